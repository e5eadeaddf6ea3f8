"""Protobuf messages <-> directory types. No logic: field by field."""

from __future__ import annotations

from blockd.events import BlockEvent, EventKind
from blockd.ghosts import MissReason
from blockd.hashing import tokens_of
from blockd.types import (
    AdmitOp,
    BlockInfo,
    CachePolicy,
    CommitOp,
    GrowOp,
    InvalidArgument,
    MissExplanation,
    Namespace,
    PoolInfo,
    PoolMatch,
    PoolStats,
    ReleaseOp,
    ResyncSequence,
    SharedBlock,
    Tier,
    TierStats,
)
from kvcache.v1 import cache_policy_pb2 as cache_pb
from kvcache.v1 import directory_pb2 as pb

CACHE_POLICIES: dict[int, CachePolicy] = {
    cache_pb.CACHE_POLICY_UNSPECIFIED: CachePolicy.STORE,
    cache_pb.CACHE_POLICY_STORE: CachePolicy.STORE,
    cache_pb.CACHE_POLICY_READ_ONLY: CachePolicy.READ_ONLY,
    cache_pb.CACHE_POLICY_NONE: CachePolicy.NONE,
}
MISS_REASONS = {reason.value: getattr(pb, f"MISS_REASON_{reason.name}") for reason in MissReason}

# ------------------------------------------------------------------ requests


def namespace_from(msg: pb.Namespace) -> Namespace:
    return Namespace(msg.model_id, msg.model_revision, msg.dtype, msg.adapter_id)


def step_ops_from(
    request: pb.StepRequest,
) -> tuple[list[CommitOp], list[ReleaseOp], list[GrowOp], list[AdmitOp]]:
    return (
        [CommitOp(op.sequence_id, op.block_ids, op.token_ids, op.token_bytes) for op in request.commits],
        [ReleaseOp(op.sequence_id) for op in request.releases],
        [GrowOp(op.sequence_id, op.num_tokens) for op in request.grows],
        [
            AdmitOp(
                op.sequence_id,
                op.token_ids,
                op.cache_salt,
                op.public_prefix_tokens,
                cache_policy_from(op.cache_policy, f"admit of sequence {op.sequence_id}"),
                op.retention_priority,
                op.token_bytes,
            )
            for op in request.admits
        ],
    )


def cache_policy_from(value: int, what: str) -> CachePolicy:
    policy = CACHE_POLICIES.get(value)
    if policy is None:
        raise InvalidArgument(
            f"{what}: cache_policy {value} is not one of CACHE_POLICY_STORE (1), CACHE_POLICY_READ_ONLY "
            f"(2), CACHE_POLICY_NONE (3)"
        )
    return policy


def resync_sequences_from(request: pb.ResyncRequest) -> list[ResyncSequence]:
    return [
        ResyncSequence(s.sequence_id, s.block_ids, s.token_ids, s.cache_salt, s.public_prefix_tokens)
        for s in request.sequences
    ]


# ------------------------------------------------------------------ responses


def namespace_to(namespace: Namespace) -> pb.Namespace:
    return pb.Namespace(
        model_id=namespace.model_id,
        model_revision=namespace.model_revision,
        dtype=namespace.dtype,
        adapter_id=namespace.adapter_id,
    )


def pool_stats_to(stats: PoolStats) -> pb.PoolStats:
    return pb.PoolStats(
        pool_id=stats.pool_id or "",
        num_blocks=stats.num_blocks,
        block_size=stats.block_size,
        num_free_blocks=stats.num_free_blocks,
        num_evictable_blocks=stats.num_evictable_blocks,
        num_referenced_blocks=stats.num_referenced_blocks,
        num_pinned_blocks=stats.num_pinned_blocks,
        num_cached_blocks=stats.num_cached_blocks,
        num_sequences=stats.num_sequences,
        queried_tokens=stats.queried_tokens,
        hit_tokens=stats.hit_tokens,
        num_evictions=stats.num_evictions,
        num_admissions=stats.num_admissions,
        num_admissions_deferred=stats.num_admissions_deferred,
        miss_tokens=[
            pb.MissTokens(reason=MISS_REASONS[reason], num_tokens=num_tokens)
            for reason, num_tokens in stats.miss_tokens
        ],
        num_ghosts=stats.num_ghosts,
        max_ghosts=stats.max_ghosts,
        eviction_policy=stats.eviction_policy,
        host=tier_stats_to(stats.host) if stats.host is not None else None,
        shared=tier_stats_to(stats.shared) if stats.shared is not None else None,
    )


def shared_block_to(block: SharedBlock) -> pb.SharedBlock:
    return pb.SharedBlock(
        block_id=block.block_id,
        block_hash=block.block_hash,
        parent_hash=block.parent_hash or b"",
        token_ids=tokens_of(block.token_bytes),
        salt_digest=block.salt_digest or b"",
        block_index=block.depth,
        chain_digest=block.chain_digest,
    )


TIERS = {Tier.DEVICE: pb.TIER_DEVICE, Tier.HOST: pb.TIER_HOST, Tier.SHARED: pb.TIER_SHARED}
TIERS_FROM = {value: tier for tier, value in TIERS.items()}


def tier_stats_to(stats: TierStats) -> pb.TierStats:
    return pb.TierStats(
        tier=TIERS[stats.tier],
        num_blocks=stats.num_blocks,
        num_free_blocks=stats.num_free_blocks,
        num_evictable_blocks=stats.num_evictable_blocks,
        num_referenced_blocks=stats.num_referenced_blocks,
        hit_tokens=stats.hit_tokens,
        num_demotions=stats.num_demotions,
        num_loads=stats.num_loads,
        num_evictions=stats.num_evictions,
        num_loads_skipped=stats.num_loads_skipped,
        load_seconds_per_block=stats.load_seconds_per_block,
        recompute_seconds_per_block=stats.recompute_seconds_per_block,
    )


def pool_info_to(info: PoolInfo) -> pb.PoolInfo:
    return pb.PoolInfo(
        pool_id=info.pool_id,
        epoch=info.epoch,
        namespace=namespace_to(info.namespace),
        block_size=info.block_size,
        num_blocks=info.num_blocks,
        worker_address=info.worker_address,
        lease_remaining_seconds=info.lease_remaining_seconds,
        is_live=info.is_live,
        stats=pool_stats_to(info.stats),
    )


def block_info_to(info: BlockInfo) -> pb.BlockInfo:
    return pb.BlockInfo(
        pool_id=info.pool_id,
        block_id=info.block_id,
        block_hash=info.block_hash,
        parent_hash=info.parent_hash or b"",
        token_ids=info.token_ids,
        ref_count=info.ref_count,
        is_pinned=info.is_pinned,
        block_index=info.block_index,
        is_salted=info.is_salted,
    )


def pool_match_to(match: PoolMatch) -> pb.PoolMatch:
    return pb.PoolMatch(
        pool_id=match.pool_id,
        worker_address=match.worker_address,
        num_cached_tokens=match.num_cached_tokens,
        load=match.load,
        num_sequences=match.num_sequences,
        num_host_cached_tokens=match.num_host_cached_tokens,
        num_shared_cached_tokens=match.num_shared_cached_tokens,
    )


_EVENT_KINDS = {
    EventKind.STORED: pb.BLOCK_EVENT_KIND_STORED,
    EventKind.REMOVED: pb.BLOCK_EVENT_KIND_REMOVED,
    EventKind.CLEARED: pb.BLOCK_EVENT_KIND_CLEARED,
    EventKind.GAP: pb.BLOCK_EVENT_KIND_GAP,
    EventKind.DEMOTED: pb.BLOCK_EVENT_KIND_DEMOTED,
    EventKind.LOADED: pb.BLOCK_EVENT_KIND_LOADED,
}


def event_to(event: BlockEvent) -> pb.WatchEventsResponse:
    return pb.WatchEventsResponse(
        sequence=event.sequence,
        kind=_EVENT_KINDS[event.kind],
        pool_id=event.pool_id or "",
        block_hashes=event.block_hashes,
        parent_hash=event.parent_hash or b"",
        token_ids=tokens_of(event.token_bytes),
        block_ids=event.block_ids,
        tier=TIERS[event.tier] if event.kind is not EventKind.GAP else pb.TIER_UNSPECIFIED,
    )


def explanation_to(explanation: MissExplanation) -> pb.MissExplanation:
    return pb.MissExplanation(
        pool_id=explanation.pool_id,
        worker_address=explanation.worker_address,
        num_cached_tokens=explanation.num_cached_tokens,
        reason=MISS_REASONS[explanation.reason] if explanation.reason else pb.MISS_REASON_UNSPECIFIED,
        num_missed_tokens=explanation.num_missed_tokens,
        num_partial_tokens=explanation.num_partial_tokens,
        first_missing_block=explanation.first_missing_block,
        evicted_by=explanation.evicted_by,
        seconds_ago=explanation.seconds_ago,
        other_pool_ids=explanation.other_pool_ids,
    )
