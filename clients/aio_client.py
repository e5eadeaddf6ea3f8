"""asyncio Python client for blockd and computed; the same API as clients.client, awaited.

    async with AsyncKVCacheClient("127.0.0.1:50051", ["127.0.0.1:50052"]) as client:
        async for chunk in client.generate("Hello", max_tokens=16):
            print(chunk.text, end="")
        stats = await client.blockd.get_stats()

Create clients inside a running event loop: grpc.aio channels belong to the loop.
Requests, replies and routing decisions come from `clients.core` and
`clients.routing.Router`, as in clients.client; only the awaiting differs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import grpc.aio

from clients import core
from clients.client import DEFAULT_BLOCKD, DEFAULT_COMPUTED
from clients.errors import KVCacheError
from clients.options import ClientOptions, open_aio_channel
from clients.requests import WHOLE_COMPLETION, MessageLike, Prompt, SamplingParams
from clients.routing import Router, Tokenized
from clients.types import (
    BlockEvent,
    BlockInfo,
    Completion,
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

if TYPE_CHECKING:
    from typing import Self

log = logging.getLogger(__name__)
T = TypeVar("T")


class _AsyncEndpoint:
    """One daemon's aio channel; makes a `core.Call` (see clients.client._Endpoint)."""

    def __init__(self, service: str, address: str, options: ClientOptions) -> None:
        self.service = service
        self.address = address
        self.options = options
        self.channel = open_aio_channel(address, options.tls)
        self._stubs = core.stubs(service, self.channel)

    async def call(self, call: core.Call[T]) -> T:
        method = getattr(self._stubs[call.stub], call.method)
        retry = call.retry or self.options.retry
        deadline = core.deadline(call, self.options)
        metadata = core.metadata(call, self.options)
        attempt = 0
        while True:
            try:
                reply = await method(call.request, timeout=core.remaining(deadline), metadata=metadata)
            except grpc.RpcError as error:
                await asyncio.sleep(
                    core.retry_pause(self.service, self.address, error, attempt, deadline, retry)
                )
                attempt += 1
                continue
            return call.parse(reply)

    async def stream(self, call: core.Call[T]) -> AsyncIterator[T]:
        """Parsed messages of a server stream. Retried only before the first message arrived."""
        method = getattr(self._stubs[call.stub], call.method)
        deadline = core.deadline(call, self.options, is_stream=True)
        metadata = core.metadata(call, self.options)
        attempt = 0
        while True:
            rpc = method(call.request, timeout=core.remaining(deadline), metadata=metadata)
            received = False
            try:
                async for message in rpc:
                    received = True
                    yield call.parse(message)
                return
            except grpc.RpcError as error:
                if received:
                    raise KVCacheError.from_rpc_error(self.service, self.address, error) from None
                pause = core.retry_pause(
                    self.service, self.address, error, attempt, deadline, self.options.retry
                )
                await asyncio.sleep(pause)
                attempt += 1
            finally:
                rpc.cancel()

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

    @property
    def address(self) -> str:
        return self._endpoint.address

    async def get_stats(self, pool_id: str | None = None, *, timeout: float | None = None) -> Stats:
        return await self._endpoint.call(core.get_stats(pool_id, timeout))

    async def list_pools(self, *, timeout: float | None = None) -> list[PoolInfo]:
        return await self._endpoint.call(core.list_pools(timeout))

    async def iter_blocks(
        self, pool_id: str | None = None, *, page_size: int = 1000, timeout: float | None = None
    ) -> AsyncIterator[BlockInfo]:
        """Every cached block, ordered by (pool_id, block_id), fetched page by page."""
        token = ""
        while True:
            page = await self._endpoint.call(core.list_blocks_page(pool_id, page_size, token, timeout))
            for block in page.blocks:
                yield block
            token = page.next_page_token
            if not token:
                return

    async def list_blocks(self, pool_id: str | None = None, **kwargs: Any) -> list[BlockInfo]:
        return [block async for block in self.iter_blocks(pool_id, **kwargs)]

    async def lookup(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str = "",
        public_prefix_tokens: int = 0,
        pool_id: str | None = None,
        timeout: float | None = None,
    ) -> list[PoolMatch]:
        return await self._endpoint.call(
            core.lookup(token_ids, cache_salt, public_prefix_tokens, pool_id, timeout)
        )

    async def flush(
        self,
        *,
        pool_id: str | None = None,
        cache_salt: str | None = None,
        tier: str | None = None,
        timeout: float | None = None,
    ) -> FlushResult:
        """Drop unreferenced cached blocks of every tier, or of `tier` ("device", "host", "shared")."""
        return await self._endpoint.call(core.flush(pool_id, cache_salt, timeout, tier))

    async def pin(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str = "",
        public_prefix_tokens: int = 0,
        ttl_seconds: float | None = None,
        pool_id: str | None = None,
        timeout: float | None = None,
    ) -> PinResult:
        return await self._endpoint.call(
            core.pin(token_ids, cache_salt, public_prefix_tokens, ttl_seconds, pool_id, timeout)
        )

    async def unpin(self, pin_id: str, *, timeout: float | None = None) -> int:
        """Returns the number of blocks unpinned."""
        return await self._endpoint.call(core.unpin(pin_id, timeout))

    async def unpin_all(self, *, timeout: float | None = None) -> tuple[int, int]:
        """Drops every pin; returns (pins dropped, blocks they held)."""
        return await self._endpoint.call(core.unpin_all(timeout))

    async def explain_miss(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str = "",
        public_prefix_tokens: int = 0,
        pool_id: str | None = None,
        timeout: float | None = None,
    ) -> list[MissExplanation]:
        """Why each live pool (or one) does not hold the prompt past its cached prefix."""
        return await self._endpoint.call(
            core.explain_miss(token_ids, cache_salt, public_prefix_tokens, pool_id, timeout)
        )

    async def watch_events(
        self, after_sequence: int = 0, *, pool_id: str | None = None, timeout: float | None = None
    ) -> AsyncIterator[BlockEvent]:
        """Block events as they happen. timeout None: watch until the caller stops reading."""
        async for event in self._endpoint.stream(core.watch_events(after_sequence, pool_id, timeout)):
            yield event

    async def route(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str = "",
        public_prefix_tokens: int = 0,
        timeout: float | None = None,
        retry: bool = True,
    ) -> Route:
        return await self._endpoint.call(
            core.route(token_ids, cache_salt, public_prefix_tokens, timeout, retry)
        )

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

    @property
    def address(self) -> str:
        return self._endpoint.address

    def generate(
        self,
        prompt: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        messages: Sequence[MessageLike] | None = None,
        cache_salt: str = "",
        public_prefix_tokens: int = 0,
        request_id: str = "",
        cache_policy: str = "store",
        retention_priority: int = 0,
        timeout: float | None = None,
        **sampling: Any,
    ) -> AsyncGenerateStream:
        """Stream a completion. sampling: max_tokens, temperature, top_p, top_k, seed, stop, ..."""
        request = Prompt.of(
            prompt,
            token_ids=token_ids,
            messages=messages,
            cache_salt=cache_salt,
            public_prefix_tokens=public_prefix_tokens,
            request_id=request_id,
            cache_policy=cache_policy,
            retention_priority=retention_priority,
        )
        return self.generate_prompt(request, SamplingParams.of(**sampling), timeout)

    async def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        kwargs.setdefault("stream_interval", WHOLE_COMPLETION)
        return await self.generate(prompt, **kwargs).completion()

    def generate_prompt(
        self, prompt: Prompt, params: SamplingParams, timeout: float | None = None
    ) -> AsyncGenerateStream:
        stream = AsyncGenerateStream(self.address)
        stream._chunks = self._endpoint.stream(core.generate(prompt, params, timeout, self.options))
        return stream

    async def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        add_special_tokens: bool = True,
        timeout: float | None = None,
    ) -> list[int]:
        return await self._endpoint.call(core.tokenize(text, messages, add_special_tokens, timeout))

    async def tokenize_prompt(self, prompt: Prompt, timeout: float | None = None) -> list[int]:
        """The token ids Generate will see for this prompt."""
        if prompt.token_ids is not None:
            return list(prompt.token_ids)
        return await self._endpoint.call(core.tokenize_prompt(prompt, timeout))

    async def detokenize(self, token_ids: Sequence[int], *, timeout: float | None = None) -> str:
        return await self._endpoint.call(core.detokenize(token_ids, timeout))

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        return await self._endpoint.call(core.model_info(timeout))

    async def close(self) -> None:
        await self._endpoint.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncKVCacheClient:
    """blockd plus computed workers with routed Generate (see clients.client.KVCacheClient)."""

    def __init__(
        self,
        blockd: str = DEFAULT_BLOCKD,
        computed: Sequence[str] | str = (DEFAULT_COMPUTED,),
        *,
        routing: str = "cache-aware",
        options: ClientOptions | None = None,
        route_timeout: float = 2.0,
    ) -> None:
        self.options = options or ClientOptions()
        self._router = Router(routing, [computed] if isinstance(computed, str) else list(computed))
        self.routing = self._router.mode
        self.route_timeout = route_timeout
        self.blockd = AsyncBlockdClient(blockd, self.options)
        self._workers = {a: AsyncComputedClient(a, self.options) for a in self._router.addresses}

    @property
    def num_routed(self) -> int:
        """Requests placed by blockd's Route."""
        return self._router.num_routed

    @property
    def num_round_robin(self) -> int:
        """Requests placed by round robin (the mode, or the fallback)."""
        return self._router.num_round_robin

    @property
    def computed_addresses(self) -> tuple[str, ...]:
        return self._router.addresses

    def computed(self, address: str | None = None) -> AsyncComputedClient:
        """The client of one worker (the first one by default)."""
        return self._workers[address or self.computed_addresses[0]]

    async def pick_worker(self, prompt: Prompt) -> str:
        return (await self._route(prompt))[0]

    def generate(
        self,
        prompt: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        messages: Sequence[MessageLike] | None = None,
        cache_salt: str = "",
        public_prefix_tokens: int = 0,
        request_id: str = "",
        cache_policy: str = "store",
        retention_priority: int = 0,
        timeout: float | None = None,
        **sampling: Any,
    ) -> AsyncGenerateStream:
        """Routing happens when the stream is first read."""
        request = Prompt.of(
            prompt,
            token_ids=token_ids,
            messages=messages,
            cache_salt=cache_salt,
            public_prefix_tokens=public_prefix_tokens,
            request_id=request_id,
            cache_policy=cache_policy,
            retention_priority=retention_priority,
        )
        return self.generate_prompt(request, SamplingParams.of(**sampling), timeout)

    def generate_prompt(
        self, prompt: Prompt, params: SamplingParams, timeout: float | None = None
    ) -> AsyncGenerateStream:
        """Routes when first read; a worker unreachable before its first token is replaced by the next one."""
        stream = AsyncGenerateStream("")
        stream._chunks = self._failover(prompt, params, timeout, stream)
        return stream

    async def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        kwargs.setdefault("stream_interval", WHOLE_COMPLETION)
        return await self.generate(prompt, **kwargs).completion()

    async def tokenize_prompt(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids, from the first computed that answers."""
        return list((await self._tokenize(prompt)).token_ids)

    async def close(self) -> None:
        await self.blockd.close()
        for worker in self._workers.values():
            await worker.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------ routing

    async def _route(self, prompt: Prompt) -> tuple[str, Tokenized | None]:
        """The worker for `prompt` and, when it was tokenized to ask blockd, its token ids."""
        if not self._router.asks_blockd:
            return self._router.place(None), None
        try:
            tokenized = await self._tokenize(prompt)
            route = await self.blockd.route(
                tokenized.token_ids,
                cache_salt=prompt.cache_salt,
                public_prefix_tokens=prompt.public_prefix_tokens,
                timeout=self.route_timeout,
                retry=False,
            )
        except KVCacheError as error:
            log.debug("routing falls back to round robin: %s", error)
            return self._router.place(None), None
        return self._router.place(route), tokenized if tokenized.worker_address else None

    async def _tokenize(self, prompt: Prompt) -> Tokenized:
        """Token ids given with the prompt have no worker_address ("")."""
        if prompt.token_ids is not None:
            return Tokenized("", prompt.token_ids)
        last: KVCacheError | None = None
        for address in self.computed_addresses:
            try:
                token_ids = await self._workers[address].tokenize_prompt(prompt, timeout=self.route_timeout)
            except KVCacheError as error:
                if not error.is_unreachable:
                    raise
                last = error
            else:
                return Tokenized(address, tuple(token_ids))
        assert last is not None
        raise last

    async def _prompt_for(self, prompt: Prompt, tokenized: Tokenized | None, address: str) -> Prompt:
        for unknown in self._router.unknown_identities(tokenized, address):
            try:
                self._router.learn(
                    unknown, await self._workers[unknown].model_info(timeout=self.route_timeout)
                )
            except KVCacheError as error:  # unknown stays unknown: the prompt goes as given
                log.debug("no model info from %s: %s", unknown, error)
        return self._router.prompt_for(prompt, tokenized, address)

    async def _failover(
        self, prompt: Prompt, params: SamplingParams, timeout: float | None, stream: AsyncGenerateStream
    ) -> AsyncIterator[GenerateChunk]:
        first, tokenized = await self._route(prompt)
        order = self._router.failover_order(first)
        for i, address in enumerate(order):
            stream.worker_address = address
            worker_prompt = await self._prompt_for(prompt, tokenized, address)
            inner = self._workers[address].generate_prompt(worker_prompt, params, timeout)
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
