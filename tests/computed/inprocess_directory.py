"""A `computed.directory.Directory` over blockd's pure core, in process (tests only).

Tests may import both daemons; the daemons may not import each other. This adapter
is the in-process twin of computed/directory_client.py: the same translation of ops
and results, blockd's domain errors surfacing as `DirectoryUnavailable`, and
`recover` = register (the same pool id) + resync. `fail_next_step` and
`restart_blockd` inject the failures the engine must recover from.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from blockd import types as bt
from blockd.directory import BlockDirectory
from computed.directory_ops import AdmitResult, DirectoryOps, DirectoryResult, GrowResult, ResyncSequence
from computed.errors import DirectoryUnavailable


@dataclass(frozen=True)
class Lease:
    pool_id: str
    epoch: int
    pool_token: str = ""


class InProcessDirectory:
    """One worker's pool in a `BlockDirectory` (the whole blockd core, no gRPC)."""

    def __init__(
        self,
        directory: BlockDirectory,
        num_blocks: int,
        block_size: int,
        namespace: bt.Namespace | None = None,
        num_host_blocks: int = 0,
    ) -> None:
        self.directory = directory
        self.host = bt.HostSpec(num_host_blocks)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.namespace = namespace or bt.Namespace("test-model")
        self.lease: Lease | None = None
        self.needs_recovery = False
        self.num_steps = 0
        self.num_recoveries = 0
        self._fail_next_step = False

    # ------------------------------------------------------------ Directory

    async def step(self, ops: DirectoryOps) -> DirectoryResult:
        lease = self._require_lease()
        if self._fail_next_step:
            self._fail_next_step = False
            self.needs_recovery = True
            raise DirectoryUnavailable("UNAVAILABLE: injected by the test")
        try:
            result = self.directory.step(
                bt.PoolId(lease.pool_id),
                lease.epoch,
                commits=[bt.CommitOp(c.sequence_id, c.block_ids, c.token_ids) for c in ops.commits],
                releases=[bt.ReleaseOp(s) for s in ops.releases],
                grows=[bt.GrowOp(g.sequence_id, g.num_tokens) for g in ops.grows],
                admits=[
                    bt.AdmitOp(a.sequence_id, a.token_ids, a.cache_salt, a.public_prefix_tokens)
                    for a in ops.admits
                ],
            )
        except (bt.NotFound, bt.StaleEpoch) as exc:
            self.needs_recovery = True
            raise DirectoryUnavailable(f"{type(exc).__name__}: {exc}") from exc
        self.num_steps += 1
        return DirectoryResult(
            grows=[GrowResult(g.sequence_id, g.grown, list(g.new_block_ids)) for g in result.grows],
            admits=[
                AdmitResult(a.sequence_id, a.admitted, list(a.block_ids), a.num_cached_tokens, list(a.loads))
                for a in result.admits
            ],
            num_free_blocks=result.num_free_blocks,
            num_evictable_blocks=result.num_evictable_blocks,
            demotions=list(result.demotions),
        )

    async def recover(self, sequences: list[ResyncSequence], stopping: asyncio.Event | None = None) -> None:
        reg = self.directory.register_pool(
            self.num_blocks,
            self.block_size,
            self.namespace,
            "in-process",
            bt.PoolId(self.lease.pool_id) if self.lease else None,
            self.lease.pool_token if self.lease else None,  # a live pool is its owner's
            host=self.host,
        )
        self.lease = Lease(reg.pool_id, reg.epoch, reg.pool_token)
        self.directory.resync(
            reg.pool_id,
            reg.epoch,
            [
                bt.ResyncSequence(
                    s.sequence_id, s.block_ids, s.token_ids, s.cache_salt, s.public_prefix_tokens
                )
                for s in sequences
            ],
        )
        self.needs_recovery = False
        self.num_recoveries += 1

    async def renew_forever(self, wake: asyncio.Event) -> None:
        while True:  # the core's leases expire only when asked to; nothing to renew
            await asyncio.sleep(3600)

    async def close(self) -> None:
        pass

    # ----------------------------------------------------------- test hooks

    def fail_next_step(self) -> None:
        """The next `step` raises as if blockd were unreachable."""
        self._fail_next_step = True

    def restart_blockd(self) -> None:
        """blockd lost everything (a restart): our pool and its cached blocks are gone."""
        self.directory = BlockDirectory(self.directory.config)

    def _require_lease(self) -> Lease:
        if self.lease is None:
            raise DirectoryUnavailable("not registered with blockd yet")
        return self.lease
