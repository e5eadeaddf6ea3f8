"""The host tier behind the lower-tier protocol: demotion on device eviction, loads
into the admitted sequence's device blocks, one record per content block.

The records are the pool's own `Block`s (`holds_records`): a block that leaves the
device may stay findable here (its worker copies the K/V out before the device block
is reused: `TierWork.demotions`), an admission's walk goes on through host-resident
blocks and loads them (`AdmitResult.loads`), and they become findable in the device
pool when the sequence commits them, after the copy (commit-after-write). The
residency and accounting of the host blocks themselves are `blockd.host_tier`'s;
the identity `free + evictable + referenced == num_blocks` holds here too.
"""

from __future__ import annotations

from typing import ClassVar

from blockd.block import Block, Sequence
from blockd.events import EventKind
from blockd.eviction import make_host_policy
from blockd.host_tier import HostTier
from blockd.prompt import Prompt
from blockd.tiers.base import NO_WORK, LowerTier, TierSetup, TierWork
from blockd.types import BlockHash, BlockId, HostBlockId, Tier


class HostLevel(LowerTier):
    """A pool's host tier: `store` holds the host blocks; this object moves blocks
    between it and the device pool."""

    tier: ClassVar[Tier] = Tier.HOST
    admit_field: ClassVar[str] = "loads"
    holds_records: ClassVar[bool] = True
    takes_demotions: ClassVar[bool] = True

    def __init__(self, setup: TierSetup) -> None:
        # its own policy instance: a stateful policy (adaptive, lfuda) learns from device evictions only
        policy = make_host_policy(setup.device_policy)
        self.store = HostTier(setup.spec, setup.block_size, policy, setup.counters.host)
        self.counters = self.store.counters
        self.pool_id = setup.pool_id
        self.block_size = setup.block_size
        self.seed = setup.seed
        self._hasher = setup.hasher
        self._events = setup.events
        self._device_index = setup.device_index
        self._worth_keeping = setup.worth_keeping
        # Whether a loaded block keeps its host copy (a later eviction then needs no
        # copy) or gives it up (the tiers hold more distinct blocks together).
        self.keep_host_copies = setup.keep_host_copies
        self.find_record = self.store.index.get  # type: ignore[method-assign]
        self._demotions: list[tuple[BlockId, HostBlockId]] = []  # the Step's, for TierWork
        self._demoted: list[Block] = []  # for the DEMOTED event of the current op
        self._dropped: list[tuple[Block, HostBlockId]] = []  # for the host REMOVED event

    # ------------------------------------------------------------ admission

    def match(self, prompt: Prompt, hits: list[Block]) -> list[Block]:
        """Host-only records continuing the device hits. The device pool holds a
        prefix-closed set (a cached block's parent is cached), so once a hit is
        host-only, so is every later one; a hash the device indexes ends the walk (the
        device's record was the candidate there). Same exactness as the device's
        match: the parent's record identity and an equal payload, never the hash."""
        parent: Block | None = hits[-1] if hits else None
        payloads = prompt.payloads(self.block_size)[len(hits) :]
        if not payloads or not self.store.index:
            return []
        device, host = self._device_index, self.store.index.get

        def lookup(block_hash: BlockHash) -> Block | None:
            return None if block_hash in device else host(block_hash)

        start = parent.block_hash if parent is not None else self.seed
        candidates: list[Block] = self._hasher.walk(start, payloads, lookup)
        num_hits = 0
        for block, payload in zip(candidates, payloads):
            if block.parent is not parent or block.payload != payload:
                break
            assert not block.is_cached, "device set is prefix-closed"
            parent = block
            num_hits += 1
        del candidates[num_hits:]
        return candidates

    @property
    def pays_to_load(self) -> bool:
        return self.store.pays_to_load

    def count_skipped(self) -> None:
        self.counters.num_loads_skipped += 1

    def reserve(self, hits: list[Block]) -> None:
        for block in hits:  # held before allocating, so no demotion can evict them
            self.store.ref(block)

    def loads(
        self, block_ids: list[BlockId], hits: list[Block], sequence: Sequence
    ) -> tuple[tuple[BlockId, HostBlockId], ...]:
        sequence.loading = hits
        self.counters.num_loads += len(hits)
        self.counters.hit_tokens += len(hits) * self.block_size
        return tuple(zip(block_ids, [block.host_block_id for block in hits]))  # type: ignore[arg-type,misc]

    # ------------------------------------------------------------ eviction

    def demote(self, dropped: list[Block]) -> None:
        """Blocks one eviction just dropped from the device, child first.

        1. Those the host tier holds turn host-only (no copy).
        2. Child first, decide who is worth a copy: seen often enough, or a host-only
           child (existing, or wanted in this chain) depends on it; unless another
           record holds its hash in the host tier (one record per hash).
        3. Every wanted block is counted as its parent's host-only child *before* any
           host block is taken, so making room never evicts a block whose child is
           about to be demoted (that child would be orphaned).
        4. Parent first, copy the wanted ones whose parent is still findable; a block
           that gets no copy is gone, and with it its host-only descendants."""
        store = self.store
        pending = []
        for block in dropped:
            if block.host_block_id is not None:
                _now_host_only(block)
            else:
                pending.append(block)
        wanted: set[int] = set()
        parents_wanted: set[int] = set()
        for block in pending:  # child first
            if block.block_hash in store.index:
                continue
            if self._worth_keeping(block) or block.num_host_children or id(block) in parents_wanted:
                wanted.add(id(block))
                if block.parent is not None:
                    parents_wanted.add(id(block.parent))
        for block in pending:
            if id(block) in wanted:
                _now_host_only(block)
        for block in reversed(pending):  # parent first
            if id(block) in wanted:
                parent = block.parent
                findable = parent is None or parent.is_cached or parent.host_block_id is not None
                host_block_id = self._take_host_block() if findable else None
                if host_block_id is not None:
                    store.place(block, host_block_id)
                    self._demotions.append((block.block_id, host_block_id))  # type: ignore[arg-type]
                    self._demoted.append(block)
                    self.counters.num_demotions += 1
                    continue
                store.child_left(parent)  # no copy after all
            if block.num_host_children:
                self._drop_descendants(block)

    def left_device(self, block: Block) -> None:
        """It stays findable if the host tier holds it; otherwise it is gone, and so
        are its host-only descendants."""
        if block.host_block_id is not None:
            _now_host_only(block)
        elif block.num_host_children:
            self._drop_descendants(block)

    # ------------------------------------------------------------ commit, release

    def adopt(self, record: Block, parent: Block | None) -> None:
        self.store.child_left(parent)

    def run_committed(self, run: list[Block], loaded: list[bool]) -> None:
        if self.keep_host_copies:
            return
        # Exclusive tiers: a loaded block lives in the device pool alone, so the two
        # tiers together hold more distinct blocks (bench.tiers: the replay's hit rate).
        for block, was_loaded in zip(reversed(run[: len(loaded)]), reversed(loaded)):
            if was_loaded and block.host_refs == 0 and block.num_host_children == 0:
                self._drop_copy(block)
        self.end_op()

    def loads_done(self, sequence: Sequence, num_blocks: int) -> None:
        loading = sequence.loading
        if loading:  # these loads' copies are done: release their host blocks
            num_loaded = min(num_blocks, len(loading))
            for record in loading[:num_loaded]:
                self.store.unref(record)
            del loading[:num_loaded]

    def released(self, sequence: Sequence) -> None:
        for record in sequence.loading:  # loads never committed (cancelled or preempted)
            self.store.unref(record)

    # ------------------------------------------------------------ admin, step

    def flush(self, salt: str | None) -> tuple[int, int]:
        matching = [b for b in self.store.index.values() if salt is None or b.chain_salt == salt]
        idle = sorted((b for b in matching if b.host_refs == 0), key=_deepest_first)
        num_dropped = 0
        for block in idle:
            if block.num_host_children:  # a host-only child is being loaded: keep its parent
                continue
            self._drop_copy(block)
            num_dropped += 1
        self.end_op()
        return num_dropped, len(matching) - num_dropped

    def end_op(self) -> None:
        """The DEMOTED and host REMOVED events of the op that just ran."""
        if self._dropped:
            dropped, self._dropped = self._dropped, []
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

    def end_step(self) -> TierWork:
        self.store.leaves.compact(self.store.num_evictable)
        if not self._demotions:
            return NO_WORK
        demotions, self._demotions = tuple(self._demotions), []
        return TierWork(demotions=demotions)

    # ------------------------------------------------------------ private helpers

    def _take_host_block(self) -> HostBlockId | None:
        """A free host block, else the one of the host tier's first leaf (evicted)."""
        store = self.store
        if len(store.free):
            return store.free.take(1)[0]  # type: ignore[return-value]
        victim = store.leaves.pop()
        if victim is None:
            return None  # every host block is being loaded or holds a needed parent
        self.counters.num_evictions += 1
        return self._drop_copy(victim, give_back=False)

    def _drop_copy(self, block: Block, give_back: bool = True, pending_children: bool = False) -> HostBlockId:
        """Drop `block`'s host copy (a host leaf, or a device-cached record): a host-only
        record leaves the directory. Answers the host block (freed if `give_back`)."""
        store = self.store
        host_block_id = store.remove(block)
        self._dropped.append((block, host_block_id))
        if not block.is_cached:
            # Only children of the eviction under way, not copied yet, may still count
            # (`_drop_descendants`): they will find their parent gone.
            assert pending_children or block.num_host_children == 0, (
                f"host-only {block} would orphan its children"
            )
            store.child_left(block.parent)
        if give_back:
            store.free.give([host_block_id])  # type: ignore[list-item]
        return host_block_id

    def _drop_descendants(self, root: Block) -> None:
        """Rare: `root` left every tier while host-only descendants remain (the host tier
        had no room for it, or a device-only flush took it). They could never be
        reached again: drop them, deepest first. O(host tier)."""
        doomed = []
        for record in self.store.index.values():
            ancestor = record.parent
            while ancestor is not None and ancestor is not root and not ancestor.is_cached:
                ancestor = ancestor.parent
            if ancestor is root and not record.is_cached:
                doomed.append(record)
        for record in sorted(doomed, key=_deepest_first):
            assert record.host_refs == 0, "a load holds its parent chain, so root was not evictable"
            self._drop_copy(record, pending_children=True)
        # What may still count in root: children of the same eviction not copied yet,
        # which then find root gone and take their count back.


def _now_host_only(block: Block) -> None:
    if block.parent is not None:
        block.parent.num_host_children += 1


def _deepest_first(block: Block) -> int:
    return -block.depth


def make_host_level(setup: TierSetup) -> HostLevel | None:
    """The registry's factory: a host tier when the worker declared host blocks."""
    return HostLevel(setup) if setup.spec.num_blocks else None
