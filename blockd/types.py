"""Domain types of the block directory: ids, operations, results and errors.

Everything here is plain data. The directory speaks only these types; the gRPC
service translates protobuf messages to and from them, and maps the errors below
to status codes (the only place that knows about gRPC).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

BlockId = NewType("BlockId", int)
"""Index of a physical block in one worker's KV pool: 0 .. num_blocks - 1."""

BlockHash = NewType("BlockHash", bytes)
"""16-byte chained content hash of a full block (xxh3-128)."""

HostBlockId = NewType("HostBlockId", int)
"""Index of a block in one worker's host tier: 0 .. num_host_blocks - 1."""

PoolId = NewType("PoolId", str)
SequenceId = NewType("SequenceId", int)
PinId = NewType("PinId", str)

# ---------------------------------------------------------------- errors


class DirectoryError(Exception):
    """A client mistake. The message says what to fix; the call changed nothing."""


class InvalidArgument(DirectoryError):
    """The request is malformed or contradicts the sequence's state."""


class NotFound(DirectoryError):
    """Unknown pool, sequence or pin."""


class StaleEpoch(DirectoryError):
    """The caller's epoch is not the pool's current one (its lease lapsed or the
    pool was registered again): register again and resync."""


class ResourceExhausted(DirectoryError):
    """The pool cannot hold the request even when empty (or a pin would pass the budget)."""


class PermissionDenied(DirectoryError):
    """The caller may not do this to that pool (it is live and owned by another worker)."""


# ---------------------------------------------------------------- inputs


class Tier(enum.Enum):
    """Where a block's K/V lives (the contract's Tier)."""

    DEVICE = 1
    HOST = 2
    SHARED = 3


@dataclass(frozen=True, slots=True)
class HostSpec:
    """A pool's host tier as its worker declared it: its size and the worker's measured
    costs (0.0: unknown, then a host hit is always loaded)."""

    num_blocks: int = 0
    load_seconds_per_block: float = 0.0
    prefill_seconds_per_token: float = 0.0
    # The worker reaches the shared tier (tier 2), and its measured fetch cost per block.
    has_shared_tier: bool = False
    shared_load_seconds_per_block: float = 0.0


NO_HOST_TIER = HostSpec()


class CachePolicy(enum.Enum):
    """What one request does with the prefix cache (Generate's cache_policy)."""

    STORE = "store"  # reuse cached blocks and index its own new full blocks (the default)
    READ_ONLY = "read_only"  # reuse cached blocks, never index its new ones (a one-off suffix)
    NONE = "none"  # neither: no hits, nothing indexed (benchmarks, privacy)


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything besides tokens that changes a block's K/V (see directory.proto)."""

    model_id: str = ""
    model_revision: str = ""
    dtype: str = ""
    adapter_id: str = ""


@dataclass(frozen=True, slots=True)
class AdmitOp:
    sequence_id: SequenceId
    token_ids: Sequence[int]
    cache_salt: str = ""
    public_prefix_tokens: int = 0
    cache_policy: CachePolicy = CachePolicy.STORE
    retention_priority: int = 0  # 1..100 (TensorRT-LLM's scale); 0: unset, the default 35
    token_bytes: bytes = b""  # the prompt packed (uint32 LE), instead of token_ids


@dataclass(frozen=True, slots=True)
class GrowOp:
    sequence_id: SequenceId
    num_tokens: int


@dataclass(frozen=True, slots=True)
class CommitOp:
    """Both token fields empty: the blocks' tokens are the ones the directory holds
    for the sequence (commit by block index)."""

    sequence_id: SequenceId
    block_ids: Sequence[int]
    token_ids: Sequence[int] = ()
    token_bytes: bytes = b""  # the tokens packed (uint32 LE), instead of token_ids


@dataclass(frozen=True, slots=True)
class ReleaseOp:
    sequence_id: SequenceId


@dataclass(frozen=True, slots=True)
class ResyncSequence:
    """A live sequence as the worker holds it: every token in token_ids is written."""

    sequence_id: SequenceId
    block_ids: Sequence[int]
    token_ids: Sequence[int]
    cache_salt: str = ""
    public_prefix_tokens: int = 0


# ---------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class Registration:
    pool_id: PoolId
    epoch: int
    lease_ttl_seconds: float
    max_sequence_tokens: int
    pool_token: str = ""  # the pool's secret: proof of ownership when re-registering it
    shared_namespace: str = ""  # hex of the namespace seed: the shared tier's key prefix


@dataclass(frozen=True, slots=True)
class AdmitResult:
    """`block_ids[i]` holds tokens [i*block_size, (i+1)*block_size); the first
    `num_cached_tokens // block_size` of them are verified hits."""

    sequence_id: SequenceId
    admitted: bool
    block_ids: tuple[BlockId, ...] = ()
    num_cached_tokens: int = 0
    # Host tier hits to copy in first: (device block, host block), in table order,
    # right after the device hits. Included in num_cached_tokens.
    loads: tuple[tuple[BlockId, HostBlockId], ...] = ()
    # Shared tier hits to fetch, after the host loads in the table. Included in
    # num_cached_tokens.
    shared_loads: tuple[SharedBlock, ...] = ()


@dataclass(frozen=True, slots=True)
class SharedBlock:
    """A block to write to or fetch from the shared tier, with what its header says."""

    block_id: BlockId
    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_bytes: bytes
    salt_digest: bytes | None
    depth: int
    chain_digest: bytes  # of the block's whole chain (kvcache_contract.shared_value)


@dataclass(frozen=True, slots=True)
class GrowResult:
    sequence_id: SequenceId
    grown: bool
    new_block_ids: tuple[BlockId, ...] = ()


@dataclass(frozen=True, slots=True)
class StepResult:
    grows: tuple[GrowResult, ...]
    admits: tuple[AdmitResult, ...]
    num_free_blocks: int
    num_evictable_blocks: int
    # Device blocks evicted by this step whose K/V the worker copies to the host tier
    # before anything writes them: (device block, host block).
    demotions: tuple[tuple[BlockId, HostBlockId], ...] = ()
    # Committed device blocks to write to the shared tier (read before the next forward).
    shared_stores: tuple[SharedBlock, ...] = ()
    # (namespace seed, block hash) keys of reported writes blockd will never index (a
    # flush forgot them while under way, or their parent never became resident): blockd's
    # servicer deletes them (never sent to the worker).
    shared_orphans: tuple[tuple[BlockHash, BlockHash], ...] = ()


@dataclass(frozen=True, slots=True)
class ResyncResult:
    num_sequences: int
    num_committed_blocks: int


@dataclass(frozen=True, slots=True)
class PoolStats:
    """Block accounting (free + evictable + referenced == num_blocks; pinned blocks
    are part of referenced) and cumulative prefix-cache counters, in tokens."""

    pool_id: PoolId | None  # None in a total over several pools
    num_blocks: int
    block_size: int  # 0 in a total over pools of different block sizes
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
    host: TierStats | None = None  # None: the pool has no host tier
    # Uncached admitted tokens by miss reason (blockd.ghosts.MissReason value), sorted.
    miss_tokens: tuple[tuple[str, int], ...] = ()
    num_ghosts: int = 0
    max_ghosts: int = 0
    eviction_policy: str = ""  # "" in a total over pools of different policies
    shared: TierStats | None = None  # None: the pool's worker has no shared tier


@dataclass(frozen=True, slots=True)
class TierStats:
    """One lower tier of a pool: free + evictable + referenced == num_blocks."""

    tier: Tier
    num_blocks: int
    num_free_blocks: int
    num_evictable_blocks: int
    num_referenced_blocks: int  # held by loads in flight
    hit_tokens: int
    num_demotions: int
    num_loads: int
    num_evictions: int
    num_loads_skipped: int
    load_seconds_per_block: float
    recompute_seconds_per_block: float


@dataclass(frozen=True, slots=True)
class Stats:
    total: PoolStats
    pools: tuple[PoolStats, ...]
    last_event_sequence: int


@dataclass(frozen=True, slots=True)
class PoolInfo:
    pool_id: PoolId
    epoch: int
    namespace: Namespace
    block_size: int
    num_blocks: int
    worker_address: str
    lease_remaining_seconds: float
    is_live: bool
    stats: PoolStats


@dataclass(frozen=True, slots=True)
class BlockInfo:
    pool_id: PoolId
    block_id: BlockId
    block_hash: BlockHash
    parent_hash: BlockHash | None  # None for a first block
    token_ids: tuple[int, ...]
    ref_count: int
    is_pinned: bool
    block_index: int
    is_salted: bool


@dataclass(frozen=True, slots=True)
class BlockPage:
    blocks: tuple[BlockInfo, ...]
    next_page_token: str | None  # None on the last page


@dataclass(frozen=True, slots=True)
class PoolMatch:
    pool_id: PoolId
    worker_address: str
    num_cached_tokens: int
    load: float  # share of the pool's blocks that are referenced, 0..1
    num_sequences: int
    num_host_cached_tokens: int = 0  # the part of num_cached_tokens only in the host tier
    num_shared_cached_tokens: int = 0  # the part only in the shared tier
    # Share of the pool's blocks holding cached content, 0..1: a new prefix goes where
    # it evicts the least (internal tie-break; not part of the wire message).
    occupancy: float = 0.0


@dataclass(frozen=True, slots=True)
class Route:
    """The chosen pool (None when no live pool exists) and every candidate, best first."""

    pool_id: PoolId | None
    worker_address: str | None
    num_cached_tokens: int
    candidates: tuple[PoolMatch, ...]


@dataclass(frozen=True, slots=True)
class FlushResult:
    dropped: int  # unreferenced cached blocks dropped (now free), summed over tiers
    busy: int  # matching cached blocks still referenced; they stay until released
    tiers: tuple[tuple[Tier, int, int], ...] = ()  # (tier, dropped, busy) per tier flushed
    # For the server, which deletes them from the store: (namespace seed, block hash) of
    # dropped shared records, and namespaces flushed whole (every key of theirs goes).
    shared_keys: tuple[tuple[BlockHash, BlockHash], ...] = ()
    shared_namespaces: tuple[BlockHash, ...] = ()


@dataclass(frozen=True, slots=True)
class MissExplanation:
    """Why one pool does not hold a prompt's tokens past its cached prefix."""

    pool_id: PoolId
    worker_address: str
    num_cached_tokens: int
    reason: str | None  # a MissReason value; None: every full block is cached
    num_missed_tokens: int
    num_partial_tokens: int
    first_missing_block: int
    evicted_by: str = ""  # the ghost's cause: a policy name, "flush" or "cache_policy"
    seconds_ago: float = 0.0
    other_pool_ids: tuple[PoolId, ...] = ()  # OTHER_NAMESPACE: pools holding the tokens


@dataclass(frozen=True, slots=True)
class PinResult:
    pin_id: PinId
    num_pinned_tokens: int  # summed over pools
    num_pinned_blocks: int
    expires_in_seconds: float
