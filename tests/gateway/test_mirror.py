"""The directory mirror: the gateway's copy of blockd's block index, fed by its event stream.

Pure parts (hashing as blockd hashes, the event state machine) are checked against
blockd's own code and by hand; the feed runs against a real blockd whose pools are
driven over the worker contract (`tests.scaleout.fakepool`), and every answer it gives
is compared with what blockd's Route answers for the same prompt, salt and public prefix.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import pytest

from blockd.hashing import DEFAULT_HASHER
from blockd.hashing import token_bytes as blockd_token_bytes
from blockd.types import Namespace
from clients.options import open_aio_channel, open_channel
from gateway.mirror import DirectoryMirror, Kind, MirrorEvent, PoolDescription, Tier
from gateway.mirror_feed import MirrorFeed
from gateway.prefix_hash import PromptChain, namespace_seed, token_bytes
from gateway.tenants import salt_for
from kvcache.v1 import directory_pb2 as pb
from kvcache.v1 import directory_pb2_grpc as pb_grpc
from tests.daemons import Daemon, start_blockd
from tests.gateway.conftest import dead_address
from tests.scaleout.fakepool import FakePool

BLOCK = 16
NAMESPACE = pb.Namespace(model_id="mirror-model", model_revision="r1", dtype="float32")
A, B = "127.0.0.1:1001", "127.0.0.1:1002"  # the pools' announced worker addresses (nothing listens)


# ---------------------------------------------------------------- hashing


def test_prompt_hashes_are_blockd_hashes() -> None:
    rng = random.Random(7)
    for _ in range(300):
        block_size = rng.choice([1, 4, 16, 32])
        ns = Namespace(rng.choice(["m", "default_model", "modèle"]), rng.choice(["", "r1"]), "bfloat16")
        ns = Namespace(ns.model_id, ns.model_revision, ns.dtype, rng.choice(["", "lora-7"]))
        seed = DEFAULT_HASHER.namespace_seed(ns, block_size)
        assert seed == namespace_seed(ns.model_id, ns.model_revision, ns.dtype, ns.adapter_id, block_size)
        tokens = [rng.randrange(2**32) for _ in range(rng.randrange(0, 160))]
        salt = rng.choice(["", "a", salt_for("tenant-a"), "ü-salt"])
        public = rng.choice([0, 0, 3, 16, 17, 64, 1000])
        expected = DEFAULT_HASHER.chain(seed, blockd_token_bytes(tokens), block_size, salt, public)
        chain = PromptChain(seed, token_bytes(tokens), block_size, salt, public)
        assert chain.num_blocks == len(expected)  # the partial tail is never hashed
        assert [chain.hash(i) for i in range(chain.num_blocks)] == expected


def test_salts_and_public_prefixes_part_chains() -> None:
    seed = namespace_seed("m", "", "float32", "", 4)
    data = token_bytes(range(16))
    plain = [PromptChain(seed, data, 4).hash(i) for i in range(4)]
    a = [PromptChain(seed, data, 4, "tenant:1:a").hash(i) for i in range(4)]
    a_public = [PromptChain(seed, data, 4, "tenant:1:a", 8).hash(i) for i in range(4)]
    b_public = [PromptChain(seed, data, 4, "tenant:1:b", 8).hash(i) for i in range(4)]
    assert not set(plain) & set(a)  # a salt from block 0 on: nothing in common
    assert a_public[:2] == plain[:2] == b_public[:2]  # public blocks: every tenant's
    assert not set(a_public[2:]) & set(b_public[2:]) and not set(a_public[2:]) & set(plain)


# ---------------------------------------------------------------- the state machine


def _pools(shared: bool = False) -> list[PoolDescription]:
    seed = namespace_seed("m", "", "float32", "", 4)
    return [PoolDescription("p1", A, seed, 4, shared), PoolDescription("p2", B, seed, 4, shared)]


def _hashes(tokens: list[int], salt: str = "", public: int = 0) -> list[bytes]:
    chain = PromptChain(_pools()[0].seed, token_bytes(tokens), 4, salt, public)
    return [chain.hash(i) for i in range(chain.num_blocks)]


PROMPT = list(range(100, 118))  # 4 full blocks and 2 tokens


def test_snapshot_then_events_in_order() -> None:
    h = _hashes(PROMPT)
    mirror = DirectoryMirror(max_blocks=100)
    assert mirror.cached_tokens([A, B], PROMPT) is None  # never loaded: ask Route
    mirror.load(10, _pools(), [("p1", h[0]), ("p1", h[1])])
    assert mirror.cached_tokens([A, B], PROMPT) == [8, 0]
    mirror.apply(MirrorEvent(11, Kind.STORED, "p1", (h[1], h[2])))  # h[1]: already in the snapshot
    mirror.apply(MirrorEvent(12, Kind.STORED, "p2", (h[0],)))
    assert mirror.cached_tokens([A, B], PROMPT) == [12, 4]
    mirror.apply(MirrorEvent(13, Kind.REMOVED, "p1", (h[2],)))
    assert mirror.cached_tokens([B, A], PROMPT) == [4, 8]
    # device evicts h[1] to the host tier: still cached there (Route counts both tiers)
    mirror.apply(MirrorEvent(14, Kind.REMOVED, "p1", (h[1],)))
    mirror.apply(MirrorEvent(15, Kind.DEMOTED, "p1", (h[1],), Tier.HOST))
    assert mirror.cached_tokens([A], PROMPT) == [8]
    mirror.apply(MirrorEvent(16, Kind.REMOVED, "p1", (h[1],), Tier.HOST))
    assert mirror.cached_tokens([A], PROMPT) == [4]
    mirror.apply(MirrorEvent(17, Kind.CLEARED, "p1"))
    assert mirror.cached_tokens([A, B], PROMPT) == [0, 4]
    assert mirror.num_blocks == 1 and mirror.in_sync and mirror.last_sequence == 17


def test_shared_tier_counts_for_pools_that_have_one() -> None:
    h = _hashes(PROMPT)
    mirror = DirectoryMirror(max_blocks=100)
    mirror.load(0, _pools(shared=True), [("p1", h[0])])
    mirror.apply(MirrorEvent(1, Kind.DEMOTED, "p2", tuple(h[:3]), Tier.SHARED))
    assert mirror.cached_tokens([A, B], PROMPT) == [12, 12]  # the longer run: the shared one
    mirror.apply(MirrorEvent(2, Kind.REMOVED, "", (h[1],), Tier.SHARED))  # no pool: the store's bound
    assert mirror.cached_tokens([A, B], PROMPT) == [4, 4]
    without = DirectoryMirror(max_blocks=100)
    without.load(0, _pools(shared=False), [])
    without.apply(MirrorEvent(1, Kind.DEMOTED, "p2", tuple(h[:3]), Tier.SHARED))
    assert without.cached_tokens([A, B], PROMPT) == [0, 0]


def test_tenants_see_only_their_own_and_public_blocks() -> None:
    a, b = salt_for("tenant-a"), salt_for("tenant-b")
    mirror = DirectoryMirror(max_blocks=100)
    mirror.load(0, _pools(), [("p1", x) for x in _hashes(PROMPT, a)])
    mirror.apply(MirrorEvent(1, Kind.STORED, "p2", tuple(_hashes(PROMPT, a, public=8))))
    assert mirror.cached_tokens([A, B], PROMPT, a) == [16, 0]
    assert mirror.cached_tokens([A, B], PROMPT, b) == [0, 0]
    assert mirror.cached_tokens([A, B], PROMPT, "") == [0, 8]  # public blocks are unsalted ones
    assert mirror.cached_tokens([A, B], PROMPT, b, 8) == [0, 8]  # the two public blocks only
    assert mirror.cached_tokens([A, B], PROMPT, a, 8) == [0, 16]


@pytest.mark.parametrize(
    "event, why",
    [
        (MirrorEvent(0, Kind.GAP, ""), "gap"),
        (MirrorEvent(7, Kind.STORED, "p1", (b"x" * 16,)), "event 7 after 5"),  # one lost
        (MirrorEvent(1, Kind.STORED, "p1", (b"x" * 16,)), "event 1 after 5"),  # blockd restarted
        (MirrorEvent(6, Kind.STORED, "p1", tuple(bytes([i]) * 16 for i in range(4))), "max_blocks"),
    ],
)
def test_out_of_sync_answers_none_until_reloaded(event: MirrorEvent, why: str) -> None:
    mirror = DirectoryMirror(max_blocks=3)
    mirror.load(5, _pools(), [])
    mirror.apply(event)
    assert not mirror.in_sync and why in mirror.why_out_of_sync
    assert mirror.cached_tokens([A, B], PROMPT) is None
    mirror.apply(MirrorEvent(6, Kind.STORED, "p1", (b"y" * 16,)))  # ignored out of sync
    mirror.load(9, _pools(), [])
    assert mirror.cached_tokens([A, B], PROMPT) == [0, 0] and mirror.num_blocks == 0


def test_an_address_no_pool_announces_is_not_guessed() -> None:
    mirror = DirectoryMirror(max_blocks=100)
    mirror.load(0, _pools(), [])
    assert mirror.cached_tokens([A, "127.0.0.1:9"], PROMPT) is None
    mirror.apply(MirrorEvent(1, Kind.STORED, "p3", (b"z" * 16,)))
    assert mirror.unknown_pools == {"p3"}
    mirror.describe([*_pools(), PoolDescription("p3", "127.0.0.1:9", _pools()[0].seed, 4)])
    assert mirror.unknown_pools == set() and mirror.cached_tokens([A, "127.0.0.1:9"], PROMPT) == [0, 0]


# ---------------------------------------------------------------- live, against blockd


@pytest.fixture
def blockd(tmp_path) -> Iterator[Daemon]:
    daemon = start_blockd(tmp_path, "--log-format", "json")
    yield daemon
    daemon.stop()


def _route(blockd_address: str, tokens: list[int], salt: str = "", public: int = 0) -> dict[str, int]:
    with open_channel(blockd_address) as channel:
        reply = pb_grpc.RoutingServiceStub(channel).Route(
            pb.RouteRequest(token_ids=tokens, cache_salt=salt, public_prefix_tokens=public), timeout=10
        )
    return {c.worker_address: c.num_cached_tokens for c in reply.candidates}


def _last_event(blockd_address: str, metadata: tuple = ()) -> int:
    with open_channel(blockd_address) as channel:
        stub = pb_grpc.DirectoryAdminServiceStub(channel)
        return stub.GetStats(pb.GetStatsRequest(), timeout=10, metadata=metadata).last_event_sequence


async def _caught_up(
    feed: MirrorFeed, blockd_address: str, metadata: tuple = (), timeout: float = 10.0
) -> None:
    """Until the mirror is in sync and has applied every event blockd has numbered."""
    newest = await asyncio.to_thread(_last_event, blockd_address, metadata)
    deadline = time.monotonic() + timeout
    while not (feed.mirror.in_sync and feed.mirror.last_sequence >= newest):
        assert time.monotonic() < deadline, f"mirror not caught up: {feed.mirror.why_out_of_sync}"
        await asyncio.sleep(0.02)


def _tokens(seed: int, n: int = 6 * BLOCK + 5) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30_000) for _ in range(n)]


QUERIES = [("", 0), (salt_for("tenant-a"), 0), (salt_for("tenant-b"), 0), (salt_for("tenant-b"), 2 * BLOCK)]


async def _agree(feed: MirrorFeed, address: str, prompts: list[list[int]]) -> None:
    for tokens in prompts:
        for salt, public in QUERIES:
            route = await asyncio.to_thread(_route, address, tokens, salt, public)
            mirrored = feed.mirror.cached_tokens([A, B], tokens, salt, public)
            assert mirrored == [route[A], route[B]], (salt, public)


async def test_the_mirror_agrees_with_route_from_snapshot_and_from_events(blockd: Daemon) -> None:
    p, q, r, s = _tokens(1), _tokens(2), _tokens(3), _tokens(6)
    with open_channel(blockd.address) as channel:
        one = FakePool(channel, NAMESPACE, 64, BLOCK, A)
        two = FakePool(channel, NAMESPACE, 64, BLOCK, B)
        # before the mirror starts: its snapshot must hold these
        one.cache(1, p, 6)
        two.cache(1, p, 2)
        with open_channel(blockd.address) as salted:
            pool = pb_grpc.BlockDirectoryServiceStub(salted)
            a = salt_for("tenant-a")
            admit = pb.AdmitOp(sequence_id=2, token_ids=q, cache_salt=a, public_prefix_tokens=2 * BLOCK)
            [result] = pool.Step(pb.StepRequest(pool_id=two.pool_id, epoch=two.epoch, admits=[admit])).admits
            commit = pb.CommitOp(sequence_id=2, block_ids=result.block_ids[:5], token_ids=q[: 5 * BLOCK])
            pool.Step(pb.StepRequest(pool_id=two.pool_id, epoch=two.epoch, commits=[commit]))
        channel_aio = open_aio_channel(blockd.address)
        feed = MirrorFeed(channel_aio, DirectoryMirror(max_blocks=10_000))
        feed.start()
        try:
            await _caught_up(feed, blockd.address)
            assert feed.mirror.cached_tokens([A, B], p) == [6 * BLOCK, 2 * BLOCK]
            # tenant b: none of tenant a's salted blocks, only the two public ones of q
            assert feed.mirror.cached_tokens([A, B], q, salt_for("tenant-b"), 2 * BLOCK) == [0, 2 * BLOCK]
            assert feed.mirror.cached_tokens([A, B], q, salt_for("tenant-b")) == [0, 0]
            await _agree(feed, blockd.address, [p, q, r])
            # while it follows: new blocks, then a re-registration (CLEARED) and a flush (REMOVED)
            await asyncio.to_thread(one.cache, 3, r, 4)
            await asyncio.to_thread(two.cache, 4, s, 6)
            await _caught_up(feed, blockd.address)
            assert feed.mirror.cached_tokens([A, B], r) == [4 * BLOCK, 0]
            assert feed.mirror.cached_tokens([A, B], s) == [0, 6 * BLOCK]
            await _agree(feed, blockd.address, [p, q, r, s])
            await asyncio.to_thread(two.reregister)  # CLEARED
            with open_channel(blockd.address) as admin:
                pb_grpc.DirectoryAdminServiceStub(admin).Flush(
                    pb.FlushRequest(pool_id=one.pool_id), timeout=10
                )
            await _caught_up(feed, blockd.address)
            assert feed.mirror.cached_tokens([A, B], p) == [0, 0]
            assert feed.mirror.cached_tokens([A, B], s) == [0, 0]
            await _agree(feed, blockd.address, [p, q, r, s])
            assert feed.num_syncs == 1  # all of it from the one stream
        finally:
            await feed.close()
            await channel_aio.close()


async def test_the_mirror_resyncs_after_blockd_restarts(tmp_path) -> None:
    listen = dead_address()
    daemon = start_blockd(tmp_path, "--listen", listen, "--log-format", "json", name="blockd-1")
    channel_aio = open_aio_channel(listen)
    feed = MirrorFeed(channel_aio, DirectoryMirror(max_blocks=10_000))
    try:
        p = _tokens(4)
        with open_channel(listen) as channel:
            FakePool(channel, NAMESPACE, 64, BLOCK, A).cache(1, p, 3)
        feed.start()
        await _caught_up(feed, listen)
        assert feed.mirror.cached_tokens([A], p) == [3 * BLOCK]
        daemon.stop()
        deadline = time.monotonic() + 10
        while feed.mirror.in_sync:  # the stream breaks: Route serves meanwhile
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        assert feed.mirror.cached_tokens([A], p) is None
        daemon = start_blockd(tmp_path, "--listen", listen, "--log-format", "json", name="blockd-2")
        with open_channel(listen) as channel:  # the same worker registers again, caches less
            FakePool(channel, NAMESPACE, 64, BLOCK, A).cache(1, p, 1)
        await _caught_up(feed, listen)
        assert feed.num_syncs >= 2
        assert (
            feed.mirror.cached_tokens([A], p) == [BLOCK] == [(await asyncio.to_thread(_route, listen, p))[A]]
        )
    finally:
        await feed.close()
        await channel_aio.close()
        daemon.stop()


async def test_the_mirror_needs_blockd_admin_token(tmp_path) -> None:
    daemon = start_blockd(tmp_path, "--admin-token", "s3cret", "--log-format", "json")
    channel_aio = open_aio_channel(daemon.address)
    refused = MirrorFeed(channel_aio, DirectoryMirror(max_blocks=100))
    allowed = MirrorFeed(channel_aio, DirectoryMirror(max_blocks=100), admin_token="s3cret")
    try:
        refused.start()
        allowed.start()
        await _caught_up(allowed, daemon.address, (("authorization", "Bearer s3cret"),))
        assert refused.refused and not refused.mirror.in_sync and refused.num_syncs == 0
        assert refused.mirror.cached_tokens([A], _tokens(5)) is None
    finally:
        await refused.close()
        await allowed.close()
        await channel_aio.close()
        daemon.stop()


def test_kinds_and_tiers_are_the_contracts_enums() -> None:
    from kvcache.v1 import directory_pb2

    kinds = {
        v.name.removeprefix("BLOCK_EVENT_KIND_"): v.number
        for v in directory_pb2.BlockEventKind.DESCRIPTOR.values
    }
    tiers = {v.name.removeprefix("TIER_"): v.number for v in directory_pb2.Tier.DESCRIPTOR.values}
    assert {k.name: k.value for k in Kind} == {n: v for n, v in kinds.items() if v}
    assert {t.name: t.value for t in Tier} == {n: v for n, v in tiers.items() if v}
