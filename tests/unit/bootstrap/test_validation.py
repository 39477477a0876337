"""The request rules (``bootstrap.validation``) against the wire's limits."""

import msgspec
import pytest

from bootstrap.validation import MAX_STOP_CHARS, MAX_STOP_STRINGS
from shared.wire import protocol


def test_the_wire_takes_whatever_the_api_accepts():
    """The API's stop limits are the wire's: a room's assignment never fails to decode for them."""
    assert MAX_STOP_STRINGS <= protocol.MAX_STOP
    room = protocol.DecodeRoom(
        transfer=1,
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


def test_the_bootstraps_context_of_the_reference_model_is_the_models():
    from bootstrap.tokenizer import ByteTokenizer
    from shared.models.reference import ModelConfig

    assert ByteTokenizer("reference").max_positions == ModelConfig().max_positions
    assert ByteTokenizer("synthetic").max_positions is None


def test_a_prompt_and_new_tokens_past_the_models_context_are_refused():
    from types import SimpleNamespace

    from bootstrap.validation import Refused, check_room

    tokenizer = SimpleNamespace(vocab_size=256, max_positions=100)
    settings = SimpleNamespace(max_prompt_tokens=1000, max_new_tokens=1000)
    check_room(tokenizer, settings, [1] * 60, 40, "prompt", "max_tokens")
    with pytest.raises(Refused) as refused:
        check_room(tokenizer, settings, [1] * 60, 41, "prompt", "max_tokens")
    assert refused.value.param == "max_tokens" and "context is 100 tokens" in refused.value.message
    for tokens, new, param in (([], 1, "prompt"), ([256], 1, "prompt"), ([1] * 1001, 1, "prompt")):
        with pytest.raises(Refused) as refused:
            check_room(
                SimpleNamespace(vocab_size=256, max_positions=None), settings, tokens, new, "prompt", "m"
            )
        assert refused.value.param == param
