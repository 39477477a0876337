"""The scheduler half of the connector: a vLLM server's rooms, and the node the bootstrap knows.

It runs in vLLM's engine-core process. For vLLM it answers which prompts load from the other
side and hands the workers each step's plan; for kvroom it is the node: it registers the server
with the bootstrap (every worker's rank, from vLLM's handshake), beats, and reports each room's
state from its own CURVE key. A decode room is SUCCESS only once vLLM's workers all reported its
load finished without a failure, which each worker decided with kvroom's gate.

vLLM calls it from its engine thread; the node (registration, heartbeats, reports) lives on an
event loop of its own, and every room record is changed there.
"""

import asyncio
import collections
import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
import vllm
from vllm.v1.request import Request, RequestStatus

from kvroom_vllm.messages import Load, RankHandshake, Send, StepPlan, TransferGrant, WorkerReport, room_params
from kvroom_vllm.settings import VllmNodeSettings
from kvroom_vllm.worker import writes_may_move
from shared.cli import VERSION
from shared.kv import tcp_drain
from shared.models.files import tokenizer_digest, weights_digest
from shared.node.builder import LEAVE_TIMEOUT_S, WRITES_SETTLE_S
from shared.node.membership import Membership
from shared.node.reports import BootstrapLink
from shared.room.record import Room, RoomTable
from shared.room.states import FailureReason, RoomState
from shared.wire import grants, protocol
from shared.wire.registration import Heartbeat, ModelIdentity, NodeRegistration, RankStatus
from shared.wire.security import ZapHandler, security_for
from shared.wire.zmq_io import PushSockets

log = logging.getLogger(__name__)

# Requests that end a prompt's use on a prefill server with its KV whole, to be sent.
PROMPT_COMPUTED = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


@dataclass
class Tracked:
    room: TransferGrant
    loading: bool = False  # decode: its load was handed to the workers and has not finished
    blocks: tuple[int, ...] = ()  # decode: the blocks it loads into
    ended: bool = False  # vLLM finished the request while its load was still going


class SchedulerHalf:
    def __init__(self, identity: ModelIdentity, settings: VllmNodeSettings, role: str, num_blocks: int):
        self.settings = settings
        self.role = role
        self.node_id = settings.resolved_node_id(f"vllm-{role}")
        self.identity = identity
        self.num_blocks = num_blocks
        self._requests: dict[str, Tracked] = {}
        self._granted: dict[str, TransferGrant] = {}  # requests whose parameters were checked
        self._refused: set[str] = set()  # requests whose parameters were not the bootstrap's
        self._first_use = grants.FirstUse()
        self._plan = StepPlan()
        # Transfers whose writers are gone, from the node's thread to the next step's plan.
        self._writers_gone: collections.deque[protocol.TransferId] = collections.deque()
        self._failures: dict[str, str] = {}  # decode loads that failed on some worker, until all finished
        self._ready: dict[str, int] = {}  # decode loads: the aux record digest the first worker had
        self._free_blocks = lambda: 0
        self.security = security_for(settings.zmq_security, settings.curve_key_file)
        self.rooms = RoomTable()
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._ranks: list[protocol.PeerRank] = []

    # -- vLLM's engine thread: the node ------------------------------------------------

    def set_free_blocks(self, free_blocks: Any) -> None:
        self._free_blocks = free_blocks

    def start(self, handshakes: dict[int, RankHandshake]) -> None:
        """Every worker's rank is known: register with the bootstrap and keep beating."""
        ranks = [protocol.PeerRank(**handshakes[r].peer) for r in sorted(handshakes)]
        if [r.rank for r in ranks] != list(range(len(ranks))):
            raise ValueError(f"vLLM's workers gave ranks {[r.rank for r in ranks]}")
        self._ranks = ranks
        self.num_blocks = min(h.num_blocks for h in handshakes.values())
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="kvroom-node", daemon=True)
        self._thread.start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        import zmq

        context = zmq.Context()
        zap = ZapHandler(context) if self.security.keys else None
        self.push = PushSockets(context, self.security)
        self.link = BootstrapLink(self.node_id, self.push.send, self._loop)
        self.link.live = self.rooms.live
        self.membership = Membership(
            self.settings,
            self.node_id,
            self.link,
            self.registration,
            self.heartbeat,
            lambda: list(self.rooms.live.values()),
            self._orphaned,
            self._writers_gone.extend,
        )
        task = self._loop.create_task(self.membership.run())
        ready.set()
        try:
            self._loop.run_forever()
        finally:
            task.cancel()
            self._loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
            self.push.close()
            if zap is not None:
                zap.close()
            context.term()

    def registration(self) -> NodeRegistration:
        return NodeRegistration(
            node_id=self.node_id,
            role=self.role,  # type: ignore[arg-type]
            http_url=self.settings.http_url,
            version=VERSION,
            ranks=self._ranks,
            model=self.identity,
            num_pages=self.num_blocks,
            verify_kv=self.settings.verify_kv,
            heartbeat_interval_s=self.settings.heartbeat_interval_s,
            report_key=self.security.public_key,
        )

    def heartbeat(self) -> Heartbeat:
        live = list(self.rooms.live)
        free = int(self._free_blocks())
        return Heartbeat(
            rooms_in_flight=len(live),
            transfers=live[:4096],
            free_pages=free,
            ranks=[RankStatus(rank=r.rank, alive=True, free_pages=free) for r in self._ranks],
        )

    def _orphaned(self, transfers: list[protocol.TransferId]) -> None:
        for transfer in transfers:
            room = self.rooms.live.get(transfer)
            if room is not None:
                room.fail(FailureReason.ORPHANED)
                self.rooms.retire(room)

    def close(self) -> None:
        """vLLM is stopping: the bootstrap hears it now (best effort), not when beats stop."""
        if self._thread is not None:
            leaving = asyncio.run_coroutine_threadsafe(self._leave(), self._loop)
            with contextlib.suppress(Exception):
                leaving.result(timeout=WRITES_SETTLE_S + LEAVE_TIMEOUT_S + 1)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def _writes_over(self) -> bool:
        """No write of this server's may still move: none of a worker half in this process (vLLM's
        in-process executor), and over TCP nothing that closed sockets held is still unsent."""
        if writes_may_move():
            return False
        return self.settings.transport != "tcp" or tcp_drain.dead_writes_sent()

    async def _leave(self) -> None:
        """Leaving tells the decodes that this server writes no more, and they free the blocks it
        could write at once: a prefill leaves only once its writes are over (docs/failures.md),
        within a bound, past which it exits without a word and the decodes wait out the lease."""
        if self.role == "prefill":
            settle = time.monotonic() + WRITES_SETTLE_S
            while not self._writes_over():
                if time.monotonic() > settle:
                    log.warning("writes in flight after %.1fs: exiting without leaving", WRITES_SETTLE_S)
                    return
                await asyncio.sleep(0.05)
        self.membership.leaving()  # a beat after the leave must not register the server again
        async with httpx.AsyncClient(base_url=self.settings.bootstrap_url, timeout=LEAVE_TIMEOUT_S) as client:
            await client.delete(
                f"/nodes/{self.node_id}", params={"cause": "shutdown"}, headers=self.membership.auth
            )

    # -- vLLM's engine thread: rooms ---------------------------------------------------

    def _params(self, request: Request) -> TransferGrant | None:
        """The request's room: None for a plain request, and for one whose transfer parameters
        this server must not act on, which is refused (``_refused``) rather than served plain."""
        req_id = request.request_id
        granted = self._granted.get(req_id)
        if granted is not None or req_id in self._refused:
            return granted
        try:
            grant = room_params(request.kv_transfer_params)
        except ValueError as exc:
            self._refuse(req_id, str(exc))
            return None
        if grant is None:
            return None
        key = self.membership.params_key if hasattr(self, "membership") else None
        now = time.time()
        why = grants.refusal(grant, key, self.role, list(request.prompt_token_ids or []), self.node_id, now)
        if why is None and not self._first_use.take(grant, req_id, now):
            why = f"transfer {grant.transfer} was already taken by another request"
        if why is not None:
            self._refuse(req_id, why)
            return None
        self._granted[req_id] = grant
        return grant

    def _refuse(self, req_id: str, why: str) -> None:
        log.warning("request %s is refused: %s", req_id, why)
        self._refused.add(req_id)

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """A decode room's prompt comes from its prefill; a refused request "loads" too, so that
        its load fails and vLLM ends it with an error before computing anything."""
        room = self._params(request)
        refused = request.request_id in self._refused
        if not refused and (room is None or self.role != "decode" or request.request_id in self._requests):
            return 0, False
        count = len(request.prompt_token_ids or []) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def allocated(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        if request.request_id in self._refused:
            self._plan.refused[request.request_id] = block_ids
            return
        room = self._params(request)
        if room is not None and self.role == "prefill":
            self._plan.scheduled.append(room)
        if room is None or num_external_tokens <= 0 or request.request_id in self._requests:
            return
        self._requests[request.request_id] = Tracked(room, loading=True, blocks=tuple(block_ids))
        prompt_len = len(request.prompt_token_ids or [])
        self._plan.loads.append(Load(request.request_id, room, block_ids, prompt_len))
        self._on_loop(self._open, room.transfer)

    def step_plan(self) -> StepPlan:
        plan, self._plan = self._plan, StepPlan()
        while self._writers_gone:
            plan.writers_gone.append(self._writers_gone.popleft())
        return plan

    def finished(self, request: Request, block_ids: list[int]) -> bool:
        """vLLM is done with the request; True: keep its blocks until the workers say so."""
        room = self._params(request)
        self._granted.pop(request.request_id, None)
        if request.request_id in self._refused:
            self._refused.discard(request.request_id)
            return False
        if room is None:
            return False
        tracked = self._requests.get(request.request_id)
        if self.role == "decode":
            if tracked is None:  # ended before its blocks were taken: its writers may stop now
                self._plan.revoked.append(room)
            elif tracked.loading:
                tracked.ended = True
                self._plan.stopped_loads.append(request.request_id)
            else:
                del self._requests[request.request_id]
            return False
        if request.status not in PROMPT_COMPUTED or not block_ids or not request.output_token_ids:
            self._plan.unsent.append(room)
            return False
        self._requests[request.request_id] = Tracked(room)
        first = request.output_token_ids[0]
        self._plan.sends.append(
            Send(request.request_id, room, list(block_ids), request.num_prompt_tokens, first)
        )
        self._on_loop(self._open, room.transfer)
        return True

    def took_output(self, output: Any) -> None:
        """What the workers finished this step (vLLM's KVConnectorOutput, summed over workers)."""
        report = output.kv_connector_worker_meta
        if isinstance(report, WorkerReport):
            for req_id, why in report.failed.items():
                self._failures.setdefault(req_id, why)  # the first reason stands (a TP worker's)
                tracked = self._requests.get(req_id)
                if tracked is not None and tracked.loading:  # the room fails now; vLLM keeps its blocks
                    self._on_loop(
                        self._advance, tracked.room.transfer, RoomState.FAILED, self._failures[req_id]
                    )
            for req_id, digest in report.ready.items():  # every worker ready with the same record
                if self._ready.setdefault(req_id, digest) != digest:
                    self._failures.setdefault(req_id, FailureReason.AUX_MISMATCH)
            for req_id in report.transferring:
                tracked = self._requests.get(req_id)
                if tracked is not None:
                    self._on_loop(self._advance, tracked.room.transfer, RoomState.TRANSFERRING, None)
        for req_id in list(output.finished_recving or ()):
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            mismatched = self._failures.get(req_id) == FailureReason.AUX_MISMATCH and not tracked.ended
            if mismatched and not set(tracked.blocks) & set(output.invalid_block_ids or ()):
                # Each worker found its own record intact, so none named the blocks as failed:
                # vLLM would decode from KV the workers disagree on. Held back this step, its load
                # is failed by the workers in the next (all of it has landed).
                output.finished_recving.discard(req_id)
                self._plan.refused[req_id] = list(tracked.blocks)
                continue
            tracked.loading = False
            if tracked.ended:
                del self._requests[req_id]
            reason = self._failures.pop(req_id, None)
            self._ready.pop(req_id, None)
            if reason is None and req_id in (output.failed_recving or ()):
                reason = FailureReason.TRANSFER_FAILED
            self._on_loop(self._advance, tracked.room.transfer, RoomState.SUCCESS, reason)
        for req_id in output.finished_sending or ():
            tracked = self._requests.pop(req_id, None)
            if tracked is not None:
                reason = self._failures.pop(req_id, None)
                self._on_loop(self._advance, tracked.room.transfer, RoomState.SUCCESS, reason)

    # -- the node's loop ---------------------------------------------------------------

    def _on_loop(self, fn: Any, *args: Any) -> None:
        self._loop.call_soon_threadsafe(fn, *args)

    def _open(self, transfer: protocol.TransferId) -> None:
        if self.rooms.find(transfer) is None:
            room = Room(transfer, self.link.report)
            self.rooms.add(room)
            self.link.report(room)

    def _advance(self, transfer: protocol.TransferId, state: RoomState, reason: str | None) -> None:
        room = self.rooms.live.get(transfer)
        if room is None:
            return
        if reason is not None:
            room.fail(reason)
        else:
            room.advance_to(state)
        if room.state.terminal:
            self.rooms.retire(room)


def model_identity(vllm_config: Any) -> ModelIdentity:
    """What the bootstrap compares between nodes, from vLLM's own configuration."""
    model = vllm_config.model_config
    return ModelIdentity(
        name=model.served_model_name
        if isinstance(model.served_model_name, str)
        else model.served_model_name[0],
        architecture=(model.hf_config.architectures or ["unknown"])[0],
        weights=weights_digest(model.model),
        tokenizer=tokenizer_digest(model.tokenizer or model.model),
        dtype=str(model.dtype).removeprefix("torch."),
        num_layers=model.get_total_num_hidden_layers(),
        num_heads=model.hf_text_config.num_attention_heads,
        num_kv_heads=model.get_total_num_kv_heads(),
        head_dim=model.get_head_size(),
        vocab_size=model.get_vocab_size(),
        page_size=vllm_config.cache_config.block_size,
        engine=f"vllm {vllm.__version__}",
    )
