"""Synchronous Python client for blockd and computed.

    with KVCacheClient("127.0.0.1:50051", ["127.0.0.1:50052"]) as client:
        for chunk in client.generate("Hello", max_tokens=16):
            print(chunk.text, end="")
        completion = client.complete(messages=[("system", "Be brief."), ("user", "Hi")])
        print(completion.usage.cached_tokens, client.blockd.get_stats().total.hit_rate)

Every call has a deadline (ClientOptions.timeout, or generate_timeout for a whole
Generate stream) that also bounds its retries; UNAVAILABLE is retried with
exponential backoff and jitter (RetryPolicy). Failures raise KVCacheError.

What each call sends and how its answer is read lives in `clients.core`, shared with
`clients.aio_client`; the routing state in `clients.routing.Router`. This module only
makes the calls; tests/clients/test_parity.py keeps both clients' methods in step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from clients import core
from clients.errors import KVCacheError
from clients.options import ClientOptions, close_channel, open_channel
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

DEFAULT_BLOCKD = "127.0.0.1:50051"
DEFAULT_COMPUTED = "127.0.0.1:50052"


class _Endpoint:
    """One daemon's channel; makes a `core.Call`, retrying it under one deadline.

    A call's deadline covers all of its attempts: each attempt gets what is left,
    and a backoff never sleeps past the deadline.
    """

    def __init__(self, service: str, address: str, options: ClientOptions) -> None:
        self.service = service
        self.address = address
        self.options = options
        self.channel = open_channel(address, options.tls)
        self._stubs = core.stubs(service, self.channel)

    def call(self, call: core.Call[T]) -> T:
        method = getattr(self._stubs[call.stub], call.method)
        retry = call.retry or self.options.retry
        deadline = core.deadline(call, self.options)
        metadata = core.metadata(call, self.options)
        attempt = 0
        while True:
            try:
                reply = method(call.request, timeout=core.remaining(deadline), metadata=metadata)
            except grpc.RpcError as error:
                time.sleep(core.retry_pause(self.service, self.address, error, attempt, deadline, retry))
                attempt += 1
                continue
            return call.parse(reply)

    def stream(self, call: core.Call[T]) -> Iterator[T]:
        """Parsed messages of a server stream. Retried only before the first message arrived."""
        method = getattr(self._stubs[call.stub], call.method)
        deadline = core.deadline(call, self.options, is_stream=True)
        metadata = core.metadata(call, self.options)
        attempt = 0
        while True:
            rpc = method(call.request, timeout=core.remaining(deadline), metadata=metadata)
            received = False
            try:
                for message in rpc:
                    received = True
                    yield call.parse(message)
                return
            except grpc.RpcError as error:
                if received:
                    raise KVCacheError.from_rpc_error(self.service, self.address, error) from None
                pause = core.retry_pause(
                    self.service, self.address, error, attempt, deadline, self.options.retry
                )
                time.sleep(pause)
                attempt += 1
            finally:
                rpc.cancel()  # no-op when finished; stops server work when the reader quits

    def close(self) -> None:
        close_channel(self.channel, self.address)


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

    @property
    def address(self) -> str:
        return self._endpoint.address

    def get_stats(self, pool_id: str | None = None, *, timeout: float | None = None) -> Stats:
        return self._endpoint.call(core.get_stats(pool_id, timeout))

    def list_pools(self, *, timeout: float | None = None) -> list[PoolInfo]:
        return self._endpoint.call(core.list_pools(timeout))

    def iter_blocks(
        self, pool_id: str | None = None, *, page_size: int = 1000, timeout: float | None = None
    ) -> Iterator[BlockInfo]:
        """Every cached block, ordered by (pool_id, block_id), fetched page by page."""
        token = ""
        while True:
            page = self._endpoint.call(core.list_blocks_page(pool_id, page_size, token, timeout))
            yield from page.blocks
            token = page.next_page_token
            if not token:
                return

    def list_blocks(self, pool_id: str | None = None, **kwargs: Any) -> list[BlockInfo]:
        return list(self.iter_blocks(pool_id, **kwargs))

    def lookup(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str = "",
        public_prefix_tokens: int = 0,
        pool_id: str | None = None,
        timeout: float | None = None,
    ) -> list[PoolMatch]:
        return self._endpoint.call(core.lookup(token_ids, cache_salt, public_prefix_tokens, pool_id, timeout))

    def flush(
        self,
        *,
        pool_id: str | None = None,
        cache_salt: str | None = None,
        tier: str | None = None,
        timeout: float | None = None,
    ) -> FlushResult:
        """Drop unreferenced cached blocks of every tier, or of `tier` ("device", "host", "shared")."""
        return self._endpoint.call(core.flush(pool_id, cache_salt, timeout, tier))

    def pin(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str = "",
        public_prefix_tokens: int = 0,
        ttl_seconds: float | None = None,
        pool_id: str | None = None,
        timeout: float | None = None,
    ) -> PinResult:
        return self._endpoint.call(
            core.pin(token_ids, cache_salt, public_prefix_tokens, ttl_seconds, pool_id, timeout)
        )

    def unpin(self, pin_id: str, *, timeout: float | None = None) -> int:
        """Returns the number of blocks unpinned."""
        return self._endpoint.call(core.unpin(pin_id, timeout))

    def unpin_all(self, *, timeout: float | None = None) -> tuple[int, int]:
        """Drops every pin; returns (pins dropped, blocks they held)."""
        return self._endpoint.call(core.unpin_all(timeout))

    def explain_miss(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str = "",
        public_prefix_tokens: int = 0,
        pool_id: str | None = None,
        timeout: float | None = None,
    ) -> list[MissExplanation]:
        """Why each live pool (or one) does not hold the prompt past its cached prefix."""
        return self._endpoint.call(
            core.explain_miss(token_ids, cache_salt, public_prefix_tokens, pool_id, timeout)
        )

    def watch_events(
        self, after_sequence: int = 0, *, pool_id: str | None = None, timeout: float | None = None
    ) -> Iterator[BlockEvent]:
        """Block events as they happen. timeout None: watch until the caller stops reading."""
        yield from self._endpoint.stream(core.watch_events(after_sequence, pool_id, timeout))

    def route(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str = "",
        public_prefix_tokens: int = 0,
        timeout: float | None = None,
        retry: bool = True,
    ) -> Route:
        return self._endpoint.call(core.route(token_ids, cache_salt, public_prefix_tokens, timeout, retry))

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
    ) -> GenerateStream:
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
        return self.generate_prompt(request, SamplingParams.of(**sampling), timeout=timeout)

    def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        kwargs.setdefault("stream_interval", WHOLE_COMPLETION)
        return self.generate(prompt, **kwargs).completion()

    def generate_prompt(
        self, prompt: Prompt, params: SamplingParams, timeout: float | None = None
    ) -> GenerateStream:
        chunks = self._endpoint.stream(core.generate(prompt, params, timeout, self.options))
        return GenerateStream(self.address, chunks)

    def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        add_special_tokens: bool = True,
        timeout: float | None = None,
    ) -> list[int]:
        return self._endpoint.call(core.tokenize(text, messages, add_special_tokens, timeout))

    def tokenize_prompt(self, prompt: Prompt, timeout: float | None = None) -> list[int]:
        """The token ids Generate will see for this prompt."""
        if prompt.token_ids is not None:
            return list(prompt.token_ids)
        return self._endpoint.call(core.tokenize_prompt(prompt, timeout))

    def detokenize(self, token_ids: Sequence[int], *, timeout: float | None = None) -> str:
        return self._endpoint.call(core.detokenize(token_ids, timeout))

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        return self._endpoint.call(core.model_info(timeout))

    def close(self) -> None:
        self._endpoint.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVCacheClient:
    """blockd plus one or more computed workers, with Generate routed among the workers.

    routing "cache-aware": tokenize on a worker, ask blockd's Route which known worker
    holds the longest cached prefix, send Generate there with those token ids (so the
    worker does not tokenize again; only to workers that serve the same model as the
    one that tokenized); round robin when blockd cannot answer or ranks no known worker.
    "round-robin": never ask blockd. A worker that is unreachable before its first
    token is skipped for the next one.
    """

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
        self.blockd = BlockdClient(blockd, self.options)
        self._workers = {a: ComputedClient(a, self.options) for a in self._router.addresses}

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

    def computed(self, address: str | None = None) -> ComputedClient:
        """The client of one worker (the first one by default)."""
        return self._workers[address or self.computed_addresses[0]]

    def pick_worker(self, prompt: Prompt) -> str:
        return self._route(prompt)[0]

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
    ) -> GenerateStream:
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
    ) -> GenerateStream:
        """Routes now; a worker unreachable before its first token is replaced by the next one."""
        first, tokenized = self._route(prompt)
        stream = GenerateStream(first, iter(()))
        stream._chunks = self._failover(prompt, tokenized, params, timeout, first, stream)
        return stream

    def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        kwargs.setdefault("stream_interval", WHOLE_COMPLETION)
        return self.generate(prompt, **kwargs).completion()

    def tokenize_prompt(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids, from the first computed that answers."""
        return list(self._tokenize(prompt).token_ids)

    def close(self) -> None:
        self.blockd.close()
        for worker in self._workers.values():
            worker.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ routing

    def _route(self, prompt: Prompt) -> tuple[str, Tokenized | None]:
        """The worker for `prompt` and, when it was tokenized to ask blockd, its token ids."""
        if not self._router.asks_blockd:
            return self._router.place(None), None
        try:
            tokenized = self._tokenize(prompt)
            route = self.blockd.route(
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

    def _tokenize(self, prompt: Prompt) -> Tokenized:
        """Token ids given with the prompt have no worker_address ("")."""
        if prompt.token_ids is not None:
            return Tokenized("", prompt.token_ids)
        last: KVCacheError | None = None
        for address in self.computed_addresses:
            try:
                token_ids = self._workers[address].tokenize_prompt(prompt, timeout=self.route_timeout)
            except KVCacheError as error:
                if not error.is_unreachable:
                    raise
                last = error
            else:
                return Tokenized(address, tuple(token_ids))
        assert last is not None
        raise last

    def _prompt_for(self, prompt: Prompt, tokenized: Tokenized | None, address: str) -> Prompt:
        for unknown in self._router.unknown_identities(tokenized, address):
            try:
                self._router.learn(unknown, self._workers[unknown].model_info(timeout=self.route_timeout))
            except KVCacheError as error:  # unknown stays unknown: the prompt goes as given
                log.debug("no model info from %s: %s", unknown, error)
        return self._router.prompt_for(prompt, tokenized, address)

    def _failover(
        self,
        prompt: Prompt,
        tokenized: Tokenized | None,
        params: SamplingParams,
        timeout: float | None,
        first: str,
        stream: GenerateStream,
    ) -> Iterator[GenerateChunk]:
        order = self._router.failover_order(first)
        for i, address in enumerate(order):
            stream.worker_address = address
            worker_prompt = self._prompt_for(prompt, tokenized, address)
            inner = self._workers[address].generate_prompt(worker_prompt, params, timeout)
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
