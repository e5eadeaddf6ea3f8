"""The lower-tier protocol: what a pool's device mechanics ask of every tier below it.

A pool (`blockd.pool.BlockPool`) keeps the device mechanics (free list, index,
evictable leaves, sequences) and walks `pool.lower_tiers`, an ordered list built by
`blockd.tiers.registry` (host, then shared; faster first). A tier answers the same
questions whatever it is backed by:

- admission, in order: `match` (verified hits continuing the chain after the faster
  tiers' hits), `pays_to_load` (a hit must never be slower than a miss), `reserve`
  (hold the hits before the device allocation can evict anything), `loads` (what the
  worker copies into the sequence's own device blocks, and the counters);
- eviction: `demote` (the victims the device pool just dropped, child first), and
  `left_device` (a block dropped without a copy, by a flush);
- commit and release: `adopt` a record a tier holds when its content is committed
  again, `run_committed` after a run is indexed, `committed` (write-through),
  `loads_done` and `released` (the holds of loads end);
- admin: `flush` one pool's part of the tier;
- the Step: `reports` (what the worker says its earlier tier work did), `end_op`
  (the events of one op, after the device's own), `end_step` (the `TierWork` the
  worker owes, a returned object).

Every hook has a no-op default, so a tier implements what it does: the host tier
demotes, the shared tier writes through. Hooks run in walk order. A tier appends its
events to the pool's log at the moment they happen (watchers read them in cause
order); what the worker must do comes back in `TierWork`, never through lists the
directory empties.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

from blockd.events import EventLog
from blockd.hashing import BlockHasher
from blockd.prompt import Prompt
from blockd.types import BlockHash, BlockId, HostBlockId, HostSpec, PoolId, SharedBlock, Tier

if TYPE_CHECKING:
    from blockd.block import Block, Sequence
    from blockd.eviction import EvictionPolicy
    from blockd.shared_tier import SharedIndex


@dataclass(frozen=True, slots=True)
class TierWork:
    """What the worker must do for the lower tiers before its next forward, one Step's
    worth (the fields are the StepResult's of the same names)."""

    # Device blocks evicted by the step whose K/V the worker copies down first:
    # (device block, host block).
    demotions: tuple[tuple[BlockId, HostBlockId], ...] = ()
    # Committed device blocks to write to the shared tier.
    shared_stores: tuple[SharedBlock, ...] = ()
    # (namespace seed, block hash) of reported shared tier writes that will never be
    # indexed (`SharedIndex.confirm`'s orphans): keys for the servicer to delete.
    shared_orphans: tuple[tuple[BlockHash, BlockHash], ...] = ()

    def __add__(self, other: TierWork) -> TierWork:
        return TierWork(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(TierWork)))


NO_WORK = TierWork()


@dataclass(frozen=True, slots=True)
class TierReports:
    """What the worker reports of its earlier tier work in a Step (block hashes)."""

    shared_written: tuple[bytes, ...] = ()
    shared_failed: tuple[bytes, ...] = ()
    shared_missing: tuple[bytes, ...] = ()


NO_REPORTS = TierReports()


@dataclass(frozen=True, slots=True)
class TierSetup:
    """What a pool gives the tiers below it (read by each tier's factory)."""

    pool_id: PoolId
    block_size: int
    seed: BlockHash  # h_{-1} of the pool's namespace
    hasher: BlockHasher
    events: EventLog
    counters: Any  # the pool's PoolCounters (a tier keeps its own part of them)
    spec: HostSpec  # the lower tiers as the worker declared them, with its measured costs
    device_index: dict[BlockHash, Block]  # the device pool's (findable) blocks
    device_policy: EvictionPolicy
    # The admission rule of demotion and write-through: seen often enough to keep.
    worth_keeping: Callable[[Block], bool]
    keep_host_copies: bool = False
    shared_index: SharedIndex | None = None  # the namespace's, when one is configured


class LowerTier:
    """One tier below the device pool. Subclasses set `tier` and `admit_field` and
    implement `match`; every other hook defaults to doing nothing."""

    tier: ClassVar[Tier]
    # The AdmitResult field its loads fill (tiers sharing one concatenate, in walk order).
    admit_field: ClassVar[str]
    # Whether its hits are the pool's own `Block` records (then the device's commit
    # may adopt them, and they are seen with the device hits), or records of its own.
    holds_records: ClassVar[bool] = False
    # Whether it takes the device pool's eviction victims (`demote`).
    takes_demotions: ClassVar[bool] = False

    # ------------------------------------------------------------ admission

    def match(self, prompt: Prompt, hits: list[Any]) -> list[Any]:
        """Verified hits of the prompt's next full blocks, continuing the chain after
        `hits` (the faster tiers' hits, parent first, each with a `block_hash`)."""
        raise NotImplementedError

    @property
    def pays_to_load(self) -> bool:
        """Whether loading its hits is estimated faster than recomputing them."""
        return True

    def count_skipped(self) -> None:
        """An admission left its hits behind (`pays_to_load` was False)."""

    def reserve(self, hits: list[Any]) -> None:
        """Hold an admission's hits: no eviction may take them while they load."""

    def loads(self, block_ids: list[BlockId], hits: list[Any], sequence: Sequence) -> tuple:
        """The admission's answer for its hits, loaded into `block_ids` (the
        sequence's device blocks, one per hit, in table order); counts them."""
        return ()

    def hits_seen(self, hits: list[Block]) -> None:
        """Device hits were seen again (pools counting sightings): they may now be
        worth keeping in this tier."""

    # ------------------------------------------------------------ eviction

    def demote(self, dropped: list[Block]) -> None:
        """Blocks one eviction just dropped from the device pool, child first."""

    def left_device(self, block: Block) -> None:
        """`block` was dropped from the device index without a copy (a flush)."""

    # ------------------------------------------------------------ commit, release

    def find_record(self, block_hash: BlockHash) -> Block | None:
        """A record this tier holds under `block_hash` (tiers that hold records)."""
        return None

    def adopt(self, record: Block, parent: Block | None) -> None:
        """A record found by `find_record` gained a device copy (its sequence
        committed the same content): it is no longer this tier's alone."""

    def run_committed(self, run: list[Block], loaded: list[bool]) -> None:
        """A sequence's run was recorded; `loaded[i]`: run[i] was indexed, adopted."""

    def committed(self, run: list[Block]) -> None:
        """A STORE sequence committed `run` (write-through tiers store it)."""

    def loads_done(self, sequence: Sequence, num_blocks: int) -> None:
        """The sequence committed its next `num_blocks` blocks: their loads are done."""

    def released(self, sequence: Sequence) -> None:
        """The sequence was released: loads it never committed end."""

    # ------------------------------------------------------------ admin, step

    def flush(self, salt: str | None) -> tuple[int, int] | None:
        """Drop this pool's unreferenced blocks (of `salt`'s chains if given): answers
        (dropped, busy), or None when the tier is not one pool's to flush."""
        return None

    def reports(self, reports: TierReports) -> None:
        """The worker's reports of earlier tier work (applied before the Step's ops)."""

    def end_op(self) -> None:
        """One op ended: append the events it caused in this tier."""

    def end_step(self) -> TierWork:
        """The Step ended: the work the worker owes this tier."""
        return NO_WORK
