"""Text to tokens and back on the bootstrap, with the tokenizer alone: no torch, no weights.

``reference`` (and ``synthetic``) speak bytes. A Hugging Face model directory
is read with the ``tokenizers`` library (its ``tokenizer.json``) and its chat
template rendered with Jinja, as transformers renders it; the nodes load the
same files, and registration checks both sides hash them alike.
"""

import json
from pathlib import Path
from typing import Any, Protocol

from shared.models.files import model_dir, model_name, tokenizer_digest


class TokenizerError(ValueError):
    """Text or messages this tokenizer cannot turn into a prompt."""


class Tokenizer(Protocol):
    name: str
    digest: str
    vocab_size: int
    max_positions: int | None  # the model's context: prompt and new tokens together
    has_chat_template: bool

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def chat(self, messages: list[dict[str, Any]]) -> list[int]: ...


class ByteTokenizer:
    """The reference model's tokens: UTF-8 bytes."""

    digest = "bytes"
    vocab_size = 256
    # The reference model's context (shared.models.reference.ModelConfig); synthetic KV has none.
    REFERENCE_POSITIONS = 8192
    has_chat_template = False

    def __init__(self, name: str = "reference"):
        self.name = name
        self.max_positions: int | None = self.REFERENCE_POSITIONS if name == "reference" else None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def chat(self, messages: list[dict[str, Any]]) -> list[int]:
        raise TokenizerError(f"model {self.name} has no chat template")


class HFTokenizer:
    """A Hugging Face checkpoint's fast tokenizer and chat template."""

    def __init__(self, model: str):
        from tokenizers import Tokenizer as Backend

        path = model_dir(model)
        self.name = model_name(model)
        self.digest = tokenizer_digest(path)
        self._backend = Backend.from_file(str(path / "tokenizer.json"))
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        model_config = _config(path)
        self.vocab_size = int(model_config.get("vocab_size", self._backend.get_vocab_size()))
        self.max_positions = model_config.get("max_position_embeddings")
        self._specials = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}
        template = config.get("chat_template")
        self.has_chat_template = isinstance(template, str)
        self._template = _compile(template) if isinstance(template, str) else None

    def encode(self, text: str) -> list[int]:
        return list(self._backend.encode(text, add_special_tokens=True).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._backend.decode(ids, skip_special_tokens=True))

    def chat(self, messages: list[dict[str, Any]]) -> list[int]:
        if self._template is None:
            raise TokenizerError(f"model {self.name} has no chat template")
        try:
            text = self._template.render(messages=messages, add_generation_prompt=True, **self._specials)
        except Exception as exc:  # the template's own raise_exception, or a message it cannot render
            raise TokenizerError(f"the chat template refused the messages: {exc}") from exc
        return list(self._backend.encode(text, add_special_tokens=False).ids)


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # an AddedToken written out
        return str(value.get("content", ""))
    return str(value or "")


def _config(path: Path) -> dict[str, Any]:
    config = path / "config.json"
    return dict(json.loads(config.read_text())) if config.exists() else {}


def _compile(template: str) -> Any:
    """The template as transformers compiles it: sandboxed, trimmed blocks, raise_exception."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TokenizerError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def load_tokenizer(model: str) -> Tokenizer:
    """The tokenizer of ``model``: a directory, or a hub id already in the local Hugging Face cache."""
    if model in ("reference", "synthetic"):
        return ByteTokenizer(model)
    return HFTokenizer(model)
