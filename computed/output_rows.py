"""The rows of a step whose final hidden states are read: the last layer runs for them only.

A step feeds T new tokens but samples at most one per chunk: a prefill chunk of 1,024
tokens needs the logits of its last token alone. Every layer but the last must run on
all T rows, because the next layer's K/V come from them. The last layer's K/V come from
its q/k/v product, which still runs on all T rows so their K/V reach the pool; what
follows it (attention, the output product, the MLP, the final norm) runs on the S read
rows only. A 2,048-token prefill step of the default model (4 layers) is ~20% less work.
vLLM and SGLang run every layer on every row.

Exactness: a read row's last layer attends over the same context it always did (its own
K/V included, written just before), as the decode row of a span of one new token, so it
runs the decode kernels rather than the causal prefill ones: the same sums in another
order, like a cache hit's recomputed last token.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from computed.attention import AttentionBatch, SpanInput
from computed.attention_plan import EVERY_SEGMENT, DecodeCascade


@dataclass(frozen=True)
class OutputRows:
    """Invariant: `batch` holds one span per read row, in the order of `rows`: that row's
    sequence at that row's position as its one new token, writing nothing; None when the
    step reads no row (its last layer then only writes K/V)."""

    rows: torch.Tensor  # (S,) int64 flat rows of the step whose hidden states are read
    batch: AttentionBatch | None  # S spans of one new token each

    @classmethod
    def build(
        cls,
        spans: Sequence[SpanInput],
        rows: Sequence[int],
        chunks: Sequence[int],
        block_size: int,
        device: torch.device,
        cascade: DecodeCascade = EVERY_SEGMENT,
    ) -> OutputRows:
        """For the step of `spans` reading flat row `rows[i]`, the last new token of chunk
        `chunks[i]`."""
        ends = list(itertools.accumulate(s.num_new_tokens for s in spans))
        read = []
        for row, chunk in zip(rows, chunks, strict=True):
            span = spans[chunk]
            assert row == ends[chunk] - 1, "a read row is its chunk's last new token"
            position = span.num_computed_tokens + span.num_new_tokens - 1
            read.append(SpanInput(span.block_table, position, 1, False))
        batch = AttentionBatch.build(read, block_size, device, cascade) if read else None
        return cls(torch.tensor(list(rows), dtype=torch.long, device=device), batch)
