import json
import subprocess
import sys

import pytest

from shared.kv_pool import KVPool
from shared.model import ReferenceModel, configure_determinism, encode_text, generate, pages_needed


@pytest.fixture(scope="module")
def model():
    configure_determinism()
    return ReferenceModel()


def test_weights_come_from_the_seed(model):
    other = ReferenceModel()
    assert all(
        (a == b).all() for a, b in zip(model.layers[0].values(), other.layers[0].values(), strict=True)
    )


def test_generate_is_deterministic_and_prompt_dependent(model):
    a = generate(model, encode_text("hello"), 12)
    assert a == generate(model, encode_text("hello"), 12)
    assert len(a) == 12 and all(32 <= t < 127 for t in a)
    assert a != generate(model, encode_text("goodbye"), 12)


@pytest.mark.parametrize("page_size", [1, 4, 64])
def test_page_size_does_not_change_tokens(model, page_size):
    ids = encode_text("paged attention reads what prefill wrote " * 3)
    assert generate(model, ids, 10, page_size) == generate(model, ids, 10, 16)


def prefilled(model, ids, max_new_tokens):
    """A pool holding the prompt's KV: (layout, pool, its pages, the first output token)."""
    layout = model.config.kv_layout(16)
    n = pages_needed(layout, len(ids), max_new_tokens)
    pool = KVPool(layout, n)
    pages = pool.alloc(n)
    first, _ = model.prefill(pool, pages, ids)
    return layout, pool, pages, first


def test_kv_moved_to_scattered_pages_decodes_the_same(model):
    """What a disaggregated run does: prefill in one pool, copy pages, decode in another."""
    ids = encode_text("x" * 70)
    layout, src, src_pages, first = prefilled(model, ids, 8)
    n = len(src_pages)
    dst = KVPool(layout, 32)
    dst_pages = [30, 2, 17, 5, 9, 11][:n]
    for s, d in zip(src_pages[: layout.pages_for(len(ids))], dst_pages, strict=False):
        dst.data[d] = src.data[s]
    assert model.decode(dst, dst_pages, len(ids), first, 8) == generate(model, ids, 8)


def test_corrupted_kv_changes_the_output(model):
    ids = encode_text("the transferred KV matters " * 4)
    _, pool, pages, first = prefilled(model, ids, 12)
    pool.data[pages[0]] = 0  # a page that never landed
    assert model.decode(pool, pages, len(ids), first, 12) != generate(model, ids, 12)


def test_cli_prints_json(model):
    out = subprocess.run(
        [sys.executable, "-m", "shared.model", "--prompt", "hi", "--max-new-tokens", "5"],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    body = json.loads(out.stdout)
    assert body["output_ids"] == generate(model, encode_text("hi"), 5)
    assert body["text"] == bytes(body["output_ids"]).decode()
