"""The prefill node: computes a room's KV, writes it into the decode node, then sends done+aux.

Per room: BOOTSTRAPPING while the model runs, WAITING_FOR_INPUT until the
decode's transfer request is in (a valid request is acknowledged at once),
TRANSFERRING while the engine writes, SUCCESS once the writes completed and the
done+aux message was queued. A room that fails or is aborted tells its decode
ranks that their pages are released.
"""

import asyncio
import logging
import time

from prefill_node.settings import PrefillSettings
from prefill_node.transfer_worker import TransferOutcome, TransferTask, TransferWorker
from shared import protocol, synthetic_kv
from shared.aux_buffers import Aux
from shared.errors import PoolExhausted, RejectedMessage
from shared.node import NodeService
from shared.room import Room
from shared.states import FailureReason, RoomState
from shared.transfer import TransferEngine, coalesce

log = logging.getLogger(__name__)


class PrefillJob(Room):
    def __init__(self, msg: protocol.PrefillRoom, service: "PrefillService"):
        super().__init__(msg.room, service.room_changed)
        self.input_ids = msg.input_ids
        self.decode_ranks = {peer.rank: peer for peer in msg.decode_ranks}
        self.pages: list[int] = []
        self.first_token = 0
        self.logprob = 0.0
        self.request: protocol.TransferRequest | None = None
        self.busy = False  # the model or the engine is using the pages


class PrefillService(NodeService):
    role = "prefill"
    settings: PrefillSettings
    # The room's visible progress is the decode's; the prefill reports how it ended.
    reported_states = frozenset({RoomState.SUCCESS, RoomState.FAILED})

    def __init__(self, settings: PrefillSettings, engine: TransferEngine | None = None):
        super().__init__(settings, engine)
        # Transfer requests whose room has not reached us yet: room -> (request, deadline).
        self.early: dict[int, tuple[protocol.TransferRequest, float]] = {}
        self.worker = TransferWorker(
            self.engine, lambda outcome: self.loop.call_soon_threadsafe(self._transfer_finished, outcome)
        )

    def shutdown(self) -> None:
        self.worker.close()

    def handle(self, msg: protocol.Message, aux: memoryview | None) -> None:
        if isinstance(msg, protocol.PrefillRoom):
            self._on_room(msg)
        elif isinstance(msg, protocol.TransferRequest):
            self._on_request(msg)
        elif isinstance(msg, protocol.AbortRoom):
            self._on_abort(msg)
        else:
            raise RejectedMessage(f"a prefill node does not take {type(msg).__name__}", kind="unexpected")

    # -- messages -----------------------------------------------------------------

    def _on_room(self, msg: protocol.PrefillRoom) -> None:
        self.check_origin(msg)
        if self.rooms.find(msg.room) is not None:
            raise RejectedMessage("room already known", room=msg.room, kind="duplicate")
        job = PrefillJob(msg, self)
        self.rooms.add(job)
        try:
            job.pages = self.pool.alloc(self.layout.pages_for(len(msg.input_ids)))
        except PoolExhausted as exc:
            log.warning("room=%d %s", job.id, exc, extra={"room": job.id})
            self._fail(job, FailureReason.NO_CAPACITY)
            return
        if self.settings.kv_mode == "synthetic":
            # Two tensor writes stand in for the model: done here, the room is ready at once.
            started = time.perf_counter()
            synthetic_kv.fill(self.pool, job.pages, job.id)
            self._kv_ready(job, 0, 0.0, time.perf_counter() - started)
        else:
            job.busy = True
            self.spawn(self._compute(job))
        early = self.early.pop(msg.room, None)
        if early is not None:
            self._on_request(early[0])

    def _on_request(self, req: protocol.TransferRequest) -> None:
        self.check_rank(req.rank, req.room)
        job = self.rooms.live.get(req.room)
        if job is None:
            if self.rooms.find(req.room) is not None:
                raise RejectedMessage("transfer request for a finished room", room=req.room, kind="finished")
            if len(self.early) >= self.settings.max_early_requests:
                raise RejectedMessage("too many early transfer requests", room=req.room, kind="overload")
            # The bootstrap's hand-off may still be in flight on another socket.
            self.early[req.room] = (req, time.monotonic() + self.settings.early_request_ttl_s)
            return
        assert isinstance(job, PrefillJob)
        self._validate_request(job, req)
        job.request = req
        if job.state is RoomState.WAITING_FOR_INPUT and not job.busy:
            self._start_transfer(job)
        # After the write is handed over: the accept may follow the start notice,
        # which the decode allows for.
        self.send(
            req.aux_endpoint,
            protocol.encode(
                protocol.TransferAccepted(room=job.id, rank=req.decode_rank, prefill_rank=self.rank)
            ),
        )

    def _validate_request(self, job: PrefillJob, req: protocol.TransferRequest) -> None:
        def reject(why: str, kind: str = "invalid") -> RejectedMessage:
            return RejectedMessage(f"transfer request: {why}", room=job.id, kind=kind)

        peer = job.decode_ranks.get(req.decode_rank)
        if peer is None:
            raise reject(f"decode rank {req.decode_rank} is not this room's", "bad_rank")
        if req.session_id != peer.session_id or req.aux_endpoint != peer.zmq_endpoint:
            raise reject("sender is not the room's decode rank", "wrong_peer")
        if job.request is not None:
            raise reject("duplicate", "duplicate")
        if req.page_bytes != self.layout.page_bytes:
            raise reject(f"page of {req.page_bytes} bytes, ours are {self.layout.page_bytes}")
        if len(req.page_indices) != len(job.pages):
            raise reject(f"{len(req.page_indices)} pages offered, {len(job.pages)} needed")
        if any(not 0 <= p < req.num_pages for p in req.page_indices):
            raise reject(f"page index outside the peer's {req.num_pages} pages", "out_of_range")
        if len(set(req.page_indices)) != len(req.page_indices):
            raise reject("repeated page index", "out_of_range")

    def _on_abort(self, msg: protocol.AbortRoom) -> None:
        self.check_origin(msg)
        self.early.pop(msg.room, None)
        job = self.rooms.find(msg.room)
        if job is None:
            log.debug("room=%d abort for a room not known here", msg.room, extra={"room": msg.room})
            return
        assert isinstance(job, PrefillJob)
        if job.state.terminal:
            # Already done writing: say so, so the decode can stop fencing its pages.
            self._release(job)
            return
        if job.state is RoomState.TRANSFERRING:
            self.worker.cancel(job.id)
        self._fail(job, msg.reason)

    # -- work -----------------------------------------------------------------------

    async def _compute(self, job: PrefillJob) -> None:
        started = time.perf_counter()
        try:
            first, logprob = await asyncio.to_thread(self.model.prefill, self.pool, job.pages, job.input_ids)
        except Exception:
            log.exception("room=%d prefill failed", job.id, extra={"room": job.id})
            job.busy = False
            self._fail(job, FailureReason.PREFILL_FAILED)
            return
        self._kv_ready(job, first, logprob, time.perf_counter() - started)

    def _kv_ready(self, job: PrefillJob, first_token: int, logprob: float, seconds: float) -> None:
        job.busy = False
        job.first_token, job.logprob = first_token, logprob
        job.timings["prefill_s"] = seconds
        if job.state.terminal:  # aborted while the model ran
            self._release(job)
            return
        job.advance(RoomState.WAITING_FOR_INPUT)
        if job.request is not None:
            self._start_transfer(job)

    def _start_transfer(self, job: PrefillJob) -> None:
        req = job.request
        assert req is not None
        job.busy = True
        writes = coalesce(
            self.pool.base_ptr, job.pages, req.kv_base_ptr, req.page_indices, self.layout.page_bytes
        )
        job.timings["engine_writes"] = len(writes)
        # Done and aux travel in one message, which the worker sends once every write completed.
        done = protocol.KvDone(
            room=job.id,
            rank=req.decode_rank,
            prefill_rank=self.rank,
            aux_slot=req.aux_slot,
            pages_written=len(req.page_indices),
            bytes_written=0,
            completed_at=0.0,
        )
        aux = Aux(job.id, job.first_token, len(job.input_ids), job.logprob).pack()
        self.worker.submit(TransferTask(job.id, req.session_id, writes, req.aux_endpoint, done, aux))
        # Notices go after the hand-off: each send wakes a ZMQ I/O thread, which
        # costs more than the worker needs to start the write.
        job.advance(RoomState.TRANSFERRING)
        started = protocol.TransferStarted(room=job.id, rank=req.decode_rank, prefill_rank=self.rank)
        self.send(req.aux_endpoint, protocol.encode(started))

    def _transfer_finished(self, outcome: TransferOutcome) -> None:
        """On the event loop, after the worker wrote a room's KV (and sent its done+aux)."""
        room = outcome.task.room
        self.worker.forget(room)
        job = self.rooms.find(room)
        assert isinstance(job, PrefillJob)
        job.busy = False
        if outcome.error is not None:
            log.warning("room=%d KV write failed: %s", room, outcome.error, extra={"room": room})
            job.fail(FailureReason.TRANSFER_FAILED)
            self._release(job)
            return
        job.timings["transfer_s"] = outcome.seconds
        job.timings["bytes_written"] = outcome.written
        self.metrics.transfer_bytes.inc(outcome.written)
        self.metrics.transfer_seconds.observe(outcome.seconds)
        if outcome.sent and not job.state.terminal:
            job.advance(RoomState.SUCCESS)
            self._free_pages(job)
            return
        job.fail(FailureReason.PEER_LOST)  # done+aux could not be queued; no-op if aborted meanwhile
        self._release(job)

    def _fail(self, job: PrefillJob, reason: str) -> None:
        if job.fail(reason):
            self._release(job)

    def _release(self, job: PrefillJob) -> None:
        """After a failure: free our pages and tell the decode ranks theirs are safe to reuse."""
        if job.busy:
            return  # the worker calls back here when it returns
        self._free_pages(job)
        for peer in job.decode_ranks.values():
            self.send(
                peer.zmq_endpoint,
                protocol.encode(
                    protocol.RoomReleased(
                        room=job.id, rank=peer.rank, prefill_rank=self.rank, reason=job.reason or ""
                    )
                ),
            )

    def _free_pages(self, job: PrefillJob) -> None:
        if job.pages:
            self.pool.free(job.pages)
            job.pages = []

    async def background(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            deadline = time.time() - self.settings.waiting_timeout_s
            for job in list(self.rooms.live.values()):
                waiting_since = job.timestamps.get(RoomState.WAITING_FOR_INPUT.name, float("inf"))
                if job.state is RoomState.WAITING_FOR_INPUT and waiting_since < deadline:
                    assert isinstance(job, PrefillJob)
                    self._fail(job, FailureReason.WAITING_TIMEOUT)
            for room, (_, deadline) in list(self.early.items()):
                if deadline < now:
                    del self.early[room]
                    self.metrics.rejected.labels("expired").inc()
                    log.warning(
                        "room=%d transfer request expired before its room arrived", room, extra={"room": room}
                    )
            await asyncio.sleep(0.5)
