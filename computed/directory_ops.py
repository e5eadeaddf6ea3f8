"""Plain values exchanged between the scheduler and the directory client.

The scheduler speaks only these types; the directory client turns them into one
batched `Step` RPC per engine iteration and back. No gRPC here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from computed.sequence import BlockId, SequenceId


@dataclass(frozen=True)
class Admit:
    seq_id: SequenceId
    token_ids: list[int]
    cache_salt: str
    public_prefix_tokens: int


@dataclass(frozen=True)
class Grow:
    seq_id: SequenceId
    num_tokens: int
    # True when this step cannot run the sequence without the new block.
    is_urgent: bool


@dataclass(frozen=True)
class Commit:
    seq_id: SequenceId
    block_ids: list[BlockId]
    token_ids: list[int]


@dataclass
class DirectoryOps:
    """Everything one engine iteration asks of blockd, applied there in this order."""

    commits: list[Commit] = field(default_factory=list)
    releases: list[SequenceId] = field(default_factory=list)
    grows: list[Grow] = field(default_factory=list)
    admits: list[Admit] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.commits or self.releases or self.grows or self.admits)

    @property
    def must_wait(self) -> bool:
        """Only admissions and urgent grows hold the model back; the rest ride along."""
        return bool(self.admits) or any(g.is_urgent for g in self.grows)


@dataclass(frozen=True)
class AdmitOutcome:
    seq_id: SequenceId
    admitted: bool
    block_ids: list[BlockId]
    num_cached_tokens: int


@dataclass(frozen=True)
class GrowOutcome:
    seq_id: SequenceId
    grown: bool
    new_block_ids: list[BlockId]


@dataclass
class DirectoryResult:
    grows: list[GrowOutcome] = field(default_factory=list)
    admits: list[AdmitOutcome] = field(default_factory=list)
    num_free_blocks: int | None = None
    num_evictable_blocks: int | None = None


@dataclass(frozen=True)
class LiveSequence:
    """What a worker re-declares after blockd restarted (see `Resync`)."""

    seq_id: SequenceId
    block_ids: list[BlockId]
    token_ids: list[int]  # every token whose K/V is written into block_ids
    cache_salt: str
    public_prefix_tokens: int
