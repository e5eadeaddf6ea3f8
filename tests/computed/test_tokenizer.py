"""Our tokenizer against transformers' AutoTokenizer on the same checkpoint directory."""

from __future__ import annotations

import json
import random
import shutil
from functools import cache
from pathlib import Path

import pytest

from computed.model import ChatTemplateError, Tokenizer
from tests.models import TinyModels, make_tiny_model

TEXTS = [
    "Hello, world!",
    "",
    "   leading and trailing spaces   ",
    "line one\nline two\n\n\ttabbed",
    "Café crème brûlée — naïve façade",
    "中文文本用于测试多字节字符。",
    "Emoji 🙂🚀 and a family 👨‍👩‍👧 in one line",
    "special tokens in text: <|im_end|> <|eot_id|> <|begin_of_text|>",
    "Prefix caching stores the keys and values of a prompt in fixed-size blocks.",
]
CHATS = [
    [{"role": "user", "content": "Hi there  "}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "¿Qué tal? 中文"},
        {"role": "assistant", "content": "Bien 🙂"},
        {"role": "user", "content": "Bye"},
    ],
]


@pytest.fixture(params=["llama", "qwen3"])
def checkpoint(request: pytest.FixtureRequest, tiny_models: TinyModels) -> Path:
    return tiny_models.get(request.param)


@cache
def reference(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(checkpoint: Path, add_special_tokens: bool) -> None:
    ours, hf = Tokenizer(checkpoint), reference(checkpoint)
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens) == hf.encode(
            text, add_special_tokens=add_special_tokens
        ), text


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_many_matches_transformers_one_text_at_a_time(
    checkpoint: Path, add_special_tokens: bool
) -> None:
    """The batched path (`encode_batch_fast`, no offsets) gives each text the ids
    transformers gives it alone, long random texts included."""
    ours, hf = Tokenizer(checkpoint), reference(checkpoint)
    rng = random.Random(7)
    texts = TEXTS + [
        ours.decode([rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 1200))], False)
        for _ in range(24)
    ]
    expected = [hf.encode(text, add_special_tokens=add_special_tokens) for text in texts]
    assert ours.encode_many(texts, add_special_tokens) == expected


def test_llama_style_adds_bos_and_qwen_style_does_not(tiny_models: TinyModels) -> None:
    llama, qwen = Tokenizer(tiny_models.get("llama")), Tokenizer(tiny_models.get("qwen3"))
    assert llama.encode("hi")[0] == llama.bos_token_id == 0 and llama.encode("hi", False)[0] != 0
    assert qwen.bos_token_id is None and qwen.encode("hi") == qwen.encode("hi", False)


@pytest.mark.parametrize("flags", [{"add_bos_token": False}, {"add_bos_token": True, "add_eos_token": True}])
def test_bos_comes_from_tokenizer_json_as_in_transformers(
    tiny_models: TinyModels, tmp_path: Path, flags: dict
) -> None:
    """transformers 5 ignores tokenizer_config's add_bos/eos flags for tokenizer.json checkpoints."""
    path = _copy(tiny_models.get("llama"), tmp_path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, **flags}))
    ours, hf = Tokenizer(path), reference(path)
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text), text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(checkpoint: Path, skip_special_tokens: bool) -> None:
    ours, hf = Tokenizer(checkpoint), reference(checkpoint)
    rng = random.Random(0)
    sequences = [ours.encode(text) for text in TEXTS]
    sequences += [
        [rng.randrange(ours.vocab_size) for _ in range(n)] for n in (1, 5, 40)
    ]  # bytes may not be UTF-8
    for ids in sequences:
        assert ours.decode(ids, skip_special_tokens) == hf.decode(
            ids, skip_special_tokens=skip_special_tokens
        )
    for text in (t for t in TEXTS if "<|" not in t):  # special tokens are skipped: no round trip
        assert ours.decode(ours.encode(text)) == text


def test_eos_token_ids(tiny_models: TinyModels) -> None:
    llama, qwen = Tokenizer(tiny_models.get("llama")), Tokenizer(tiny_models.get("qwen3"))
    assert [llama.decode([i], False) for i in llama.eos_token_ids] == ["<|eot_id|>", "<|end_of_text|>"]
    assert [qwen.decode([i], False) for i in qwen.eos_token_ids] == ["<|im_end|>", "<|endoftext|>"]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(checkpoint: Path, add_generation_prompt: bool) -> None:
    ours, hf = Tokenizer(checkpoint), reference(checkpoint)
    assert ours.has_chat_template
    for chat in CHATS:
        text = ours.apply_chat_template(chat, add_generation_prompt)
        assert text == hf.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        expected_ids = hf.apply_chat_template(
            chat, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
        )
        assert ours.encode_chat(chat, add_generation_prompt) == list(expected_ids)


def test_chat_template_exceptions_become_chat_template_errors(tiny_models: TinyModels) -> None:
    ours = Tokenizer(tiny_models.get("llama"))
    with pytest.raises(ChatTemplateError, match="must start with a system or user"):
        ours.apply_chat_template([{"role": "assistant", "content": "hi"}])
    with pytest.raises(ChatTemplateError, match="at least one message"):
        ours.apply_chat_template([])


def test_saved_by_transformers_reads_chat_template_jinja(checkpoint: Path, tmp_path: Path) -> None:
    """transformers 5 writes the template to chat_template.jinja; both layouts must work."""
    reference(checkpoint).save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").is_file()
    ours, original = Tokenizer(tmp_path), Tokenizer(checkpoint)
    for chat in CHATS:
        assert ours.apply_chat_template(chat) == original.apply_chat_template(chat)
    assert ours.encode(TEXTS[4]) == original.encode(TEXTS[4])


def test_no_chat_template(tiny_models: TinyModels, tmp_path: Path) -> None:
    path = _copy(tiny_models.get("qwen3"), tmp_path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer(path)
    assert not ours.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ours.apply_chat_template(CHATS[0])


@pytest.mark.parametrize("text", TEXTS[4:7] + ["a" + "é" * 5 + "中" * 3 + "🙂" * 3])
def test_incremental_decoder_never_splits_a_character(checkpoint: Path, text: str) -> None:
    ours = Tokenizer(checkpoint)
    ids = ours.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.encode()) // 3, "the tiny vocab should split multi-byte characters"
    decoder = ours.incremental_decoder()
    pieces = [decoder.push(i) for i in ids]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) + decoder.flush() == text


@pytest.mark.parametrize("seed", range(6))
def test_incremental_decoder_concatenates_to_decode(checkpoint: Path, seed: int) -> None:
    """Any id stream, special tokens and invalid UTF-8 included: pieces + flush == decode(all)."""
    ours = Tokenizer(checkpoint)
    rng = random.Random(seed)
    ids = [rng.randrange(ours.vocab_size) for _ in range(60)]
    ids += ours.encode("🙂")[-2:]  # end on a truncated character, which only flush may emit
    for skip in (True, False):
        decoder = ours.incremental_decoder(skip_special_tokens=skip)
        pieces = [decoder.push(i) for i in ids]
        assert "".join(pieces) + decoder.flush() == ours.decode(ids, skip_special_tokens=skip)


def test_make_tiny_model_is_deterministic(tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "a", "qwen2", seed=3, num_hidden_layers=2)
    b = make_tiny_model(tmp_path / "b", "qwen2", seed=3, num_hidden_layers=2)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def _copy(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / source.name
    shutil.copytree(source, target)
    return target
