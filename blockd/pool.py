"""One worker's pool: the block mechanics behind admit, grow, commit and release.

Every block is in exactly one of three states, so at every moment

    free + evictable + referenced == num_blocks

- free: in `self.free`; nobody can find it.
- evictable: committed, cached (findable by hash), no references; it can be hit
  again or evicted (leaf first) when the pool runs out of free blocks.
- referenced: held by live sequences or pins. Only a sequence's own uncommitted
  blocks are ever written; a referenced block is never evicted or handed out.

With a host tier (`blockd.host_tier`), a block that leaves the device pool may stay
findable there: eviction demotes what is worth keeping (the worker copies its K/V out
before the device block is reused: `demotions`), an admission's walk goes on through
host-resident blocks and loads them into its own new device blocks (`AdmitResult.loads`),
and they become findable in the device pool when the sequence commits them, after the
copy (commit-after-write, for loads). The identity above holds per tier.

With a shared tier (`blockd.shared_tier`, one index per namespace, shared by its
pools), a committed block the admission rule accepts is written through: the Step
answer asks the worker to store it (`stores`), and it becomes findable there once the
worker reports the write done. An admission's walk goes on through shared records
after the device and host hits; they get fresh device blocks that the worker fetches
into (`AdmitResult.shared_loads`) and commits like loads.

Methods assume their arguments were validated (`blockd.validation`); they only
`assert` internal invariants, so a step that passed validation applies fully.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from blockd.allocator import FreeBlocks
from blockd.block import Block, Sequence
from blockd.events import EventKind, EventLog
from blockd.eviction import EvictableLeaves, EvictionPolicy, make_host_policy
from blockd.ghosts import FLUSH, NOT_STORED, GhostTable, Miss, MissReason, classify_miss
from blockd.hashing import BlockHasher, block_payloads, block_width, salt_tag, split_blocks
from blockd.host_tier import HostCounters, HostTier
from blockd.prompt import Prompt
from blockd.shared_tier import SharedCounters, SharedIndex, SharedRecord, make_identity, salt_digest_of
from blockd.sightings import Sightings
from blockd.types import (
    NO_HOST_TIER,
    AdmitResult,
    BlockHash,
    BlockId,
    CachePolicy,
    GrowResult,
    HostBlockId,
    HostSpec,
    PoolId,
    SequenceId,
    SharedBlock,
    Tier,
)

EVENT_CHUNK = 1024  # blocks per REMOVED event when a flush drops many


@dataclass
class PoolCounters:
    """Cumulative statistics; they survive resets so exported counters never go down."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    num_evictions: int = 0
    num_admissions: int = 0
    num_admissions_deferred: int = 0
    host: HostCounters = field(default_factory=HostCounters)
    shared: SharedCounters = field(default_factory=SharedCounters)
    # Uncached prompt tokens of admissions by `MissReason` value (blockd.ghosts).
    miss_tokens: dict[str, int] = field(default_factory=dict)


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
        host_spec: HostSpec = NO_HOST_TIER,
        demote_min_hits: int = 0,
        sightings: Sightings | None = None,
        keep_host_copies: bool = False,
        ghosts: GhostTable | None = None,
        shared: SharedIndex | None = None,
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
        self.host_spec = host_spec
        # its own policy instance: a stateful policy (adaptive, lfuda) learns from device evictions only
        host_policy = make_host_policy(policy)
        self.host = (
            HostTier(host_spec, block_size, host_policy, counters.host) if host_spec.num_blocks else None
        )
        # A block is demoted when it was seen more than this many times (0: always; 1:
        # seen twice), or when host-only children depend on it.
        self.demote_min_hits = demote_min_hits
        # Shared by every pool of the directory; None when the rule needs no count.
        self.sightings = sightings if demote_min_hits > 0 else None
        # Whether a loaded block keeps its host copy (a later eviction then needs no
        # copy) or gives it up (the tiers hold more distinct blocks together).
        self.keep_host_copies = keep_host_copies
        # Copies the worker owes before its next forward; the directory drains them
        # into each StepResult.
        self.demotions: list[tuple[BlockId, HostBlockId]] = []
        self._demoted: list[Block] = []  # for the DEMOTED event of the current op
        self._host_dropped: list[tuple[Block, HostBlockId]] = []  # for the host REMOVED event
        # Hashes that left the index (bounded; without one, nothing is remembered).
        self.ghosts = ghosts if ghosts is not None else GhostTable(0, lambda: 0.0)
        self.last_miss: Miss | None = None  # the last admission's classification
        # The namespace's shared tier index, when this pool's worker reaches the store.
        self.shared = shared if host_spec.has_shared_tier else None
        # Writes to the shared tier the worker owes; drained into each StepResult.
        self.stores: list[SharedBlock] = []

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

    def match_tiers(self, prompt: Prompt) -> tuple[list[Block], list[Block]]:
        """Verified hits in every tier: (device-cached hits, host-only hits after them).
        The device pool holds a prefix-closed set (a cached block's parent is cached),
        so once a hit is host-only, so is every later one. Same exactness as `match`:
        record identity of the parent and an equal payload, never the hash alone."""
        host = self.host
        if host is None:
            return self.match(prompt), []
        index, host_index = self.index, host.index

        def lookup(block_hash: BlockHash) -> Block | None:
            return index.get(block_hash) or host_index.get(block_hash)

        payloads = prompt.payloads(self.block_size)
        candidates: list[Block] = self._hasher.walk(self.seed, payloads, lookup)
        num_hits = num_device = 0
        parent: Block | None = None
        for block, payload in zip(candidates, payloads):
            if block.parent is not parent or block.payload != payload:
                break
            if block.is_cached:
                num_device += 1
            parent = block
            num_hits += 1
        assert all(not b.is_cached for b in candidates[num_device:num_hits]), "device set is prefix-closed"
        return candidates[:num_device], candidates[num_device:num_hits]

    # ------------------------------------------------------------ step ops

    def admit(
        self,
        sequence_id: SequenceId,
        prompt: Prompt,
        cache_policy: CachePolicy = CachePolicy.STORE,
        retention: int = 0,
    ) -> AdmitResult:
        """Reference the verified hits, then allocate the misses (evicting if needed),
        so the allocation can never evict a block this admission reuses. Without
        enough free + evictable blocks nothing changes and admitted is False.
        `cache_policy` NONE looks nothing up (no hits); READ_ONLY and NONE sequences
        never index their blocks (`commit`). `retention` is stamped at release."""
        num_tokens = prompt.num_tokens
        hits, host_hits = self.match_tiers(prompt) if cache_policy is not CachePolicy.NONE else ([], [])
        host = self.host
        not_loaded = False  # host hits left behind: loading them was estimated slower
        if host_hits and not host.pays_to_load:  # type: ignore[union-attr]
            host.counters.num_loads_skipped += 1  # type: ignore[union-attr]
            host_hits = []
            not_loaded = True
        shared_hits: list[SharedRecord] = []
        num_full = num_tokens // self.block_size
        # The shared walk goes on from the faster tiers' hits (their hashes are known:
        # one digest per block per admission), only when they leave full blocks uncached.
        if (
            self.shared is not None
            and cache_policy is not CachePolicy.NONE
            and len(hits) + len(host_hits) < num_full
        ):
            known = [block.block_hash for block in hits] + [block.block_hash for block in host_hits]
            chain = self.shared.match(prompt, self.block_size, known)
            self.shared.touch(chain)
            shared_hits = chain[len(hits) + len(host_hits) :]
            if shared_hits and not self.pays_to_fetch:
                self.counters.shared.num_loads_skipped += 1
                shared_hits = []
                not_loaded = True
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
        if self.sightings is not None:
            self.sightings.see([block.block_hash for block in hits + host_hits])
            self.sightings.see([record.block_hash for record in shared_hits])
            if self.shared is not None:  # a hit may make a block worth keeping in the store
                self._store([block for block in hits if self._times_seen(block) > self.demote_min_hits])
        for block in host_hits:  # held before allocating, so no demotion can evict them
            host.ref(block)  # type: ignore[union-attr]
        block_ids = [block.block_id for block in hits]
        block_ids += self._allocate(num_missing)
        self._emit_tier_events()
        salt_block = prompt.salt_block(self.block_size)
        sequence = Sequence(
            sequence_id, block_ids, hits, prompt.token_bytes, prompt.salt, salt_block, cache_policy, retention
        )
        self.sequences[sequence_id] = sequence
        loads: tuple[tuple[BlockId, HostBlockId], ...] = ()
        if host_hits:
            sequence.loading = host_hits
            first = len(hits)
            loads = tuple(
                (block_ids[first + i], block.host_block_id)  # type: ignore[misc]
                for i, block in enumerate(host_hits)
            )
            host.counters.num_loads += len(host_hits)  # type: ignore[union-attr]
            host.counters.hit_tokens += len(host_hits) * self.block_size  # type: ignore[union-attr]
        shared_loads: tuple[SharedBlock, ...] = ()
        if shared_hits:
            first = len(hits) + len(host_hits)
            shared_loads = tuple(
                SharedBlock(
                    block_ids[first + i],
                    record.block_hash,
                    record.parent_hash,
                    record.token_bytes,
                    record.salt_digest,
                    record.depth,
                )
                for i, record in enumerate(shared_hits)
            )
            self.counters.shared.num_loads += len(shared_hits)
            self.counters.shared.hit_tokens += len(shared_hits) * self.block_size
        num_cached_tokens = (len(hits) + len(host_hits) + len(shared_hits)) * self.block_size
        counters = self.counters
        counters.num_admissions += 1
        counters.queried_tokens += num_tokens
        counters.hit_tokens += num_cached_tokens
        if num_cached_tokens < num_tokens:
            miss = self.explain(prompt, hits + host_hits + shared_hits, cache_policy)  # type: ignore[operator]
            if not_loaded and miss.reason is not None:
                miss = Miss(
                    MissReason.NOT_LOADED, miss.num_tokens, miss.num_partial_tokens, miss.first_missing_block
                )
            self._count_miss(miss)
        return AdmitResult(sequence_id, True, tuple(block_ids), num_cached_tokens, loads, shared_loads)

    def grow(self, sequence_id: SequenceId, num_tokens: int) -> GrowResult:
        sequence = self.sequences[sequence_id]
        num_missing = self.num_blocks_for(num_tokens) - len(sequence.block_ids)
        if num_missing <= 0:
            return GrowResult(sequence_id, True)
        if len(self.free) + self.num_evictable < num_missing:
            return GrowResult(sequence_id, False)
        new_block_ids = self._allocate(num_missing)
        self._emit_tier_events()
        sequence.block_ids.extend(new_block_ids)
        return GrowResult(sequence_id, True, tuple(new_block_ids))

    def commit(self, sequence_id: SequenceId, block_ids: list[BlockId], data: bytes) -> None:
        """Make the sequence's next uncommitted blocks findable (validated: they are the
        run from its first uncommitted block and `data` is exactly their tokens), unless
        its cache_policy is not STORE: then they are recorded, never indexed, and freed
        on release like any unfindable block; the ghost table remembers them."""
        sequence = self.sequences[sequence_id]
        committed = sequence.committed
        start = len(committed)
        assert block_ids == sequence.block_ids[start : start + len(block_ids)], "commit run"
        parent = committed[-1] if committed else None
        blocks = split_blocks(data, self.block_size)
        if sequence.loading:  # these loads' copies are done: release their host blocks
            num_loaded = min(len(block_ids), len(sequence.loading))
            for record in sequence.loading[:num_loaded]:
                self.host.unref(record)  # type: ignore[union-attr]
            del sequence.loading[:num_loaded]
        salt_index = sequence.salt_block - start if sequence.salt_block is not None else None
        payloads = block_payloads(blocks, sequence.salt, salt_index)
        hashes = self._hasher.walk(parent.block_hash if parent is not None else self.seed, payloads)
        store = sequence.cache_policy is CachePolicy.STORE
        run = self._commit_run(parent, block_ids, hashes, blocks, payloads, sequence.salt, salt_index, store)
        committed += run
        if self.shared is not None and store:
            self._store([b for b in run if b.is_cached and self._times_seen(b) > self.demote_min_hits])
        known = sequence.token_bytes
        offset = start * block_width(self.block_size)
        sequence.token_bytes = known[:offset] + data + known[offset + len(data) :]

    def release(self, sequence_id: SequenceId) -> None:
        """Drop the sequence's references: committed blocks stay findable (evictable)
        once unreferenced, its own uncommitted blocks return to free. One tick stamps
        the whole chain, so a parent is never more recent than its child."""
        sequence = self.sequences.pop(sequence_id)
        for record in sequence.loading:  # loads never committed (cancelled or preempted)
            self.host.unref(record)  # type: ignore[union-attr]
        self._tick += 1
        tick = self._tick
        retention = sequence.retention
        if retention:  # the highest priority any user of a block asked for
            for block in sequence.committed:
                block.retention = max(block.retention, retention)
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

    def flush(self, salt: str | None, tiers: frozenset[Tier]) -> list[tuple[Tier, int, int]]:
        """Drop every unreferenced cached block (of chains carrying `salt` if given) of
        the given tiers; answer (tier, dropped, busy) per tier this pool has. Blocks go
        children first; descendants of an unreferenced block are unreferenced and carry
        its salt, so no findable block is left without its parent (a device-only flush
        keeps host copies findable, and drops host-only blocks whose parent it took)."""
        answer: list[tuple[Tier, int, int]] = []
        if self.host is not None and Tier.HOST in tiers:
            answer.append((Tier.HOST, *self._flush_host(salt)))
        if Tier.DEVICE in tiers:
            answer.append((Tier.DEVICE, *self._flush_device(salt)))
        return answer

    def _flush_device(self, salt: str | None) -> tuple[int, int]:
        matching = [b for b in self.index.values() if salt is None or b.chain_salt == salt]
        dropped = [b for b in matching if b.ref_count == 0]
        dropped.sort(key=_deepest_first)
        for block in dropped:
            _, leaf = self._drop_chain(block, 1, None)
            if leaf is not None:
                self.leaves.push(leaf)
            self._left_device(block)
        self.num_evictable -= len(dropped)
        self.ghosts.remember([(b.block_hash, b.num_seen + b.num_hits) for b in dropped], FLUSH)
        self.free.give_all([block.block_id for block in dropped])  # type: ignore[misc]
        for i in range(0, len(dropped), EVENT_CHUNK):
            chunk = dropped[i : i + EVENT_CHUNK]
            self._events.append(
                EventKind.REMOVED,
                self.pool_id,
                tuple(b.block_hash for b in chunk),
                tuple(b.block_id for b in chunk),  # type: ignore[misc]
            )
        self._emit_tier_events()
        return len(dropped), len(matching) - len(dropped)

    def _flush_host(self, salt: str | None) -> tuple[int, int]:
        host = self.host
        assert host is not None
        matching = [b for b in host.index.values() if salt is None or b.chain_salt == salt]
        idle = sorted((b for b in matching if b.host_refs == 0), key=_deepest_first)
        num_dropped = 0
        for block in idle:
            if block.num_host_children:  # a host-only child is being loaded: keep its parent
                continue
            self._drop_host_copy(block)
            num_dropped += 1
        self._emit_tier_events()
        return num_dropped, len(matching) - num_dropped

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
        store: bool = True,
    ) -> list[Block]:
        """Records for a run of blocks its sequence has just written, parent to child
        (`salt_index` counts from the run's first block); answers them. A block is
        indexed unless an entry with its hash exists (an identical copy, or a collision)
        or its parent is not findable (it could never be reached by a walk), or `store`
        is False (its request's cache_policy), so the indexed blocks are a prefix of
        the run: one STORED event, cut from the inputs. An indexed block gets back the
        uses the ghost table remembered for its hash."""
        records = self.blocks
        index = self.index
        host_index = self.host.index if self.host is not None else None
        assert records.keys().isdisjoint(block_ids), "a block of the run is already committed"
        salts: list[str | None] = [None] * len(block_ids)
        if salt_index is not None and 0 <= salt_index < len(salts):
            salts[salt_index] = salt
        first_parent = parent
        indexing = store and (parent is None or parent.is_cached)
        ghosts = self.ghosts
        num_stored = 0
        loaded: list[bool] = []  # per indexed block: an existing host record, now loaded
        run: list[Block] = []
        append = run.append
        for block_id, block_hash, tokens, payload, mixed_salt in zip(
            block_ids, hashes, blocks, payloads, salts
        ):
            kept = None
            if host_index is not None and indexing and block_hash not in index:
                kept = host_index.get(block_hash)
            if kept is not None and not kept.is_cached and kept.parent is parent and kept.payload == payload:
                # The content's host-only record (loaded, or recomputed beside it) gains
                # this device copy: one record per content block, its history kept.
                block = kept
                assert block.ref_count == 0, f"a host-only record is unreferenced: {block}"
                block.block_id = block_id
                block.ref_count = 1
                self.host.child_left(parent)  # type: ignore[union-attr]
            else:
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
                    loaded.append(block is kept)
                    if ghosts:  # a recomputed block gets back its uses (a loaded one kept them)
                        uses = ghosts.recall(block_hash)
                        if block is not kept:
                            block.num_seen += uses
                    if mixed_salt is not None:
                        ghosts.add_salted(self._salt_free_hash(block))
            append(block)
            parent = block
        if self.host is not None and not self.keep_host_copies:
            # Exclusive tiers: a loaded block lives in the device pool alone, so the two
            # tiers together hold more distinct blocks (bench.tiers: the replay's hit rate).
            for block, was_loaded in zip(reversed(run[:num_stored]), reversed(loaded)):
                if was_loaded and block.host_refs == 0 and block.num_host_children == 0:
                    self._drop_host_copy(block)
            self._emit_tier_events()
        if not store:
            ghosts.remember([(b.block_hash, 1) for b in run if b.block_hash not in index], NOT_STORED)
        if self.sightings is not None:  # computed here: seen once (a load was seen as a hit)
            self.sightings.see([hashes[i] for i in range(num_stored) if not loaded[i]])
        start = 0
        while start < num_stored:  # one STORED or LOADED event per run of either
            end = start + 1
            while end < num_stored and loaded[end] == loaded[start]:
                end += 1
            before = run[start - 1] if start else first_parent
            self._events.append(
                EventKind.LOADED if loaded[start] else EventKind.STORED,
                self.pool_id,
                tuple(hashes[start:end]),
                tuple(block_ids[start:end]),
                before.block_hash if before is not None else None,
                b"".join(blocks[start:end]),
            )
            start = end
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
            if self.host is not None:
                self._demote_chain(dropped)
        self.num_evictable -= num
        self.counters.num_evictions += num
        self.ghosts.remember([(b.block_hash, b.num_seen + b.num_hits) for b in evicted], leaves.policy.name)
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
        index, records, leaves = self.index, self.blocks, self.leaves
        dropped: list[Block] = []
        while True:
            assert index.get(block.block_hash) is block, f"{block} is not indexed"
            del index[block.block_hash]
            del records[block.block_id]
            block.is_cached = False
            block.heap_key = None
            dropped.append(block)
            if block.mixed_salt is not None:
                self.ghosts.drop_salted(self._salt_free_hash(block))
            parent = block.parent
            if parent is None:
                return dropped, None
            parent.num_cached_children -= 1
            # `is_evictable_leaf`, inlined: this runs once per evicted block
            if not parent.is_cached or parent.ref_count or parent.num_cached_children:
                return dropped, None
            if len(dropped) == limit or not leaves.takes_next(parent, bar):
                return dropped, parent  # a pushed block loses ties, so only "below" is sure
            block = parent

    # ------------------------------------------------------------ shared tier

    @property
    def pays_to_fetch(self) -> bool:
        """Whether fetching a block from the shared tier is estimated faster than
        recomputing it (unknown costs: fetch)."""
        fetch = self.host_spec.shared_load_seconds_per_block
        recompute = self.host_spec.prefill_seconds_per_token * self.block_size
        return fetch <= 0.0 or recompute <= 0.0 or fetch < recompute

    def _store(self, blocks: list[Block]) -> None:
        """Ask the worker to write these device-cached blocks (parent first) to the
        shared tier, unless the store holds them or a write of them is under way."""
        shared = self.shared
        assert shared is not None
        for block in blocks:
            if shared.is_known(block.block_hash):
                continue
            parent = block.parent
            digest = salt_digest_of(salt_tag(block.mixed_salt)) if block.mixed_salt is not None else None
            record = SharedRecord(
                block.block_hash,
                parent.block_hash if parent is not None else None,
                block.token_bytes,
                digest,
                block.depth,
            )
            parent_identity = None
            if parent is not None:
                parent_digest = (
                    salt_digest_of(salt_tag(parent.mixed_salt)) if parent.mixed_salt is not None else None
                )
                parent_identity = make_identity(parent.token_bytes, parent_digest)
            shared.add_pending(record, self.pool_id, parent_identity)
            self.stores.append(
                SharedBlock(
                    block.block_id,  # type: ignore[arg-type]
                    record.block_hash,
                    record.parent_hash,
                    record.token_bytes,
                    digest,
                    record.depth,
                )
            )

    # ------------------------------------------------------------ host tier

    def _left_device(self, block: Block) -> None:
        """`block` was just dropped from the device index without a copy (a flush): it
        stays findable if the host tier holds it; otherwise it is gone, and so are its
        host-only descendants."""
        if self.host is None:
            return
        if block.host_block_id is not None:
            self._now_host_only(block)
        elif block.num_host_children:
            self._drop_host_descendants(block)

    def _times_seen(self, block: Block) -> int:
        """Computed once plus hit since, fleet-wide when blockd counts sightings."""
        local = block.num_hits + 1
        return local if self.sightings is None else max(local, self.sightings.count(block.block_hash))

    def _now_host_only(self, block: Block) -> None:
        if block.parent is not None:
            block.parent.num_host_children += 1

    def _demote_chain(self, dropped: list[Block]) -> None:
        """Blocks one eviction just dropped from the device, child first (`_drop_chain`).

        1. Those the host tier holds turn host-only (no copy).
        2. Child first, decide who is worth a copy: hit often enough, or a host-only
           child (existing, or wanted in this chain) depends on it; unless another
           record holds its hash in the host tier (one record per hash).
        3. Every wanted block is counted as its parent's host-only child *before* any
           host block is taken, so making room never evicts a block whose child is
           about to be demoted (that child would be orphaned).
        4. Parent first, copy the wanted ones whose parent is still findable; a block
           that gets no copy is gone, and with it its host-only descendants."""
        host = self.host
        assert host is not None
        pending = []
        for block in dropped:
            if block.host_block_id is not None:
                self._now_host_only(block)
            else:
                pending.append(block)
        wanted: set[int] = set()
        parents_wanted: set[int] = set()
        for block in pending:  # child first
            if block.block_hash in host.index:
                continue
            if (
                self._times_seen(block) > self.demote_min_hits
                or block.num_host_children
                or id(block) in parents_wanted
            ):
                wanted.add(id(block))
                if block.parent is not None:
                    parents_wanted.add(id(block.parent))
        for block in pending:
            if id(block) in wanted:
                self._now_host_only(block)
        for block in reversed(pending):  # parent first
            if id(block) in wanted:
                parent = block.parent
                findable = parent is None or parent.is_cached or parent.host_block_id is not None
                host_block_id = self._take_host_block() if findable else None
                if host_block_id is not None:
                    host.place(block, host_block_id)
                    self.demotions.append((block.block_id, host_block_id))  # type: ignore[arg-type]
                    self._demoted.append(block)
                    host.counters.num_demotions += 1
                    continue
                host.child_left(parent)  # no copy after all
            if block.num_host_children:
                self._drop_host_descendants(block)

    def _take_host_block(self) -> HostBlockId | None:
        """A free host block, else the one of the host tier's first leaf (evicted)."""
        host = self.host
        assert host is not None
        if len(host.free):
            return host.free.take(1)[0]  # type: ignore[return-value]
        victim = host.leaves.pop()
        if victim is None:
            return None  # every host block is being loaded or holds a needed parent
        host.counters.num_evictions += 1
        return self._drop_host_copy(victim, give_back=False)

    def _drop_host_copy(
        self, block: Block, give_back: bool = True, pending_children: bool = False
    ) -> HostBlockId:
        """Drop `block`'s host copy (a host leaf, or a device-cached record): a host-only
        record leaves the directory. Answers the host block (freed if `give_back`)."""
        host = self.host
        assert host is not None
        host_block_id = host.remove(block)
        self._host_dropped.append((block, host_block_id))
        if not block.is_cached:
            # Only children of the eviction under way, not copied yet, may still count
            # (`_drop_host_descendants`): they will find their parent gone.
            assert pending_children or block.num_host_children == 0, (
                f"host-only {block} would orphan its children"
            )
            host.child_left(block.parent)
        if give_back:
            host.free.give([host_block_id])  # type: ignore[list-item]
        return host_block_id

    def _drop_host_descendants(self, root: Block) -> None:
        """Rare: `root` left every tier while host-only descendants remain (the host tier
        had no room for it, or a device-only flush took it). They could never be
        reached again: drop them, deepest first. O(host tier)."""
        host = self.host
        assert host is not None
        doomed = []
        for record in host.index.values():
            ancestor = record.parent
            while ancestor is not None and ancestor is not root and not ancestor.is_cached:
                ancestor = ancestor.parent
            if ancestor is root and not record.is_cached:
                doomed.append(record)
        for record in sorted(doomed, key=_deepest_first):
            assert record.host_refs == 0, "a load holds its parent chain, so root was not evictable"
            self._drop_host_copy(record, pending_children=True)
        # What may still count in root: children of the same eviction not copied yet,
        # which then find root gone and take their count back.

    def _emit_tier_events(self) -> None:
        """The DEMOTED and host REMOVED events of the op that just ran."""
        if self._host_dropped:
            dropped, self._host_dropped = self._host_dropped, []
            self._events.append(
                EventKind.REMOVED,
                self.pool_id,
                tuple(b.block_hash for b, _ in dropped),
                tuple(h for _, h in dropped),  # type: ignore[misc]
                tier=Tier.HOST,
            )
        if self._demoted:
            demoted, self._demoted = self._demoted, []
            self._events.append(
                EventKind.DEMOTED,
                self.pool_id,
                tuple(b.block_hash for b in demoted),
                tuple(b.host_block_id for b in demoted),  # type: ignore[misc]
                tier=Tier.HOST,
            )

    def explain(
        self, prompt: Prompt, hits: list[Block], cache_policy: CachePolicy = CachePolicy.STORE
    ) -> Miss:
        """Why the prompt's tokens after `hits` (its verified hits) are not cached."""
        if cache_policy is CachePolicy.NONE:
            num_tokens = prompt.num_tokens
            return Miss(MissReason.BYPASSED, num_tokens, 0, 0)
        return classify_miss(prompt, self.block_size, hits, self.seed, self._hasher, self.index, self.ghosts)

    def _count_miss(self, miss: Miss) -> None:
        self.last_miss = miss
        tokens = self.counters.miss_tokens
        if miss.reason is not None and miss.num_tokens:
            tokens[miss.reason.value] = tokens.get(miss.reason.value, 0) + miss.num_tokens
        if miss.num_partial_tokens:
            key = MissReason.PARTIAL_BLOCK.value
            tokens[key] = tokens.get(key, 0) + miss.num_partial_tokens

    def _salt_free_hash(self, block: Block) -> BlockHash:
        """The hash the block would have without its salt (for OTHER_SALT misses)."""
        parent = block.parent
        return self._hasher.walk(parent.block_hash if parent is not None else self.seed, [block.token_bytes])[
            0
        ]

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


def _deepest_first(block: Block) -> int:
    return -block.depth


def _num_unreferenced(blocks: list[Block]) -> int:
    return sum(1 for block in blocks if not block.ref_count)
