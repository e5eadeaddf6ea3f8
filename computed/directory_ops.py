"""Plain values exchanged between the scheduler and the directory (named as in the contract).

The scheduler speaks only these types; a `Directory` (computed/directory.py) turns
them into one batched `Step` per engine iteration and back. Each type mirrors the
message of the same name in proto/kvcache/v1/directory.proto. No gRPC here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from computed.sequence import BlockId, Sequence, SequenceId
from computed.shared_store import StoredBlock


@dataclass(frozen=True)
class AdmitOp:
    sequence_id: SequenceId
    token_ids: list[int]
    cache_salt: str
    public_prefix_tokens: int
    cache_policy: str = "store"  # "store", "read_only" or "none" (Generate's cache_policy)
    retention_priority: int = 0  # 1..100; 0: blockd's default


@dataclass(frozen=True)
class GrowOp:
    sequence_id: SequenceId
    num_tokens: int
    # True when this step cannot run the sequence without the new block (not sent to blockd).
    is_urgent: bool


@dataclass(frozen=True)
class CommitOp:
    sequence_id: SequenceId
    block_ids: list[BlockId]
    token_ids: list[int]


@dataclass(frozen=True)
class SharedFetch:
    """A shared tier hit of `seq`: fetch `block` into its table's `block_index`."""

    seq: Sequence
    block_index: int
    block: StoredBlock


@dataclass
class CopyPlan:
    """The copies blockd's answers owe, in the order they must run: reads of device
    blocks first (host demotions, device block -> host block; shared tier stores,
    snapshotted), then writes into device blocks (host loads, then shared fetches)."""

    demotions: list[tuple[BlockId, int]] = field(default_factory=list)
    loads: list[tuple[BlockId, int]] = field(default_factory=list)
    stores: list[StoredBlock] = field(default_factory=list)
    fetches: list[SharedFetch] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.demotions or self.loads or self.stores or self.fetches)


@dataclass
class DirectoryOps:
    """Everything one engine iteration asks of blockd, applied there in this order.

    `releases` are sequence ids (a `ReleaseOp` carries nothing else)."""

    commits: list[CommitOp] = field(default_factory=list)
    releases: list[SequenceId] = field(default_factory=list)
    grows: list[GrowOp] = field(default_factory=list)
    admits: list[AdmitOp] = field(default_factory=list)
    # Reports of the shared tier's writes and fetches (block hashes), see SharedKV.
    shared_written: list[bytes] = field(default_factory=list)
    shared_failed: list[bytes] = field(default_factory=list)
    shared_missing: list[bytes] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (
            self.commits
            or self.releases
            or self.grows
            or self.admits
            or self.shared_written
            or self.shared_failed
            or self.shared_missing
        )

    @property
    def must_wait(self) -> bool:
        """Only admissions and urgent grows hold the model back; the rest ride along."""
        return bool(self.admits) or any(g.is_urgent for g in self.grows)


@dataclass(frozen=True)
class AdmitResult:
    sequence_id: SequenceId
    admitted: bool
    block_ids: list[BlockId]
    num_cached_tokens: int
    # Host tier hits to copy in before the forward: (device block, host block); they
    # follow the device hits in block_ids and count in num_cached_tokens.
    loads: list[tuple[BlockId, int]] = field(default_factory=list)
    # Shared tier hits to fetch before the forward; they follow the host loads.
    shared_loads: list[StoredBlock] = field(default_factory=list)


@dataclass(frozen=True)
class GrowResult:
    sequence_id: SequenceId
    grown: bool
    new_block_ids: list[BlockId]


@dataclass
class DirectoryResult:
    """blockd's answer to one `DirectoryOps` (a `StepResponse`)."""

    grows: list[GrowResult] = field(default_factory=list)
    admits: list[AdmitResult] = field(default_factory=list)
    num_free_blocks: int | None = None
    num_evictable_blocks: int | None = None
    # Device blocks to copy to the host tier before anything writes them.
    demotions: list[tuple[BlockId, int]] = field(default_factory=list)
    # Committed device blocks to write to the shared tier (read before the next forward).
    shared_stores: list[StoredBlock] = field(default_factory=list)


@dataclass(frozen=True)
class ResyncSequence:
    """What a worker re-declares after blockd restarted (see `Resync`)."""

    sequence_id: SequenceId
    block_ids: list[BlockId]
    token_ids: list[int]  # every token whose K/V is written into block_ids
    cache_salt: str
    public_prefix_tokens: int
