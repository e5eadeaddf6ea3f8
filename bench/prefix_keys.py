"""Content identity of full blocks for the simulators: one int per (parent key, tokens).

Two requests get the same key for block i exactly when their first (i+1) * block_size
tokens are equal, which is what a chained hash with exact verification decides.
Interning makes keys collision-free and cheap to compare.
"""

from __future__ import annotations

from collections.abc import Sequence


class PrefixKeys:
    def __init__(self, block_size: int) -> None:
        assert block_size >= 1, "block_size must be >= 1"
        self.block_size = block_size
        self._ids: dict[tuple[int, tuple[int, ...]], int] = {}

    def chain(self, token_ids: Sequence[int]) -> list[int]:
        """Keys of the prompt's full blocks, in order (the partial tail has none)."""
        bs = self.block_size
        keys: list[int] = []
        parent = -1
        for start in range(0, len(token_ids) - bs + 1, bs):
            ident = (parent, tuple(token_ids[start : start + bs]))
            parent = self._ids.setdefault(ident, len(self._ids))
            keys.append(parent)
        return keys

    def num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
