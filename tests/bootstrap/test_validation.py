"""The request rules (``bootstrap.validation``) against the wire's limits."""

import msgspec
import pytest

from bootstrap.validation import MAX_STOP_CHARS, MAX_STOP_STRINGS
from shared import protocol


def test_the_wire_takes_whatever_the_api_accepts():
    """The API's stop limits are the wire's: a room's assignment never fails to decode for them."""
    assert MAX_STOP_STRINGS <= protocol.MAX_STOP
    room = protocol.DecodeRoom(
        room=1,
        prompt_len=1,
        max_new_tokens=1,
        prefill_node="p",
        prefill_ranks=[protocol.PeerRank(0, "127.0.0.1:1", "tcp://127.0.0.1:2", "", 0, 1)],
        stop=["\U0001f600" * MAX_STOP_CHARS] * MAX_STOP_STRINGS,
    )
    assert protocol.decode(protocol.encode(room)) == (room, None)
    for stop in ([""], ["x" * (MAX_STOP_CHARS + 1)], ["x"] * (protocol.MAX_STOP + 1)):
        with pytest.raises(protocol.MalformedFrame):
            protocol.decode(protocol.encode(msgspec.structs.replace(room, stop=stop)))
