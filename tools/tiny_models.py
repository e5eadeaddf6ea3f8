"""Tiny random-weight Hugging Face checkpoints for tests (Llama, Qwen2, Qwen3).

`make_tiny_model(dir, "qwen3")` writes a complete checkpoint directory that both
transformers and computed load: config.json, generation_config.json, model.safetensors,
tokenizer.json (a byte-level BPE trained on a fixed text) and tokenizer_config.json with
a chat template. Builds are deterministic and take about a second after transformers is
imported; `TinyModels` caches them per test session:

    @pytest.fixture(scope="session")
    def tiny_models(tmp_path_factory):
        return TinyModels(tmp_path_factory.mktemp("models"))

    path = tiny_models.get("llama", tie_word_embeddings=True)

transformers is imported lazily, inside the builders only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

ARCHS = ("llama", "qwen2", "qwen3")
TOKENIZER_VOCAB_SIZE = 400  # bytes (256) + special tokens + merges; below every model's vocab

# Llama-3.1-style scaling shrunk to the tiny context: some frequencies in each regime.
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

_BASE: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query attention
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rope_theta": 500000.0},
    "qwen2": {"rope_theta": 1000000.0},
    "qwen3": {"rope_theta": 1000000.0, "head_dim": 32},  # head_dim * heads != hidden, as in real Qwen3
}
_INIT_STD = 0.15  # well above HF's 0.02 so greedy argmaxes have margins, not near-ties
_EMBED_STD = 0.3  # tied heads reuse the embedding: this keeps logits within about +-10

_LLAMA_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
_QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_LLAMA_TEMPLATE = (
    "{% if messages[0]['role'] not in ['system', 'user'] %}"
    "{{ raise_exception('Conversation must start with a system or user message') }}{% endif %}"
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim "
    "+ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
_QWEN_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    (
        "Prefix caching stores the keys and values of a prompt in fixed-size blocks, "
        "so that a later request with the same beginning skips the work."
    ),
    "A block is committed once its tokens are written; then the directory can find it by its hash.",
    "Hello, world! How are you today? I am fine, thank you. 0123456789 + - * / = ( ) [ ] { }",
    "Café crème brûlée, naïve façade; Grüße aus München; ¿Qué tal? Ça va.",
    "中文文本用于测试多字节字符。日本語のテキスト。한국어 텍스트.",
    "Emoji: 🙂 🚀 🎉 — em dash … ellipsis « guillemets » ‘quotes’",
    "def forward(self, x):\n    return self.down(self.act(self.gate(x)) * self.up(x))\n",
]


def make_tiny_model(path: str | Path, arch: str, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random `arch` checkpoint into `path` (created); returns the path.

    `overrides` are transformers config kwargs, e.g. `tie_word_embeddings=True`,
    `rope_scaling=LLAMA3_ROPE_SCALING`, `num_hidden_layers=2`, `attention_bias=True`.
    Every parameter (biases and norm weights included) is random, so each one matters.
    """
    import torch
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    specials = _LLAMA_SPECIALS if arch == "llama" else _QWEN_SPECIALS
    backend = _train_tokenizer(specials, add_bos=arch == "llama")
    ids = {token: backend.token_to_id(token) for token in specials}
    if arch == "llama":
        bos, eos, stop_ids = ids["<|begin_of_text|>"], ids["<|end_of_text|>"], [ids["<|eot_id|>"]]
    else:
        bos, eos, stop_ids = ids["<|endoftext|>"], ids["<|im_end|>"], [ids["<|endoftext|>"]]
    kwargs = {**_BASE, **_ARCH_DEFAULTS[arch], "bos_token_id": bos, "eos_token_id": eos, **overrides}
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    config = config_class(**kwargs)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif "embed" in name:
                param.normal_(0.0, _EMBED_STD)
            else:
                param.normal_(0.0, _INIT_STD)
    model.generation_config = transformers.GenerationConfig(bos_token_id=bos, eos_token_id=[eos, *stop_ids])
    model.save_pretrained(path)
    backend.save(str(path / "tokenizer.json"))
    _write_tokenizer_config(path, arch, config.max_position_embeddings)
    return path


class TinyModels:
    """Builds each distinct (arch, seed, overrides) checkpoint once under `root`.

    Safe across processes (pytest-xdist workers): a checkpoint is built in a temporary
    directory and renamed into place, so a directory that exists is complete.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def get(self, arch: str, seed: int = 0, **overrides: Any) -> Path:
        key = json.dumps([arch, seed, overrides], sort_keys=True)
        name = f"{arch}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
        target = self.root / name
        if not target.is_dir():
            scratch = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=self.root))
            make_tiny_model(scratch, arch, seed, **overrides)
            try:
                os.rename(scratch, target)
            except OSError:  # another process won the race; its copy is identical
                shutil.rmtree(scratch, ignore_errors=True)
        return target


def _train_tokenizer(specials: list[str], add_bos: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    if add_bos:  # Llama 3: the post-processor prepends BOS
        bos = specials[0]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
        )
    else:  # Qwen: no BOS
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _write_tokenizer_config(path: Path, arch: str, max_length: int) -> None:
    if arch == "llama":
        special = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
        template = _LLAMA_TEMPLATE
    else:
        special = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
        template = _QWEN_TEMPLATE
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": template,
        **special,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
