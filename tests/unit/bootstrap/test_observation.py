"""Observer blindness is not node death: a node is silent only after a TTL of the bootstrap's own
watching, whatever kept the bootstrap from watching (its start, a stall of its own, its store)."""

from bootstrap.directory import BLIND_GAP_S, Observation

TTL = 5.0
SWEEP = 0.25


def watched(observation: Observation, start: float, end: float) -> None:
    """Looks at the nodes every sweep from ``start`` to ``end``, none missed."""
    now = start
    while now <= end:
        assert observation.looked(now) is None
        now += SWEEP


def test_after_its_start_a_node_whose_lease_ran_out_gets_one_ttl():
    observation = Observation(TTL, now=100.0)
    watched(observation, 100.0, 104.75)
    assert not observation.silent(lease_ran_out=True, now=104.75)
    watched(observation, 105.0, 105.0)
    assert observation.silent(lease_ran_out=True, now=105.0)


def test_a_node_whose_lease_runs_is_never_silent():
    observation = Observation(TTL, now=0.0)
    watched(observation, 0.0, 60.0)
    assert not observation.silent(lease_ran_out=False, now=60.0)


def test_a_node_really_silent_for_a_ttl_of_watching_is_dead():
    observation = Observation(TTL, now=0.0)
    watched(observation, 0.0, 30.0)
    assert observation.silent(lease_ran_out=True, now=30.0)


def test_a_stall_of_the_bootstrap_gives_every_node_a_ttl_from_its_end():
    observation = Observation(TTL, now=0.0)
    watched(observation, 0.0, 30.0)
    # Stopped for two TTLs: the first look after it finds every lease run out.
    assert observation.looked(40.0) == 10.0
    assert not observation.silent(lease_ran_out=True, now=40.0)
    watched(observation, 40.25, 44.75)
    assert not observation.silent(lease_ran_out=True, now=44.75)
    watched(observation, 45.0, 45.0)
    assert observation.silent(lease_ran_out=True, now=45.0)  # then silence is silence again


def test_a_look_late_by_less_than_the_gap_is_no_stall():
    observation = Observation(TTL, now=0.0)
    watched(observation, 0.0, 30.0)
    gap = max(BLIND_GAP_S, TTL / 4)
    assert observation.looked(30.0 + gap) is None  # a busy loop, not a blind bootstrap
    assert observation.silent(lease_ran_out=True, now=30.0 + gap)


def test_the_gap_grows_with_a_long_ttl():
    observation = Observation(60.0, now=0.0)
    assert observation.gap_s == 15.0
    assert observation.looked(10.0) is None  # a 10 s pause cannot run out a 60 s lease
    assert observation.looked(40.0) == 30.0


def test_a_store_outage_gives_every_node_a_ttl_from_the_store_s_return():
    observation = Observation(TTL, now=0.0)
    watched(observation, 0.0, 30.0)
    # The store fails for 7 s: the sweeps fail (no look) and say so each time.
    now = 30.25
    while now < 37.0:
        observation.blind(now)
        now += SWEEP
    assert observation.looked(37.0) is not None  # the first look once it answers again
    assert not observation.silent(lease_ran_out=True, now=37.0)
    watched(observation, 37.25, 41.75)
    assert not observation.silent(lease_ran_out=True, now=41.75)
    watched(observation, 42.0, 42.0)
    assert observation.silent(lease_ran_out=True, now=42.0)


def test_a_beat_the_store_could_not_take_gives_a_ttl_though_every_sweep_looked():
    observation = Observation(TTL, now=0.0)
    watched(observation, 0.0, 30.0)
    observation.blind(30.1)  # a heartbeat's write failed between two sweeps that read fine
    watched(observation, 30.25, 35.0)
    assert not observation.silent(lease_ran_out=True, now=35.0)
    assert observation.silent(lease_ran_out=True, now=35.1)
