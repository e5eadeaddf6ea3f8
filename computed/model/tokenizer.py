"""Tokenizer of a Hugging Face checkpoint without transformers.

`tokenizer.json` drives encode/decode through the `tokenizers` library;
`tokenizer_config.json` adds the special tokens, the BOS/EOS rule and the chat template,
which is rendered with jinja2 the way transformers renders it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class ChatTemplateError(ValueError):
    """The messages do not fit the model's chat template, or it has none."""


class Tokenizer:
    """Text <-> token ids for one checkpoint directory.

    Special tokens added by `encode` come from tokenizer.json's post-processor alone (e.g.
    Llama 3's BOS template; none for Qwen), as transformers 5 does for tokenizer.json
    checkpoints: `add_bos_token`/`add_eos_token` in tokenizer_config.json do not change it.
    """

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        self._backend = BackendTokenizer.from_file(str(tokenizer_file))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.special_tokens: dict[str, str] = {
            key: _token_text(config[key]) for key in _SPECIAL_TOKEN_KEYS if config.get(key) is not None
        }
        self.bos_token_id = self._id_of(self.special_tokens.get("bos_token"))
        self.chat_template = _read_chat_template(path, config)
        self.eos_token_ids = self._eos_ids(path)

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.encode_many([text], add_special_tokens)[0]

    def encode_many(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` of each text, in one call that releases the GIL and runs on every core.

        The ids are `tokenizers`' `encode` ids; `encode_batch_fast` leaves out the character
        offsets, which nothing here reads (tests/computed/test_tokenizer.py checks the ids
        are the same). Why: prompts made as the serving benchmark makes them (1,040 random
        ids of the built-in model decoded, ~1,200 tokens again), medians of 20 on a quiet
        machine: 8 in one call 5.4 ms against 7.2, one 1.07 ms against 1.6; a burst's
        tokenizing competes with the forward for the cores (`bench.serving_http`)."""
        encoded = self._backend.encode_batch_fast(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encoded]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` ({"role", "content", ...} dicts) to the prompt text.

        The text already holds any BOS the template writes: encode it with
        `add_special_tokens=False` (or use `encode_chat`). Raises ChatTemplateError.
        """
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; send a plain prompt")
        if not messages:
            raise ChatTemplateError("a chat needs at least one message")
        # As transformers: keys whose value is None are dropped, special tokens are variables.
        messages = [
            {key: value for key, value in message.items() if value is not None} for message in messages
        ]
        try:
            return _compile(self.chat_template).render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **kwargs},
            )
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"chat template: {error}") from error

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat, as transformers' `apply_chat_template(tokenize=True)`."""
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False
        )

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def _eos_ids(self, path: Path) -> tuple[int, ...]:
        """The tokenizer's eos token, then generation_config.json's eos ids (chat models list more)."""
        ids = [self._id_of(self.special_tokens.get("eos_token"))]
        generation_file = path / "generation_config.json"
        if generation_file.is_file():
            value = json.loads(generation_file.read_text()).get("eos_token_id")
            ids += [value] if isinstance(value, int) else (value or [])
        return tuple(dict.fromkeys(i for i in ids if i is not None))


class IncrementalDecoder:
    """Turns a stream of token ids into a stream of text.

    `push` returns only completed text: it holds back output while the decoded tail is
    an incomplete UTF-8 character (U+FFFD). It decodes a sliding window that starts at
    the previous emission point, so tokenizers that strip a leading space (SentencePiece)
    keep the right spacing. Invariant: "".join(push(id) for id in ids) + flush() == decode(ids).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: text before it has been emitted long ago
        self._read_offset = 0  # ids before it have had their text emitted

    def push(self, token_id: int) -> str:
        """Add one id; return the newly completed text (often "", never half a character)."""
        return self.push_many([token_id])

    def push_many(self, token_ids: list[int]) -> str:
        """Add several ids; one decode for all of them (the same text, in total, as a push each)."""
        self._ids.extend(token_ids)
        delta = self._delta()
        return "" if delta.endswith("\ufffd") else self._advance(delta)

    def flush(self) -> str:
        """At the end of the stream: whatever is still held back (a truncated character decodes to U+FFFD)."""
        return self._advance(self._delta())

    def _delta(self) -> str:
        emitted = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        return window[len(emitted) :] if len(window) > len(emitted) else ""

    def _advance(self, delta: str) -> str:
        if delta:
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


def _token_text(value: str | dict[str, Any]) -> str:
    """A special token as saved: a string or a serialized AddedToken ({"content": ...})."""
    return value["content"] if isinstance(value, dict) else value


def _read_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja (transformers 5), chat_template.json, or tokenizer_config's entry."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    if (path / "chat_template.json").is_file():
        return json.loads((path / "chat_template.json").read_text())["chat_template"]
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = {item["name"]: item["template"] for item in template}.get("default")
    return template


_compiled: dict[str, jinja2.Template] = {}


def _compile(template: str) -> jinja2.Template:
    """The environment transformers uses: sandboxed, trim/lstrip blocks, loop controls."""
    if template not in _compiled:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _compiled[template] = env.from_string(template)
    return _compiled[template]


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
