"""What crosses between the bootstrap, vLLM's scheduler and its workers for a kvroom room.

``TransferGrant`` (``shared.wire.grants``) is what the bootstrap puts in a request's
``kv_transfer_params["kvroom"]``; the rest is what the scheduler half hands its workers each step
(``StepPlan``) and what the workers hand back (``WorkerReport``), as plain data vLLM can carry
between processes.
"""

from dataclasses import dataclass, field
from typing import Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from shared.room.states import FailureReason
from shared.wire.grants import TransferGrant


def room_params(kv_transfer_params: dict[str, Any] | None) -> TransferGrant | None:
    """The request's kvroom placement, or None for a request that is not a kvroom room.

    Raises ValueError for a ``kvroom`` entry that is not a placement; whether it is one this
    server may act on is ``grants.refusal``'s to say."""
    if kv_transfer_params is None:
        return None
    if not isinstance(kv_transfer_params, dict):
        raise ValueError("kv_transfer_params is not an object")
    raw = kv_transfer_params.get("kvroom")
    if raw is None:
        return None
    try:
        return msgspec.convert(raw, TransferGrant)
    except msgspec.ValidationError as exc:
        raise ValueError(f"kv_transfer_params.kvroom: {exc}") from None


@dataclass(frozen=True)
class Load:
    """Decode: bring the prompt's KV into these blocks."""

    req_id: str
    room: TransferGrant
    blocks: list[int]
    prompt_len: int


@dataclass(frozen=True)
class Send:
    """Prefill: the prompt is computed; its KV is in these blocks, its first token sampled."""

    req_id: str
    room: TransferGrant
    blocks: list[int]
    prompt_len: int
    first_token: int


@dataclass
class StepPlan(KVConnectorMetadata):
    """Scheduler -> workers, once per engine step."""

    loads: list[Load] = field(default_factory=list)
    sends: list[Send] = field(default_factory=list)
    # Decode requests that ended before their KV was in: write nothing more into their blocks.
    stopped_loads: list[str] = field(default_factory=list)
    # Rooms this server will never load (their requests ended before their blocks were taken):
    # the prefill ranks may give their blocks back now.
    revoked: list[TransferGrant] = field(default_factory=list)
    # Prefill rooms whose requests ended before their KV was sent (aborted while waiting or
    # computing): their decode ranks hear at once that nothing will be written.
    unsent: list[TransferGrant] = field(default_factory=list)
    # Requests whose transfer parameters this server must not act on (request -> its blocks): the
    # workers fail them as loads, which vLLM ends with an error, never computed.
    refused: dict[str, list[int]] = field(default_factory=dict)
    # Prefill rooms just scheduled, before their prompt is computed: a revoke for one is answered
    # at once, from the peers it names.
    scheduled: list[TransferGrant] = field(default_factory=list)
    # Decode: transfers whose prefill process ended (the bootstrap said so): once what it sent has
    # landed, nothing more can be written into their blocks.
    writers_gone: list[int] = field(default_factory=list)


@dataclass
class WorkerReport(KVConnectorWorkerMetadata):
    """Workers -> scheduler, once per engine step: why loads failed, loads whose writes began, and
    the digest of the aux record each worker's load was ready with (all workers must agree)."""

    failed: dict[str, str] = field(default_factory=dict)  # request -> reason
    transferring: set[str] = field(default_factory=set)
    ready: dict[str, int] = field(default_factory=dict)  # request -> its aux record's digest

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "WorkerReport":
        """This worker's report with a later one's: the first reason stands; two workers ready with
        different records fail the load ``aux_mismatch``."""
        assert isinstance(other, WorkerReport)
        failed = {**other.failed, **self.failed}
        for req_id in self.ready.keys() & other.ready.keys():
            if self.ready[req_id] != other.ready[req_id]:
                failed.setdefault(req_id, FailureReason.AUX_MISMATCH)
        return WorkerReport(failed, self.transferring | other.transferring, {**other.ready, **self.ready})


@dataclass
class RankHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler, once at start: how peers reach this rank."""

    peer: dict[str, Any]  # a protocol.PeerRank as builtins
    num_blocks: int
