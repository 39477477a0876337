"""The demo workload: start the three services on 127.0.0.1 over TCP, run rooms, check every output.

    python -m launcher.demo [--rooms 16] [--max-new-tokens 24] [--prefill-tp N] [--decode-tp N]
                             [--model reference|tiny-llama|tiny-qwen2|DIR] [--log-dir DIR]

``tiny-llama`` and ``tiny-qwen2`` are small random-initialised Hugging Face
checkpoints made on the fly (``python -m launcher.tiny_model``). Exits 0 only if
every room reached SUCCESS with exactly the tokens of a single-process,
single-rank run of the same model on the same prompt: the reference model's
``generate``, or transformers' ``generate(do_sample=False)``.
"""

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from launcher.local_stack import LocalStack
from shared.models.reference import ReferenceModel, configure_determinism, encode_text, generate

PROMPTS = [
    "K",
    "Hello, kvroom!",
    "The quick brown fox jumps over the lazy dog.",
    "Prefill computes the KV cache; decode continues from it.",
    "A room is SUCCESS only after its aux metadata has landed and been validated.",
    "0 is never a valid room id.",
    "Ranks agree: the room's state is the minimum over ranks.",
    "TCP on a laptop, RDMA across hosts, NVLink inside one.",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit.",
    "kv" * 40,
    "Pages of sixteen tokens, coalesced into runs before they move.",
    "What does the decode node do while it waits?",
    "Metrics for Prometheus, health for curl.",
    "Transfer, then done and aux in one message.",
    " ".join(f"token{i}" for i in range(60)),
    "The long prompt spans many pages: " + "abcdefghijklmnopqrstuvwxyz" * 40,
]


def prompts(n: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" #{i}") for i in range(n)]


async def run_rooms(base_url: str, texts: list[str], max_new_tokens: int) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120.0) as client:
        created = await asyncio.gather(
            *(client.post("/rooms", json={"prompt": t, "max_new_tokens": max_new_tokens}) for t in texts)
        )
        for resp in created:
            resp.raise_for_status()
        rooms = [resp.json()["room"] for resp in created]
        done = 0

        async def wait(room: int) -> dict[str, Any]:
            nonlocal done
            while True:
                body: dict[str, Any] = (await client.get(f"/rooms/{room}", params={"wait": 30})).json()
                if body["finished"]:
                    done += 1
                    print(
                        f"[{done:3d}/{len(rooms)}] room {room} {body['state']}"
                        f"{' ' + body['reason'] if body['reason'] else ''}",
                        flush=True,
                    )
                    return body

        return await asyncio.gather(*(wait(room) for room in rooms))


def colocated(model: str, texts: list[str], max_new_tokens: int) -> list[list[int]]:
    """What one process computes for each prompt: the tokens every room must equal."""
    if model == "reference":
        reference = ReferenceModel()
        return [generate(reference, encode_text(t), max_new_tokens) for t in texts]
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for text in texts:
            ids = torch.tensor([tokenizer(text)["input_ids"]])
            full = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
            )
            out.append(full[0, ids.shape[1] :].tolist())
    return out


def model_path(model: str, log_dir: Path) -> str:
    """A model directory for ``tiny-llama`` and ``tiny-qwen2``, made now; else ``model`` as given."""
    if model.startswith("tiny-"):
        from launcher.tiny_model import write_tiny_model

        return str(write_tiny_model(model.removeprefix("tiny-"), log_dir / model))
    return model


def ms(timings: dict[str, float], key: str) -> str:
    return f"{timings[key] * 1000:8.1f}" if key in timings else "       -"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--rooms", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--prefill-tp", type=int, default=1, help="tensor-parallel ranks of the prefill node")
    parser.add_argument("--decode-tp", type=int, default=1, help="tensor-parallel ranks of the decode node")
    parser.add_argument(
        "--model",
        default="reference",
        help="reference, tiny-llama, tiny-qwen2, or a Hugging Face model directory",
    )
    parser.add_argument("--log-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    configure_determinism()
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvroom-demo-"))
    texts = prompts(args.rooms)
    model = model_path(args.model, log_dir)
    print(
        f"starting bootstrap, prefill (tp={args.prefill_tp}) and decode (tp={args.decode_tp}) on 127.0.0.1 "
        f"with model {args.model}, CURVE on, KV verified (logs in {log_dir})",
        flush=True,
    )
    with LocalStack(log_dir, bootstrap_args=["--model", model]) as stack:
        node = ["--model", model]
        stack.start([*node, "--tp-size", str(args.prefill_tp)], [*node, "--tp-size", str(args.decode_tp)])
        print(f"running {len(texts)} rooms through POST /rooms", flush=True)
        started = time.perf_counter()
        results = asyncio.run(run_rooms(stack.bootstrap.url, texts, args.max_new_tokens))
        elapsed = time.perf_counter() - started
    print(f"all rooms finished in {elapsed:.2f}s; checking against the colocated single-rank run", flush=True)
    expected_all = colocated(model, texts, args.max_new_tokens)
    print(
        f"\n{'room':>17} {'prompt':>6} {'new':>4} {'state':>8} {'prefill ms':>10} "
        f"{'xfer ms':>8} {'decode ms':>9}  match"
    )
    ok = 0
    for body, expected in zip(results, expected_all, strict=True):
        match = body["state"] == "SUCCESS" and body["output_ids"] == expected
        ok += match
        t = body["timings"]
        print(
            f"{body['room']:>17} {body['prompt_tokens']:>6} {len(body['output_ids'] or []):>4} "
            f"{body['state']:>8} {ms(t, 'prefill_s'):>10} {ms(t, 'transfer_s'):>8} "
            f"{ms(t, 'decode_s'):>9}  {'yes' if match else 'NO'}"
        )
    print(f"\n{ok}/{len(texts)} rooms SUCCESS with output equal to the colocated run")
    return 0 if ok == len(texts) else 1


if __name__ == "__main__":
    sys.exit(main())
