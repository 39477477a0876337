import pytest

from launcher.local_stack import LocalStack
from shared.model import ReferenceModel, configure_determinism

# Short liveness settings so fault tests finish in seconds.
FAST_BOOTSTRAP = ["--node-ttl-s", "1.5"]
FAST_NODE = ["--heartbeat-interval-s", "0.3", "--register-retry-s", "0.2"]


def _stack(tmp_path, bootstrap_args=None):
    s = LocalStack(tmp_path / "logs", bootstrap_args=bootstrap_args)
    try:
        yield s
    finally:
        s.stop()
        for service in s.services:
            print(f"----- {service.name} -----\n{service.log_tail(40)}")


@pytest.fixture
def stack(tmp_path):
    """A fresh set of real service processes; their log tails are printed for a failing test."""
    yield from _stack(tmp_path)


@pytest.fixture
def fast_stack(tmp_path):
    """Like ``stack``, with a bootstrap that declares a node dead after 1.5 s of silence."""
    yield from _stack(tmp_path, FAST_BOOTSTRAP)


@pytest.fixture(scope="session")
def model():
    configure_determinism()
    return ReferenceModel()
