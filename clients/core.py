"""What every client call sends and what it answers, shared by the sync and asyncio clients.

A client method is three steps: build a `Call` here (request message, stub method name,
admin metadata or not, retry policy), make the one transport call (the only part that is
sync in `clients.client` and awaited in `clients.aio_client`), and `parse` the reply into
a `clients.types` value here. No I/O happens in this module, so a new RPC is one `Call`
builder here plus a one-line method in each client, and the two cannot disagree on
what is sent or how the answer is read.

Invariants:
- A `Call` is complete: the transport needs nothing but the stubs and the options.
- `retry_pause` is the one retry decision: it either answers the pause before the next
  attempt or raises the call's `KVCacheError`; never both, never a pause past the deadline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import grpc

from clients.errors import KVCacheError
from clients.options import NO_RETRY, ClientOptions, RetryPolicy
from clients.requests import MessageLike, Prompt, SamplingParams
from clients.types import (
    TIER_NAMES,
    TIERS_BY_NAME,
    BlockEvent,
    BlockInfo,
    FlushResult,
    GenerateChunk,
    MissExplanation,
    ModelInfo,
    PinResult,
    PoolInfo,
    PoolMatch,
    Route,
    Stats,
)
from kvcache.v1 import directory_pb2, directory_pb2_grpc, generation_pb2, generation_pb2_grpc

log = logging.getLogger("clients")

T = TypeVar("T")

# Which stub of a daemon's channel serves a call.
Stub = Literal["admin", "routing", "generation"]


@dataclass(frozen=True)
class Call(Generic[T]):
    """One RPC, ready to send: `stub`.`method`(request), then `parse`(reply).

    For a server stream, `parse` is applied to each message. is_admin: send the admin
    token. retry None: the client's RetryPolicy. timeout None: the client's default.
    """

    stub: Stub
    method: str
    request: Any
    parse: Callable[[Any], T]
    timeout: float | None = None
    is_admin: bool = False
    retry: RetryPolicy | None = None


def stubs(service: str, channel: Any) -> dict[Stub, Any]:
    """The stubs of one daemon's channel (sync or aio: the generated stubs serve both)."""
    if service == "blockd":
        return {
            "admin": directory_pb2_grpc.DirectoryAdminServiceStub(channel),
            "routing": directory_pb2_grpc.RoutingServiceStub(channel),
        }
    return {"generation": generation_pb2_grpc.GenerationServiceStub(channel)}


def metadata(call: Call[Any], options: ClientOptions) -> tuple[tuple[str, str], ...]:
    """The admin token goes out on admin calls only."""
    return options.admin_metadata() if call.is_admin else ()


def deadline(call: Call[Any], options: ClientOptions, *, is_stream: bool = False) -> float | None:
    """When the whole call, retries included, must end. A stream without timeout has none."""
    if is_stream:
        return None if call.timeout is None else time.monotonic() + call.timeout
    return time.monotonic() + (call.timeout or options.timeout)


def _admin(method: str, request: Any, parse: Callable[[Any], T], timeout: float | None) -> Call[T]:
    return Call("admin", method, request, parse, timeout, is_admin=True)


# ---------------------------------------------------------------- retries


def retry_pause(
    service: str, address: str, error: grpc.RpcError, attempt: int, deadline: float | None, retry: RetryPolicy
) -> float:
    """Seconds to wait before retrying failed attempt `attempt` (0-based), or raise its KVCacheError.

    Retried only for a retryable code, while attempts remain and the pause ends before the deadline.
    """
    code = error.code() if hasattr(error, "code") else None
    if retry.should_retry(code, attempt):
        pause = retry.backoff(attempt)
        if deadline is None or time.monotonic() + pause < deadline:
            log.debug("%s at %s: %s, retry %d in %.2fs", service, address, code, attempt + 1, pause)
            return pause
    raise KVCacheError.from_rpc_error(service, address, error) from None


def remaining(deadline: float | None) -> float | None:
    """The timeout of the next attempt: what is left of the deadline (at least 1 ms)."""
    return None if deadline is None else max(0.001, deadline - time.monotonic())


# ---------------------------------------------------------------- blockd


def get_stats(pool_id: str | None, timeout: float | None) -> Call[Stats]:
    return _admin("GetStats", directory_pb2.GetStatsRequest(pool_id=pool_id or ""), Stats.from_proto, timeout)


def list_pools(timeout: float | None) -> Call[list[PoolInfo]]:
    return _admin(
        "ListPools",
        directory_pb2.ListPoolsRequest(),
        lambda reply: [PoolInfo.from_proto(p) for p in reply.pools],
        timeout,
    )


@dataclass(frozen=True)
class BlockPage:
    """One ListBlocks page; next_page_token "" means it was the last."""

    blocks: list[BlockInfo]
    next_page_token: str


def list_blocks_page(
    pool_id: str | None, page_size: int, page_token: str, timeout: float | None
) -> Call[BlockPage]:
    request = directory_pb2.ListBlocksRequest(
        pool_id=pool_id or "", page_size=page_size, page_token=page_token
    )
    return _admin(
        "ListBlocks",
        request,
        lambda reply: BlockPage([BlockInfo.from_proto(b) for b in reply.blocks], reply.next_page_token),
        timeout,
    )


def lookup(
    token_ids: Sequence[int],
    cache_salt: str,
    public_prefix_tokens: int,
    pool_id: str | None,
    timeout: float | None,
) -> Call[list[PoolMatch]]:
    request = directory_pb2.LookupRequest(
        token_ids=list(token_ids),
        cache_salt=cache_salt,
        public_prefix_tokens=public_prefix_tokens,
        pool_id=pool_id or "",
    )
    return _admin("Lookup", request, lambda reply: [PoolMatch.from_proto(m) for m in reply.matches], timeout)


def flush(
    pool_id: str | None, cache_salt: str | None, timeout: float | None, tier: str | None = None
) -> Call[FlushResult]:
    """tier: "device", "host" or "shared" flushes one tier; None every tier."""
    if tier is not None and tier not in TIERS_BY_NAME:
        raise ValueError(
            f"tier must be one of {sorted(TIERS_BY_NAME)} (or None for every tier), got {tier!r}"
        )
    request = directory_pb2.FlushRequest(
        pool_id=pool_id or "", cache_salt=cache_salt or "", tier=TIERS_BY_NAME[tier] if tier else 0
    )

    def answer(reply: directory_pb2.FlushResponse) -> FlushResult:
        tiers = {TIER_NAMES.get(t.tier, "unspecified"): (t.dropped, t.busy) for t in reply.tiers}
        return FlushResult(dropped=reply.dropped, busy=reply.busy, tiers=tiers)

    return _admin("Flush", request, answer, timeout)


def pin(
    token_ids: Sequence[int],
    cache_salt: str,
    public_prefix_tokens: int,
    ttl_seconds: float | None,
    pool_id: str | None,
    timeout: float | None,
) -> Call[PinResult]:
    request = directory_pb2.PinRequest(
        token_ids=list(token_ids),
        cache_salt=cache_salt,
        public_prefix_tokens=public_prefix_tokens,
        ttl_seconds=ttl_seconds or 0.0,
        pool_id=pool_id or "",
    )
    return _admin(
        "Pin",
        request,
        lambda reply: PinResult(
            reply.pin_id, reply.num_pinned_tokens, reply.num_pinned_blocks, reply.expires_in_seconds
        ),
        timeout,
    )


def unpin(pin_id: str, timeout: float | None) -> Call[int]:
    """Answers the number of blocks unpinned."""
    return _admin(
        "Unpin", directory_pb2.UnpinRequest(pin_id=pin_id), lambda reply: reply.num_unpinned_blocks, timeout
    )


def unpin_all(timeout: float | None) -> Call[tuple[int, int]]:
    """Answers (pins dropped, blocks they held)."""
    return _admin(
        "Unpin",
        directory_pb2.UnpinRequest(all=True),
        lambda reply: (reply.num_unpinned_pins, reply.num_unpinned_blocks),
        timeout,
    )


def explain_miss(
    token_ids: Sequence[int],
    cache_salt: str,
    public_prefix_tokens: int,
    pool_id: str | None,
    timeout: float | None,
) -> Call[list[MissExplanation]]:
    request = directory_pb2.ExplainMissRequest(
        token_ids=list(token_ids),
        cache_salt=cache_salt,
        public_prefix_tokens=public_prefix_tokens,
        pool_id=pool_id or "",
    )
    return _admin(
        "ExplainMiss", request, lambda reply: [MissExplanation.from_proto(p) for p in reply.pools], timeout
    )


def watch_events(after_sequence: int, pool_id: str | None, timeout: float | None) -> Call[BlockEvent]:
    """A server stream; timeout None means no deadline (watch until the reader stops)."""
    request = directory_pb2.WatchEventsRequest(after_sequence=after_sequence, pool_id=pool_id or "")
    return _admin("WatchEvents", request, BlockEvent.from_proto, timeout)


def route(
    token_ids: Sequence[int], cache_salt: str, public_prefix_tokens: int, timeout: float | None, retry: bool
) -> Call[Route]:
    request = directory_pb2.RouteRequest(
        token_ids=list(token_ids), cache_salt=cache_salt, public_prefix_tokens=public_prefix_tokens
    )
    return Call("routing", "Route", request, Route.from_proto, timeout, retry=None if retry else NO_RETRY)


# ---------------------------------------------------------------- computed


def generate(
    prompt: Prompt, params: SamplingParams, timeout: float | None, options: ClientOptions
) -> Call[GenerateChunk]:
    """A server stream of chunks whose deadline (default generate_timeout) covers the whole stream."""
    return Call(
        "generation",
        "Generate",
        prompt.to_request(params),
        GenerateChunk.from_proto,
        timeout or options.generate_timeout,
    )


def tokenize(
    text: str | None, messages: Sequence[MessageLike] | None, add_special_tokens: bool, timeout: float | None
) -> Call[list[int]]:
    if messages is not None:
        request = Prompt.of(messages=messages).to_tokenize_request()
    else:
        request = generation_pb2.TokenizeRequest(text=text or "", add_special_tokens=add_special_tokens)
    return Call("generation", "Tokenize", request, _token_ids, timeout)


def tokenize_prompt(prompt: Prompt, timeout: float | None) -> Call[list[int]]:
    """The Tokenize call answering the token ids Generate would see for `prompt` (text or messages)."""
    return Call("generation", "Tokenize", prompt.to_tokenize_request(), _token_ids, timeout)


def detokenize(token_ids: Sequence[int], timeout: float | None) -> Call[str]:
    request = generation_pb2.DetokenizeRequest(token_ids=list(token_ids))
    return Call("generation", "Detokenize", request, lambda reply: reply.text, timeout)


def model_info(timeout: float | None) -> Call[ModelInfo]:
    return Call(
        "generation", "GetModelInfo", generation_pb2.GetModelInfoRequest(), ModelInfo.from_proto, timeout
    )


def _token_ids(reply: generation_pb2.TokenizeResponse) -> list[int]:
    return list(reply.token_ids)
