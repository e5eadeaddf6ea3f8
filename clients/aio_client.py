"""asyncio Python client for blockd and computed; the same API as clients.client, awaited.

    async with AsyncKVCacheClient("127.0.0.1:50051", ["127.0.0.1:50052"]) as client:
        async for chunk in client.generate("Hello", max_tokens=16):
            print(chunk.text, end="")
        stats = await client.blockd.get_stats()

Create clients inside a running event loop: grpc.aio channels belong to the loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio

from clients.client import DEFAULT_BLOCKD, DEFAULT_COMPUTED
from clients.errors import KVCacheError
from clients.options import NO_RETRY, ClientOptions, RetryPolicy, open_aio_channel
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


class _AsyncEndpoint:
    """One daemon's aio channel and the retrying call helpers (see clients.client._Endpoint)."""

    def __init__(self, service: str, address: str, options: ClientOptions) -> None:
        self.service = service
        self.address = address
        self.options = options
        self.channel = open_aio_channel(address, options.tls)

    async def unary(self, method: Callable, request: Any, *, timeout: float | None = None,
                    metadata: Sequence[tuple[str, str]] = (), retry: RetryPolicy | None = None) -> Any:
        retry = retry or self.options.retry
        deadline = time.monotonic() + (timeout or self.options.timeout)
        attempt = 0
        while True:
            try:
                return await method(request, timeout=max(0.001, deadline - time.monotonic()),
                                    metadata=tuple(metadata))
            except grpc.RpcError as error:
                await self._backoff_or_raise(error, attempt, deadline, retry)
                attempt += 1

    async def stream(self, method: Callable, request: Any, *, timeout: float | None,
                     metadata: Sequence[tuple[str, str]] = ()) -> AsyncIterator[Any]:
        """Messages of a server stream. Retried only before the first message arrived."""
        deadline = time.monotonic() + timeout if timeout is not None else None
        attempt = 0
        while True:
            remaining = max(0.001, deadline - time.monotonic()) if deadline is not None else None
            call = method(request, timeout=remaining, metadata=tuple(metadata))
            received = False
            try:
                async for message in call:
                    received = True
                    yield message
                return
            except grpc.RpcError as error:
                if received:
                    raise KVCacheError.from_rpc_error(self.service, self.address, error) from None
                await self._backoff_or_raise(error, attempt, deadline, self.options.retry)
                attempt += 1
            finally:
                call.cancel()

    async def _backoff_or_raise(self, error: grpc.RpcError, attempt: int, deadline: float | None,
                                retry: RetryPolicy) -> None:
        code = error.code() if hasattr(error, "code") else None
        if retry.should_retry(code, attempt):
            pause = retry.backoff(attempt)
            if deadline is None or time.monotonic() + pause < deadline:
                log.debug("%s at %s: %s, retry %d in %.2fs", self.service, self.address, code,
                          attempt + 1, pause)
                await asyncio.sleep(pause)
                return
        raise KVCacheError.from_rpc_error(self.service, self.address, error) from None

    async def close(self) -> None:
        await self.channel.close()


class AsyncGenerateStream:
    """Async iterator of GenerateChunk; worker_address says which computed serves it."""

    def __init__(self, worker_address: str) -> None:
        self.worker_address = worker_address
        self._chunks: AsyncIterator[GenerateChunk] | None = None

    def __aiter__(self) -> AsyncGenerateStream:
        return self

    async def __anext__(self) -> GenerateChunk:
        assert self._chunks is not None, "stream not started"
        return await self._chunks.__anext__()

    async def cancel(self) -> None:
        """Stop reading; the server cancels the request."""
        aclose = getattr(self._chunks, "aclose", None)
        if aclose is not None:
            await aclose()

    async def completion(self) -> Completion:
        chunks = [chunk async for chunk in self]
        return Completion.from_chunks(chunks, self.worker_address)


class AsyncBlockdClient:
    """Operator and routing calls to one blockd (see clients.client.BlockdClient)."""

    def __init__(self, address: str = DEFAULT_BLOCKD, options: ClientOptions | None = None) -> None:
        self.options = options or ClientOptions()
        self._endpoint = _AsyncEndpoint("blockd", address, self.options)
        self._admin = directory_pb2_grpc.DirectoryAdminServiceStub(self._endpoint.channel)
        self._routing = directory_pb2_grpc.RoutingServiceStub(self._endpoint.channel)

    @property
    def address(self) -> str:
        return self._endpoint.address

    async def _admin_call(self, method: Callable, request: Any, timeout: float | None) -> Any:
        return await self._endpoint.unary(method, request, timeout=timeout,
                                          metadata=self.options.admin_metadata())

    async def get_stats(self, pool_id: str | None = None, *, timeout: float | None = None) -> Stats:
        request = directory_pb2.GetStatsRequest(pool_id=pool_id or "")
        return Stats.from_proto(await self._admin_call(self._admin.GetStats, request, timeout))

    async def list_pools(self, *, timeout: float | None = None) -> list[PoolInfo]:
        reply = await self._admin_call(self._admin.ListPools, directory_pb2.ListPoolsRequest(), timeout)
        return [PoolInfo.from_proto(p) for p in reply.pools]

    async def iter_blocks(self, pool_id: str | None = None, *, page_size: int = 1000,
                          timeout: float | None = None) -> AsyncIterator[BlockInfo]:
        token = ""
        while True:
            request = directory_pb2.ListBlocksRequest(pool_id=pool_id or "", page_size=page_size,
                                                      page_token=token)
            reply = await self._admin_call(self._admin.ListBlocks, request, timeout)
            for block in reply.blocks:
                yield BlockInfo.from_proto(block)
            token = reply.next_page_token
            if not token:
                return

    async def list_blocks(self, pool_id: str | None = None, **kwargs: Any) -> list[BlockInfo]:
        return [block async for block in self.iter_blocks(pool_id, **kwargs)]

    async def lookup(self, token_ids: Sequence[int], *, cache_salt: str = "", public_prefix_tokens: int = 0,
                     pool_id: str | None = None, timeout: float | None = None) -> list[PoolMatch]:
        request = directory_pb2.LookupRequest(token_ids=list(token_ids), cache_salt=cache_salt,
                                              public_prefix_tokens=public_prefix_tokens, pool_id=pool_id or "")
        reply = await self._admin_call(self._admin.Lookup, request, timeout)
        return [PoolMatch.from_proto(m) for m in reply.matches]

    async def flush(self, *, pool_id: str | None = None, cache_salt: str | None = None,
                    timeout: float | None = None) -> FlushResult:
        request = directory_pb2.FlushRequest(pool_id=pool_id or "", cache_salt=cache_salt or "")
        reply = await self._admin_call(self._admin.Flush, request, timeout)
        return FlushResult(dropped=reply.dropped, busy=reply.busy)

    async def pin(self, token_ids: Sequence[int], *, cache_salt: str = "", public_prefix_tokens: int = 0,
                  ttl_seconds: float | None = None, pool_id: str | None = None,
                  timeout: float | None = None) -> PinResult:
        request = directory_pb2.PinRequest(token_ids=list(token_ids), cache_salt=cache_salt,
                                           public_prefix_tokens=public_prefix_tokens,
                                           ttl_seconds=ttl_seconds or 0.0, pool_id=pool_id or "")
        reply = await self._admin_call(self._admin.Pin, request, timeout)
        return PinResult(reply.pin_id, reply.num_pinned_tokens, reply.num_pinned_blocks,
                         reply.expires_in_seconds)

    async def unpin(self, pin_id: str, *, timeout: float | None = None) -> int:
        reply = await self._admin_call(self._admin.Unpin, directory_pb2.UnpinRequest(pin_id=pin_id), timeout)
        return reply.num_unpinned_blocks

    async def watch_events(self, after_sequence: int = 0, *, pool_id: str | None = None,
                           timeout: float | None = None) -> AsyncIterator[BlockEvent]:
        request = directory_pb2.WatchEventsRequest(after_sequence=after_sequence, pool_id=pool_id or "")
        async for reply in self._endpoint.stream(self._admin.WatchEvents, request, timeout=timeout,
                                                 metadata=self.options.admin_metadata()):
            yield BlockEvent.from_proto(reply)

    async def route(self, token_ids: Sequence[int], *, cache_salt: str = "", public_prefix_tokens: int = 0,
                    timeout: float | None = None, retry: bool = True) -> Route:
        request = directory_pb2.RouteRequest(token_ids=list(token_ids), cache_salt=cache_salt,
                                             public_prefix_tokens=public_prefix_tokens)
        reply = await self._endpoint.unary(self._routing.Route, request, timeout=timeout,
                                           retry=None if retry else NO_RETRY)
        return Route.from_proto(reply)

    async def close(self) -> None:
        await self._endpoint.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncComputedClient:
    """GenerationService calls to one computed (see clients.client.ComputedClient)."""

    def __init__(self, address: str = DEFAULT_COMPUTED, options: ClientOptions | None = None) -> None:
        self.options = options or ClientOptions()
        self._endpoint = _AsyncEndpoint("computed", address, self.options)
        self._stub = generation_pb2_grpc.GenerationServiceStub(self._endpoint.channel)

    @property
    def address(self) -> str:
        return self._endpoint.address

    def generate(self, prompt: str | None = None, *, token_ids: Sequence[int] | None = None,
                 messages: Sequence[MessageLike] | None = None, cache_salt: str = "",
                 public_prefix_tokens: int = 0, request_id: str = "", timeout: float | None = None,
                 **sampling: Any) -> AsyncGenerateStream:
        request = Prompt.of(prompt, token_ids=token_ids, messages=messages, cache_salt=cache_salt,
                            public_prefix_tokens=public_prefix_tokens, request_id=request_id)
        return self.generate_prompt(request, SamplingParams.of(**sampling), timeout)

    async def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        return await self.generate(prompt, **kwargs).completion()

    def generate_prompt(self, prompt: Prompt, params: SamplingParams,
                        timeout: float | None = None) -> AsyncGenerateStream:
        stream = AsyncGenerateStream(self.address)
        stream._chunks = self._chunks(prompt, params, timeout)
        return stream

    async def _chunks(self, prompt: Prompt, params: SamplingParams,
                      timeout: float | None) -> AsyncIterator[GenerateChunk]:
        async for message in self._endpoint.stream(self._stub.Generate, prompt.to_request(params),
                                                    timeout=timeout or self.options.generate_timeout):
            yield GenerateChunk.from_proto(message)

    async def tokenize(self, text: str | None = None, *, messages: Sequence[MessageLike] | None = None,
                       add_special_tokens: bool = True, timeout: float | None = None) -> list[int]:
        if messages is not None:
            request = Prompt.of(messages=messages).to_tokenize_request()
        else:
            request = generation_pb2.TokenizeRequest(text=text or "", add_special_tokens=add_special_tokens)
        return list((await self._endpoint.unary(self._stub.Tokenize, request, timeout=timeout)).token_ids)

    async def tokenize_prompt(self, prompt: Prompt, timeout: float | None = None) -> list[int]:
        if prompt.token_ids is not None:
            return list(prompt.token_ids)
        reply = await self._endpoint.unary(self._stub.Tokenize, prompt.to_tokenize_request(), timeout=timeout)
        return list(reply.token_ids)

    async def detokenize(self, token_ids: Sequence[int], *, timeout: float | None = None) -> str:
        request = generation_pb2.DetokenizeRequest(token_ids=list(token_ids))
        return (await self._endpoint.unary(self._stub.Detokenize, request, timeout=timeout)).text

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        reply = await self._endpoint.unary(self._stub.GetModelInfo, generation_pb2.GetModelInfoRequest(),
                                           timeout=timeout)
        return ModelInfo.from_proto(reply)

    async def close(self) -> None:
        await self._endpoint.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncKVCacheClient:
    """blockd plus computed workers with routed Generate (see clients.client.KVCacheClient)."""

    def __init__(self, blockd: str = DEFAULT_BLOCKD, computed: Sequence[str] | str = (DEFAULT_COMPUTED,),
                 *, routing: str = "cache-aware", options: ClientOptions | None = None,
                 route_timeout: float = 2.0) -> None:
        self.options = options or ClientOptions()
        addresses = [computed] if isinstance(computed, str) else list(computed)
        self.routing = validate_mode(routing)
        self.route_timeout = route_timeout
        self.blockd = AsyncBlockdClient(blockd, self.options)
        self._round_robin = RoundRobin(addresses)
        self._workers = {a: AsyncComputedClient(a, self.options) for a in self._round_robin.addresses}
        self.num_routed = 0
        self.num_round_robin = 0

    @property
    def computed_addresses(self) -> tuple[str, ...]:
        return self._round_robin.addresses

    def computed(self, address: str | None = None) -> AsyncComputedClient:
        return self._workers[address or self.computed_addresses[0]]

    async def pick_worker(self, prompt: Prompt) -> str:
        if self.routing == "cache-aware" and len(self._workers) > 1:
            try:
                token_ids = await self.tokenize_prompt(prompt)
                route = await self.blockd.route(token_ids, cache_salt=prompt.cache_salt,
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
                 **sampling: Any) -> AsyncGenerateStream:
        """Routing happens when the stream is first read."""
        request = Prompt.of(prompt, token_ids=token_ids, messages=messages, cache_salt=cache_salt,
                            public_prefix_tokens=public_prefix_tokens, request_id=request_id)
        return self.generate_prompt(request, SamplingParams.of(**sampling), timeout)

    def generate_prompt(self, prompt: Prompt, params: SamplingParams,
                        timeout: float | None = None) -> AsyncGenerateStream:
        stream = AsyncGenerateStream("")
        stream._chunks = self._failover(prompt, params, timeout, stream)
        return stream

    async def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        return await self.generate(prompt, **kwargs).completion()

    async def _failover(self, prompt: Prompt, params: SamplingParams, timeout: float | None,
                        stream: AsyncGenerateStream) -> AsyncIterator[GenerateChunk]:
        first = await self.pick_worker(prompt)
        order = [first] + [a for a in self.computed_addresses if a != first]
        for i, address in enumerate(order):
            stream.worker_address = address
            inner = self._workers[address].generate_prompt(prompt, params, timeout)
            try:
                head = await inner.__anext__()
            except StopAsyncIteration:
                return
            except KVCacheError as error:
                if error.code is grpc.StatusCode.UNAVAILABLE and i + 1 < len(order):
                    log.debug("%s; trying %s", error, order[i + 1])
                    continue
                raise
            try:
                yield head
                async for chunk in inner:
                    yield chunk
            finally:
                await inner.cancel()
            return

    async def tokenize_prompt(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids, from the first computed that answers."""
        if prompt.token_ids is not None:
            return list(prompt.token_ids)
        last: KVCacheError | None = None
        for address in self.computed_addresses:
            try:
                return await self._workers[address].tokenize_prompt(prompt, timeout=self.route_timeout)
            except KVCacheError as error:
                if not error.is_unreachable:
                    raise
                last = error
        assert last is not None
        raise last

    async def close(self) -> None:
        await self.blockd.close()
        for worker in self._workers.values():
            await worker.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
