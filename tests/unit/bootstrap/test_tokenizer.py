"""The bootstrap tokenizes with the tokenizer alone, exactly as transformers does, and never loads torch."""

import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from bootstrap.tokenizer import ByteTokenizer, TokenizerError, load_tokenizer
from launcher.tiny_model import write_tiny_model

TEXTS = ["a", "Hello, kvroom!", "The quick brown fox jumps over the lazy dog.", "ünïcödé ✓ and\ttabs\n"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {arch: write_tiny_model(arch, root / f"tiny-{arch}") for arch in ("llama", "qwen2")}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tokens_text_and_chat_equal_transformers(checkpoints, arch):
    ours, theirs = load_tokenizer(str(checkpoints[arch])), AutoTokenizer.from_pretrained(checkpoints[arch])
    assert ours.name == f"tiny-{arch}" and ours.vocab_size == theirs.vocab_size
    for text in TEXTS:
        ids = theirs(text)["input_ids"]
        assert ours.encode(text) == ids
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    want = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert ours.chat(messages) == (want["input_ids"] if hasattr(want, "keys") else want)


def test_bytes_for_the_reference_model():
    tok = ByteTokenizer()
    assert tok.encode("hé") == [104, 195, 169] and tok.decode([104, 195, 169]) == "hé"
    assert not tok.has_chat_template
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.chat([{"role": "user", "content": "x"}])


def test_a_directory_without_a_tokenizer_is_refused(tmp_path):
    with pytest.raises(ValueError):
        load_tokenizer(str(tmp_path))


def test_the_bootstrap_never_imports_torch(checkpoints):
    model = str(checkpoints["qwen2"])
    code = (
        "import sys; from bootstrap.settings import BootstrapSettings\n"
        "from bootstrap.cluster import Cluster; from bootstrap.app import create_app\n"
        "from launcher.local_stack import free_port\n"
        f"s = BootstrapSettings(http_port=free_port(), zmq_port=free_port(), model={model!r})\n"
        "c = Cluster(s); c.tokenizer.encode('hi'); create_app(s)\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch loaded'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    help_out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "bootstrap", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert help_out.returncode == 0 and "usage:" in help_out.stdout
    assert " torch\n" not in help_out.stderr and "| torch" not in help_out.stderr
