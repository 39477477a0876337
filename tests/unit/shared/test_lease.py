"""Page leases: every transition, and the pool's refusal to free a page a write may still land in."""

import pytest

from shared.errors import IllegalTransition, PagesStillLent
from shared.kv.layout import KVLayout
from shared.kv.lease import TRANSITIONS, Lease, LeaseState
from shared.kv.pool import KVPool

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, page_size=2)


def pool_with_lease() -> tuple[KVPool, list[int], Lease]:
    pool = KVPool(LAYOUT, 8)
    pages = pool.alloc(3)
    return pool, pages, pool.lend(7, 0, pages)


def test_the_table_lets_a_lease_close_once_and_three_ways():
    assert TRANSITIONS[LeaseState.LENT] == {LeaseState.RETURNED, LeaseState.REVOKED, LeaseState.EXPIRED}
    assert all(not TRANSITIONS[state] for state in LeaseState if state is not LeaseState.LENT)


def test_returned_frees_the_pages_and_a_late_word_changes_nothing():
    pool, pages, lease = pool_with_lease()
    with pytest.raises(PagesStillLent):
        pool.free(pages)
    assert lease.returned() and lease.state is LeaseState.RETURNED
    assert not lease.returned()  # a second done or release: already closed
    pool.free(pages)
    assert pool.free_pages == 8


def test_revoked_when_the_borrower_is_gone():
    pool, pages, lease = pool_with_lease()
    lease.revoke()
    assert lease.state is LeaseState.REVOKED and not pool.lent(pages[0])
    lease.revoke()  # said twice: no change
    assert lease.state is LeaseState.REVOKED
    pool.free(pages)


def test_a_lease_expires_only_once_asked_back_and_past_its_deadline():
    pool, pages, lease = pool_with_lease()
    assert not lease.expire_if_due(now=1e12)  # never asked back: a write may take its time
    lease.ask_back(timeout_s=5.0, now=100.0)
    assert not lease.expire_if_due(now=104.0) and lease.open
    assert lease.expire_if_due(now=105.5) and lease.state is LeaseState.EXPIRED
    pool.free(pages)
    # The write that was late lands after the timeout: its done or release finds the lease closed.
    assert not lease.returned() and lease.state is LeaseState.EXPIRED


def test_two_leases_on_the_same_pages_both_must_close():
    """Two prefill ranks write their heads into the same pages."""
    pool = KVPool(LAYOUT, 8)
    pages = pool.alloc(2)
    first, second = pool.lend(7, 0, pages), pool.lend(7, 1, pages)
    first.returned()
    with pytest.raises(PagesStillLent):
        pool.free(pages)
    second.ask_back(1.0, now=0.0)
    second.expire_if_due(now=2.0)
    pool.free(pages)
    assert pool.free_pages == 8


@pytest.mark.parametrize("target", [LeaseState.RETURNED, LeaseState.REVOKED, LeaseState.EXPIRED])
def test_each_transition_is_taken_from_the_table(monkeypatch, target):
    """Without its row in the table, a transition is refused: the table is the rule."""
    _, _, lease = pool_with_lease()
    monkeypatch.setitem(TRANSITIONS, LeaseState.LENT, TRANSITIONS[LeaseState.LENT] - {target})
    lease.ask_back(0.0, now=0.0)
    close = {
        LeaseState.RETURNED: lease.returned,
        LeaseState.REVOKED: lease.revoke,
        LeaseState.EXPIRED: lambda: lease.expire_if_due(now=1.0),
    }[target]
    with pytest.raises(IllegalTransition):
        close()
    assert lease.open
