"""The computed workers behind the gateway, which models they serve, and where a request goes.

Placement of one request (`Fleet.place`):
1. the workers of its model that are up and below `max_inflight_per_worker` (none: 429);
   one such worker gets the request as it is (nothing to choose, nothing to ask);
2. a policy that weighs caches (`gateway.routing`), blockd, and a prompt of at least one
   block: the prompt is tokenized once (here with `--tokenizer`, else a worker's Tokenize;
   token ids given by the caller need none) and the directory mirror (`gateway.mirror`,
   blockd's index kept here from its event stream) says how many of its tokens each
   worker caches, with no round trip; while the mirror is out of sync, or knows no pool
   of some available worker, blockd's `Route` says it instead. The chosen worker gets the
   token ids, so it never tokenizes the prompt again;
3. the policy picks from each worker's cached tokens (0 when neither could say) and the
   load this gateway has sent it (in flight, and prefill still queued).

The mirror is the fast path that `python -m bench.gateway` justifies: its "2 workers
routed" overhead with the mirror against `--no-mirror` (a Route round trip per request,
about 1 ms on the 2-core bench machine), and the mirror's own answer time by prompt length
(about 15 us for 48 tokens, 280 us for a cached 4,096-token prompt).

Which workers there are: the static `--computed` list, plus (`--discover`, the default with
blockd) the live pools' worker addresses blockd lists (`gateway.discovery`), so scaling the
workers needs no gateway restart. Every `REFRESH_SECONDS` each worker's GetModelInfo is
asked again: one that does not answer within `route_timeout` is marked down (`/health`
then counts it out within about two refreshes) and skipped until it answers again; a
discovered worker that blockd no longer lists as live and that does not answer is dropped
(its channel closed once its requests are done). A request that finds a worker unreachable
marks it down at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import grpc.aio
import structlog

from clients import core
from clients.errors import KVCacheError
from clients.options import open_aio_channel
from clients.requests import Prompt
from clients.routing import normalize_address
from clients.types import ModelInfo, Route
from gateway import metrics
from gateway.config import GatewayConfig
from gateway.discovery import PoolDiscovery
from gateway.errors import NOT_FOUND, RATE_LIMITED, UNAVAILABLE, ApiError
from gateway.mirror import DirectoryMirror
from gateway.mirror_feed import MirrorFeed
from gateway.mirrors import MirrorSet
from gateway.routing import Candidate, make_policy
from gateway.tokenizer import LocalTokenizer, load_tokenizers
from gateway.worker_stream import WorkerStream
from kvcache.v1 import directory_pb2, directory_pb2_grpc, generation_pb2_grpc

log = structlog.get_logger("gateway")
# How often every worker is probed and blockd's pools read: a dead worker is counted out of
# /health within about this plus route_timeout.
REFRESH_SECONDS = 1.0
# Probes in a row that may time out before a worker is marked down: a worker busy with a long
# step may answer late, while one that is gone is refused at once (UNAVAILABLE: down now).
SLOW_PROBES_TOLERATED = 2


@dataclass
class Worker:
    address: str
    stub: generation_pb2_grpc.GenerationServiceStub
    channel: grpc.aio.Channel
    # Its requests' GenerateMany stream; None: a Generate call each (--no-generate-many).
    stream: WorkerStream | None = None
    info: ModelInfo | None = None
    inflight: int = 0
    # Requests in flight without a first token yet, and their uncached prompt tokens (where known).
    num_waiting: int = 0
    queued_prefill_tokens: int = 0
    # Learnt from blockd's pools (not --computed): dropped when blockd no longer lists it and it is down.
    is_discovered: bool = False
    num_slow_probes: int = 0  # probes in a row that timed out
    normalized_address: str = dataclasses.field(init=False, default="")  # as blockd's pools announce it

    def __post_init__(self) -> None:
        self.normalized_address = normalize_address(self.address)

    @property
    def model(self) -> str | None:
        return self.info.model_id if self.info is not None else None

    def admit(self, placement: Placement) -> None:
        self.inflight += 1
        self.num_waiting += 1
        self.queued_prefill_tokens += placement.uncached_tokens

    def first_token(self, placement: Placement) -> None:
        """The request's prefill is done (or it ended before one): no longer queued."""
        self.num_waiting -= 1
        self.queued_prefill_tokens -= placement.uncached_tokens

    def release(self) -> None:
        self.inflight -= 1


@dataclass(frozen=True)
class Placement:
    """Where a request goes, what to send (token ids when it was tokenized to route), and
    how many of its prompt tokens the worker is estimated to prefill (0: unknown)."""

    worker: Worker
    prompt: Prompt
    uncached_tokens: int = 0


class Fleet:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.workers: list[Worker] = []
        self._route_stub: directory_pb2_grpc.RoutingServiceStub | None = None
        self._blockd_channel: grpc.aio.Channel | None = None
        self._route_metadata = (
            (("authorization", f"Bearer {config.route_token}"),) if config.route_token else ()
        )
        self.policy = make_policy(config.routing)
        self._refresher: asyncio.Task | None = None
        self.mirror: MirrorSet | None = None
        self._feeds: list[MirrorFeed] = []
        self._shard_channels: list[grpc.aio.Channel] = []
        self.tokenizers: dict[str, LocalTokenizer] = load_tokenizers(dict(config.tokenizers))
        self._discovery: PoolDiscovery | None = None
        self._retired: list[Worker] = []  # dropped, their channels closed once idle

    # ------------------------------------------------------------ life cycle

    async def start(self) -> None:
        """Open the channels (inside the serving loop) and learn each worker's model."""
        for address in self.config.computed:
            self._add(address, is_discovered=False)
        if self.config.blockd and (self.policy.uses_cache or self.config.discover):
            self._blockd_channel = open_aio_channel(self.config.blockd)
        if self._blockd_channel is not None and self.config.discover:
            self._discovery = PoolDiscovery(
                self._blockd_channel, self.config.blockd_admin_token, self.config.route_timeout
            )
        if self._blockd_channel is not None and self.policy.uses_cache:
            self._route_stub = directory_pb2_grpc.RoutingServiceStub(self._blockd_channel)
            if self.config.mirror:
                self._start_mirrors(self._blockd_channel)
        await self.refresh()
        self._refresher = asyncio.create_task(self._refresh_forever())

    def _start_mirrors(self, blockd_channel: grpc.aio.Channel) -> None:
        """One mirror and its feed per shard (`--blockd-shard`), else one following blockd."""
        if self.config.blockd_shards:
            self._shard_channels = [open_aio_channel(a) for a in self.config.blockd_shards]
        channels = self._shard_channels or [blockd_channel]
        # Each shard's mirror may hold the bound: it is a bound of memory, and shards split it.
        budget = max(1, self.config.mirror_max_blocks // len(channels))
        mirror = self.mirror = MirrorSet([DirectoryMirror(budget) for _ in channels])

        def publish() -> None:
            metrics.MIRROR_SYNCED.set(1 if mirror.in_sync else 0)
            metrics.MIRROR_BLOCKS.set(mirror.num_blocks)

        self._feeds = [
            MirrorFeed(channel, shard, self.config.blockd_admin_token, publish=publish)
            for channel, shard in zip(channels, mirror.mirrors)
        ]
        for feed in self._feeds:
            feed.start()

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        for feed in self._feeds:
            await feed.close()
        for channel in self._shard_channels:
            await channel.close()
        for worker in (*self.workers, *self._retired):
            await worker.channel.close()
        if self._blockd_channel is not None:
            await self._blockd_channel.close()

    async def refresh(self) -> None:
        """Learn blockd's live workers (discovery), then ask every worker for its ModelInfo:
        an answer marks it up, silence marks it down; drop the discovered workers that are
        down and that blockd no longer lists."""
        live = await self._discovery.addresses() if self._discovery is not None else None
        if live is not None:
            known = {w.normalized_address for w in self.workers}
            for address in live:
                if address not in known:
                    self._add(address, is_discovered=True)
        await asyncio.gather(*(self._probe(w) for w in self.workers))
        if live is not None:
            gone = [
                w
                for w in self.workers
                if w.is_discovered and w.info is None and w.normalized_address not in live
            ]
            for worker in gone:
                log.info("worker dropped: blockd lists no live pool there", worker=worker.address)
                self.workers.remove(worker)
                self._retired.append(worker)
        for worker in [w for w in self._retired if w.inflight == 0]:
            self._retired.remove(worker)
            await worker.channel.close()

    def _add(self, address: str, *, is_discovered: bool) -> None:
        channel = open_aio_channel(address)
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        stream = WorkerStream(stub) if self.config.generate_many else None
        self.workers.append(Worker(address, stub, channel, stream, is_discovered=is_discovered))
        if is_discovered:
            log.info("worker discovered", worker=address)

    async def _probe(self, worker: Worker) -> None:
        call = core.model_info(self.config.route_timeout)
        try:
            reply = await worker.stub.GetModelInfo(call.request, timeout=self.config.route_timeout)
        except grpc.RpcError as error:
            log.debug("worker not answering", worker=worker.address, code=str(error.code()))
            worker.num_slow_probes += error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            if (
                error.code() != grpc.StatusCode.DEADLINE_EXCEEDED
                or worker.num_slow_probes > SLOW_PROBES_TOLERATED
            ):
                self.mark_down(worker)
            return
        worker.num_slow_probes = 0
        was_down = worker.info is None
        worker.info = ModelInfo.from_proto(reply)
        if was_down:
            log.info("worker up", worker=worker.address, model=worker.model)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_SECONDS)
            await self.refresh()

    def mark_down(self, worker: Worker) -> None:
        if worker.info is not None:
            log.warning("worker down", worker=worker.address)
        worker.info = None

    # ------------------------------------------------------------ models

    def models(self) -> dict[str, list[Worker]]:
        """model id -> its workers that are up, in configuration order."""
        out: dict[str, list[Worker]] = {}
        for worker in self.workers:
            if worker.model is not None:
                out.setdefault(worker.model, []).append(worker)
        return out

    def workers_of(self, model: str) -> list[Worker]:
        models = self.models()
        if model in models:
            return models[model]
        if not models:
            raise ApiError(UNAVAILABLE, "no computed worker is reachable; try again later")
        raise ApiError(
            NOT_FOUND,
            f"The model '{model}' does not exist; this server serves {', '.join(sorted(models))}",
            "model",
        )

    # ------------------------------------------------------------ placement

    async def place(self, model: str, prompt: Prompt) -> Placement:
        """The worker for `prompt` and what to send it."""
        available = self._available(model)
        if len(available) == 1:
            metrics.ROUTING.labels("single").inc()
            return Placement(available[0], prompt)
        token_ids, known = None, None
        if self.policy.uses_cache and self._route_stub is not None:
            token_ids = await self._token_ids(model, prompt, available)
            available = self._available(model)  # a tokenizing worker may have gone down
            if token_ids is not None and len(token_ids) >= _block_size(available):  # shorter: nothing cached
                known = await self._cached_tokens(token_ids, prompt, available)
        cached = known if known is not None else [0] * len(available)
        candidates = [
            Candidate(c, w.inflight, w.num_waiting, w.queued_prefill_tokens)
            for c, w in zip(cached, available, strict=True)
        ]
        index = self.policy.pick(len(token_ids or ()), candidates)
        metrics.ROUTING.labels(decision(self.config.routing, known, index)).inc()
        if token_ids is None:
            return Placement(available[index], prompt)
        routed = dataclasses.replace(prompt, text=None, messages=None, token_ids=tuple(token_ids))
        return Placement(available[index], routed, len(token_ids) - cached[index])

    async def _token_ids(
        self, model: str, prompt: Prompt, available: Sequence[Worker]
    ) -> Sequence[int] | None:
        """The prompt's token ids: given, tokenized here, or by a worker (None: none could)."""
        if prompt.token_ids is not None:
            return prompt.token_ids
        if model in self.tokenizers:
            token_ids = self.tokenizers[model].tokenize(prompt)
            metrics.TOKENIZED.labels("local" if token_ids is not None else "worker").inc()
            if token_ids is not None:
                return token_ids
        tokenizer = least_loaded(available)
        try:
            return await self._tokenize(tokenizer, prompt)
        except KVCacheError as error:
            if not error.is_unreachable:
                raise
            self.mark_down(tokenizer)  # the others may still serve, as the prompt is
            return None

    def _available(self, model: str) -> list[Worker]:
        workers = self.workers_of(model)
        available = [w for w in workers if w.inflight < self.config.max_inflight_per_worker]
        if not available:
            raise ApiError(
                RATE_LIMITED,
                f"all {len(workers)} workers of '{model}' are at their limit of "
                f"{self.config.max_inflight_per_worker} requests; retry later",
            )
        return available

    async def _tokenize(self, worker: Worker, prompt: Prompt) -> tuple[int, ...]:
        request = prompt.to_tokenize_request()
        try:
            reply = await worker.stub.Tokenize(request, timeout=self.config.route_timeout)
        except grpc.RpcError as error:
            raise KVCacheError.from_rpc_error("computed", worker.address, error) from None
        return tuple(reply.token_ids)

    async def _cached_tokens(
        self, token_ids: Sequence[int], prompt: Prompt, available: Sequence[Worker]
    ) -> list[int] | None:
        """Per available worker, the prompt tokens it caches: the mirror's answer, else
        Route's (None: neither could say)."""
        if self.mirror is not None:
            addresses = [w.normalized_address for w in available]
            cached = self.mirror.cached_tokens(
                addresses, token_ids, prompt.cache_salt, prompt.public_prefix_tokens
            )
            if cached is not None:
                metrics.ROUTE_SOURCE.labels("mirror").inc()
                return cached
        route = await self._route(token_ids, prompt)
        if route is None:
            return None
        metrics.ROUTE_SOURCE.labels("route").inc()
        return cached_tokens(route, available)

    async def _route(self, token_ids: Sequence[int], prompt: Prompt) -> Route | None:
        assert self._route_stub is not None
        request = directory_pb2.RouteRequest(
            token_ids=token_ids,
            cache_salt=prompt.cache_salt,
            public_prefix_tokens=prompt.public_prefix_tokens,
        )
        try:
            reply = await self._route_stub.Route(
                request, timeout=self.config.route_timeout, metadata=self._route_metadata
            )
        except grpc.RpcError as error:
            log.debug("blockd did not route", code=str(error.code()))
            return None
        return Route.from_proto(reply)

    def failover(self, model: str, failed: Worker) -> Worker | None:
        """Another available worker of `model` after `failed` was unreachable (None: no other)."""
        self.mark_down(failed)
        try:
            return least_loaded(self._available(model))
        except ApiError:
            return None


def least_loaded(workers: Sequence[Worker]) -> Worker:
    """The worker with the fewest requests in flight; the first listed among equals."""
    return min(workers, key=lambda w: w.inflight)


def cached_tokens(route: Route, available: Sequence[Worker]) -> list[int]:
    """Per available worker, the prompt tokens its pool caches by blockd's Route (addresses
    as both spell them; 0 for a worker Route does not know)."""
    by_address = {c.worker_address and normalize_address(c.worker_address): c for c in route.candidates}
    out = []
    for worker in available:
        match = by_address.get(normalize_address(worker.address))
        out.append(match.num_cached_tokens if match is not None else 0)
    return out


def decision(routing: str, cached: Sequence[int] | None, index: int) -> str:
    """The metric's word: round_robin / least_loaded (those policies, or neither the mirror
    nor Route could say what is cached), routed (the pick caches the longest prefix),
    spilled (load sent it to a worker caching less)."""
    if routing in ("round-robin", "least-loaded"):
        return routing.replace("-", "_")
    if cached is None:
        return "least_loaded"
    return "routed" if cached[index] == max(cached) else "spilled"


def _block_size(workers: Sequence[Worker]) -> int:
    return min((w.info.block_size for w in workers if w.info is not None), default=1)
