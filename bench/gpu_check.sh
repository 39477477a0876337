#!/usr/bin/env bash
# kvroom on one GPU host, end to end, in under six minutes (docs/gpu.md says how to read it):
#
#   bash bench/gpu_check.sh             # on a host with CUDA GPUs
#   bash bench/gpu_check.sh --plan      # what it would run on this host, without running it
#   bash bench/gpu_check.sh --dry-run   # the same flow on a CPU host (small sizes)
#
# The runs depend on the GPUs torch sees:
#   one GPU    both nodes on cuda:0, in separate processes with separate allocations:
#              tcp (the engine's TCP path from GPU memory to GPU memory) and nvlink
#              (MC_INTRANODE_NVLINK: CUDA IPC between two processes on one device);
#   2 or more  prefill on cuda:0, decode on cuda:1: tcp and nvlink;
#   and rdma besides, where /sys/class/infiniband shows a device.
# Each transport starts with a probe: the raw engine writes a few MiB between two processes
# holding the same kind of memory, the receiver checks the bytes, and the engine's own log
# must name the transport asked for. A transport the engine refuses, or replaces by another,
# is printed as `SKIP <transport>: <the engine's words>` and never counts as a pass.
#
# Each run that passed its probe starts a bootstrap, a prefill and a decode node as real
# processes (a join token and CURVE keys, as launcher/local_stack.py's LocalStack gives them;
# --verify-kv on both nodes, so page digests are computed where the pages live) with KV
# pools on the run's devices, aux slots in CPU memory, and the synthetic KV of an 8B-class
# model (32 layers, 8 KV heads of 128, bfloat16: 128 KiB a token). Then:
#   1. a first round of rooms, untimed, then --rooms rooms of --tokens tokens through
#      POST /rooms, --in-flight at a time: every room must end SUCCESS; aggregate GB/s;
#   2. rooms of each --sizes (MiB) one at a time beside the raw engine writing the same bytes
#      in the same writes between the same kinds of buffers, in turn (A B B A): GB/s of both
#      and the median of each stage of a room, as `python -m bench` prints them; each of
#      these rooms must have its done+aux taken after its writes completed;
#   3. a tiny random Llama (launcher/tiny_model.py) on the same devices (bfloat16 on CUDA):
#      every room SUCCESS and its tokens equal to generate(do_sample=False) on the same device.
# One SUMMARY line per run, one SIZE line per room size, one RESULT line at the end.
#
# Exit status: 0 when every run that passed its probe passed, 1 when one failed, 77 when the
# host could run nothing (no CUDA GPU), 2 for a bad option. The services' logs stay in the
# printed directory when a run fails (or with --keep-logs).
set -euo pipefail

usage() {
  cat <<'EOF'
usage: bash bench/gpu_check.sh [--plan] [--dry-run] [--gpus N] [--rooms N] [--tokens N]
                               [--in-flight N] [--sizes MiB,...] [--timed-rooms N] [--no-model]
                               [--rdma-devices mlx5_0,...] [--keep-logs]
  --plan           print the runs this host would get, then stop (no GPU needed)
  --dry-run        CPU host: --device cpu, tcp (and the nvlink probe), small sizes
  --gpus N         plan as if N CUDA GPUs were visible (default: as many as torch sees)
  --rooms N        rooms checked for SUCCESS, --in-flight at a time (default 64; dry run 8)
  --tokens N       prompt tokens of those rooms (default 1024; dry run 64)
  --in-flight N    rooms in flight in that phase (default 8; dry run 4)
  --sizes LIST     KV of the rooms timed against the raw engine, MiB (default 1,16,256; dry run 1,4)
  --timed-rooms N  rooms of each size timed, as many raw writes beside them (default 8; dry run 4)
  --no-model       leave out the Hugging Face model's rooms
  --rdma-devices   RDMA devices for the rdma run (default: every HCA the engine finds)
  --keep-logs      keep the services' logs even when every check passed
EOF
}

cd "$(dirname "$0")/.."
if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi

PLAN=0 DRY_RUN=0 GPUS="" ROOMS="" TOKENS="" IN_FLIGHT="" SIZES="" TIMED="" MODEL=1 RDMA_DEVICES="" KEEP_LOGS=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --plan) PLAN=1 ;;
    --dry-run) DRY_RUN=1 ;;
    --gpus) GPUS="$2"; shift ;;
    --rooms) ROOMS="$2"; shift ;;
    --tokens) TOKENS="$2"; shift ;;
    --in-flight) IN_FLIGHT="$2"; shift ;;
    --sizes) SIZES="$2"; shift ;;
    --timed-rooms) TIMED="$2"; shift ;;
    --no-model) MODEL=0 ;;
    --rdma-devices) RDMA_DEVICES="$2"; shift ;;
    --keep-logs) KEEP_LOGS=1 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu_check: unknown option $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
if [[ $DRY_RUN == 1 ]]; then
  ROOMS=${ROOMS:-8} TOKENS=${TOKENS:-64} IN_FLIGHT=${IN_FLIGHT:-4} SIZES=${SIZES:-1,4} TIMED=${TIMED:-4}
else
  ROOMS=${ROOMS:-64} TOKENS=${TOKENS:-1024} IN_FLIGHT=${IN_FLIGHT:-8} SIZES=${SIZES:-1,16,256} TIMED=${TIMED:-8}
fi
if [[ -z $GPUS && $DRY_RUN == 0 ]]; then
  # Counted without starting CUDA; a CPU build of torch says 0.
  GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)
  if [[ $GPUS == 0 ]] && command -v nvidia-smi >/dev/null; then
    echo "note: nvidia-smi is here but torch sees no GPU: is $PY's torch a CPU build?"
  fi
fi
RDMA=0
if compgen -G "/sys/class/infiniband/*" >/dev/null; then RDMA=1; fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvroom-gpu-check.XXXXXX")
STATUS=0
cleanup() {
  if [[ $PLAN == 0 ]] && [[ $STATUS == 1 || $KEEP_LOGS == 1 ]]; then echo "logs: $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT

# The check itself, in Python. A file rather than `python -`, so that the raw engine's
# spawned processes can import it.
cat >"$WORK/gpu_check.py" <<'PYTHON'
"""bench/gpu_check.sh in Python: the plan for this host, and each run of it."""

import argparse
import concurrent.futures
import contextlib
import importlib.metadata
import multiprocessing as mp
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

MIB = 1 << 20
# A few MiB written and checked before anything else runs on a transport.
PROBE_BYTES = 4 * MIB
# Seconds any one answer from a raw engine process may take (a refused CUDA IPC may hang).
RAW_TIMEOUT_S = 60.0
# The engine's own information lines once it installed a transport (its C++ log, on stderr,
# glog's format: I, date, time, thread, file:line]). Its error lines name transports too.
ENGINE_INFO = re.compile(r"^I\d{4} [\d:.]+ +\d+ \S+\] (.*)$")
INSTALLED = {
    "nvlink": re.compile(r"Using Intra-Node NVLink transport"),
    "rdma": re.compile(r"Using RDMA transport|installTransport, type=rdma"),
    "tcp": re.compile(r"TCP transport|TcpTransport: listen"),
}
# The engine's error lines (glog: E or F, date, time, thread, file:line]); the first is
# logged on every start and says nothing.
ENGINE_ERROR = re.compile(r"^[EF]\d{4} [\d:.]+ +\d+ (\S+\] .*)$", re.M)
NOT_A_REASON = ("Local segment descriptor not found",)
# Prompts of the model's rooms: one token, several pages, and some in between.
PROMPTS = [
    "a",
    "Hello, kvroom!",
    "The quick brown fox jumps over the lazy dog.",
    "long prompt spanning many pages " * 12,
    *[f"room number {i}: " + "xyz " * i for i in range(4)],
]
MODEL_NEW_TOKENS = 16


@dataclass(frozen=True)
class Run:
    transport: str
    device: str  # cpu or cuda
    prefill_gpu: int = 0
    decode_gpu: int = 0

    @property
    def name(self) -> str:
        return f"{self.transport}/{self.device}"

    def where(self, side: str) -> str:
        if self.device == "cpu":
            return "cpu"
        return f"cuda:{self.prefill_gpu if side == 'prefill' else self.decode_gpu}"


def plan(gpus: int, rdma: bool, dry_run: bool) -> tuple[str, list[Run], list[str]]:
    """The mode, the runs and a SKIP line for each transport left out, for a host with
    ``gpus`` CUDA devices and RDMA devices or not. A run is still skipped later if its
    probe finds the engine refuses it."""
    if dry_run:
        # nvlink on CPU memory: the probe shows what the engine does with a transport it lacks.
        return "dry run (CPU memory)", [Run("tcp", "cpu"), Run("nvlink", "cpu")], []
    if gpus == 0:
        skips = [f"SKIP {t}: no CUDA GPU visible to torch" for t in ("tcp", "nvlink", "rdma")]
        return "no GPU", [], skips
    if gpus == 1:
        mode = "one GPU: both nodes on cuda:0, separate processes, separate allocations"
        pair = (0, 0)
    else:
        mode = f"{gpus} GPUs: prefill on cuda:0, decode on cuda:1"
        pair = (0, 1)
    runs = [Run("tcp", "cuda", *pair), Run("nvlink", "cuda", *pair)]
    skips = []
    if rdma:
        runs.append(Run("rdma", "cuda", *pair))
    else:
        skips.append("SKIP rdma: no RDMA device under /sys/class/infiniband")
    return mode, runs, skips


def installed_transports(log_text: str) -> dict[str, str]:
    """The transports an engine's log says it installed, each with the line that says so
    (its "using ... transport" line where it wrote one)."""
    found: dict[str, str] = {}
    for line in log_text.splitlines():
        if not (info := ENGINE_INFO.match(line)) or "for RPC" in line:  # its handshake's, not the data's
            continue
        said = info[1].strip()
        for transport, pattern in INSTALLED.items():
            if not pattern.search(said):
                continue
            if transport not in found or ("sing " in said and "sing " not in found[transport]):
                found[transport] = said
    return found


def engine_reason(log_text: str) -> str | None:
    """The engine's last error line that says something."""
    lines = [m for m in ENGINE_ERROR.findall(log_text) if not any(n in m for n in NOT_A_REASON)]
    return lines[-1] if lines else None


def refusal(asked: str, logs: list[str], error: str | None) -> str | None:
    """Why the engine did not give ``asked``, in its own words; None when it did.

    ``logs`` are its processes' logs, ``error`` what failed on our side (None if nothing)."""
    text = "\n".join(logs)
    if error is not None:
        said = engine_reason(text)
        return f"{error}; the engine logged: {said}" if said else error
    installed = [installed_transports(log) for log in logs]
    if any(asked not in got and got for got in installed):
        other = next(got for got in installed if asked not in got and got)
        name, line = next(iter(other.items()))
        return f"the engine installed {name} instead: {line!r}"
    return None


# -- the raw engine between two processes ------------------------------------------------


def buffer(nbytes: int, device: str, fill: int):
    import torch

    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    out = torch.full((nbytes,), fill, dtype=torch.uint8, device=device)
    if out.is_cuda:
        torch.cuda.synchronize()  # filled before the engine reads or the peer checks it
    return out


def quiet(log: Path) -> None:
    """The engine logs to stderr from C++: a raw process's output goes to its own log file."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)


def raw_receiver(nbytes: int, device: str, transport: str, rdma: str, log: Path, conn: Connection) -> None:
    quiet(log)
    try:
        from shared.kv.transfer import MooncakeEngine

        buf = buffer(nbytes, device, 0)
        engine = MooncakeEngine("127.0.0.1", transport, rdma)
        engine.register(buf.data_ptr(), nbytes)
        conn.send(("ready", (engine.session_id, buf.data_ptr())))
    except Exception as exc:
        conn.send(("error", f"receiver: {exc}"))
        return
    while (job := conn.recv()) is not None:  # hold the memory until told to stop
        if buf.is_cuda:
            import torch

            torch.cuda.synchronize()
        conn.send(("ok", bool(buf[:job].eq(1).all())))  # did the first ``job`` bytes land?


def raw_sender(
    nbytes: int, device: str, transport: str, rdma: str, log: Path, peer, conn: Connection
) -> None:
    quiet(log)
    try:
        from shared.kv.transfer import MooncakeEngine

        session, dst = peer
        buf = buffer(nbytes, device, 1)
        engine = MooncakeEngine("127.0.0.1", transport, rdma)
        engine.register(buf.data_ptr(), nbytes)
        conn.send(("ready", None))
    except Exception as exc:
        conn.send(("error", f"sender: {exc}"))
        return
    src = buf.data_ptr()
    while (job := conn.recv()) is not None:
        total, entries = job
        size = total // entries
        writes = [(src + i * size, dst + i * size, size) for i in range(entries)]
        started = time.perf_counter()
        try:
            # Blocking on rdma and nvlink, submitted and polled on tcp: as the nodes wait.
            engine.write(session, writes)
        except Exception as exc:
            conn.send(("error", f"write of {total} bytes in {entries}: {exc}"))
            continue
        conn.send(("ok", time.perf_counter() - started))


class RawFailed(Exception):
    pass


class RawPair:
    """Two processes, each with its own engine and ``nbytes`` of memory on its own device."""

    def __init__(self, nbytes: int, run: Run, rdma: str, log_dir: Path):
        ctx = mp.get_context("spawn")  # a fresh CUDA context in each
        self.logs = [log_dir / "raw-receiver.log", log_dir / "raw-sender.log"]
        self.procs: list = []
        self.conns: list[Connection] = []
        try:
            self._start(ctx, raw_receiver, (nbytes, run.where("decode"), run.transport, rdma, self.logs[0]))
            peer = self._ask(0, None)
            sender = (nbytes, run.where("prefill"), run.transport, rdma, self.logs[1], peer)
            self._start(ctx, raw_sender, sender)
            self._ask(1, None)
        except RawFailed:
            self.close()
            raise

    def _start(self, ctx, target, args) -> None:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(*args, child), daemon=True)
        proc.start()
        self.procs.append(proc)
        self.conns.append(parent)

    def _ask(self, which: int, job):
        """Send ``job`` (None: only wait) to one process and return its answer."""
        conn, proc = self.conns[which], self.procs[which]
        if job is not None:
            conn.send(job)
        deadline = time.monotonic() + RAW_TIMEOUT_S
        while not conn.poll(0.2):
            if not proc.is_alive():
                raise RawFailed(f"the raw engine process exited with status {proc.exitcode}")
            if time.monotonic() > deadline:
                raise RawFailed(f"no answer from the raw engine in {RAW_TIMEOUT_S:.0f}s")
        kind, value = conn.recv()
        if kind == "error":
            raise RawFailed(value)
        return value

    def write(self, total: int, entries: int) -> float:
        return float(self._ask(1, (total, entries)))

    def landed(self, nbytes: int) -> bool:
        return bool(self._ask(0, nbytes))

    def log_text(self) -> list[str]:
        return [p.read_text(errors="replace") if p.exists() else "" for p in self.logs]

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):  # the process may have died already
                conn.send(None)
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def probe(pair: RawPair) -> str | None:
    """Write PROBE_BYTES in 4 writes and check the receiver holds them; None, or what failed."""
    try:
        pair.write(PROBE_BYTES, 4)
    except RawFailed as exc:
        return str(exc)
    if not pair.landed(PROBE_BYTES):
        return "the engine reported the write done, but the receiver does not hold the bytes"
    return None


# -- the rooms -------------------------------------------------------------------------


def run_room(url: str, ids: list[int], new_tokens: int) -> dict:
    import httpx

    with httpx.Client(base_url=url, timeout=90.0) as client:
        created = client.post(
            "/rooms", params={"wait": 60}, json={"input_ids": ids, "max_new_tokens": new_tokens}
        )
        created.raise_for_status()
        body = created.json()
        while not body["finished"]:
            body = client.get(f"/rooms/{body['room']}", params={"wait": 60}).json()
        return body


def not_success(room: dict) -> str | None:
    return None if room["state"] == "SUCCESS" else f"{room['room']} {room['state']} {room.get('reason')}"


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def gpu_memory(pids: list[int]) -> str:
    """What nvidia-smi says the given processes hold on the GPU, or why it cannot say."""
    if not shutil.which("nvidia-smi"):
        return "nvidia-smi not found"
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    held = {
        int(p): m.strip() for p, m in (line.split(",", 1) for line in out.stdout.splitlines() if "," in line)
    }
    return ", ".join(f"pid {p}: {held.get(p, 'none seen')}" for p in pids)


def node_pids(service) -> list[int]:
    """A node's process and its rank processes."""
    pids = [service.proc.pid]
    with contextlib.suppress(Exception):
        pids += [r["pid"] for r in service.health()["ranks"] if r.get("pid") and r["pid"] not in pids]
    return pids


def synthetic(args: argparse.Namespace, run: Run, raw: RawPair, log: list[str]) -> dict:
    """Rooms of synthetic KV on ``run``: every one SUCCESS, then each size against the raw engine."""
    from bench.__main__ import BIG, Bench, interleaved, layout_of, node_args, stages_ms
    from launcher.local_stack import LocalStack

    layout = layout_of(BIG)  # the bench's 8B-class layout, one token a page
    sizes = [int(s) * MIB for s in args.sizes.split(",")]
    tokens = [size // layout.page_bytes for size in sizes]  # one token a page
    pages = max(args.in_flight * (args.tokens + 1), 2 * (max(tokens) + 1)) + 64
    flags = ["--transport", run.transport, "--device", run.device]
    if run.transport == "rdma" and args.rdma_devices:
        flags += ["--rdma-devices", args.rdma_devices]

    def node(side: str) -> list[str]:
        gpus = ["--gpus", run.where(side).split(":")[1]] if run.device == "cuda" else []
        return node_args(BIG, pages * layout.page_bytes, *flags, *gpus)

    stack = LocalStack(
        args.log_dir / "synthetic",
        bootstrap_args=["--log-level", "WARNING", "--max-prompt-tokens", str(max(args.tokens, *tokens) + 64)],
        verify_kv=True,  # every page digested where it lives, on both sides, before SUCCESS
    )
    out: dict = {"failed": [], "sizes": []}
    try:
        started = time.monotonic()
        prefill, decode = stack.start(node("prefill"), node("decode"))
        say(
            run,
            f"services registered in {time.monotonic() - started:.1f}s; KV pools of {pages} pages "
            f"({pages * layout.page_bytes / MIB:.0f} MiB) on {run.where('prefill')} "
            f"and {run.where('decode')}; aux slots in CPU memory",
        )
        if run.device == "cuda":
            say(
                run,
                f"GPU memory held: prefill {gpu_memory(node_pids(prefill))}; "
                f"decode {gpu_memory(node_pids(decode))}",
            )
        engines = [s.log_path.read_text(errors="replace") for s in (prefill, decode)]
        if problem := refusal(run.transport, engines, None):
            out["failed"].append(f"nodes' engines: {problem}")
            return out
        said = [installed_transports(t).get(run.transport) for t in engines]
        out["engine"] = said[0] or said[1] or "(its log names no transport)"

        def batch(first: int, count: int) -> list[dict]:
            ids = [[65 + (first + i) % 26] * args.tokens for i in range(count)]  # not read by the model
            with concurrent.futures.ThreadPoolExecutor(args.in_flight) as pool:
                rooms = list(pool.map(lambda x: run_room(stack.bootstrap.url, x, 1), ids))
            out["failed"].extend(filter(None, map(not_success, rooms)))
            return rooms

        # A first round, untimed: it connects the engines, loads the digest kernels, touches pages.
        batch(0, args.in_flight)
        started = time.perf_counter()
        rooms = batch(args.in_flight, args.rooms)
        wall = time.perf_counter() - started
        moved = args.rooms * -(-args.tokens // layout.page_size) * layout.page_bytes
        out["rooms"] = args.in_flight + args.rooms
        out["aggregate"] = gbps(moved, wall)
        ok = sum(r["state"] == "SUCCESS" for r in rooms)
        say(
            run,
            f"{ok}/{args.rooms} rooms of {args.tokens} tokens SUCCESS, {args.in_flight} in flight: "
            f"{moved / MIB:.0f} MiB in {wall:.2f}s, {out['aggregate']:.2f} GB/s aggregate",
        )
        if out["failed"]:
            return out

        with stack.client() as client:
            for size, room_tokens in zip(sizes, tokens, strict=True):
                first = Bench.room(client, room_tokens)
                total, count = int(first["bytes_written"]), int(first["engine_writes"])
                raw.write(total, count)  # the raw side's first write of this shape, untimed
                samples = interleaved(
                    {
                        "kvroom": lambda t=room_tokens: Bench.room(client, t),
                        "raw": lambda m=total, c=count: raw.write(m, c),
                    },
                    args.timed_rooms,
                )
                out["rooms"] += 1 + args.timed_rooms
                # done+aux leaves the prefill after its writes completed, and SUCCESS follows it.
                late = [
                    t
                    for t in samples["kvroom"]
                    if not t["write_done_at"] <= t["done_received_at"] <= t["success_at"]
                ]
                if late:
                    out["failed"].append(
                        f"{len(late)} rooms of {size // MIB} MiB: done+aux before the writes ended"
                    )
                kv = statistics.median(t["request_to_success_s"] for t in samples["kvroom"])
                rw = statistics.median(samples["raw"])
                stages = stages_ms(samples["kvroom"])
                out["sizes"].append((size, total, count, gbps(total, kv), gbps(total, rw), rw / kv, stages))
    except Exception as exc:
        out["failed"].append(f"{type(exc).__name__}: {exc}")
        log.append(traceback.format_exc())
    finally:
        stack.stop()
    return out


def model_check(args: argparse.Namespace, run: Run, log: list[str]) -> dict:
    """A tiny random Llama on ``run``'s devices: each room's tokens against generate() on the same device."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from launcher.local_stack import LocalStack
    from launcher.tiny_model import write_tiny_model

    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # the check's output stays one line a fact
    dtype = "bfloat16" if run.device == "cuda" else "float32"
    device = run.where("decode")
    path = write_tiny_model("llama", args.log_dir / "tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    expected = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            full = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=MODEL_NEW_TOKENS, do_sample=False
            )
            expected.append(full[0, len(ids) :].tolist())
    del model

    flags = ["--model", str(path), "--page-size", "4", "--dtype", dtype, "--log-level", "WARNING"]
    flags += ["--transport", run.transport, "--device", run.device]
    if run.transport == "rdma" and args.rdma_devices:
        flags += ["--rdma-devices", args.rdma_devices]

    def gpus(side: str) -> list[str]:
        return ["--gpus", run.where(side).split(":")[1]] if run.device == "cuda" else []

    stack = LocalStack(
        args.log_dir / "model", bootstrap_args=["--log-level", "WARNING", "--model", str(path)]
    )
    out: dict = {"failed": [], "equal": 0, "rooms": len(prompts), "name": f"tiny-llama/{dtype}"}
    try:
        stack.start([*flags, *gpus("prefill")], [*flags, *gpus("decode")])
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            rooms = list(pool.map(lambda ids: run_room(stack.bootstrap.url, ids, MODEL_NEW_TOKENS), prompts))
        for room, want in zip(rooms, expected, strict=True):
            if problem := not_success(room):
                out["failed"].append(problem)
            elif room["output_ids"] != want:
                out["failed"].append(f"{room['room']}: {room['output_ids']} where generate() gave {want}")
            else:
                out["equal"] += 1
    except Exception as exc:
        out["failed"].append(f"{type(exc).__name__}: {exc}")
        log.append(traceback.format_exc())
    finally:
        stack.stop()
    say(
        run,
        f"{out['name']} on {device}: {out['equal']}/{out['rooms']} rooms SUCCESS with the tokens of "
        f"generate(do_sample=False) on {device}",
    )
    return out


def say(run: Run, line: str) -> None:
    print(f"[{run.name}] {line}", flush=True)


def one_run(args: argparse.Namespace, run: Run) -> str:
    """``run`` from its probe to its SUMMARY: "passed", "skipped" or "failed"."""
    log_dir = args.log_dir / run.transport
    log_dir.mkdir(parents=True, exist_ok=True)
    args = argparse.Namespace(**{**vars(args), "log_dir": log_dir})
    say(run, f"prefill on {run.where('prefill')}, decode on {run.where('decode')}; logs in {log_dir}")
    largest = max(int(s) for s in args.sizes.split(",")) * MIB
    raw = None
    try:
        try:
            raw = RawPair(max(largest, PROBE_BYTES), run, args.rdma_devices, log_dir)
            error = probe(raw)
        except RawFailed as exc:
            error = str(exc)
        logs = raw.log_text() if raw else [p.read_text(errors="replace") for p in log_dir.glob("raw-*.log")]
        if reason := refusal(run.transport, logs, error):
            print(f"SKIP {run.transport}: {reason}", flush=True)
            return "skipped"
        said = next((t[run.transport] for t in map(installed_transports, logs) if run.transport in t), None)
        say(
            run,
            f"probe: {PROBE_BYTES // MIB} MiB written and found at the receiver; the engine says: "
            f"{said or '(its log names no transport)'}",
        )
        trace: list[str] = []
        synth = synthetic(args, run, raw, trace)
        for size, total, count, kv, rw, ratio, stages in synth["sizes"]:
            print(
                f"SIZE transport={run.transport} device={run.device} room={size // MIB}MiB "
                f"moved={total / MIB:.1f}MiB writes={count} kvroom={kv:.2f} GB/s raw={rw:.2f} GB/s "
                f"kvroom/raw={ratio:.3f} stages_ms " + " ".join(f"{k}={v:.3f}" for k, v in stages.items()),
                flush=True,
            )
        model = model_check(args, run, trace) if args.model and not synth["failed"] else None
        failed = synth["failed"] + (model["failed"] if model else [])
        rooms = synth.get("rooms", 0) + (model["rooms"] if model else 0)
        model_part = (
            f"model={model['name']} equal_generate={model['equal']}/{model['rooms']}"
            if model
            else "model=off"
        )
        print(
            f"SUMMARY transport={run.transport} device={run.device} prefill={run.where('prefill')} "
            f"decode={run.where('decode')} rooms={rooms - len(failed)}/{rooms} SUCCESS verify_kv=on "
            f"aggregate={synth.get('aggregate', float('nan')):.2f} GB/s ({args.in_flight} in flight) "
            f"{model_part} engine={synth.get('engine', '?')!r}",
            flush=True,
        )
        if failed:
            say(run, f"not passed: {failed[:8]}")
            for text in trace:
                print(text, file=sys.stderr)
            return "failed"
        return "passed"
    finally:
        if raw is not None:
            raw.close()


def versions() -> str:
    import torch
    import transformers

    engine = importlib.metadata.packages_distributions().get("mooncake", ["(not installed)"])
    names = ", ".join(f"{d} {importlib.metadata.version(d)}" for d in engine if d != "(not installed)")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() and torch.cuda.device_count() else "none"
    return (
        f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"transformers {transformers.__version__}, engine {names or engine[0]}, GPU {gpu}"
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", action="store_true")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--rdma", type=int, choices=[0, 1], required=True)
    parser.add_argument("--rooms", type=int, required=True)
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--in-flight", type=int, required=True)
    parser.add_argument("--sizes", required=True)
    parser.add_argument("--timed-rooms", type=int, required=True)
    parser.add_argument("--model", type=int, choices=[0, 1], required=True)
    parser.add_argument("--rdma-devices", default="")
    parser.add_argument("--log-dir", type=Path, required=True)
    args = parser.parse_args()

    mode, runs, skips = plan(args.gpus, bool(args.rdma), args.dry_run)
    print(f"mode: {mode}", flush=True)
    for run in runs:
        print(
            f"PLAN {run.transport} {run.where('prefill')} -> {run.where('decode')}: probe, "
            f"{args.in_flight}+{args.rooms} rooms of {args.tokens} tokens, rooms of {args.sizes} MiB "
            f"x{args.timed_rooms} against the raw engine"
            + (", tiny-llama against generate()" if args.model else ""),
            flush=True,
        )
    for line in skips:
        print(line, flush=True)
    if args.plan or not runs:
        return 0 if runs else 77
    try:
        print(f"host: {versions()}", flush=True)
        import mooncake.engine  # noqa: F401  (a missing system library shows here, not in a node's log)
    except Exception as exc:
        print(f"FAILED: kvroom's stack does not load here: {type(exc).__name__}: {exc}", flush=True)
        return 1
    outcomes = {run.transport: one_run(args, run) for run in runs}
    by = {k: [t for t, o in outcomes.items() if o == k] for k in ("passed", "skipped", "failed")}
    print("RESULT " + " ".join(f"{k}={','.join(v) or '-'}" for k, v in by.items()), flush=True)
    if by["failed"]:
        return 1
    return 0 if by["passed"] else 77


if __name__ == "__main__":
    sys.exit(main())
PYTHON

set +e
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 "$PY" "$WORK/gpu_check.py" \
  $([[ $PLAN == 1 ]] && echo --plan) $([[ $DRY_RUN == 1 ]] && echo --dry-run) \
  --gpus "${GPUS:-0}" --rdma "$RDMA" --rooms "$ROOMS" --tokens "$TOKENS" --in-flight "$IN_FLIGHT" \
  --sizes "$SIZES" --timed-rooms "$TIMED" --model "$MODEL" --rdma-devices "$RDMA_DEVICES" --log-dir "$WORK"
STATUS=$?
set -e
if [[ $STATUS == 1 ]]; then echo "FAILED: see the logs below $WORK"; fi
exit $STATUS
