"""One request's state as the scheduler and engine see it."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from computed.errors import RequestError

SequenceId = int
BlockId = int


@dataclass(frozen=True)
class SamplingParams:
    """Validated per-request sampling settings (temperature 0 means greedy)."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Logit processing (computed/penalties.py), all off by default.
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids unique
    min_tokens: int = 0
    banned_until_min_tokens: tuple[int, ...] = ()  # EOS and stop ids, masked below min_tokens
    # Alternatives returned per generated / prompt token; None: no logprobs at all.
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise RequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if len(self.stop) > 16 or any(not s or len(s) > 256 for s in self.stop):
            raise RequestError("stop: at most 16 non-empty strings of at most 256 characters")
        if len(self.stop_token_ids) > 256:
            raise RequestError("stop_token_ids: at most 256 ids")
        _check_processing(self)

    @property
    def processes_logits(self) -> bool:
        """Whether any penalty, bias or min_tokens changes this request's logits."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or (self.min_tokens and self.banned_until_min_tokens)
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


MAX_LOGPROBS = 20


def _check_processing(p: SamplingParams) -> None:
    if not math.isfinite(p.min_p) or not 0.0 <= p.min_p <= 1.0:
        raise RequestError(f"min_p must be in [0, 1], got {p.min_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not math.isfinite(value) or not -2.0 <= value <= 2.0:
            raise RequestError(f"{name} must be in [-2, 2], got {value}")
    if not math.isfinite(p.repetition_penalty) or not 0.0 < p.repetition_penalty <= 2.0:
        raise RequestError(f"repetition_penalty must be in (0, 2] (1: off), got {p.repetition_penalty}")
    if len(p.logit_bias) > 300 or len({t for t, _ in p.logit_bias}) != len(p.logit_bias):
        raise RequestError("logit_bias: at most 300 distinct token ids")
    if any(not math.isfinite(b) or not -100.0 <= b <= 100.0 for _, b in p.logit_bias):
        raise RequestError("logit_bias: every bias must be in [-100, 100]")
    if p.min_tokens < 0 or p.min_tokens > p.max_tokens:
        raise RequestError(f"min_tokens must be in [0, max_tokens={p.max_tokens}], got {p.min_tokens}")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(p, name)
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise RequestError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not holding blocks: never admitted, or preempted
    RUNNING = "running"  # holds its block table; prefilling or decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A prompt and its completion so far.

    Invariants while RUNNING:
    - `block_table[i]` holds the K/V of tokens [i*block_size, (i+1)*block_size).
    - tokens [0, num_computed_tokens) have their K/V written in the pool; the first
      `num_committed_blocks` blocks are committed (findable, shared, never written).
    - only blocks at index >= num_committed_blocks are written, and only by this sequence.
    A preempted sequence drops its table and comes back as WAITING with every token so
    far as its new prompt; blockd usually hands its committed blocks straight back.
    """

    sequence_id: SequenceId
    prompt_token_ids: list[int]
    params: SamplingParams
    block_size: int
    cache_salt: str = ""
    public_prefix_tokens: int = 0
    cache_policy: str = "store"  # "store", "read_only" or "none": what blockd may do with its blocks
    retention_priority: int = 0  # 1..100; 0: blockd's default
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[BlockId] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_committed_blocks: int = 0
    # Prompt tokens served from cache at the first admission (what usage reports), and
    # the part of them copied in from the host tier.
    num_cached_tokens: int | None = None
    num_host_cached_tokens: int = 0
    num_shared_cached_tokens: int = 0  # the part fetched from the shared tier
    num_preemptions: int = 0
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def capacity(self) -> int:
        """Tokens the current block table can hold."""
        return len(self.block_table) * self.block_size

    @property
    def is_prefilling(self) -> bool:
        """True until every token but the newest has its K/V (the newest is fed next)."""
        return self.num_computed_tokens < self.num_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def num_full_blocks(self) -> int:
        """Blocks whose every slot holds written K/V."""
        return self.num_computed_tokens // self.block_size
