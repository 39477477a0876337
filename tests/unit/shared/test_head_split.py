"""How tensor-parallel ranks share heads, and which prefill rank writes which heads to which decode rank."""

import itertools

import pytest

from shared.kv.head_split import HeadRange, kv_heads, mapping_problem, query_heads, split_problem, writers

SIZES = [1, 2, 4, 8]


def node(tp: int, num_kv_heads: int) -> list[HeadRange]:
    return [kv_heads(r, tp, num_kv_heads) for r in range(tp)]


def test_head_range():
    r = HeadRange(2, 3)
    assert r.stop == 5
    assert [h for h in range(8) if h in r] == [2, 3, 4]
    assert "2" not in r and 2.0 not in r


@pytest.mark.parametrize(
    ("heads", "kv", "tp", "why"),
    [
        (8, 4, 0, "at least 1"),
        (8, 4, 3, "query heads do not split"),
        (8, 3, 1, "do not group"),
        (24, 6, 4, "neither split over nor replicate"),
        (24, 4, 6, "neither split over nor replicate"),
    ],
)
def test_split_problems_are_named(heads, kv, tp, why):
    problem = split_problem(heads, kv, tp)
    assert problem is not None and why in problem


@pytest.mark.parametrize(
    ("heads", "kv", "tp"), [(8, 4, 1), (8, 4, 2), (8, 4, 4), (8, 4, 8), (8, 2, 8), (8, 8, 4)]
)
def test_splits_that_work(heads, kv, tp):
    assert split_problem(heads, kv, tp) is None


@pytest.mark.parametrize("tp", SIZES)
def test_query_heads_tile_the_heads_in_rank_order(tp):
    ranges = [query_heads(r, tp, 8) for r in range(tp)]
    assert [h for r in ranges for h in range(r.start, r.stop)] == list(range(8))
    assert {r.count for r in ranges} == {8 // tp}


@pytest.mark.parametrize("kv", [2, 4, 8])
@pytest.mark.parametrize("tp", SIZES)
def test_kv_heads_split_or_replicate(tp, kv):
    ranges = node(tp, kv)
    if tp <= kv:  # a share each, in order, nothing held twice
        assert [h for r in ranges for h in range(r.start, r.stop)] == list(range(kv))
    else:  # one head each, every head held by tp / kv consecutive ranks
        assert all(r.count == 1 for r in ranges)
        assert [r.start for r in ranges] == [h for h in range(kv) for _ in range(tp // kv)]


def test_replication_when_ranks_outnumber_kv_heads():
    assert node(8, 4) == [HeadRange(h, 1) for h in (0, 0, 1, 1, 2, 2, 3, 3)]
    assert node(2, 4) == [HeadRange(0, 2), HeadRange(2, 2)]


@pytest.mark.parametrize(("tp", "kv"), [(1, 4), (2, 4), (4, 4), (8, 4), (8, 2), (4, 8)])
def test_a_node_laid_out_as_kv_heads_says_has_no_mapping_problem(tp, kv):
    assert mapping_problem(node(tp, kv), kv) is None


def test_mapping_problems_name_the_rank():
    wrong = [HeadRange(0, 2), HeadRange(1, 2)]
    problem = mapping_problem(wrong, 4)
    assert problem is not None and "rank 1" in problem and "[1, 3)" in problem and "[2, 4)" in problem
    assert mapping_problem([HeadRange(0, 1)] * 3, 4) is not None  # 3 ranks cannot hold 4 heads
    assert mapping_problem([HeadRange(0, 4), HeadRange(0, 4)], 4) is not None  # both hold everything


@pytest.mark.parametrize("kv", [2, 4, 8])
@pytest.mark.parametrize(("np_", "nd"), list(itertools.product(SIZES, SIZES)))
def test_every_decode_head_is_written_exactly_once_by_a_holder(np_, nd, kv):
    prefill = node(np_, kv)
    for d in range(nd):
        decode = kv_heads(d, nd, kv)
        plan = writers(prefill, decode, d)
        written: list[int] = []
        for p, heads in plan.items():
            assert heads.count >= 1
            assert all(h in prefill[p] for h in range(heads.start, heads.stop)), (p, heads)
            written += range(heads.start, heads.stop)
        assert sorted(written) == list(range(decode.start, decode.stop)), (d, plan)


@pytest.mark.parametrize("kv", [2, 4])
@pytest.mark.parametrize("nd", SIZES)
def test_replicated_prefill_heads_spread_over_their_holders(nd, kv):
    """With 8 prefill ranks a head has several holders: the decode ranks that read it use as many
    of them as there are readers (or holders, if fewer)."""
    prefill = node(8, kv)
    used: dict[int, set[int]] = {}
    readers: dict[int, int] = {}
    for d in range(nd):
        decode = kv_heads(d, nd, kv)
        for p, heads in writers(prefill, decode, d).items():
            for h in range(heads.start, heads.stop):
                used.setdefault(h, set()).add(p)
                readers[h] = readers.get(h, 0) + 1
    holders = 8 // kv
    assert set(used) == set(range(kv))
    for h in range(kv):
        assert len(used[h]) == min(holders, readers[h]), (h, used[h])


def test_eight_prefill_ranks_to_eight_decode_ranks_pair_up():
    prefill = node(8, 4)
    assert [writers(prefill, kv_heads(d, 8, 4), d) for d in range(8)] == [
        {d: HeadRange(d // 2, 1)} for d in range(8)
    ]


def test_one_prefill_rank_writes_everything_as_one_range():
    assert writers(node(1, 4), HeadRange(0, 4), 0) == {0: HeadRange(0, 4)}
    assert writers(node(4, 4), HeadRange(0, 4), 0) == {p: HeadRange(p, 1) for p in range(4)}


def test_a_head_nobody_holds_is_refused():
    with pytest.raises(ValueError, match="head 3"):
        writers([HeadRange(0, 3)], HeadRange(0, 4), 0)


def test_a_non_contiguous_share_is_refused():
    """Rank 0 would write heads 0 and 2, rank 1 the head between: not one range of a page."""
    with pytest.raises(ValueError, match="non-contiguous"):
        writers([HeadRange(0, 3), HeadRange(1, 1)], HeadRange(0, 3), 1)
