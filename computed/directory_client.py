"""The one way computed talks to blockd: register, a batched Step per iteration, resync.

Steps travel on one long-lived StepStream (computed.step_stream), answered as unary
Step calls would be, at about half of blockd's CPU per Step.

Every failure of blockd (down, restarted, lease lapsed, stale epoch) surfaces as
`DirectoryUnavailable`; the engine then calls `recover()`, which re-registers the
same pool id (blockd resets it) and re-declares the live sequences with `Resync`.
With `compact_steps`, prompts travel as packed `token_bytes` and a commit of blocks
inside the prompt this client admitted sends no tokens (commit by block index).
Re-registering presents the pool_token blockd answered at the first registration: a
blockd with a worker token resets a live pool only for its owner. Every call carries
the worker token, when there is one, as 'authorization: Bearer <token>'.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import grpc
import structlog

from computed.directory_ops import (
    AdmitResult,
    DirectoryOps,
    DirectoryResult,
    GrowResult,
    ResyncSequence,
)
from computed.errors import DirectoryUnavailable
from computed.shared_store import StoredBlock
from computed.step_stream import StepStream
from kvcache.v1 import cache_policy_pb2
from kvcache.v1 import directory_pb2 as pb
from kvcache.v1 import directory_pb2_grpc as pb_grpc
from kvcache_contract.block_hash import token_bytes
from kvcache_contract.shared_value import NO_DIGEST

CACHE_POLICIES = {
    "store": cache_policy_pb2.CACHE_POLICY_STORE,
    "read_only": cache_policy_pb2.CACHE_POLICY_READ_ONLY,
    "none": cache_policy_pb2.CACHE_POLICY_NONE,
}

log = structlog.get_logger("computed.directory")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class PoolSpec:
    num_blocks: int
    block_size: int
    model_id: str
    model_revision: str
    dtype: str
    worker_address: str
    # The host tier (0: none) and the measured costs behind blockd's load decisions.
    num_host_blocks: int = 0
    host_load_seconds_per_block: float = 0.0
    prefill_seconds_per_token: float = 0.0
    # The shared tier (a Valkey/Redis store every worker of the namespace reaches).
    has_shared_tier: bool = False
    shared_load_seconds_per_block: float = 0.0


@dataclass
class PoolLease:
    """What blockd granted: runtime state, replaced at every (re-)registration."""

    pool_id: str
    epoch: int
    lease_ttl_seconds: float
    pool_token: str = ""  # proves to blockd that this worker owns pool_id
    shared_namespace: str = ""  # the shared tier's key namespace (hex), when it has one


class DirectoryClient:
    def __init__(
        self,
        address: str,
        spec: PoolSpec,
        credentials: grpc.ChannelCredentials | None = None,
        call_timeout: float = 10.0,
        worker_token: str | None = None,
        compact_steps: bool = True,
    ) -> None:
        self.address = address
        # Prompts as packed token_bytes, commits inside the prompt by block index (blockd
        # parses a packed prompt ~4x faster and commits need not resend what it holds:
        # bench.blockd_grpc). Off: the varint token_ids forms, for a blockd before them.
        self.compact_steps = compact_steps
        self.spec = spec
        self.call_timeout = call_timeout
        self._metadata = (("authorization", f"Bearer {worker_token}"),) if worker_token else None
        options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ]
        self._channel = (
            grpc.aio.secure_channel(address, credentials, options=options)
            if credentials
            else grpc.aio.insecure_channel(address, options=options)
        )
        self._stub = pb_grpc.BlockDirectoryServiceStub(self._channel)
        self._steps = StepStream(self._stub, self._metadata)  # Steps on one stream
        self.lease: PoolLease | None = None
        # Per admitted sequence: (prompt tokens blockd holds, block id -> its index in
        # the table). A commit inside that prompt sends no tokens (blockd has them); a
        # sequence missing here (resynced after a failure) sends them.
        self._held: dict[int, tuple[int, dict[int, int]]] = {}
        # Set by the lease renewer when blockd no longer knows our epoch.
        self.needs_recovery = False

    async def close(self) -> None:
        self._steps.close()
        await self._channel.close()

    async def register(self) -> PoolLease:
        spec = self.spec
        request = pb.RegisterPoolRequest(
            num_blocks=spec.num_blocks,
            block_size=spec.block_size,
            namespace=pb.Namespace(
                model_id=spec.model_id, model_revision=spec.model_revision, dtype=spec.dtype
            ),
            worker_address=spec.worker_address,
            pool_id=self.lease.pool_id if self.lease else "",
            pool_token=self.lease.pool_token if self.lease else "",
            num_host_blocks=spec.num_host_blocks,
            host_load_seconds_per_block=spec.host_load_seconds_per_block,
            prefill_seconds_per_token=spec.prefill_seconds_per_token,
            has_shared_tier=spec.has_shared_tier,
            shared_load_seconds_per_block=spec.shared_load_seconds_per_block,
        )
        reply = await self._call(self._stub.RegisterPool, request)
        self._held.clear()  # a (re-)registered pool holds no sequence
        self.lease = PoolLease(
            reply.pool_id, reply.epoch, reply.lease_ttl_seconds, reply.pool_token, reply.shared_namespace
        )
        log.info(
            "pool_registered",
            pool_id=reply.pool_id,
            epoch=reply.epoch,
            lease_ttl=reply.lease_ttl_seconds,
            blockd=self.address,
        )
        return self.lease

    async def step(self, ops: DirectoryOps) -> DirectoryResult:
        lease = self._require_lease()
        request = pb.StepRequest(
            pool_id=lease.pool_id,
            epoch=lease.epoch,
            commits=[
                self._commit_op(c.sequence_id, c.block_ids, c.token_ids)
                if self.compact_steps
                else pb.CommitOp(sequence_id=c.sequence_id, block_ids=c.block_ids, token_ids=c.token_ids)
                for c in ops.commits
            ],
            releases=[pb.ReleaseOp(sequence_id=s) for s in ops.releases],
            grows=[pb.GrowOp(sequence_id=g.sequence_id, num_tokens=g.num_tokens) for g in ops.grows],
            admits=[
                pb.AdmitOp(
                    sequence_id=a.sequence_id,
                    token_ids=() if self.compact_steps else a.token_ids,
                    token_bytes=token_bytes(a.token_ids) if self.compact_steps else b"",
                    cache_salt=a.cache_salt,
                    public_prefix_tokens=a.public_prefix_tokens,
                    cache_policy=CACHE_POLICIES[a.cache_policy],
                    retention_priority=a.retention_priority,
                )
                for a in ops.admits
            ],
            shared_written=ops.shared_written,
            shared_failed=ops.shared_failed,
            shared_missing=ops.shared_missing,
        )
        try:
            reply = await self._call(self._steps, request)
        except DirectoryUnavailable:
            self.needs_recovery = True  # the Directory contract: recover before the next step
            self._held.clear()  # recovery resyncs: from then on commits send their tokens
            raise
        if self.compact_steps:
            self._track(ops, reply)
        return DirectoryResult(
            grows=[GrowResult(g.sequence_id, g.grown, list(g.new_block_ids)) for g in reply.grows],
            admits=[
                AdmitResult(
                    a.sequence_id,
                    a.admitted,
                    list(a.block_ids),
                    a.num_cached_tokens,
                    [(c.block_id, c.host_block_id) for c in a.loads],
                    [_stored_block(b) for b in a.shared_loads],
                )
                for a in reply.admits
            ],
            num_free_blocks=reply.num_free_blocks,
            num_evictable_blocks=reply.num_evictable_blocks,
            demotions=[(c.block_id, c.host_block_id) for c in reply.demotions],
            shared_stores=[_stored_block(b) for b in reply.shared_stores],
        )

    def _track(self, ops: DirectoryOps, reply: pb.StepResponse) -> None:
        """What blockd now holds of each sequence's tokens (for `_commit_op`)."""
        # blockd applied the whole Step: commits, releases, grows, then admits.
        for sequence_id in ops.releases:
            self._held.pop(sequence_id, None)
        for g in reply.grows:
            held = self._held.get(g.sequence_id)
            if held is not None:
                positions = held[1]
                for block_id in g.new_block_ids:
                    positions[block_id] = len(positions)
        results = {a.sequence_id: a for a in reply.admits if a.admitted}
        for a in ops.admits:
            result = results.get(a.sequence_id)
            if result is not None:
                self._held[a.sequence_id] = (len(a.token_ids), {b: i for i, b in enumerate(result.block_ids)})

    def _commit_op(self, sequence_id: int, block_ids: list[int], token_ids: list[int]) -> pb.CommitOp:
        """The commit, without its tokens when blockd holds them already: the run lies
        inside the prompt this client admitted (its place in the block table says where),
        so blockd takes the tokens from its own copy (commit by block index)."""
        held = self._held.get(sequence_id)
        if held is not None and block_ids:
            num_prompt_tokens, positions = held
            first = positions.get(block_ids[0])
            if first is not None and (first + len(block_ids)) * self.spec.block_size <= num_prompt_tokens:
                return pb.CommitOp(sequence_id=sequence_id, block_ids=block_ids)
        return pb.CommitOp(sequence_id=sequence_id, block_ids=block_ids, token_bytes=token_bytes(token_ids))

    async def resync(self, sequences: list[ResyncSequence]) -> None:
        lease = self._require_lease()
        request = pb.ResyncRequest(
            pool_id=lease.pool_id,
            epoch=lease.epoch,
            sequences=[
                pb.ResyncSequence(
                    sequence_id=s.sequence_id,
                    block_ids=s.block_ids,
                    token_ids=s.token_ids,
                    cache_salt=s.cache_salt,
                    public_prefix_tokens=s.public_prefix_tokens,
                )
                for s in sequences
            ],
        )
        reply = await self._call(self._stub.Resync, request)
        log.info(
            "pool_resynced",
            pool_id=lease.pool_id,
            epoch=lease.epoch,
            sequences=reply.num_sequences,
            committed_blocks=reply.num_committed_blocks,
        )

    async def recover(self, live: list[ResyncSequence], stopping: asyncio.Event | None = None) -> None:
        """Re-register and resync until blockd answers (backoff with jitter)."""
        delay = 0.05
        while True:
            try:
                await self.register()
                await self.resync(live)
                self.needs_recovery = False
                return
            except DirectoryUnavailable as exc:
                if stopping is not None and stopping.is_set():
                    raise
                log.warning("blockd_recovery_retry", error=str(exc), retry_in=round(delay, 3))
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 2.0)

    async def renew_forever(self, wake: asyncio.Event) -> None:
        """Renew the lease at a third of its TTL; flag recovery when blockd lost us."""
        while True:
            ttl = self.lease.lease_ttl_seconds if self.lease else 3.0
            await asyncio.sleep(max(0.05, ttl / 3))
            if self.lease is None or self.needs_recovery:
                continue
            try:
                await self._call(
                    self._stub.RenewLease,
                    pb.RenewLeaseRequest(pool_id=self.lease.pool_id, epoch=self.lease.epoch),
                )
            except DirectoryUnavailable as exc:
                log.warning("lease_renewal_failed", error=str(exc))
                self.needs_recovery = True
                wake.set()

    def _require_lease(self) -> PoolLease:
        if self.lease is None:
            raise DirectoryUnavailable("not registered with blockd yet")
        return self.lease

    async def _call(self, method, request):
        try:
            return await method(request, timeout=self.call_timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.CANCELLED,
            ) and not _transport_lost(exc):
                # Anything else means our bookkeeping disagrees with blockd's: resync heals it.
                log.error(
                    "blockd_refused",
                    method=getattr(method, "_method", b"?"),
                    code=exc.code().name,
                    details=exc.details(),
                )
            raise DirectoryUnavailable(f"{exc.code().name}: {exc.details()}") from exc


# What gRPC's own core answers (INTERNAL) when the connection dies under a call, e.g. blockd
# killed mid-Step (tests/reliability/test_faults.py saw it in 1 of 3 CI runs): a lost
# blockd, like UNAVAILABLE, not an answer of blockd's, whose INTERNAL details differ.
_CORE_INTERNAL_DETAILS = "Internal error from Core"


def _transport_lost(exc: grpc.aio.AioRpcError) -> bool:
    return exc.code() == grpc.StatusCode.INTERNAL and exc.details() == _CORE_INTERNAL_DETAILS


def _stored_block(msg: pb.SharedBlock) -> StoredBlock:
    return StoredBlock(
        msg.block_id,
        msg.block_hash,
        msg.parent_hash or None,
        tuple(msg.token_ids),
        msg.salt_digest or None,
        msg.block_index,
        msg.chain_digest or NO_DIGEST,
    )
