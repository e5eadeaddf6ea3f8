"""The directory mirror over blockd shards (gateway.mirrors, docs/sharding.md): one mirror
per shard, each fed by that shard's event stream, answering as one.

Pure: a worker's prefix comes from the mirror of the shard that holds its pool; a shard
out of sync or a worker no shard knows makes the set answer None (Route then). Live:
two real blockd shards behind the real fleet router, a real gateway started with
`--blockd-shard` for each: its mirror follows both streams and agrees with the router's
Route for pools on either shard.
"""

from __future__ import annotations

import asyncio
import re
import time

from clients.options import open_aio_channel, open_channel
from gateway.mirror import DirectoryMirror, Kind, MirrorEvent, PoolDescription
from gateway.mirror_feed import MirrorFeed
from gateway.mirrors import MirrorSet
from gateway.prefix_hash import PromptChain, namespace_seed, token_bytes
from tests.daemons import spawn, start_blockd, start_gateway
from tests.gateway.conftest import http
from tests.gateway.test_mirror import NAMESPACE, _route, _tokens
from tests.scaleout.fakepool import FakePool

A, B, C = "127.0.0.1:1001", "127.0.0.1:1002", "127.0.0.1:1003"
SEED = namespace_seed("m", "", "float32", "", 4)
PROMPT = list(range(100, 118))  # 4 full blocks of 4 and 2 tokens


def _hashes(tokens: list[int]) -> list[bytes]:
    chain = PromptChain(SEED, token_bytes(tokens), 4)
    return [chain.hash(i) for i in range(chain.num_blocks)]


def _two_shards() -> tuple[DirectoryMirror, DirectoryMirror]:
    h = _hashes(PROMPT)
    one, two = DirectoryMirror(max_blocks=100), DirectoryMirror(max_blocks=100)
    one.load(3, [PoolDescription("p1", A, SEED, 4)], [("p1", h[0])])
    two.load(8, [PoolDescription("p2", B, SEED, 4), PoolDescription("p3", C, SEED, 4)], [])
    two.apply(MirrorEvent(9, Kind.STORED, "p2", tuple(h[:3])))
    return one, two


def test_each_worker_answers_from_its_shards_mirror_in_the_order_asked() -> None:
    one, two = _two_shards()
    mirrors = MirrorSet([one, two])
    assert mirrors.cached_tokens([B, A, C], PROMPT) == [12, 4, 0]
    assert mirrors.cached_tokens([A], PROMPT) == [4]
    assert mirrors.num_blocks == one.num_blocks + two.num_blocks == 4


def test_a_shard_out_of_sync_or_an_unknown_worker_answers_none() -> None:
    one, two = _two_shards()
    mirrors = MirrorSet([one, two])
    assert mirrors.cached_tokens([A, "127.0.0.1:9"], PROMPT) is None  # no shard knows it
    two.apply(MirrorEvent(11, Kind.STORED, "p2", ()))  # event 10 lost: shard two resyncs
    assert not mirrors.in_sync
    assert mirrors.cached_tokens([A], PROMPT) is None  # even for a worker of the other shard
    two.load(12, [PoolDescription("p2", B, SEED, 4), PoolDescription("p3", C, SEED, 4)], [])
    assert mirrors.cached_tokens([A, B], PROMPT) == [4, 0]


async def test_mirrors_of_two_live_shards_agree_with_the_fleet_routers_route(tmp_path) -> None:
    shards = [start_blockd(tmp_path / f"s{i}", name=f"blockd{i}") for i in range(2)]
    router = spawn("fleet", "blockd.fleet", tmp_path, [a for s in shards for a in ("--shard", s.address)])
    gateway = None
    channels = [open_channel(s.address) for s in shards]
    try:
        pools = [FakePool(ch, NAMESPACE, 64, 16, w) for ch, w in zip(channels, (A, B))]
        p, q = _tokens(1), _tokens(2)
        pools[0].cache(1, p, 2)  # shard 0's worker A: 2 blocks of p
        pools[1].cache(1, p, 5)  # shard 1's worker B: 5 blocks of p, and q
        pools[1].cache(2, q, 3)
        aio = [open_aio_channel(s.address) for s in shards]
        mirrors = MirrorSet([DirectoryMirror(10_000), DirectoryMirror(10_000)])
        feeds = [MirrorFeed(ch, m) for ch, m in zip(aio, mirrors.mirrors)]
        for feed in feeds:
            feed.start()
        try:
            deadline = time.monotonic() + 10
            while mirrors.cached_tokens([A, B], p) != [2 * 16, 5 * 16]:
                assert time.monotonic() < deadline, "the shards' mirrors never caught up"
                await asyncio.sleep(0.02)
            for tokens in (p, q):
                route = await asyncio.to_thread(_route, router.address, tokens)
                assert mirrors.cached_tokens([A, B], tokens) == [route[A], route[B]]
        finally:
            for feed in feeds:
                await feed.close()
            for ch in aio:
                await ch.close()
        # The gateway itself, given both shards: its mirror follows both streams.
        shard_flags = [a for s in shards for a in ("--blockd-shard", s.address)]
        gateway = start_gateway(tmp_path, [], *shard_flags, blockd=router.address)
        deadline = time.monotonic() + 10
        while True:
            text = http(gateway.address, "GET", "/metrics")[2]
            synced = re.search(r"^gateway_directory_mirror_synced (\S+)$", text, re.MULTILINE)
            blocks = re.search(r"^gateway_directory_mirror_blocks (\S+)$", text, re.MULTILINE)
            if synced and blocks and float(synced[1]) == 1 and float(blocks[1]) == 2 + 5 + 3:
                break
            assert time.monotonic() < deadline, (
                f"gateway mirror: {synced and synced[0]}, {blocks and blocks[0]}"
            )
            await asyncio.sleep(0.05)
    finally:
        for ch in channels:
            ch.close()
        if gateway is not None:
            gateway.stop()
        router.stop()
        for shard in shards:
            shard.stop()
