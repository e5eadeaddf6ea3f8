"""gRPC servicers: messages in, directory calls, messages out.

The only module that knows gRPC status codes. Every handler runs on the server's
event loop, which serialises calls into the (not thread-safe) directory. A client
mistake becomes its status code with the directory's message; anything unexpected
becomes INTERNAL and is logged; the daemon keeps serving either way.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from google.protobuf.message import DecodeError

from blockd import messages
from blockd.auth import BearerAuth, MissingCredentials, WrongCredentials
from blockd.directory import BlockDirectory
from blockd.shared_store import SharedStoreAdmin, delete_logged
from blockd.types import (
    HostSpec,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    PinId,
    PoolId,
    ResourceExhausted,
    StaleEpoch,
)
from kvcache.v1 import directory_pb2 as pb
from kvcache.v1 import directory_pb2_grpc as pb_grpc

log = structlog.get_logger("blockd.service")

STATUS_CODES: dict[type[Exception], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    StaleEpoch: grpc.StatusCode.FAILED_PRECONDITION,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    MissingCredentials: grpc.StatusCode.UNAUTHENTICATED,
    WrongCredentials: grpc.StatusCode.PERMISSION_DENIED,
}


def _status_of(exc: Exception) -> grpc.StatusCode | None:
    for cls in type(exc).__mro__:
        if cls in STATUS_CODES:
            return STATUS_CODES[cls]
    return None


# Status details travel in trailing metadata (16 KiB at most): a message that echoes a
# huge client value must be cut, or the client sees a transport error instead.
MAX_DETAILS_CHARS = 1_000


@dataclass(frozen=True)
class Malformed:
    """A request whose bytes did not parse (e.g. invalid UTF-8 in a string field)."""

    message_type: str
    error: str


def _details(text: str) -> str:
    return text if len(text) <= MAX_DETAILS_CHARS else text[:MAX_DETAILS_CHARS] + "... (truncated)"


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
    code = _status_of(exc)
    if code is None:
        log.exception("internal error", method=method)
        await context.abort(
            grpc.StatusCode.INTERNAL, _details(f"internal error in {method}: {type(exc).__name__}: {exc}")
        )
    await context.abort(code, _details(str(exc)))


def _reject_malformed(request: Any) -> None:
    if isinstance(request, Malformed):
        raise InvalidArgument(
            f"request is not a valid {request.message_type}: {request.error} (string fields must be UTF-8)"
        )


def unary(method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Map exceptions of a unary handler to status codes."""

    @functools.wraps(method)
    async def handler(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            _reject_malformed(request)
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure must become a status
            await _abort(context, method.__name__, exc)

    return handler


def streaming(method: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    """Map exceptions of a server-streaming handler to status codes."""

    @functools.wraps(method)
    async def handler(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            _reject_malformed(request)
            async for reply in method(self, request, context):
                yield reply
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001
            await _abort(context, method.__name__, exc)

    return handler


class BlockDirectoryService(pb_grpc.BlockDirectoryServiceServicer):
    """Worker calls; each needs the worker token when one is configured."""

    def __init__(
        self,
        directory: BlockDirectory,
        auth: BearerAuth,
        on_pool_registered: Callable[[], None] | None = None,
        shared_store: SharedStoreAdmin | None = None,
    ) -> None:
        """`on_pool_registered`: called after each registration (blockd.server freezes the
        collector's heap there). `shared_store`: deletes the keys that writes a flush
        forgot left behind, once their reports come (`StepResult.shared_orphans`)."""
        self._directory = directory
        self._auth = auth
        self._on_pool_registered = on_pool_registered
        self._shared_store = shared_store
        self._deletions: set[asyncio.Task[None]] = set()  # held until done (asyncio keeps weak refs)

    @unary
    async def RegisterPool(
        self, request: pb.RegisterPoolRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterPoolResponse:
        self._auth.check(context.invocation_metadata())
        reg = self._directory.register_pool(
            request.num_blocks,
            request.block_size,
            messages.namespace_from(request.namespace),
            request.worker_address,
            PoolId(request.pool_id) or None,
            request.pool_token or None,
            HostSpec(
                request.num_host_blocks,
                request.host_load_seconds_per_block,
                request.prefill_seconds_per_token,
                request.has_shared_tier,
                request.shared_load_seconds_per_block,
            ),
        )
        log.info(
            "pool registered",
            num_host_blocks=request.num_host_blocks,
            pool_id=reg.pool_id,
            epoch=reg.epoch,
            num_blocks=request.num_blocks,
            block_size=request.block_size,
            worker=request.worker_address,
            shared_tier=request.has_shared_tier,
        )
        if self._on_pool_registered is not None:
            self._on_pool_registered()
        return pb.RegisterPoolResponse(
            pool_id=reg.pool_id,
            epoch=reg.epoch,
            lease_ttl_seconds=reg.lease_ttl_seconds,
            max_sequence_tokens=reg.max_sequence_tokens,
            pool_token=reg.pool_token,
            shared_namespace=reg.shared_namespace,
        )

    @unary
    async def RenewLease(
        self, request: pb.RenewLeaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.RenewLeaseResponse:
        self._auth.check(context.invocation_metadata())
        ttl = self._directory.renew_lease(PoolId(request.pool_id), request.epoch)
        return pb.RenewLeaseResponse(lease_ttl_seconds=ttl)

    @unary
    async def Step(self, request: pb.StepRequest, context: grpc.aio.ServicerContext) -> pb.StepResponse:
        self._auth.check(context.invocation_metadata())
        return self._step(request, pb.StepResponse())

    async def StepStream(
        self, requests: AsyncIterator[pb.StepStreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StepStreamResponse]:
        """`Step`, request after request on one stream; the first refused Step ends the
        stream with the status `Step` would answer (the status table is `_abort`'s)."""
        try:
            self._auth.check(context.invocation_metadata())
            async for request in requests:
                _reject_malformed(request)
                answer = pb.StepStreamResponse()
                self._step(request.step, answer.step)  # filled in place: no copy of the answer
                yield answer
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure must become a status
            await _abort(context, "StepStream", exc)

    def _step(self, request: pb.StepRequest, reply: pb.StepResponse) -> pb.StepResponse:
        """Applies `request` and writes its answer into `reply` (empty); answers it."""
        commits, releases, grows, admits = messages.step_ops_from(request)
        result = self._directory.step(
            PoolId(request.pool_id),
            request.epoch,
            commits,
            releases,
            grows,
            admits,
            request.shared_written,
            request.shared_failed,
            request.shared_missing,
        )
        if result.shared_orphans and self._shared_store is not None:  # off the Step's path
            task = asyncio.get_running_loop().create_task(
                delete_logged(self._shared_store, list(result.shared_orphans), ())
            )
            self._deletions.add(task)
            task.add_done_callback(self._deletions.discard)
        reply.num_free_blocks = result.num_free_blocks
        reply.num_evictable_blocks = result.num_evictable_blocks
        for block_id, host_block_id in result.demotions:
            reply.demotions.add(block_id=block_id, host_block_id=host_block_id)
        reply.shared_stores.extend(messages.shared_block_to(b) for b in result.shared_stores)
        for grow in result.grows:
            reply.grows.add(sequence_id=grow.sequence_id, grown=grow.grown, new_block_ids=grow.new_block_ids)
        for admit in result.admits:
            added = reply.admits.add(
                sequence_id=admit.sequence_id,
                admitted=admit.admitted,
                block_ids=admit.block_ids,
                num_cached_tokens=admit.num_cached_tokens,
            )
            if admit.loads:
                added.loads.extend(pb.BlockCopy(block_id=b, host_block_id=h) for b, h in admit.loads)
            if admit.shared_loads:
                added.shared_loads.extend(messages.shared_block_to(b) for b in admit.shared_loads)
        return reply

    @unary
    async def Resync(self, request: pb.ResyncRequest, context: grpc.aio.ServicerContext) -> pb.ResyncResponse:
        self._auth.check(context.invocation_metadata())
        result = self._directory.resync(
            PoolId(request.pool_id), request.epoch, messages.resync_sequences_from(request)
        )
        log.info(
            "pool resynced",
            pool_id=request.pool_id,
            sequences=result.num_sequences,
            indexed_blocks=result.num_committed_blocks,
        )
        return pb.ResyncResponse(
            num_sequences=result.num_sequences, num_committed_blocks=result.num_committed_blocks
        )


class DirectoryAdminService(pb_grpc.DirectoryAdminServiceServicer):
    """Operator calls; each needs the admin token when one is configured."""

    def __init__(
        self, directory: BlockDirectory, auth: BearerAuth, shared_store: SharedStoreAdmin | None = None
    ) -> None:
        self._directory = directory
        self._auth = auth
        self._shared_store = shared_store  # deletes what a flush drops from the shared tier

    @unary
    async def GetStats(
        self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetStatsResponse:
        self._auth.check(context.invocation_metadata())
        stats = self._directory.stats(PoolId(request.pool_id) or None)
        return pb.GetStatsResponse(
            total=messages.pool_stats_to(stats.total),
            pools=[messages.pool_stats_to(p) for p in stats.pools],
            last_event_sequence=stats.last_event_sequence,
        )

    @unary
    async def ListPools(
        self, request: pb.ListPoolsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListPoolsResponse:
        self._auth.check(context.invocation_metadata())
        return pb.ListPoolsResponse(pools=[messages.pool_info_to(p) for p in self._directory.list_pools()])

    @unary
    async def ListBlocks(
        self, request: pb.ListBlocksRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListBlocksResponse:
        self._auth.check(context.invocation_metadata())
        page = self._directory.list_blocks(
            PoolId(request.pool_id) or None, request.page_size, request.page_token or None
        )
        return pb.ListBlocksResponse(
            blocks=[messages.block_info_to(b) for b in page.blocks],
            next_page_token=page.next_page_token or "",
        )

    @unary
    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        self._auth.check(context.invocation_metadata())
        matches = self._directory.lookup(
            request.token_ids,
            request.cache_salt,
            request.public_prefix_tokens,
            PoolId(request.pool_id) or None,
        )
        return pb.LookupResponse(matches=[messages.pool_match_to(m) for m in matches])

    @unary
    async def Flush(self, request: pb.FlushRequest, context: grpc.aio.ServicerContext) -> pb.FlushResponse:
        self._auth.check(context.invocation_metadata())
        if request.tier not in (pb.TIER_UNSPECIFIED, pb.TIER_DEVICE, pb.TIER_HOST, pb.TIER_SHARED):
            raise InvalidArgument(f"tier must be one of the Tier values, got {request.tier}")
        result = self._directory.flush(
            PoolId(request.pool_id) or None,
            request.cache_salt or None,
            messages.TIERS_FROM.get(request.tier),
        )
        log.info(
            "flush",
            pool_id=request.pool_id or None,
            salted=bool(request.cache_salt),
            dropped=result.dropped,
            busy=result.busy,
        )
        if self._shared_store is not None and (result.shared_keys or result.shared_namespaces):
            await delete_logged(self._shared_store, result.shared_keys, result.shared_namespaces)
        return pb.FlushResponse(
            dropped=result.dropped,
            busy=result.busy,
            tiers=[pb.TierFlush(tier=messages.TIERS[t], dropped=d, busy=b) for t, d, b in result.tiers],
        )

    @unary
    async def Pin(self, request: pb.PinRequest, context: grpc.aio.ServicerContext) -> pb.PinResponse:
        self._auth.check(context.invocation_metadata())
        pin = self._directory.pin(
            request.token_ids,
            request.cache_salt,
            request.public_prefix_tokens,
            request.ttl_seconds,
            PoolId(request.pool_id) or None,
        )
        return pb.PinResponse(
            pin_id=pin.pin_id,
            num_pinned_tokens=pin.num_pinned_tokens,
            num_pinned_blocks=pin.num_pinned_blocks,
            expires_in_seconds=pin.expires_in_seconds,
        )

    @unary
    async def Unpin(self, request: pb.UnpinRequest, context: grpc.aio.ServicerContext) -> pb.UnpinResponse:
        self._auth.check(context.invocation_metadata())
        if request.all:
            if request.pin_id:
                raise InvalidArgument("unpin: give either pin_id or all, not both")
            num_pins, num_blocks = self._directory.unpin_all()
            log.info("unpin all", pins=num_pins, blocks=num_blocks)
            return pb.UnpinResponse(num_unpinned_blocks=num_blocks, num_unpinned_pins=num_pins)
        if not request.pin_id:
            raise InvalidArgument("unpin: pin_id is empty; give the id Pin answered, or set all")
        num_blocks = self._directory.unpin(PinId(request.pin_id))
        return pb.UnpinResponse(num_unpinned_blocks=num_blocks, num_unpinned_pins=1)

    @unary
    async def ExplainMiss(
        self, request: pb.ExplainMissRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExplainMissResponse:
        self._auth.check(context.invocation_metadata())
        explanations = self._directory.explain_miss(
            request.token_ids,
            request.cache_salt,
            request.public_prefix_tokens,
            PoolId(request.pool_id) or None,
        )
        return pb.ExplainMissResponse(
            num_tokens=len(request.token_ids),
            pools=[messages.explanation_to(e) for e in explanations],
        )

    @streaming
    async def WatchEvents(
        self, request: pb.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchEventsResponse]:
        """Replay events after `after_sequence`, then stream new ones as they happen."""
        self._auth.check(context.invocation_metadata())
        pool_id = PoolId(request.pool_id) or None
        if pool_id is not None:
            self._directory.stats(pool_id)  # NotFound for an unknown pool
        events = self._directory.events
        wake = asyncio.Event()
        events.subscribe(wake.set)
        try:
            cursor = request.after_sequence
            while True:
                wake.clear()
                newest = events.last_sequence
                for event in events.read(cursor, pool_id):
                    yield messages.event_to(event)
                cursor = newest  # read() covered every event up to `newest` (or reported a GAP)
                await wake.wait()
        finally:
            events.unsubscribe(wake.set)


class RoutingService(pb_grpc.RoutingServiceServicer):
    """Route; it needs the route token when one is configured."""

    def __init__(self, directory: BlockDirectory, auth: BearerAuth) -> None:
        self._directory = directory
        self._auth = auth

    @unary
    async def Route(self, request: pb.RouteRequest, context: grpc.aio.ServicerContext) -> pb.RouteResponse:
        self._auth.check(context.invocation_metadata())
        route = self._directory.route(request.token_ids, request.cache_salt, request.public_prefix_tokens)
        return pb.RouteResponse(
            pool_id=route.pool_id or "",
            worker_address=route.worker_address or "",
            num_cached_tokens=route.num_cached_tokens,
            candidates=[messages.pool_match_to(m) for m in route.candidates],
        )


def add_service(servicer: Any, server: grpc.aio.Server, service_name: str) -> None:
    """Register like the generated helper does, but hand undecodable requests to the
    handler as `Malformed` (answered INVALID_ARGUMENT) instead of grpc's UNKNOWN."""
    service = pb.DESCRIPTOR.services_by_name[service_name]
    handlers = {}
    for method in service.methods:
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        factory = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = factory(
            getattr(servicer, method.name),
            request_deserializer=_lenient(request_cls),
            response_serializer=response_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def _lenient(message_cls: Any) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return message_cls.FromString(data)
        except (DecodeError, ValueError, UnicodeDecodeError) as exc:
            return Malformed(message_cls.DESCRIPTOR.name, str(exc) or type(exc).__name__)

    return deserialize
