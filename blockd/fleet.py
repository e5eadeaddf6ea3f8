"""The fleet router: one address for Route, Lookup and ListPools over blockd shards.

A fleet grows past one blockd process by shards (docs/sharding.md): each shard is a
plain blockd that owns the pools of the workers configured to it, so a worker's
Steps, and so its admissions, never cross shards. What spans pools is read-only and
answered here by fanning out to every shard at once and merging:

- Route: every shard's candidates, ranked again by the rule one blockd applies
  (`routing.rank_for_route`: longest weighted prefix, load margin, load);
- Lookup: every shard's matches, longest prefix first (`routing.by_cached_prefix`);
- ListPools: every shard's pools.

A shard that does not answer within the deadline is left out of the answer (and
logged): its pools are gone from routing until it is back, exactly as a restarted
shard's idle cache is. The caller's authorization metadata goes to the shards as it
came, so one set of tokens serves the fleet. The router holds no state.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from blockd.messages import pool_match_to
from blockd.routing import by_cached_prefix, rank_for_route
from blockd.service import add_service, unary
from blockd.types import PoolId, PoolMatch
from kvcache.v1 import directory_pb2 as pb
from kvcache.v1 import directory_pb2_grpc as pb_grpc

log = structlog.get_logger("blockd.fleet")

DEFAULT_DEADLINE_SECONDS = 2.0
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def match_from(msg: pb.PoolMatch) -> PoolMatch:
    return PoolMatch(
        PoolId(msg.pool_id),
        msg.worker_address,
        msg.num_cached_tokens,
        msg.load,
        msg.num_sequences,
        msg.num_host_cached_tokens,
        msg.num_shared_cached_tokens,
    )


class Shards:
    """One channel and the stubs per shard; `gather` asks them all at once."""

    def __init__(self, addresses: Sequence[str], deadline_seconds: float = DEFAULT_DEADLINE_SECONDS) -> None:
        assert addresses, "a fleet has at least one shard"
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        self.addresses = list(addresses)
        self._channels = [grpc.aio.insecure_channel(address, options=options) for address in addresses]
        self.routing = [pb_grpc.RoutingServiceStub(channel) for channel in self._channels]
        self.admin = [pb_grpc.DirectoryAdminServiceStub(channel) for channel in self._channels]
        self.deadline_seconds = deadline_seconds

    async def gather(
        self, context: grpc.aio.ServicerContext, call: Callable[[int], Awaitable[Any]]
    ) -> list[Any]:
        """`call(i)` for every shard i concurrently; answers the replies of the shards
        that answered (the others are logged). An auth refusal is the caller's fault and
        ends the call with its status; none answering is UNAVAILABLE (retry)."""
        replies = await asyncio.gather(*(call(i) for i in range(len(self.addresses))), return_exceptions=True)
        answered = []
        for address, reply in zip(self.addresses, replies, strict=True):
            if isinstance(reply, grpc.aio.AioRpcError):
                if reply.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    await context.abort(reply.code(), reply.details() or "")
                log.warning("shard did not answer", shard=address, code=reply.code().name)
            elif isinstance(reply, BaseException):
                raise reply
            else:
                answered.append(reply)
        if not answered:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"no blockd shard answered ({', '.join(self.addresses)}); retry"
            )
        return answered

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


def _metadata(context: grpc.aio.ServicerContext) -> tuple[tuple[str, str], ...]:
    return tuple((k, v) for k, v in context.invocation_metadata() or () if k.lower() == "authorization")


class FleetRoutingService(pb_grpc.RoutingServiceServicer):
    def __init__(self, shards: Shards, load_margin: float) -> None:
        self._shards = shards
        self._load_margin = load_margin

    @unary
    async def Route(self, request: pb.RouteRequest, context: grpc.aio.ServicerContext) -> pb.RouteResponse:
        shards, metadata = self._shards, _metadata(context)
        replies = await shards.gather(
            context,
            lambda i: shards.routing[i].Route(request, metadata=metadata, timeout=shards.deadline_seconds),
        )
        ranked = rank_for_route([match_from(m) for r in replies for m in r.candidates], self._load_margin)
        if not ranked:
            return pb.RouteResponse()
        best = ranked[0]
        return pb.RouteResponse(
            pool_id=best.pool_id,
            worker_address=best.worker_address,
            num_cached_tokens=best.num_cached_tokens,
            candidates=[pool_match_to(m) for m in ranked],
        )


class FleetAdminService(pb_grpc.DirectoryAdminServiceServicer):
    """The read-only fleet-wide admin queries; the others go to a shard directly."""

    def __init__(self, shards: Shards) -> None:
        self._shards = shards

    @unary
    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        shards, metadata = self._shards, _metadata(context)
        replies = await shards.gather(
            context,
            lambda i: shards.admin[i].Lookup(request, metadata=metadata, timeout=shards.deadline_seconds),
        )
        matches = by_cached_prefix([match_from(m) for r in replies for m in r.matches])
        return pb.LookupResponse(matches=[pool_match_to(m) for m in matches])

    @unary
    async def ListPools(
        self, request: pb.ListPoolsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListPoolsResponse:
        shards, metadata = self._shards, _metadata(context)
        replies = await shards.gather(
            context,
            lambda i: shards.admin[i].ListPools(request, metadata=metadata, timeout=shards.deadline_seconds),
        )
        return pb.ListPoolsResponse(pools=[p for r in replies for p in r.pools])


def build_router(listen: str, shards: Shards, load_margin: float) -> tuple[grpc.aio.Server, str]:
    """The router's server (not started) on `listen`; answers it and its bound address."""
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.so_reuseport", 0)]
    )
    add_service(FleetRoutingService(shards, load_margin), server, "RoutingService")
    add_service(FleetAdminService(shards), server, "DirectoryAdminService")
    health = health_aio.HealthServicer()  # SERVING from the start: the router holds no state
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port(listen)
    host = listen.rsplit(":", 1)[0]
    return server, f"{host}:{port}"


async def serve(listen: str, shard_addresses: list[str], load_margin: float, ready_file: Path | None) -> int:
    """build -> start -> (ready file) -> wait for SIGTERM/SIGINT -> stop."""
    shards = Shards(shard_addresses)
    server, address = build_router(listen, shards, load_margin)
    await server.start()
    if ready_file is not None:
        ready_file.write_text(address + "\n")
    log.info("fleet router serving", address=address, shards=shard_addresses)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
    await server.stop(1.0)
    await shards.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default="127.0.0.1:50050", help="host:port to serve on")
    parser.add_argument("--shard", action="append", required=True, help="a blockd shard's address (repeat)")
    parser.add_argument(
        "--route-load-margin",
        type=float,
        default=0.25,
        help="a pool loaded more than this above the least loaded one is skipped (as blockd)",
    )
    parser.add_argument("--ready-file", type=Path, help="write the bound address here once serving")
    args = parser.parse_args(argv)
    try:
        return asyncio.run(serve(args.listen, args.shard, args.route_load_margin, args.ready_file))
    except RuntimeError as exc:  # e.g. the address is taken
        log.error("cannot serve", error=str(exc))
        return 1


if __name__ == "__main__":
    sys.exit(main())
