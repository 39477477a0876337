"""A rank is one struct: the registration's JSON is checked by the wire's own rules, and what the
bootstrap parsed is what it names in assignments."""

import msgspec
import pydantic
import pytest

from shared.wire import protocol
from shared.wire.registration import NodeRegistration

RANK = {
    "rank": 0,
    "session_id": "127.0.0.1:4000",
    "zmq_endpoint": "tcp://127.0.0.1:5000",
    "public_key": "",
    "kv_head_start": 0,
    "kv_head_count": 2,
}
MODEL = {
    "name": "m",
    "architecture": "a",
    "weights": "w",
    "tokenizer": "t",
    "dtype": "float32",
    "num_layers": 2,
    "num_heads": 2,
    "num_kv_heads": 2,
    "head_dim": 8,
    "vocab_size": 100,
    "page_size": 16,
}


def registration(**rank: object) -> dict[str, object]:
    return {
        "node_id": "p0",
        "role": "prefill",
        "http_url": "http://127.0.0.1:1",
        "version": "1",
        "ranks": [RANK | rank],
        "model": MODEL,
        "num_pages": 8,
    }


def test_a_registered_rank_is_the_wire_struct_and_goes_out_unchanged() -> None:
    reg = NodeRegistration.model_validate(registration())
    peer = reg.ranks[0]
    assert isinstance(peer, protocol.PeerRank) and peer.heads.count == 2
    assigned = protocol.PrefillRoom(transfer=1, input_ids=[1], decode_node="d", decode_ranks=[peer])
    assert protocol.decode(protocol.encode(assigned))[0] == assigned
    assert NodeRegistration.model_validate_json(reg.model_dump_json()) == reg


def test_the_public_key_may_be_left_out_where_security_is_off() -> None:
    rank = dict(RANK)
    del rank["public_key"]
    body = registration() | {"ranks": [rank]}
    assert NodeRegistration.model_validate(body).ranks[0].public_key == ""


@pytest.mark.parametrize(
    "bad",
    [
        {"session_id": "no-port"},
        {"zmq_endpoint": "ipc:///tmp/x"},
        {"rank": protocol.MAX_RANKS},
        {"kv_head_count": 0},
        {"surprise": 1},
    ],
    ids=["session id", "zmq endpoint", "rank", "head count", "unknown field"],
)
def test_a_rank_breaking_the_wire_rules_is_refused_at_registration(bad: dict[str, object]) -> None:
    with pytest.raises(pydantic.ValidationError):
        NodeRegistration.model_validate(registration(**bad))
    with pytest.raises(msgspec.ValidationError):  # the same rule on the wire
        msgspec.convert(RANK | bad, protocol.PeerRank)


def test_the_schema_documents_a_rank_with_its_wire_rules() -> None:
    schema = NodeRegistration.model_json_schema()["properties"]["ranks"]["items"]
    assert schema["properties"]["zmq_endpoint"]["pattern"].startswith("^tcp://")
    assert "public_key" not in schema["required"] and schema["additionalProperties"] is False
