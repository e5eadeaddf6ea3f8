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
from typing import Any

from clients.types import Usage

DONE = b"data: [DONE]\n\n"
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

    def body(self, texts: Sequence[str], reasons: Sequence[str], usage: dict[str, Any]) -> dict[str, Any]:
        """The non-streaming answer: one choice per (prompt, sample)."""
        if self.kind == "chat":
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text, "refusal": None},
                    "logprobs": None,
                    "finish_reason": finish_reason(reason),
                }
                for i, (text, reason) in enumerate(zip(texts, reasons, strict=True))
            ]
            head = self._head("chat.completion")
        else:
            choices = [
                {"index": i, "text": text, "logprobs": None, "finish_reason": finish_reason(reason)}
                for i, (text, reason) in enumerate(zip(texts, reasons, strict=True))
            ]
            head = self._head("text_completion")
        return {**head, "choices": choices, "usage": usage, "system_fingerprint": None}

    def chunk(
        self, index: int, text: str, reason: str | None, *, first: bool = False, with_usage: bool = False
    ) -> dict[str, Any]:
        """One streamed chunk of choice `index`; first: the chat chunk that carries the role."""
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
            if reason and not text and not first:
                delta = {}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice], "system_fingerprint": None}
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
            out = {**self._head("text_completion"), "choices": [choice], "system_fingerprint": None}
        if with_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The last chunk with stream_options.include_usage: no choices, the whole usage."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage, "system_fingerprint": None}
