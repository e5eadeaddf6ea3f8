from kvcache.v1 import cache_policy_pb2 as _cache_policy_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_DEVICE: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
    TIER_SHARED: _ClassVar[Tier]

class BlockEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BLOCK_EVENT_KIND_UNSPECIFIED: _ClassVar[BlockEventKind]
    BLOCK_EVENT_KIND_STORED: _ClassVar[BlockEventKind]
    BLOCK_EVENT_KIND_REMOVED: _ClassVar[BlockEventKind]
    BLOCK_EVENT_KIND_CLEARED: _ClassVar[BlockEventKind]
    BLOCK_EVENT_KIND_GAP: _ClassVar[BlockEventKind]
    BLOCK_EVENT_KIND_DEMOTED: _ClassVar[BlockEventKind]
    BLOCK_EVENT_KIND_LOADED: _ClassVar[BlockEventKind]

class MissReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MISS_REASON_UNSPECIFIED: _ClassVar[MissReason]
    MISS_REASON_PARTIAL_BLOCK: _ClassVar[MissReason]
    MISS_REASON_NEVER_SEEN: _ClassVar[MissReason]
    MISS_REASON_EVICTED: _ClassVar[MissReason]
    MISS_REASON_FLUSHED: _ClassVar[MissReason]
    MISS_REASON_NOT_STORED: _ClassVar[MissReason]
    MISS_REASON_OTHER_SALT: _ClassVar[MissReason]
    MISS_REASON_OTHER_NAMESPACE: _ClassVar[MissReason]
    MISS_REASON_NOT_LOADED: _ClassVar[MissReason]
    MISS_REASON_BYPASSED: _ClassVar[MissReason]
    MISS_REASON_NOT_ADMITTED: _ClassVar[MissReason]
TIER_UNSPECIFIED: Tier
TIER_DEVICE: Tier
TIER_HOST: Tier
TIER_SHARED: Tier
BLOCK_EVENT_KIND_UNSPECIFIED: BlockEventKind
BLOCK_EVENT_KIND_STORED: BlockEventKind
BLOCK_EVENT_KIND_REMOVED: BlockEventKind
BLOCK_EVENT_KIND_CLEARED: BlockEventKind
BLOCK_EVENT_KIND_GAP: BlockEventKind
BLOCK_EVENT_KIND_DEMOTED: BlockEventKind
BLOCK_EVENT_KIND_LOADED: BlockEventKind
MISS_REASON_UNSPECIFIED: MissReason
MISS_REASON_PARTIAL_BLOCK: MissReason
MISS_REASON_NEVER_SEEN: MissReason
MISS_REASON_EVICTED: MissReason
MISS_REASON_FLUSHED: MissReason
MISS_REASON_NOT_STORED: MissReason
MISS_REASON_OTHER_SALT: MissReason
MISS_REASON_OTHER_NAMESPACE: MissReason
MISS_REASON_NOT_LOADED: MissReason
MISS_REASON_BYPASSED: MissReason
MISS_REASON_NOT_ADMITTED: MissReason

class Namespace(_message.Message):
    __slots__ = ("model_id", "model_revision", "dtype", "adapter_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_REVISION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    model_revision: str
    dtype: str
    adapter_id: str
    def __init__(self, model_id: _Optional[str] = ..., model_revision: _Optional[str] = ..., dtype: _Optional[str] = ..., adapter_id: _Optional[str] = ...) -> None: ...

class StepStreamRequest(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: StepRequest
    def __init__(self, step: _Optional[_Union[StepRequest, _Mapping]] = ...) -> None: ...

class StepStreamResponse(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: StepResponse
    def __init__(self, step: _Optional[_Union[StepResponse, _Mapping]] = ...) -> None: ...

class RegisterPoolRequest(_message.Message):
    __slots__ = ("num_blocks", "block_size", "namespace", "worker_address", "pool_id", "pool_token", "num_host_blocks", "host_load_seconds_per_block", "prefill_seconds_per_token", "has_shared_tier", "shared_load_seconds_per_block")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_LOAD_SECONDS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HAS_SHARED_TIER_FIELD_NUMBER: _ClassVar[int]
    SHARED_LOAD_SECONDS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    block_size: int
    namespace: Namespace
    worker_address: str
    pool_id: str
    pool_token: str
    num_host_blocks: int
    host_load_seconds_per_block: float
    prefill_seconds_per_token: float
    has_shared_tier: bool
    shared_load_seconds_per_block: float
    def __init__(self, num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., namespace: _Optional[_Union[Namespace, _Mapping]] = ..., worker_address: _Optional[str] = ..., pool_id: _Optional[str] = ..., pool_token: _Optional[str] = ..., num_host_blocks: _Optional[int] = ..., host_load_seconds_per_block: _Optional[float] = ..., prefill_seconds_per_token: _Optional[float] = ..., has_shared_tier: _Optional[bool] = ..., shared_load_seconds_per_block: _Optional[float] = ...) -> None: ...

class RegisterPoolResponse(_message.Message):
    __slots__ = ("pool_id", "epoch", "lease_ttl_seconds", "max_sequence_tokens", "pool_token", "shared_namespace")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POOL_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SHARED_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    epoch: int
    lease_ttl_seconds: float
    max_sequence_tokens: int
    pool_token: str
    shared_namespace: str
    def __init__(self, pool_id: _Optional[str] = ..., epoch: _Optional[int] = ..., lease_ttl_seconds: _Optional[float] = ..., max_sequence_tokens: _Optional[int] = ..., pool_token: _Optional[str] = ..., shared_namespace: _Optional[str] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("pool_id", "epoch")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    epoch: int
    def __init__(self, pool_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class RenewLeaseResponse(_message.Message):
    __slots__ = ("lease_ttl_seconds",)
    LEASE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    lease_ttl_seconds: float
    def __init__(self, lease_ttl_seconds: _Optional[float] = ...) -> None: ...

class AdmitOp(_message.Message):
    __slots__ = ("sequence_id", "token_ids", "token_bytes", "cache_salt", "public_prefix_tokens", "cache_policy", "retention_priority")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_POLICY_FIELD_NUMBER: _ClassVar[int]
    RETENTION_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_bytes: bytes
    cache_salt: str
    public_prefix_tokens: int
    cache_policy: _cache_policy_pb2.CachePolicy
    retention_priority: int
    def __init__(self, sequence_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., token_bytes: _Optional[bytes] = ..., cache_salt: _Optional[str] = ..., public_prefix_tokens: _Optional[int] = ..., cache_policy: _Optional[_Union[_cache_policy_pb2.CachePolicy, str]] = ..., retention_priority: _Optional[int] = ...) -> None: ...

class AdmitResult(_message.Message):
    __slots__ = ("sequence_id", "admitted", "block_ids", "num_cached_tokens", "loads", "shared_loads")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    SHARED_LOADS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    admitted: bool
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: int
    loads: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    shared_loads: _containers.RepeatedCompositeFieldContainer[SharedBlock]
    def __init__(self, sequence_id: _Optional[int] = ..., admitted: _Optional[bool] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[int] = ..., loads: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., shared_loads: _Optional[_Iterable[_Union[SharedBlock, _Mapping]]] = ...) -> None: ...

class SharedBlock(_message.Message):
    __slots__ = ("block_id", "block_hash", "parent_hash", "token_ids", "salt_digest", "block_index", "chain_digest")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SALT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    CHAIN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    block_id: int
    block_hash: bytes
    parent_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    salt_digest: bytes
    block_index: int
    chain_digest: bytes
    def __init__(self, block_id: _Optional[int] = ..., block_hash: _Optional[bytes] = ..., parent_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., salt_digest: _Optional[bytes] = ..., block_index: _Optional[int] = ..., chain_digest: _Optional[bytes] = ...) -> None: ...

class BlockCopy(_message.Message):
    __slots__ = ("block_id", "host_block_id")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    block_id: int
    host_block_id: int
    def __init__(self, block_id: _Optional[int] = ..., host_block_id: _Optional[int] = ...) -> None: ...

class GrowOp(_message.Message):
    __slots__ = ("sequence_id", "num_tokens")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    num_tokens: int
    def __init__(self, sequence_id: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class GrowResult(_message.Message):
    __slots__ = ("sequence_id", "grown", "new_block_ids")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    GROWN_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    grown: bool
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sequence_id: _Optional[int] = ..., grown: _Optional[bool] = ..., new_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitOp(_message.Message):
    __slots__ = ("sequence_id", "block_ids", "token_ids", "token_bytes")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_bytes: bytes
    def __init__(self, sequence_id: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., token_bytes: _Optional[bytes] = ...) -> None: ...

class ReleaseOp(_message.Message):
    __slots__ = ("sequence_id",)
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    def __init__(self, sequence_id: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("pool_id", "epoch", "commits", "releases", "grows", "admits", "shared_written", "shared_failed", "shared_missing")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    COMMITS_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    GROWS_FIELD_NUMBER: _ClassVar[int]
    ADMITS_FIELD_NUMBER: _ClassVar[int]
    SHARED_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    SHARED_FAILED_FIELD_NUMBER: _ClassVar[int]
    SHARED_MISSING_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    epoch: int
    commits: _containers.RepeatedCompositeFieldContainer[CommitOp]
    releases: _containers.RepeatedCompositeFieldContainer[ReleaseOp]
    grows: _containers.RepeatedCompositeFieldContainer[GrowOp]
    admits: _containers.RepeatedCompositeFieldContainer[AdmitOp]
    shared_written: _containers.RepeatedScalarFieldContainer[bytes]
    shared_failed: _containers.RepeatedScalarFieldContainer[bytes]
    shared_missing: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, pool_id: _Optional[str] = ..., epoch: _Optional[int] = ..., commits: _Optional[_Iterable[_Union[CommitOp, _Mapping]]] = ..., releases: _Optional[_Iterable[_Union[ReleaseOp, _Mapping]]] = ..., grows: _Optional[_Iterable[_Union[GrowOp, _Mapping]]] = ..., admits: _Optional[_Iterable[_Union[AdmitOp, _Mapping]]] = ..., shared_written: _Optional[_Iterable[bytes]] = ..., shared_failed: _Optional[_Iterable[bytes]] = ..., shared_missing: _Optional[_Iterable[bytes]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("grows", "admits", "num_free_blocks", "num_evictable_blocks", "demotions", "shared_stores")
    GROWS_FIELD_NUMBER: _ClassVar[int]
    ADMITS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    SHARED_STORES_FIELD_NUMBER: _ClassVar[int]
    grows: _containers.RepeatedCompositeFieldContainer[GrowResult]
    admits: _containers.RepeatedCompositeFieldContainer[AdmitResult]
    num_free_blocks: int
    num_evictable_blocks: int
    demotions: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    shared_stores: _containers.RepeatedCompositeFieldContainer[SharedBlock]
    def __init__(self, grows: _Optional[_Iterable[_Union[GrowResult, _Mapping]]] = ..., admits: _Optional[_Iterable[_Union[AdmitResult, _Mapping]]] = ..., num_free_blocks: _Optional[int] = ..., num_evictable_blocks: _Optional[int] = ..., demotions: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., shared_stores: _Optional[_Iterable[_Union[SharedBlock, _Mapping]]] = ...) -> None: ...

class ResyncSequence(_message.Message):
    __slots__ = ("sequence_id", "block_ids", "token_ids", "cache_salt", "public_prefix_tokens")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    public_prefix_tokens: int
    def __init__(self, sequence_id: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., public_prefix_tokens: _Optional[int] = ...) -> None: ...

class ResyncRequest(_message.Message):
    __slots__ = ("pool_id", "epoch", "sequences")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    epoch: int
    sequences: _containers.RepeatedCompositeFieldContainer[ResyncSequence]
    def __init__(self, pool_id: _Optional[str] = ..., epoch: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[ResyncSequence, _Mapping]]] = ...) -> None: ...

class ResyncResponse(_message.Message):
    __slots__ = ("num_sequences", "num_committed_blocks")
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NUM_COMMITTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_sequences: int
    num_committed_blocks: int
    def __init__(self, num_sequences: _Optional[int] = ..., num_committed_blocks: _Optional[int] = ...) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("pool_id", "num_blocks", "block_size", "num_free_blocks", "num_evictable_blocks", "num_referenced_blocks", "num_pinned_blocks", "num_cached_blocks", "num_sequences", "queried_tokens", "hit_tokens", "num_evictions", "num_admissions", "num_admissions_deferred", "miss_tokens", "num_ghosts", "max_ghosts", "eviction_policy", "host", "shared")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_REFERENCED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_ADMISSIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_ADMISSIONS_DEFERRED_FIELD_NUMBER: _ClassVar[int]
    MISS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_GHOSTS_FIELD_NUMBER: _ClassVar[int]
    MAX_GHOSTS_FIELD_NUMBER: _ClassVar[int]
    EVICTION_POLICY_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    num_blocks: int
    block_size: int
    num_free_blocks: int
    num_evictable_blocks: int
    num_referenced_blocks: int
    num_pinned_blocks: int
    num_cached_blocks: int
    num_sequences: int
    queried_tokens: int
    hit_tokens: int
    num_evictions: int
    num_admissions: int
    num_admissions_deferred: int
    miss_tokens: _containers.RepeatedCompositeFieldContainer[MissTokens]
    num_ghosts: int
    max_ghosts: int
    eviction_policy: str
    host: TierStats
    shared: TierStats
    def __init__(self, pool_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_evictable_blocks: _Optional[int] = ..., num_referenced_blocks: _Optional[int] = ..., num_pinned_blocks: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., num_sequences: _Optional[int] = ..., queried_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., num_evictions: _Optional[int] = ..., num_admissions: _Optional[int] = ..., num_admissions_deferred: _Optional[int] = ..., miss_tokens: _Optional[_Iterable[_Union[MissTokens, _Mapping]]] = ..., num_ghosts: _Optional[int] = ..., max_ghosts: _Optional[int] = ..., eviction_policy: _Optional[str] = ..., host: _Optional[_Union[TierStats, _Mapping]] = ..., shared: _Optional[_Union[TierStats, _Mapping]] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "num_blocks", "num_free_blocks", "num_evictable_blocks", "num_referenced_blocks", "hit_tokens", "num_demotions", "num_loads", "num_evictions", "num_loads_skipped", "load_seconds_per_block", "recompute_seconds_per_block")
    TIER_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_REFERENCED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOADS_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOADS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_SECONDS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    num_blocks: int
    num_free_blocks: int
    num_evictable_blocks: int
    num_referenced_blocks: int
    hit_tokens: int
    num_demotions: int
    num_loads: int
    num_evictions: int
    num_loads_skipped: int
    load_seconds_per_block: float
    recompute_seconds_per_block: float
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_evictable_blocks: _Optional[int] = ..., num_referenced_blocks: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., num_demotions: _Optional[int] = ..., num_loads: _Optional[int] = ..., num_evictions: _Optional[int] = ..., num_loads_skipped: _Optional[int] = ..., load_seconds_per_block: _Optional[float] = ..., recompute_seconds_per_block: _Optional[float] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("pool_id",)
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    def __init__(self, pool_id: _Optional[str] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("total", "pools", "last_event_sequence")
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    total: PoolStats
    pools: _containers.RepeatedCompositeFieldContainer[PoolStats]
    last_event_sequence: int
    def __init__(self, total: _Optional[_Union[PoolStats, _Mapping]] = ..., pools: _Optional[_Iterable[_Union[PoolStats, _Mapping]]] = ..., last_event_sequence: _Optional[int] = ...) -> None: ...

class PoolInfo(_message.Message):
    __slots__ = ("pool_id", "epoch", "namespace", "block_size", "num_blocks", "worker_address", "lease_remaining_seconds", "is_live", "stats")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IS_LIVE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    epoch: int
    namespace: Namespace
    block_size: int
    num_blocks: int
    worker_address: str
    lease_remaining_seconds: float
    is_live: bool
    stats: PoolStats
    def __init__(self, pool_id: _Optional[str] = ..., epoch: _Optional[int] = ..., namespace: _Optional[_Union[Namespace, _Mapping]] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., worker_address: _Optional[str] = ..., lease_remaining_seconds: _Optional[float] = ..., is_live: _Optional[bool] = ..., stats: _Optional[_Union[PoolStats, _Mapping]] = ...) -> None: ...

class ListPoolsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPoolsResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolInfo]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolInfo, _Mapping]]] = ...) -> None: ...

class BlockInfo(_message.Message):
    __slots__ = ("pool_id", "block_id", "block_hash", "parent_hash", "token_ids", "ref_count", "is_pinned", "block_index", "is_salted")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REF_COUNT_FIELD_NUMBER: _ClassVar[int]
    IS_PINNED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    IS_SALTED_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    block_id: int
    block_hash: bytes
    parent_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    ref_count: int
    is_pinned: bool
    block_index: int
    is_salted: bool
    def __init__(self, pool_id: _Optional[str] = ..., block_id: _Optional[int] = ..., block_hash: _Optional[bytes] = ..., parent_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., ref_count: _Optional[int] = ..., is_pinned: _Optional[bool] = ..., block_index: _Optional[int] = ..., is_salted: _Optional[bool] = ...) -> None: ...

class ListBlocksRequest(_message.Message):
    __slots__ = ("pool_id", "page_size", "page_token")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    page_size: int
    page_token: str
    def __init__(self, pool_id: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListBlocksResponse(_message.Message):
    __slots__ = ("blocks", "next_page_token")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockInfo]
    next_page_token: str
    def __init__(self, blocks: _Optional[_Iterable[_Union[BlockInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("token_ids", "cache_salt", "public_prefix_tokens", "pool_id")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    public_prefix_tokens: int
    pool_id: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., public_prefix_tokens: _Optional[int] = ..., pool_id: _Optional[str] = ...) -> None: ...

class PoolMatch(_message.Message):
    __slots__ = ("pool_id", "worker_address", "num_cached_tokens", "load", "num_sequences", "num_host_cached_tokens", "num_shared_cached_tokens")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARED_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    worker_address: str
    num_cached_tokens: int
    load: float
    num_sequences: int
    num_host_cached_tokens: int
    num_shared_cached_tokens: int
    def __init__(self, pool_id: _Optional[str] = ..., worker_address: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., load: _Optional[float] = ..., num_sequences: _Optional[int] = ..., num_host_cached_tokens: _Optional[int] = ..., num_shared_cached_tokens: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("matches",)
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    matches: _containers.RepeatedCompositeFieldContainer[PoolMatch]
    def __init__(self, matches: _Optional[_Iterable[_Union[PoolMatch, _Mapping]]] = ...) -> None: ...

class FlushRequest(_message.Message):
    __slots__ = ("pool_id", "cache_salt", "tier")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    cache_salt: str
    tier: Tier
    def __init__(self, pool_id: _Optional[str] = ..., cache_salt: _Optional[str] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class TierFlush(_message.Message):
    __slots__ = ("tier", "dropped", "busy")
    TIER_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    dropped: int
    busy: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., dropped: _Optional[int] = ..., busy: _Optional[int] = ...) -> None: ...

class FlushResponse(_message.Message):
    __slots__ = ("dropped", "busy", "tiers")
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    dropped: int
    busy: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierFlush]
    def __init__(self, dropped: _Optional[int] = ..., busy: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierFlush, _Mapping]]] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("token_ids", "cache_salt", "public_prefix_tokens", "ttl_seconds", "pool_id")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    public_prefix_tokens: int
    ttl_seconds: float
    pool_id: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., public_prefix_tokens: _Optional[int] = ..., ttl_seconds: _Optional[float] = ..., pool_id: _Optional[str] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("pin_id", "num_pinned_tokens", "num_pinned_blocks", "expires_in_seconds")
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    pin_id: str
    num_pinned_tokens: int
    num_pinned_blocks: int
    expires_in_seconds: float
    def __init__(self, pin_id: _Optional[str] = ..., num_pinned_tokens: _Optional[int] = ..., num_pinned_blocks: _Optional[int] = ..., expires_in_seconds: _Optional[float] = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("pin_id", "all")
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    pin_id: str
    all: bool
    def __init__(self, pin_id: _Optional[str] = ..., all: _Optional[bool] = ...) -> None: ...

class UnpinResponse(_message.Message):
    __slots__ = ("num_unpinned_blocks", "num_unpinned_pins")
    NUM_UNPINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_UNPINNED_PINS_FIELD_NUMBER: _ClassVar[int]
    num_unpinned_blocks: int
    num_unpinned_pins: int
    def __init__(self, num_unpinned_blocks: _Optional[int] = ..., num_unpinned_pins: _Optional[int] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("after_sequence", "pool_id")
    AFTER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    after_sequence: int
    pool_id: str
    def __init__(self, after_sequence: _Optional[int] = ..., pool_id: _Optional[str] = ...) -> None: ...

class WatchEventsResponse(_message.Message):
    __slots__ = ("sequence", "kind", "pool_id", "block_hashes", "parent_hash", "token_ids", "block_ids", "tier")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    kind: BlockEventKind
    pool_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    tier: Tier
    def __init__(self, sequence: _Optional[int] = ..., kind: _Optional[_Union[BlockEventKind, str]] = ..., pool_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., parent_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_ids: _Optional[_Iterable[int]] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("token_ids", "cache_salt", "public_prefix_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    public_prefix_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., public_prefix_tokens: _Optional[int] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("pool_id", "worker_address", "num_cached_tokens", "candidates")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    worker_address: str
    num_cached_tokens: int
    candidates: _containers.RepeatedCompositeFieldContainer[PoolMatch]
    def __init__(self, pool_id: _Optional[str] = ..., worker_address: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., candidates: _Optional[_Iterable[_Union[PoolMatch, _Mapping]]] = ...) -> None: ...

class MissTokens(_message.Message):
    __slots__ = ("reason", "num_tokens")
    REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    reason: MissReason
    num_tokens: int
    def __init__(self, reason: _Optional[_Union[MissReason, str]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class ExplainMissRequest(_message.Message):
    __slots__ = ("token_ids", "cache_salt", "public_prefix_tokens", "pool_id")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    public_prefix_tokens: int
    pool_id: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., public_prefix_tokens: _Optional[int] = ..., pool_id: _Optional[str] = ...) -> None: ...

class MissExplanation(_message.Message):
    __slots__ = ("pool_id", "worker_address", "num_cached_tokens", "reason", "num_missed_tokens", "num_partial_tokens", "first_missing_block", "evicted_by", "seconds_ago", "other_pool_ids")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_MISSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PARTIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_MISSING_BLOCK_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BY_FIELD_NUMBER: _ClassVar[int]
    SECONDS_AGO_FIELD_NUMBER: _ClassVar[int]
    OTHER_POOL_IDS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    worker_address: str
    num_cached_tokens: int
    reason: MissReason
    num_missed_tokens: int
    num_partial_tokens: int
    first_missing_block: int
    evicted_by: str
    seconds_ago: float
    other_pool_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, pool_id: _Optional[str] = ..., worker_address: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., reason: _Optional[_Union[MissReason, str]] = ..., num_missed_tokens: _Optional[int] = ..., num_partial_tokens: _Optional[int] = ..., first_missing_block: _Optional[int] = ..., evicted_by: _Optional[str] = ..., seconds_ago: _Optional[float] = ..., other_pool_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ExplainMissResponse(_message.Message):
    __slots__ = ("num_tokens", "pools")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    pools: _containers.RepeatedCompositeFieldContainer[MissExplanation]
    def __init__(self, num_tokens: _Optional[int] = ..., pools: _Optional[_Iterable[_Union[MissExplanation, _Mapping]]] = ...) -> None: ...
