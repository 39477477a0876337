import gc

from shared.heap import freeze_startup_heap


def test_objects_alive_at_start_up_are_no_longer_scanned():
    survivor = {"held": [object() for _ in range(1000)]}
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() >= 1000
        assert not any(o is survivor for o in gc.get_objects())  # out of every generation
    finally:
        gc.unfreeze()
