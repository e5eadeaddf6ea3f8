"""OpenAI response bodies and stream chunks from what the workers answered (pure, no I/O).

A `Reply` names one response (id, object kinds, creation time, model); its methods
build the non-streaming body, each streamed chunk and the closing usage chunk
exactly as OpenAI's API spells them.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from json.encoder import encode_basestring_ascii as _json_str  # json.dumps of a str, in C
from typing import Any

from clients.types import PositionLogprobs, TokenLogprob, Usage

DONE = b"data: [DONE]\n\n"
# What follows a streamed chunk's finish_reason (`Reply.chunk_event`).
_EVENT_END = '}],"system_fingerprint":null}\n\n'
_EVENT_END_USAGE = '}],"system_fingerprint":null,"usage":null}\n\n'
# What the workers' finish_reason becomes (a cancelled request has no reader left).
_FINISH = {"stop": "stop", "length": "length", "cancelled": "stop", "": None}


def finish_reason(reason: str) -> str | None:
    return _FINISH.get(reason, reason or None)


def usage_body(usages: Sequence[Usage | None], n: int) -> dict[str, Any]:
    """Usage of one response: the prompt counted once per prompt (its first sample), completions all.

    `usages` is in choice order (prompt i's samples at i*n .. i*n+n-1).
    """
    firsts = [u for u in usages[::n] if u is not None]
    prompt = sum(u.prompt_tokens for u in firsts)
    cached = sum(u.cached_tokens for u in firsts)
    completion = sum(u.completion_tokens for u in usages if u is not None)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


# A logprob JSON can carry (JSON has no -Infinity); vLLM clamps to the same value.
MIN_LOGPROB = -9999.0


def _lp(value: float) -> float:
    return max(value, MIN_LOGPROB)


def chat_logprobs(entries: Sequence[PositionLogprobs]) -> dict[str, Any]:
    """Chat's `logprobs` of these tokens: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def one(t: TokenLogprob) -> dict[str, Any]:
        return {"token": t.text, "logprob": _lp(t.logprob), "bytes": list(t.text.encode())}

    return {
        "content": [{**one(e.token), "top_logprobs": [one(t) for t in e.top]} for e in entries],
        "refusal": None,
    }


def completion_logprobs(
    entries: Sequence[PositionLogprobs], offset: int, first_unscored: bool = False
) -> tuple[dict[str, Any], int]:
    """The legacy `logprobs` of /v1/completions (tokens, token_logprobs, top_logprobs,
    text_offset), text offsets counted from `offset`; answers the offset after them.
    first_unscored: the first entry is a prompt's first token, which has no logprob (null).
    Each top_logprobs dict holds the chosen token too, as vLLM's does."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for i, e in enumerate(entries):
        tokens.append(e.token.text)
        offsets.append(offset)
        offset += len(e.token.text)
        if first_unscored and i == 0:
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(_lp(e.token.logprob))
        top = {t.text: _lp(t.logprob) for t in e.top}
        top.setdefault(e.token.text, _lp(e.token.logprob))
        tops.append(top)
    block = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
    return block, offset


def join_logprobs(blocks: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Completion logprob blocks of consecutive tokens as one."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for block in blocks:
        for key, values in out.items():
            values.extend(block[key])
    return out


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event as OpenAI writes it."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


@dataclass(frozen=True)
class Reply:
    kind: str  # "chat" or "completion"
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def new(cls, kind: str, model: str) -> Reply:
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return cls(kind, model, f"{prefix}-{uuid.uuid4().hex}")

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def body(
        self,
        texts: Sequence[str],
        reasons: Sequence[str],
        usage: dict[str, Any],
        logprobs: Sequence[dict[str, Any] | None] | None = None,
    ) -> dict[str, Any]:
        """The non-streaming answer: one choice per (prompt, sample); `logprobs`: each
        choice's logprobs block (None: not asked)."""
        blocks = logprobs if logprobs is not None else [None] * len(texts)
        if self.kind == "chat":
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text, "refusal": None},
                    "logprobs": block,
                    "finish_reason": finish_reason(reason),
                }
                for i, (text, reason, block) in enumerate(zip(texts, reasons, blocks, strict=True))
            ]
            head = self._head("chat.completion")
        else:
            choices = [
                {"index": i, "text": text, "logprobs": block, "finish_reason": finish_reason(reason)}
                for i, (text, reason, block) in enumerate(zip(texts, reasons, blocks, strict=True))
            ]
            head = self._head("text_completion")
        return {**head, "choices": choices, "usage": usage, "system_fingerprint": None}

    def chunk(
        self,
        index: int,
        text: str,
        reason: str | None,
        *,
        first: bool = False,
        with_usage: bool = False,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One streamed chunk of choice `index`; first: the chat chunk that carries the role;
        logprobs: the logprobs block of this chunk's tokens."""
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
            if reason and not text and not first:
                delta = {}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice], "system_fingerprint": None}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
            out = {**self._head("text_completion"), "choices": [choice], "system_fingerprint": None}
        if with_usage:
            out["usage"] = None
        return out

    def chunk_event(
        self,
        index: int,
        text: str,
        reason: str | None,
        *,
        first: bool = False,
        with_usage: bool = False,
        logprobs: dict[str, Any] | None = None,
    ) -> bytes:
        """`sse(self.chunk(...))`, the same bytes. A chunk of text alone (no logprobs, not
        chat's first) comes from the reply's template with only the text and the finish
        reason encoded: one per token per stream, it was the gateway's costliest Python per
        token (a dict per chunk and json.dumps of all of it; `python -m bench --only
        serving` streams 8,192 of them per run)."""
        if logprobs is not None or first:
            return sse(self.chunk(index, text, reason, first=first, with_usage=with_usage, logprobs=logprobs))
        if self.kind == "chat":
            delta = "{}" if reason and not text else '{"content":' + _json_str(text) + "}"
            body = f'{self._event_prefix}{index},"delta":{delta}'
        else:
            body = f'{self._event_prefix}{index},"text":{_json_str(text)}'
        end = _EVENT_END_USAGE if with_usage else _EVENT_END
        finish = _json_str(reason) if reason else "null"
        return f'{body},"logprobs":null,"finish_reason":{finish}{end}'.encode()

    @cached_property
    def _event_prefix(self) -> str:
        """A streamed chunk's event up to its choice's index: 'data: {"id":...,"choices":[{"index":'."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        head = json.dumps(self._head(obj), separators=(",", ":"))
        return f'data: {head[:-1]},"choices":[{{"index":'

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The last chunk with stream_options.include_usage: no choices, the whole usage."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage, "system_fingerprint": None}


class ChoiceOutput:
    """What one choice shows beyond the worker's text, chunk by chunk: the echoed prompt
    (completions with echo) and the logprobs blocks, text offsets carried across chunks.

    `prompt_text` None with echo: the prompt's text is its tokens' texts (a token-id
    prompt, whose prompt logprobs the gateway asked for to get them)."""

    def __init__(self, kind: str, logprobs: int | None, echo: bool, prompt_text: str | None) -> None:
        self.kind = kind
        self.logprobs = logprobs
        self.echo = echo
        self.prompt_text = prompt_text
        self._offset = 0
        self._started = False

    def take(
        self, entries: Sequence[PositionLogprobs], prompt: Sequence[PositionLogprobs]
    ) -> tuple[str, Any]:
        """(text this chunk leads with, its logprobs block or None) for a chunk's token
        entries and, on the first chunk, the prompt's."""
        first, self._started = not self._started, True
        echoed = self.echo and first
        prefix = ""
        if echoed:
            prefix = (
                self.prompt_text if self.prompt_text is not None else "".join(e.token.text for e in prompt)
            )
        if self.logprobs is None:
            return prefix, None
        if self.kind == "chat":
            return prefix, chat_logprobs(entries)
        blocks = []
        if echoed:
            block, self._offset = completion_logprobs(prompt, self._offset, first_unscored=True)
            blocks.append(block)
        block, self._offset = completion_logprobs(entries, self._offset)
        blocks.append(block)
        return prefix, join_logprobs(blocks) if len(blocks) > 1 else blocks[0]

    def merge(self, blocks: Sequence[Any]) -> Any:
        """The blocks of every chunk of the choice as one (a non-streaming answer)."""
        if self.logprobs is None:
            return None
        if self.kind == "chat":
            return {"content": [c for b in blocks for c in b["content"]], "refusal": None}
        return join_logprobs(blocks)
