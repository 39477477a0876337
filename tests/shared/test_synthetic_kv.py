from shared import synthetic_kv
from shared.kv_layout import KVLayout
from shared.kv_pool import KVPool

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="bfloat16")


def test_stamps_survive_a_faithful_copy_and_catch_a_wrong_one():
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
