"""Typed results of client calls: small frozen dataclasses built from the contract's messages.

Field names follow the proto fields, so `to_dict()` gives JSON keys that are as
stable as the contract. "Missing" is None, never an empty string or -1: a total
over several pools has `pool_id=None`, a first block has `parent_hash=None`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvcache.v1 import directory_pb2, generation_pb2


def to_dict(value: Any) -> Any:
    """JSON-ready form of a result: dataclasses to dicts, tuples to lists, bytes to hex."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_dict(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [to_dict(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    return value


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


# ---------------------------------------------------------------- generation


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system", "user", "assistant" or "tool"
    content: str
    name: str = ""  # the participant's name ("": none), passed to the chat template

    @classmethod
    def coerce(cls, value: ChatMessage | Mapping[str, str] | tuple[str, str]) -> ChatMessage:
        if isinstance(value, ChatMessage):
            return value
        if isinstance(value, Mapping):
            return cls(role=value["role"], content=value["content"], name=value.get("name") or "")
        role, content = value
        return cls(role=role, content=content)

    def to_proto(self) -> generation_pb2.ChatMessage:
        return generation_pb2.ChatMessage(role=self.role, content=self.content, name=self.name)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    text: str  # the token alone, decoded


@dataclass(frozen=True)
class PositionLogprobs:
    """A position's token and its most likely alternatives, most likely first."""

    token: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()

    @classmethod
    def from_proto(cls, m: generation_pb2.PositionLogprobs) -> PositionLogprobs:
        def one(t: generation_pb2.TokenLogprob) -> TokenLogprob:
            return TokenLogprob(t.token_id, t.logprob, t.text)

        return cls(one(m.token), tuple(one(t) for t in m.top))


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    time_to_first_token_seconds: float
    total_time_seconds: float
    num_preemptions: int
    host_cached_tokens: int = 0  # the part of cached_tokens copied in from the host tier
    shared_cached_tokens: int = 0  # the part fetched from the shared tier

    @classmethod
    def from_proto(cls, m: generation_pb2.Usage) -> Usage:
        return cls(
            m.prompt_tokens,
            m.cached_tokens,
            m.completion_tokens,
            m.time_to_first_token_seconds,
            m.total_time_seconds,
            m.num_preemptions,
            m.host_cached_tokens,
            m.shared_cached_tokens,
        )

    @property
    def cache_hit_rate(self) -> float:
        """Share of the prompt served from the prefix cache, 0..1."""
        return _ratio(self.cached_tokens, self.prompt_tokens)


@dataclass(frozen=True)
class GenerateChunk:
    """One streamed message: new tokens and their text; the last one has finish_reason and usage."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    usage: Usage | None
    logprobs: tuple[PositionLogprobs, ...] = ()  # one per token, when asked
    prompt_logprobs: tuple[PositionLogprobs, ...] = ()  # the first message's, when asked

    @classmethod
    def from_proto(cls, m: generation_pb2.GenerateResponse) -> GenerateChunk:
        return cls(
            request_id=m.request_id,
            token_ids=tuple(m.token_ids),
            text=m.text,
            finish_reason=m.finish_reason or None,
            usage=Usage.from_proto(m.usage) if m.HasField("usage") else None,
            logprobs=tuple(PositionLogprobs.from_proto(e) for e in m.logprobs) if m.logprobs else (),
            prompt_logprobs=(
                tuple(PositionLogprobs.from_proto(e) for e in m.prompt_logprobs) if m.prompt_logprobs else ()
            ),
        )

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class Completion:
    """A whole generation. worker_address: the computed that served it."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    usage: Usage
    worker_address: str

    @classmethod
    def from_chunks(cls, chunks: Iterable[GenerateChunk], worker_address: str) -> Completion:
        request_id, texts, token_ids = "", [], []
        last: GenerateChunk | None = None
        for chunk in chunks:
            request_id = request_id or chunk.request_id
            texts.append(chunk.text)
            token_ids.extend(chunk.token_ids)
            last = chunk
        if last is None or last.finish_reason is None or last.usage is None:
            raise ValueError(f"stream from {worker_address} ended without finish_reason and usage")
        return cls(
            request_id, "".join(texts), tuple(token_ids), last.finish_reason, last.usage, worker_address
        )

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    model_revision: str
    architecture: str
    dtype: str
    device: str
    block_size: int
    num_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool
    pool_id: str | None
    blockd_address: str

    @classmethod
    def from_proto(cls, m: generation_pb2.GetModelInfoResponse) -> ModelInfo:
        return cls(
            m.model_id,
            m.model_revision,
            m.architecture,
            m.dtype,
            m.device,
            m.block_size,
            m.num_blocks,
            m.max_model_len,
            m.vocab_size,
            tuple(m.eos_token_ids),
            m.has_chat_template,
            m.pool_id or None,
            m.blockd_address,
        )


# ---------------------------------------------------------------- directory


@dataclass(frozen=True)
class PoolStats:
    """Counters of one pool, or their sum over pools (then pool_id is None)."""

    pool_id: str | None
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
    host: TierStats | None = None  # the host tier; None when the pool has none
    # Uncached admitted tokens by miss reason ("never_seen", "evicted", ...; see `kvctl why`).
    miss_tokens: dict[str, int] = field(default_factory=dict)
    eviction_policy: str = ""
    num_ghosts: int = 0
    max_ghosts: int = 0
    shared: TierStats | None = None  # the shared tier as this pool uses it; None without one

    @classmethod
    def from_proto(cls, m: directory_pb2.PoolStats) -> PoolStats:
        return cls(
            m.pool_id or None,
            m.num_blocks,
            m.block_size,
            m.num_free_blocks,
            m.num_evictable_blocks,
            m.num_referenced_blocks,
            m.num_pinned_blocks,
            m.num_cached_blocks,
            m.num_sequences,
            m.queried_tokens,
            m.hit_tokens,
            m.num_evictions,
            m.num_admissions,
            m.num_admissions_deferred,
            TierStats.from_proto(m.host) if m.HasField("host") else None,
            {miss_reason_name(x.reason): x.num_tokens for x in m.miss_tokens},
            m.eviction_policy,
            m.num_ghosts,
            m.max_ghosts,
            TierStats.from_proto(m.shared) if m.HasField("shared") else None,
        )

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from cache over prompt tokens admitted, 0..1."""
        return _ratio(self.hit_tokens, self.queried_tokens)


@dataclass(frozen=True)
class TierStats:
    """A lower tier of a pool (free + evictable + referenced == num_blocks)."""

    tier: str  # "host" or "shared"
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

    @classmethod
    def from_proto(cls, m: directory_pb2.TierStats) -> TierStats:
        return cls(
            TIER_NAMES.get(m.tier, "unspecified"),
            m.num_blocks,
            m.num_free_blocks,
            m.num_evictable_blocks,
            m.num_referenced_blocks,
            m.hit_tokens,
            m.num_demotions,
            m.num_loads,
            m.num_evictions,
            m.num_loads_skipped,
            m.load_seconds_per_block,
            m.recompute_seconds_per_block,
        )


TIER_NAMES = {
    directory_pb2.TIER_DEVICE: "device",
    directory_pb2.TIER_HOST: "host",
    directory_pb2.TIER_SHARED: "shared",
}
TIERS_BY_NAME = {name: value for value, name in TIER_NAMES.items()}


@dataclass(frozen=True)
class Stats:
    total: PoolStats
    pools: tuple[PoolStats, ...]
    last_event_sequence: int

    @classmethod
    def from_proto(cls, m: directory_pb2.GetStatsResponse) -> Stats:
        return cls(
            PoolStats.from_proto(m.total),
            tuple(PoolStats.from_proto(p) for p in m.pools),
            m.last_event_sequence,
        )


@dataclass(frozen=True)
class Namespace:
    model_id: str
    model_revision: str
    dtype: str
    adapter_id: str | None

    @classmethod
    def from_proto(cls, m: directory_pb2.Namespace) -> Namespace:
        return cls(m.model_id, m.model_revision, m.dtype, m.adapter_id or None)


@dataclass(frozen=True)
class PoolInfo:
    pool_id: str
    epoch: int
    namespace: Namespace
    block_size: int
    num_blocks: int
    worker_address: str
    lease_remaining_seconds: float
    is_live: bool
    stats: PoolStats

    @classmethod
    def from_proto(cls, m: directory_pb2.PoolInfo) -> PoolInfo:
        return cls(
            m.pool_id,
            m.epoch,
            Namespace.from_proto(m.namespace),
            m.block_size,
            m.num_blocks,
            m.worker_address,
            m.lease_remaining_seconds,
            m.is_live,
            PoolStats.from_proto(m.stats),
        )


@dataclass(frozen=True)
class BlockInfo:
    """A cached (committed) block. parent_hash is None for a first block (block_index 0)."""

    pool_id: str
    block_id: int
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    ref_count: int
    is_pinned: bool
    block_index: int
    is_salted: bool

    @classmethod
    def from_proto(cls, m: directory_pb2.BlockInfo) -> BlockInfo:
        return cls(
            m.pool_id,
            m.block_id,
            m.block_hash,
            m.parent_hash or None,
            tuple(m.token_ids),
            m.ref_count,
            m.is_pinned,
            m.block_index,
            m.is_salted,
        )


@dataclass(frozen=True)
class PoolMatch:
    pool_id: str
    worker_address: str
    num_cached_tokens: int
    load: float
    num_sequences: int
    num_host_cached_tokens: int = 0  # the part of num_cached_tokens only in the host tier
    num_shared_cached_tokens: int = 0  # the part only in the shared tier

    @classmethod
    def from_proto(cls, m: directory_pb2.PoolMatch) -> PoolMatch:
        return cls(
            m.pool_id,
            m.worker_address,
            m.num_cached_tokens,
            m.load,
            m.num_sequences,
            m.num_host_cached_tokens,
            m.num_shared_cached_tokens,
        )


@dataclass(frozen=True)
class Route:
    """Where blockd would send a prompt. pool_id/worker_address are None when no pool is live."""

    pool_id: str | None
    worker_address: str | None
    num_cached_tokens: int
    candidates: tuple[PoolMatch, ...]

    @classmethod
    def from_proto(cls, m: directory_pb2.RouteResponse) -> Route:
        return cls(
            m.pool_id or None,
            m.worker_address or None,
            m.num_cached_tokens,
            tuple(PoolMatch.from_proto(c) for c in m.candidates),
        )


@dataclass(frozen=True)
class FlushResult:
    """dropped: cached blocks freed; busy: matching blocks still referenced, left in place
    (both summed over tiers); tiers: {tier name: (dropped, busy)} per tier flushed."""

    dropped: int
    busy: int
    tiers: dict[str, tuple[int, int]] = field(default_factory=dict)


def miss_reason_name(value: int) -> str:
    """MISS_REASON_EVICTED -> "evicted" (the names blockd's stats and metrics use)."""
    return directory_pb2.MissReason.Name(value).removeprefix("MISS_REASON_").lower()


@dataclass(frozen=True)
class MissExplanation:
    """Why one pool does not hold a prompt past its cached prefix (ExplainMiss)."""

    pool_id: str
    worker_address: str
    num_cached_tokens: int
    reason: str | None  # "never_seen", "evicted", ...; None: every full block is cached
    num_missed_tokens: int
    num_partial_tokens: int
    first_missing_block: int
    evicted_by: str
    seconds_ago: float
    other_pool_ids: tuple[str, ...]

    @classmethod
    def from_proto(cls, m: directory_pb2.MissExplanation) -> MissExplanation:
        return cls(
            m.pool_id,
            m.worker_address,
            m.num_cached_tokens,
            miss_reason_name(m.reason) if m.reason else None,
            m.num_missed_tokens,
            m.num_partial_tokens,
            m.first_missing_block,
            m.evicted_by,
            m.seconds_ago,
            tuple(m.other_pool_ids),
        )


@dataclass(frozen=True)
class PinResult:
    pin_id: str
    num_pinned_tokens: int
    num_pinned_blocks: int
    expires_in_seconds: float


_EVENT_KINDS = {
    directory_pb2.BLOCK_EVENT_KIND_STORED: "stored",
    directory_pb2.BLOCK_EVENT_KIND_REMOVED: "removed",
    directory_pb2.BLOCK_EVENT_KIND_CLEARED: "cleared",
    directory_pb2.BLOCK_EVENT_KIND_GAP: "gap",
    directory_pb2.BLOCK_EVENT_KIND_DEMOTED: "demoted",
    directory_pb2.BLOCK_EVENT_KIND_LOADED: "loaded",
}


@dataclass(frozen=True)
class BlockEvent:
    """kind: "stored", "removed", "cleared", "gap", "demoted", "loaded" (or "unspecified");
    tier: "device", "host" or "shared" ("" when the event names none)."""

    sequence: int
    kind: str
    pool_id: str
    block_hashes: tuple[bytes, ...]
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    tier: str = ""

    @classmethod
    def from_proto(cls, m: directory_pb2.WatchEventsResponse) -> BlockEvent:
        return cls(
            m.sequence,
            _EVENT_KINDS.get(m.kind, "unspecified"),
            m.pool_id,
            tuple(m.block_hashes),
            m.parent_hash or None,
            tuple(m.token_ids),
            tuple(m.block_ids),
            TIER_NAMES.get(m.tier, ""),
        )
