"""A Hugging Face causal LM (Llama or Qwen2 family) as a KV source: prefill into pages, decode from them.

The model runs HF's own forward. Prefill fills a ``DynamicCache`` and copies each
layer's K and V (the heads this rank holds) into pages; decode rebuilds a cache
from the pages and continues greedily, one token at a time, with the inputs
``generate()`` gives (attention mask, positions, last logits only, float32
argmax). With one rank, a disaggregated room therefore decodes exactly the
tokens of ``model.generate(ids, do_sample=False)``, unless the checkpoint's
generation config adds logits processors (``greedy_differences`` names them;
the source warns and stays plain argmax).

Tensor parallelism shards the loaded model in place, Megatron style: q/k/v and
gate/up keep this rank's output rows (query heads, KV heads, MLP columns),
o_proj and down_proj keep the matching input columns, their biases on rank 0
only, and forward hooks sum their outputs over the ranks with ``all_reduce``.
Embeddings, norms and lm_head stay whole, so every rank picks the same token.

The digests of the model's files live in ``shared.models.files``, which the
bootstrap reads without torch.
"""

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache

from shared.kv.head_split import kv_heads, query_heads, split_problem
from shared.kv.layout import KVLayout
from shared.kv.pool import KVPool, torch_dtype
from shared.models.files import (
    SUPPORTED_ARCHITECTURES,
    greedy_differences,
    model_dir,
    model_name,
    tokenizer_digest,
    weights_digest,
)
from shared.models.source import Decoded, DecodeRequest, KVSource, ModelSettings, stop_at
from shared.wire.registration import ModelIdentity

log = logging.getLogger(__name__)


def _keep(linear: torch.nn.Linear, rows: slice, cols: slice, bias: bool = True) -> None:
    """Cut ``linear`` to ``weight[rows, cols]``; its bias follows the rows, or goes if not ``bias``."""
    linear.weight = torch.nn.Parameter(linear.weight.data[rows, cols].contiguous(), requires_grad=False)
    if linear.bias is not None:
        kept = torch.nn.Parameter(linear.bias.data[rows].contiguous(), requires_grad=False)
        linear.bias = kept if bias else None  # type: ignore[assignment]
    linear.out_features, linear.in_features = linear.weight.shape


def _shard(model: Any, rank: int, tp: int, all_reduce: Callable[[torch.Tensor], None]) -> None:
    """Keep ``rank``'s share of every decoder layer; o_proj and down_proj sum over the ranks."""
    c = model.config
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv = query_heads(rank, tp, c.num_attention_heads), kv_heads(rank, tp, c.num_key_value_heads)
    q_rows, kv_rows = slice(q.start * d, q.stop * d), slice(kv.start * d, kv.stop * d)
    per = c.intermediate_size // tp
    ffn, whole = slice(rank * per, (rank + 1) * per), slice(None)

    def summed(module: object, inputs: object, output: torch.Tensor) -> None:
        all_reduce(output)

    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        _keep(attn.q_proj, q_rows, whole)
        _keep(attn.k_proj, kv_rows, whole)
        _keep(attn.v_proj, kv_rows, whole)
        _keep(attn.o_proj, whole, q_rows, bias=rank == 0)
        attn.num_key_value_groups = q.count // kv.count
        _keep(mlp.gate_proj, ffn, whole)
        _keep(mlp.up_proj, ffn, whole)
        _keep(mlp.down_proj, whole, ffn, bias=rank == 0)
        attn.o_proj.register_forward_hook(summed)
        mlp.down_proj.register_forward_hook(summed)


class HFSource(KVSource):
    inline = False

    def __init__(self, settings: ModelSettings, rank: int, all_reduce: Callable[[torch.Tensor], None] | None):
        path, tp = model_dir(settings.model), settings.tp_size
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        arch = (config.architectures or ["(none given)"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            supported = ", ".join(SUPPORTED_ARCHITECTURES)
            raise ValueError(f"architecture {arch} is not supported (supported: {supported})")
        if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
            raise ValueError(f"{arch} with sliding-window layers is not supported")
        heads, groups = config.num_attention_heads, config.num_key_value_heads
        problem = split_problem(heads, groups, tp)
        if problem is None and config.intermediate_size % tp:
            problem = f"MLP of {config.intermediate_size} does not split over {tp} ranks"
        if problem:
            raise ValueError(problem)
        self.dtype = settings.resolved_dtype
        self.device = torch.device(settings.rank_device(rank))
        model: Any = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype(self.dtype), local_files_only=True
        )
        if tp > 1:
            if all_reduce is None:
                raise ValueError("tensor parallelism needs an all_reduce")
            _shard(model, rank, tp, all_reduce)
        self.model = model.to(self.device).eval()
        # transformers before 5.2x names the KV cache argument past_key_values; a model given a
        # name it does not take ignores it, and prefill then has no cache at all.
        forward = inspect.signature(self.model.forward).parameters
        self._cache_argument = "cache" if "cache" in forward else "past_key_values"
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        generation = model.generation_config
        eos = generation.eos_token_id if generation.eos_token_id is not None else config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if differences := greedy_differences(generation):
            log.warning("%s: generate() is not plain greedy here (%s)", path, ", ".join(differences))
        self.kv_heads = kv_heads(rank, tp, groups)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.num_layers = config.num_hidden_layers
        self.identity = ModelIdentity(
            name=model_name(settings.model),
            architecture=arch,
            weights=weights_digest(path),
            tokenizer=tokenizer_digest(path),
            dtype=self.dtype,
            num_layers=self.num_layers,
            num_heads=heads,
            num_kv_heads=groups,
            head_dim=self.head_dim,
            vocab_size=config.vocab_size,
            page_size=settings.page_size,
        )

    def kv_layout(self, page_size: int) -> KVLayout:
        return KVLayout(self.num_layers, self.kv_heads.count, self.head_dim, page_size, self.dtype)

    def _text(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))  # the text a client sees

    def _pages_of(self, pool: KVPool, pages: list[int], tokens: int) -> torch.Tensor:
        if pool.layout != self.kv_layout(pool.layout.page_size):
            raise ValueError(f"pool layout {pool.layout} is not this model's")
        n = pool.layout.pages_for(tokens)
        if len(pages) < n:
            raise ValueError(f"{tokens} tokens need {n} pages, got {len(pages)}")
        return torch.tensor(pages[:n], device=pool.data.device)

    def _last_logits(self, ids: list[int], start: int, cache: DynamicCache) -> torch.Tensor:
        """Feed ``ids`` at positions ``start``..., as ``generate()`` does; the last position's
        logits in float32."""
        out = self.model(
            input_ids=torch.tensor([ids], device=self.device),
            attention_mask=torch.ones(1, start + len(ids), dtype=torch.long, device=self.device),
            position_ids=torch.arange(start, start + len(ids), device=self.device).unsqueeze(0),
            **{self._cache_argument: cache},
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[0, -1].to(torch.float32)

    @torch.inference_mode()
    def prefill(
        self, room: int, pool: KVPool, pages: list[int] | None, input_ids: list[int]
    ) -> tuple[int, float]:
        n = len(input_ids)
        if n == 0:
            raise ValueError("an empty prompt has no KV")
        index = None if pages is None else self._pages_of(pool, pages, n)
        cache = DynamicCache(config=self.model.config)
        logits = self._last_logits(input_ids, 0, cache)
        if index is not None:
            ps, count = pool.layout.page_size, len(index)
            for li in range(self.num_layers):
                layer: Any = cache.layers[li]
                for kv, states in enumerate((layer.keys, layer.values)):
                    t = F.pad(states[0].to(pool.data.device), (0, 0, 0, count * ps - n))
                    # [heads, tokens, dim] -> [pages, heads, page_size, dim]
                    pool.data[index, :, li, kv] = t.view(t.shape[0], count, ps, -1).transpose(0, 1)
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits, dim=-1)[token])

    @torch.inference_mode()
    def decode(self, pool: KVPool, req: DecodeRequest) -> Decoded:
        pages, prompt_len, on_token, stop = req.pages, req.prompt_len, req.on_token, req.stop
        index = self._pages_of(pool, pages, prompt_len)
        layers = []
        for li in range(self.num_layers):
            k, v = (
                pool.data[index, :, li, kv].transpose(0, 1).flatten(1, 2)[:, :prompt_len] for kv in (0, 1)
            )
            layers.append((k.unsqueeze(0).to(self.device), v.unsqueeze(0).to(self.device)))
        cache = DynamicCache(ddp_cache_data=layers, config=self.model.config)
        out = [req.first_token]
        while True:
            if on_token is not None:
                on_token(out[-1])
            if out[-1] in self.eos or stop_at(self._text, out, stop):
                return Decoded(out, "stop")
            if len(out) >= req.max_new_tokens:
                return Decoded(out, "length")
            logits = self._last_logits(out[-1:], prompt_len + len(out) - 1, cache)
            out.append(int(torch.argmax(logits)))
