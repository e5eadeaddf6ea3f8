"""Cached blocks (ListBlocks) as a forest of prefixes, one per pool, with runs compressed.

Blocks link to their parent by hash (`parent_hash`). A node holds a *run*: a block
and then, as long as a block has exactly one cached child, that child too - the
way a radix tree stores a path without branches in one edge. Roots are first
blocks (block_index 0) and, should the directory ever report one, blocks whose
parent is not cached ("orphans").
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from clients.types import BlockInfo


@dataclass
class PrefixNode:
    """A run of blocks, each the only cached child of the one before; `children` branch after it."""

    pool_id: str
    blocks: list[BlockInfo]
    children: list[PrefixNode] = field(default_factory=list)
    text: str | None = None  # the run's tokens decoded, when a tokenizer was reachable
    is_orphan: bool = False  # a root whose first block has a parent that is not cached

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    @property
    def token_ids(self) -> list[int]:
        return [t for b in self.blocks for t in b.token_ids]

    @property
    def start_index(self) -> int:
        return self.blocks[0].block_index

    @property
    def max_ref_count(self) -> int:
        return max(b.ref_count for b in self.blocks)

    @property
    def num_pinned_blocks(self) -> int:
        return sum(b.is_pinned for b in self.blocks)

    @property
    def is_salted(self) -> bool:
        return any(b.is_salted for b in self.blocks)

    def walk(self) -> Iterable[PrefixNode]:
        """This node and every node below it, depth first."""
        stack = [self]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children))

    def to_dict(self) -> dict:
        return {
            "block_ids": self.block_ids,
            "start_block_index": self.start_index,
            "token_ids": self.token_ids,
            "text": self.text,
            "max_ref_count": self.max_ref_count,
            "num_pinned_blocks": self.num_pinned_blocks,
            "is_salted": self.is_salted,
            "children": [child.to_dict() for child in self.children],
        }


def build_prefix_forest(blocks: Iterable[BlockInfo]) -> dict[str, list[PrefixNode]]:
    """pool_id -> root nodes, pools and siblings ordered by block id."""
    by_pool: dict[str, list[BlockInfo]] = defaultdict(list)
    for block in blocks:
        by_pool[block.pool_id].append(block)
    return {pool_id: _build_pool(pool_blocks) for pool_id, pool_blocks in sorted(by_pool.items())}


def _build_pool(blocks: list[BlockInfo]) -> list[PrefixNode]:
    blocks = sorted(blocks, key=lambda b: b.block_id)
    hashes = {b.block_hash for b in blocks}
    children_of: dict[bytes, list[BlockInfo]] = defaultdict(list)
    roots: list[BlockInfo] = []
    for block in blocks:
        if block.parent_hash is None or block.parent_hash not in hashes:
            roots.append(block)
        else:
            children_of[block.parent_hash].append(block)
    # Two physical copies of one content share a hash: hand their children out only once.
    claimed: set[bytes] = set()

    def children(block: BlockInfo) -> list[BlockInfo]:
        if block.block_hash in claimed:
            return []
        claimed.add(block.block_hash)
        return children_of.get(block.block_hash, [])

    def grow(first: BlockInfo) -> PrefixNode:
        node = PrefixNode(first.pool_id, [first])
        below = children(first)
        while len(below) == 1:
            node.blocks.append(below[0])
            below = children(below[0])
        node.children = [grow(child) for child in below]
        return node

    forest = [grow(root) for root in roots]
    for node in forest:
        node.is_orphan = node.blocks[0].parent_hash is not None
    return forest
