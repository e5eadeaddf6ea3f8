"""Shards and the fleet router (issue 43, docs/sharding.md): two real blockd shards,
each owning its workers' pools; the router answers Route, Lookup and ListPools over
both as one blockd would, and leaves out a shard that is down."""

from __future__ import annotations

import grpc
import pytest

from blockd.fleet import Shards, build_router
from kvcache.v1 import directory_pb2 as pb
from kvcache.v1 import directory_pb2_grpc as pb_grpc
from tests.blockd.conftest import AUTH, make_config, start_inprocess

PROMPT = list(range(2000, 2064))  # 4 blocks of 16


async def _cache(env, worker: str, tokens: list[int], num_blocks: int) -> str:
    """A pool on `env` (a shard) holding the first `num_blocks` blocks of `tokens`."""
    reg = await env.workers.RegisterPool(
        pb.RegisterPoolRequest(
            num_blocks=64, block_size=16, namespace=pb.Namespace(model_id="m"), worker_address=worker
        )
    )
    step = pb.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch)
    step.admits.add(sequence_id=1, token_ids=tokens)
    table = (await env.workers.Step(step)).admits[0].block_ids
    step = pb.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch)
    step.commits.add(sequence_id=1, block_ids=table[:num_blocks])  # by index: blockd holds the prompt
    step.releases.add(sequence_id=1)
    await env.workers.Step(step)
    return reg.pool_id


@pytest.fixture
async def fleet():
    shards = [await start_inprocess(make_config()) for _ in range(2)]
    router_shards = Shards([s.address for s in shards], deadline_seconds=2.0)
    server, address = build_router("127.0.0.1:0", router_shards, load_margin=0.25)
    await server.start()
    channel = grpc.aio.insecure_channel(address)
    yield shards, channel
    await channel.close()
    await server.stop(0)
    await router_shards.close()
    for shard in shards:
        await shard.channel.close()
        await shard.server.stop(0)


async def test_route_finds_the_longest_prefix_on_any_shard(fleet):
    (a, b), channel = fleet
    await _cache(a, "worker-a:1", PROMPT, 1)
    best = await _cache(b, "worker-b:1", PROMPT, 3)  # the longer prefix lives on shard b
    route = await pb_grpc.RoutingServiceStub(channel).Route(pb.RouteRequest(token_ids=PROMPT))
    assert (route.pool_id, route.worker_address, route.num_cached_tokens) == (best, "worker-b:1", 48)
    assert [c.num_cached_tokens for c in route.candidates] == [48, 16]
    lookup = await pb_grpc.DirectoryAdminServiceStub(channel).Lookup(
        pb.LookupRequest(token_ids=PROMPT), metadata=AUTH
    )
    assert [m.worker_address for m in lookup.matches] == ["worker-b:1", "worker-a:1"]
    pools = await pb_grpc.DirectoryAdminServiceStub(channel).ListPools(pb.ListPoolsRequest(), metadata=AUTH)
    assert sorted(p.worker_address for p in pools.pools) == ["worker-a:1", "worker-b:1"]


async def test_a_shard_that_is_down_is_left_out_and_admin_tokens_still_count(fleet):
    (a, b), channel = fleet
    only = await _cache(a, "worker-a:1", PROMPT, 2)
    await _cache(b, "worker-b:1", PROMPT, 3)
    await b.server.stop(0)  # shard b is gone: its pools leave routing with it
    route = await pb_grpc.RoutingServiceStub(channel).Route(pb.RouteRequest(token_ids=PROMPT))
    assert (route.pool_id, route.num_cached_tokens) == (only, 32)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await pb_grpc.DirectoryAdminServiceStub(channel).ListPools(pb.ListPoolsRequest())  # no admin token
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    await a.server.stop(0)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await pb_grpc.RoutingServiceStub(channel).Route(pb.RouteRequest(token_ids=PROMPT))
    assert (
        info.value.code() == grpc.StatusCode.UNAVAILABLE
        and "no blockd shard answered" in info.value.details()
    )


def test_the_router_daemon_over_two_blockd_processes(tmp_path):
    """`python -m blockd.fleet` in front of two blockd processes, each with a pool."""
    from tests.daemons import spawn, start_blockd

    shards = [start_blockd(tmp_path / f"shard{i}", name=f"blockd{i}") for i in range(2)]
    router = spawn("fleet", "blockd.fleet", tmp_path, [a for s in shards for a in ("--shard", s.address)])
    try:
        for i, shard in enumerate(shards):
            with grpc.insecure_channel(shard.address) as channel:
                pb_grpc.BlockDirectoryServiceStub(channel).RegisterPool(
                    pb.RegisterPoolRequest(
                        num_blocks=8,
                        block_size=4,
                        namespace=pb.Namespace(model_id="m"),
                        worker_address=f"w{i}:1",
                    ),
                    timeout=10,
                )
        with grpc.insecure_channel(router.address) as channel:
            pools = pb_grpc.DirectoryAdminServiceStub(channel).ListPools(pb.ListPoolsRequest(), timeout=10)
            route = pb_grpc.RoutingServiceStub(channel).Route(
                pb.RouteRequest(token_ids=[1, 2, 3, 4]), timeout=10
            )
        assert sorted(p.worker_address for p in pools.pools) == ["w0:1", "w1:1"]
        assert route.worker_address in ("w0:1", "w1:1") and len(route.candidates) == 2
    finally:
        assert router.stop() == 0, router.log()
        for shard in shards:
            assert shard.stop() == 0, shard.log()
