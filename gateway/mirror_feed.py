"""Keeps a `DirectoryMirror` in step with blockd: a snapshot, then blockd's event stream.

One task (`MirrorFeed.start`), off every request's path:
1. sync: `GetStats` (the newest event's number S), `ListPools` (addresses, namespaces,
   block sizes), `ListBlocks` page by page (every pool's device index), loaded as one
   snapshot taken after event S;
2. follow: `WatchEvents(after_sequence=S)`, each event applied in order as it arrives;
3. every `CHECK_SECONDS`: `ListPools` again (a worker that registered since is learnt
   within that time; until then the fleet asks Route for requests that could go there)
   and `GetStats`: a stream that has not reached, by now, the event blockd had numbered
   at the previous check is stalled, and blockd numbering below the mirror restarted;
   either way the stream is dropped and the mirror resynced.
The mirror goes out of sync (the fleet then asks `Route`) on a GAP, a jump in the
numbers, its `max_blocks` bound, a broken or stalled stream; this task then syncs
again, after a backoff when blockd is unreachable, and after `REFUSED_RETRY_SECONDS`
when blockd refuses the admin calls (blockd --admin-token without the gateway's
--blockd-admin-token: the gateway then routes with Route alone, and says so once).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import grpc
import grpc.aio
import structlog

from clients.routing import normalize_address
from gateway import metrics
from gateway.mirror import DirectoryMirror, Kind, MirrorEvent, PoolDescription, Tier
from gateway.prefix_hash import namespace_seed
from kvcache.v1 import directory_pb2 as pb
from kvcache.v1 import directory_pb2_grpc

log = structlog.get_logger("gateway")
CHECK_SECONDS = 2.0
PAGE_SIZE = 10_000
MIN_BACKOFF_SECONDS = 0.05
MAX_BACKOFF_SECONDS = 2.0
REFUSED_RETRY_SECONDS = 30.0
OVERFLOW_RETRY_SECONDS = 30.0
_REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
# The contract's enums, value by value (an UNSPECIFIED 0 aside): a kind or tier added to
# the proto that the mirror does not know fails here, at import, not as a silent miss.
_KINDS = {
    v.number: Kind[v.name.removeprefix("BLOCK_EVENT_KIND_")]
    for v in pb.BlockEventKind.DESCRIPTOR.values
    if v.number
}
_TIERS = {v.number: Tier[v.name.removeprefix("TIER_")] for v in pb.Tier.DESCRIPTOR.values if v.number}


class _Stalled(Exception):
    """The stream is behind what blockd numbered a check ago, or blockd restarted."""


class _Unsupported(Exception):
    """An event kind this gateway does not know: mirroring could go wrong, so it pauses."""


class MirrorFeed:
    def __init__(
        self,
        channel: grpc.aio.Channel,
        mirror: DirectoryMirror,
        admin_token: str | None = None,
        timeout: float = 5.0,
        publish: Callable[[], None] | None = None,
    ) -> None:
        self.mirror = mirror
        # What sets the mirror gauges; with shards, the fleet's (every shard's mirror in one).
        self._publish_metrics = publish or self._publish_own
        self._stub = directory_pb2_grpc.DirectoryAdminServiceStub(channel)
        self._metadata = (("authorization", f"Bearer {admin_token}"),) if admin_token else ()
        self._timeout = timeout
        self._task: asyncio.Task | None = None
        self.refused = False  # blockd refused the admin calls (last attempt)
        self.num_syncs = 0
        self._warned = False
        self._last_why = ""

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="mirror-feed")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # ------------------------------------------------------------ the loop

    async def _run(self) -> None:
        backoff = MIN_BACKOFF_SECONDS
        while True:
            syncs = self.num_syncs
            follow = asyncio.create_task(self._sync_and_follow())
            try:
                await self._watch(follow)
                delay = MIN_BACKOFF_SECONDS  # the stream ended, or the mirror asked for a resync
            except grpc.RpcError as error:
                code = error.code()
                self._out_of_sync(f"blockd: {code.name}")
                self.refused = code in _REFUSED
                if self.refused:
                    if not self._warned:
                        log.warning(
                            "blockd refuses the directory mirror's admin calls; routing asks Route "
                            "(give --blockd-admin-token)",
                            code=code.name,
                        )
                        self._warned = True
                    delay = REFUSED_RETRY_SECONDS
                else:
                    delay = backoff if self.num_syncs == syncs else MIN_BACKOFF_SECONDS
            except (_Stalled, _Unsupported) as error:
                self._out_of_sync(str(error))
                delay = OVERFLOW_RETRY_SECONDS if isinstance(error, _Unsupported) else MIN_BACKOFF_SECONDS
            except Exception as error:  # a bug must not leave a mirror that looks in sync but follows nothing
                log.exception("directory mirror failed")
                self._out_of_sync(f"{type(error).__name__}: {error}")
                delay = OVERFLOW_RETRY_SECONDS
            finally:
                follow.cancel()
                # wait() never raises the task's error (the except clauses had it) and, unlike
                # awaiting the task, lets a cancel of this loop itself through
                await asyncio.wait({follow})
                if not follow.cancelled():
                    follow.exception()
            if "max_blocks" in self.mirror.why_out_of_sync:
                delay = OVERFLOW_RETRY_SECONDS
            if self.mirror.why_out_of_sync and self.mirror.why_out_of_sync != self._last_why:
                log.info("directory mirror out of sync", why=self.mirror.why_out_of_sync, resync_in=delay)
            self._last_why = self.mirror.why_out_of_sync
            backoff = MIN_BACKOFF_SECONDS if self.num_syncs > syncs else min(2 * backoff, MAX_BACKOFF_SECONDS)
            await asyncio.sleep(delay)

    async def _watch(self, follow: asyncio.Task) -> None:
        """Wait for `follow`; every CHECK_SECONDS refresh the pools and check the stream's lag."""
        target = None  # blockd's newest event number at the previous check
        while True:
            done, _ = await asyncio.wait({follow}, timeout=CHECK_SECONDS)
            if done:
                follow.result()  # raises what the stream raised
                return
            if not self.mirror.in_sync:
                continue  # still syncing
            stats, pools = await asyncio.gather(self._call_stats(), self._call_pools())
            self.mirror.describe(self._describe(pools))
            newest = stats.last_event_sequence
            if newest < self.mirror.last_sequence:
                raise _Stalled(f"blockd numbers events from {newest} now (restarted)")
            if target is not None and self.mirror.last_sequence < target:
                raise _Stalled(f"the event stream is stalled at {self.mirror.last_sequence} (< {target})")
            target = newest

    async def _sync_and_follow(self) -> None:
        stats = await self._call_stats()
        pools = await self._call_pools()
        blocks: list[tuple[str, bytes]] = []
        token = ""
        while True:
            page = await self._stub.ListBlocks(
                pb.ListBlocksRequest(page_size=PAGE_SIZE, page_token=token),
                timeout=self._timeout,
                metadata=self._metadata,
            )
            blocks += [(b.pool_id, b.block_hash) for b in page.blocks]
            token = page.next_page_token
            if not token:
                break
        after = stats.last_event_sequence
        self.mirror.load(after, self._describe(pools), blocks, _lower_tiers_partial(pools))
        self.num_syncs += 1
        self.refused = False
        self._publish()
        log.info(
            "directory mirror synced",
            after_event=after,
            pools=len(pools.pools),
            blocks=self.mirror.num_blocks,
            lower_tiers_partial=self.mirror.lower_tiers_partial,
        )
        call = self._stub.WatchEvents(pb.WatchEventsRequest(after_sequence=after), metadata=self._metadata)
        try:
            async for message in call:
                self.mirror.apply(event_from(message))
                if not self.mirror.in_sync:
                    return
                self._publish_metrics()
        finally:
            call.cancel()
            self._publish()

    # ------------------------------------------------------------ helpers

    async def _call_stats(self) -> pb.GetStatsResponse:
        return await self._stub.GetStats(pb.GetStatsRequest(), timeout=self._timeout, metadata=self._metadata)

    async def _call_pools(self) -> pb.ListPoolsResponse:
        return await self._stub.ListPools(
            pb.ListPoolsRequest(), timeout=self._timeout, metadata=self._metadata
        )

    @staticmethod
    def _describe(pools: pb.ListPoolsResponse) -> list[PoolDescription]:
        return [describe_pool(p) for p in pools.pools]

    def _out_of_sync(self, why: str) -> None:
        if self.mirror.in_sync:
            self.mirror.lose_sync(why)
        self._publish()

    def _publish(self) -> None:
        self._publish_metrics()

    def _publish_own(self) -> None:
        metrics.MIRROR_SYNCED.set(1 if self.mirror.in_sync else 0)
        metrics.MIRROR_BLOCKS.set(self.mirror.num_blocks)


def describe_pool(pool: pb.PoolInfo) -> PoolDescription:
    ns = pool.namespace
    return PoolDescription(
        pool.pool_id,
        normalize_address(pool.worker_address),
        namespace_seed(ns.model_id, ns.model_revision, ns.dtype, ns.adapter_id, pool.block_size),
        pool.block_size,
        pool.stats.HasField("shared"),
    )


def event_from(message: pb.WatchEventsResponse) -> MirrorEvent:
    kind = _KINDS.get(message.kind)
    if kind is None:
        raise _Unsupported(f"event kind {message.kind} is unknown to this gateway")
    return MirrorEvent(
        message.sequence,
        kind,
        message.pool_id,
        tuple(message.block_hashes),
        _TIERS.get(message.tier, Tier.DEVICE),
    )


def _lower_tiers_partial(pools: pb.ListPoolsResponse) -> bool:
    """Whether some host or shared tier held blocks at the snapshot (ListBlocks lists none)."""
    for pool in pools.pools:
        stats = pool.stats
        if stats.HasField("host") and stats.host.num_blocks > stats.host.num_free_blocks:
            return True
        if stats.HasField("shared") and stats.shared.num_blocks > 0:
            return True
    return False
