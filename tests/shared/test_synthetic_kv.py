import pytest
import torch

from shared import synthetic_kv
from shared.kv_layout import KVLayout
from shared.kv_pool import KVPool

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="bfloat16")


@pytest.fixture(params=["words", "tensor ops"])
def path(request, monkeypatch):
    """Both ways of stamping: word by word (CPU pools), and tensor ops (pools on a device)."""
    monkeypatch.setattr(synthetic_kv, "_TENSOR_OPS_ON_CPU", request.param == "tensor ops")


def test_stamps_survive_a_faithful_copy_and_catch_a_wrong_one(path):
    src, dst = KVPool(LAYOUT, 8), KVPool(LAYOUT, 8)
    src_pages, dst_pages = [1, 2, 5], [7, 0, 3]
    synthetic_kv.fill(src, src_pages, room=42)
    for s, d in zip(src_pages, dst_pages, strict=True):
        dst.data[d] = src.data[s]
    assert synthetic_kv.verify(dst, dst_pages, room=42)
    assert not synthetic_kv.verify(dst, dst_pages, room=43)  # another room's stamps
    assert not synthetic_kv.verify(dst, [0, 7, 3], room=42)  # pages out of place
    dst.data[3].view(-1)[-4:] = 0  # the last 8 bytes of the last page never landed
    assert not synthetic_kv.verify(dst, dst_pages, room=42)


def test_both_paths_stamp_alike(monkeypatch):
    pools = []
    for tensor_ops in (False, True):
        monkeypatch.setattr(synthetic_kv, "_TENSOR_OPS_ON_CPU", tensor_ops)
        pool = KVPool(LAYOUT, 8)
        synthetic_kv.fill(pool, [6, 2, 3], room=(1 << 62) + 5)
        pools.append(pool.data.clone())
    assert pools[0].count_nonzero() > 0
    assert bool((pools[0].view(-1).view(torch.int64) == pools[1].view(-1).view(torch.int64)).all())
