"""One worker's pool: the block mechanics behind admit, grow, commit and release.

Every block is in exactly one of three states, so at every moment

    free + evictable + referenced == num_blocks

- free: in `self.free`; nobody can find it.
- evictable: committed, cached (findable by hash), no references; it can be hit
  again or evicted (leaf first) when the pool runs out of free blocks.
- referenced: held by live sequences or pins. Only a sequence's own uncommitted
  blocks are ever written; a referenced block is never evicted or handed out.

Methods assume their arguments were validated (`blockd.validation`); they only
`assert` internal invariants, so a step that passed validation applies fully.
"""

from __future__ import annotations

from dataclasses import dataclass

from blockd.allocator import FreeBlocks
from blockd.block import Block, Sequence
from blockd.events import EventKind, EventLog
from blockd.eviction import EvictableLeaves, EvictionPolicy
from blockd.hashing import BlockHasher, block_payloads, block_width, split_blocks
from blockd.prompt import Prompt
from blockd.types import AdmitResult, BlockHash, BlockId, GrowResult, PoolId, SequenceId

EVENT_CHUNK = 1024  # blocks per REMOVED event when a flush drops many


@dataclass
class PoolCounters:
    """Cumulative statistics; they survive resets so exported counters never go down."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    num_evictions: int = 0
    num_admissions: int = 0
    num_admissions_deferred: int = 0


@dataclass(frozen=True, slots=True)
class ResyncPlan:
    """A validated ResyncSequence."""

    sequence_id: SequenceId
    block_ids: list[BlockId]
    prompt: Prompt


class BlockPool:
    """Blocks, hash index, free list, evictable leaves and sequences of one pool."""

    def __init__(
        self,
        pool_id: PoolId,
        num_blocks: int,
        block_size: int,
        seed: BlockHash,
        hasher: BlockHasher,
        policy: EvictionPolicy,
        events: EventLog,
        counters: PoolCounters,
    ) -> None:
        self.pool_id = pool_id
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.seed = seed  # h_{-1} of the pool's namespace
        self.counters = counters
        self.free = FreeBlocks(num_blocks)
        self.blocks: dict[BlockId, Block] = {}  # every committed block
        self.index: dict[BlockHash, Block] = {}  # the cached (findable) ones
        self.sequences: dict[SequenceId, Sequence] = {}
        self.leaves = EvictableLeaves(policy)
        self.num_evictable = 0
        self.num_referenced = 0
        self.num_pinned = 0
        self._hasher = hasher
        self._events = events
        self._tick = 0  # logical clock for recency

    # ------------------------------------------------------------ queries

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def load(self) -> float:
        """Share of blocks referenced (by sequences or pins), 0..1."""
        return self.num_referenced / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match(self, prompt: Prompt) -> list[Block]:
        """Verified hits of the prompt's leading full blocks; the first miss ends the walk.
        The hash walk finds the candidates (hashing each hit and the one miss); a
        candidate is a hit only when its parent is the previous hit (the same physical
        block) and its payload (tokens and mixed salt) is equal: an equal hash alone
        never decides. Cost per hit: a digest, a dict lookup and a payload comparison."""
        walk, lookup = self._hasher.walk, self.index.get
        # A new prompt misses at block 0: probing that block alone spares cutting the
        # whole prompt into blocks (bench.blockd_core, cold: 11 us for 256 blocks).
        if not walk(self.seed, prompt.payloads(self.block_size, limit=1), lookup):
            return []
        payloads = prompt.payloads(self.block_size)
        candidates: list[Block] = walk(self.seed, payloads, lookup)
        num_hits = 0
        parent: Block | None = None
        for block, payload in zip(candidates, payloads):
            if block.parent is not parent or block.payload != payload:
                break  # a collision: a miss, and the walk ends there
            parent = block
            num_hits += 1
        del candidates[num_hits:]
        return candidates

    # ------------------------------------------------------------ step ops

    def admit(self, sequence_id: SequenceId, prompt: Prompt) -> AdmitResult:
        """Reference the verified hits, then allocate the misses (evicting if needed),
        so the allocation can never evict a block this admission reuses. Without
        enough free + evictable blocks nothing changes and admitted is False."""
        num_tokens = prompt.num_tokens
        hits = self.match(prompt)
        num_missing = self.num_blocks_for(num_tokens) - len(hits)
        available = len(self.free) + self.num_evictable
        # Referencing an unreferenced hit takes it from the evictable blocks; count those
        # only when it can matter (a warm admission need not walk its hits twice).
        if available - len(hits) < num_missing and available - _num_unreferenced(hits) < num_missing:
            self.counters.num_admissions_deferred += 1
            return AdmitResult(sequence_id, False)
        num_revived = 0
        for block in hits:
            if not block.ref_count:
                num_revived += 1
            block.ref_count += 1
            block.num_hits += 1
        self.num_evictable -= num_revived
        self.num_referenced += num_revived
        block_ids = [block.block_id for block in hits]
        block_ids += self._allocate(num_missing)
        salt_block = prompt.salt_block(self.block_size)
        self.sequences[sequence_id] = Sequence(
            sequence_id, block_ids, hits, prompt.token_bytes, prompt.salt, salt_block
        )
        num_cached_tokens = len(hits) * self.block_size
        counters = self.counters
        counters.num_admissions += 1
        counters.queried_tokens += num_tokens
        counters.hit_tokens += num_cached_tokens
        return AdmitResult(sequence_id, True, tuple(block_ids), num_cached_tokens)

    def grow(self, sequence_id: SequenceId, num_tokens: int) -> GrowResult:
        sequence = self.sequences[sequence_id]
        num_missing = self.num_blocks_for(num_tokens) - len(sequence.block_ids)
        if num_missing <= 0:
            return GrowResult(sequence_id, True)
        if len(self.free) + self.num_evictable < num_missing:
            return GrowResult(sequence_id, False)
        new_block_ids = self._allocate(num_missing)
        sequence.block_ids.extend(new_block_ids)
        return GrowResult(sequence_id, True, tuple(new_block_ids))

    def commit(self, sequence_id: SequenceId, block_ids: list[BlockId], data: bytes) -> None:
        """Make the sequence's next uncommitted blocks findable (validated: they are the
        run from its first uncommitted block and `data` is exactly their tokens)."""
        sequence = self.sequences[sequence_id]
        committed = sequence.committed
        start = len(committed)
        assert block_ids == sequence.block_ids[start : start + len(block_ids)], "commit run"
        parent = committed[-1] if committed else None
        blocks = split_blocks(data, self.block_size)
        salt_index = sequence.salt_block - start if sequence.salt_block is not None else None
        payloads = block_payloads(blocks, sequence.salt, salt_index)
        hashes = self._hasher.walk(parent.block_hash if parent is not None else self.seed, payloads)
        committed += self._commit_run(parent, block_ids, hashes, blocks, payloads, sequence.salt, salt_index)
        known = sequence.token_bytes
        offset = start * block_width(self.block_size)
        sequence.token_bytes = known[:offset] + data + known[offset + len(data) :]

    def release(self, sequence_id: SequenceId) -> None:
        """Drop the sequence's references: committed blocks stay findable (evictable)
        once unreferenced, its own uncommitted blocks return to free. One tick stamps
        the whole chain, so a parent is never more recent than its child."""
        sequence = self.sequences.pop(sequence_id)
        self._tick += 1
        tick = self._tick
        num_idle = 0  # unreferenced now, cached, with cached children: evictable, not leaves
        for block in sequence.committed:
            block.ref_count -= 1
            if not block.ref_count:
                block.last_tick = tick
                if block.is_cached and block.num_cached_children:  # the common case, inlined
                    num_idle += 1
                else:
                    self._unreferenced(block, tick)
        self.num_evictable += num_idle
        self.num_referenced -= num_idle
        owned = sequence.block_ids[sequence.num_committed :]
        self.free.give_all(owned)
        self.num_referenced -= len(owned)

    # ------------------------------------------------------------ admin ops

    def flush(self, salt: str | None) -> tuple[int, int]:
        """Drop every unreferenced cached block (of chains carrying `salt` if given);
        answer (dropped, busy). Descendants of an unreferenced block are unreferenced
        and carry its salt, so no cached block is left without its parent."""
        matching = [b for b in self.index.values() if salt is None or b.chain_salt == salt]
        dropped = [b for b in matching if b.ref_count == 0]
        for block in dropped:
            _, leaf = self._drop_chain(block, 1, None)
            if leaf is not None:
                self.leaves.push(leaf)
        self.num_evictable -= len(dropped)
        self.free.give_all([block.block_id for block in dropped])
        for i in range(0, len(dropped), EVENT_CHUNK):
            chunk = dropped[i : i + EVENT_CHUNK]
            self._events.append(
                EventKind.REMOVED,
                self.pool_id,
                tuple(b.block_hash for b in chunk),
                tuple(b.block_id for b in chunk),
            )
        return len(dropped), len(matching) - len(dropped)

    def pin(self, blocks: list[Block]) -> None:
        """Hold a reference on cached blocks (a pinned prefix is never evicted)."""
        for block in blocks:
            assert block.is_cached and self.index.get(block.block_hash) is block, "pin a cached block"
            if block.ref_count == 0:
                self.num_evictable -= 1
                self.num_referenced += 1
            block.ref_count += 1
            block.pin_count += 1
            if block.pin_count == 1:
                self.num_pinned += 1

    def unpin(self, blocks: list[Block]) -> None:
        self._tick += 1
        for block in blocks:
            assert block.pin_count > 0, f"unpin of an unpinned block {block}"
            block.pin_count -= 1
            if block.pin_count == 0:
                self.num_pinned -= 1
            block.ref_count -= 1
            if block.ref_count == 0:
                self._unreferenced(block, self._tick)

    def resync(self, plans: list[ResyncPlan]) -> int:
        """Re-declare live sequences on an empty pool: reference their exact blocks and
        re-commit their full blocks (a block shared by several has identical content;
        validated). Answers how many blocks were indexed again."""
        assert not self.sequences and not self.blocks, "resync needs an empty pool"
        held = {block_id for plan in plans for block_id in plan.block_ids}
        self.free.reserve(held)
        self.num_referenced = len(held)
        num_stored = 0
        for plan in plans:
            prompt = plan.prompt
            blocks = prompt.blocks(self.block_size)
            payloads = prompt.payloads(self.block_size)
            hashes = self._hasher.walk(self.seed, payloads)
            table = plan.block_ids[: len(blocks)]
            # Validated: a block held by an earlier sequence is the same full block (so
            # it has the same hash), and such shared blocks form a prefix of the table.
            committed: list[Block] = []
            for block_id in table:
                shared = self.blocks.get(block_id)
                if shared is None:
                    break
                shared.ref_count += 1
                committed.append(shared)
            start = len(committed)
            salt_block = prompt.salt_block(self.block_size)
            salt_index = salt_block - start if salt_block is not None else None
            run = self._commit_run(
                committed[-1] if committed else None,
                table[start:],
                hashes[start:],
                blocks[start:],
                payloads[start:],
                prompt.salt,
                salt_index,
            )
            num_stored += sum(1 for block in run if block.is_cached)
            self.sequences[plan.sequence_id] = Sequence(
                plan.sequence_id,
                list(plan.block_ids),
                committed + run,
                prompt.token_bytes,
                prompt.salt,
                salt_block,
            )
        return num_stored

    # ------------------------------------------------------------ private helpers

    def _commit_run(
        self,
        parent: Block | None,
        block_ids: list[BlockId],
        hashes: list[BlockHash],
        blocks: list[bytes],
        payloads: list[bytes],
        salt: str,
        salt_index: int | None,
    ) -> list[Block]:
        """Records for a run of blocks its sequence has just written, parent to child
        (`salt_index` counts from the run's first block); answers them. A block is
        indexed unless an entry with its hash exists (an identical copy, or a collision)
        or its parent is not findable (it could never be reached by a walk), so the
        indexed blocks are a prefix of the run: one STORED event, cut from the inputs."""
        records = self.blocks
        index = self.index
        assert records.keys().isdisjoint(block_ids), "a block of the run is already committed"
        salts: list[str | None] = [None] * len(block_ids)
        if salt_index is not None and 0 <= salt_index < len(salts):
            salts[salt_index] = salt
        first_parent = parent
        indexing = parent is None or parent.is_cached
        num_stored = 0
        run: list[Block] = []
        append = run.append
        for block_id, block_hash, tokens, payload, mixed_salt in zip(
            block_ids, hashes, blocks, payloads, salts
        ):
            block = Block(block_id, block_hash, parent, tokens, mixed_salt, payload)
            records[block_id] = block
            if indexing:
                if block_hash in index:
                    indexing = False  # this block and its descendants stay unfindable
                else:
                    index[block_hash] = block
                    block.is_cached = True
                    if parent is not None:
                        parent.num_cached_children += 1
                    num_stored += 1
            append(block)
            parent = block
        if num_stored:
            self._events.append(
                EventKind.STORED,
                self.pool_id,
                tuple(hashes[:num_stored]),
                tuple(block_ids[:num_stored]),
                first_parent.block_hash if first_parent is not None else None,
                b"".join(blocks[:num_stored]),
            )
        return run

    def _allocate(self, num: int) -> list[BlockId]:
        """`num` blocks for a sequence: free ones first, then evicted leaves."""
        num_free = min(num, len(self.free))
        block_ids = self.free.take(num_free)
        if num > num_free:
            block_ids += self._evict(num - num_free)
        self.num_referenced += num
        return block_ids

    def _evict(self, num: int) -> list[BlockId]:
        """`num` evictable leaves, in the policy's order, each chain tail first."""
        leaves = self.leaves
        evicted: list[Block] = []
        while len(evicted) < num:
            block = leaves.pop()
            assert block is not None, "evictable count promised a leaf"
            dropped, leaf = self._drop_chain(block, num - len(evicted), leaves.first_priority())
            evicted += dropped
            if leaf is not None:
                leaves.push(leaf)
        self.num_evictable -= num
        self.counters.num_evictions += num
        block_ids = [block.block_id for block in evicted]
        self._events.append(
            EventKind.REMOVED, self.pool_id, tuple([b.block_hash for b in evicted]), tuple(block_ids)
        )
        return block_ids

    def _drop_chain(
        self, block: Block, limit: int, bar: tuple[int, ...] | None
    ) -> tuple[list[Block], Block | None]:
        """Drop an unreferenced cached block's index entry and record, then its parent
        while that is left an evictable leaf that the heap would answer next anyway (its
        priority is below `bar`, the heap's first; None: an empty heap), up to `limit`
        blocks. Answers the dropped blocks and the evictable leaf left behind, if any,
        for the caller to push. Under LRU a released chain shares one tick, so eviction
        takes a whole chain for one heap pop (bench.blockd_grpc: an admission there
        evicts a 128-block chain); a flush drops one block at a time (limit 1)."""
        index, records, priority = self.index, self.blocks, self.leaves.priority
        dropped: list[Block] = []
        while True:
            assert index.get(block.block_hash) is block, f"{block} is not indexed"
            del index[block.block_hash]
            del records[block.block_id]
            block.is_cached = False
            block.heap_key = None
            dropped.append(block)
            parent = block.parent
            if parent is None:
                return dropped, None
            parent.num_cached_children -= 1
            # `is_evictable_leaf`, inlined: this runs once per evicted block
            if not parent.is_cached or parent.ref_count or parent.num_cached_children:
                return dropped, None
            if len(dropped) == limit or (bar is not None and not priority(parent) < bar):
                return dropped, parent  # a pushed block loses ties, so only "below" is sure
            block = parent

    def _unreferenced(self, block: Block, tick: int) -> None:
        """A block's last reference is gone: cached ones become evictable, the others
        (never findable) are freed."""
        self.num_referenced -= 1
        block.last_tick = tick
        if block.is_cached:
            self.num_evictable += 1
            if block.num_cached_children == 0:
                self.leaves.push(block)
        else:
            del self.blocks[block.block_id]
            self.free.give_all([block.block_id])


def _num_unreferenced(blocks: list[Block]) -> int:
    return sum(1 for block in blocks if not block.ref_count)
