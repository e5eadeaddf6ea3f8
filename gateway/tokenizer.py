"""Tokenizing in the gateway (`--tokenizer MODEL=DIR`), saving a worker's Tokenize round trip.

Reads the checkpoint's own files as computed does, with no code shared with it:
tokenizer.json through the `tokenizers` library (special tokens from its
post-processor), the chat template from chat_template.jinja, chat_template.json or
tokenizer_config.json, rendered with jinja2 the way transformers (and computed) render
it. tests/gateway/test_local_tokenizer.py proves the ids equal computed's Tokenize.
`LocalTokenizer.tokenize` answers None for anything it cannot do exactly as computed
would (no template, a template error, an empty result): the caller then asks a worker.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import structlog
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from clients.requests import Prompt

log = structlog.get_logger("gateway")
_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
MAX_MESSAGES = 1024  # beyond computed's limit, let the worker answer (and refuse)


class LocalTokenizer:
    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        self._backend = Tokenizer.from_file(str(path / "tokenizer.json"))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self._special = {k: _text(config[k]) for k in _SPECIAL if config.get(k) is not None}
        template = chat_template(path, config)
        self._template = _environment().from_string(template) if template is not None else None

    def tokenize(self, prompt: Prompt) -> tuple[int, ...] | None:
        """The prompt's token ids as computed's Tokenize answers them; None: ask a worker."""
        try:
            if prompt.messages is not None:
                text = self.render(prompt.messages)
                ids = None if text is None else self._encode(text, add_special_tokens=False)
            else:
                ids = self._encode(prompt.text or "", add_special_tokens=True)
        except Exception as exc:  # noqa: BLE001 (a template raises anything; the worker will say it)
            log.debug("local tokenization declined", error=str(exc))
            return None
        return tuple(ids) if ids else None

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """`encode`'s ids without its character offsets, which nothing here reads: the
        path computed tokenizes by (computed.model.tokenizer), about a third cheaper."""
        return self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def render(self, messages: Any) -> str | None:
        if self._template is None or not messages or len(messages) > MAX_MESSAGES:
            return None
        if any(not m.role for m in messages):
            return None
        chat = [{"role": m.role, "content": m.content, "name": m.name or None} for m in messages]
        chat = [{k: v for k, v in m.items() if v is not None} for m in chat]
        return self._template.render(
            messages=chat, tools=None, documents=None, add_generation_prompt=True, **self._special
        )


def load_tokenizers(specs: dict[str, str]) -> dict[str, LocalTokenizer]:
    """model id -> its local tokenizer, from --tokenizer MODEL=DIR."""
    out = {model: LocalTokenizer(path) for model, path in specs.items()}
    for model, path in specs.items():
        log.info("tokenizing locally", model=model, path=path)
    return out


def chat_template(path: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja, chat_template.json, or tokenizer_config's entry (named: "default")."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    if (path / "chat_template.json").is_file():
        return json.loads((path / "chat_template.json").read_text())["chat_template"]
    template = config.get("chat_template")
    if isinstance(template, list):
        template = {item["name"]: item["template"] for item in template}.get("default")
    return template


def _text(value: str | dict[str, Any]) -> str:
    return value["content"] if isinstance(value, dict) else value


def _environment() -> jinja2.Environment:
    """transformers' environment: sandboxed, trim/lstrip blocks, loop controls, plain tojson."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
