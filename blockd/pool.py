"""One worker's pool: the block mechanics behind admit, grow, commit and release.

Every block is in exactly one of three states, so at every moment

    free + evictable + referenced == num_blocks

- free: in `self.free`; nobody can find it.
- evictable: committed, cached (findable by hash), no references; it can be hit
  again or evicted (leaf first) when the pool runs out of free blocks.
- referenced: held by live sequences or pins. Only a sequence's own uncommitted
  blocks are ever written; a referenced block is never evicted or handed out.

Below the device blocks, `lower_tiers` (`blockd.tiers`: the host tier, then the
shared tier, each behind one protocol, chosen by the registry) hold what may stay
findable when it leaves the device: an admission walks them in order after the
device hits, eviction hands its victims to the tier that takes demotions, commits
and releases end their loads, and a Step answers the work the worker owes them as
one returned object (`step`). The identity above holds per tier. The pool never
asks which tiers exist: it walks the list.

Methods assume their arguments were validated (`blockd.validation`); they only
`assert` internal invariants, so a step that passed validation applies fully.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from blockd.allocator import FreeBlocks
from blockd.block import Block, Hashed, Sequence
from blockd.events import EventKind, EventLog
from blockd.eviction import EvictableLeaves, EvictionPolicy, GatedPolicy, Priority, SimulatedPolicy, admits
from blockd.ghosts import FLUSH, NOT_STORED, GhostTable, Miss, MissReason, classify_miss
from blockd.hashing import BlockHasher, block_payloads, block_width, split_blocks
from blockd.host_tier import HostCounters, HostTier
from blockd.prompt import Prompt
from blockd.shared_tier import SharedCounters, SharedIndex
from blockd.sightings import Sightings
from blockd.tiers.base import NO_REPORTS, NO_WORK, LowerTier, TierReports, TierSetup
from blockd.tiers.registry import make_lower_tiers
from blockd.types import (
    NO_HOST_TIER,
    AdmitResult,
    BlockHash,
    BlockId,
    CachePolicy,
    GrowResult,
    HostSpec,
    PoolId,
    SequenceId,
    StepResult,
    Tier,
)

if TYPE_CHECKING:
    from blockd.validation import StepPlan

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


class WorthKeeping:
    """The admission rule of demotion and write-through: seen more than `min_hits` times
    (computed once plus hit since, fleet-wide when blockd counts sightings), and admitted
    by the eviction policy's gate when it has one (issue 44: the device, host and shared
    tiers decide with the same gate; a block on probation is demoted or written once a
    hit admits it)."""

    def __init__(self, min_hits: int, sightings: Sightings | None, policy: EvictionPolicy) -> None:
        self.min_hits = min_hits
        self.sightings = sightings
        self.policy = policy

    def __call__(self, block: Block) -> bool:
        local = block.num_hits + 1
        seen = local if self.sightings is None else max(local, self.sightings.count(block.block_hash))
        return seen > self.min_hits and admits(self.policy, block)


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
        # A block is demoted (or written through) when it was seen more than this many
        # times (0: always; 1: seen twice), or when host-only children depend on it.
        self.demote_min_hits = demote_min_hits
        # Shared by every pool of the directory; None when the rule needs no count.
        self.sightings = sightings if demote_min_hits > 0 else None
        # Hashes that left the index (bounded; without one, nothing is remembered).
        self.ghosts = ghosts if ghosts is not None else GhostTable(0, lambda: 0.0)
        self.last_miss: Miss | None = None  # the last admission's classification
        # Not a bound method of the pool: the tiers hold it, and a cycle through the pool
        # would outlive blockd's young collections (blockd.server._tune_gc).
        self._worth_keeping = WorthKeeping(demote_min_hits, self.sightings, policy)
        setup = TierSetup(
            pool_id,
            block_size,
            seed,
            hasher,
            events,
            counters,
            host_spec,
            self.index,
            policy,
            self._worth_keeping,
            keep_host_copies,
            shared,
        )
        # Faster first: the order an admission walks them (`blockd.tiers.registry`).
        self.lower_tiers: list[LowerTier] = make_lower_tiers(setup)
        self._gated = isinstance(self.leaves.policy, GatedPolicy)
        self._simulates = isinstance(self.leaves.policy, SimulatedPolicy)
        tiers = self.lower_tiers
        # The tier that takes the device's eviction victims, and the one whose records
        # a commit may adopt (the pool's own `Block`s); None without one.
        self._demote = next((t.demote for t in tiers if t.takes_demotions), None)
        holders = [t for t in tiers if t.holds_records]
        assert len(holders) <= 1, "one tier holds the pool's records"
        self._record_tier: LowerTier | None = holders[0] if holders else None
        # Read-only views for operator queries, stats and tests.
        self.host: HostTier | None = next(
            (getattr(t, "store", None) for t in tiers if t.tier is Tier.HOST), None
        )
        self.shared: SharedIndex | None = next(
            (getattr(t, "index", None) for t in tiers if t.tier is Tier.SHARED), None
        )

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
        """Verified hits of the device pool and of the tier holding the pool's records
        after them (the host tier): (device-cached hits, host-only hits)."""
        hits = self.match(prompt)
        tier = self._record_tier
        return hits, tier.match(prompt, hits) if tier is not None else []

    # ------------------------------------------------------------ step ops

    def step(self, plan: StepPlan, reports: TierReports = NO_REPORTS) -> StepResult:
        """Apply a validated Step: the worker's reports of earlier tier work first, then
        commits, releases, grows and admits in that order. The answer is one returned
        object: the ops' results and the work the lower tiers ask of the worker before
        its next forward (their demotions to copy, their writes)."""
        tiers = self.lower_tiers
        if reports is not NO_REPORTS:
            for tier in tiers:
                tier.reports(reports)
        for sequence_id, block_ids, data in plan.commits:
            self.commit(sequence_id, block_ids, data)
        for sequence_id in plan.releases:
            self.release(sequence_id)
        grown = tuple(self.grow(sequence_id, num_tokens) for sequence_id, num_tokens in plan.grows)
        admitted = tuple(self.admit(*admit) for admit in plan.admits)
        self.leaves.compact(self.num_evictable)
        work = NO_WORK
        for tier in tiers:
            tier_work = tier.end_step()
            if tier_work is not NO_WORK:
                work = tier_work if work is NO_WORK else work + tier_work
        return StepResult(
            grown,
            admitted,
            self.num_free,
            self.num_evictable,
            work.demotions,
            work.shared_stores,
            work.shared_orphans,
        )

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
        hits = self.match(prompt) if cache_policy is not CachePolicy.NONE else []
        not_loaded = False  # lower tier hits left behind: loading them was estimated slower
        # Each lower tier in order goes on from the hits kept so far (their hashes are
        # known: one digest per block per admission), while full blocks are uncached.
        found: list[tuple[LowerTier, list[Any]]] = []
        kept: list[Any] = hits
        if self.lower_tiers and cache_policy is not CachePolicy.NONE:
            num_full = num_tokens // self.block_size
            for tier in self.lower_tiers:
                if len(kept) >= num_full:
                    break
                tier_hits = tier.match(prompt, kept)
                if tier_hits and not tier.pays_to_load:
                    tier.count_skipped()
                    tier_hits = []
                    not_loaded = True
                if tier_hits:
                    found.append((tier, tier_hits))
                    kept = kept + tier_hits
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
            self._see_hits(hits, found)
        elif self._gated and hits:  # a hit may admit a block the gate held back at commit
            for tier in self.lower_tiers:
                tier.hits_seen(hits)
        for tier, tier_hits in found:  # held before allocating, so no demotion can evict them
            tier.reserve(tier_hits)
        # a device-resident block's id is never None (Block.block_id): no per-block cast
        block_ids: list[BlockId] = [block.block_id for block in hits]  # type: ignore[misc]
        block_ids += self._allocate(num_missing)
        self._end_op()
        salt_block = prompt.salt_block(self.block_size)
        sequence = Sequence(
            sequence_id,
            block_ids,
            hits,
            prompt.token_bytes,
            prompt.salt,
            salt_block,
            cache_policy,
            retention,
            max(0, num_tokens // self.block_size - len(kept)),  # the run its commits stamp
            # the walk cut a warm prompt already (Prompt caches it); a salted block's payload
            # is not its tokens, so salted prompts are cut at commit
            prompt.payloads(self.block_size) if salt_block is None else None,
        )
        self.sequences[sequence_id] = sequence
        num_cached_tokens = len(kept) * self.block_size
        counters = self.counters
        counters.num_admissions += 1
        counters.queried_tokens += num_tokens
        counters.hit_tokens += num_cached_tokens
        if num_cached_tokens < num_tokens:
            miss = self.explain(prompt, kept, cache_policy)
            if not_loaded and miss.reason is not None:
                miss = Miss(
                    MissReason.NOT_LOADED, miss.num_tokens, miss.num_partial_tokens, miss.first_missing_block
                )
            self._count_miss(miss)
        if not found:
            return AdmitResult(sequence_id, True, tuple(block_ids), num_cached_tokens)
        answers: dict[str, tuple] = {}
        first = len(hits)
        for tier, tier_hits in found:  # each tier's loads fill its field, in table order
            last = first + len(tier_hits)
            field_name = tier.admit_field
            answers[field_name] = answers.get(field_name, ()) + tier.loads(
                block_ids[first:last], tier_hits, sequence
            )
            first = last
        return AdmitResult(sequence_id, True, tuple(block_ids), num_cached_tokens, **answers)

    def grow(self, sequence_id: SequenceId, num_tokens: int) -> GrowResult:
        sequence = self.sequences[sequence_id]
        num_missing = self.num_blocks_for(num_tokens) - len(sequence.block_ids)
        if num_missing <= 0:
            return GrowResult(sequence_id, True)
        if len(self.free) + self.num_evictable < num_missing:
            return GrowResult(sequence_id, False)
        new_block_ids = self._allocate(num_missing)
        self._end_op()
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
        for tier in self.lower_tiers:  # these blocks' loads are done
            tier.loads_done(sequence, len(block_ids))
        salt_index = sequence.salt_block - start if sequence.salt_block is not None else None
        prompt_blocks = sequence.prompt_blocks
        end = start + len(block_ids)
        if prompt_blocks is not None and end <= len(prompt_blocks):
            # inside the prompt `data` are its tokens (validated), cut at admission
            blocks = payloads = prompt_blocks[start:end]
        else:
            blocks = split_blocks(data, self.block_size)
            payloads = block_payloads(blocks, sequence.salt, salt_index)
        hashes = self._hasher.walk(parent.block_hash if parent is not None else self.seed, payloads)
        store = sequence.cache_policy is CachePolicy.STORE
        run = self._commit_run(
            parent, block_ids, hashes, blocks, payloads, sequence.salt, salt_index, store, sequence.run_length
        )
        committed += run
        if store:
            for tier in self.lower_tiers:
                tier.committed(run)
        known = sequence.token_bytes
        offset = start * block_width(self.block_size)
        if offset + len(data) > len(known):  # inside them, `data` are those tokens (validated)
            sequence.token_bytes = known[:offset] + data + known[offset + len(data) :]

    def release(self, sequence_id: SequenceId) -> None:
        """Drop the sequence's references: committed blocks stay findable (evictable)
        once unreferenced, its own uncommitted blocks return to free. One tick stamps
        the whole chain, so a parent is never more recent than its child."""
        sequence = self.sequences.pop(sequence_id)
        for tier in self.lower_tiers:  # loads never committed (cancelled or preempted) end
            tier.released(sequence)
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
        # adaptive-sim simulates its candidates on what was used (once under pressure)
        if (
            self._simulates
            and self.counters.num_evictions
            and self.leaves.policy.observe(  # type: ignore[attr-defined]
                sequence.committed, tick, self.num_blocks
            )
        ):
            self.leaves.rekey()
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
        for tier in self.lower_tiers:
            if tier.tier in tiers:
                counts = tier.flush(salt)
                if counts is not None:  # None: not one pool's to flush (the shared tier)
                    answer.append((tier.tier, *counts))
        if Tier.DEVICE in tiers:
            answer.append((Tier.DEVICE, *self._flush_device(salt)))
        return answer

    def _flush_device(self, salt: str | None) -> tuple[int, int]:
        matching = [b for b in self.index.values() if salt is None or b.chain_salt == salt]
        dropped = [b for b in matching if b.ref_count == 0]
        dropped.sort(key=_deepest_first)
        for block in dropped:
            _, leaf, priority = self._drop_chain(block, 1, None)
            if leaf is not None:
                self.leaves.push(leaf, priority)
            for tier in self.lower_tiers:
                tier.left_device(block)
        self.num_evictable -= len(dropped)
        self.ghosts.remember_blocks(dropped, FLUSH)
        self.free.give_all([block.block_id for block in dropped])  # type: ignore[misc]
        for i in range(0, len(dropped), EVENT_CHUNK):
            chunk = dropped[i : i + EVENT_CHUNK]
            self._events.append(
                EventKind.REMOVED,
                self.pool_id,
                tuple(b.block_hash for b in chunk),
                tuple(b.block_id for b in chunk),  # type: ignore[misc]
            )
        self._end_op()
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
        store: bool = True,
        run_length: int = 0,
    ) -> list[Block]:
        """Records for a run of blocks its sequence has just written, parent to child
        (`salt_index` counts from the run's first block); answers them. A block is
        indexed unless an entry with its hash exists (an identical copy, or a collision)
        or its parent is not findable (it could never be reached by a walk), or `store`
        is False (its request's cache_policy), so the indexed blocks are a prefix of
        the run: one STORED event, cut from the inputs. An indexed block gets back the
        uses the ghost table remembered for its hash. A new record is stamped with
        `run_length` (its sequence's, at admission; 0 for a resync); an adopted host
        record keeps the run it was computed in."""
        index = self.index
        salts: list[str | None] = [None] * len(block_ids)
        if salt_index is not None and 0 <= salt_index < len(salts):
            salts[salt_index] = salt
        else:
            salt_index = None  # the run holds no salted block
        first_parent = parent
        indexing = store and (parent is None or parent.is_cached)
        ghosts = self.ghosts
        run: list[Block] = []
        if not indexing or (
            self._record_tier is None and len(set(hashes)) == len(hashes) and index.keys().isdisjoint(hashes)
        ):
            num_stored = self._new_run(
                run, parent, block_ids, hashes, blocks, payloads, salts, salt_index, indexing, run_length
            )
            loaded = [False] * num_stored  # per indexed block: an existing host record, now loaded
        else:
            loaded = self._run_by_block(
                run, parent, block_ids, hashes, blocks, payloads, salts, indexing, run_length
            )
            num_stored = len(loaded)
        for tier in self.lower_tiers:
            tier.run_committed(run, loaded)
        if not store:
            ghosts.remember(
                [(b.block_hash, 1, run_length) for b in run if b.block_hash not in index], NOT_STORED
            )
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

    def _new_run(
        self,
        run: list[Block],
        parent: Block | None,
        block_ids: list[BlockId],
        hashes: list[BlockHash],
        blocks: list[bytes],
        payloads: list[bytes],
        salts: list[str | None],
        salt_index: int | None,
        indexing: bool,
        run_length: int,
    ) -> int:
        """`_commit_run`'s common case: no tier holds records to adopt, and the whole run
        is indexed (`indexing`: no entry with any of its hashes, none twice in it) or
        none of it. Each block is made in one call with its final state and the dicts
        are updated in bulk: a commit of bench.blockd_inprocess indexes 128 new blocks.
        `salt_index`: the salted block of the run, if any. Appends the records to `run`;
        answers how many were indexed."""
        num = len(block_ids)
        # indexed: each block's one cached child is the next of the run
        children = [1] * num if indexing else [0] * num
        ghosts = self.ghosts
        if num and indexing:
            children[-1] = 0
            # its commit, plus the uses the ghost table remembers (a pool that never
            # evicted has nothing to recall: decided once per run)
            seen = [1 + uses for uses in _recall_all(ghosts, hashes)] if ghosts else [1] * num
        else:
            seen = [1] * num
        append = run.append
        for block_id, block_hash, tokens, payload, mixed_salt, num_children, num_seen in zip(
            block_ids, hashes, blocks, payloads, salts, children, seen
        ):
            parent = Block(
                block_id,
                block_hash,
                parent,
                tokens,
                mixed_salt,
                payload,
                run_length,
                indexing,
                num_children,
                num_seen,
            )
            append(parent)
        records = self.blocks
        num_records = len(records)
        records.update(zip(block_ids, run))
        assert len(records) == num_records + num, "a block of the run is already committed"
        if not indexing or not num:
            return 0
        self.index.update(zip(hashes, run))
        first_parent = run[0].parent
        if first_parent is not None:
            first_parent.num_cached_children += 1
        if salt_index is not None:  # the one salted block of the run (`salts`)
            ghosts.add_salted(self._salt_free_hash(run[salt_index]))
        return num

    def _run_by_block(
        self,
        run: list[Block],
        parent: Block | None,
        block_ids: list[BlockId],
        hashes: list[BlockHash],
        blocks: list[bytes],
        payloads: list[bytes],
        salts: list[str | None],
        indexing: bool,
        run_length: int,
    ) -> list[bool]:
        """`_commit_run` block by block: a block may adopt the host tier's record of its
        content, and indexing stops at the first hash with an entry. Appends the records
        to `run`; answers, per indexed block, whether it adopted a loaded record."""
        records, index, ghosts = self.blocks, self.index, self.ghosts
        assert records.keys().isdisjoint(block_ids), "a block of the run is already committed"
        record_tier = self._record_tier
        find_record = record_tier.find_record if record_tier is not None else None
        # A pool that never evicted has nothing to recall (and a recall cannot make a
        # ghost table answer anything new): decided once per run, not per block.
        recall = ghosts.recall if ghosts else None
        loaded: list[bool] = []
        append = run.append
        for block_id, block_hash, tokens, payload, mixed_salt in zip(
            block_ids, hashes, blocks, payloads, salts
        ):
            kept = None
            if find_record is not None and indexing and block_hash not in index:
                kept = find_record(block_hash)
            if kept is not None and not kept.is_cached and kept.parent is parent and kept.payload == payload:
                # The content's host-only record (loaded, or recomputed beside it) gains
                # this device copy: one record per content block, its history kept.
                block = kept
                assert block.ref_count == 0, f"a host-only record is unreferenced: {block}"
                block.block_id = block_id
                block.ref_count = 1
                record_tier.adopt(block, parent)  # type: ignore[union-attr]
            else:
                block = Block(block_id, block_hash, parent, tokens, mixed_salt, payload, run_length)
            records[block_id] = block
            if indexing:
                if block_hash in index:
                    indexing = False  # this block and its descendants stay unfindable
                else:
                    index[block_hash] = block
                    block.is_cached = True
                    if parent is not None:
                        parent.num_cached_children += 1
                    loaded.append(block is kept)
                    if recall is not None:  # a recomputed block gets back its uses (a loaded one kept them)
                        uses = recall(block_hash)
                        if block is not kept:
                            block.num_seen += uses
                    if mixed_salt is not None:
                        ghosts.add_salted(self._salt_free_hash(block))
            append(block)
            parent = block
        return loaded

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
        leaves, demote = self.leaves, self._demote
        evicted: list[Block] = []
        while len(evicted) < num:
            entry = leaves.pop_entry()
            assert entry is not None, "evictable count promised a leaf"
            priority, block = entry
            dropped, leaf, leaf_priority = self._drop_chain(
                block, num - len(evicted), leaves.first_priority(), priority
            )
            evicted += dropped
            if leaf is not None:
                leaves.push(leaf, leaf_priority)
            if demote is not None:
                demote(dropped)
        self.num_evictable -= num
        self.counters.num_evictions += num
        self.ghosts.remember_blocks(evicted, leaves.policy.name)
        block_ids: list[BlockId] = [block.block_id for block in evicted]  # type: ignore[misc]
        self._events.append(
            EventKind.REMOVED, self.pool_id, tuple([b.block_hash for b in evicted]), tuple(block_ids)
        )
        return block_ids

    def _drop_chain(
        self, block: Block, limit: int, bar: Priority | None, priority: Priority | None = None
    ) -> tuple[list[Block], Block | None, Priority | None]:
        """Drop an unreferenced cached block's index entry and record, then its parent
        while that is left an evictable leaf that the heap would answer next anyway (its
        priority is below `bar`, the heap's first; None: an empty heap), up to `limit`
        blocks. Answers the dropped blocks and the evictable leaf left behind, if any,
        with its priority, for the caller to push.

        A parent released with its child (same tick, uses, retention and run length: all
        a policy may rank by, `EvictionPolicy`) takes the child's `priority` (the one its heap
        entry was pushed with) instead of a fresh one: the chain was released as one,
        and a fresh priority drifts with the policy's state, so interleaved chains of
        one Step broke after a few blocks each (bench.blockd_grpc: 17.7 heap pops and
        128 priorities per 128-block eviction, takes_next ~20% of blockd's time in
        process; now one priority per chain). A flush drops one block at a time (limit 1)."""
        index, records, leaves = self.index, self.blocks, self.leaves
        rank = leaves.priority
        dropped: list[Block] = []
        below = False  # `priority` was found below `bar` (it stays so while inherited)
        # Parents counted evicted with the inherited `priority` but not yet told to the
        # policy: told in one call before anything reads the policy's state (a fresh
        # priority) and at the end (`_count_evicted`).
        pending = 0
        while True:
            indexed = index.pop(block.block_hash, None)
            assert indexed is block, f"{block} is not indexed"
            del records[block.block_id]  # type: ignore[arg-type]
            block.is_cached = False
            block.heap_key = None
            dropped.append(block)
            if block.mixed_salt is not None:
                self.ghosts.drop_salted(self._salt_free_hash(block))
            parent = block.parent
            if parent is None:
                break
            parent.num_cached_children -= 1
            # `is_evictable_leaf`, inlined: this runs once per evicted block
            if not parent.is_cached or parent.ref_count or parent.num_cached_children:
                break
            if (
                priority is None
                or parent.last_tick != block.last_tick
                or parent.num_hits != block.num_hits
                or parent.num_seen != block.num_seen
                or parent.retention != block.retention
                or parent.run_length != block.run_length
            ):
                if pending:
                    _count_evicted(leaves.policy, priority, pending)  # type: ignore[arg-type]
                    pending = 0
                priority = rank(parent)
                below = False
            if len(dropped) == limit:
                if pending:
                    _count_evicted(leaves.policy, priority, pending)
                return dropped, parent, priority
            if below:  # an inherited priority against the same bar: `takes_next`'s answer again
                pending += 1
            elif leaves.takes_next(priority, bar):
                below = True
            else:
                if pending:
                    _count_evicted(leaves.policy, priority, pending)
                return dropped, parent, priority  # a pushed block loses ties: only "below" is sure
            block = parent
        if pending:
            _count_evicted(leaves.policy, priority, pending)  # type: ignore[arg-type]
        return dropped, None, None

    # ------------------------------------------------------------ lower tiers

    def _see_hits(self, hits: list[Block], found: list[tuple[LowerTier, list[Any]]]) -> None:
        """An admission's hits are sightings: the pool's records (device, then the tier
        holding records) at once, then each other tier's; a device hit may now be
        worth keeping in a lower tier."""
        sightings = self.sightings
        assert sightings is not None
        seen = [block.block_hash for block in hits]
        others = []
        for tier, tier_hits in found:
            if tier.holds_records:
                seen += [block.block_hash for block in tier_hits]
            else:
                others.append(tier_hits)
        sightings.see(seen)
        for tier_hits in others:
            sightings.see([record.block_hash for record in tier_hits])
        for tier in self.lower_tiers:
            tier.hits_seen(hits)

    def _end_op(self) -> None:
        """One op ended: each lower tier appends the events it caused (after the
        device's own)."""
        for tier in self.lower_tiers:
            tier.end_op()

    def explain(
        self, prompt: Prompt, hits: Seq[Hashed], cache_policy: CachePolicy = CachePolicy.STORE
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
            block_id = block.block_id
            assert block_id is not None, f"{block} is a device block"
            del self.blocks[block_id]
            self.free.give_all([block_id])


def _recall_all(ghosts: GhostTable, hashes: list[BlockHash]) -> list[int]:
    """`ghosts.recall` of each hash, in order, in one call. bench.blockd_inprocess under
    callgrind: ~2% fewer instructions per admission than one recall per block."""
    return ghosts.recall_many(hashes)


def _count_evicted(policy: EvictionPolicy, priority: Priority, num: int) -> None:
    """Tell the policy `num` victims of one priority in one call (`evicted_many`, equal to
    `evicted` called `num` times). bench.blockd_inprocess under callgrind: ~12% fewer
    instructions per admission than one call per victim."""
    policy.evicted_many(priority, num)


def _deepest_first(block: Block) -> int:
    return -block.depth


def _num_unreferenced(blocks: list[Block]) -> int:
    return sum(1 for block in blocks if not block.ref_count)
