"""Which logits a step reads for logprobs, and where they wait until the engine sends them.

Prompt logprobs need the logits of every prompt position but the last, and a prefix
cache hit skips exactly those positions' forward. Rather than refusing the cache (vLLM
turns prefix caching off for such requests), a hit's positions are recomputed from the
cached K/V: one extra forward of those tokens as a span that writes nothing, so every
layer reads its K/V back from the pool as a cold prefill reads what it just wrote. The
cache still supplies the K/V (no block is written twice, the hit still counts as cached
tokens) and the logits are those of the same K/V, so a hit never changes a logprob
(tests/computed/test_logprobs.py compares a cold and a warm run). Only positions not yet
scored are planned, so chunked prefill and a preempted sequence's recompute score each
prompt position once.

`LogprobStore` keys entries by the position of the token they score: prompt token p
(1 <= p < prompt length) and each sampled token at the index it takes in its sequence.
The runner puts (compute thread), the engine takes when it emits (event loop).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from computed.attention import SpanInput
from computed.logprobs import TokenLogprobs
from computed.sequence import SequenceId


@dataclass(frozen=True)
class PromptRows:
    """Rows [first_row, first_row + len(targets)) of a forward are positions
    first_position.. of `sequence_id`; row r scores `targets[r]` (the next prompt token)."""

    sequence_id: SequenceId
    first_row: int
    first_position: int
    targets: tuple[int, ...]
    num_top: int


@dataclass(frozen=True)
class PromptRecompute:
    """Cache-served positions of one sequence to run again without writing K/V."""

    sequence_id: SequenceId
    span: SpanInput  # write_kv False: these positions' K/V are in the pool already
    token_ids: tuple[int, ...]
    targets: tuple[int, ...]
    num_top: int


# Cache-served positions recomputed per forward at most (the default step budget's half).
MAX_RECOMPUTE_TOKENS = 1024


class LogprobStore:
    def __init__(self) -> None:
        self._entries: dict[SequenceId, dict[int, TokenLogprobs]] = {}
        self._scored_to: dict[SequenceId, int] = {}  # next prompt position whose logits are owed

    def plan(
        self, chunks: Sequence[Any], spans: Sequence[SpanInput]
    ) -> tuple[list[PromptRows], list[PromptRecompute]]:
        """The prompt rows and recomputes of the step of `chunks` (ScheduledChunks), whose
        flat rows follow `spans`; marks those positions scored (a failed forward fails its
        requests, so nothing planned is owed twice)."""
        rows: list[PromptRows] = []
        recomputes: list[PromptRecompute] = []
        first_row = 0
        for chunk, span in zip(chunks, spans, strict=True):
            seq = chunk.seq
            num_top = seq.params.prompt_logprobs
            if num_top is not None or seq.params.logprobs is not None:
                self._entries.setdefault(seq.sequence_id, {})
            if num_top is not None:
                last = seq.num_prompt_tokens - 1  # positions [0, last) score tokens 1 .. last
                done = self._scored_to.get(seq.sequence_id, 0)
                ids = seq.token_ids
                while done < last and chunk.start > done:
                    # In pieces: a piece's activations and logits (positions x vocab) are
                    # what one forward holds, whatever the cached prefix's length.
                    end = min(chunk.start, last, done + MAX_RECOMPUTE_TOKENS)
                    recompute_span = SpanInput(list(span.block_table), done, end - done, False)
                    recomputes.append(
                        PromptRecompute(
                            seq.sequence_id,
                            recompute_span,
                            tuple(ids[done:end]),
                            tuple(ids[done + 1 : end + 1]),
                            num_top,
                        )
                    )
                    done = end
                lo, hi = max(chunk.start, done), min(chunk.end, last)
                if hi > lo:
                    rows.append(
                        PromptRows(
                            seq.sequence_id,
                            first_row + lo - chunk.start,
                            lo,
                            tuple(ids[lo + 1 : hi + 1]),
                            num_top,
                        )
                    )
                    done = hi
                self._scored_to[seq.sequence_id] = done
            first_row += span.num_new_tokens
        return rows, recomputes

    def put(self, sequence_id: SequenceId, first_position: int, entries: Sequence[TokenLogprobs]) -> None:
        store = self._entries.get(sequence_id)
        if store is None:  # the request left while its step ran
            return
        for offset, entry in enumerate(entries):
            store.setdefault(first_position + offset, entry)

    def take(self, sequence_id: SequenceId, position: int) -> TokenLogprobs | None:
        store = self._entries.get(sequence_id)
        return None if store is None else store.pop(position, None)

    def take_prompt(self, sequence_id: SequenceId, prompt_token_ids: Sequence[int]) -> list[TokenLogprobs]:
        """Every prompt position's entry, the first (which has no logprob) as logprob 0."""
        store = self._entries.get(sequence_id, {})
        out = [TokenLogprobs(prompt_token_ids[0], 0.0)]
        for position in range(1, len(prompt_token_ids)):
            entry = store.pop(position, None)
            assert entry is not None, f"prompt position {position} of sequence {sequence_id} was never scored"
            out.append(entry)
        return out

    def remove(self, sequence_id: SequenceId) -> None:
        self._entries.pop(sequence_id, None)
        self._scored_to.pop(sequence_id, None)
