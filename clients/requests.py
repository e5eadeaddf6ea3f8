"""Building GenerateRequest messages, shared by the sync and the asyncio client."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from clients.types import ChatMessage
from kvcache.v1 import cache_policy_pb2, generation_pb2

# stream_interval meaning "send the first token, then everything at the end" (uint32 max).
WHOLE_COMPLETION = 2**32 - 1

MessageLike = ChatMessage | Mapping[str, str] | tuple[str, str]
CACHE_POLICIES = {
    "store": cache_policy_pb2.CACHE_POLICY_STORE,
    "read_only": cache_policy_pb2.CACHE_POLICY_READ_ONLY,
    "none": cache_policy_pb2.CACHE_POLICY_NONE,
}


# SamplingParams fields that map to `optional` GenerateRequest fields (None: unset).
_OPTIONAL_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "prompt_logprobs",
)


@dataclass(frozen=True)
class SamplingParams:
    """Generation knobs; None means "the server's default" (max_tokens 64, greedy, top_p 1)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Tokens per message after the first (0: every token). `complete()` reads only the
    # whole completion, so it asks for WHOLE_COMPLETION: two messages, not one per token.
    stream_interval: int = 0
    # Logit processing and logprobs (None / empty: the server's default, off).
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None  # alternatives per generated token; None: no logprobs
    prompt_logprobs: int | None = None  # alternatives per prompt token; None: none

    def __post_init__(self) -> None:
        if not 0 <= self.stream_interval <= WHOLE_COMPLETION:
            raise ValueError(f"stream_interval must be 0 .. {WHOLE_COMPLETION}, got {self.stream_interval}")

    @classmethod
    def of(cls, **sampling: Any) -> SamplingParams:
        """stop / stop_token_ids may be one value or any sequence (stored as tuples)."""
        for name in ("stop", "stop_token_ids"):
            value = sampling.get(name)
            if value is not None:
                sampling[name] = (value,) if isinstance(value, (str, int)) else tuple(value)
        return cls(**sampling)


@dataclass(frozen=True)
class Prompt:
    """Exactly one of text, token_ids or messages, plus the cache scope (salt, public prefix)."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None
    cache_salt: str = ""
    public_prefix_tokens: int = 0
    request_id: str = ""
    cache_policy: str = "store"  # "store", "read_only" (reuse, never store) or "none"
    retention_priority: int = 0  # 1..100 (TensorRT-LLM's scale); 0: the server's default (35)

    def __post_init__(self) -> None:
        given = [x is not None for x in (self.text, self.token_ids, self.messages)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt text, token_ids or messages")
        if self.public_prefix_tokens < 0:
            raise ValueError("public_prefix_tokens must be >= 0")
        if self.cache_policy not in CACHE_POLICIES:
            raise ValueError(
                f"cache_policy must be one of {sorted(CACHE_POLICIES)}, got {self.cache_policy!r}"
            )
        if not 0 <= self.retention_priority <= 100:
            raise ValueError(
                f"retention_priority must be 1 .. 100 (0: the default), got {self.retention_priority}"
            )

    @classmethod
    def of(
        cls,
        prompt: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        messages: Sequence[MessageLike] | None = None,
        cache_salt: str = "",
        public_prefix_tokens: int = 0,
        request_id: str = "",
        cache_policy: str = "store",
        retention_priority: int = 0,
    ) -> Prompt:
        return cls(
            text=prompt,
            # map, not a generator expression: 4,160 ids in 0.21-0.26 ms against 0.32-0.59 (in process)
            token_ids=tuple(map(int, token_ids)) if token_ids is not None else None,
            messages=tuple(ChatMessage.coerce(m) for m in messages) if messages is not None else None,
            cache_salt=cache_salt,
            public_prefix_tokens=public_prefix_tokens,
            request_id=request_id,
            cache_policy=cache_policy,
            retention_priority=retention_priority,
        )

    def to_request(self, params: SamplingParams) -> generation_pb2.GenerateRequest:
        request = generation_pb2.GenerateRequest(
            stop=list(params.stop),
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
            stream_interval=params.stream_interval,
            cache_salt=self.cache_salt,
            public_prefix_tokens=self.public_prefix_tokens,
            request_id=self.request_id,
            cache_policy=CACHE_POLICIES[self.cache_policy],
            retention_priority=self.retention_priority,
            min_tokens=params.min_tokens,
        )
        if params.logit_bias:
            request.logit_bias.update(dict(params.logit_bias))
        if self.text is not None:
            request.prompt = self.text
        elif self.token_ids is not None:
            request.prompt_token_ids.extend(self.token_ids)
        else:
            assert self.messages is not None
            request.messages.extend(m.to_proto() for m in self.messages)
        for name in _OPTIONAL_FIELDS:
            value = getattr(params, name)
            if value is not None:
                setattr(request, name, value)
        return request

    def to_tokenize_request(self) -> generation_pb2.TokenizeRequest:
        """The Tokenize call that yields the token ids Generate will see (for routing)."""
        assert self.token_ids is None, "token ids need no tokenizing"
        if self.messages is not None:
            return generation_pb2.TokenizeRequest(messages=[m.to_proto() for m in self.messages])
        return generation_pb2.TokenizeRequest(text=self.text, add_special_tokens=True)
