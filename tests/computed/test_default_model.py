"""The committed default model folder loads with transformers and behaves like a tiny Python LM.

These tests read the artifacts that `computed` serves without `--model`; they do not
retrain (tools/train_default_model.py regenerates the folder).
"""

import keyword
import math
import re
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import computed
from tools.train_default_model import HELD_OUT_FILES, SPECIAL_TOKENS, TrainConfig, stdlib_files

MODEL_DIR = Path(computed.__file__).parent / "default_model"
ARTIFACTS = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "README.md",
)
CODE_LINE = re.compile(r"^\s*(import|from|def|class|return|if|for|while|with|try|raise|@)\b|\w\(|\w = ")
SNIPPET = '''import os


class Greeter:
    """Says hello — to anyone (ünïcödé too)."""

    def greet(self, name: str) -> str:
\tif not name:
            raise ValueError("empty name")
        return f"Hello, {name}!\\n"  # trailing spaces   
'''


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()


def test_folder_holds_every_artifact_within_10_mb():
    sizes = {name: (MODEL_DIR / name).stat().st_size for name in ARTIFACTS}
    total = sum(p.stat().st_size for p in MODEL_DIR.iterdir() if p.is_file())
    assert total <= 10 * 1024 * 1024, f"default model folder is {total} bytes"
    assert sizes["model.safetensors"] <= 8_500_000, sizes


def test_config_is_a_small_gqa_llama_with_bf16_weights():
    config = AutoConfig.from_pretrained(MODEL_DIR)
    assert config.model_type == "llama"
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.num_key_value_heads < config.num_attention_heads, "expected grouped-query attention"
    assert config.max_position_embeddings >= 8192
    assert config.tie_word_embeddings
    assert config.vocab_size == TrainConfig().vocab_size
    with safe_open(str(MODEL_DIR / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        assert {f.get_slice(k).get_dtype() for k in keys} == {"BF16"}
    assert "lm_head.weight" not in keys, "embeddings are tied, the head is not stored"


def test_tokenizer_round_trips_python_source(tokenizer):
    ids = tokenizer.encode(SNIPPET, add_special_tokens=False)
    assert tokenizer.decode(ids) == SNIPPET
    assert len(ids) < len(SNIPPET.encode()) / 2, "BPE should compress source at least 2x"


def test_special_tokens_are_single_ids(tokenizer):
    assert tokenizer.bos_token == "<|bos|>" and tokenizer.eos_token == "<|eos|>"
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.convert_tokens_to_ids(token) == i
        assert tokenizer.encode(token, add_special_tokens=False) == [i]
    assert tokenizer.encode("x = 1", add_special_tokens=True) == tokenizer.encode(
        "x = 1", add_special_tokens=False
    )


def test_chat_template_renders_roles_and_generation_prompt(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort a list."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|><|system|>\nBe brief.<|end|>\n<|user|>\nSort a list.<|end|>\n<|assistant|>\n"
    without = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert text.startswith(without) and not without.endswith("<|assistant|>\n")


def test_greedy_generation_from_import_looks_like_python(model, tokenizer):
    ids = tokenizer("import ", return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=48, do_sample=False)
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    words = re.findall(r"[A-Za-z_][A-Za-z_0-9]*", text)
    common = set(keyword.kwlist) | {"self", "os", "sys", "re", "name", "None", "True", "False"}
    assert len(words) >= 3, f"expected identifiers, got {text!r}"
    assert common.intersection(words), f"no common Python token in {text!r}"
    # Prose (a docstring's words) has keywords too; code has statements, calls or assignments.
    lines = [line for line in ("import " + text).splitlines() if line.strip()]
    assert sum(bool(CODE_LINE.search(line)) for line in lines) >= 2, f"not code-like: {text!r}"


def test_held_out_stdlib_file_loss_is_well_below_uniform(model, tokenizer):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = (stdlib / HELD_OUT_FILES[0]).read_text(encoding="utf-8")
    ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False))
    seq_len, num_windows = 256, 8
    windows = torch.stack([ids[i * seq_len : (i + 1) * seq_len] for i in range(num_windows)])  # (N, T)
    with torch.no_grad():
        loss = model(input_ids=windows, labels=windows).loss.item()
    uniform = math.log(model.config.vocab_size)
    assert loss < 0.6 * uniform, f"held-out loss {loss:.3f} vs uniform {uniform:.3f}"


def test_held_out_files_are_not_in_the_training_corpus():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train, held_out = stdlib_files(stdlib, TrainConfig())
    assert sorted(p.relative_to(stdlib).as_posix() for p in held_out) == sorted(HELD_OUT_FILES)
    assert not {p.relative_to(stdlib).as_posix() for p in train} & set(HELD_OUT_FILES)
    assert train == sorted(train), "the corpus order must be deterministic"
