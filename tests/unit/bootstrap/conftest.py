from collections.abc import Iterator

import pytest
import zmq

from tests.unit.bootstrap.silent_node import SilentNode


@pytest.fixture
def silent_nodes() -> Iterator[tuple[SilentNode, SilentNode]]:
    """A prefill and a decode node that take every room and never answer."""
    context = zmq.Context()
    prefill, decode = SilentNode(context), SilentNode(context)
    yield prefill, decode
    for node in (prefill, decode):
        node.sock.close(0)
    context.term()
