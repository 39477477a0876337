"""A small deterministic decoder-only transformer with paged attention, tensor-parallel.

Weights come from a fixed seed and tokens are bytes, so every node builds the
same model with nothing to download. It uses grouped-query attention (fewer
KV heads than query heads). Under tensor parallelism a rank holds a share of
the query and KV heads (a KV head replicated when there are more ranks than
KV heads), the columns of the first MLP matrix and the rows of the second;
partial results are summed over the ranks' process group. Arithmetic is in
float64, so a node of N ranks computes the tokens a node of one computes.

Prefill writes K and V into pages of a KVPool; decode reads them back from
pages. A disaggregated run (prefill on one node, pages moved, decode on
another) must therefore give exactly the tokens of ``generate`` below, which
runs both halves in one process.

    python -m shared.models.reference --prompt TEXT --max-new-tokens N
"""

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.kv.head_split import kv_heads, query_heads, split_problem
from shared.kv.layout import KVLayout
from shared.kv.pool import KVPool

AllReduce = Callable[[torch.Tensor], None]  # sums a tensor over the ranks, in place


def _alone(tensor: torch.Tensor) -> None:
    pass


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    num_layers: int = 2
    hidden: int = 64
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 8
    ffn: int = 128
    max_positions: int = 8192
    seed: int = 1234

    def kv_layout(self, page_size: int, kv_heads_held: int | None = None) -> KVLayout:
        return KVLayout(
            self.num_layers, kv_heads_held or self.num_kv_heads, self.head_dim, page_size, "float64"
        )


def configure_determinism() -> None:
    """One intra-op thread everywhere, so reductions run in the same order in every process."""
    torch.set_num_threads(1)


def encode_text(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode_text(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


class ReferenceModel:
    DTYPE = torch.float64

    def __init__(
        self,
        config: ModelConfig | None = None,
        device: str = "cpu",
        rank: int = 0,
        tp: int = 1,
        all_reduce: AllReduce = _alone,
    ):
        """Weights are drawn whole on the CPU from the seed, then sliced for ``rank`` and moved."""
        self.config = c = config or ModelConfig()
        problem = split_problem(c.num_heads, c.num_kv_heads, tp)
        if problem:
            raise ValueError(problem)
        self.device = torch.device(device)
        self.all_reduce = all_reduce
        self.q_heads = query_heads(rank, tp, c.num_heads)
        self.kv_heads = kv_heads(rank, tp, c.num_kv_heads)
        self.group_size = c.num_heads // c.num_kv_heads  # query heads per KV head
        g = torch.Generator().manual_seed(c.seed)

        def weight(*shape: int, fan_in: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) / math.sqrt(fan_in)).to(self.DTYPE)

        d, q, kv = c.head_dim, self.q_heads, self.kv_heads
        ffn_per = c.ffn // tp
        ffn = slice(rank * ffn_per, (rank + 1) * ffn_per) if c.ffn % tp == 0 else None
        if ffn is None:
            raise ValueError(f"MLP of {c.ffn} does not split over {tp} ranks")
        self.embed = torch.randn(c.vocab_size, c.hidden, generator=g).to(self.DTYPE)
        self.pos = (torch.randn(c.max_positions, c.hidden, generator=g) * 0.5).to(self.DTYPE)
        self.layers = []
        for _ in range(c.num_layers):
            wq = weight(c.hidden, c.num_heads * d, fan_in=c.hidden)
            wk = weight(c.hidden, c.num_kv_heads * d, fan_in=c.hidden)
            wv = weight(c.hidden, c.num_kv_heads * d, fan_in=c.hidden)
            wo = weight(c.num_heads * d, c.hidden, fan_in=c.num_heads * d)
            up = weight(c.hidden, c.ffn, fan_in=c.hidden)
            down = weight(c.ffn, c.hidden, fan_in=c.ffn)
            self.layers.append(
                {
                    "q": wq[:, q.start * d : q.stop * d],
                    "k": wk[:, kv.start * d : kv.stop * d],
                    "v": wv[:, kv.start * d : kv.stop * d],
                    "o": wo[q.start * d : q.stop * d],
                    "up": up[:, ffn],
                    "down": down[ffn],
                }
            )
        self.head = weight(c.hidden, c.vocab_size, fan_in=c.hidden)
        self._printable = torch.zeros(c.vocab_size, dtype=torch.bool)
        self._printable[32:127] = True
        for name in ("embed", "pos", "head", "_printable"):
            setattr(self, name, getattr(self, name).to(self.device))
        self.layers = [{k: w.contiguous().to(self.device) for k, w in layer.items()} for layer in self.layers]
        # The local KV head each local query head reads.
        self._kv_of_query = torch.tensor(
            [h // self.group_size - kv.start for h in range(q.start, q.stop)], device=self.device
        )

    def kv_layout(self, page_size: int) -> KVLayout:
        return self.config.kv_layout(page_size, self.kv_heads.count)

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def _qkv(self, layer: dict[str, torch.Tensor], h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        d = self.config.head_dim
        x = self._norm(h)
        return tuple((x @ layer[n]).reshape(x.shape[0], -1, d) for n in ("q", "k", "v"))

    def _finish_layer(
        self, layer: dict[str, torch.Tensor], h: torch.Tensor, attn: torch.Tensor
    ) -> torch.Tensor:
        out = attn.reshape(attn.shape[0], -1) @ layer["o"]
        self.all_reduce(out)
        h = h + out
        mlp = F.gelu(self._norm(h) @ layer["up"]) @ layer["down"]
        self.all_reduce(mlp)
        return h + mlp

    def _next_token(self, h_last: torch.Tensor) -> tuple[int, float]:
        # Output is limited to printable ASCII so demo texts stay readable.
        logits = (self._norm(h_last) @ self.head).masked_fill(~self._printable, float("-inf"))
        logprobs = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logprobs))
        return token, float(logprobs[token])

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        # Each query head reads its group's KV head. [T, H, D] -> [H, T, D] for batched matmul.
        k, v = k[:, self._kv_of_query], v[:, self._kv_of_query]
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        scores = (q @ k.transpose(1, 2)) / math.sqrt(q.shape[-1])
        if causal:
            t = scores.shape[-1]
            mask = torch.ones(t, t, dtype=torch.bool, device=scores.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        return (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)

    @torch.inference_mode()
    def prefill(self, pool: KVPool, pages: list[int] | None, input_ids: list[int]) -> tuple[int, float]:
        """Write the prompt's KV into ``pages`` (None: store nothing, only take part in the collectives);
        return the first output token and its logprob."""
        n = len(input_ids)
        ps = pool.layout.page_size
        if pages is not None and len(pages) < pool.layout.pages_for(n):
            raise ValueError(f"{n} tokens need {pool.layout.pages_for(n)} pages, got {len(pages)}")
        h = self.embed[torch.tensor(input_ids, device=self.device)] + self.pos[:n]
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, h)
            for i, page in enumerate((pages or [])[: pool.layout.pages_for(n)]):
                start, end = i * ps, min(n, (i + 1) * ps)
                # page: [heads, layers, 2, tokens, head_dim]
                pool.data[page, :, li, 0, : end - start] = k[start:end].transpose(0, 1)
                pool.data[page, :, li, 1, : end - start] = v[start:end].transpose(0, 1)
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
            pool.data[page, :, li, 0, slot] = k[0]
            pool.data[page, :, li, 1, slot] = v[0]
            # [pages, heads, tokens, head_dim] -> [tokens, heads, head_dim]
            keys = pool.data[used, :, li, 0].transpose(1, 2).reshape(-1, k.shape[1], k.shape[2])
            values = pool.data[used, :, li, 1].transpose(1, 2).reshape(-1, v.shape[1], v.shape[2])
            attn = self._attend(q, keys[: position + 1], values[: position + 1], causal=False)
            h = self._finish_layer(layer, h, attn)
        return self._next_token(h[0])

    def decode(
        self,
        pool: KVPool,
        pages: list[int],
        prompt_len: int,
        first_token: int,
        max_new_tokens: int,
        on_token: Callable[[int], object] | None = None,
        should_stop: Callable[[list[int]], bool] | None = None,
    ) -> list[int]:
        """Continue from the prefill's first token: up to ``max_new_tokens`` output ids, the first
        included, ending early once ``should_stop`` says so; ``on_token`` hears of each."""
        out = [first_token]
        if on_token is not None:
            on_token(first_token)
        for position in range(prompt_len, prompt_len + max_new_tokens - 1):
            if should_stop is not None and should_stop(out):
                break
            token, _ = self.decode_step(pool, pages, position, out[-1])
            out.append(token)
            if on_token is not None:
                on_token(token)
        return out


def generate(
    model: ReferenceModel, input_ids: list[int], max_new_tokens: int, page_size: int = 16
) -> list[int]:
    """Prefill and decode in one process: the reference every disaggregated run must equal."""
    layout = model.kv_layout(page_size)
    n = layout.room_pages("decode", len(input_ids), max_new_tokens)
    pool = KVPool(layout, n, str(model.device))
    pages = pool.alloc(n)
    first, _ = model.prefill(pool, pages, input_ids)
    return model.decode(pool, pages, len(input_ids), first, max_new_tokens)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m shared.models.reference", description=__doc__.split("\n")[0]
    )
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
