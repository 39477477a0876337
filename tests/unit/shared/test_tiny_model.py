import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from launcher import tiny_model
from launcher.tiny_model import ARCHS, write_tiny_model

REPO = Path(__file__).resolve().parents[3]
FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]
PROMPTS = ["The cat sat on the mat.", "A dog sat on the mat."]  # the same last tokens


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {arch: write_tiny_model(arch, tmp_path_factory.mktemp(arch)) for arch in ARCHS}


@pytest.fixture(scope="module")
def loaded(checkpoints):
    return {
        arch: (AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path))
        for arch, path in checkpoints.items()
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_loads_with_the_auto_classes(checkpoints, loaded, arch):
    assert sorted(p.name for p in checkpoints[arch].iterdir()) == FILES
    tokenizer, model = loaded[arch]
    config = model.config
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (2, 4, 2)
    assert (config.hidden_size, config.intermediate_size, config.max_position_embeddings) == (64, 128, 4096)
    assert config.hidden_size // config.num_attention_heads == 16
    assert config.vocab_size == len(tokenizer) == 512
    assert not config.tie_word_embeddings
    assert model.dtype == torch.float32
    generation = model.generation_config
    assert generation.do_sample is False
    assert generation.eos_token_id == config.eos_token_id == tokenizer.eos_token_id
    assert generation.pad_token_id == tokenizer.pad_token_id is not None
    assert tokenizer.bos_token_id is not None


def test_qwen2_attention_biases_are_random(checkpoints):
    weights = load_file(checkpoints["qwen2"] / "model.safetensors")
    biases = [name for name in weights if name.endswith(".bias")]
    assert len(biases) == 6  # q, k and v in each of 2 layers
    assert all(weights[name].std() > 0.05 for name in biases)


def test_same_seed_same_bytes_other_seed_other_weights(checkpoints, tmp_path):
    again = write_tiny_model("llama", tmp_path / "again")
    other = write_tiny_model("llama", tmp_path / "other", seed=1)
    for name in FILES:
        assert (again / name).read_bytes() == (checkpoints["llama"] / name).read_bytes(), name
    assert (other / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_round_trips_and_knows_its_special_tokens(loaded, arch):
    tokenizer, _ = loaded[arch]
    for text in [
        "Hello, world! The quick brown fox.",
        "  leading spaces,\ttabs\nand new lines\n\n",
        "def f(x):\n    return {'a': [1, 2, 3]} # 2024-06-01 ~`^|\\",
    ]:
        ids = tokenizer.encode(text)
        assert len(ids) < len(text)
        assert tokenizer.decode(ids) == text
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert [tokenizer.encode(token) for token in specials] == [[0], [1], [2]]
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 2)


def test_both_archs_tokenize_alike(loaded):
    # AutoTokenizer rebuilds a qwen2 tokenizer from its vocab and merges; a llama one is read as is.
    text = "It's 2024: naïve café, x+=1;\n\n  done!"
    assert loaded["llama"][0].encode(text) == loaded["qwen2"][0].encode(text)


@pytest.mark.parametrize("arch", ARCHS)
def test_chat_template_renders_chatml(loaded, arch):
    tokenizer, _ = loaded[arch]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    closed = tokenizer.apply_chat_template(messages[1:], tokenize=False)
    assert closed == "<|im_start|>user\nhi<|im_end|>\n"


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_runs_long_and_depends_on_the_prompt(loaded, arch):
    tokenizer, model = loaded[arch]
    outputs = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        new = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1] :].tolist()
        assert len(new) == 16 and tokenizer.eos_token_id not in new
        outputs.append(new)
    assert outputs[0] != outputs[1]


def test_eos_is_rare_but_reachable(tmp_path):
    path = write_tiny_model("qwen2", tmp_path, seed=1)
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    ids = tokenizer("A teacher remembers a long letter in the garden?", return_tensors="pt").input_ids
    new = model.generate(ids, max_new_tokens=64, do_sample=False)[0, ids.shape[1] :].tolist()
    assert new.index(tokenizer.eos_token_id) == len(new) - 1 == 41


def test_command_line_writes_the_same_checkpoint(checkpoints, tmp_path):
    out = tmp_path / "cli"
    result = subprocess.run(
        [sys.executable, "-m", "launcher.tiny_model", "--arch", "qwen2", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert result.stdout.strip() == str(out)
    # Another process (other hash seeds) trains the same tokenizer and draws the same weights.
    for name in ["model.safetensors", "tokenizer.json"]:
        assert (out / name).read_bytes() == (checkpoints["qwen2"] / name).read_bytes(), name
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]


@pytest.mark.parametrize("arch", ARCHS)
def test_the_shape_options_make_a_wider_model(tmp_path, arch):
    # vLLM's CPU attention refuses a head size of 16 (the default); 64 is one it takes.
    path = write_tiny_model(arch, tmp_path, head_dim=64, layers=3, heads=4, kv_heads=1)
    config = json.loads((path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (
        3,
        4,
        1,
    )
    assert (config["hidden_size"], config["intermediate_size"]) == (256, 512)
    assert config.get("head_dim", config["hidden_size"] // config["num_attention_heads"]) == 64
    weights = load_file(path / "model.safetensors")
    assert weights["model.layers.2.self_attn.k_proj.weight"].shape == (64, 256)  # one KV head of 64
    assert weights["model.layers.2.self_attn.q_proj.weight"].shape == (256, 256)
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    ids = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    assert len(model.generate(ids, max_new_tokens=4, do_sample=False)[0]) == ids.shape[1] + 4


def test_the_default_shape_is_the_one_before_the_options(checkpoints, tmp_path):
    path = write_tiny_model("llama", tmp_path, head_dim=16, layers=2, heads=4, kv_heads=2)
    assert (path / "model.safetensors").read_bytes() == (
        checkpoints["llama"] / "model.safetensors"
    ).read_bytes()
    assert json.loads((path / "config.json").read_text())["head_dim"] == 16


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        (dict(heads=4, kv_heads=3), "multiple of kv_heads"),
        (dict(head_dim=15), "head_dim must be even"),
        (dict(layers=0), "layers must be at least 1"),
        (dict(kv_heads=0), "kv_heads must be at least 1"),
    ],
)
def test_a_bad_shape_is_refused_before_any_file_is_written(tmp_path, shape, message):
    with pytest.raises(ValueError, match=message):
        write_tiny_model("qwen2", tmp_path / "out", **shape)
    assert not (tmp_path / "out").exists()


def test_the_command_line_takes_the_shape_and_refuses_a_bad_one(tmp_path, monkeypatch, capsys):
    out = tmp_path / "cli"
    argv = ["tiny_model", "--arch", "llama", "--out", str(out), "--head-dim", "64", "--layers", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--heads", "2", "--kv-heads", "2"])
    tiny_model.main()
    assert capsys.readouterr().out.strip() == str(out)
    config = json.loads((out / "config.json").read_text())
    assert (config["head_dim"], config["num_hidden_layers"], config["num_attention_heads"]) == (64, 1, 2)
    monkeypatch.setattr(sys, "argv", [*argv, "--heads", "3", "--kv-heads", "2"])
    with pytest.raises(SystemExit) as exit_info:
        tiny_model.main()
    assert exit_info.value.code == 2
    assert "heads (3) must be a multiple of kv_heads (2)" in capsys.readouterr().err
