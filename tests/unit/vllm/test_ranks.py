"""The connector's worker half: a prefill rank and a decode rank in one process, over real ZMQ
sockets, with vLLM's KV layout in torch tensors and the fake engine moving the bytes (the real
engine and real vLLM servers are in tests/integration/test_vllm.py)."""

import contextlib
import ctypes
import os
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import torch

from kvroom_vllm.messages import Load, Send, StepPlan, TransferGrant
from kvroom_vllm.paged_kv import PagedKV, block_digests, paged_kv
from kvroom_vllm.settings import settings_from
from kvroom_vllm.worker import WorkerHalf, writes_may_move
from launcher.local_stack import free_port
from shared.kv import tcp_drain
from shared.kv.aux_buffers import AUX_RECORD
from shared.kv.head_split import HeadRange
from shared.kv.transfer import MooncakeEngine
from shared.room.states import FailureReason
from shared.wire import protocol
from tests.support import until
from tests.support.fakes import FakeEngine
from tests.support.sockets import loopback_connection

LAYERS, BLOCKS, HEADS, TOKENS, CHANNELS = 3, 16, 2, 4, 8  # a block: 2 heads of 4 tokens, K|V of 4
VOCAB = 512
PROMPT = 10  # 3 blocks of 4 tokens
TRANSFER = protocol.TransferId(77)


def kv_caches() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Layers as vLLM allocates them on CPU: views of one tensor, a layer after another."""
    whole = torch.zeros(LAYERS, BLOCKS, HEADS, TOKENS, CHANNELS)
    return whole, {f"model.layers.{i}.self_attn.attn": whole[i] for i in range(LAYERS)}


class Rank:
    def __init__(self, role: str, directory: dict, engine: type[FakeEngine] = FakeEngine, **settings: object):
        self.whole, layers = kv_caches()
        extra = {
            "http_url": f"http://127.0.0.1:{free_port()}",
            "zmq_port": free_port(),
            "zmq_security": "plain",
            "transfer_timeout_s": 5.0,
            "lease_timeout_s": 5.0,
            **settings,
        }
        self.half = WorkerHalf(settings_from(extra), 0, 1, HEADS, VOCAB, role)
        self.half.start(paged_kv(layers, HeadRange(0, HEADS)), engine(role, directory))
        self.peer = protocol.PeerRank(**self.half.handshake().peer)
        self.sending: set[str] = set()
        self.recving: set[str] = set()
        self.invalid: set[int] = set()
        self.failed: dict[str, str] = {}
        self.ready: dict[str, int] = {}

    def poll(self) -> "Rank":
        sending, recving, invalid, report = self.half.results()
        self.sending |= sending
        self.recving |= recving
        self.invalid |= invalid
        self.failed |= report.failed
        self.ready |= report.ready
        return self

    def close(self) -> None:
        self.half.close()


class HeldDoneAux(WorkerHalf):
    """A prefill rank whose done+aux waits until the test lets it go, or is changed on the way."""

    held: list[tuple] = []
    tamper = False

    def send_done_aux(self, peer, done, record):
        if self.tamper:
            record = bytes([record[0] ^ 1]) + record[1:]
        self.held.append((peer, done, record))


def room(role: str, peer: protocol.PeerRank) -> TransferGrant:
    return TransferGrant(TRANSFER, role, "me", "other", [peer], TOKENS, "0" * 64, expires=0.0)  # type: ignore[arg-type]


def load(decode: Rank, prefill: Rank, req_id: str = "d-1", dst=(2, 9, 11)) -> None:
    """The decode asks the prefill for the room's KV, into blocks ``dst``."""
    decode.half.take_plan(StepPlan(loads=[Load(req_id, room("decode", prefill.peer), list(dst), PROMPT)]))


def start(prefill: Rank, decode: Rank, src=(5, 6, 7), dst=(2, 9, 11)) -> None:
    prefill.whole[:, list(src)] = torch.randn(LAYERS, len(src), HEADS, TOKENS, CHANNELS)
    load(decode, prefill, dst=dst)
    send = Send("p-1", room("prefill", decode.peer), list(src), PROMPT, first_token=42)
    prefill.half.take_plan(StepPlan(sends=[send]))


def test_a_prompt_moves_block_by_block_layer_by_layer_and_both_finish():
    directory: dict = {}
    prefill, decode = Rank("prefill", directory), Rank("decode", directory)
    try:
        start(prefill, decode)
        until(lambda: "d-1" in decode.poll().recving and "p-1" in prefill.poll().sending)
        assert decode.failed == {} and decode.invalid == set()
        assert set(decode.ready) == {"d-1"}  # with its record's digest, for the workers to agree on
        assert torch.equal(decode.whole[:, [2, 9, 11]], prefill.whole[:, [5, 6, 7]])
        assert decode.whole[:, [0, 1, 3]].abs().sum() == 0  # nothing else was written
        # vLLM's stat loggers hear of it: no two of blocks 2, 9, 11 are adjacent, so one write a
        # block a layer.
        stats = prefill.half.take_stats()
        assert stats is not None and prefill.half.take_stats() is None
        assert stats.data == {
            "sends": 1,
            "writes": LAYERS * 3,
            "bytes": LAYERS * 3 * prefill.half.kv.block_bytes,
            "freed_answered": 0,
            "freed_writers_gone": 0,
            "freed_expired": 0,
        }
        assert decode.half.take_stats() is None
    finally:
        prefill.close()
        decode.close()


def test_the_load_waits_for_the_aux_record_and_fails_on_a_changed_one():
    directory: dict = {}
    HeldDoneAux.held = []
    prefill, decode = Rank("prefill", directory), Rank("decode", directory, aux_timeout_s=0.3)
    prefill.half.__class__ = HeldDoneAux
    try:
        start(prefill, decode)
        until(lambda: HeldDoneAux.held)
        assert torch.equal(decode.whole[:, [2, 9, 11]], prefill.whole[:, [5, 6, 7]])
        assert decode.poll().recving == set()  # the KV is in; without its aux record the load is not done
        peer, done, record = HeldDoneAux.held.pop()
        changed = bytes([record[0] ^ 1]) + record[1:]
        WorkerHalf.send_done_aux(prefill.half, peer, done, changed)
        until(lambda: "d-1" in decode.poll().recving)
        assert decode.failed == {"d-1": FailureReason.AUX_TIMEOUT}  # no intact copy came
        assert decode.invalid == {2, 9, 11}
        assert len(changed) == AUX_RECORD.size
    finally:
        prefill.close()
        decode.close()


def test_a_load_that_times_out_is_finished_for_vllm_only_once_the_prefill_released_it():
    directory: dict = {}
    HeldDoneAux.held = []
    prefill = Rank("prefill", directory, transfer_timeout_s=5.0)
    decode = Rank("decode", directory, transfer_timeout_s=0.3, lease_timeout_s=30.0)
    prefill.half.__class__ = HeldDoneAux  # its done+aux never leaves
    try:
        start(prefill, decode)
        # The decode gives up, revokes; the prefill's write is done, so it releases at once.
        until(lambda: "d-1" in decode.poll().recving, timeout=10)
        assert decode.failed == {"d-1": FailureReason.TRANSFER_TIMEOUT}  # no done+aux came
        until(lambda: "p-1" in prefill.poll().sending)
    finally:
        prefill.close()
        decode.close()


def test_a_decode_that_ends_before_loading_lets_the_prefill_free_its_blocks_at_once():
    directory: dict = {}
    prefill, decode = Rank("prefill", directory, transfer_timeout_s=30.0), Rank("decode", directory)
    try:
        decode.half.take_plan(StepPlan(revoked=[room("decode", prefill.peer)]))
        until(lambda: TRANSFER in prefill.half._revoked)
        send = Send("p-1", room("prefill", decode.peer), [1, 2, 3], PROMPT, first_token=42)
        prefill.half.take_plan(StepPlan(sends=[send]))
        until(lambda: "p-1" in prefill.poll().sending, timeout=3)
        assert directory["prefill"] and not prefill.half.engine.writes  # type: ignore[attr-defined]
    finally:
        prefill.close()
        decode.close()


class ChangingEngine(FakeEngine):
    """Writes, then changes one byte of what it wrote: KV that did not land as it was sent."""

    def write(self, peer_session, writes, timeout_s=30.0):
        total = super().write(peer_session, writes, timeout_s)
        _, dst, _ = writes[-1]
        ctypes.c_uint8.from_address(dst).value ^= 0xFF
        return total


@pytest.mark.parametrize("inline_bytes", [1 << 20, 0], ids=["digested-on-the-loop", "digested-off-it"])
@pytest.mark.parametrize("engine", [FakeEngine, ChangingEngine])
def test_verify_mode_takes_only_kv_that_landed_as_it_was_written(engine, inline_bytes, monkeypatch):
    """A small load's blocks are digested where done+aux is taken, a large one's on another
    thread: either way a changed byte fails the load."""
    monkeypatch.setattr("kvroom_vllm.worker.INLINE_BYTES", inline_bytes)
    digested_on: list[str] = []  # the threads the decode's digests ran on

    def recorded(kv, *args):
        if kv is decode.half.kv:
            digested_on.append(threading.current_thread().name)
        return block_digests(kv, *args)

    monkeypatch.setattr("kvroom_vllm.worker.block_digests", recorded)
    directory: dict = {}
    prefill = Rank("prefill", directory, verify_kv=True, engine=engine)
    decode = Rank("decode", directory, verify_kv=True)
    try:
        start(prefill, decode)
        until(lambda: "d-1" in decode.poll().recving and "p-1" in prefill.poll().sending)
        loop_thread = "kvroom-rank-0"
        assert len(digested_on) == 1 and (digested_on[0] == loop_thread) == bool(inline_bytes), digested_on
        if engine is FakeEngine:
            assert decode.failed == {} and torch.equal(
                decode.whole[:, [2, 9, 11]], prefill.whole[:, [5, 6, 7]]
            )
        else:
            assert decode.failed == {"d-1": FailureReason.KV_CORRUPT} and decode.invalid == {2, 9, 11}
    finally:
        prefill.close()
        decode.close()


def test_paged_kv_refuses_layers_it_cannot_address_as_one_region():
    _, layers = kv_caches()
    kv = paged_kv(layers, HeadRange(0, HEADS))
    assert isinstance(kv, PagedKV)
    assert kv.layer_stride == BLOCKS * kv.block_bytes and kv.head_bytes == TOKENS * CHANNELS * 4
    whole = torch.zeros(4, BLOCKS, HEADS, TOKENS, CHANNELS)
    with pytest.raises(ValueError, match="fixed stride"):  # a layer missing between two others
        paged_kv({"a": whole[0], "b": whole[1], "c": whole[3]}, HeadRange(0, HEADS))
    with pytest.raises(ValueError, match="heads"):
        paged_kv(layers, HeadRange(0, 1))


def test_settings_refuse_what_vllm_decides_and_need_the_servers_url():
    with pytest.raises(ValueError, match="num_pages"):
        settings_from({"http_url": "http://127.0.0.1:8100", "zmq_port": 9100, "num_pages": 10})
    with pytest.raises(ValueError, match="http_url"):
        settings_from({"zmq_port": 9100})
    assert settings_from({"http_url": "http://127.0.0.1:8100", "zmq_port": 9100}).http_port == 8100


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores to pin to one")
def test_a_rank_started_from_a_thread_bound_to_one_core_runs_its_threads_on_every_core():
    """vLLM's CPU worker thread is bound to the forward's cores; a rank it starts must not be, or
    its writes wait behind the forward. The worker thread keeps its own binding."""
    every = set(range(os.cpu_count() or 1))
    os.sched_setaffinity(0, {0})
    try:
        rank = Rank("prefill", {})
        try:
            assert os.sched_getaffinity(0) == {0}
            assert rank.half._thread is not None
            assert os.sched_getaffinity(rank.half._thread.native_id) == every
        finally:
            rank.close()
    finally:
        os.sched_setaffinity(0, every)


def test_a_request_that_came_early_is_not_written_once_its_room_was_revoked():
    directory: dict = {}
    prefill, decode = Rank("prefill", directory, transfer_timeout_s=30.0), Rank("decode", directory)
    try:
        load(decode, prefill)
        until(lambda: TRANSFER in prefill.half._early)  # the prompt is not computed yet
        decode.half.take_plan(StepPlan(revoked=[room("decode", prefill.peer)]))
        until(lambda: TRANSFER in prefill.half._revoked)
        send = Send("p-1", room("prefill", decode.peer), [5, 6, 7], PROMPT, first_token=42)
        prefill.half.take_plan(StepPlan(sends=[send]))
        until(lambda: "p-1" in prefill.poll().sending, timeout=3)
        assert not prefill.half.engine.writes  # type: ignore[attr-defined]
    finally:
        prefill.close()
        decode.close()


@contextlib.contextmanager
def write_threads_taken(rank: Rank) -> Iterator[None]:
    """Every write thread of the rank busy until the block ends (writes ahead of the ones the
    block queues, hung on a partitioned peer)."""
    busy = threading.Event()
    blockers = [rank.half._writes.submit(busy.wait) for _ in range(8)]
    try:
        yield
    finally:
        busy.set()
        for blocker in blockers:
            blocker.result(5)


def queued_write(rank: Rank) -> bool:
    sending = rank.half._sends.get(TRANSFER)
    return sending is not None and bool(sending.writing)


def test_a_write_that_waited_past_its_start_deadline_is_not_started():
    directory: dict = {}
    prefill = Rank("prefill", directory, transfer_timeout_s=0.3)
    decode = Rank("decode", directory, transfer_timeout_s=30.0, lease_timeout_s=30.0)
    try:
        with write_threads_taken(prefill):
            start(prefill, decode)
            until(lambda: queued_write(prefill))
            threading.Event().wait(0.5)  # past the write's start deadline while it queues
        until(lambda: "p-1" in prefill.poll().sending and "d-1" in decode.poll().recving, timeout=5)
        assert not prefill.half.engine.writes  # type: ignore[attr-defined]
        assert set(decode.failed) == {"d-1"} and decode.invalid == {2, 9, 11}
        assert decode.whole.abs().sum() == 0
    finally:
        prefill.close()
        decode.close()


def test_a_write_may_move_until_the_rank_saw_it_end_which_a_scheduler_in_this_process_asks():
    """With vLLM's in-process executor a prefill's writes are its scheduler's process's own: it
    leaves only once none may still move (``kvroom_vllm.scheduler`` asks ``writes_may_move``)."""
    directory: dict = {}
    prefill, decode = Rank("prefill", directory), Rank("decode", directory)
    try:
        assert not prefill.half.writing()
        with write_threads_taken(prefill):
            start(prefill, decode)
            until(lambda: queued_write(prefill))
            assert prefill.half.writing() and writes_may_move()
        until(lambda: "p-1" in prefill.poll().sending)
        assert not prefill.half.writing()
    finally:
        prefill.close()
        decode.close()


def test_the_connector_refuses_a_load_failure_policy_that_would_compute_over_a_failed_load():
    from types import SimpleNamespace

    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvroom_vllm.connector import KvroomConnector

    config = KVTransferConfig(
        kv_connector="KvroomConnector", kv_role="kv_consumer", kv_load_failure_policy="recompute"
    )
    with pytest.raises(ValueError, match='kv_load_failure_policy must be "fail"'):
        KvroomConnector(SimpleNamespace(kv_transfer_config=config), KVConnectorRole.SCHEDULER)


def test_a_prefill_request_that_ended_unsent_gives_its_decode_its_blocks_back_at_once():
    directory: dict = {}
    prefill = Rank("prefill", directory, transfer_timeout_s=30.0)
    decode = Rank("decode", directory, transfer_timeout_s=30.0, lease_timeout_s=30.0)
    try:
        load(decode, prefill)
        until(lambda: TRANSFER in prefill.half._early)  # asked for, the prompt not computed yet
        prefill.half.take_plan(StepPlan(unsent=[room("prefill", decode.peer)]))  # the client left
        until(lambda: "d-1" in decode.poll().recving, timeout=1)
        assert set(decode.failed) == {"d-1"} and decode.invalid == {2, 9, 11}
        assert TRANSFER not in prefill.half._early and not prefill.half.engine.writes  # type: ignore[attr-defined]
        # A request that comes after is answered at once as well.
        load(decode, prefill, "d-2", dst=(4, 5, 6))
        until(lambda: "d-2" in decode.poll().recving, timeout=1)
        assert "d-2" in decode.failed
    finally:
        prefill.close()
        decode.close()


def test_a_revoke_for_a_room_scheduled_but_not_sent_is_answered_at_once_and_nothing_is_written():
    directory: dict = {}
    prefill = Rank("prefill", directory, transfer_timeout_s=30.0)
    decode = Rank("decode", directory, transfer_timeout_s=30.0, lease_timeout_s=30.0)
    try:
        prefill.half.take_plan(StepPlan(scheduled=[room("prefill", decode.peer)]))  # computing
        load(decode, prefill)
        until(lambda: TRANSFER in prefill.half._early)
        decode.half.take_plan(StepPlan(stopped_loads=["d-1"]))  # the decode's client left
        until(lambda: "d-1" in decode.poll().recving, timeout=1)  # not at the 30 s lease
        send = Send("p-1", room("prefill", decode.peer), [5, 6, 7], PROMPT, first_token=42)
        prefill.half.take_plan(StepPlan(sends=[send]))  # the prompt is computed after all
        until(lambda: "p-1" in prefill.poll().sending, timeout=3)
        assert not prefill.half.engine.writes  # type: ignore[attr-defined]
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("how", ["timed out", "stopped"])
def test_a_failed_loads_blocks_stay_fenced_until_the_latest_moment_a_silent_writer_could_write(how):
    """Asked at t0, its writer silent: vLLM hears of the failure at once (the blocks named invalid:
    it ends the request with an error), and the blocks are vLLM's again (the load finished) at
    t0 + T + L, not at failure + L (the writer may start until T after the request reached it)."""
    directory: dict = {}
    prefill = Rank("prefill", directory, transfer_timeout_s=30.0)  # never sent: it stays silent
    decode = Rank("decode", directory, transfer_timeout_s=0.6, lease_timeout_s=0.4)
    try:
        asked = time.monotonic()
        load(decode, prefill)
        if how == "stopped":
            decode.half.take_plan(StepPlan(stopped_loads=["d-1"]))
        until(lambda: decode.poll().invalid, timeout=5)
        failed_at = time.monotonic() - asked
        assert decode.invalid == {2, 9, 11} and "d-1" in decode.failed and "d-1" not in decode.recving
        until(lambda: "d-1" in decode.poll().recving, timeout=5)
        assert time.monotonic() - asked >= 0.6 + 0.4 > failed_at
        stats = decode.half.take_stats()  # counted as blocks freed at the fence's end
        assert stats is not None and stats.data["freed_expired"] == 3
    finally:
        prefill.close()
        decode.close()


def test_a_load_whose_prefill_process_ended_is_vllms_again_once_what_it_sent_over_tcp_is_read():
    """The bootstrap says the load's prefill left (``writers_gone``): vLLM hears of the failure at
    once, and gets the blocks back long before the fence would end, but only once the bytes the
    gone writer's kernel sent to this process have been read."""
    directory: dict = {}
    prefill = Rank("prefill", directory, transfer_timeout_s=30.0)  # never sent: it stays silent
    decode = Rank("decode", directory, transfer_timeout_s=30.0, lease_timeout_s=30.0)
    try:
        with loopback_connection() as (writer, reader, _):
            writer.sendall(b"k" * 100)
            writer.close()  # the gone writer's end; 100 bytes and its FIN wait in this process
            until(lambda: not tcp_drain.closed_writes_read(), what="the FIN")
            load(decode, prefill)
            decode.half.take_plan(StepPlan(writers_gone=[TRANSFER]))
            until(lambda: decode.poll().invalid, timeout=5)
            assert decode.failed == {"d-1": FailureReason.PEER_LOST} and decode.invalid == {2, 9, 11}
            time.sleep(0.1)  # ten looks at the kernel's table: none may free them
            assert "d-1" not in decode.poll().recving
            assert reader.recv(200) == b"k" * 100  # the transport reads them
            until(lambda: "d-1" in decode.poll().recving, timeout=5)
            assert decode.half.aux.free_slots == decode.half.aux.slots
            stats = decode.half.take_stats()  # counted as blocks freed on the writers' certain end
            assert (
                stats is not None
                and stats.data["freed_writers_gone"] == 3
                and stats.data["freed_expired"] == 0
            )
    finally:
        prefill.close()
        decode.close()


def test_a_request_that_came_early_keeps_the_start_deadline_of_its_arrival():
    directory: dict = {}
    prefill = Rank("prefill", directory, transfer_timeout_s=0.6)
    decode = Rank("decode", directory, transfer_timeout_s=30.0, lease_timeout_s=30.0)
    try:
        with write_threads_taken(prefill):
            decode.half.take_plan(
                StepPlan(loads=[Load("d-1", room("decode", prefill.peer), [2, 9, 11], PROMPT)])
            )
            until(lambda: TRANSFER in prefill.half._early)
            threading.Event().wait(0.35)  # the prompt is computed within T of the request's arrival
            send = Send("p-1", room("prefill", decode.peer), [5, 6, 7], PROMPT, first_token=42)
            prefill.half.take_plan(StepPlan(sends=[send]))
            until(lambda: queued_write(prefill))
            threading.Event().wait(0.35)  # its write queued past arrival + T, not past send + T
        until(lambda: "p-1" in prefill.poll().sending, timeout=3)
        assert not prefill.half.engine.writes  # type: ignore[attr-defined]
    finally:
        prefill.close()
        decode.close()


def test_a_refused_request_fails_as_a_load_on_every_rank_and_nothing_is_asked_of_any_peer():
    directory: dict = {}
    prefill, decode = Rank("prefill", directory), Rank("decode", directory)
    try:
        # On a decode, and on a prefill: the blocks vLLM gave the request come back failed.
        for rank in (decode, prefill):
            rank.half.take_plan(StepPlan(refused={"f-1": [2, 3]}))
            rank.poll()
            assert rank.recving == {"f-1"} and rank.invalid == {2, 3} and rank.failed == {}
        assert not prefill.half.engine.writes and not decode.half._loads  # type: ignore[attr-defined]
    finally:
        prefill.close()
        decode.close()


class DarkPeerBinding:
    """The engine's blocking calls as RDMA makes them: bytes copied, except that the first
    ``hang`` calls never return until the test ends (a peer gone dark mid-write)."""

    def __init__(self, hang: int):
        self.hang = hang
        self.calls = 0
        self.let_go = threading.Event()

    def register_memory(self, ptr: int, nbytes: int) -> int:
        return 0

    def _call(self, writes: list[tuple[int, int, int]]) -> int:
        self.calls += 1
        if self.calls <= self.hang:
            self.let_go.wait(30)
            return -1
        for src, dst, length in writes:
            ctypes.memmove(dst, src, length)
        return 0

    def transfer_sync_write(self, peer: str, src: int, dst: int, length: int) -> int:
        return self._call([(src, dst, length)])

    def batch_transfer_sync_write(self, peer: str, src: list, dst: list, lengths: list) -> int:
        return self._call(list(zip(src, dst, lengths, strict=True)))


def test_hung_blocking_writes_end_at_their_deadline_and_the_ranks_next_send_lands():
    binding = DarkPeerBinding(hang=2)  # as many as the rank has write threads

    def engine(role: str, directory: dict) -> MooncakeEngine:
        blocking = object.__new__(MooncakeEngine)  # the wrapper's blocking path over the binding above
        blocking._engine, blocking._polled, blocking.hung_writes = binding, False, 0
        blocking._session_id = f"{role}:1"
        return blocking

    directory: dict = {}
    prefill = Rank("prefill", directory, engine=engine, transfer_timeout_s=0.3, lease_timeout_s=0.3)  # type: ignore[arg-type]
    decode = Rank("decode", directory, transfer_timeout_s=30.0, lease_timeout_s=30.0)
    try:
        prefill.whole[:, [0, 1]] = torch.randn(LAYERS, 2, HEADS, TOKENS, CHANNELS)
        for n, (src, dst) in enumerate([((5,), (2,)), ((6,), (9,)), ((0, 1), (3, 4))]):
            transfer = protocol.TransferId(TRANSFER + n)
            grant = msgspec.structs.replace(room("decode", prefill.peer), transfer=transfer)
            decode.half.take_plan(StepPlan(loads=[Load(f"d-{n}", grant, list(dst), PROMPT)]))
            until(lambda transfer=transfer: transfer in prefill.half._early)
            grant = msgspec.structs.replace(room("prefill", decode.peer), transfer=transfer)
            prefill.half.take_plan(StepPlan(sends=[Send(f"p-{n}", grant, list(src), PROMPT, first_token=42)]))
        # The two hung writes were given up on, and the third send took a write thread and landed.
        until(lambda: "d-2" in decode.poll().recving, timeout=10)
        assert "d-2" not in decode.failed
        assert torch.equal(decode.whole[:, [3, 4]], prefill.whole[:, [0, 1]])
        # The third can land before the second's deadline: the second started later than the first.
        until(lambda: prefill.half.engine.hung_writes == 2, timeout=10)  # type: ignore[union-attr]
        # vLLM gets every block back: the hung ones once the lease a late write could land in ran out.
        until(lambda: {"p-0", "p-1", "p-2"} <= prefill.poll().sending, timeout=10)
        assert not {"d-0", "d-1"} & decode.recving  # the decode still waits for theirs (its own timeout)
    finally:
        binding.let_go.set()
        prefill.close()
        decode.close()


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1)])
def test_each_head_lands_in_the_decode_rank_that_holds_it_over_the_real_engine(prefill_tp, decode_tp):
    """P and D at different TP, the real transfer engine over TCP: every decode rank gets the heads
    it holds, from the prefill ranks that hold them, and nothing else."""

    def ranks(role: str, tp: int) -> list[tuple[WorkerHalf, torch.Tensor]]:
        out = []
        for r in range(tp):
            local = HEADS // tp
            whole = torch.zeros(LAYERS, BLOCKS, local, TOKENS, CHANNELS)
            layers = {f"model.layers.{i}.self_attn.attn": whole[i] for i in range(LAYERS)}
            extra = {
                "http_url": f"http://127.0.0.1:{free_port()}",
                "zmq_port": free_port(),
                "zmq_security": "plain",
            }
            half = WorkerHalf(settings_from(extra), r, tp, HEADS, VOCAB, role)
            half.start(paged_kv(layers, HeadRange(r * local, local)))  # the real engine
            out.append((half, whole))
        return out

    prefills, decodes = ranks("prefill", prefill_tp), ranks("decode", decode_tp)
    try:
        full = torch.randn(LAYERS, 3, HEADS, TOKENS, CHANNELS)  # the prompt's KV, all heads
        for r, (_, whole) in enumerate(prefills):
            local = HEADS // prefill_tp
            whole[:, [5, 6, 7]] = full[:, :, r * local : (r + 1) * local]
        peers = {
            side: [protocol.PeerRank(**h.handshake().peer) for h, _ in halves]
            for side, halves in (("prefill", prefills), ("decode", decodes))
        }
        grant = {
            role: TransferGrant(TRANSFER, role, "me", "other", peers[other], TOKENS, "0" * 64, expires=0.0)  # type: ignore[arg-type]
            for role, other in (("decode", "prefill"), ("prefill", "decode"))
        }
        for half, _ in decodes:
            half.take_plan(StepPlan(loads=[Load("d-1", grant["decode"], [2, 9, 11], PROMPT)]))
        for half, _ in prefills:
            half.take_plan(StepPlan(sends=[Send("p-1", grant["prefill"], [5, 6, 7], PROMPT, first_token=42)]))

        finished: set[tuple[int, str]] = set()

        def done() -> bool:
            finished.update((half.rank, req) for half, _ in decodes for req in half.results()[1])
            return len(finished) == decode_tp

        until(done, 20, "every decode rank loaded")
        for r, (_, whole) in enumerate(decodes):
            local = HEADS // decode_tp
            assert torch.equal(whole[:, [2, 9, 11]], full[:, :, r * local : (r + 1) * local]), r
            assert whole[:, [0, 1, 3]].abs().sum() == 0
    finally:
        for half, _ in prefills + decodes:
            half.close()
