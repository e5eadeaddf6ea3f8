"""The block directory: pools under leases, prefix lookups, pins, stats and events.

Pure bookkeeping: no gRPC, no I/O, no threads. Time comes from the injected
`clock` (seconds, monotonic), so tests drive leases and pins by hand. Not
thread-safe: the server calls it from its event loop only, which serialises calls.

Every call either raises a `DirectoryError` and changes nothing, or applies fully:
input is checked first (`validation`), then applied. The parts live in their own
modules: slots and leases (`leases`), block mechanics (`pool`), operator queries
(`queries`), pins (`pins`); this class composes them and keeps the API.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

from mypy_extensions import mypyc_attr

from blockd import queries
from blockd.config import DirectoryConfig
from blockd.events import EventKind, EventLog
from blockd.eviction import make_policy
from blockd.ghosts import GhostTable, ghost_capacity
from blockd.hashing import DEFAULT_HASHER, BlockHasher, salt_tag
from blockd.leases import PoolLeases, PoolSlot
from blockd.pins import PinTable
from blockd.pool import BlockPool, PoolCounters
from blockd.routing import by_cached_prefix, rank_for_route
from blockd.shared_tier import SharedRecord, SharedTier
from blockd.sightings import Sightings
from blockd.tiers.base import NO_REPORTS, TierReports
from blockd.tiers.shared import removed_event
from blockd.types import (
    NO_HOST_TIER,
    AdmitOp,
    BlockHash,
    BlockPage,
    CommitOp,
    FlushResult,
    GrowOp,
    HostSpec,
    MissExplanation,
    Namespace,
    PinId,
    PinResult,
    PoolId,
    PoolInfo,
    PoolMatch,
    Registration,
    ReleaseOp,
    ResyncResult,
    ResyncSequence,
    Route,
    Stats,
    StepResult,
    Tier,
)
from blockd.validation import (
    check_registration,
    check_salt,
    checked_page_size,
    checked_pin_ttl,
    decode_page_token,
    make_prompt,
    plan_resync,
    plan_step,
)
from kvcache_contract.shared_value import salt_digest


@mypyc_attr(allow_interpreted_subclasses=True)  # tests wrap it (blockd.native)
class BlockDirectory:
    """Every registered pool (live, or a tombstone after its lease lapsed), the pins
    over them, and one event log. Worker calls need the pool's current epoch."""

    def __init__(
        self,
        config: DirectoryConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        hasher: BlockHasher = DEFAULT_HASHER,
    ) -> None:
        self.config = config or DirectoryConfig()
        self.events = EventLog(self.config.event_log_capacity, self.config.event_log_max_bytes)
        self._clock = clock
        self._hasher = hasher
        self._pins = PinTable()
        self._sightings = Sightings(max(1, self.config.max_ghosts))  # fleet-wide, for the demotion rule
        self.shared = SharedTier(hasher, self.config.shared_index_max_blocks)  # every namespace's
        self._leases = PoolLeases(self.config, clock, self._new_pool, self._on_reset)
        self._slots: dict[PoolId, PoolSlot] = self._leases.slots  # read by queries and tests

    # ------------------------------------------------------------ workers

    def register_pool(
        self,
        num_blocks: int,
        block_size: int,
        namespace: Namespace,
        worker_address: str = "",
        pool_id: PoolId | None = None,
        pool_token: str | None = None,
        host: HostSpec = NO_HOST_TIER,
    ) -> Registration:
        """Declare a pool. With the id of a known pool, that pool is reset (references,
        sequences and index dropped) under a bumped epoch; an unknown id is created
        (a worker re-registering after a blockd restart). A live pool is reset only for
        the caller presenting its `pool_token` (its owner)."""
        check_registration(num_blocks, block_size, namespace, worker_address, pool_id, pool_token, host)
        slot = self._leases.register(
            num_blocks, block_size, namespace, worker_address, pool_id, pool_token, host
        )
        config = self.config
        return Registration(
            slot.pool.pool_id,
            slot.epoch,
            config.lease_ttl_seconds,
            config.max_sequence_tokens,
            slot.pool_token,
            slot.pool.seed.hex() if host.has_shared_tier else "",
        )

    def renew_lease(self, pool_id: PoolId, epoch: int) -> float:
        self._leases.renew(self._leases.worker_slot(pool_id, epoch))
        return self.config.lease_ttl_seconds

    def step(
        self,
        pool_id: PoolId,
        epoch: int,
        commits: Seq[CommitOp] = (),
        releases: Seq[ReleaseOp] = (),
        grows: Seq[GrowOp] = (),
        admits: Seq[AdmitOp] = (),
        shared_written: Seq[bytes] = (),
        shared_failed: Seq[bytes] = (),
        shared_missing: Seq[bytes] = (),
    ) -> StepResult:
        """One scheduler step: every op is validated first (any bad op raises and
        nothing changes), then commits, releases, grows and admits apply in that order.
        A grow or admit that finds too few blocks answers False and changes nothing.
        The answer carries the demotions its evictions owe (copies before the worker's
        next forward), and the shared tier writes it asks for. The worker's reports of
        earlier shared tier writes and fetches apply first (hashes blockd does not
        know are ignored: the records may have left meanwhile)."""
        slot = self._leases.worker_slot(pool_id, epoch)
        pool = slot.pool
        plan = plan_step(pool, self.config, commits, releases, grows, admits)
        self._leases.renew(slot)
        reports = NO_REPORTS
        if shared_written or shared_failed or shared_missing:
            reports = TierReports(tuple(shared_written), tuple(shared_failed), tuple(shared_missing))
        return pool.step(plan, reports)

    def resync(self, pool_id: PoolId, epoch: int, sequences: Seq[ResyncSequence]) -> ResyncResult:
        """Make the worker's declared live sequences the whole state of the pool: it is
        emptied, then each sequence re-references its exact blocks and its full blocks
        are committed and indexed again. Idempotent, so a worker may retry it."""
        slot = self._leases.worker_slot(pool_id, epoch)
        old = slot.pool
        fresh = self._new_pool(
            pool_id, old.num_blocks, old.block_size, slot.namespace, old.counters, old.host_spec
        )
        plans = plan_resync(fresh, self.config, sequences)
        self._leases.reset(slot, fresh)
        num_indexed = fresh.resync(plans)
        return ResyncResult(len(plans), num_indexed)

    def expire_leases(self) -> list[PoolId]:
        """Retire every live pool whose lease lapsed; answers their ids."""
        return self._leases.expire_lapsed()

    # ------------------------------------------------------------ operators

    def stats(self, pool_id: PoolId | None = None) -> Stats:
        pools = tuple(queries.pool_stats(slot.pool) for slot in self._leases.selected(pool_id))
        return Stats(queries.total(pools), pools, self.events.last_sequence)

    def list_pools(self) -> tuple[PoolInfo, ...]:
        return queries.pool_infos(self._slots, self._clock())

    def list_blocks(
        self, pool_id: PoolId | None = None, page_size: int = 0, page_token: str | None = None
    ) -> BlockPage:
        """Cached blocks ordered by (pool_id, block_id), one page at a time."""
        size = checked_page_size(page_size)
        after = decode_page_token(page_token) if page_token else ("", -1)
        if pool_id:
            self._leases.known_slot(pool_id)
        pool_ids = [pool_id] if pool_id else sorted(self._slots)
        return queries.block_page(self._slots, pool_ids, size, after)

    def lookup(
        self,
        token_ids: Seq[int],
        cache_salt: str = "",
        public_prefix_tokens: int = 0,
        pool_id: PoolId | None = None,
    ) -> tuple[PoolMatch, ...]:
        """Cached prefix of the prompt in each live pool, longest first."""
        max_tokens = self.config.max_sequence_tokens
        prompt = make_prompt(token_ids, cache_salt, public_prefix_tokens, max_tokens, "lookup")
        return tuple(by_cached_prefix(queries.matches(self._leases.live(pool_id), prompt)))

    def route(self, token_ids: Seq[int], cache_salt: str = "", public_prefix_tokens: int = 0) -> Route:
        """The live pool with the longest cached prefix, lower load breaking ties; a pool
        loaded more than `route_load_margin` above the least loaded one is skipped."""
        max_tokens = self.config.max_sequence_tokens
        prompt = make_prompt(token_ids, cache_salt, public_prefix_tokens, max_tokens, "route")
        matches = queries.matches(self._leases.live(), prompt)
        ranked = tuple(rank_for_route(matches, self.config.route_load_margin))
        if not ranked:
            return Route(None, None, 0, ())
        best = ranked[0]
        return Route(best.pool_id, best.worker_address, best.num_cached_tokens, ranked)

    def flush(
        self, pool_id: PoolId | None = None, cache_salt: str | None = None, tier: Tier | None = None
    ) -> FlushResult:
        """Drop every unreferenced cached block (of one pool, of one salt, of one tier;
        None: every tier); referenced ones (and host blocks being loaded) are counted
        busy and stay until released. Never refuses."""
        check_salt(cache_salt or "", "flush")
        tiers = frozenset(Tier) if tier is None else frozenset({tier})
        per_tier: dict[Tier, list[int]] = {}
        seeds: dict[BlockHash, None] = {}
        for slot in self._leases.selected(pool_id):
            for pool_tier, dropped, busy in slot.pool.flush(cache_salt or None, tiers):
                counts = per_tier.setdefault(pool_tier, [0, 0])
                counts[0] += dropped
                counts[1] += busy
            if slot.pool.shared is not None:
                seeds[slot.pool.seed] = None
        shared_keys: list[tuple[BlockHash, BlockHash]] = []
        if Tier.SHARED in tiers and seeds:
            # The shared tier is the namespace's, not one pool's: flushing it for a pool
            # flushes it for every pool of that namespace. Nothing there is referenced.
            digest = salt_digest(salt_tag(cache_salt)) if cache_salt else None
            counts = per_tier.setdefault(Tier.SHARED, [0, 0])
            for seed in seeds:
                records = self.shared.index_for(seed).flush(digest)
                counts[0] += len(records)
                shared_keys += [(seed, record.block_hash) for record in records]
                self._shared_removed(records)
        rows = tuple((t, d, b) for t, (d, b) in sorted(per_tier.items(), key=lambda item: item[0].value))
        whole = tuple(seeds) if Tier.SHARED in tiers and not cache_salt else ()
        return FlushResult(sum(r[1] for r in rows), sum(r[2] for r in rows), rows, tuple(shared_keys), whole)

    def load_shared(self, seed: BlockHash, records: Seq[SharedRecord]) -> int:
        """Records of one namespace read back from the store (blockd's start-up rebuild);
        answers how many became findable."""
        num, forgotten = self.shared.index_for(seed).load(records)
        self._shared_removed(forgotten)
        return num

    def pin(
        self,
        token_ids: Seq[int],
        cache_salt: str = "",
        public_prefix_tokens: int = 0,
        ttl_seconds: float = 0.0,
        pool_id: PoolId | None = None,
    ) -> PinResult:
        """Reference the currently cached blocks of the prefix in each live pool (or
        one) until `unpin` or the TTL (0: one hour; at most 30 days)."""
        ttl_seconds = checked_pin_ttl(ttl_seconds)
        max_tokens = self.config.max_sequence_tokens
        prompt = make_prompt(token_ids, cache_salt, public_prefix_tokens, max_tokens, "pin")
        live = self._leases.live(pool_id)
        pin = self._pins.pin(live, prompt, self._clock() + ttl_seconds, self.config.pin_budget)
        num_tokens = sum(len(blocks) * self._slots[pid].pool.block_size for pid, blocks in pin.blocks.items())
        return PinResult(pin.pin_id, num_tokens, pin.num_blocks, ttl_seconds)

    def unpin(self, pin_id: PinId) -> int:
        """Drop a pin; answers how many blocks it still held."""
        return self._pins.unpin(pin_id, self._slots)

    def unpin_all(self) -> tuple[int, int]:
        """Drop every pin; answers (pins, blocks they still held)."""
        pin_ids = self._pins.ids()
        return len(pin_ids), sum(self._pins.unpin(pin_id, self._slots) for pin_id in pin_ids)

    def explain_miss(
        self,
        token_ids: Seq[int],
        cache_salt: str = "",
        public_prefix_tokens: int = 0,
        pool_id: PoolId | None = None,
    ) -> tuple[MissExplanation, ...]:
        """Why each live pool (or one) does not hold the prompt past its cached prefix:
        the reason of the first missing block (blockd.ghosts), and the partial tail."""
        max_tokens = self.config.max_sequence_tokens
        prompt = make_prompt(token_ids, cache_salt, public_prefix_tokens, max_tokens, "explain")
        slots = self._leases.live(pool_id)
        return tuple(queries.explain(slots, self._leases.live(), prompt, self._clock()))

    def expire_pins(self) -> list[PinId]:
        expired = self._pins.expired(self._clock())
        for pin_id in expired:
            self.unpin(pin_id)
        return expired

    # ------------------------------------------------------------ private helpers

    def _new_pool(
        self,
        pool_id: PoolId,
        num_blocks: int,
        block_size: int,
        namespace: Namespace,
        counters: PoolCounters,
        host: HostSpec,
    ) -> BlockPool:
        seed = self._hasher.namespace_seed(namespace, block_size)
        config = self.config
        policy = make_policy(config.eviction_policy)
        capacity = ghost_capacity(num_blocks, config.ghosts_per_block, config.max_ghosts)
        ghosts = GhostTable(capacity, self._clock, policy.returned)
        return BlockPool(
            pool_id,
            num_blocks,
            block_size,
            seed,
            self._hasher,
            policy,
            self.events,
            counters,
            host,
            config.demote_min_hits,
            self._sightings,
            ghosts=ghosts,
            shared=self.shared.index_for(seed),
        )

    def _on_reset(self, pool_id: PoolId) -> None:
        """A live pool's blocks are about to be dropped: pins lose them, watchers hear it;
        its shared tier writes in flight will never be reported."""
        self._pins.forget_pool(pool_id)
        self.events.append(EventKind.CLEARED, pool_id)
        for shared in self.shared.namespaces.values():
            shared.forget_pool(pool_id)

    def _shared_removed(self, dropped: list[SharedRecord], pool_id: str = "") -> None:
        """A REMOVED event of tier SHARED (pool_id: the pool whose fetch found them gone)."""
        removed_event(self.events, dropped, pool_id)
