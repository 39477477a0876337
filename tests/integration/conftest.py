import pytest

from shared.local_stack import LocalStack
from shared.model import ReferenceModel, configure_determinism


@pytest.fixture
def stack(tmp_path):
    """A fresh set of real service processes; their log tails are printed for a failing test."""
    s = LocalStack(tmp_path / "logs")
    try:
        yield s
    finally:
        s.stop()
        for service in s.services:
            print(f"----- {service.name} -----\n{service.log_tail(40)}")


@pytest.fixture(scope="session")
def model():
    configure_determinism()
    return ReferenceModel()
