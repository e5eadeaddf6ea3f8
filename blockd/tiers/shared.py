"""The shared tier behind the lower-tier protocol: write-through of committed blocks
the admission rule accepts, fetches into the admitted sequence's device blocks.

The records are the namespace's (`blockd.shared_tier.SharedIndex`, shared by every
pool of it), so this tier adopts no pool record and takes no demotions: a committed
block worth keeping is written through (`TierWork.shared_stores`) and becomes
findable once the worker reports the write done (`reports`); an admission's walk
goes on through resident records after the faster tiers' hits, which get fresh
device blocks the worker fetches into (`AdmitResult.shared_loads`). Flushing it is
the namespace's business, not one pool's (`BlockDirectory.flush`).
"""

from __future__ import annotations

from typing import ClassVar

from blockd.block import Block, Sequence
from blockd.events import EventKind
from blockd.hashing import salt_tag
from blockd.prompt import Prompt
from blockd.shared_tier import SharedIndex, SharedRecord, chain_of
from blockd.tiers.base import NO_WORK, LowerTier, TierReports, TierSetup, TierWork
from blockd.types import BlockHash, BlockId, PoolId, SharedBlock, Tier
from kvcache_contract.shared_value import identity, salt_digest


class SharedLevel(LowerTier):
    """One pool's use of its namespace's shared index."""

    tier: ClassVar[Tier] = Tier.SHARED
    admit_field: ClassVar[str] = "shared_loads"

    def __init__(self, setup: TierSetup, index: SharedIndex) -> None:
        self.index = index
        self.counters = setup.counters.shared
        self.pool_id = setup.pool_id
        self.block_size = setup.block_size
        self._events = setup.events
        self._worth_keeping = setup.worth_keeping
        spec = setup.spec
        self.load_seconds_per_block = spec.shared_load_seconds_per_block
        self.recompute_seconds_per_block = spec.prefill_seconds_per_token * setup.block_size
        self._stores: list[SharedBlock] = []  # the Step's writes, for TierWork
        # Keys of this Step's reported writes that will never be indexed (`SharedIndex.confirm`).
        self._orphans: list[tuple[BlockHash, BlockHash]] = []

    # ------------------------------------------------------------ admission

    def match(self, prompt: Prompt, hits: list) -> list[SharedRecord]:
        """Resident records after the faster tiers' hits: the walk goes on from their
        hashes (one digest per block per admission); the whole chain is touched."""
        chain = self.index.match(prompt, self.block_size, [block.block_hash for block in hits])
        self.index.touch(chain)
        return chain[len(hits) :]

    @property
    def pays_to_load(self) -> bool:
        """Whether fetching a block is estimated faster than recomputing it (unknown
        costs: fetch)."""
        fetch, recompute = self.load_seconds_per_block, self.recompute_seconds_per_block
        return fetch <= 0.0 or recompute <= 0.0 or fetch < recompute

    def count_skipped(self) -> None:
        self.counters.num_loads_skipped += 1

    def loads(
        self, block_ids: list[BlockId], hits: list[SharedRecord], sequence: Sequence
    ) -> tuple[SharedBlock, ...]:
        self.counters.num_loads += len(hits)
        self.counters.hit_tokens += len(hits) * self.block_size
        return tuple(_shared_block(block_id, record) for block_id, record in zip(block_ids, hits))

    def hits_seen(self, hits: list[Block]) -> None:
        # a hit may make a block worth keeping in the store
        self._store([block for block in hits if self._worth_keeping(block)])

    # ------------------------------------------------------------ commit, step

    def committed(self, run: list[Block]) -> None:
        self._store([b for b in run if b.is_cached and self._worth_keeping(b)])

    def reports(self, reports: TierReports) -> None:
        """The pool's writes that completed become resident (parent first), failed ones
        are forgotten, and records whose value a fetch found gone leave."""
        shared, counters = self.index, self.counters
        if reports.shared_written:
            written = [BlockHash(bytes(h)) for h in reports.shared_written]
            resident, forgotten, orphans = shared.confirm(self.pool_id, written)
            self._orphans += [(shared.seed, block_hash) for block_hash in orphans]
            counters.num_stores += len(resident)
            if resident:
                self._events.append(
                    EventKind.DEMOTED, self.pool_id, tuple(r.block_hash for r in resident), tier=Tier.SHARED
                )
            removed_event(self._events, forgotten)  # the index outgrew its bound
        if reports.shared_failed:
            failed = [BlockHash(bytes(h)) for h in reports.shared_failed]
            counters.num_write_failures += shared.fail(self.pool_id, failed)
        if reports.shared_missing:
            dropped = shared.drop([BlockHash(bytes(h)) for h in reports.shared_missing])
            counters.num_missing += len(dropped)
            removed_event(self._events, dropped, self.pool_id)

    def end_step(self) -> TierWork:
        if not self._stores and not self._orphans:
            return NO_WORK
        stores, self._stores = tuple(self._stores), []
        orphans, self._orphans = tuple(self._orphans), []
        return TierWork(shared_stores=stores, shared_orphans=orphans)

    # ------------------------------------------------------------ private helpers

    def _store(self, blocks: list[Block]) -> None:
        """Ask the worker to write these device-cached blocks (parent first), unless
        the store holds them or a write of them is under way."""
        shared = self.index
        records: dict[int, SharedRecord] = {}  # id(block) -> its record, made in this call
        for block in blocks:
            if shared.is_known(block.block_hash):
                continue
            parent = block.parent
            parent_record = None
            if parent is not None:
                parent_record = records.get(id(parent)) or self._record_of(parent)
                if parent_record is None:
                    continue  # its parent is not (or under its hash, another chain is) stored
            salt_digest = _salt_digest(block)
            record = SharedRecord(
                block.block_hash,
                parent.block_hash if parent is not None else None,
                block.token_bytes,
                salt_digest,
                block.depth,
                chain_of(parent_record, identity(block.token_bytes, salt_digest)),
            )
            shared.add_pending(record, self.pool_id, parent_record)
            records[id(block)] = record
            self._stores.append(_shared_block(block.block_id, record))  # type: ignore[arg-type]

    def _record_of(self, block: Block) -> SharedRecord | None:
        """The record, resident or pending, that holds this device block's chain: the one
        under its hash, if it and every record above it carry the block's and its
        ancestors' identities (tokens and salt) at their depths; else None. O(depth),
        once per stored run (its first block's parent). Why not the hash alone: under a
        collision another chain's record sits there (tests/blockd/test_properties.py,
        the colliding shared-tier machine)."""
        shared = self.index
        found = shared.known_record(block.block_hash)
        record: SharedRecord | None = found
        node: Block | None = block
        while node is not None:
            if (
                record is None
                or record.block_hash != node.block_hash
                or record.depth != node.depth
                or record.identity != identity(node.token_bytes, _salt_digest(node))
            ):
                return None
            node, record = node.parent, shared.parent_of(record)
        return found if record is None else None


def _shared_block(block_id: BlockId, record: SharedRecord) -> SharedBlock:
    """What the worker is told of a record: the device block to copy, the header's fields."""
    return SharedBlock(
        block_id,
        record.block_hash,
        record.parent_hash,
        record.token_bytes,
        record.salt_digest,
        record.depth,
        record.chain_digest,
    )


def _salt_digest(block: Block) -> bytes | None:
    """What a shared record keeps of the block's salt: a one-way digest of its tag."""
    return salt_digest(salt_tag(block.mixed_salt)) if block.mixed_salt is not None else None


def removed_event(events, dropped: list[SharedRecord], pool_id: str = "") -> None:
    """A REMOVED event of tier SHARED (pool_id: the pool whose fetch found them gone;
    empty: the namespace's index dropped them)."""
    if dropped:
        events.append(
            EventKind.REMOVED, PoolId(pool_id), tuple(r.block_hash for r in dropped), tier=Tier.SHARED
        )


def make_shared_level(setup: TierSetup) -> SharedLevel | None:
    """The registry's factory: when the worker reaches the namespace's store."""
    if not setup.spec.has_shared_tier or setup.shared_index is None:
        return None
    return SharedLevel(setup, setup.shared_index)
