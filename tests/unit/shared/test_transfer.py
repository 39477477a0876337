"""The engine wrapper: how each transport is set up, and the polled and blocking waits for writes.

The engine's binding is replaced by scripted stand-ins, so these tests say nothing about real
transfers (the integration tests do); they pin down what the wrapper does with what it is told.
"""

import concurrent.futures
import threading

import pytest
import torch

from shared.errors import TransferError
from shared.kv.transfer import (
    MAX_BATCH_ENTRIES,
    MAX_IN_FLIGHT,
    MooncakeEngine,
    WriteJob,
    WriteUnresolved,
    engine_setup,
)
from tests.support.fakes import FakeEngine

STALE = {"MC_FORCE_TCP": "0", "MC_INTRANODE_NVLINK": "0", "MC_FORCE_MNNVL": "1", "OTHER": "kept"}


def test_tcp_setup_forces_tcp_and_clears_the_rest():
    setup = engine_setup("tcp")
    env = dict(STALE)
    setup.apply(env)
    assert (setup.protocol, setup.device_name) == ("tcp", "")
    assert env == {"MC_FORCE_TCP": "1", "OTHER": "kept"}


def test_rdma_setup_names_devices_and_removes_every_override():
    setup = engine_setup("rdma", "mlx5_0,mlx5_1")
    env = dict(STALE)
    setup.apply(env)
    assert (setup.protocol, setup.device_name) == ("rdma", "mlx5_0,mlx5_1")
    # Present-but-zero would still force TCP: the variable must be gone.
    assert env == {"OTHER": "kept"}
    assert engine_setup("rdma").device_name == ""


def test_nvlink_setup_selects_intra_node_nvlink():
    setup = engine_setup("nvlink")
    env = dict(STALE)
    setup.apply(env)
    assert env == {"MC_INTRANODE_NVLINK": "1", "OTHER": "kept"}
    assert setup.protocol == "rdma"


def test_unknown_transport():
    with pytest.raises(ValueError):
        engine_setup("carrier-pigeon")  # type: ignore[arg-type]


def test_fake_engine_moves_bytes_and_refuses_foreign_memory():
    directory: dict[str, list[tuple[int, int]]] = {}
    a, b = FakeEngine("a", directory), FakeEngine("b", directory)
    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    a.register(src.data_ptr(), 64)
    b.register(dst.data_ptr(), 64)
    assert a.write("b", [(src.data_ptr(), dst.data_ptr() + 8, 16)]) == 16
    assert dst[8:24].tolist() == list(range(16))
    with pytest.raises(TransferError):
        a.write("b", [(src.data_ptr(), dst.data_ptr() + 60, 16)])
    with pytest.raises(TransferError):
        a.write("nobody", [(src.data_ptr(), dst.data_ptr(), 1)])


class ScriptedBinding:
    """Stands in for the engine's Python binding on the polled path: each write is pending for its
    first ``pending_looks`` looks and then completes, fails if it is ``fail_at``, or stays pending
    for good if it is in ``stuck``."""

    def __init__(
        self,
        fail_at: int | None = None,
        refuse_at: int | None = None,
        refusal: int = 0,
        stuck: frozenset[int] = frozenset(),
        pending_status: int = 0,
        pending_looks: int = 1,
    ):
        self.fail_at, self.refuse_at, self.refusal = fail_at, refuse_at, refusal
        self.stuck, self.pending_status, self.pending_looks = stuck, pending_status, pending_looks
        self.submitted: list[int] = []
        self.finished: set[int] = set()
        self.looks: dict[int, int] = {}
        self.most_in_flight = 0

    def transfer_submit_write(self, peer: str, src: int, dst: int, length: int) -> int:
        if len(self.submitted) == self.refuse_at:
            return self.refusal
        batch_id = 1000 + len(self.submitted)
        self.submitted.append(batch_id)
        self.most_in_flight = max(self.most_in_flight, len(self.submitted) - len(self.finished))
        return batch_id

    def transfer_check_status(self, batch_id: int) -> int:
        self.looks[batch_id] = self.looks.get(batch_id, 0) + 1
        if self.looks[batch_id] <= self.pending_looks or batch_id - 1000 in self.stuck:
            return self.pending_status
        self.finished.add(batch_id)
        return -1 if batch_id - 1000 == self.fail_at else 1


def scripted_engine(binding: object, polled: bool = True) -> MooncakeEngine:
    engine = object.__new__(MooncakeEngine)  # no real engine: the binding is scripted
    engine._engine = binding
    engine._polled = polled
    engine.hung_writes = 0
    return engine


def test_polled_writes_keep_a_bounded_number_in_flight():
    binding = ScriptedBinding()
    count = 2 * MAX_IN_FLIGHT + 7
    assert scripted_engine(binding).write("peer", [(0, 0, 10)] * count) == 10 * count
    assert len(binding.submitted) == count
    assert binding.most_in_flight == MAX_IN_FLIGHT
    assert binding.finished == set(binding.submitted)


def test_no_writes_is_zero_bytes():
    binding = ScriptedBinding()
    assert scripted_engine(binding).write("peer", []) == 0
    assert binding.submitted == []


@pytest.mark.parametrize(
    "script",
    [
        {"fail_at": 3},
        {"fail_at": 0},
        {"fail_at": MAX_IN_FLIGHT + 2},
        {"refuse_at": 5},
        {"refuse_at": 5, "refusal": -1},
        {"refuse_at": 5, "refusal": (1 << 64) - 1},
        {"refuse_at": MAX_IN_FLIGHT + 1},
    ],
)
def test_a_failed_write_raises_only_once_nothing_submitted_is_still_moving(script):
    binding = ScriptedBinding(**script)
    with pytest.raises(TransferError) as info:
        scripted_engine(binding).write("peer", [(0, 0, 10)] * (MAX_IN_FLIGHT + 10))
    assert not isinstance(info.value, WriteUnresolved)  # nothing is left moving
    assert binding.submitted  # some writes went out before the failure
    assert binding.finished == set(binding.submitted)


def test_a_failure_stops_further_submits():
    binding = ScriptedBinding(fail_at=0)
    with pytest.raises(TransferError):
        scripted_engine(binding).write("peer", [(0, 0, 10)] * (2 * MAX_IN_FLIGHT))
    assert len(binding.submitted) == MAX_IN_FLIGHT  # the first wait saw the failure


@pytest.mark.parametrize("pending_status", [0, -2])
def test_writes_still_pending_at_the_deadline_are_named(pending_status):
    # The others complete at their first look, which may come after the deadline passed.
    binding = ScriptedBinding(stuck=frozenset({2, 5}), pending_status=pending_status, pending_looks=0)
    with pytest.raises(WriteUnresolved) as info:
        scripted_engine(binding).write("peer", [(0, 0, 10)] * 8, timeout_s=0.01)
    assert info.value.pending == [1002, 1005]
    assert isinstance(info.value, TransferError)
    assert binding.finished == set(binding.submitted) - {1002, 1005}  # every other write was waited for


def test_a_write_stuck_at_the_head_of_a_full_window_stops_submits():
    binding = ScriptedBinding(stuck=frozenset({0}), pending_looks=0)
    with pytest.raises(WriteUnresolved) as info:
        scripted_engine(binding).write("peer", [(0, 0, 10)] * (MAX_IN_FLIGHT + 10), timeout_s=0.01)
    assert info.value.pending == [1000]
    assert len(binding.submitted) == MAX_IN_FLIGHT
    assert binding.finished == set(binding.submitted) - {1000}


def test_a_write_seen_pending_after_the_deadline_is_unresolved_too():
    """Every write is pending at its first look: those first looked at after the deadline are named."""
    binding = ScriptedBinding(stuck=frozenset({0}))
    with pytest.raises(WriteUnresolved) as info:
        scripted_engine(binding).write("peer", [(0, 0, 10)] * 3, timeout_s=0.01)
    assert info.value.pending == [1000, 1001, 1002]


def test_unresolved_names_the_writes_neither_done_nor_failed():
    class Statuses:
        def __init__(self) -> None:
            self.asked: list[int] = []

        def transfer_check_status(self, batch_id: int) -> int:
            self.asked.append(batch_id)
            return {1: 1, 2: -1, 3: 0, 4: -2, 5: 2}[batch_id]

    binding = Statuses()
    assert scripted_engine(binding).unresolved([1, 2, 3, 4, 5]) == [3, 4, 5]
    assert binding.asked == [1, 2, 3, 4, 5]
    assert scripted_engine(binding).unresolved([]) == []


class BlockingBinding:
    """Stands in for the binding's blocking calls: records them, returns ``rc`` from the ``fail_at``-th."""

    def __init__(self, rc: int = 0, fail_at: int | None = None):
        self.rc, self.fail_at = rc, fail_at
        self.calls: list[tuple[str, int]] = []

    def _answer(self) -> int:
        return self.rc if len(self.calls) - 1 == self.fail_at else 0

    def transfer_sync_write(self, peer: str, src: int, dst: int, length: int) -> int:
        self.calls.append(("one", 1))
        return self._answer()

    def batch_transfer_sync_write(self, peer: str, src: list[int], dst: list[int], lengths: list[int]) -> int:
        assert len(src) == len(dst) == len(lengths)
        self.calls.append(("batch", len(src)))
        return self._answer()


def test_blocking_writes_go_in_batches_below_the_engine_limit():
    binding = BlockingBinding()
    writes = [(i, i, 3) for i in range(2 * MAX_BATCH_ENTRIES + 1)]
    assert scripted_engine(binding, polled=False).write("peer", writes) == 3 * len(writes)
    assert binding.calls == [("batch", MAX_BATCH_ENTRIES), ("batch", MAX_BATCH_ENTRIES), ("one", 1)]


def test_a_failed_blocking_write_is_unresolved_and_stops():
    binding = BlockingBinding(rc=-1, fail_at=0)
    writes = [(i, i, 3) for i in range(2 * MAX_BATCH_ENTRIES)]
    with pytest.raises(WriteUnresolved) as info:
        scripted_engine(binding, polled=False).write("peer", writes)
    assert info.value.pending == []  # the blocking call's ids cannot be asked after
    assert binding.calls == [("batch", MAX_BATCH_ENTRIES)]


class HangingBinding(BlockingBinding):
    """A blocking call to ``hung`` that never returns until the test lets it (an RDMA peer gone dark)."""

    def __init__(self) -> None:
        super().__init__()
        self.let_go = threading.Event()

    def transfer_sync_write(self, peer: str, src: int, dst: int, length: int) -> int:
        if peer == "hung":
            self.let_go.wait(30)
        return super().transfer_sync_write(peer, src, dst, length)

    def batch_transfer_sync_write(self, peer: str, src: list[int], dst: list[int], lengths: list[int]) -> int:
        if peer == "hung":
            self.let_go.wait(30)
        return super().batch_transfer_sync_write(peer, src, dst, lengths)


def test_a_hung_blocking_write_is_given_up_at_its_deadline_and_the_next_write_goes_on():
    binding = HangingBinding()
    engine = scripted_engine(binding, polled=False)
    caller = concurrent.futures.ThreadPoolExecutor(1)  # one thread, as a rank's writes share a few
    try:
        hung = caller.submit(engine.write, "hung", [(0, 0, 3)], 0.2)
        with pytest.raises(WriteUnresolved) as info:
            hung.result(timeout=10)
        assert info.value.pending == [] and engine.hung_writes == 1
        # The caller's thread is free again: the next write, to a live peer, completes.
        assert caller.submit(engine.write, "live", [(0, 0, 3)], 5.0).result(timeout=10) == 3
        assert binding.calls == [("one", 1)]
    finally:
        binding.let_go.set()
        caller.shutdown()


def test_a_blocking_write_given_up_starts_no_more_of_its_batch_once_its_call_returns():
    binding = HangingBinding()
    engine = scripted_engine(binding, polled=False)
    try:
        with pytest.raises(WriteUnresolved):
            engine.write("hung", [(i, i, 3) for i in range(2 * MAX_BATCH_ENTRIES)], 0.2)
    finally:
        binding.let_go.set()
    for thread in threading.enumerate():
        if thread.name == "kvroom-blocking-write":
            thread.join(10)
    assert binding.calls == [("batch", MAX_BATCH_ENTRIES)]  # the second half never went out


def test_jobs_together_are_all_submitted_before_any_is_waited_for():
    binding = ScriptedBinding()
    jobs = [
        WriteJob("peer", [(0, 0, 10)] * 2),
        WriteJob("peer", [(0, 0, 5)] * 3),
        WriteJob("peer", [(0, 0, 1)]),
    ]
    assert list(scripted_engine(binding).write_together(jobs)) == [20, 15, 1]
    assert binding.most_in_flight == 6
    assert binding.finished == set(binding.submitted)


def test_a_job_that_fails_together_with_others_fails_alone():
    binding = ScriptedBinding(fail_at=1)  # the second write of the first job
    jobs = [WriteJob("peer", [(0, 0, 10)] * 2), WriteJob("peer", [(0, 0, 10)])]
    first, second = scripted_engine(binding).write_together(jobs)
    assert isinstance(first, TransferError) and not isinstance(first, WriteUnresolved)
    assert second == 10
    assert binding.finished == set(binding.submitted)  # the failed job's other write was waited for


def test_a_job_stuck_together_with_others_is_unresolved_alone():
    binding = ScriptedBinding(stuck=frozenset({1}), pending_looks=0)
    jobs = [
        WriteJob("peer", [(0, 0, 10)]),
        WriteJob("peer", [(0, 0, 10)] * 2, 0.01),
        WriteJob("peer", [(0, 0, 1)]),
    ]
    first, second, third = scripted_engine(binding).write_together(jobs)
    assert first == 10 and third == 1
    assert isinstance(second, WriteUnresolved) and second.pending == [1001]


def test_jobs_past_the_window_or_on_the_blocking_path_run_one_after_another():
    binding = ScriptedBinding()
    jobs = [WriteJob("peer", [(0, 0, 1)] * MAX_IN_FLIGHT), WriteJob("peer", [(0, 0, 1)] * 2)]
    assert list(scripted_engine(binding).write_together(jobs)) == [MAX_IN_FLIGHT, 2]
    assert binding.most_in_flight == MAX_IN_FLIGHT
    blocking = BlockingBinding()
    jobs = [WriteJob("peer", [(0, 0, 3)]), WriteJob("peer", [(0, 0, 3)] * 2)]
    assert list(scripted_engine(blocking, polled=False).write_together(jobs)) == [3, 6]
    assert blocking.calls == [("one", 1), ("batch", 2)]
