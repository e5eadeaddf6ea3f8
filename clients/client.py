"""Synchronous Python client for blockd and computed.

    with KVCacheClient("127.0.0.1:50051", ["127.0.0.1:50052"]) as client:
        for chunk in client.generate("Hello", max_tokens=16):
            print(chunk.text, end="")
        completion = client.complete(messages=[("system", "Be brief."), ("user", "Hi")])
        print(completion.usage.cached_tokens, client.blockd.get_stats().total.hit_rate)

Every call has a deadline (ClientOptions.timeout, or generate_timeout for a whole
Generate stream) that also bounds its retries; UNAVAILABLE is retried with
exponential backoff and jitter (RetryPolicy). Failures raise KVCacheError.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from clients.errors import KVCacheError
from clients.options import NO_RETRY, ClientOptions, RetryPolicy, open_channel
from clients.requests import MessageLike, Prompt, SamplingParams
from clients.routing import RoundRobin, choose_routed, validate_mode
from clients.types import (
    BlockEvent,
    BlockInfo,
    Completion,
    FlushResult,
    GenerateChunk,
    ModelInfo,
    PinResult,
    PoolInfo,
    PoolMatch,
    Route,
    Stats,
)
from kvcache.v1 import directory_pb2, directory_pb2_grpc, generation_pb2, generation_pb2_grpc

if TYPE_CHECKING:
    from typing import Self

log = logging.getLogger(__name__)

DEFAULT_BLOCKD = "127.0.0.1:50051"
DEFAULT_COMPUTED = "127.0.0.1:50052"


class _Endpoint:
    """One daemon's channel and the retrying call helpers.

    A call's deadline covers all of its attempts: each attempt gets what is left,
    and a backoff never sleeps past the deadline.
    """

    def __init__(self, service: str, address: str, options: ClientOptions) -> None:
        self.service = service
        self.address = address
        self.options = options
        self.channel = open_channel(address, options.tls)

    def unary(self, method: Callable, request: Any, *, timeout: float | None = None,
              metadata: Sequence[tuple[str, str]] = (), retry: RetryPolicy | None = None) -> Any:
        retry = retry or self.options.retry
        deadline = time.monotonic() + (timeout or self.options.timeout)
        attempt = 0
        while True:
            try:
                return method(request, timeout=max(0.001, deadline - time.monotonic()),
                              metadata=tuple(metadata))
            except grpc.RpcError as error:
                self._backoff_or_raise(error, attempt, deadline, retry)
                attempt += 1

    def stream(self, method: Callable, request: Any, *, timeout: float | None,
               metadata: Sequence[tuple[str, str]] = ()) -> Iterator[Any]:
        """Messages of a server stream. Retried only before the first message arrived."""
        deadline = time.monotonic() + timeout if timeout is not None else None
        attempt = 0
        while True:
            remaining = max(0.001, deadline - time.monotonic()) if deadline is not None else None
            call = method(request, timeout=remaining, metadata=tuple(metadata))
            received = False
            try:
                for message in call:
                    received = True
                    yield message
                return
            except grpc.RpcError as error:
                if received:
                    raise KVCacheError.from_rpc_error(self.service, self.address, error) from None
                self._backoff_or_raise(error, attempt, deadline, self.options.retry)
                attempt += 1
            finally:
                call.cancel()  # no-op when finished; stops server work when the reader quits

    def _backoff_or_raise(self, error: grpc.RpcError, attempt: int, deadline: float | None,
                          retry: RetryPolicy) -> None:
        code = error.code() if hasattr(error, "code") else None
        if retry.should_retry(code, attempt):
            pause = retry.backoff(attempt)
            if deadline is None or time.monotonic() + pause < deadline:
                log.debug("%s at %s: %s, retry %d in %.2fs", self.service, self.address, code,
                          attempt + 1, pause)
                time.sleep(pause)
                return
        raise KVCacheError.from_rpc_error(self.service, self.address, error) from None

    def close(self) -> None:
        self.channel.close()


class GenerateStream:
    """Iterator of GenerateChunk; worker_address says which computed serves it."""

    def __init__(self, worker_address: str, chunks: Iterator[GenerateChunk]) -> None:
        self.worker_address = worker_address
        self._chunks = chunks

    def __iter__(self) -> GenerateStream:
        return self

    def __next__(self) -> GenerateChunk:
        return next(self._chunks)

    def cancel(self) -> None:
        """Stop reading; the server cancels the request."""
        close = getattr(self._chunks, "close", None)
        if close is not None:
            close()

    def completion(self) -> Completion:
        """Read the rest of the stream into one Completion."""
        chunks = list(self)
        return Completion.from_chunks(chunks, self.worker_address)


class BlockdClient:
    """Operator (DirectoryAdminService) and routing (RoutingService) calls to one blockd."""

    def __init__(self, address: str = DEFAULT_BLOCKD, options: ClientOptions | None = None) -> None:
        self.options = options or ClientOptions()
        self._endpoint = _Endpoint("blockd", address, self.options)
        self._admin = directory_pb2_grpc.DirectoryAdminServiceStub(self._endpoint.channel)
        self._routing = directory_pb2_grpc.RoutingServiceStub(self._endpoint.channel)

    @property
    def address(self) -> str:
        return self._endpoint.address

    def _admin_call(self, method: Callable, request: Any, timeout: float | None) -> Any:
        return self._endpoint.unary(method, request, timeout=timeout, metadata=self.options.admin_metadata())

    def get_stats(self, pool_id: str | None = None, *, timeout: float | None = None) -> Stats:
        reply = self._admin_call(self._admin.GetStats, directory_pb2.GetStatsRequest(pool_id=pool_id or ""),
                                 timeout)
        return Stats.from_proto(reply)

    def list_pools(self, *, timeout: float | None = None) -> list[PoolInfo]:
        reply = self._admin_call(self._admin.ListPools, directory_pb2.ListPoolsRequest(), timeout)
        return [PoolInfo.from_proto(p) for p in reply.pools]

    def iter_blocks(self, pool_id: str | None = None, *, page_size: int = 1000,
                    timeout: float | None = None) -> Iterator[BlockInfo]:
        """Every cached block, ordered by (pool_id, block_id), fetched page by page."""
        token = ""
        while True:
            request = directory_pb2.ListBlocksRequest(pool_id=pool_id or "", page_size=page_size,
                                                      page_token=token)
            reply = self._admin_call(self._admin.ListBlocks, request, timeout)
            yield from (BlockInfo.from_proto(b) for b in reply.blocks)
            token = reply.next_page_token
            if not token:
                return

    def list_blocks(self, pool_id: str | None = None, **kwargs: Any) -> list[BlockInfo]:
        return list(self.iter_blocks(pool_id, **kwargs))

    def lookup(self, token_ids: Sequence[int], *, cache_salt: str = "", public_prefix_tokens: int = 0,
               pool_id: str | None = None, timeout: float | None = None) -> list[PoolMatch]:
        request = directory_pb2.LookupRequest(token_ids=list(token_ids), cache_salt=cache_salt,
                                              public_prefix_tokens=public_prefix_tokens, pool_id=pool_id or "")
        reply = self._admin_call(self._admin.Lookup, request, timeout)
        return [PoolMatch.from_proto(m) for m in reply.matches]

    def flush(self, *, pool_id: str | None = None, cache_salt: str | None = None,
              timeout: float | None = None) -> FlushResult:
        request = directory_pb2.FlushRequest(pool_id=pool_id or "", cache_salt=cache_salt or "")
        reply = self._admin_call(self._admin.Flush, request, timeout)
        return FlushResult(dropped=reply.dropped, busy=reply.busy)

    def pin(self, token_ids: Sequence[int], *, cache_salt: str = "", public_prefix_tokens: int = 0,
            ttl_seconds: float | None = None, pool_id: str | None = None,
            timeout: float | None = None) -> PinResult:
        request = directory_pb2.PinRequest(token_ids=list(token_ids), cache_salt=cache_salt,
                                           public_prefix_tokens=public_prefix_tokens,
                                           ttl_seconds=ttl_seconds or 0.0, pool_id=pool_id or "")
        reply = self._admin_call(self._admin.Pin, request, timeout)
        return PinResult(reply.pin_id, reply.num_pinned_tokens, reply.num_pinned_blocks,
                         reply.expires_in_seconds)

    def unpin(self, pin_id: str, *, timeout: float | None = None) -> int:
        """Returns the number of blocks unpinned."""
        reply = self._admin_call(self._admin.Unpin, directory_pb2.UnpinRequest(pin_id=pin_id), timeout)
        return reply.num_unpinned_blocks

    def watch_events(self, after_sequence: int = 0, *, pool_id: str | None = None,
                     timeout: float | None = None) -> Iterator[BlockEvent]:
        """Block events as they happen. timeout None: watch until the caller stops reading."""
        request = directory_pb2.WatchEventsRequest(after_sequence=after_sequence, pool_id=pool_id or "")
        for reply in self._endpoint.stream(self._admin.WatchEvents, request, timeout=timeout,
                                           metadata=self.options.admin_metadata()):
            yield BlockEvent.from_proto(reply)

    def route(self, token_ids: Sequence[int], *, cache_salt: str = "", public_prefix_tokens: int = 0,
              timeout: float | None = None, retry: bool = True) -> Route:
        request = directory_pb2.RouteRequest(token_ids=list(token_ids), cache_salt=cache_salt,
                                             public_prefix_tokens=public_prefix_tokens)
        reply = self._endpoint.unary(self._routing.Route, request, timeout=timeout,
                                     retry=None if retry else NO_RETRY)
        return Route.from_proto(reply)

    def close(self) -> None:
        self._endpoint.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ComputedClient:
    """GenerationService calls to one computed."""

    def __init__(self, address: str = DEFAULT_COMPUTED, options: ClientOptions | None = None) -> None:
        self.options = options or ClientOptions()
        self._endpoint = _Endpoint("computed", address, self.options)
        self._stub = generation_pb2_grpc.GenerationServiceStub(self._endpoint.channel)

    @property
    def address(self) -> str:
        return self._endpoint.address

    def generate(self, prompt: str | None = None, *, token_ids: Sequence[int] | None = None,
                 messages: Sequence[MessageLike] | None = None, cache_salt: str = "",
                 public_prefix_tokens: int = 0, request_id: str = "", timeout: float | None = None,
                 **sampling: Any) -> GenerateStream:
        """Stream a completion. sampling: max_tokens, temperature, top_p, top_k, seed, stop, ..."""
        request = Prompt.of(prompt, token_ids=token_ids, messages=messages, cache_salt=cache_salt,
                            public_prefix_tokens=public_prefix_tokens, request_id=request_id)
        return self.generate_prompt(request, SamplingParams.of(**sampling), timeout=timeout)

    def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        return self.generate(prompt, **kwargs).completion()

    def generate_prompt(self, prompt: Prompt, params: SamplingParams,
                        timeout: float | None = None) -> GenerateStream:
        messages = self._endpoint.stream(self._stub.Generate, prompt.to_request(params),
                                         timeout=timeout or self.options.generate_timeout)
        return GenerateStream(self.address, (GenerateChunk.from_proto(m) for m in messages))

    def tokenize(self, text: str | None = None, *, messages: Sequence[MessageLike] | None = None,
                 add_special_tokens: bool = True, timeout: float | None = None) -> list[int]:
        if messages is not None:
            prompt = Prompt.of(messages=messages)
            request = prompt.to_tokenize_request()
        else:
            request = generation_pb2.TokenizeRequest(text=text or "", add_special_tokens=add_special_tokens)
        return list(self._endpoint.unary(self._stub.Tokenize, request, timeout=timeout).token_ids)

    def tokenize_prompt(self, prompt: Prompt, timeout: float | None = None) -> list[int]:
        """The token ids Generate will see for this prompt."""
        if prompt.token_ids is not None:
            return list(prompt.token_ids)
        reply = self._endpoint.unary(self._stub.Tokenize, prompt.to_tokenize_request(), timeout=timeout)
        return list(reply.token_ids)

    def detokenize(self, token_ids: Sequence[int], *, timeout: float | None = None) -> str:
        request = generation_pb2.DetokenizeRequest(token_ids=list(token_ids))
        return self._endpoint.unary(self._stub.Detokenize, request, timeout=timeout).text

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        reply = self._endpoint.unary(self._stub.GetModelInfo, generation_pb2.GetModelInfoRequest(),
                                     timeout=timeout)
        return ModelInfo.from_proto(reply)

    def close(self) -> None:
        self._endpoint.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVCacheClient:
    """blockd plus one or more computed workers, with Generate routed among the workers.

    routing "cache-aware": tokenize on a worker, ask blockd's Route which known worker
    holds the longest cached prefix, send Generate there; round robin when blockd
    cannot answer or ranks no known worker. "round-robin": never ask blockd.
    A worker that is unreachable before its first token is skipped for the next one.
    """

    def __init__(self, blockd: str = DEFAULT_BLOCKD, computed: Sequence[str] | str = (DEFAULT_COMPUTED,),
                 *, routing: str = "cache-aware", options: ClientOptions | None = None,
                 route_timeout: float = 2.0) -> None:
        self.options = options or ClientOptions()
        addresses = [computed] if isinstance(computed, str) else list(computed)
        self.routing = validate_mode(routing)
        self.route_timeout = route_timeout
        self.blockd = BlockdClient(blockd, self.options)
        self._round_robin = RoundRobin(addresses)
        self._workers = {a: ComputedClient(a, self.options) for a in self._round_robin.addresses}
        self.num_routed = 0  # requests placed by blockd's Route
        self.num_round_robin = 0  # requests placed by round robin (mode, or fallback)

    @property
    def computed_addresses(self) -> tuple[str, ...]:
        return self._round_robin.addresses

    def computed(self, address: str | None = None) -> ComputedClient:
        """The client of one worker (the first one by default)."""
        return self._workers[address or self.computed_addresses[0]]

    def pick_worker(self, prompt: Prompt) -> str:
        if self.routing == "cache-aware" and len(self._workers) > 1:
            try:
                token_ids = self.tokenize_prompt(prompt)
                route = self.blockd.route(token_ids, cache_salt=prompt.cache_salt,
                                          public_prefix_tokens=prompt.public_prefix_tokens,
                                          timeout=self.route_timeout, retry=False)
            except KVCacheError as error:
                log.debug("routing falls back to round robin: %s", error)
            else:
                chosen = choose_routed(route, self.computed_addresses)
                if chosen is not None:
                    self.num_routed += 1
                    return chosen
        self.num_round_robin += 1
        return self._round_robin.next()

    def generate(self, prompt: str | None = None, *, token_ids: Sequence[int] | None = None,
                 messages: Sequence[MessageLike] | None = None, cache_salt: str = "",
                 public_prefix_tokens: int = 0, request_id: str = "", timeout: float | None = None,
                 **sampling: Any) -> GenerateStream:
        request = Prompt.of(prompt, token_ids=token_ids, messages=messages, cache_salt=cache_salt,
                            public_prefix_tokens=public_prefix_tokens, request_id=request_id)
        return self.generate_prompt(request, SamplingParams.of(**sampling), timeout)

    def generate_prompt(self, prompt: Prompt, params: SamplingParams,
                        timeout: float | None = None) -> GenerateStream:
        """Routes now; a worker unreachable before its first token is replaced by the next one."""
        first = self.pick_worker(prompt)
        stream = GenerateStream(first, iter(()))
        stream._chunks = self._failover(prompt, params, timeout, first, stream)
        return stream

    def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        return self.generate(prompt, **kwargs).completion()

    def _failover(self, prompt: Prompt, params: SamplingParams, timeout: float | None, first: str,
                  stream: GenerateStream) -> Iterator[GenerateChunk]:
        order = [first] + [a for a in self.computed_addresses if a != first]
        for i, address in enumerate(order):
            stream.worker_address = address
            inner = self._workers[address].generate_prompt(prompt, params, timeout)
            try:
                head = next(inner)
            except StopIteration:
                return
            except KVCacheError as error:
                if error.code is grpc.StatusCode.UNAVAILABLE and i + 1 < len(order):
                    log.debug("%s; trying %s", error, order[i + 1])
                    continue
                raise
            yield head
            yield from inner
            return

    def tokenize_prompt(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids, from the first computed that answers."""
        if prompt.token_ids is not None:
            return list(prompt.token_ids)
        last: KVCacheError | None = None
        for address in self.computed_addresses:
            try:
                return self._workers[address].tokenize_prompt(prompt, timeout=self.route_timeout)
            except KVCacheError as error:
                if not error.is_unreachable:
                    raise
                last = error
        assert last is not None
        raise last

    def close(self) -> None:
        self.blockd.close()
        for worker in self._workers.values():
            worker.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

