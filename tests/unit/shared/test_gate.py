"""The SUCCESS gate: a room is ready only on intact, agreeing done+aux from every expected prefill rank.

The gate is pure, so these tests drive it through every order of arrival.
"""

import itertools

import pytest

from shared.kv.aux_buffers import Aux
from shared.room.gate import Expected, Invalid, Landed, Pending, RankView, Ready, node_verdict, rank_verdict
from shared.room.states import FailureReason, RoomState

S = RoomState
ROOM = 77
PROMPT_LEN = 5
VOCAB = 256
PAGES = 3
AUX = Aux(transfer=ROOM, first_token=65, cached_tokens=PROMPT_LEN, logprob=-0.5)  # exact in float32


def expected(ranks: range | set[int] = range(1)) -> Expected:
    return Expected(ROOM, PROMPT_LEN, VOCAB, PAGES, frozenset(ranks))


def landed(aux: Aux = AUX, pages: int = PAGES, intact: bool = True) -> Landed:
    return Landed(aux.pack(), pages, intact)


def flipped(record: bytes, bit: int = 3) -> bytes:
    out = bytearray(record)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


CORRUPT = Landed(flipped(AUX.pack()), PAGES, True)
READY = Ready(AUX, AUX.pack())


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ready_only_once_every_rank_landed_in_every_order(world):
    """Pending after every arrival but the last, whichever order the ranks' done+aux come in."""
    for order in itertools.permutations(range(world)):
        got: dict[int, Landed] = {}
        for i, rank in enumerate(order):
            got[rank] = landed()
            verdict = rank_verdict(expected(range(world)), got)
            assert verdict == (READY if i == world - 1 else Pending()), (order, i)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_duplicates_change_nothing_in_any_order(world):
    """Each rank lands twice, in every interleaving: the verdict depends on which ranks landed, only."""
    for order in set(itertools.permutations([*range(world), *range(world)])):
        got: dict[int, Landed] = {}
        for i, rank in enumerate(order):
            got[rank] = landed()
            verdict = rank_verdict(expected(range(world)), got)
            assert verdict == (READY if len(got) == world else Pending()), (order, i)


def test_writers_need_not_be_ranks_0_to_n():
    """A decode rank written by prefill ranks 1 and 3 waits for exactly those two."""
    writers = {1, 3}
    assert rank_verdict(expected(writers), {1: landed()}) == Pending()
    assert rank_verdict(expected(writers), {3: landed()}) == Pending()
    assert rank_verdict(expected(writers), {1: landed(), 3: landed()}) == READY


def test_nothing_landed_is_pending():
    assert rank_verdict(expected(range(2)), {}) == Pending()


def test_ready_carries_the_record_that_landed():
    verdict = rank_verdict(expected(), {0: landed()})
    assert isinstance(verdict, Ready)
    assert verdict.aux == AUX and verdict.record == AUX.pack()


@pytest.mark.parametrize(
    ("aux", "why"),
    [
        pytest.param(Aux(ROOM + 1, 65, PROMPT_LEN, -0.5), "transfer", id="another transfer"),
        pytest.param(Aux(0, 65, PROMPT_LEN, -0.5), "transfer", id="transfer 0"),
        pytest.param(Aux(ROOM, 65, PROMPT_LEN - 1, -0.5), "cached", id="fewer cached tokens"),
        pytest.param(Aux(ROOM, 65, PROMPT_LEN + 1, -0.5), "cached", id="more cached tokens"),
        pytest.param(Aux(ROOM, -1, PROMPT_LEN, -0.5), "vocabulary", id="token below 0"),
        pytest.param(Aux(ROOM, VOCAB, PROMPT_LEN, -0.5), "vocabulary", id="token at vocab size"),
        pytest.param(Aux(ROOM, 1 << 30, PROMPT_LEN, -0.5), "vocabulary", id="token far out"),
    ],
)
@pytest.mark.parametrize("world", [1, 3])
def test_an_intact_record_that_does_not_fit_the_room_is_invalid(aux, why, world):
    """Invalid as soon as it lands, whether or not the other ranks have landed yet."""
    bad_rank = world - 1
    for others in ([], [r for r in range(world) if r != bad_rank]):
        got = {r: landed() for r in others} | {bad_rank: landed(aux)}
        verdict = rank_verdict(expected(range(world)), got)
        assert isinstance(verdict, Invalid), (others, verdict)
        assert verdict.reason is FailureReason.AUX_INVALID and why in verdict.detail


@pytest.mark.parametrize("token", [0, VOCAB - 1])
def test_first_tokens_at_the_edges_of_the_vocabulary_are_valid(token):
    aux = Aux(ROOM, token, PROMPT_LEN, -0.5)
    assert rank_verdict(expected(), {0: landed(aux)}) == Ready(aux, aux.pack())


@pytest.mark.parametrize("pages", [0, PAGES - 1, PAGES + 1])
@pytest.mark.parametrize("record", ["intact", "corrupt", "none"])
def test_a_rank_that_wrote_the_wrong_number_of_pages_is_invalid(pages, record):
    """Decided from the done notice, whatever state its record is in."""
    rec = {"intact": AUX.pack(), "corrupt": flipped(AUX.pack()), "none": None}[record]
    verdict = rank_verdict(expected(range(2)), {0: landed(), 1: Landed(rec, pages, True)})
    assert isinstance(verdict, Invalid)
    assert verdict.reason is FailureReason.AUX_INVALID and "pages" in verdict.detail


@pytest.mark.parametrize("record", ["intact", "corrupt", "none"])
def test_kv_that_does_not_match_its_digest_is_corrupt(record):
    """Decided from the done notice, whatever state its record is in."""
    rec = {"intact": AUX.pack(), "corrupt": flipped(AUX.pack()), "none": None}[record]
    verdict = rank_verdict(expected(range(2)), {1: Landed(rec, PAGES, False)})
    assert isinstance(verdict, Invalid)
    assert verdict.reason is FailureReason.KV_CORRUPT


@pytest.mark.parametrize("record", ["intact", "corrupt", "none"])
def test_done_aux_from_a_rank_that_is_not_a_writer_is_invalid(record):
    """Even once every expected rank landed: a stranger's word never counts toward, or waits."""
    rec = {"intact": AUX.pack(), "corrupt": flipped(AUX.pack()), "none": None}[record]
    writers = {1, 3}
    for stranger in (0, 2, 4):
        got = {1: landed(), 3: landed(), stranger: Landed(rec, PAGES, True)}
        verdict = rank_verdict(expected(writers), got)
        assert isinstance(verdict, Invalid), stranger
        assert verdict.reason is FailureReason.AUX_INVALID and str(stranger) in verdict.detail


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(Aux(ROOM, 66, PROMPT_LEN, -0.5), id="first token 65 vs 66"),
        pytest.param(Aux(ROOM, 65, PROMPT_LEN, -0.25), id="logprob"),
    ],
)
@pytest.mark.parametrize(("world", "odd"), [(2, 0), (2, 1), (3, 0), (3, 1), (3, 2), (4, 2), (4, 3)])
def test_ranks_whose_records_differ_are_a_mismatch(other, world, odd):
    """One rank of ``world`` (the ``odd`` one, first, middle or last) sent a different record."""
    got = {r: landed(other if r == odd else AUX) for r in range(world)}
    verdict = rank_verdict(expected(range(world)), got)
    assert isinstance(verdict, Invalid)
    assert verdict.reason is FailureReason.AUX_MISMATCH


@pytest.mark.parametrize("bit", [0, 7, 64, 100, 159, 160, 191])
def test_a_corrupt_record_waits_for_an_intact_copy(bit):
    record = flipped(AUX.pack(), bit)
    got = {0: landed(), 1: Landed(record, PAGES, True)}
    assert rank_verdict(expected(range(2)), got) == Pending(frozenset({1}))
    got[1] = landed()  # the copy that follows
    assert rank_verdict(expected(range(2)), got) == READY


def test_every_corrupt_rank_is_named():
    got = {0: CORRUPT, 1: landed(), 2: CORRUPT}
    assert rank_verdict(expected(range(4)), got) == Pending(frozenset({0, 2}))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_corrupt_and_intact_copies_in_every_order(world):
    """Each rank lands a corrupt copy and an intact one, in every interleaving: the verdict at
    every step follows from each rank's latest copy alone."""
    events = [(r, CORRUPT) for r in range(world)] + [(r, landed()) for r in range(world)]
    for order in itertools.permutations(events):
        got: dict[int, Landed] = {}
        for rank, copy in order:
            got[rank] = copy
            corrupt = frozenset(r for r, c in got.items() if c is CORRUPT)
            intact = len(got) == world and not corrupt
            assert rank_verdict(expected(range(world)), got) == (READY if intact else Pending(corrupt))


def test_a_done_without_its_record_is_pending_and_not_corrupt():
    assert rank_verdict(expected(), {0: Landed(None, PAGES, True)}) == Pending()
    got = {0: Landed(None, PAGES, True), 1: landed()}
    assert rank_verdict(expected(range(2)), got) == Pending()


# node_verdict: what a node's ranks agree on.


def view(state: RoomState, reason: str | None = None, digest: int = 0) -> RankView:
    return RankView(state, reason, digest)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_all_ranks_ready_with_the_same_record_is_success(world):
    ranks = {r: view(S.SUCCESS, digest=1234) for r in range(world)}
    assert node_verdict(ranks, world) == (S.SUCCESS, None)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ready_ranks_with_different_records_fail(world):
    for odd in range(world):
        ranks = {r: view(S.SUCCESS, digest=99 if r == odd else 1234) for r in range(world)}
        assert node_verdict(ranks, world) == (S.FAILED, FailureReason.AUX_MISMATCH)


def test_digests_only_matter_once_every_rank_is_ready():
    ranks = {0: view(S.SUCCESS, digest=5), 1: view(S.TRANSFERRING)}
    assert node_verdict(ranks, 2) == (S.TRANSFERRING, None)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_agreed_state_is_the_minimum_over_ranks(world):
    live = [S.BOOTSTRAPPING, S.WAITING_FOR_INPUT, S.TRANSFERRING, S.SUCCESS]
    for states in itertools.product(live, repeat=world):
        ranks = {r: view(s, reason="ignored" if s is not S.SUCCESS else None) for r, s in enumerate(states)}
        assert node_verdict(ranks, world) == (min(states), None), states


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_rank_not_heard_from_is_still_bootstrapping(world):
    for missing in range(world):
        ranks = {r: view(S.SUCCESS) for r in range(world) if r != missing}
        assert node_verdict(ranks, world) == (S.BOOTSTRAPPING, None)
    assert node_verdict({}, world) == (S.BOOTSTRAPPING, None)


def test_one_failed_rank_fails_the_room_with_its_reason():
    assert node_verdict({0: view(S.FAILED, "aux_timeout")}, 1) == (S.FAILED, "aux_timeout")
    ranks = {0: view(S.SUCCESS), 1: view(S.FAILED, "kv_corrupt"), 2: view(S.TRANSFERRING)}
    assert node_verdict(ranks, 3) == (S.FAILED, "kv_corrupt")


def test_failure_wins_over_ranks_not_heard_from():
    assert node_verdict({2: view(S.FAILED, "aborted")}, 4) == (S.FAILED, "aborted")


def test_the_lowest_failed_rank_gives_the_reason():
    """Whatever order the failures were heard in, every node picks the same reason."""
    ranks = {3: view(S.FAILED, "third"), 0: view(S.SUCCESS), 1: view(S.FAILED, "first")}
    assert node_verdict(ranks, 4) == (S.FAILED, "first")
    for order in itertools.permutations([(1, "b"), (2, "c"), (3, "d")]):
        ranks = {r: view(S.FAILED, why) for r, why in order} | {0: view(S.TRANSFERRING)}
        assert node_verdict(ranks, 4) == (S.FAILED, "b")


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_combination_of_rank_states(world):
    """Each rank missing or in any state, with two digests: min, failure first, digests at SUCCESS."""
    options = [None] + [(s, d) for s in S for d in (1, 2)]
    for combo in itertools.product(options, repeat=world):
        ranks = {r: view(c[0], f"r{r}", c[1]) for r, c in enumerate(combo) if c is not None}
        failed = [r for r, c in enumerate(combo) if c is not None and c[0] is S.FAILED]
        if failed:
            want: tuple[RoomState, str | None] = (S.FAILED, f"r{failed[0]}")
        elif len(ranks) < world:
            want = (S.BOOTSTRAPPING, None)
        elif all(v.state is S.SUCCESS for v in ranks.values()):
            same = len({v.digest for v in ranks.values()}) == 1
            want = (S.SUCCESS, None) if same else (S.FAILED, FailureReason.AUX_MISMATCH)
        else:
            want = (min(v.state for v in ranks.values()), None)
        assert node_verdict(ranks, world) == want, combo
