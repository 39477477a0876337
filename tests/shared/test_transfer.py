import pytest
import torch

from shared.errors import TransferError
from shared.transfer import MAX_IN_FLIGHT, FakeEngine, MooncakeEngine, coalesce, engine_setup

PB = 100


def test_contiguous_pages_become_one_write():
    assert coalesce(1000, [0, 1, 2, 3], 5000, [4, 5, 6, 7], PB) == [(1000, 5400, 400)]


def test_runs_break_where_either_side_jumps():
    writes = coalesce(0, [0, 1, 2, 3, 4], 0, [10, 11, 20, 21, 22], PB)
    assert writes == [(0, 1000, 200), (200, 2000, 300)]
    writes = coalesce(0, [0, 5, 6], 0, [1, 2, 3], PB)
    assert writes == [(0, 100, 100), (500, 200, 200)]


def test_scattered_pages_give_one_write_each():
    assert len(coalesce(0, [0, 1, 2], 0, [9, 5, 1], PB)) == 3


def test_empty_and_mismatched():
    assert coalesce(0, [], 0, [], PB) == []
    with pytest.raises(ValueError):
        coalesce(0, [1], 0, [], PB)


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


def test_long_runs_are_cut_at_the_write_limit():
    assert coalesce(0, [0, 1, 2, 3, 4], 1000, [0, 1, 2, 3, 4], PB, max_bytes=200) == [
        (0, 1000, 200),
        (200, 1200, 200),
        (400, 1400, 100),
    ]
    # Pages larger than the limit are cut too: a write is only a byte range.
    assert coalesce(0, [0, 1], 1000, [5, 6], PB, max_bytes=80) == [
        (0, 1500, 80),
        (80, 1580, 80),
        (160, 1660, 40),
    ]


class ScriptedBinding:
    """Stands in for the engine's Python binding on the polled path: each write is
    pending at its first look and then completes, or fails if it is ``fail_at``."""

    def __init__(self, fail_at: int | None = None, refuse_at: int | None = None):
        self.fail_at, self.refuse_at = fail_at, refuse_at
        self.submitted: list[int] = []
        self.finished: set[int] = set()
        self.looks: dict[int, int] = {}
        self.most_in_flight = 0

    def transfer_submit_write(self, peer: str, src: int, dst: int, length: int) -> int:
        if len(self.submitted) == self.refuse_at:
            return 0
        batch_id = 1000 + len(self.submitted)
        self.submitted.append(batch_id)
        self.most_in_flight = max(self.most_in_flight, len(self.submitted) - len(self.finished))
        return batch_id

    def transfer_check_status(self, batch_id: int) -> int:
        self.looks[batch_id] = self.looks.get(batch_id, 0) + 1
        if self.looks[batch_id] == 1:
            return 0
        self.finished.add(batch_id)
        return -1 if batch_id - 1000 == self.fail_at else 1


def polled_engine(binding: ScriptedBinding) -> MooncakeEngine:
    engine = MooncakeEngine.__new__(MooncakeEngine)  # no real engine: the binding is scripted
    engine._engine = binding
    engine._polled = True
    return engine


def test_polled_writes_keep_a_bounded_number_in_flight():
    binding = ScriptedBinding()
    count = 2 * MAX_IN_FLIGHT + 7
    assert polled_engine(binding).write("peer", [(0, 0, 10)] * count) == 10 * count
    assert len(binding.submitted) == count
    assert binding.most_in_flight == MAX_IN_FLIGHT
    assert binding.finished == set(binding.submitted)


@pytest.mark.parametrize("script", [{"fail_at": 3}, {"refuse_at": 5}])
def test_a_failed_write_raises_only_once_nothing_submitted_is_still_moving(script):
    binding = ScriptedBinding(**script)
    with pytest.raises(TransferError):
        polled_engine(binding).write("peer", [(0, 0, 10)] * 10)
    assert binding.submitted  # some writes went out before the failure
    assert binding.finished == set(binding.submitted)
