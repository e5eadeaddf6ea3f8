"""Streaming text for one request: incremental detokenization and stop strings."""

from __future__ import annotations

from typing import Protocol


class TokenDecoder(Protocol):
    def push(self, token_id: int) -> str: ...
    def flush(self) -> str: ...


def _push_all(decoder: TokenDecoder, token_ids: list[int]) -> str:
    """Several ids at once: one decode where the decoder can (`push_many`), else one each."""
    push_many = getattr(decoder, "push_many", None)
    if push_many is not None:
        return push_many(token_ids)
    return "".join(decoder.push(token_id) for token_id in token_ids)


class OutputText:
    """Text emitted so far never contains a stop string and never splits a character.

    While stop strings are set, the last `len(longest stop) - 1` characters are held
    back: they might be the start of a stop string that the next token completes.
    """

    def __init__(self, decoder: TokenDecoder, stop: tuple[str, ...]) -> None:
        self._decoder = decoder
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._text = ""
        self._emitted = 0
        self._deferred: list[int] = []  # ids whose text nobody has asked for yet

    def push(self, token_id: int, defer: bool = False, silent: bool = False) -> tuple[str, bool]:
        """Add a token; returns (text to emit now, whether a stop string was hit).

        `defer=True` (the caller holds this token's chunk back) only queues the id when no
        stop string is set: its text comes with the next push that is not deferred, or
        with `finish`, decoded together (detokenizing is ~7 us a token, a tenth of a
        64-stream decode step's host work). The text emitted in total is the same.

        `silent=True`: the token that ended the completion (EOS or one of its stop token
        ids) adds no text of its own, as vLLM drops it unless `include_stop_str_in_output`
        (which the gateway accepts only as false); the text before it is still emitted."""
        if silent:
            self._drain()
            return self._take(len(self._text) - self._hold), False
        if defer and not self._stop:
            self._deferred.append(token_id)
            return "", False
        self._deferred.append(token_id)
        self._drain()
        if self._stop:
            search_from = max(0, self._emitted - self._hold)
            hits = [i for i in (self._text.find(s, search_from) for s in self._stop) if i >= 0]
            if hits:
                self._text = self._text[: min(hits)]
                return self._take(len(self._text)), True
        return self._take(len(self._text) - self._hold), False

    def finish(self, stopped: bool) -> str:
        """The held-back tail (nothing more when a stop string ended the text)."""
        self._drain()  # ids held without text: their text is owed (stop strings defer nothing)
        if not stopped:
            self._text += self._decoder.flush()
        return self._take(len(self._text))

    def _drain(self) -> None:
        """Decode the deferred ids into the text, together."""
        if self._deferred:
            self._text += _push_all(self._decoder, self._deferred)
            self._deferred = []

    def _take(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        out = self._text[self._emitted : upto]
        self._emitted = upto
        return out
