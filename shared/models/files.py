"""A Hugging Face checkpoint's files: where they are, and digests of what two nodes must share.

Imports neither torch nor transformers: the bootstrap, which must not load
either, reads the tokenizer's digest here.
"""

import hashlib
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
_MIB = 1 << 20
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Generation-config settings under which greedy generate() is not plain argmax: these at any value
# but their neutral one, and the others at any value but None.
_GREEDY_NEUTRAL = {"repetition_penalty": 1.0, "guidance_scale": 1.0, "num_beams": 1}
_GREEDY_NEUTRAL |= dict.fromkeys(("no_repeat_ngram_size", "min_length", "min_new_tokens"), 0)
_GREEDY_CHANGERS = (
    *_GREEDY_NEUTRAL,
    *("bad_words_ids", "sequence_bias", "forced_bos_token_id", "forced_eos_token_id", "suppress_tokens"),
    *("begin_suppress_tokens", "exponential_decay_length_penalty", "stop_strings", "watermarking_config"),
    "prefill_chunk_size",
)


def model_dir(model: str | Path) -> Path:
    """The local directory of ``model``: a directory itself, or a hub id already in the HF cache."""
    path = Path(model)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(str(model), local_files_only=True))
    except (LocalEntryNotFoundError, ValueError) as exc:
        raise ValueError(f"model {model!r} is not a directory nor in the local Hugging Face cache") from exc


def model_name(model: str) -> str:
    """What /v1/models lists: a directory's own name (as given, not resolved), or the hub id."""
    path = Path(model)
    return (path.name or path.resolve().name) if path.is_dir() else model


def _file_ends(digest: Any, path: Path, start: int) -> None:
    """Feed the first and last MiB after ``start`` of ``path`` into ``digest``."""
    size = path.stat().st_size
    with path.open("rb") as f:
        f.seek(start)
        digest.update(f.read(_MIB))
        f.seek(max(start, size - _MIB))
        digest.update(f.read(_MIB))


def weights_digest(model: str | Path) -> str:
    """16 hex chars over config.json and each safetensors file's name, size, header and end MiBs.

    Different seeds of one shape differ; a 10 GB checkpoint is hashed in milliseconds."""
    path = model_dir(model)
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for file in sorted(path.glob("*.safetensors")):
        digest.update(f"\0{file.name}\0{file.stat().st_size}\0".encode())
        with file.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            digest.update(f.read(header_len))
        _file_ends(digest, file, 8 + header_len)
    return digest.hexdigest()[:16]


def tokenizer_digest(model: str | Path) -> str:
    """16 hex chars over tokenizer.json, and tokenizer_config.json where there is one."""
    path = model_dir(model)
    if not (path / _TOKENIZER_FILES[0]).is_file():
        raise ValueError(f"{path} has no {_TOKENIZER_FILES[0]}")
    digest = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        if (path / name).is_file():
            digest.update(f"\0{name}\0".encode())
            digest.update((path / name).read_bytes())
    return digest.hexdigest()[:16]


def greedy_differences(generation_config: Any) -> list[str]:
    """The generation-config settings under which ``generate(do_sample=False)`` is not plain argmax."""
    out = []
    for name in _GREEDY_CHANGERS:
        value = getattr(generation_config, name, None)
        if value not in (None, [], _GREEDY_NEUTRAL.get(name)):
            out.append(f"{name}={value!r}")
    return out
