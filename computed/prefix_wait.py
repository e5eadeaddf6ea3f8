"""Hold back a waiting request whose prefix another sequence is computing right now (pure).

Blocks become findable only once the forward that wrote them has finished (DESIGN's
commit-after-write rule). Requests that arrive together with a common uncached prefix
would therefore all be admitted in one step, all miss, and all compute the prefix: 16
requests sharing one 4,096-token prefix computed it 8 times (`make bench-peer`, long
prefix). Instead, a waiting request whose full blocks run past what an in-flight
sequence with the same salt has committed waits until that sequence has committed them,
and then hits them like any later request. Invariant: a request waits only on a
sequence that is admitted and still prefilling, so it waits at most until that
sequence's prompt is committed (or it is preempted or finishes, ending the wait).
"""

from __future__ import annotations

from dataclasses import dataclass

from computed.sequence import Sequence


@dataclass(frozen=True)
class _Leader:
    token_ids: list[int]
    num_committed_blocks: int


class PrefixLeaders:
    """The in-flight prefills of one scheduling step, indexed by salt and first block."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._by_key: dict[tuple, list[_Leader]] = {}

    def add(self, seq: Sequence, num_committed_blocks: int) -> None:
        """`seq` computes its prompt now; its first `num_committed_blocks` are findable."""
        key = self._key(seq)
        if key is not None:
            self._by_key.setdefault(key, []).append(_Leader(seq.token_ids, num_committed_blocks))

    def should_wait(self, seq: Sequence) -> bool:
        """True when a leader is still computing full blocks that `seq` would hit."""
        key = self._key(seq)
        if key is None:
            return False
        return any(
            self._common_blocks(seq.token_ids, leader.token_ids) > leader.num_committed_blocks
            for leader in self._by_key.get(key, ())
        )

    def _key(self, seq: Sequence) -> tuple | None:
        if seq.num_tokens < self.block_size:
            return None  # no full block: nothing to share
        return seq.cache_salt, seq.public_prefix_tokens, tuple(seq.token_ids[: self.block_size])

    def _common_blocks(self, a: list[int], b: list[int]) -> int:
        """Full blocks the two token lists share from the start (binary search on slices,
        each comparison one C-speed list equality)."""
        low, high = 0, min(len(a), len(b)) // self.block_size
        while low < high:
            mid = (low + high + 1) // 2
            end = mid * self.block_size
            if a[:end] == b[:end]:
                low = mid
            else:
                high = mid - 1
        return low
