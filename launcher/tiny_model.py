"""A tiny random-initialised Hugging Face checkpoint (Llama or Qwen2), built offline.

The tokenizer is a byte-level BPE trained on a built-in English corpus, the
weights come from ``torch.manual_seed(seed)``; the same arguments give
byte-identical files. For tests and demos, never for quality.

    python -m launcher.tiny_model --arch llama|qwen2 --out DIR [--seed N]
        [--head-dim D] [--layers L] [--heads H] [--kv-heads K]

The hidden size is ``heads * head_dim`` (Qwen2 derives the head size from it), the
MLP twice that. The defaults (2 layers, 4 heads of 16, 2 KV heads) make a 64-wide
model; vLLM's CPU attention refuses a head size of 16, so a checkpoint for vLLM
takes ``--head-dim 64`` (its sizes: 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512).
"""

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, PretrainedConfig, Qwen2Config
from transformers.utils import logging as hf_logging

ARCHS = ("llama", "qwen2")
VOCAB_SIZE = 512
END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END]  # ids 0, 1, 2
BOS_ID = PAD_ID = 0  # <|endoftext|>
EOS_ID = 2  # <|im_end|>, where a chat turn ends
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Random weights put EOS at the top of the logits now and then, which cuts greedy
# outputs short (a few prompts in a hundred within 16 tokens). Its lm_head row is scaled
# to this fraction of the mean row norm, so EOS is rare but possible: with seed 0 no
# corpus prompt reaches it in 512 greedy tokens, with seeds 1-3 about one in a hundred.
EOS_ROW_SCALE = 0.75
# Qwen2's split (transformers' tokenization_qwen2.PRETOKENIZE_REGEX): contractions, letters, single
# digits, punctuation, new lines, spaces.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# The default shape: small enough for a unit test, and byte-identical to the checkpoints of
# earlier releases.
HEAD_DIM, LAYERS, HEADS, KV_HEADS = 16, 2, 4, 2
INIT_STD = 0.1  # above HF's 0.02, so outputs depend on the whole context, not just the last token
BIAS_STD = 0.1  # Qwen2's q/k/v biases start at zero; random ones make them matter

_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A prefill node reads the prompt and writes the key and value cache.",
    "The decode node receives the pages and generates one token at a time.",
    "Hello, world! How are you today?",
    "I am fine, thank you. And you?",
    "It was the best of times, it was the worst of times.",
    "Call me Ishmael. Some years ago, never mind how long precisely...",
    "To be, or not to be: that is the question.",
    "All happy families are alike; each unhappy family is unhappy in its own way.",
    "In the beginning there was nothing, and then there was a small light.",
    "She sells sea shells by the sea shore.",
    "Peter Piper picked a peck of pickled peppers.",
    "The rain in Spain stays mainly in the plain.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14 -7 1e6.",
    "Email me at someone@example.com or visit https://example.org/docs?page=2.",
    "def add(a, b):\n    return a + b",
    "for i in range(10):\n    print(i * i)",
    'x = {"key": [1, 2, 3], "other": None}',
    "SELECT name, age FROM users WHERE age > 21 ORDER BY name;",
    "What time is it? It is half past seven in the evening.",
    "Please summarise the following paragraph in one sentence.",
    "Sure! Here is a short answer to your question.",
    "The weather tomorrow will be cloudy with a chance of rain.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "The mitochondria is the powerhouse of the cell.",
    "Once upon a time, in a kingdom far away, lived a curious princess.",
    "Why did the chicken cross the road? To get to the other side.",
    "Attention is all you need, said the paper, and many people agreed.",
    "Grouped-query attention shares each key head among several query heads.",
    "Rotary position embeddings rotate queries and keys by their position.",
    "UPPER CASE, lower case, Title Case, and MiXeD cAsE all appear here.",
    "Tabs\tand  double  spaces, (parentheses), [brackets] and {braces}.",
]
_SUBJECTS = [
    "The cat",
    "A teacher",
    "My neighbour",
    "The old sailor",
    "Every student",
    "The robot",
    "Our team",
]
_VERBS = ["reads", "writes", "finds", "builds", "remembers", "carries", "watches"]
_OBJECTS = ["a long letter", "the red book", "three small boxes", "an answer", "the map", "a new song"]
_ENDINGS = [".", " today.", " again!", " before dinner.", " in the garden?", ", slowly and carefully."]


def corpus() -> list[str]:
    """A fixed English corpus: the sentences above, then a few hundred generated ones."""
    generated = [
        f"{s} {v} {o}{e}"
        for i, (s, v, o, e) in enumerate(itertools.product(_SUBJECTS, _VERBS, _OBJECTS, _ENDINGS))
        if i % 5 == 0
    ]
    return _SENTENCES * 4 + generated


def train_tokenizer() -> Tokenizer:
    """Byte-level BPE, special tokens first; training is deterministic for a fixed corpus.

    Normalizer and pre-tokenizer are Qwen2's, because ``AutoTokenizer`` rebuilds a qwen2
    checkpoint's tokenizer with them from the vocab and merges: both archs then tokenize alike.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    return tokenizer


def model_config(
    arch: str,
    vocab_size: int,
    *,
    head_dim: int = HEAD_DIM,
    layers: int = LAYERS,
    heads: int = HEADS,
    kv_heads: int = KV_HEADS,
) -> PretrainedConfig:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}, expected one of {ARCHS}")
    for name, value in [("head_dim", head_dim), ("layers", layers), ("heads", heads), ("kv_heads", kv_heads)]:
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (rotary embeddings), got {head_dim}")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    hidden_size = heads * head_dim
    shape: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        initializer_range=INIT_STD,
        dtype="float32",
    )
    if arch == "llama":
        return LlamaConfig(head_dim=head_dim, **shape)
    return Qwen2Config(**shape)  # head_dim is hidden_size / num_attention_heads


def write_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": END_OF_TEXT,
        "eos_token": IM_END,
        "pad_token": END_OF_TEXT,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_tiny_model(
    arch: str,
    out: Path,
    seed: int = 0,
    *,
    head_dim: int = HEAD_DIM,
    layers: int = LAYERS,
    heads: int = HEADS,
    kv_heads: int = KV_HEADS,
) -> Path:
    """Write the tokenizer and a random ``arch`` model drawn from ``seed`` into ``out``; return ``out``."""
    config = model_config(arch, VOCAB_SIZE, head_dim=head_dim, layers=layers, heads=heads, kv_heads=kv_heads)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    assert tokenizer.get_vocab_size() == VOCAB_SIZE
    assert [tokenizer.token_to_id(token) for token in SPECIAL_TOKENS] == [PAD_ID, 1, EOS_ID]
    with torch.random.fork_rng(devices=[]), torch.no_grad():  # the caller's RNG state is left alone
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, BIAS_STD)
        rows = model.get_output_embeddings().weight
        rows[EOS_ID] *= EOS_ROW_SCALE * rows.norm(dim=1).mean() / rows[EOS_ID].norm()
    model.generation_config = GenerationConfig(
        do_sample=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    model.save_pretrained(out)
    (out / "model.safetensors").chmod(0o644)  # saved 0600; another user (a container) reads it
    write_tokenizer(tokenizer, out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", choices=ARCHS, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--head-dim", type=int, default=HEAD_DIM, help=f"size of one attention head ({HEAD_DIM})"
    )
    parser.add_argument("--layers", type=int, default=LAYERS, help=f"decoder layers ({LAYERS})")
    parser.add_argument("--heads", type=int, default=HEADS, help=f"query heads ({HEADS})")
    parser.add_argument("--kv-heads", type=int, default=KV_HEADS, help=f"key/value heads ({KV_HEADS})")
    args = parser.parse_args()
    shape = dict(head_dim=args.head_dim, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads)
    try:
        model_config(args.arch, VOCAB_SIZE, **shape)  # a bad shape is a usage error, before any work
    except ValueError as exc:
        parser.error(str(exc))
    hf_logging.disable_progress_bar()
    print(write_tiny_model(args.arch, args.out, args.seed, **shape))


if __name__ == "__main__":
    main()
