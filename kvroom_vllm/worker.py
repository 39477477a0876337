"""The worker half of the connector: a kvroom rank inside a vLLM worker process.

It registers vLLM's paged KV cache with the transfer engine, owns a CURVE-authenticated ZMQ
socket and, on a decode server, aux slots in CPU memory. Its own event loop, on a thread of its
own, speaks kvroom's protocol with the other server's ranks; vLLM's calls (once per engine step)
hand it the step's plan and take what finished.

Decode: a load sends a transfer request to each prefill rank holding some of this rank's heads,
then waits for their done+aux; the gate (``shared.room.gate``) decides on what landed in the aux
slots. A load is finished for vLLM only when it is ready, or when it failed and no write of it
can still land (every writer said so, or the lease ran out).

Prefill: a computed prompt is written into the blocks each decode rank asked for, once every
write completed its done+aux follows, and vLLM frees the prompt's blocks only when no write
reads them any more.
"""

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from kvroom_vllm.cores import unpinned
from kvroom_vllm.messages import Load, RankHandshake, Send, StepPlan, TransferGrant, WorkerReport
from kvroom_vllm.paged_kv import PagedKV, block_digests, host_bytes, plan_layers
from kvroom_vllm.settings import VllmNodeSettings
from kvroom_vllm.stats import WriteStats
from shared.errors import PoolExhausted, RejectedMessage, TransferError
from shared.kv import tcp_drain
from shared.kv.aux_buffers import Aux, AuxBuffers, record_digest
from shared.kv.digest import INLINE_BYTES
from shared.kv.head_split import HeadRange, kv_heads, writers
from shared.kv.layout import total_bytes
from shared.kv.transfer import MooncakeEngine, TransferEngine, WriteUnresolved
from shared.metrics import ServiceMetrics
from shared.node.rank import RankService
from shared.room.gate import Expected, Invalid, Landed, Pending, Ready, rank_verdict
from shared.room.states import FailureReason
from shared.wire import protocol
from shared.wire.security import Security, ZapHandler, security_for
from shared.wire.zmq_io import PushSockets, bind_pull, dispatcher, receive_forever

log = logging.getLogger(__name__)

# Transfer requests that came before their prompt was computed, held at most this many.
MAX_EARLY_REQUESTS = 4096

# The worker halves this process runs (one, or none where vLLM runs its workers apart).
_IN_PROCESS: "weakref.WeakSet[WorkerHalf]" = weakref.WeakSet()


def writes_may_move() -> bool:
    """Whether a worker half of this process has a write that may still move bytes: with vLLM's
    in-process executor (TP 1 on a GPU) a prefill's writes are its scheduler's process's own. Read
    at vLLM's shutdown, once the workers' loops stopped: a write their loop did not see end counts."""
    return any(half.writing() for half in list(_IN_PROCESS))


@dataclass
class Loading:
    """A decode rank's load: what it asked for, what landed, and whose writes may still land."""

    load: Load
    writers: dict[int, HeadRange]  # prefill rank -> the heads it writes here
    slot: int
    landed: dict[int, Landed] = field(default_factory=dict)
    released: set[int] = field(default_factory=set)  # writers that will write nothing more
    checking: set[int] = field(default_factory=set)  # writers whose KV is being digested
    failed: str | None = None
    timer: asyncio.TimerHandle | None = None
    settled: bool = False  # its slot freed and vLLM told: once
    asked_at: float = field(default_factory=time.monotonic)  # its transfer requests went out
    freed: str = "answered"  # how its blocks come back once it failed (kvroom_vllm.stats.FREED)

    def fenced(self) -> bool:
        """Whether a write of this load may still land."""
        return any(p not in self.landed and p not in self.released for p in self.writers)


class WriteNotStarted(Exception):
    """A write that was not started, for ``reason``: nothing of it moved."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class Sending:
    """A prefill rank's send: the decode ranks it writes into and where each stands."""

    send: Send
    targets: dict[int, HeadRange]  # decode rank -> the heads written into it
    requests: dict[int, protocol.TransferRequest] = field(default_factory=dict)
    writing: set[int] = field(default_factory=set)
    revoked: set[int] = field(default_factory=set)
    ended: set[int] = field(default_factory=set)  # written, revoked or given up
    timer: asyncio.TimerHandle | None = None


class WorkerHalf:
    def __init__(
        self,
        settings: VllmNodeSettings,
        rank: int,
        tp_size: int,
        num_kv_heads: int,
        vocab_size: int,
        role: str,
    ):
        self.settings = settings
        self.rank = rank
        self.tp_size = tp_size
        self.num_kv_heads = num_kv_heads
        self.vocab_size = vocab_size
        self.role = role
        self.security: Security = security_for(settings.zmq_security, settings.curve_key_file)
        self.metrics = ServiceMetrics(f"vllm-{role}")
        self.kv: PagedKV | None = None
        self._bytes: memoryview | None = None
        self.engine: TransferEngine | None = None
        self.aux = AuxBuffers(settings.aux_slots)
        self._loads: dict[protocol.TransferId, Loading] = {}
        self._sends: dict[protocol.TransferId, Sending] = {}
        # Requests that came before their send, with their sender and when they came.
        self._early: dict[protocol.TransferId, list[tuple[protocol.TransferRequest, str | None, float]]] = {}
        # Revoked before their send came, with the revoker's key (checked once the room's peers are known).
        self._revoked: dict[protocol.TransferId, set[str | None]] = {}  # revoked before the send, by whom
        # Prefill rooms scheduled whose send has not come: whom a revoke before it is answered.
        self._scheduled: collections.OrderedDict[protocol.TransferId, TransferGrant] = (
            collections.OrderedDict()
        )
        # Sends that ended, to answer a late revocation of one (bounded).
        self._ended_sends: collections.OrderedDict[protocol.TransferId, TransferGrant] = (
            collections.OrderedDict()
        )
        # What finished, taken by vLLM's thread at the end of each step.
        self._lock = threading.Lock()
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        self._failed: dict[str, str] = {}
        self._ready: dict[str, int] = {}  # request -> the digest of the record its load was ready with
        self._invalid_blocks: set[int] = set()
        self._transferring: set[str] = set()
        self._stats = WriteStats()
        self._writes = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="kvroom-write")
        self._loop = asyncio.new_event_loop()
        # Loads whose writers are gone, until nothing those sent over TCP is still unread here.
        self._landing = tcp_drain.AfterLanding(
            self._loop, settings.transport == "tcp", lambda loading: not loading.settled, self._writes_ended
        )
        self._thread: threading.Thread | None = None
        self._zmq: zmq.Context | None = None
        _IN_PROCESS.add(self)

    # -- vLLM's thread ----------------------------------------------------------------

    def start(self, kv: PagedKV, engine: TransferEngine | None = None) -> None:
        """Register the KV cache and start receiving: vLLM's ``register_kv_caches``. Every thread
        this starts (the transfer engine's, ZMQ's, the rank's) may run off the forward's cores."""
        with unpinned():
            self._start(kv, engine)

    def _start(self, kv: PagedKV, engine: TransferEngine | None) -> None:
        s = self.settings
        if s.verify_kv and not kv.on_host:
            raise ValueError("verify_kv digests the KV in host memory: this vLLM's KV cache is on a GPU")
        self.kv = kv
        self.engine = engine or MooncakeEngine(
            s.engine_host or s.public_host, s.transport, s.rdma_devices, advertise_host=s.public_host
        )
        self.engine.register(kv.base, kv.nbytes)
        # Verify mode digests what was written on both sides, from host memory.
        self._bytes = host_bytes(kv) if s.verify_kv else None
        self._zmq = zmq.Context()
        self._zap = ZapHandler(self._zmq) if self.security.keys else None
        self.push = PushSockets(self._zmq, self.security)
        pull = bind_pull(self._zmq, s.bind_zmq_endpoint(self.rank), self.security)
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            task = self._loop.create_task(receive_forever(pull, dispatcher(self._on_message, self.metrics)))
            self._loop.call_soon(ready.set)
            try:
                self._loop.run_forever()
            finally:
                task.cancel()
                self._loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
                pull.close(0)

        self._thread = threading.Thread(target=run, name=f"kvroom-rank-{self.rank}", daemon=True)
        self._thread.start()
        ready.wait(10)
        log.info(
            "kvroom rank %d of %s: %d layers, %d blocks of %d bytes, KV heads [%d, %d), engine %s",
            self.rank,
            self.role,
            kv.num_layers,
            kv.num_blocks,
            kv.block_bytes,
            kv.heads.start,
            kv.heads.stop,
            self.engine.session_id,
        )

    def handshake(self) -> RankHandshake:
        assert self.kv is not None and self.engine is not None
        peer = protocol.PeerRank(
            self.rank,
            self.engine.session_id,
            self.settings.public_zmq_endpoint(self.rank),
            self.security.public_key,
            self.kv.heads.start,
            self.kv.heads.count,
        )
        return RankHandshake(msgspec.to_builtins(peer), self.kv.num_blocks)

    def take_plan(self, plan: StepPlan) -> None:
        if plan.refused:  # nothing to do but say so: vLLM ends them with an error
            with self._lock:
                self._finished_recving.update(plan.refused)
                self._invalid_blocks.update(b for blocks in plan.refused.values() for b in blocks)
        work = (plan.loads, plan.sends, plan.stopped_loads, plan.revoked, plan.unsent, plan.scheduled)
        if any(work) or plan.writers_gone:
            self._loop.call_soon_threadsafe(self._take_plan, plan)

    def results(self) -> tuple[set[str], set[str], set[int], WorkerReport]:
        """What finished since the last step: sends, loads, the blocks of failed loads, and why.

        A send finishes only after vLLM handed it over in a step whose finished requests name it,
        so vLLM always knows the request it is told of."""
        with self._lock:
            sending, self._finished_sending = self._finished_sending, set()
            recving, self._finished_recving = self._finished_recving, set()
            failed, self._failed = self._failed, {}
            ready, self._ready = self._ready, {}
            invalid, self._invalid_blocks = self._invalid_blocks, set()
            transferring, self._transferring = self._transferring, set()
        return sending, recving, invalid, WorkerReport(failed, transferring, ready)

    def writing(self) -> bool:
        """Whether a write of this rank may still move bytes (until its end was seen, a write given
        up on at its deadline until its lease ran out)."""
        return any(sending.writing for sending in list(self._sends.values()))

    def take_stats(self) -> WriteStats | None:
        """What this rank wrote since the last call, for vLLM's stat loggers (None: nothing)."""
        with self._lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, WriteStats()
        return stats

    def close(self) -> None:
        if self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        self._writes.shutdown(wait=False, cancel_futures=True)
        if self._zmq is not None:
            self.push.close()
            if self._zap is not None:
                self._zap.close()
            self._zmq.term()
        if self.engine is not None:
            self.engine.close()

    # -- the rank's loop: the plan ----------------------------------------------------

    def _take_plan(self, plan: StepPlan) -> None:
        for room in plan.scheduled:
            self._scheduled[room.transfer] = room
            while len(self._scheduled) > MAX_EARLY_REQUESTS:
                self._scheduled.popitem(last=False)
        for load in plan.loads:
            self._start_load(load)
        for send in plan.sends:
            self._start_send(send)
        for req_id in plan.stopped_loads:
            loading = next((x for x in self._loads.values() if x.load.req_id == req_id), None)
            if loading is not None:
                self._fail_load(loading, FailureReason.ABORTED)
        for room in plan.revoked:
            self._revoke_all(room, FailureReason.ABORTED)
        for room in plan.unsent:
            self._unsent(room)
        for transfer in plan.writers_gone:
            gone = self._loads.get(protocol.TransferId(transfer))
            if gone is not None:
                self._fail_load(gone, FailureReason.PEER_LOST)
                self._landing.add(gone)

    def _start_load(self, load: Load) -> None:
        assert self.kv is not None
        transfer = load.room.transfer
        try:
            ranges = [p.heads for p in load.room.peers]
            mine = writers(ranges, self.kv.heads, self.rank)
            slot = self.aux.alloc()
        except (ValueError, PoolExhausted) as exc:
            log.warning("transfer=%d cannot load: %s", transfer, exc)
            # Nothing was asked of any prefill rank: nothing can land, the blocks are vLLM's again.
            no_slot = isinstance(exc, PoolExhausted)
            self._finish_load(load, FailureReason.NO_CAPACITY if no_slot else FailureReason.TRANSFER_FAILED)
            return
        loading = Loading(load, mine, slot)
        self._loads[transfer] = loading
        loading.timer = self._loop.call_later(self.settings.transfer_timeout_s, self._timed_out, loading)
        for prefill_rank in mine:
            peer = load.room.peers[prefill_rank]
            request = protocol.TransferRequest(
                transfer,
                prefill_rank,
                self.rank,
                self.kv.base,
                self.kv.num_blocks,
                self.kv.block_bytes,
                load.blocks,
                slot,
                layer_stride=self.kv.layer_stride,
            )
            self.push.send(peer.zmq_endpoint, peer.public_key, protocol.encode(request))

    def _timed_out(self, loading: Loading) -> None:
        if loading.failed is None:
            done = all(p in loading.landed for p in loading.writers)
            self._fail_load(loading, FailureReason.AUX_TIMEOUT if done else FailureReason.TRANSFER_TIMEOUT)
        else:  # the lease ran out: whatever was still moving has landed or never will
            loading.released |= set(loading.writers)
            loading.freed = "expired"
            self._settle_load(loading)

    def _fail_load(self, loading: Loading, reason: str) -> None:
        """The load failed: no writer may write any more. vLLM hears of it now, through its blocks
        named invalid, and ends the request with an error; it frees the blocks only once the load
        finishes (``finished_recving``), when no writer can write into them."""
        if loading.failed is not None:
            return
        loading.failed = reason
        log.warning("transfer=%d load failed: %s", loading.load.room.transfer, reason)
        with self._lock:
            self._failed[loading.load.req_id] = reason
            self._invalid_blocks.update(loading.load.blocks)
        for prefill_rank in loading.writers:
            if prefill_rank not in loading.landed and prefill_rank not in loading.released:
                peer = loading.load.room.peers[prefill_rank]
                revoke = protocol.RevokeLease(loading.load.room.transfer, prefill_rank, reason)
                self.push.send(peer.zmq_endpoint, peer.public_key, protocol.encode(revoke))
        if loading.timer is not None:
            loading.timer.cancel()
        loading.timer = self._loop.call_later(self._fenced_for(loading), self._timed_out, loading)
        self._settle_load(loading)

    def _fenced_for(self, loading: Loading) -> float:
        """Seconds from now until no write of a failed load can land unless its writers say so
        sooner (docs/design.md, "The fence inside vLLM"): a prefill rank starts a write only within
        transfer_timeout_s of the request reaching it, and the write ends within transfer_timeout_s;
        the lease covers the rest, the request's transit included."""
        s = self.settings
        return s.lease_timeout_s + max(0.0, loading.asked_at + s.transfer_timeout_s - time.monotonic())

    def _writes_ended(self, gone: list[Loading]) -> None:
        """These loads' prefill processes ended, and what they sent has landed: no writer of
        theirs can write any more."""
        for loading in gone:
            loading.released |= set(loading.writers)
            loading.freed = "writers_gone"
            self._settle_load(loading)

    def _settle_load(self, loading: Loading) -> None:
        if loading.failed is None or loading.fenced() or loading.settled:
            return
        loading.settled = True
        if loading.timer is not None:
            loading.timer.cancel()
        self._loads.pop(loading.load.room.transfer, None)
        self.aux.free(loading.slot)
        if self.rank == 0:  # every worker frees the same blocks: counted once
            with self._lock:
                self._stats.freed(loading.freed, len(loading.load.blocks))
        self._finish_load(loading.load, None)  # its failure and blocks were named when it failed

    def _finish_load(self, load: Load, failed: str | None, digest: int | None = None) -> None:
        with self._lock:
            self._finished_recving.add(load.req_id)
            if digest is not None:
                self._ready[load.req_id] = digest
            if failed is not None:
                self._failed[load.req_id] = failed
                self._invalid_blocks.update(load.blocks)

    def _start_send(self, send: Send) -> None:
        assert self.kv is not None
        transfer = send.room.transfer
        if transfer in self._sends:
            return
        targets = {}
        for peer in send.room.peers:
            try:
                heads = writers([self._heads_of(r) for r in range(self.tp_size)], peer.heads, peer.rank)
            except ValueError as exc:
                log.warning("transfer=%d cannot be written: %s", transfer, exc)
                heads = {}
            if self.rank in heads:
                targets[peer.rank] = heads[self.rank]
        sending = Sending(send, targets)
        self._sends[transfer] = sending
        self._scheduled.pop(transfer, None)
        for sender in self._revoked.pop(transfer, ()):
            self._revoke(sending, sender)
        sending.timer = self._loop.call_later(self.settings.transfer_timeout_s, self._give_up_send, sending)
        for request, sender, arrived in self._early.pop(transfer, []):
            self._take_request(sending, request, sender, arrived)
        self._settle_send(sending)

    def _heads_of(self, rank: int) -> HeadRange:
        return kv_heads(rank, self.tp_size, self.num_kv_heads)

    def _give_up_send(self, sending: Sending) -> None:
        """No request came (the decode ended the room, or is gone): the blocks are not read."""
        waiting = set(sending.targets) - sending.ended - sending.writing
        if waiting:
            log.warning(
                "transfer=%d no transfer request from decode ranks %s; giving the blocks back",
                sending.send.room.transfer,
                sorted(waiting),
            )
        sending.ended |= waiting
        self._settle_send(sending)

    def _settle_send(self, sending: Sending) -> None:
        for decode_rank in sending.revoked - sending.ended - sending.writing:
            sending.ended.add(decode_rank)
            self._released(sending, decode_rank, "revoked")
        if sending.ended >= set(sending.targets):
            if sending.timer is not None:
                sending.timer.cancel()
            self._sends.pop(sending.send.room.transfer, None)
            self._ended(sending.send.room)
            with self._lock:
                self._finished_sending.add(sending.send.req_id)

    def _ended(self, room: TransferGrant) -> None:
        """Nothing more of the room is written: a request or revoke for it is answered so at once."""
        self._ended_sends[room.transfer] = room
        while len(self._ended_sends) > MAX_EARLY_REQUESTS:
            self._ended_sends.popitem(last=False)

    def _unsent(self, room: TransferGrant) -> None:
        """The prefill request ended before its KV was sent: its decode ranks may have their blocks
        back now, not at their lease's end."""
        if room.transfer in self._sends or room.transfer in self._ended_sends:
            return
        self._early.pop(room.transfer, None)
        self._revoked.pop(room.transfer, None)
        self._scheduled.pop(room.transfer, None)
        self._ended(room)
        self._release_to(room, None, FailureReason.ABORTED)

    def _released(self, sending: Sending, decode_rank: int, reason: str) -> None:
        self._release_peer(sending.send.room.transfer, sending.send.room.peers[decode_rank], reason)

    def _release_to(self, room: TransferGrant, sender: str | None, reason: str) -> None:
        """Tell the room's decode ranks whose key ``sender`` is (all, with None) that nothing more
        of it will be written here."""
        for peer in room.peers:
            if sender is None or sender == peer.public_key:
                self._release_peer(room.transfer, peer, reason)

    def _release_peer(self, transfer: protocol.TransferId, peer: protocol.PeerRank, reason: str) -> None:
        msg = protocol.RoomReleased(transfer, peer.rank, self.rank, reason)
        self.push.send(peer.zmq_endpoint, peer.public_key, protocol.encode(msg))

    def _revoke_all(self, room: TransferGrant, reason: str) -> None:
        """A decode server that will never load this room: tell its writers to stop now."""
        for peer in room.peers:
            revoke = protocol.RevokeLease(room.transfer, peer.rank, reason)
            self.push.send(peer.zmq_endpoint, peer.public_key, protocol.encode(revoke))

    # -- the rank's loop: messages ----------------------------------------------------

    def _on_message(self, msg: protocol.Message, aux: memoryview | None, sender: str | None) -> None:
        if isinstance(msg, protocol.TransferRequest):
            self._on_request(msg, sender)
        elif isinstance(msg, protocol.TransferRequests):
            for request in msg.requests:
                self._on_request(request, sender)
        elif isinstance(msg, protocol.DoneAux):
            self._on_done(msg, aux, sender)
        elif isinstance(msg, protocol.RevokeLease):
            self._on_revoke(msg, sender)
        elif isinstance(msg, protocol.RoomReleased):
            self._on_released(msg, sender)
        else:
            raise RejectedMessage(f"a vLLM rank does not take {type(msg).__name__}", kind="unexpected")

    def _on_request(self, request: protocol.TransferRequest, sender: str | None) -> None:
        if request.rank != self.rank:
            raise RejectedMessage(f"for rank {request.rank}", room=request.transfer, kind="bad_rank")
        sending = self._sends.get(request.transfer)
        ended = self._ended_sends.get(request.transfer)
        if sending is None and ended is not None:  # too late: nothing of it will be written
            if request.decode_rank < len(ended.peers):
                peer = ended.peers[request.decode_rank]
                RankService.check_sender(sender, peer, request.transfer)
                self._release_peer(request.transfer, peer, "revoked")
            return
        if sending is None:
            early = self._early.setdefault(request.transfer, [])
            if len(self._early) > MAX_EARLY_REQUESTS or len(early) >= protocol.MAX_RANKS:
                self._early.pop(request.transfer, None)
                raise RejectedMessage(
                    "too many early transfer requests", room=request.transfer, kind="overload"
                )
            early.append((request, sender, time.monotonic()))
            self._loop.call_later(self.settings.transfer_timeout_s, self._early.pop, request.transfer, None)
            return
        self._take_request(sending, request, sender, time.monotonic())

    def _take_request(
        self, sending: Sending, request: protocol.TransferRequest, sender: str | None, arrived: float
    ) -> None:
        try:
            self._check_request(sending, request, sender)
        except RejectedMessage as exc:
            self.metrics.rejected.labels(exc.kind).inc()
            log.warning("transfer=%d dropped transfer request (%s): %s", request.transfer, exc.kind, exc)
            return
        sending.requests[request.decode_rank] = request
        sending.writing.add(request.decode_rank)
        start_by = arrived + self.settings.transfer_timeout_s  # from its arrival, early or not
        self._loop.create_task(self._write(sending, request, start_by))

    def _check_request(self, sending: Sending, req: protocol.TransferRequest, sender: str | None) -> None:
        assert self.kv is not None

        def reject(why: str, kind: str = "invalid") -> RejectedMessage:
            return RejectedMessage(f"transfer request: {why}", room=req.transfer, kind=kind)

        peers = sending.send.room.peers
        if req.decode_rank >= len(peers):
            raise reject(f"decode rank {req.decode_rank} is not this room's", "bad_rank")
        RankService.check_sender(sender, peers[req.decode_rank], req.transfer)
        heads = sending.targets.get(req.decode_rank)
        if heads is None:
            raise reject(f"this rank writes nothing into decode rank {req.decode_rank}", "bad_rank")
        if req.decode_rank in sending.requests or req.decode_rank in sending.ended:
            raise reject("duplicate", "duplicate")
        if req.decode_rank in sending.revoked:  # revoked before it could be taken: nothing is written
            raise reject("its room was revoked", "finished")
        want = peers[req.decode_rank].kv_head_count * self.kv.head_bytes
        if req.page_bytes != want:
            raise reject(
                f"block of {req.page_bytes} bytes, {peers[req.decode_rank].kv_head_count} heads take {want}"
            )
        if req.layer_stride < req.num_pages * req.page_bytes:
            raise reject("layers that overlap", "out_of_range")
        if not 0 < len(req.page_indices) <= len(sending.send.blocks):
            raise reject(f"{len(req.page_indices)} blocks for a prompt of {len(sending.send.blocks)}")
        if any(not 0 <= b < req.num_pages for b in req.page_indices):
            raise reject(f"block outside the peer's {req.num_pages} blocks", "out_of_range")
        if len(set(req.page_indices)) != len(req.page_indices):
            raise reject("repeated block", "out_of_range")

    async def _write(self, sending: Sending, request: protocol.TransferRequest, start_by: float) -> None:
        assert self.kv is not None and self.engine is not None
        send, decode_rank = sending.send, request.decode_rank
        peer = send.room.peers[decode_rank]
        # A decode that holds some of the prompt already asks for the blocks after those.
        sources = send.blocks[len(send.blocks) - len(request.page_indices) :]
        writes = plan_layers(
            self.kv,
            sources,
            request.kv_base_ptr,
            request.layer_stride,
            request.page_bytes,
            peer.heads,
            request.page_indices,
            sending.targets[decode_rank],
        )
        with self._lock:
            self._transferring.add(send.req_id)
        outcome: str | None = None
        digests = None
        try:
            written = await self._loop.run_in_executor(
                self._writes, self._write_if_open, sending, decode_rank, start_by, peer.session_id, writes
            )
            if self._bytes is not None:
                heads = sending.targets[decode_rank]
                digests = await self._loop.run_in_executor(
                    self._writes, block_digests, self.kv, self._bytes, sources, heads
                )
        except WriteNotStarted as exc:
            log.warning("transfer=%d write not started: %s", send.room.transfer, exc)
            outcome = exc.reason
        except WriteUnresolved as exc:
            # Some writes may still be moving: the blocks stay read until the lease runs out.
            log.warning("transfer=%d writes unresolved: %s", send.room.transfer, exc)
            await asyncio.sleep(self.settings.lease_timeout_s)
            outcome = FailureReason.TRANSFER_FAILED
        except TransferError as exc:
            log.warning("transfer=%d write failed: %s", send.room.transfer, exc)
            outcome = FailureReason.TRANSFER_FAILED
        sending.writing.discard(decode_rank)
        sending.ended.add(decode_rank)
        if outcome is None:
            with self._lock:
                self._stats.record(len(writes), written or total_bytes(writes))
        if outcome is None and decode_rank not in sending.revoked:
            done = protocol.DoneAux(
                send.room.transfer,
                decode_rank,
                self.rank,
                request.aux_slot,
                len(request.page_indices),
                written if written else total_bytes(writes),
                time.time(),
                digests,
            )
            # vLLM keeps the first token's logprob in its output processor, out of the connector's
            # reach: the record carries 0 (no rule reads it).
            record = Aux(send.room.transfer, send.first_token, send.prompt_len, 0.0).pack()
            self.send_done_aux(peer, done, record)
        else:
            self._released(sending, decode_rank, outcome or "revoked")
        self._settle_send(sending)

    def _write_if_open(
        self, sending: Sending, decode_rank: int, start_by: float, session: str, writes: list[Any]
    ) -> int:
        """On a write thread, at the instant the engine is called: a write whose lease was revoked, or
        whose start deadline passed while it queued, is not started (the decode may have reused the
        blocks by then)."""
        assert self.engine is not None
        with self._lock:
            if decode_rank in sending.revoked:
                raise WriteNotStarted("revoked")
        if time.monotonic() > start_by:
            raise WriteNotStarted(FailureReason.TRANSFER_TIMEOUT)
        return int(self.engine.write(session, writes, self.settings.transfer_timeout_s))

    def send_done_aux(self, peer: protocol.PeerRank, done: protocol.DoneAux, record: bytes) -> None:
        """The one place done+aux leaves a prefill rank, after every write of it completed."""
        self.push.send(peer.zmq_endpoint, peer.public_key, protocol.encode(done, record))

    def _on_done(self, msg: protocol.DoneAux, aux: memoryview | None, sender: str | None) -> None:
        loading = self._loads.get(msg.transfer)
        if loading is None:
            raise RejectedMessage("done+aux for no load in flight", room=msg.transfer, kind="unknown_room")
        if msg.rank != self.rank or msg.prefill_rank not in loading.writers:
            raise RejectedMessage(
                "done+aux from a rank that does not write here", room=msg.transfer, kind="bad_rank"
            )
        RankService.check_sender(sender, loading.load.room.peers[msg.prefill_rank], msg.transfer)
        if msg.prefill_rank in loading.landed or msg.prefill_rank in loading.checking:
            raise RejectedMessage("duplicate done+aux", room=msg.transfer, kind="duplicate")
        if msg.aux_slot != loading.slot:
            raise RejectedMessage("done+aux for another aux slot", room=msg.transfer, kind="invalid")
        record = self.aux.write(loading.slot, aux) if aux is not None else None
        if self._bytes is None or self._digest_bytes(loading, msg) <= INLINE_BYTES:
            self._landed(loading, msg, record, self._kv_intact(loading, msg))
            return
        # A large room's digests off the loop; the writer stays fenced (its blocks kept) meanwhile.
        loading.checking.add(msg.prefill_rank)
        checked = self._loop.run_in_executor(self._writes, self._kv_intact, loading, msg)
        checked.add_done_callback(lambda done: self._checked(loading, msg, record, done))

    def _checked(
        self, loading: Loading, msg: protocol.DoneAux, record: bytes | None, done: "asyncio.Future[bool]"
    ) -> None:
        loading.checking.discard(msg.prefill_rank)
        intact = not done.cancelled() and done.exception() is None and done.result()
        self._landed(loading, msg, record, intact)

    def _landed(self, loading: Loading, msg: protocol.DoneAux, record: bytes | None, intact: bool) -> None:
        """A writer's done+aux, its KV checked: the gate decides on the load."""
        loading.landed[msg.prefill_rank] = Landed(record, msg.pages_written, intact)
        if loading.failed is not None or self._loads.get(msg.transfer) is not loading:
            self._settle_load(loading)
            return
        load = loading.load
        expected = Expected(
            load.room.transfer, load.prompt_len, self.vocab_size, len(load.blocks), frozenset(loading.writers)
        )
        verdict = rank_verdict(expected, loading.landed)
        if isinstance(verdict, Invalid):
            log.warning("transfer=%d %s: %s", load.room.transfer, verdict.reason, verdict.detail)
            self._fail_load(loading, verdict.reason)
        elif isinstance(verdict, Pending) and verdict.corrupt:
            # The KV is done but its record did not arrive intact: a copy may follow, for a while.
            log.warning(
                "transfer=%d aux record from ranks %s not intact; waiting",
                load.room.transfer,
                sorted(verdict.corrupt),
            )
            if loading.timer is not None:
                loading.timer.cancel()
            loading.timer = self._loop.call_later(self.settings.aux_timeout_s, self._timed_out, loading)
        elif isinstance(verdict, Ready):
            if loading.timer is not None:
                loading.timer.cancel()
            self._loads.pop(load.room.transfer, None)
            self.aux.free(loading.slot)
            self._finish_load(load, None, record_digest(verdict.record))

    def _digest_bytes(self, loading: Loading, msg: protocol.DoneAux) -> int:
        assert self.kv is not None
        heads = loading.writers[msg.prefill_rank]
        return len(loading.load.blocks) * self.kv.num_layers * heads.count * self.kv.head_bytes

    def _kv_intact(self, loading: Loading, msg: protocol.DoneAux) -> bool:
        """Verify mode: whether what landed in the load's blocks is what the prefill rank wrote."""
        if self._bytes is None:
            return True
        assert self.kv is not None
        blocks = loading.load.blocks
        if msg.digests is None or msg.digest_kind != "xxh3" or len(msg.digests) != len(blocks):
            return False  # unverified KV is never taken
        heads = loading.writers[msg.prefill_rank]
        return block_digests(self.kv, self._bytes, blocks, heads) == msg.digests

    def _on_revoke(self, msg: protocol.RevokeLease, sender: str | None) -> None:
        if msg.rank != self.rank:
            raise RejectedMessage(f"for rank {msg.rank}", room=msg.transfer, kind="bad_rank")
        sending = self._sends.get(msg.transfer)
        ended = self._ended_sends.get(msg.transfer)
        if ended is not None:  # nothing of it can still be written: say so at once
            self._release_to(ended, sender, "revoked")
            return
        if sending is None:
            # Its prompt is still being computed (or long gone): remembered while it may come, and
            # answered now if the room is known here, since nothing of it will be written.
            scheduled = self._scheduled.get(msg.transfer)
            if scheduled is not None:
                self._release_to(scheduled, sender, "revoked")
            if msg.transfer not in self._revoked:
                self._loop.call_later(self.settings.transfer_timeout_s, self._revoked.pop, msg.transfer, None)
            self._revoked.setdefault(msg.transfer, set()).add(sender)
            return
        self._revoke(sending, sender)
        self._settle_send(sending)

    def _revoke(self, sending: Sending, sender: str | None) -> None:
        """The decode ranks whose key ``sender`` is take their blocks back (all, with security off)."""
        with self._lock:  # a write thread checks it as it starts a write
            for peer in sending.send.room.peers:
                if sender is None or sender == peer.public_key:
                    sending.revoked.add(peer.rank)

    def _on_released(self, msg: protocol.RoomReleased, sender: str | None) -> None:
        loading = self._loads.get(msg.transfer)
        if loading is None or msg.prefill_rank not in loading.writers:
            return
        RankService.check_sender(sender, loading.load.room.peers[msg.prefill_rank], msg.transfer)
        loading.released.add(msg.prefill_rank)
        if loading.failed is None and msg.reason:
            self._fail_load(loading, FailureReason.PREFILL_FAILED if msg.reason != "revoked" else msg.reason)
        self._settle_load(loading)
