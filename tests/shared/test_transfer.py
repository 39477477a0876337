import pytest
import torch

from shared.errors import TransferError
from shared.transfer import FakeEngine, coalesce, engine_environment

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


def test_transport_environment():
    assert engine_environment("tcp")["MC_FORCE_TCP"] == "1"
    assert engine_environment("rdma") == {"MC_FORCE_TCP": "0", "MC_INTRANODE_NVLINK": "0"}
    assert engine_environment("nvlink")["MC_INTRANODE_NVLINK"] == "1"


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
