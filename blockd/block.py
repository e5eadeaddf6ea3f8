"""Mutable records of one pool: committed blocks and live sequences.

Only *committed* blocks have a `Block` record. A block a sequence has allocated but
not yet committed belongs to that sequence alone: its id sits in the sequence's
table and nowhere else, so it needs no record (this keeps a cold admission to a
handful of list operations).
"""

from __future__ import annotations

from typing import Protocol

from blockd.types import BlockHash, BlockId, CachePolicy, HostBlockId, SequenceId


class Hashed(Protocol):
    """A cached block of any tier as a prefix walk reads it: a device or host `Block`, or a
    shared tier's record (blockd.shared_tier)."""

    block_hash: BlockHash


class Ranked(Protocol):
    """What an eviction policy may read of a block (`EvictionPolicy.priority`): a pool's
    `Block`, or a miniature simulation's `MiniBlock` (blockd.minisim)."""

    last_tick: int
    num_seen: int
    num_hits: int
    retention: int
    run_length: int


class Block:
    """A committed block: its content identity and its bookkeeping.

    Identity (what an exact hit compares): `parent` (the physical parent block's
    record, None for a first block) and `payload`, what the hash covers after the
    parent's hash: `token_bytes` preceded by the salt tag of `mixed_salt` (the salt
    mixed into this block's hash, None for all but one block of a salted chain). The
    salt encoding is unambiguous, so equal payloads mean equal tokens and salt; an
    unsalted block's payload is its `token_bytes` object. The pool's namespace is
    implied: every pool has its own index.

    Invariants, checked by the property tests:
    - `is_cached` <=> the pool's index maps `block_hash` to this record.
    - a cached block's parent is cached (no orphaned descendants), so its
      `num_cached_children` counts cached records whose `parent` is this one.
    - `ref_count` == holders: sequences whose table contains it, plus `pin_count`.
    - ref_count == 0 => cached (an uncached committed block is freed on its last
      release, since nothing can find it again).

    Residency (pools with a host tier): a record is *device-cached* (`is_cached`, in
    the pool's index) and/or *host-resident* (`host_block_id` set, in the host tier's
    index); one record per content block, whichever tiers hold it, so a child's
    `parent` identity survives its parent's moves and exact verification holds across
    tiers. A record resident nowhere is gone. Further invariants:
    - a host-only record (host-resident, not device-cached) has ref_count 0 and
      `block_id` None; its parent is device-cached or host-resident (no orphans in
      the union of the tiers), and `num_host_children` of a record counts its
      host-only children;
    - `host_refs` counts sequences copying the record into the device (loads in
      flight); such a record is never evicted from the host tier.
    """

    __slots__ = (
        "block_hash",
        "block_id",
        "chain_salt",
        "depth",
        "heap_key",
        "host_block_id",
        "host_heap_key",
        "host_refs",
        "is_cached",
        "last_tick",
        "mixed_salt",
        "num_cached_children",
        "num_hits",
        "num_host_children",
        "num_seen",
        "parent",
        "payload",
        "pin_count",
        "ref_count",
        "retention",
        "run_length",
        "token_bytes",
    )

    def __init__(
        self,
        block_id: BlockId | None,
        block_hash: BlockHash,
        parent: Block | None,
        token_bytes: bytes,
        mixed_salt: str | None,
        payload: bytes,
        run_length: int = 0,
        is_cached: bool = False,
        num_cached_children: int = 0,
        num_seen: int = 1,
    ) -> None:
        """`run_length`, `is_cached`, `num_cached_children` and `num_seen` are given by a
        commit that indexes a whole run at once (`BlockPool._new_run`): one call per block."""
        self.block_id = block_id
        self.block_hash = block_hash
        self.parent = parent
        self.token_bytes = token_bytes
        self.mixed_salt = mixed_salt
        self.payload = payload
        # The salt the chain carries from here on (for flushing one tenant's blocks).
        if parent is None:
            self.chain_salt = mixed_salt
            self.depth = 0
        else:
            self.chain_salt = mixed_salt if mixed_salt is not None else parent.chain_salt
            self.depth = parent.depth + 1
        self.ref_count = 1
        self.pin_count = 0
        self.num_cached_children = num_cached_children
        self.is_cached = is_cached
        self.last_tick = 0  # logical time of the last release/unpin (LRU recency)
        self.num_hits = 0  # verified hits (LFU frequency)
        # Uses before the first hit: its commit, plus the uses the pool's ghost table
        # remembered for this hash from before an eviction (the "seen count" a
        # seen-twice admission rule reads: num_seen + num_hits >= 2).
        self.num_seen = num_seen
        # Retention priority 1..100 (0: unset), the highest any releasing request asked.
        self.retention = 0
        # Uncached full blocks its sequence brought at admission (0: unknown, e.g. a
        # resync's or an adopted host record's): long fresh runs are often one-shots.
        self.run_length = run_length
        self.heap_key: int | None = None  # key of its valid entry in the evictable heap
        self.host_block_id: HostBlockId | None = None
        self.host_refs = 0
        self.num_host_children = 0
        self.host_heap_key: int | None = None  # key of its valid entry in the host tier's heap

    @property
    def is_evictable_leaf(self) -> bool:
        return self.is_cached and self.ref_count == 0 and self.num_cached_children == 0

    @property
    def is_host_leaf(self) -> bool:
        """Evictable from the host tier: resident there, no load in flight, and no
        host-only child (which would be orphaned)."""
        return self.host_block_id is not None and self.host_refs == 0 and self.num_host_children == 0

    def __repr__(self) -> str:
        return (
            f"Block(id={self.block_id}, depth={self.depth}, ref={self.ref_count}, "
            f"cached={self.is_cached}, children={self.num_cached_children})"
        )


class Sequence:
    """A live sequence of one pool.

    `committed` are the records of `block_ids[:num_committed]` (each holds one
    reference for this sequence), kept beside the ids so a release touches no dict;
    `block_ids[num_committed:]` are owned by this sequence alone. `token_bytes` are
    the tokens known to be written or to be written (prompt, then committed content);
    commits must agree with them where they overlap.
    """

    __slots__ = (
        "block_ids",
        "cache_policy",
        "committed",
        "loading",
        "prompt_blocks",
        "retention",
        "run_length",
        "salt",
        "salt_block",
        "sequence_id",
        "token_bytes",
    )

    def __init__(
        self,
        sequence_id: SequenceId,
        block_ids: list[BlockId],
        committed: list[Block],
        token_bytes: bytes,
        salt: str,
        salt_block: int | None,
        cache_policy: CachePolicy = CachePolicy.STORE,
        retention: int = 0,
        run_length: int = 0,
        prompt_blocks: list[bytes] | None = None,
    ) -> None:
        self.sequence_id = sequence_id
        self.block_ids = block_ids
        self.committed = committed
        self.token_bytes = token_bytes
        self.salt = salt
        self.salt_block = salt_block
        # Host-only records this sequence copies into block_ids[num_committed:] (each
        # holds one host_ref until its commit or the sequence's release).
        self.loading: list[Block] = []
        self.cache_policy = cache_policy  # STORE: its committed blocks are indexed
        self.retention = retention  # stamped on its blocks at release (0: unset)
        self.run_length = run_length  # stamped on the blocks it commits (Block.run_length)
        # The prompt's full blocks as cut at admission (unsalted prompts: each block is
        # its payload), so a commit inside the prompt cuts nothing again (None: cut then).
        self.prompt_blocks = prompt_blocks

    @property
    def num_committed(self) -> int:
        return len(self.committed)
