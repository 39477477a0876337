"""A small deterministic decoder-only transformer with paged attention.

Weights come from a fixed seed and tokens are bytes, so every node builds the
same model with nothing to download. Prefill writes K and V into pages of a
KVPool; decode reads them back from pages. A disaggregated run (prefill on one
node, pages moved, decode on another) must therefore give exactly the tokens of
``generate`` below, which runs both halves in one process.

    python -m shared.model --prompt TEXT --max-new-tokens N
"""

import argparse
import json
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.kv_layout import KVLayout
from shared.kv_pool import KVPool


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    num_layers: int = 2
    hidden: int = 64
    num_heads: int = 4
    head_dim: int = 16
    ffn: int = 128
    max_positions: int = 8192
    seed: int = 1234

    def kv_layout(self, page_size: int) -> KVLayout:
        return KVLayout(self.num_layers, self.num_heads, self.head_dim, page_size, "float32")


def configure_determinism() -> None:
    """One intra-op thread everywhere, so reductions run in the same order in every process."""
    torch.set_num_threads(1)


def encode_text(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode_text(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


class ReferenceModel:
    def __init__(self, config: ModelConfig | None = None, device: str = "cpu"):
        """Weights are drawn on the CPU from the seed, then moved: the same on every host."""
        self.config = c = config or ModelConfig()
        self.device = torch.device(device)
        g = torch.Generator().manual_seed(c.seed)

        def weight(*shape: int, fan_in: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / math.sqrt(fan_in)

        inner = c.num_heads * c.head_dim
        self.embed = torch.randn(c.vocab_size, c.hidden, generator=g)
        self.pos = torch.randn(c.max_positions, c.hidden, generator=g) * 0.5
        self.layers = [
            {
                "qkv": weight(c.hidden, 3 * inner, fan_in=c.hidden),
                "out": weight(inner, c.hidden, fan_in=inner),
                "up": weight(c.hidden, c.ffn, fan_in=c.hidden),
                "down": weight(c.ffn, c.hidden, fan_in=c.ffn),
            }
            for _ in range(c.num_layers)
        ]
        self.head = weight(c.hidden, c.vocab_size, fan_in=c.hidden)
        self._printable = torch.zeros(c.vocab_size, dtype=torch.bool)
        self._printable[32:127] = True
        for name in ("embed", "pos", "head", "_printable"):
            setattr(self, name, getattr(self, name).to(self.device))
        self.layers = [{k: w.to(self.device) for k, w in layer.items()} for layer in self.layers]

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def _qkv(self, layer: dict[str, torch.Tensor], h: torch.Tensor) -> list[torch.Tensor]:
        c = self.config
        qkv = self._norm(h) @ layer["qkv"]
        return [t.reshape(-1, c.num_heads, c.head_dim) for t in qkv.chunk(3, dim=-1)]

    def _finish_layer(
        self, layer: dict[str, torch.Tensor], h: torch.Tensor, attn: torch.Tensor
    ) -> torch.Tensor:
        h = h + attn.reshape(attn.shape[0], -1) @ layer["out"]
        return h + F.gelu(self._norm(h) @ layer["up"]) @ layer["down"]

    def _next_token(self, h_last: torch.Tensor) -> tuple[int, float]:
        # Output is limited to printable ASCII so demo texts stay readable.
        logits = (self._norm(h_last) @ self.head).masked_fill(~self._printable, float("-inf"))
        logprobs = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logprobs))
        return token, float(logprobs[token])

    @staticmethod
    def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        # [T, H, D] -> [H, T, D] for batched matmul over heads
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        scores = (q @ k.transpose(1, 2)) / math.sqrt(q.shape[-1])
        if causal:
            t = scores.shape[-1]
            mask = torch.ones(t, t, dtype=torch.bool, device=scores.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        return (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)

    @torch.inference_mode()
    def prefill(self, pool: KVPool, pages: list[int], input_ids: list[int]) -> tuple[int, float]:
        """Write the prompt's KV into ``pages``; return the first output token and its logprob."""
        n = len(input_ids)
        ps = pool.layout.page_size
        if len(pages) < pool.layout.pages_for(n):
            raise ValueError(f"{n} tokens need {pool.layout.pages_for(n)} pages, got {len(pages)}")
        h = self.embed[torch.tensor(input_ids, device=self.device)] + self.pos[:n]
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, h)
            for i, page in enumerate(pages[: pool.layout.pages_for(n)]):
                start, end = i * ps, min(n, (i + 1) * ps)
                pool.data[page, li, 0, : end - start] = k[start:end]
                pool.data[page, li, 1, : end - start] = v[start:end]
            h = self._finish_layer(layer, h, self._attend(q, k, v, causal=True))
        return self._next_token(h[-1])

    @torch.inference_mode()
    def decode_step(self, pool: KVPool, pages: list[int], position: int, token: int) -> tuple[int, float]:
        """Feed ``token`` at ``position`` over the KV already in ``pages``."""
        ps = pool.layout.page_size
        page, slot = pages[position // ps], position % ps
        used = torch.tensor(pages[: position // ps + 1], device=self.device)
        h = self.embed[token : token + 1] + self.pos[position : position + 1]
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, h)
            pool.data[page, li, 0, slot] = k[0]
            pool.data[page, li, 1, slot] = v[0]
            shape = (-1, *pool.data.shape[-2:])
            keys = pool.data[used, li, 0].reshape(shape)[: position + 1]
            values = pool.data[used, li, 1].reshape(shape)[: position + 1]
            h = self._finish_layer(layer, h, self._attend(q, keys, values, causal=False))
        return self._next_token(h[0])

    def decode(
        self, pool: KVPool, pages: list[int], prompt_len: int, first_token: int, max_new_tokens: int
    ) -> list[int]:
        """Continue from the prefill's first token; return all ``max_new_tokens`` output ids."""
        out = [first_token]
        for position in range(prompt_len, prompt_len + max_new_tokens - 1):
            token, _ = self.decode_step(pool, pages, position, out[-1])
            out.append(token)
        return out


def pages_needed(layout: KVLayout, prompt_len: int, max_new_tokens: int) -> int:
    """Pages a decode node holds for a room: the prompt plus every token fed back."""
    return layout.pages_for(prompt_len + max_new_tokens - 1)


def generate(
    model: ReferenceModel, input_ids: list[int], max_new_tokens: int, page_size: int = 16
) -> list[int]:
    """Prefill and decode in one process: the reference every disaggregated run must equal."""
    layout = model.config.kv_layout(page_size)
    n = pages_needed(layout, len(input_ids), max_new_tokens)
    pool = KVPool(layout, n, str(model.device))
    pages = pool.alloc(n)
    first, _ = model.prefill(pool, pages, input_ids)
    return model.decode(pool, pages, len(input_ids), first, max_new_tokens)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m shared.model", description=__doc__.split("\n")[0])
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args(argv)
    configure_determinism()
    model = ReferenceModel(device=args.device)
    ids = generate(model, encode_text(args.prompt), args.max_new_tokens, args.page_size)
    print(json.dumps({"output_ids": ids, "text": decode_text(ids)}))


if __name__ == "__main__":
    main()
