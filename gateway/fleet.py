"""The computed workers behind the gateway, which models they serve, and where a request goes.

Placement of one request (`Fleet.place`):
1. the workers of its model that are up and below `max_inflight_per_worker` (none: 429);
2. cache-aware with blockd and several such workers: the prompt is tokenized once (here
   with `--tokenizer`, else a worker's Tokenize; token ids given by the caller need none), blockd's `Route` ranks
   the pools by cached prefix (load-aware), and the first ranked worker that is
   available gets the token ids, so it never tokenizes the prompt again;
3. otherwise (one worker, round-robin mode, blockd away or ranking none of ours): the
   least-loaded worker by this gateway's in-flight count (round robin in round-robin mode).

A worker found unreachable is marked down and skipped until its GetModelInfo answers again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
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
from gateway.errors import NOT_FOUND, RATE_LIMITED, UNAVAILABLE, ApiError
from gateway.tokenizer import LocalTokenizer, load_tokenizers
from kvcache.v1 import directory_pb2, directory_pb2_grpc, generation_pb2_grpc

log = structlog.get_logger("gateway")
REFRESH_SECONDS = 2.0


@dataclass
class Worker:
    address: str
    stub: generation_pb2_grpc.GenerationServiceStub
    channel: grpc.aio.Channel
    info: ModelInfo | None = None
    inflight: int = 0

    @property
    def model(self) -> str | None:
        return self.info.model_id if self.info is not None else None


class Fleet:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.workers: list[Worker] = []
        self._route_stub: directory_pb2_grpc.RoutingServiceStub | None = None
        self._blockd_channel: grpc.aio.Channel | None = None
        self._route_metadata = (
            (("authorization", f"Bearer {config.route_token}"),) if config.route_token else ()
        )
        self._turn = itertools.count()
        self._refresher: asyncio.Task | None = None
        self.tokenizers: dict[str, LocalTokenizer] = load_tokenizers(dict(config.tokenizers))

    # ------------------------------------------------------------ life cycle

    async def start(self) -> None:
        """Open the channels (inside the serving loop) and learn each worker's model."""
        for address in self.config.computed:
            channel = open_aio_channel(address)
            self.workers.append(Worker(address, generation_pb2_grpc.GenerationServiceStub(channel), channel))
        if self.config.blockd and self.config.routing == "cache-aware":
            self._blockd_channel = open_aio_channel(self.config.blockd)
            self._route_stub = directory_pb2_grpc.RoutingServiceStub(self._blockd_channel)
        await self.refresh()
        self._refresher = asyncio.create_task(self._refresh_forever())

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        for worker in self.workers:
            await worker.channel.close()
        if self._blockd_channel is not None:
            await self._blockd_channel.close()

    async def refresh(self) -> None:
        """Ask every worker without known model for its ModelInfo."""
        await asyncio.gather(*(self._learn(w) for w in self.workers if w.info is None))

    async def _learn(self, worker: Worker) -> None:
        call = core.model_info(self.config.route_timeout)
        try:
            reply = await worker.stub.GetModelInfo(call.request, timeout=self.config.route_timeout)
        except grpc.RpcError as error:
            log.debug("worker not answering", worker=worker.address, code=str(error.code()))
            return
        worker.info = ModelInfo.from_proto(reply)
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

    async def place(self, model: str, prompt: Prompt) -> tuple[Worker, Prompt]:
        """The worker for `prompt` and what to send it (token ids when it was tokenized to route)."""
        available = self._available(model)
        if self.config.routing == "round-robin":
            metrics.ROUTING.labels("round_robin").inc()
            return available[next(self._turn) % len(available)], prompt
        if self._route_stub is None or len(available) < 2:
            metrics.ROUTING.labels("least_loaded").inc()
            return least_loaded(available), prompt
        token_ids = prompt.token_ids
        if token_ids is None and model in self.tokenizers:
            token_ids = self.tokenizers[model].tokenize(prompt)
            metrics.TOKENIZED.labels("local" if token_ids is not None else "worker").inc()
        if token_ids is None:
            tokenizer = least_loaded(available)
            try:
                token_ids = await self._tokenize(tokenizer, prompt)
            except KVCacheError as error:
                if not error.is_unreachable:
                    raise
                self.mark_down(tokenizer)  # the others may still serve, as the prompt is
                metrics.ROUTING.labels("least_loaded").inc()
                return least_loaded(self._available(model)), prompt
        routed = dataclasses.replace(prompt, text=None, messages=None, token_ids=token_ids)
        route = await self._route(token_ids, prompt)
        chosen = choose(route, available) if route is not None else None
        if chosen is None:
            metrics.ROUTING.labels("least_loaded").inc()
            return least_loaded(available), routed
        metrics.ROUTING.labels("routed").inc()
        return chosen, routed

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


def choose(route: Route, available: Sequence[Worker]) -> Worker | None:
    """The first worker in blockd's ranking that is available here (addresses as both spell them)."""
    by_address = {normalize_address(w.address): w for w in available}
    ranked = [route.worker_address] if route.worker_address else []
    ranked += [c.worker_address for c in route.candidates]
    for address in ranked:
        worker = by_address.get(normalize_address(address)) if address else None
        if worker is not None:
            return worker
    return None
