"""The statistics issue 44 publishes for a production conversation trace, measured on ours.

Per trace, over its stream of full-block requests (each prompt's chain of blocks, in
order; an unbounded cache would hit every request of a block after its first):

- `one_off_share`: distinct blocks requested only once ÷ distinct blocks (issue 44: ~0.76);
- `median_reuse_gap`: the median, over every repeated request of a block, of the block
  requests since the block's previous request (issue 44: ~6,000 blocks, longer than a
  2% pool);
- `twice_used_hit_share`: of the unbounded cache's hits, the share given by blocks
  requested exactly twice (issue 44: ~0.42; pure admission always misses those).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from bench.prefix_keys import PrefixKeys


@dataclass(frozen=True)
class TraceStatistics:
    num_distinct: int
    num_requests: int  # block requests
    one_off_share: float
    median_reuse_gap: float | None  # None: no block is requested twice
    twice_used_hit_share: float

    def describe(self) -> str:
        gap = f"{self.median_reuse_gap:,.0f}" if self.median_reuse_gap is not None else "none"
        return (
            f"one-off blocks {self.one_off_share:.2f}, median reuse gap {gap} blocks, "
            f"twice-used blocks {self.twice_used_hit_share:.2f} of hits"
        )


def trace_statistics(prompts: Sequence[Sequence[int]], block_size: int) -> TraceStatistics:
    keys = PrefixKeys(block_size)
    last: dict[int, int] = {}
    uses: dict[int, int] = {}
    gaps: list[int] = []
    position = 0
    for prompt in prompts:
        for key in keys.chain(prompt):
            previous = last.get(key)
            if previous is not None:
                gaps.append(position - previous)
            last[key] = position
            uses[key] = uses.get(key, 0) + 1
            position += 1
    distinct = len(uses)
    counts = list(uses.values())
    hits = position - distinct
    return TraceStatistics(
        num_distinct=distinct,
        num_requests=position,
        one_off_share=counts.count(1) / max(1, distinct),
        median_reuse_gap=statistics.median(gaps) if gaps else None,
        twice_used_hit_share=counts.count(2) / max(1, hits),
    )
