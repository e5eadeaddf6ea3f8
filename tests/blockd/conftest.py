"""An in-process blockd (grpc.aio on port 0) with stubs for every service."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import pytest

from blockd.config import BlockdConfig, DirectoryConfig
from blockd.directory import BlockDirectory
from blockd.server import BlockdServer, build_server
from kvcache.v1 import directory_pb2 as pb
from kvcache.v1 import directory_pb2_grpc as pb_grpc

ADMIN_TOKEN = "s3cret-admin"
AUTH = (("authorization", f"Bearer {ADMIN_TOKEN}"),)


@dataclass
class Blockd:
    server: BlockdServer
    address: str
    channel: grpc.aio.Channel
    workers: pb_grpc.BlockDirectoryServiceStub
    admin: pb_grpc.DirectoryAdminServiceStub
    routing: pb_grpc.RoutingServiceStub

    @property
    def directory(self) -> BlockDirectory:
        return self.server.directory

    async def stats(self) -> pb.GetStatsResponse:
        return await self.admin.GetStats(pb.GetStatsRequest(), metadata=AUTH)


async def start_inprocess(
    config: BlockdConfig, directory: BlockDirectory | None = None, on_pool_registered=None
) -> Blockd:
    server, address = build_server(config, directory, on_pool_registered)
    await server.start()
    channel = grpc.aio.insecure_channel(address)
    return Blockd(
        server,
        address,
        channel,
        pb_grpc.BlockDirectoryServiceStub(channel),
        pb_grpc.DirectoryAdminServiceStub(channel),
        pb_grpc.RoutingServiceStub(channel),
    )


def make_config(**directory) -> BlockdConfig:
    directory.setdefault("max_sequence_tokens", 4096)
    directory.setdefault("lease_ttl_seconds", 30.0)
    return BlockdConfig(
        listen="127.0.0.1:0",
        admin_token=ADMIN_TOKEN,
        shutdown_grace_seconds=0.5,
        directory=DirectoryConfig(**directory),
    )


@pytest.fixture
async def blockd():
    env = await start_inprocess(make_config())
    yield env
    await env.channel.close()
    await env.server.stop(0)
