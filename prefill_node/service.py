"""A prefill rank: computes a room's KV for its heads, writes it into the decode ranks that hold them,
then sends each its done+aux.

Per room, on this rank: BOOTSTRAPPING while the model runs, WAITING_FOR_INPUT
until the decode ranks' transfer requests are in, TRANSFERRING while the engine
writes, SUCCESS once every write completed and every done+aux was queued. The
room's state is what the node's ranks agreed: SUCCESS when every rank finished,
FAILED when one failed.

A decode rank hears that its request was accepted and that its write began
only when its done+aux has not gone out ``progress_notice_s`` after the
request (or after the write began): the notices are two messages per room, and
sent at once they would take the cores while the write they announce runs. A
done+aux says both.

Ownership of pages: our pages are read by the engine until a write is
resolved. A write that failed is resolved; one that gave up while it may
still move is not, until the engine says it finished (or the room's lease
ends). A decode rank is told its pages are released (RoomReleased) only once
nothing we wrote into them can still move.
"""

import asyncio
import concurrent.futures
import logging
import time

from prefill_node.settings import PrefillSettings
from prefill_node.transfer_worker import Digests, TransferOutcome, TransferTask, TransferWorker
from shared.errors import PoolExhausted, RejectedMessage
from shared.kv.aux_buffers import Aux
from shared.kv.borrow import Borrow, BorrowState
from shared.kv.head_split import HeadRange, kv_heads, writers
from shared.kv.layout import plan_writes
from shared.node.rank import RankRoom, RankService
from shared.room.record import Room
from shared.room.states import FailureReason, RoomState
from shared.wire import protocol

log = logging.getLogger(__name__)


class PrefillJob(RankRoom):
    def __init__(self, msg: protocol.PrefillRoom, service: "PrefillService"):
        super().__init__(msg.transfer, service.room_changed)
        self.input_ids = msg.input_ids
        self.decode_ranks = {peer.rank: peer for peer in msg.decode_ranks}
        self.targets: dict[int, HeadRange] = {}  # decode rank -> the heads we write into it
        self.requests: dict[int, protocol.TransferRequest] = {}
        self.pages: list[int] = []
        self.first_token = 0
        self.logprob = 0.0
        self.computing = False
        self.computed = False
        self.borrows: dict[int, Borrow] = {}  # decode rank -> our writes into the pages it lent
        self.told: dict[int, RoomState] = {}  # decode rank -> the furthest step it was told of

    def borrow(self, decode_rank: int) -> Borrow:
        found = self.borrows.get(decode_rank)
        if found is None:
            found = self.borrows[decode_rank] = Borrow(self.id, decode_rank)
        return found

    def any_borrow(self, state: BorrowState) -> bool:
        return any(b.state is state for b in self.borrows.values())

    @property
    def all_written(self) -> bool:
        return all(self.borrow(r).state is BorrowState.WRITTEN for r in self.targets)


class PrefillService(RankService):
    role = "prefill"
    settings: PrefillSettings
    # The room's visible progress is the decode's; the prefill reports how it ended.
    reported_states = frozenset({RoomState.SUCCESS, RoomState.FAILED})

    def set_up(self) -> None:
        s = self.settings
        # Transfer requests whose room has not reached us yet: room -> [(request, sender, deadline)].
        self.early: dict[int, list[tuple[protocol.TransferRequest, str | None, float]]] = {}
        self.node_heads = [
            kv_heads(r, s.tp_size, self.source.identity.num_kv_heads) for r in range(s.tp_size)
        ]
        # A rank that fails a room still runs its model for it: the collectives of the node's
        # ranks must pair up. A rank alone, or a source without collectives, can skip it.
        self.always_compute = s.tp_size > 1 and not self.source.inline
        self.worker = TransferWorker(
            self.rank.engine,
            self.rank.security,
            lambda outcome: self.loop.call_soon_threadsafe(self._transfer_finished, outcome),
            lambda room, d: self.loop.call_soon_threadsafe(self._write_resolved, room, d),
            s.write_timeout_s,
        )

    def shutdown(self) -> None:
        self.worker.close()  # first: its tasks may still start digests
        super().shutdown()

    def health(self) -> protocol.RankHealth:
        return protocol.RankHealth(
            rank=self.rank.index,
            free_pages=self.pool.free_pages,
            total_pages=self.pool.num_pages,
            free_aux_slots=0,
            total_aux_slots=0,
            rooms_in_flight=len(self.rooms.live),
            fenced_rooms=self.worker.quarantined,
            writes_in_flight=self.worker.quarantined + sum(map(self._writing, self.rooms.live.values())),
        )

    @staticmethod
    def _writing(room: Room) -> bool:
        return isinstance(room, PrefillJob) and room.any_borrow(BorrowState.WRITING)

    def holds(self, room: Room) -> bool:
        assert isinstance(room, PrefillJob)
        return bool(room.pages) or room.computing or room.any_borrow(BorrowState.WRITING)

    def handle_assignment(self, msg: protocol.PrefillRoom | protocol.DecodeRoom | protocol.AbortRoom) -> None:
        if isinstance(msg, protocol.PrefillRoom):
            self._on_room(msg)
        elif isinstance(msg, protocol.AbortRoom):
            self._on_abort(msg)
        else:
            raise RejectedMessage(f"a prefill node does not take {type(msg).__name__}", kind="unexpected")

    def handle_peer(self, msg: protocol.Message, aux: memoryview | None, sender: str | None) -> None:
        if isinstance(msg, protocol.TransferRequest):
            self._on_request(msg, sender)
        elif isinstance(msg, protocol.TransferRequests):
            self.take_each(msg.requests, lambda req: self._on_request(req, sender))
        elif isinstance(msg, protocol.RevokeLease):
            self._on_revoke(msg, sender)
        else:
            raise RejectedMessage(f"a prefill rank does not take {type(msg).__name__}", kind="unexpected")

    # -- messages -----------------------------------------------------------------

    def _on_room(self, msg: protocol.PrefillRoom) -> None:
        if self.rooms.find(msg.transfer) is not None:
            raise RejectedMessage("room already known", room=msg.transfer, kind="duplicate")
        job = PrefillJob(msg, self)
        self.rooms.add(job)
        try:
            for peer in msg.decode_ranks:
                heads = HeadRange(peer.kv_head_start, peer.kv_head_count)
                mine = writers(self.node_heads, heads, peer.rank).get(self.rank.index)
                if mine is not None:
                    job.targets[peer.rank] = mine
            job.pages = self.pool.alloc(self.layout.room_pages("prefill", len(msg.input_ids), 0))
        except (PoolExhausted, ValueError) as exc:
            log.warning("transfer=%d %s", job.id, exc, extra={"room": job.id})
            self.set_local(
                job,
                RoomState.FAILED,
                FailureReason.NO_CAPACITY if isinstance(exc, PoolExhausted) else FailureReason.PREFILL_FAILED,
            )
        self._compute(job)
        for req, sender, _ in self.early.pop(msg.transfer, []):
            try:
                self._on_request(req, sender)
            except RejectedMessage as exc:
                self.metrics.rejected.labels(exc.kind).inc()
                log.warning(
                    "transfer=%d dropped early request (%s): %s",
                    job.id,
                    exc.kind,
                    exc,
                    extra={"room": job.id},
                )

    def _compute(self, job: PrefillJob) -> None:
        if job.local.terminal and not self.always_compute:
            self._settle(job)
            return
        pages = job.pages or None  # a rank without pages for the room computes and stores nothing
        if self.source.inline:
            started = time.perf_counter()
            first, logprob = self.source.prefill(job.id, self.pool, job.pages, job.input_ids)
            self.pool.synchronize()
            self._kv_ready(job, first, logprob, time.perf_counter() - started)
            return
        job.computing = True
        # Submitted now, in the order the leader gave the rooms: the order of the ranks' collectives.
        future = self.model.submit(self._prefill, job.id, pages, job.input_ids)
        self.spawn(self._computed(job, future))

    def _prefill(self, room: int, pages: list[int] | None, input_ids: list[int]) -> tuple[int, float]:
        """In the model thread: the KV, synchronised before anything hands its pages to the engine."""
        result = self.source.prefill(room, self.pool, pages, input_ids)
        self.pool.synchronize()
        return result

    async def _computed(
        self, job: PrefillJob, future: "concurrent.futures.Future[tuple[int, float]]"
    ) -> None:
        started = time.perf_counter()
        try:
            first, logprob = await asyncio.wrap_future(future)
        except Exception:
            log.exception("transfer=%d prefill failed", job.id, extra={"room": job.id})
            job.computing = False
            self.set_local(job, RoomState.FAILED, FailureReason.PREFILL_FAILED)
            self._settle(job)
            return
        job.computing = False
        self._kv_ready(job, first, logprob, time.perf_counter() - started)

    def _kv_ready(self, job: PrefillJob, first_token: int, logprob: float, seconds: float) -> None:
        job.first_token, job.logprob, job.computed = first_token, logprob, True
        job.timings["prefill_s"] = seconds
        if job.local.terminal:  # failed or aborted while the model ran
            self._settle(job)
            return
        if not job.targets:  # every head this rank holds is written by another
            self.set_local(job, RoomState.SUCCESS)
            return
        self.set_local(job, RoomState.WAITING_FOR_INPUT)
        for decode_rank in job.requests:
            self._start_transfer(job, decode_rank)
            self._notify_later(job, decode_rank)

    def _on_request(self, req: protocol.TransferRequest, sender: str | None) -> None:
        self.check_rank(req.rank, req.transfer)
        job = self.rooms.live.get(req.transfer)
        if job is None:
            if self.rooms.find(req.transfer) is not None:
                raise RejectedMessage(
                    "transfer request for a finished room", room=req.transfer, kind="finished"
                )
            if sum(len(v) for v in self.early.values()) >= self.settings.max_early_requests:
                raise RejectedMessage("too many early transfer requests", room=req.transfer, kind="overload")
            # The bootstrap's hand-off may still be in flight on another socket; who sent
            # the request is checked when the room arrives.
            deadline = time.monotonic() + self.settings.early_request_ttl_s
            self.early.setdefault(req.transfer, []).append((req, sender, deadline))
            return
        assert isinstance(job, PrefillJob)
        self._validate_request(job, req, sender)
        job.requests[req.decode_rank] = req
        job.timings.setdefault("request_received_at", time.time())
        if job.computed and not job.local.terminal:
            self._start_transfer(job, req.decode_rank)
        self._notify_later(job, req.decode_rank)

    def _validate_request(self, job: PrefillJob, req: protocol.TransferRequest, sender: str | None) -> None:
        def reject(why: str, kind: str = "invalid") -> RejectedMessage:
            return RejectedMessage(f"transfer request: {why}", room=job.id, kind=kind)

        peer = job.decode_ranks.get(req.decode_rank)
        if peer is None:
            raise reject(f"decode rank {req.decode_rank} is not this room's", "bad_rank")
        self.check_sender(sender, peer, job.id)
        if req.decode_rank not in job.targets:
            raise reject(f"this rank writes nothing into decode rank {req.decode_rank}", "bad_rank")
        if req.decode_rank in job.requests:
            raise reject("duplicate", "duplicate")
        if req.layer_stride:
            raise reject("pages one layer each (a vLLM decode) cannot take kvroom's pages")
        want = peer.kv_head_count * self.layout.head_bytes
        if req.page_bytes != want:
            raise reject(f"page of {req.page_bytes} bytes, {peer.kv_head_count} heads take {want}")
        if len(req.page_indices) != self.layout.pages_for(len(job.input_ids)):
            raise reject(f"{len(req.page_indices)} pages offered, {len(job.pages)} needed")
        if any(not 0 <= p < req.num_pages for p in req.page_indices):
            raise reject(f"page index outside the peer's {req.num_pages} pages", "out_of_range")
        if len(set(req.page_indices)) != len(req.page_indices):
            raise reject("repeated page index", "out_of_range")

    def _on_abort(self, msg: protocol.AbortRoom) -> None:
        """From the bootstrap (its leader handed it on)."""
        self.early.pop(msg.transfer, None)
        job = self.rooms.find(msg.transfer)
        if not isinstance(job, PrefillJob):  # never seen here, or ended before it came
            if job is None:
                self.rooms.ended_unseen(msg.transfer, msg.reason)
            return
        self._stop(job, msg.reason)

    def _on_revoke(self, msg: protocol.RevokeLease, sender: str | None) -> None:
        """A decode rank of the room wants the pages it lent back: the room failed there."""
        job = self.rooms.find(msg.transfer)
        if not isinstance(job, PrefillJob):  # never seen here, or ended before it came
            raise RejectedMessage(
                "revocation for a room not known here", room=msg.transfer, kind="unknown_room"
            )
        self.check_rank(msg.rank, msg.transfer)
        peers = [p for p in job.decode_ranks.values() if p.public_key == sender]
        if not peers:
            raise RejectedMessage(
                "revocation from a key that is not the room's", room=job.id, kind="unauthorized"
            )
        if job.state.terminal and job.borrow(peers[0].rank).state in (
            BorrowState.WRITTEN,
            BorrowState.RELEASED,
        ):
            # Already done writing: say so, so the decode can stop fencing its pages.
            self._release_to(job, peers[0].rank)
            return
        self._stop(job, msg.reason)

    def _stop(self, job: PrefillJob, reason: str) -> None:
        self.worker.cancel(job.id)
        self.set_local(job, RoomState.FAILED, reason)
        if job.state.terminal:
            self._settle(job)

    # -- writes -----------------------------------------------------------------------

    def _start_transfer(self, job: PrefillJob, decode_rank: int) -> None:
        req = job.requests[decode_rank]
        peer = job.decode_ranks[decode_rank]
        heads, mine = job.targets[decode_rank], self.source.kv_heads
        hb = self.layout.head_bytes
        writes = plan_writes(
            self.pool.base_ptr,
            self.layout.page_bytes,
            job.pages,
            req.kv_base_ptr,
            req.page_bytes,
            req.page_indices,
            (heads.start - mine.start) * hb,
            (heads.start - peer.kv_head_start) * hb,
            heads.count * hb,
        )
        job.timings["engine_writes"] = job.timings.get("engine_writes", 0) + len(writes)
        # Done and aux travel in one message, which the worker sends once every write completed.
        done = protocol.DoneAux(
            transfer=job.id,
            rank=decode_rank,
            prefill_rank=self.rank.index,
            aux_slot=req.aux_slot,
            pages_written=len(req.page_indices),
            bytes_written=0,
            completed_at=0.0,
            digest_kind=self.digester.kind if self.digester is not None else "xxh3",
        )
        aux = Aux(job.id, job.first_token, len(job.input_ids), job.logprob).pack()
        digests = None
        if self.digester is not None:
            digests = Digests(self.digester, job.pages, (heads.start - mine.start) * hb, heads.count * hb)
        job.borrow(decode_rank).to(BorrowState.WRITING)
        self.worker.submit(TransferTask(job.id, decode_rank, peer, writes, done, aux, digests))
        self.set_local(job, RoomState.TRANSFERRING)

    def _notify_later(self, job: PrefillJob, decode_rank: int) -> None:
        delay = self.settings.progress_notice_s
        if delay > 0:
            self.loop.call_later(delay, self._notify, job, decode_rank)
        else:
            self._notify(job, decode_rank)

    def _notify(self, job: PrefillJob, decode_rank: int) -> None:
        """Tell a decode rank what it has not heard of its request: accepted, and the write begun."""
        borrow = job.borrow(decode_rank)
        if job.local.terminal or borrow.state is BorrowState.WRITTEN:
            return  # its done+aux, or the room's end, says more
        told = job.told.get(decode_rank, RoomState.BOOTSTRAPPING)
        peer = job.decode_ranks[decode_rank]
        if told < RoomState.WAITING_FOR_INPUT:
            self.rank.send(peer, protocol.TransferAccepted(job.id, decode_rank, self.rank.index))
            told = RoomState.WAITING_FOR_INPUT
        if borrow.state is BorrowState.WRITING and told < RoomState.TRANSFERRING:
            self.rank.send(peer, protocol.TransferStarted(job.id, decode_rank, self.rank.index))
            told = RoomState.TRANSFERRING
        job.told[decode_rank] = told

    def _transfer_finished(self, outcome: TransferOutcome) -> None:
        """On the event loop, after the worker wrote into one decode rank (and sent its done+aux)."""
        task = outcome.task
        job = self.rooms.find(task.transfer)
        assert isinstance(job, PrefillJob)
        borrow = job.borrow(task.decode_rank)
        if outcome.unresolved:
            log.warning(
                "transfer=%d KV write gave up while it may still move: %s",
                job.id,
                outcome.error,
                extra={"room": job.id},
            )
            borrow.gave_up(time.monotonic() + self.settings.lease_timeout_s)
            self.set_local(job, RoomState.FAILED, FailureReason.TRANSFER_TIMEOUT)
        elif outcome.error is not None:
            log.warning("transfer=%d KV write failed: %s", job.id, outcome.error, extra={"room": job.id})
            borrow.to(BorrowState.STOPPED)
            self.set_local(job, RoomState.FAILED, FailureReason.TRANSFER_FAILED)
        elif outcome.sent:
            borrow.to(BorrowState.WRITTEN)
            job.timings["transfer_s"] = job.timings.get("transfer_s", 0.0) + outcome.seconds
            job.timings["bytes_written"] = job.timings.get("bytes_written", 0) + outcome.written
            # Wall-clock stages of the first write (one host's clock: the benchmark's breakdown).
            job.timings.setdefault("write_started_at", outcome.started_at)
            job.timings.setdefault("write_done_at", outcome.done_at)
            self.metrics.transfer_bytes.inc(outcome.written)
            self.metrics.transfer_seconds.observe(outcome.seconds)
            if job.all_written:
                self.set_local(job, RoomState.SUCCESS)
        else:
            borrow.to(BorrowState.STOPPED)
            if not outcome.cancelled:
                self.set_local(job, RoomState.FAILED, FailureReason.PEER_LOST)  # done+aux could not be queued
        self._settle(job)

    def _write_resolved(self, room: protocol.TransferId, decode_rank: int) -> None:
        """A write that had given up is over now: nothing of it moves any more."""
        job = self.rooms.find(room)
        if isinstance(job, PrefillJob) and job.borrow(decode_rank).state is BorrowState.UNRESOLVED:
            log.info("transfer=%d the write that gave up has ended", room, extra={"room": room})
            job.borrow(decode_rank).to(BorrowState.STOPPED)
            self._settle(job)

    # -- the agreed states ----------------------------------------------------------

    def on_agreed(self, room: protocol.TransferId, state: RoomState, reason: str | None) -> None:
        job = self.rooms.find(room)
        if not isinstance(job, PrefillJob) or job.state.terminal:
            return
        if state is RoomState.FAILED:
            self.worker.cancel(job.id)
            job.fail(reason or FailureReason.ABORTED)
        else:
            job.advance_to(state)
        self._settle(job)

    def _settle(self, job: PrefillJob) -> None:
        """Once the room ended and our work for it stopped: free our pages, release the decode's."""
        if not job.state.terminal or job.computing or job.any_borrow(BorrowState.WRITING):
            return  # a callback comes back here when they end
        for decode_rank in job.targets:
            if job.borrow(decode_rank).may_release:
                self._release_to(job, decode_rank)
        if job.any_borrow(BorrowState.UNRESOLVED):
            return  # our pages may still be read by a write that gave up
        self.worker.forget(job.id)
        if job.pages:
            self.pool.free(job.pages)
            job.pages = []
        self.finished(job)

    def _release_to(self, job: PrefillJob, decode_rank: int) -> None:
        borrow = job.borrow(decode_rank)
        if borrow.state is BorrowState.RELEASED:
            return
        wrote = borrow.state is not BorrowState.IDLE
        borrow.to(BorrowState.RELEASED)
        reason = "" if job.state is RoomState.SUCCESS else job.reason or ""
        msg = protocol.RoomReleased(
            transfer=job.id, rank=decode_rank, prefill_rank=self.rank.index, reason=reason, wrote=wrote
        )
        self.rank.send(job.decode_ranks[decode_rank], msg)

    # -- time -------------------------------------------------------------------------

    def check_timeouts(self, now: float) -> None:
        for job in list(self.rooms.live.values()):
            assert isinstance(job, PrefillJob)
            waited = now - job.local_since
            if job.local is RoomState.WAITING_FOR_INPUT and waited > self.settings.waiting_timeout_s:
                self.set_local(job, RoomState.FAILED, FailureReason.WAITING_TIMEOUT)
            expired = [b for b in job.borrows.values() if b.expire_if_due(now)]
            if expired:
                log.warning(
                    "transfer=%d lease ended with writes still unresolved; pages reused",
                    job.id,
                    extra={"room": job.id},
                )
                self._settle(job)
        for room, waiting in list(self.early.items()):
            kept = [entry for entry in waiting if entry[2] >= now]
            for _ in range(len(waiting) - len(kept)):
                self.metrics.rejected.labels("expired").inc()
                log.warning(
                    "transfer=%d transfer request expired before its room arrived", room, extra={"room": room}
                )
            if kept:
                self.early[room] = kept
            else:
                del self.early[room]

    async def background(self) -> None:
        while True:
            self.check_timeouts(time.monotonic())
            await asyncio.sleep(0.2)
