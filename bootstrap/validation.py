"""What a client's request must be before a room is placed for it: one set of rules for /rooms and /v1.

Every limit a room's assignment holds on the wire (``shared.wire.protocol``) is
checked here first. A request the bootstrap accepted but a node could not
decode would be dropped on the way, and its room would fail as if a node were
lost; a request refused here is the client's to fix, and no node hears of it.
``Refused`` is answered 422 on /rooms and 400, in OpenAI's shape, under /v1.
"""

from typing import Annotated, Any

from pydantic import AfterValidator, Field, StringConstraints

from shared.wire import protocol

# OpenAI's own limit on stop strings; the wire holds up to protocol.MAX_STOP.
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = protocol.MAX_STOP_CHARS


class Refused(ValueError):
    """A request that cannot be served as it is, with the parameter at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


def _encodable(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode: {exc.reason} at position {exc.start}") from exc
    return text


Text = Annotated[str, AfterValidator(_encodable)]
PromptText = Annotated[str, StringConstraints(min_length=1), AfterValidator(_encodable)]
StopString = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS), AfterValidator(_encodable)
]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None


def encode(tokenizer: Any, text: str, param: str) -> list[int]:
    """The text's tokens; Refused if the tokenizer cannot take it."""
    try:
        return list(tokenizer.encode(text))
    except (ValueError, TypeError) as exc:  # TokenizerError is a ValueError
        raise Refused(f"{param}: the tokenizer cannot encode it: {exc}", param) from exc


def check_room(
    tokenizer: Any, settings: Any, tokens: list[int], max_new_tokens: int, param: str, max_param: str
) -> None:
    """A room's prompt and length as a node can take them; Refused naming the parameter otherwise."""
    if not tokens:
        raise Refused(f"{param}: the prompt has no tokens", param)
    if len(tokens) > settings.max_prompt_tokens:
        raise Refused(
            f"{param}: a prompt of {len(tokens)} tokens exceeds the cap of {settings.max_prompt_tokens}",
            param,
        )
    vocab = tokenizer.vocab_size
    if any(t >= vocab for t in tokens):
        raise Refused(f"{param}: token ids must be below the vocabulary size {vocab}", param)
    if max_new_tokens > settings.max_new_tokens:
        raise Refused(f"{max_param}: above the cap of {settings.max_new_tokens}", max_param)
    context = tokenizer.max_positions
    if context is not None and len(tokens) + max_new_tokens > context:
        raise Refused(
            f"{max_param}: the model's context is {context} tokens; the prompt's {len(tokens)} "
            f"and {max_new_tokens} new ones exceed it",
            max_param,
        )
