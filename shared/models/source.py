"""What a node computes a room's KV with, and decodes it with: handed to the node, never chosen inside it.

Three sources: the reference model (``ReferenceSource``), a Hugging Face model
(``shared.models.hf.HFSource``) and synthetic stamped pages for benchmarks
(``SyntheticSource``). ``make_source`` picks one from the settings.

Contract for sources whose ranks run collectives (``inline`` False): every rank
of a node calls ``prefill`` for the same rooms in the same order, and
``decode`` likewise, each to the end; a room that failed meanwhile still runs,
and its result is dropped. The node's leader fixes that order.
"""

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from shared.errors import KvroomError
from shared.kv.head_split import HeadRange, kv_heads
from shared.kv.layout import KVLayout
from shared.kv.pool import KVPool
from shared.models import synthetic
from shared.models.reference import AllReduce, ModelConfig, ReferenceModel, decode_text
from shared.wire.registration import ModelIdentity

OnToken = Callable[[int], object]


class ModelSettings(Protocol):
    """What picking and loading a model reads of a node's settings (``NodeSettings``, a layer up)."""

    model: str
    tp_size: int
    page_size: int
    num_layers: int | None
    num_kv_heads: int | None
    head_dim: int | None

    @property
    def resolved_dtype(self) -> str: ...

    def rank_device(self, rank: int) -> str: ...


@dataclass(frozen=True)
class Decoded:
    output_ids: list[int]
    finish_reason: str  # "stop": an end token or stop string; "length": max_new_tokens


@dataclass(frozen=True)
class DecodeRequest:
    """What a decode continues from: the room's pages, holding its prompt's KV, and its first token."""

    room: int
    pages: list[int]
    prompt_len: int
    first_token: int
    max_new_tokens: int
    stop: list[str] = field(default_factory=list)
    on_token: OnToken | None = None


class DecodeFailed(KvroomError):
    """The source could not continue from the room's pages (for synthetic KV: a stamp is wrong)."""


class KVSource(abc.ABC):
    inline = False  # True: cheap and collective-free, run on the event loop
    identity: ModelIdentity
    kv_heads: HeadRange  # the KV heads this rank holds

    @abc.abstractmethod
    def kv_layout(self, page_size: int) -> KVLayout:
        """The pages of this rank."""

    @abc.abstractmethod
    def prefill(
        self, room: int, pool: KVPool, pages: list[int] | None, input_ids: list[int]
    ) -> tuple[int, float]:
        """Write the prompt's KV for this rank's heads into ``pages`` (None: compute, store nothing);
        the first token and its logprob."""

    @abc.abstractmethod
    def decode(self, pool: KVPool, req: DecodeRequest) -> Decoded:
        """Continue from the KV in the request's pages; every output token, the first included."""


def stop_at(text_of: Callable[[list[int]], str], out: list[int], stop: list[str]) -> bool:
    """Whether the text of ``out`` now holds one of ``stop``."""
    return bool(stop) and any(s in text_of(out) for s in stop)


class ReferenceSource(KVSource):
    def __init__(self, model: ReferenceModel, page_size: int):
        self.model = model
        c = model.config
        self.kv_heads = model.kv_heads
        self.identity = ModelIdentity(
            name="reference",
            architecture="kvroom-reference",
            weights=f"seed-{c.seed}",
            tokenizer="bytes",
            dtype="float64",
            num_layers=c.num_layers,
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            vocab_size=c.vocab_size,
            page_size=page_size,
        )

    def kv_layout(self, page_size: int) -> KVLayout:
        return self.model.kv_layout(page_size)

    def prefill(
        self, room: int, pool: KVPool, pages: list[int] | None, input_ids: list[int]
    ) -> tuple[int, float]:
        return self.model.prefill(pool, pages, input_ids)

    def decode(self, pool: KVPool, req: DecodeRequest) -> Decoded:
        out = self.model.decode(
            pool,
            req.pages,
            req.prompt_len,
            req.first_token,
            req.max_new_tokens,
            req.on_token,
            lambda ids: stop_at(decode_text, ids, req.stop),
        )
        return Decoded(out, "stop" if stop_at(decode_text, out, req.stop) else "length")


class SyntheticSource(KVSource):
    """Stamped pages of any layout, for benchmarks; decoding checks the stamps and yields no tokens."""

    inline = True

    def __init__(self, layout: KVLayout, heads: HeadRange, total_kv_heads: int):
        self._layout = layout
        self.kv_heads = heads
        self._total = total_kv_heads
        self.identity = ModelIdentity(
            name="synthetic",
            architecture="kvroom-synthetic",
            weights="stamps",
            tokenizer="bytes",
            dtype=layout.dtype,
            num_layers=layout.num_layers,
            num_heads=total_kv_heads,
            num_kv_heads=total_kv_heads,
            head_dim=layout.head_dim,
            vocab_size=256,
            page_size=layout.page_size,
        )

    def kv_layout(self, page_size: int) -> KVLayout:
        return self._layout

    def prefill(
        self, room: int, pool: KVPool, pages: list[int] | None, input_ids: list[int]
    ) -> tuple[int, float]:
        synthetic.fill(pool, pages or [], room, self.kv_heads.start, self._total)
        return ord("K"), 0.0

    def decode(self, pool: KVPool, req: DecodeRequest) -> Decoded:
        kv_pages = req.pages[: pool.layout.pages_for(req.prompt_len)]
        if not synthetic.verify(pool, kv_pages, req.room, self.kv_heads.start, self._total):
            raise DecodeFailed(f"room {req.room}: synthetic KV did not land intact")
        return Decoded([], "length")


# The reference model's own shape, which the synthetic source takes where a flag is not given.
_REFERENCE = ModelConfig()


def make_source(settings: ModelSettings, rank: int, all_reduce: AllReduce | None) -> KVSource:
    """The KV source ``settings.model`` names, for ``rank`` of ``settings.tp_size``."""
    tp = settings.tp_size
    if settings.model == "reference":
        model = ReferenceModel(
            device=settings.rank_device(rank), rank=rank, tp=tp, all_reduce=all_reduce or (lambda t: None)
        )
        return ReferenceSource(model, settings.page_size)
    if settings.model == "synthetic":
        total = settings.num_kv_heads or _REFERENCE.num_kv_heads
        heads = kv_heads(rank, tp, total)
        layout = KVLayout(
            settings.num_layers or _REFERENCE.num_layers,
            heads.count,
            settings.head_dim or _REFERENCE.head_dim,
            settings.page_size,
            settings.resolved_dtype,
        )
        return SyntheticSource(layout, heads, total)
    from shared.models.hf import HFSource

    return HFSource(settings, rank, all_reduce)
