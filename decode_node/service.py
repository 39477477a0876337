"""The decode node: lends KV pages to a prefill node, takes done+aux, decides SUCCESS.

Per room: BOOTSTRAPPING until every prefill rank accepted the transfer request,
WAITING_FOR_INPUT until one reports its writes began, TRANSFERRING until every
prefill rank the room expects sent its done notice with an aux record and every
record landed in the room's slot and names this room: then SUCCESS, and the
remaining tokens are decoded from the transferred KV. Each waiting state has
its own timeout and failure reason.

Pages lent to a prefill rank are fenced until that rank answers (done+aux or
released) or the lease times out, so a late write can never land in pages
that another room already holds.
"""

import asyncio
import logging
import time

from decode_node.settings import DecodeSettings
from shared import protocol, synthetic_kv
from shared.aux_buffers import AUX_RECORD, AuxBuffers
from shared.errors import AuxValidationError, PoolExhausted, RejectedMessage
from shared.model import pages_needed
from shared.node import NodeService
from shared.room import Room
from shared.states import FailureReason, RoomState
from shared.transfer import TransferEngine

log = logging.getLogger(__name__)


class DecodeJob(Room):
    def __init__(self, msg: protocol.DecodeRoom, service: "DecodeService"):
        super().__init__(msg.room, service.room_changed)
        self.prompt_len = msg.prompt_len
        self.max_new_tokens = msg.max_new_tokens
        self.prefill_ranks = {peer.rank: peer for peer in msg.prefill_ranks}
        self.pages: list[int] = []
        self.aux_slot: int | None = None
        self.unaccepted: set[int] = set()  # prefill ranks that have not accepted the request
        self.pending: set[int] = set()  # prefill ranks whose done+aux has not landed
        self.kv_done: set[int] = set()  # prefill ranks whose done came without its aux
        self.aux_missing_since: float | None = None
        self.leased: set[int] = set()  # prefill ranks that may still write into our pages
        self.lease_deadline = 0.0
        self.requested_at = 0.0
        self.decoding = False


class DecodeService(NodeService):
    role = "decode"
    settings: DecodeSettings
    # A room's done+aux goes before other waiting messages: it ends a room and frees its
    # pages, and under load it would otherwise wait behind new rooms' messages.
    urgent = staticmethod(protocol.is_done_aux)

    def __init__(self, settings: DecodeSettings, engine: TransferEngine | None = None):
        super().__init__(settings, engine)
        self.aux = AuxBuffers(settings.aux_slots)
        # Failed rooms whose pages are still lent out, until released or timed out.
        self.fenced: dict[int, DecodeJob] = {}
        self.metrics.gauge_function("kvroom_free_aux_slots", "Free aux slots", lambda: self.aux.free_slots)
        self.metrics.gauge_function("kvroom_total_aux_slots", "Aux slots", lambda: self.aux.slots)

    def health(self) -> dict[str, object]:
        return {
            **super().health(),
            "free_aux_slots": self.aux.free_slots,
            "total_aux_slots": self.aux.slots,
            "fenced_rooms": len(self.fenced),
        }

    def handle(self, msg: protocol.Message, aux: memoryview | None) -> None:
        if isinstance(msg, protocol.KvDone):
            self._on_done(msg, aux)
        elif isinstance(msg, protocol.TransferAccepted):
            self._on_accepted(msg)
        elif isinstance(msg, protocol.TransferStarted):
            self._on_started(msg)
        elif isinstance(msg, protocol.DecodeRoom):
            self._on_room(msg)
        elif isinstance(msg, protocol.RoomReleased):
            self._on_released(msg)
        elif isinstance(msg, protocol.AbortRoom):
            self._on_abort(msg)
        else:
            raise RejectedMessage(f"a decode node does not take {type(msg).__name__}", kind="unexpected")

    # -- messages -----------------------------------------------------------------

    def _job_for(self, room: int, rank: int, prefill_rank: int) -> DecodeJob:
        """The live room a prefill message addresses, after the checks that need no room data."""
        self.check_rank(rank, room)
        job = self.rooms.live.get(room)
        if job is None:
            known = self.rooms.find(room) is not None
            raise RejectedMessage(
                f"message for a {'finished' if known else 'unknown'} room",
                room=room,
                kind="finished" if known else "unknown_room",
            )
        assert isinstance(job, DecodeJob)
        if prefill_rank not in job.prefill_ranks:
            raise RejectedMessage(
                f"prefill rank {prefill_rank} is not this room's", room=room, kind="bad_rank"
            )
        return job

    def _on_room(self, msg: protocol.DecodeRoom) -> None:
        self.check_origin(msg)
        if self.rooms.find(msg.room) is not None:
            raise RejectedMessage("room already known", room=msg.room, kind="duplicate")
        job = DecodeJob(msg, self)
        self.rooms.add(job)
        try:
            job.pages = self.pool.alloc(pages_needed(self.layout, msg.prompt_len, msg.max_new_tokens))
            job.aux_slot = self.aux.alloc()
        except PoolExhausted as exc:
            log.warning("room=%d %s", job.id, exc, extra={"room": job.id})
            self._fail(job, FailureReason.NO_CAPACITY)
            return
        kv_pages = job.pages[: self.layout.pages_for(msg.prompt_len)]
        for peer in job.prefill_ranks.values():
            request = protocol.TransferRequest(
                room=job.id,
                rank=peer.rank,
                decode_rank=self.rank,
                session_id=self.engine.session_id,
                kv_base_ptr=self.pool.base_ptr,
                num_pages=self.pool.num_pages,
                page_bytes=self.layout.page_bytes,
                page_indices=kv_pages,
                aux_slot=job.aux_slot,
                aux_endpoint=self.settings.public_zmq_endpoint(self.rank),
            )
            job.requested_at = time.perf_counter()
            if not self.send(peer.zmq_endpoint, protocol.encode(request)):
                self._fail(job, FailureReason.PEER_LOST)
                return
            job.unaccepted.add(peer.rank)
            job.pending.add(peer.rank)
            job.leased.add(peer.rank)

    def _progress_job(self, room: int, rank: int, prefill_rank: int) -> DecodeJob | None:
        """The room a progress notice is for; None for a room that already ended.

        Accept and start notices can be overtaken by the done+aux they precede,
        so one for a finished room is expected and dropped without complaint.
        """
        if room not in self.rooms.live and self.rooms.find(room) is not None:
            log.debug("room=%d progress notice after the room ended", room, extra={"room": room})
            return None
        return self._job_for(room, rank, prefill_rank)

    def _on_accepted(self, msg: protocol.TransferAccepted) -> None:
        job = self._progress_job(msg.room, msg.rank, msg.prefill_rank)
        if job is None:
            return
        if msg.prefill_rank not in job.unaccepted:
            raise RejectedMessage("duplicate accept", room=job.id, kind="duplicate")
        job.unaccepted.discard(msg.prefill_rank)
        if not job.unaccepted:
            job.advance_to(RoomState.WAITING_FOR_INPUT)

    def _on_started(self, msg: protocol.TransferStarted) -> None:
        job = self._progress_job(msg.room, msg.rank, msg.prefill_rank)
        if job is not None:
            job.advance_to(RoomState.TRANSFERRING)

    def _on_done(self, msg: protocol.KvDone, record: memoryview | None) -> None:
        job = self._job_for(msg.room, msg.rank, msg.prefill_rank)
        if msg.prefill_rank not in job.pending:
            raise RejectedMessage(
                f"duplicate done from prefill rank {msg.prefill_rank}", room=job.id, kind="duplicate"
            )
        if msg.aux_slot != job.aux_slot:
            # Bounds and ownership checked before anything is copied.
            raise RejectedMessage(
                f"aux slot {msg.aux_slot} is not this room's", room=job.id, kind="out_of_range"
            )
        if record is None or len(record) != AUX_RECORD.size:
            self._on_aux_missing(job, msg.prefill_rank)
            return
        job.pending.discard(msg.prefill_rank)
        job.kv_done.discard(msg.prefill_rank)
        job.leased.discard(msg.prefill_rank)
        expected_pages = self.layout.pages_for(job.prompt_len)
        try:
            if msg.pages_written != expected_pages:
                raise AuxValidationError(f"{msg.pages_written} pages written, {expected_pages} expected")
            self.aux.write(job.aux_slot, record)
            aux = self.aux.validate(job.aux_slot, job.id, job.prompt_len, self.model.config.vocab_size)
        except AuxValidationError as exc:
            log.warning("room=%d aux rejected: %s", job.id, exc, extra={"room": job.id})
            self._fail(job, FailureReason.AUX_INVALID)
            return
        job.advance_to(RoomState.TRANSFERRING)
        if job.pending:
            return
        aux_latency = max(0.0, time.time() - msg.completed_at)
        job.timings["request_to_success_s"] = time.perf_counter() - job.requested_at
        job.timings["aux_latency_s"] = aux_latency
        self.metrics.aux_latency.observe(aux_latency)
        job.advance(RoomState.SUCCESS)
        self.aux.free(job.aux_slot)
        job.aux_slot = None
        job.decoding = True
        self.spawn(self._decode(job, aux.first_token))

    def _on_aux_missing(self, job: DecodeJob, prefill_rank: int) -> None:
        """The KV is done but its aux is not here: wait for it, up to the aux timeout."""
        if prefill_rank in job.kv_done:
            raise RejectedMessage("duplicate done without aux", room=job.id, kind="duplicate")
        job.kv_done.add(prefill_rank)
        if job.aux_missing_since is None:
            job.aux_missing_since = time.monotonic()
        self.metrics.rejected.labels("aux_missing").inc()
        log.warning(
            "room=%d done notice from prefill rank %d arrived without a whole aux record",
            job.id,
            prefill_rank,
            extra={"room": job.id},
        )
        job.advance_to(RoomState.TRANSFERRING)

    def _on_released(self, msg: protocol.RoomReleased) -> None:
        self.check_rank(msg.rank, msg.room)
        job = self.fenced.get(msg.room) or self.rooms.live.get(msg.room)
        if not isinstance(job, DecodeJob) or msg.prefill_rank not in job.leased:
            raise RejectedMessage("release for a room holding no lease", room=msg.room, kind="unknown_room")
        job.leased.discard(msg.prefill_rank)
        if msg.reason:
            # The prefill gave the room up: it cannot succeed any more.
            self._fail(job, msg.reason)
        # An empty reason: that rank finished writing; the room's own timeouts still rule.
        if job.state.terminal:
            self._release(job)

    def _on_abort(self, msg: protocol.AbortRoom) -> None:
        self.check_origin(msg)
        job = self.rooms.live.get(msg.room)
        if job is None:
            log.debug("room=%d abort for a room not live here", msg.room, extra={"room": msg.room})
            return
        assert isinstance(job, DecodeJob)
        if msg.reason == FailureReason.PEER_LOST:
            job.leased.clear()  # a dead process writes nothing more
        self._fail(job, msg.reason)

    # -- work and release ---------------------------------------------------------------

    async def _decode(self, job: DecodeJob, first_token: int) -> None:
        started = time.perf_counter()
        try:
            if self.settings.kv_mode == "synthetic":
                kv_pages = job.pages[: self.layout.pages_for(job.prompt_len)]
                verified = synthetic_kv.verify(self.pool, kv_pages, job.id)  # two tensor reads
                job.timings["kv_verified"] = float(verified)
                if not verified:
                    log.error("room=%d synthetic KV did not land intact", job.id, extra={"room": job.id})
                job.output_ids = []
            else:
                job.output_ids = await asyncio.to_thread(
                    self.model.decode, self.pool, job.pages, job.prompt_len, first_token, job.max_new_tokens
                )
            job.timings["decode_s"] = time.perf_counter() - started
        except Exception:
            log.exception("room=%d decode failed", job.id, extra={"room": job.id})
            job.reason = FailureReason.DECODE_FAILED
        finally:
            job.decoding = False
            self._release(job)
        self.report(job)

    def _fail(self, job: DecodeJob, reason: str) -> None:
        if not job.fail(reason):
            return
        # Tell prefill ranks that still hold our pages to stop; they answer with a release.
        for rank in job.leased:
            peer = job.prefill_ranks[rank]
            self.send(
                peer.zmq_endpoint,
                protocol.encode(
                    protocol.AbortRoom(room=job.id, rank=rank, token=self.token or "-", reason=str(reason))
                ),
            )
        job.lease_deadline = time.monotonic() + self.settings.lease_timeout_s
        self._release(job)

    def _release(self, job: DecodeJob) -> None:
        """Give back what the room holds, as far as no peer or worker still uses it."""
        if job.aux_slot is not None:
            self.aux.free(job.aux_slot)  # aux never arrives by DMA: safe at once
            job.aux_slot = None
        if job.decoding or not job.pages:
            return
        if job.leased:
            self.fenced[job.id] = job
            return
        self.fenced.pop(job.id, None)
        self.pool.free(job.pages)
        job.pages = []

    def _timed_out(self, job: DecodeJob, now_wall: float, now: float) -> FailureReason | None:
        s = self.settings
        waited = now_wall - job.timestamps[job.state.name]
        if job.state is RoomState.BOOTSTRAPPING and waited > s.bootstrap_timeout_s:
            return FailureReason.BOOTSTRAP_TIMEOUT
        if job.state is RoomState.WAITING_FOR_INPUT and waited > s.waiting_timeout_s:
            return FailureReason.WAITING_TIMEOUT
        if job.state is RoomState.TRANSFERRING:
            if job.aux_missing_since is not None and now - job.aux_missing_since > s.aux_timeout_s:
                return FailureReason.AUX_TIMEOUT
            if waited > s.transfer_timeout_s:
                return FailureReason.TRANSFER_TIMEOUT
        return None

    def _check_timeouts(self, now_wall: float, now: float) -> None:
        for job in list(self.rooms.live.values()):
            assert isinstance(job, DecodeJob)
            reason = self._timed_out(job, now_wall, now)
            if reason is not None:
                self._fail(job, reason)
        for job in list(self.fenced.values()):
            if job.lease_deadline < now:
                log.warning(
                    "room=%d lease expired with no answer from prefill ranks %s",
                    job.id,
                    sorted(job.leased),
                    extra={"room": job.id},
                )
                job.leased.clear()
                self._release(job)

    async def background(self) -> None:
        while not self._stop.is_set():
            self._check_timeouts(time.time(), time.monotonic())
            await asyncio.sleep(0.2)
