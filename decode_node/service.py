"""A decode rank: lends KV pages to the prefill ranks that write its heads, takes done+aux, decides SUCCESS.

Per room, on this rank: BOOTSTRAPPING until every prefill rank that writes into
it accepted the transfer request, WAITING_FOR_INPUT until one reports its writes
began, TRANSFERRING until every one of them sent done+aux and the gate
(``shared.room.gate.rank_verdict``) calls the records that landed in this rank's
slots intact, this room's, and in agreement: then the rank is ready. The room
becomes SUCCESS only when every rank of the node is ready with the same record
(``shared.node.agreement``); then every rank decodes, in the order they agreed.
Each waiting state has its own timeout and failure reason. A prefill rank whose
done+aux goes out soon after the request sends no accept or start notice: the
room passes through those states when its done+aux arrives.

Ownership of pages (``shared.kv.lease``): each transfer request lends the room's
pages to one prefill rank, until it sends done+aux (its writes completed) or
RoomReleased (none of its writes can still move). Until then a failed room's
pages stay fenced, however it failed, or until the lease expires; the pool
refuses to free a page under an open lease. Aux slots are freed at once on any
end: the aux never arrives by DMA.
"""

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable

from decode_node.settings import DecodeSettings
from shared.errors import PoolExhausted, RejectedMessage
from shared.kv import tcp_drain
from shared.kv.aux_buffers import AUX_RECORD, AuxBuffers, record_digest
from shared.kv.head_split import HeadRange, writers
from shared.kv.lease import Lease, LeaseState
from shared.models.source import Decoded, DecodeRequest
from shared.node.rank import RankRoom, RankService
from shared.room.gate import Expected, Invalid, Landed, Pending, Ready, rank_verdict
from shared.room.record import Room
from shared.room.states import FailureReason, RoomState
from shared.wire import protocol
from shared.wire.per_turn import PerTurn, chunks

log = logging.getLogger(__name__)

# Page indices are most of a transfer request's bytes: this many stay far below a body's limit.
MAX_PAGES_PER_MESSAGE = 100_000


class DecodeJob(RankRoom):
    def __init__(self, msg: protocol.DecodeRoom, service: "DecodeService"):
        super().__init__(msg.transfer, service.room_changed)
        self.prompt_len = msg.prompt_len
        self.max_new_tokens = msg.max_new_tokens
        self.stop = msg.stop
        self.stream = msg.stream
        self.prefill_ranks = {peer.rank: peer for peer in msg.prefill_ranks}
        self.writers: dict[int, HeadRange] = {}  # prefill rank -> the heads it writes here
        self.pages: list[int] = []
        self.slots: dict[int, int] = {}  # prefill rank -> its aux slot
        self.unaccepted: set[int] = set()  # prefill ranks that have not accepted the request
        self.landed: dict[int, Landed] = {}
        self.checking: set[int] = set()  # prefill ranks whose pages are being digested
        self.completed_at: dict[int, float] = {}
        self.aux_missing_since: float | None = None
        self.leases: dict[int, Lease] = {}  # prefill rank -> the pages lent to its writes
        self.requested_at = 0.0
        self.first_token = 0
        self.decoding = False
        self.abort_reason: str | None = None  # aborted while decoding: the output is dropped

    @property
    def lent(self) -> bool:
        """Whether a prefill rank's write may still land in the room's pages."""
        return any(lease.open for lease in self.leases.values())


class DecodeService(RankService):
    role = "decode"
    settings: DecodeSettings
    # A room's done+aux goes before other waiting messages: it ends a room and frees its
    # pages, and under load it would otherwise wait behind new rooms' messages.
    urgent = staticmethod(protocol.is_done_aux)

    def set_up(self) -> None:
        self.aux = AuxBuffers(self.settings.aux_slots)
        # Failed rooms whose pages are still lent out, until released or timed out.
        self.fenced: dict[int, DecodeJob] = {}
        # Rooms whose writers are gone, until nothing they sent over TCP is still unread.
        tcp = self.settings.transport == "tcp"
        self._landing = tcp_drain.AfterLanding(self.loop, tcp, lambda job: job.lent, self._writes_ended)
        self.requests: PerTurn[protocol.TransferRequest] = PerTurn(self._send_requests)

    def health(self) -> protocol.RankHealth:
        return protocol.RankHealth(
            rank=self.rank.index,
            free_pages=self.pool.free_pages,
            total_pages=self.pool.num_pages,
            free_aux_slots=self.aux.free_slots,
            total_aux_slots=self.aux.slots,
            rooms_in_flight=len(self.rooms.live),
            fenced_rooms=len(self.fenced),
            fenced_pages=sum(len(job.pages) for job in self.fenced.values()),
            lent_pages_returned=self.pool.closed_lent_pages[LeaseState.RETURNED],
            lent_pages_revoked=self.pool.closed_lent_pages[LeaseState.REVOKED],
            lent_pages_expired=self.pool.closed_lent_pages[LeaseState.EXPIRED],
        )

    def holds(self, room: Room) -> bool:
        return isinstance(room, DecodeJob) and room.decoding

    def handle_assignment(self, msg: protocol.PrefillRoom | protocol.DecodeRoom | protocol.AbortRoom) -> None:
        if isinstance(msg, protocol.DecodeRoom):
            self._on_room(msg)
        elif isinstance(msg, protocol.AbortRoom):
            self._on_abort(msg)
        else:
            raise RejectedMessage(f"a decode node does not take {type(msg).__name__}", kind="unexpected")

    def handle_peer(self, msg: protocol.Message, aux: memoryview | None, sender: str | None) -> None:
        if isinstance(msg, protocol.DoneAux):
            self._on_done(msg, aux, sender)
        elif isinstance(msg, protocol.TransferAccepted):
            self._on_accepted(msg, sender)
        elif isinstance(msg, protocol.TransferStarted):
            self._on_started(msg, sender)
        elif isinstance(msg, protocol.RoomReleased):
            self._on_released(msg, sender)
        elif isinstance(msg, protocol.AbortRoom):
            raise RejectedMessage(
                "an abort from a key that is not the bootstrap's", room=msg.transfer, kind="unauthorized"
            )
        else:
            raise RejectedMessage(f"a decode rank does not take {type(msg).__name__}", kind="unexpected")

    # -- messages -----------------------------------------------------------------

    def _job_for(
        self, room: protocol.TransferId, rank: int, prefill_rank: int, sender: str | None
    ) -> DecodeJob:
        """The live room a prefill message addresses, once it is known to come from that prefill rank."""
        self.check_rank(rank, room)
        job = self.rooms.live.get(room)
        if job is None:
            known = self.rooms.find(room) is not None or room in self.fenced
            raise RejectedMessage(
                f"message for a {'finished' if known else 'unknown'} room",
                room=room,
                kind="finished" if known else "unknown_room",
            )
        assert isinstance(job, DecodeJob)
        if prefill_rank not in job.writers:
            raise RejectedMessage(
                f"prefill rank {prefill_rank} does not write into this rank", room=room, kind="bad_rank"
            )
        self.check_sender(sender, job.prefill_ranks[prefill_rank], room)
        return job

    def _on_room(self, msg: protocol.DecodeRoom) -> None:
        if self.rooms.find(msg.transfer) is not None or msg.transfer in self.fenced:
            raise RejectedMessage("room already known", room=msg.transfer, kind="duplicate")
        job = DecodeJob(msg, self)
        self.rooms.add(job)
        ranks = [job.prefill_ranks.get(r) for r in range(len(job.prefill_ranks))]
        try:
            if None in ranks:
                raise ValueError("prefill ranks are not numbered 0..n-1")
            heads = [HeadRange(p.kv_head_start, p.kv_head_count) for p in ranks if p is not None]
            job.writers = writers(heads, self.source.kv_heads, self.rank.index)
        except ValueError as exc:
            log.warning(
                "transfer=%d prefill ranks do not map onto ours: %s", job.id, exc, extra={"room": job.id}
            )
            self.set_local(job, RoomState.FAILED, FailureReason.AUX_INVALID)
            return
        try:
            job.pages = self.pool.alloc(self.layout.room_pages("decode", msg.prompt_len, msg.max_new_tokens))
            for prefill_rank in job.writers:
                job.slots[prefill_rank] = self.aux.alloc()
        except PoolExhausted as exc:
            log.warning("transfer=%d %s", job.id, exc, extra={"room": job.id})
            self.set_local(job, RoomState.FAILED, FailureReason.NO_CAPACITY)
            return
        kv_pages = job.pages[: self.layout.pages_for(msg.prompt_len)]
        job.requested_at = time.perf_counter()
        job.timings["requested_at"] = time.time()
        for prefill_rank, slot in job.slots.items():
            request = protocol.TransferRequest(
                transfer=job.id,
                rank=prefill_rank,
                decode_rank=self.rank.index,
                kv_base_ptr=self.pool.base_ptr,
                num_pages=self.pool.num_pages,
                page_bytes=self.layout.page_bytes,
                page_indices=kv_pages,
                aux_slot=slot,
            )
            self.requests.add(job.prefill_ranks[prefill_rank], request)
            job.unaccepted.add(prefill_rank)
            job.leases[prefill_rank] = self.pool.lend(job.id, prefill_rank, kv_pages)

    def _send_requests(self, peer: protocol.PeerRank, requests: list[protocol.TransferRequest]) -> None:
        """A turn's transfer requests to one prefill rank: alone as they are, several in one message."""
        for run in chunks(
            requests, lambda r: len(r.page_indices), protocol.MAX_ASSIGNMENTS, MAX_PAGES_PER_MESSAGE
        ):
            msg = run[0] if len(run) == 1 else protocol.TransferRequests(run)
            if self.rank.send(peer, msg):
                continue
            for request in run:
                job = self.rooms.live.get(request.transfer)
                if job is not None:
                    assert isinstance(job, DecodeJob)
                    self.set_local(job, RoomState.FAILED, FailureReason.PEER_LOST)

    def _progress_job(
        self, room: protocol.TransferId, rank: int, prefill_rank: int, sender: str | None
    ) -> DecodeJob | None:
        """The room a progress notice is for; None for a room that already ended.

        Accept and start notices can be overtaken by the done+aux they precede,
        so one for a finished room is expected and dropped without complaint.
        """
        if room not in self.rooms.live and (self.rooms.find(room) is not None or room in self.fenced):
            log.debug("transfer=%d progress notice after the room ended", room, extra={"room": room})
            return None
        return self._job_for(room, rank, prefill_rank, sender)

    def _on_accepted(self, msg: protocol.TransferAccepted, sender: str | None) -> None:
        job = self._progress_job(msg.transfer, msg.rank, msg.prefill_rank, sender)
        if job is None:
            return
        if msg.prefill_rank not in job.unaccepted:
            raise RejectedMessage("duplicate accept", room=job.id, kind="duplicate")
        job.unaccepted.discard(msg.prefill_rank)
        if not job.unaccepted:
            self.set_local(job, RoomState.WAITING_FOR_INPUT)

    def _on_started(self, msg: protocol.TransferStarted, sender: str | None) -> None:
        job = self._progress_job(msg.transfer, msg.rank, msg.prefill_rank, sender)
        if job is not None:
            self.set_local(job, RoomState.TRANSFERRING)

    def _on_done(self, msg: protocol.DoneAux, record: memoryview | None, sender: str | None) -> None:
        late = self.fenced.get(msg.transfer)
        if late is not None and msg.transfer not in self.rooms.live:
            self._on_late_done(late, msg, sender)
            return
        job = self._job_for(msg.transfer, msg.rank, msg.prefill_rank, sender)
        job.timings.setdefault("done_received_at", time.time())
        p = msg.prefill_rank
        earlier = job.landed.get(p)
        if p in job.checking or (earlier is not None and not self._needs_aux(earlier)):
            raise RejectedMessage(f"duplicate done from prefill rank {p}", room=job.id, kind="duplicate")
        if msg.aux_slot != job.slots[p]:
            # Bounds and ownership checked before anything is copied.
            raise RejectedMessage(
                f"aux slot {msg.aux_slot} is not this room's", room=job.id, kind="out_of_range"
            )
        landed = None
        if record is not None and len(record) == AUX_RECORD.size:
            landed = self.aux.write(msg.aux_slot, record)
        job.leases[p].returned()  # done is sent only once every write of that rank completed
        job.completed_at[p] = msg.completed_at
        if not self.settings.verify_kv:
            self._landed(job, p, Landed(landed, msg.pages_written, True))
            return
        if msg.digests is None or len(msg.digests) != msg.pages_written:
            log.warning("transfer=%d no page digests from prefill rank %d", job.id, p, extra={"room": job.id})
            self._landed(job, p, Landed(landed, msg.pages_written, False))
            return
        # Our pages as they are now, with the prefill's kind of digest: a small room's at once,
        # a large one's off the event loop.
        assert self.digester is not None
        heads, mine = job.writers[p], self.source.kv_heads
        hb = self.layout.head_bytes
        pages = job.pages[: msg.pages_written]
        pending = self.digester.start(
            pages, (heads.start - mine.start) * hb, heads.count * hb, msg.digest_kind
        )
        if pending.done():
            self._compare_digests(job, p, msg, landed, pending)
            return
        job.checking.add(p)
        self.spawn(self._await_digests(job, p, msg, landed, pending))

    @staticmethod
    def _needs_aux(landed: Landed) -> bool:
        from shared.kv.aux_buffers import unpack

        return landed.record is None or unpack(landed.record) is None

    async def _await_digests(
        self,
        job: DecodeJob,
        p: int,
        msg: protocol.DoneAux,
        landed: bytes | None,
        pending: "concurrent.futures.Future[list[int]]",
    ) -> None:
        try:
            with contextlib.suppress(Exception):  # its failure is _compare_digests' to tell
                await asyncio.wrap_future(pending)
        finally:
            job.checking.discard(p)
        if job.id in self.rooms.live:
            self._compare_digests(job, p, msg, landed, pending)

    def _compare_digests(
        self,
        job: DecodeJob,
        p: int,
        msg: protocol.DoneAux,
        landed: bytes | None,
        pending: "concurrent.futures.Future[list[int]]",
    ) -> None:
        try:
            ours = pending.result()
        except Exception:  # pages that could not be digested are not verified
            log.exception(
                "transfer=%d could not digest the pages of prefill rank %d", job.id, p, extra={"room": job.id}
            )
            ours = None
        intact = ours == msg.digests
        if ours is not None and not intact:
            pairs = enumerate(zip(ours, msg.digests or [], strict=False))
            bad = next((i for i, (a, b) in pairs if a != b), min(len(ours), len(msg.digests or [])))
            log.error(
                "transfer=%d page %d from prefill rank %d does not match its digest",
                job.id,
                bad,
                p,
                extra={"room": job.id},
            )
        self._landed(job, p, Landed(landed, msg.pages_written, intact))

    def _landed(self, job: DecodeJob, p: int, landed: Landed) -> None:
        """Fold one prefill rank's done+aux into the room and ask the gate."""
        job.landed[p] = landed
        expected = Expected(
            job.id,
            job.prompt_len,
            self.source.identity.vocab_size,
            self.layout.pages_for(job.prompt_len),
            frozenset(job.writers),
        )
        verdict = rank_verdict(expected, job.landed)
        if isinstance(verdict, Invalid):
            log.warning("transfer=%d aux rejected: %s", job.id, verdict.detail, extra={"room": job.id})
            self.set_local(job, RoomState.FAILED, verdict.reason)
            return
        if isinstance(verdict, Pending):
            if self._needs_aux(landed):
                kind = "aux_missing" if landed.record is None else "aux_corrupt"
                self.metrics.rejected.labels(kind).inc()
                log.warning(
                    "transfer=%d done from prefill rank %d came without an intact aux record (%s); waiting",
                    job.id,
                    p,
                    kind,
                    extra={"room": job.id},
                )
                if job.aux_missing_since is None:
                    job.aux_missing_since = time.monotonic()
            self.set_local(job, RoomState.TRANSFERRING)
            return
        assert isinstance(verdict, Ready)
        job.first_token = verdict.aux.first_token
        self.set_local(job, RoomState.SUCCESS, digest=record_digest(verdict.record))

    def _on_late_done(self, job: DecodeJob, msg: protocol.DoneAux, sender: str | None) -> None:
        """A prefill rank's writes for a room that failed here completed: into pages still fenced for
        it, which is why they were fenced. That rank's lease ends; the record is not looked at."""
        self.check_rank(msg.rank, msg.transfer)
        lease = job.leases.get(msg.prefill_rank)
        if lease is None or not lease.open:
            raise RejectedMessage("done for a finished room", room=msg.transfer, kind="finished")
        self.check_sender(sender, job.prefill_ranks[msg.prefill_rank], msg.transfer)
        self.metrics.late_writes.inc()
        log.info(
            "transfer=%d writes of prefill rank %d completed after the room failed, into its fenced pages",
            job.id,
            msg.prefill_rank,
            extra={"room": job.id},
        )
        lease.returned()
        self._release(job)

    def _on_released(self, msg: protocol.RoomReleased, sender: str | None) -> None:
        self.check_rank(msg.rank, msg.transfer)
        job = self.fenced.get(msg.transfer) or self.rooms.live.get(msg.transfer)
        lease = job.leases.get(msg.prefill_rank) if isinstance(job, DecodeJob) else None
        if not isinstance(job, DecodeJob) or lease is None or not lease.open:
            raise RejectedMessage(
                "release for a room holding no lease", room=msg.transfer, kind="unknown_room"
            )
        self.check_sender(sender, job.prefill_ranks[msg.prefill_rank], msg.transfer)
        if msg.wrote and job.id in self.fenced:
            self.metrics.late_writes.inc()  # its writes outlived the room: they landed in fenced pages
        lease.returned()
        if msg.reason and not job.state.terminal:
            # The prefill gave the room up: it cannot succeed any more.
            self.set_local(job, RoomState.FAILED, msg.reason)
        # An empty reason: that rank finished writing; the room's own timeouts still rule.
        if job.state.terminal:
            self._release(job)

    def _on_abort(self, msg: protocol.AbortRoom) -> None:
        fenced = self.fenced.get(msg.transfer)
        job = self.rooms.live.get(msg.transfer) or fenced
        if msg.peer_gone and isinstance(job, DecodeJob):
            self._landing.add(job)
        if fenced is not None:  # failed before: its pages go back once no writer holds them
            self._release(fenced)
            return
        if job is None:
            if not msg.peer_gone and self.rooms.find(msg.transfer) is None:
                self.rooms.ended_unseen(msg.transfer, msg.reason)
            return
        assert isinstance(job, DecodeJob)
        if job.state is RoomState.SUCCESS:
            # Ended now, and said so: a node that drains exits without waiting for the decode.
            # Every rank still decodes to the end (their collectives pair up); the output is dropped.
            if job.outcome is None:
                job.abort_reason = msg.reason
                job.end("failed", msg.reason)
                self.metrics.failures.labels(msg.reason).inc()
            return
        self.set_local(job, RoomState.FAILED, msg.reason)

    # -- the agreed states ----------------------------------------------------------

    def on_agreed(self, room: protocol.TransferId, state: RoomState, reason: str | None) -> None:
        job = self.rooms.live.get(room)
        if not isinstance(job, DecodeJob) or job.state.terminal:  # decoding, or ended
            return
        if state is RoomState.FAILED:
            self._failed(job, reason or FailureReason.ABORTED)
            return
        # A room that succeeded stays live while it decodes: an abort or a drain must find it.
        job.decoding = state is RoomState.SUCCESS
        job.advance_to(state)
        if state is RoomState.SUCCESS:
            self._succeeded(job)

    def _succeeded(self, job: DecodeJob) -> None:
        job.timings["request_to_success_s"] = time.perf_counter() - job.requested_at
        job.timings["success_at"] = time.time()
        done_at = max(job.completed_at.values(), default=time.time())
        aux_latency = max(0.0, time.time() - done_at)
        job.timings["aux_latency_s"] = aux_latency
        self.metrics.aux_latency.observe(aux_latency)
        self._free_slots(job)
        on_token = self._streamer(job) if job.stream else None
        req = DecodeRequest(
            job.id, job.pages, job.prompt_len, job.first_token, job.max_new_tokens, job.stop, on_token
        )
        if self.source.inline:
            self.spawn(self._decoded(job, None, req))
        else:
            # Submitted now, in the agreed order: the order of the ranks' collectives.
            self.spawn(self._decoded(job, self.model.submit(self._decode, req), req))

    def _decode(self, req: DecodeRequest) -> tuple[Decoded, float]:
        """In the model thread: the decode, and how long it took there (not counting its wait)."""
        started = time.perf_counter()
        return self.source.decode(self.pool, req), time.perf_counter() - started

    def _streamer(self, job: DecodeJob) -> Callable[[int], None]:
        offset = 0

        def on_token(token: int) -> None:
            nonlocal offset
            self.loop.call_soon_threadsafe(self.reports.tokens, job.id, offset, [token])
            offset += 1

        return on_token

    async def _decoded(
        self,
        job: DecodeJob,
        future: "concurrent.futures.Future[tuple[Decoded, float]] | None",
        req: DecodeRequest,
    ) -> None:
        outcome: str = "completed"
        reason: str | None = None
        try:
            if future is None:
                result, seconds = self._decode(req)
            else:
                result, seconds = await asyncio.wrap_future(future)
            job.output_ids, job.finish_reason = result.output_ids, result.finish_reason
            job.timings["decode_s"] = seconds
        except Exception:
            log.exception("transfer=%d decode failed", job.id, extra={"room": job.id})
            outcome, reason = "failed", FailureReason.DECODE_FAILED
        finally:
            job.decoding = False
            self._release(job)
        if job.abort_reason is not None:
            job.output_ids = None  # the room ended when it was aborted
        else:
            job.end(outcome, reason)
            if outcome == "failed":
                self.metrics.failures.labels(reason or "unknown").inc()
        self.finished(job)

    def _failed(self, job: DecodeJob, reason: str) -> None:
        if not job.fail(reason):
            return
        # Ask prefill ranks that still hold our pages for them back; they answer with a release.
        # The requests of this turn go first: a revocation must not overtake the request it cancels.
        self.requests.flush()
        for prefill_rank, lease in job.leases.items():
            if lease.open:
                revoke = protocol.RevokeLease(transfer=job.id, rank=prefill_rank, reason=str(reason))
                self.rank.send(job.prefill_ranks[prefill_rank], revoke)
                lease.ask_back(self.settings.lease_timeout_s)
        self._release(job)

    def _writes_ended(self, jobs: list[DecodeJob]) -> None:
        """The writers of these rooms are gone (their node left, or another took its id), and what
        they sent has landed: their leases close, and the rooms fenced for them are released."""
        for job in jobs:
            for lease in job.leases.values():
                lease.revoke()
            if self.fenced.get(job.id) is job:
                self._release(job)

    # -- release --------------------------------------------------------------------

    def _free_slots(self, job: DecodeJob) -> None:
        for slot in job.slots.values():
            self.aux.free(slot)  # aux never arrives by DMA: safe at once
        job.slots.clear()

    def _release(self, job: DecodeJob) -> None:
        """Give back what the room holds, as far as no peer or worker still uses it."""
        self._free_slots(job)
        if job.decoding or not job.pages:
            return
        if job.lent:
            self.fenced[job.id] = job
            return
        self.fenced.pop(job.id, None)
        self.pool.free(job.pages)
        job.pages = []

    # -- time -------------------------------------------------------------------------

    def _timed_out(self, job: DecodeJob, now: float) -> FailureReason | None:
        s = self.settings
        waited = now - job.local_since
        if job.local is RoomState.BOOTSTRAPPING and waited > s.bootstrap_timeout_s:
            return FailureReason.BOOTSTRAP_TIMEOUT
        if job.local is RoomState.WAITING_FOR_INPUT and waited > s.waiting_timeout_s:
            return FailureReason.WAITING_TIMEOUT
        if job.local is RoomState.TRANSFERRING:
            if job.aux_missing_since is not None and now - job.aux_missing_since > s.aux_timeout_s:
                return FailureReason.AUX_TIMEOUT
            if waited > s.transfer_timeout_s:
                return FailureReason.TRANSFER_TIMEOUT
        return None

    def check_timeouts(self, now: float) -> None:
        for job in list(self.rooms.live.values()):
            assert isinstance(job, DecodeJob)
            reason = self._timed_out(job, now)
            if reason is not None:
                self.set_local(job, RoomState.FAILED, reason)
        for job in list(self.fenced.values()):
            expired = [rank for rank, lease in job.leases.items() if lease.expire_if_due(now)]
            if expired:
                log.warning(
                    "transfer=%d lease expired with no answer from prefill ranks %s",
                    job.id,
                    expired,
                    extra={"room": job.id},
                )
                self._release(job)

    async def background(self) -> None:
        while True:
            self.check_timeouts(time.monotonic())
            await asyncio.sleep(0.2)
