"""The gRPC services over an in-process server on port 0: every RPC, every bad input
with its exact status code, and the daemon still serving (accounting unchanged)
after each bad call."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest

from blockd.config import BlockdConfig, DirectoryConfig
from blockd.directory import BlockDirectory
from kvcache.v1 import cache_policy_pb2 as cache_pb
from kvcache.v1 import directory_pb2 as pb
from tests.blockd.conftest import ADMIN_TOKEN, AUTH, Blockd, make_config, start_inprocess

NS = pb.Namespace(model_id="m", model_revision="r1", dtype="float32")
PROMPT = list(range(1000, 1040))  # 40 tokens: 2 full blocks of 16 + a tail of 8


async def register(env: Blockd, num_blocks: int = 64, block_size: int = 16, **kw) -> pb.RegisterPoolResponse:
    return await env.workers.RegisterPool(
        pb.RegisterPoolRequest(
            num_blocks=num_blocks, block_size=block_size, namespace=NS, worker_address="w:1", **kw
        )
    )


async def step(env: Blockd, pool: pb.RegisterPoolResponse, **ops) -> pb.StepResponse:
    return await env.workers.Step(pb.StepRequest(pool_id=pool.pool_id, epoch=pool.epoch, **ops))


async def expect(code: grpc.StatusCode, call, *, env: Blockd, text: str = "") -> None:
    """The call fails with `code`, changes no accounting, and blockd keeps serving."""
    before = await env.stats()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    assert text.lower() in (info.value.details() or "").lower()
    after = await env.stats()
    assert after.total == before.total and after.last_event_sequence == before.last_event_sequence


async def test_worker_flow_admit_commit_release_hit(blockd):
    pool = await register(blockd)
    assert pool.epoch >= 1 and pool.lease_ttl_seconds == 30 and pool.max_sequence_tokens == 4096
    first = (await step(blockd, pool, admits=[pb.AdmitOp(sequence_id=1, token_ids=PROMPT)])).admits[0]
    assert first.admitted and len(first.block_ids) == 3 and first.num_cached_tokens == 0
    reply = await step(
        blockd,
        pool,
        commits=[pb.CommitOp(sequence_id=1, block_ids=first.block_ids[:2], token_ids=PROMPT[:32])],
        releases=[pb.ReleaseOp(sequence_id=1)],
        admits=[pb.AdmitOp(sequence_id=2, token_ids=PROMPT)],
    )
    second = reply.admits[0]
    assert second.num_cached_tokens == 32 and second.block_ids[:2] == first.block_ids[:2]
    assert reply.num_free_blocks == 61 and reply.num_evictable_blocks == 0
    grow = (await step(blockd, pool, grows=[pb.GrowOp(sequence_id=2, num_tokens=49)])).grows[0]
    assert grow.grown and len(grow.new_block_ids) == 1
    stats = await blockd.stats()
    assert (stats.total.queried_tokens, stats.total.hit_tokens) == (80, 32)
    assert stats.total.num_referenced_blocks == 4 and stats.total.num_cached_blocks == 2
    renewed = await blockd.workers.RenewLease(pb.RenewLeaseRequest(pool_id=pool.pool_id, epoch=pool.epoch))
    assert renewed.lease_ttl_seconds == 30


async def test_resync_after_reregister(blockd):
    pool = await register(blockd, pool_id="worker-7")
    assert pool.pool_id == "worker-7"
    admitted = (await step(blockd, pool, admits=[pb.AdmitOp(sequence_id=5, token_ids=PROMPT)])).admits[0]
    again = await register(blockd, pool_id="worker-7", pool_token=pool.pool_token)
    assert again.epoch == pool.epoch + 1
    reply = await blockd.workers.Resync(
        pb.ResyncRequest(
            pool_id="worker-7",
            epoch=again.epoch,
            sequences=[pb.ResyncSequence(sequence_id=5, block_ids=admitted.block_ids, token_ids=PROMPT)],
        )
    )
    assert (reply.num_sequences, reply.num_committed_blocks) == (1, 2)
    stats = await blockd.stats()
    assert stats.total.num_sequences == 1 and stats.total.num_referenced_blocks == 3


async def test_admin_rpcs(blockd):
    pool = await register(blockd)
    admitted = (await step(blockd, pool, admits=[pb.AdmitOp(sequence_id=1, token_ids=PROMPT)])).admits[0]
    await step(
        blockd,
        pool,
        commits=[pb.CommitOp(sequence_id=1, block_ids=admitted.block_ids[:2], token_ids=PROMPT[:32])],
    )
    pools = await blockd.admin.ListPools(pb.ListPoolsRequest(), metadata=AUTH)
    info = pools.pools[0]
    assert info.pool_id == pool.pool_id and info.is_live and info.namespace.model_id == "m"
    assert 0 < info.lease_remaining_seconds <= 30 and info.stats.num_sequences == 1
    blocks = await blockd.admin.ListBlocks(pb.ListBlocksRequest(page_size=1), metadata=AUTH)
    assert len(blocks.blocks) == 1 and blocks.next_page_token
    assert list(blocks.blocks[0].token_ids) == PROMPT[:16] and blocks.blocks[0].parent_hash == b""
    rest = await blockd.admin.ListBlocks(
        pb.ListBlocksRequest(page_token=blocks.next_page_token), metadata=AUTH
    )
    assert len(rest.blocks) == 1 and rest.blocks[0].parent_hash == blocks.blocks[0].block_hash
    assert rest.next_page_token == "" and rest.blocks[0].block_index == 1
    lookup = await blockd.admin.Lookup(pb.LookupRequest(token_ids=PROMPT), metadata=AUTH)
    assert [(m.pool_id, m.num_cached_tokens, m.num_sequences) for m in lookup.matches] == [
        (pool.pool_id, 32, 1)
    ]
    assert lookup.matches[0].load == pytest.approx(3 / 64)
    pin = await blockd.admin.Pin(pb.PinRequest(token_ids=PROMPT, ttl_seconds=60), metadata=AUTH)
    assert (pin.num_pinned_tokens, pin.num_pinned_blocks, pin.expires_in_seconds) == (32, 2, 60)
    flush = await blockd.admin.Flush(pb.FlushRequest(), metadata=AUTH)
    assert (flush.dropped, flush.busy) == (0, 2)
    unpin = await blockd.admin.Unpin(pb.UnpinRequest(pin_id=pin.pin_id), metadata=AUTH)
    assert unpin.num_unpinned_blocks == 2
    await step(blockd, pool, releases=[pb.ReleaseOp(sequence_id=1)])
    flush = await blockd.admin.Flush(pb.FlushRequest(pool_id=pool.pool_id), metadata=AUTH)
    assert (flush.dropped, flush.busy) == (2, 0)
    stats = await blockd.admin.GetStats(pb.GetStatsRequest(pool_id=pool.pool_id), metadata=AUTH)
    assert stats.total.num_free_blocks == 64 and stats.pools[0].pool_id == pool.pool_id


async def test_route(blockd):
    hot = await register(blockd)
    cold = await register(blockd)
    route = await blockd.routing.Route(pb.RouteRequest(token_ids=PROMPT))  # no token needed
    assert route.num_cached_tokens == 0 and len(route.candidates) == 2
    admitted = (await step(blockd, hot, admits=[pb.AdmitOp(sequence_id=1, token_ids=PROMPT)])).admits[0]
    await step(
        blockd,
        hot,
        commits=[pb.CommitOp(sequence_id=1, block_ids=admitted.block_ids[:2], token_ids=PROMPT[:32])],
        releases=[pb.ReleaseOp(sequence_id=1)],
    )
    route = await blockd.routing.Route(pb.RouteRequest(token_ids=PROMPT))
    assert (route.pool_id, route.worker_address, route.num_cached_tokens) == (hot.pool_id, "w:1", 32)
    assert [c.pool_id for c in route.candidates] == [hot.pool_id, cold.pool_id]


async def test_watch_events_replays_then_streams_live(blockd):
    pool = await register(blockd)
    admitted = (await step(blockd, pool, admits=[pb.AdmitOp(sequence_id=1, token_ids=PROMPT)])).admits[0]
    await step(
        blockd,
        pool,
        commits=[pb.CommitOp(sequence_id=1, block_ids=admitted.block_ids[:1], token_ids=PROMPT[:16])],
    )
    call = blockd.admin.WatchEvents(pb.WatchEventsRequest(after_sequence=0), metadata=AUTH)
    stream = call.__aiter__()
    first = await asyncio.wait_for(stream.__anext__(), 5)
    assert first.kind == pb.BLOCK_EVENT_KIND_STORED and list(first.token_ids) == PROMPT[:16]
    assert list(first.block_ids) == [admitted.block_ids[0]] and first.parent_hash == b""
    await step(
        blockd,
        pool,
        commits=[pb.CommitOp(sequence_id=1, block_ids=admitted.block_ids[1:2], token_ids=PROMPT[16:32])],
    )
    live = await asyncio.wait_for(stream.__anext__(), 5)
    assert live.kind == pb.BLOCK_EVENT_KIND_STORED and live.sequence == first.sequence + 1
    assert live.parent_hash == first.block_hashes[0]
    await blockd.admin.Flush(pb.FlushRequest(), metadata=AUTH)  # busy: nothing removed
    await step(blockd, pool, releases=[pb.ReleaseOp(sequence_id=1)])
    await blockd.admin.Flush(pb.FlushRequest(), metadata=AUTH)
    removed = await asyncio.wait_for(stream.__anext__(), 5)
    assert removed.kind == pb.BLOCK_EVENT_KIND_REMOVED and len(removed.block_hashes) == 2
    call.cancel()


async def test_watch_events_gap_when_too_old():
    env = await start_inprocess(make_config(event_log_capacity=2))
    try:
        pool = await register(env)
        for sequence_id in range(1, 5):
            tokens = [sequence_id] * 16
            admitted = (
                await step(env, pool, admits=[pb.AdmitOp(sequence_id=sequence_id, token_ids=tokens)])
            ).admits[0]
            await step(
                env,
                pool,
                commits=[
                    pb.CommitOp(sequence_id=sequence_id, block_ids=admitted.block_ids, token_ids=tokens)
                ],
            )
        call = env.admin.WatchEvents(pb.WatchEventsRequest(after_sequence=1), metadata=AUTH)
        gap = await asyncio.wait_for(call.__aiter__().__anext__(), 5)
        assert gap.kind == pb.BLOCK_EVENT_KIND_GAP and gap.sequence == 4
        call.cancel()
    finally:
        await env.channel.close()
        await env.server.stop(0)


async def test_bad_worker_calls_get_exact_codes(blockd):
    pool = await register(blockd, num_blocks=8)
    admitted = (await step(blockd, pool, admits=[pb.AdmitOp(sequence_id=1, token_ids=PROMPT)])).admits[0]
    code = grpc.StatusCode
    for num_blocks, block_size in ((0, 16), (16_777_217, 16), (8, 0), (8, 4096)):
        request = pb.RegisterPoolRequest(num_blocks=num_blocks, block_size=block_size, namespace=NS)
        await expect(code.INVALID_ARGUMENT, blockd.workers.RegisterPool(request), env=blockd)
    cases = [
        (code.INVALID_ARGUMENT, "empty", {"admits": [pb.AdmitOp(sequence_id=2, token_ids=[])]}),
        (
            code.INVALID_ARGUMENT,
            "exceed the limit",
            {"admits": [pb.AdmitOp(sequence_id=2, token_ids=[1] * 4097)]},
        ),
        (
            code.RESOURCE_EXHAUSTED,
            "only 8 blocks",
            {"admits": [pb.AdmitOp(sequence_id=2, token_ids=[1] * 200)]},
        ),
        (code.INVALID_ARGUMENT, "already live", {"admits": [pb.AdmitOp(sequence_id=1, token_ids=[1])]}),
        (code.NOT_FOUND, "not live", {"releases": [pb.ReleaseOp(sequence_id=99)]}),
        (
            code.NOT_FOUND,
            "not live",
            {"releases": [pb.ReleaseOp(sequence_id=1), pb.ReleaseOp(sequence_id=1)]},
        ),
        (
            code.INVALID_ARGUMENT,
            "partial block",
            {
                "commits": [
                    pb.CommitOp(sequence_id=1, block_ids=admitted.block_ids[:1], token_ids=PROMPT[:10])
                ]
            },
        ),
        (
            code.INVALID_ARGUMENT,
            "foreign block",
            {"commits": [pb.CommitOp(sequence_id=1, block_ids=[7], token_ids=PROMPT[:16])]},
        ),
        (code.NOT_FOUND, "not live", {"grows": [pb.GrowOp(sequence_id=42, num_tokens=1)]}),
        (code.RESOURCE_EXHAUSTED, "blocks", {"grows": [pb.GrowOp(sequence_id=1, num_tokens=4000)]}),
    ]
    for status, text, ops in cases:
        await expect(status, step(blockd, pool, **ops), env=blockd, text=text)
    await expect(code.NOT_FOUND, blockd.workers.Step(pb.StepRequest(pool_id="nope", epoch=1)), env=blockd)
    await expect(code.INVALID_ARGUMENT, blockd.workers.Step(pb.StepRequest(epoch=1)), env=blockd)
    await expect(
        code.FAILED_PRECONDITION,
        blockd.workers.Step(pb.StepRequest(pool_id=pool.pool_id, epoch=pool.epoch + 1)),
        env=blockd,
    )
    await expect(
        code.NOT_FOUND, blockd.workers.RenewLease(pb.RenewLeaseRequest(pool_id="nope", epoch=1)), env=blockd
    )
    await expect(
        code.INVALID_ARGUMENT,
        blockd.workers.Resync(
            pb.ResyncRequest(
                pool_id=pool.pool_id,
                epoch=pool.epoch,
                sequences=[pb.ResyncSequence(sequence_id=1, block_ids=[99], token_ids=[1])],
            )
        ),
        env=blockd,
        text="outside",
    )
    # still serving, and the sequence is intact
    reply = await step(blockd, pool, releases=[pb.ReleaseOp(sequence_id=1)])
    assert reply.num_free_blocks == 8


async def test_stale_epoch_after_reregister(blockd):
    pool = await register(blockd, pool_id="w-1")
    await register(blockd, pool_id="w-1", pool_token=pool.pool_token)
    await expect(
        grpc.StatusCode.FAILED_PRECONDITION,
        blockd.workers.RenewLease(pb.RenewLeaseRequest(pool_id="w-1", epoch=pool.epoch)),
        env=blockd,
        text="stale",
    )


async def test_admin_auth(blockd):
    requests = [
        (blockd.admin.GetStats, pb.GetStatsRequest()),
        (blockd.admin.ListPools, pb.ListPoolsRequest()),
        (blockd.admin.ListBlocks, pb.ListBlocksRequest()),
        (blockd.admin.Lookup, pb.LookupRequest(token_ids=[1])),
        (blockd.admin.Flush, pb.FlushRequest()),
        (blockd.admin.Pin, pb.PinRequest(token_ids=[1])),
        (blockd.admin.Unpin, pb.UnpinRequest(pin_id="x")),
    ]
    for method, request in requests:
        await expect(grpc.StatusCode.UNAUTHENTICATED, method(request), env=blockd, text="Bearer")
        await expect(
            grpc.StatusCode.PERMISSION_DENIED,
            method(request, metadata=(("authorization", "Bearer wrong"),)),
            env=blockd,
        )
        await expect(
            grpc.StatusCode.UNAUTHENTICATED,
            method(request, metadata=(("authorization", ADMIN_TOKEN),)),
            env=blockd,
        )
    for metadata, status in (
        (None, grpc.StatusCode.UNAUTHENTICATED),
        ((("authorization", "Bearer nope"),), grpc.StatusCode.PERMISSION_DENIED),
    ):
        call = blockd.admin.WatchEvents(pb.WatchEventsRequest(), metadata=metadata)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
        assert info.value.code() == status


async def test_bad_admin_calls(blockd):
    code = grpc.StatusCode
    await expect(code.INVALID_ARGUMENT, blockd.admin.Lookup(pb.LookupRequest(), metadata=AUTH), env=blockd)
    await expect(
        code.INVALID_ARGUMENT,
        blockd.admin.Pin(pb.PinRequest(token_ids=[1], ttl_seconds=-1), metadata=AUTH),
        env=blockd,
    )
    await expect(
        code.NOT_FOUND, blockd.admin.Unpin(pb.UnpinRequest(pin_id="pin-x"), metadata=AUTH), env=blockd
    )
    await expect(
        code.NOT_FOUND, blockd.admin.GetStats(pb.GetStatsRequest(pool_id="nope"), metadata=AUTH), env=blockd
    )
    await expect(
        code.INVALID_ARGUMENT,
        blockd.admin.ListBlocks(pb.ListBlocksRequest(page_token="%%%"), metadata=AUTH),
        env=blockd,
    )
    await expect(code.INVALID_ARGUMENT, blockd.routing.Route(pb.RouteRequest()), env=blockd)


async def test_admin_calls_need_no_token_when_none_is_configured():
    env = await start_inprocess(BlockdConfig(listen="127.0.0.1:0"))
    try:
        reply = await env.admin.GetStats(pb.GetStatsRequest())
        assert reply.total.num_blocks == 0
    finally:
        await env.channel.close()
        await env.server.stop(0)


class BrokenDirectory(BlockDirectory):
    def lookup(self, *args, **kwargs):
        raise ZeroDivisionError("simulated bug")


async def test_unexpected_errors_are_internal_and_blockd_keeps_serving():
    env = await start_inprocess(make_config(), BrokenDirectory(DirectoryConfig()))
    try:
        await expect(
            grpc.StatusCode.INTERNAL,
            env.admin.Lookup(pb.LookupRequest(token_ids=[1]), metadata=AUTH),
            env=env,
            text="ZeroDivisionError: simulated bug",
        )
        assert (await register(env)).pool_id
    finally:
        await env.channel.close()
        await env.server.stop(0)


async def test_each_registration_and_only_a_registration_calls_the_servers_hook():
    """`serve` freezes the collector's heap there (blockd.server._tune_gc)."""
    calls: list[int] = []
    env = await start_inprocess(make_config(), on_pool_registered=lambda: calls.append(1))
    try:
        first = await register(env)
        await step(env, first, admits=[pb.AdmitOp(sequence_id=1, token_ids=PROMPT)])
        assert len(calls) == 1
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await register(env, num_blocks=0)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(calls) == 1  # a refused registration changes nothing
        await register(env, block_size=32)
        assert len(calls) == 2
    finally:
        await env.channel.close()
        await env.server.stop(0)


async def test_lease_expiry_task_drops_a_silent_pool():
    env = await start_inprocess(make_config(lease_ttl_seconds=0.4))
    try:
        pool = await register(env)
        await step(env, pool, admits=[pb.AdmitOp(sequence_id=1, token_ids=PROMPT)])
        for _ in range(50):
            await asyncio.sleep(0.1)
            pools = (await env.admin.ListPools(pb.ListPoolsRequest(), metadata=AUTH)).pools
            if not pools[0].is_live:
                break
        assert not pools[0].is_live and pools[0].stats.num_referenced_blocks == 0
        await expect(grpc.StatusCode.FAILED_PRECONDITION, step(env, pool), env=env, text="lapsed")
    finally:
        await env.channel.close()
        await env.server.stop(0)


async def test_metrics_endpoint_counts_tokens():
    config = BlockdConfig(listen="127.0.0.1:0", metrics_port=0)
    env = await start_inprocess(config)
    try:
        pool = await register(env)
        await step(env, pool, admits=[pb.AdmitOp(sequence_id=1, token_ids=PROMPT)])
        url = f"http://{env.server.metrics_address}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
        label = f'pool_id="{pool.pool_id}"'
        assert f"kvcache_prefix_cache_queries_total{{{label}}} 40.0" in body
        assert f"kvcache_prefix_cache_hits_total{{{label}}} 0.0" in body
        assert f"kvcache_referenced_blocks{{{label}}} 3.0" in body
        assert f"kvcache_free_blocks{{{label}}} 61.0" in body
        assert "kvcache_admissions_total" in body and "kvcache_evictions_total" in body
        assert f'kvcache_prefix_cache_misses_total{{{label},reason="never_seen"}} 32.0' in body
        assert f'kvcache_prefix_cache_misses_total{{{label},reason="partial_block"}} 8.0' in body
        assert f"kvcache_ghosts{{{label}}} 0.0" in body
    finally:
        await env.channel.close()
        await env.server.stop(0)


# ---------------------------------------------------------------- retention (issue 14)


async def _cache(
    env: Blockd, pool: pb.RegisterPoolResponse, sequence_id: int, tokens: list[int], **admit
) -> None:
    """Admit, commit every full block, release."""
    result = (
        await step(env, pool, admits=[pb.AdmitOp(sequence_id=sequence_id, token_ids=tokens, **admit)])
    ).admits[0]
    first, last = result.num_cached_tokens // 16, len(tokens) // 16
    commits = [
        pb.CommitOp(
            sequence_id=sequence_id,
            block_ids=result.block_ids[first:last],
            token_ids=tokens[first * 16 : last * 16],
        )
    ]
    await step(
        env, pool, commits=commits if last > first else [], releases=[pb.ReleaseOp(sequence_id=sequence_id)]
    )


async def test_miss_reasons_in_stats_and_explain_miss(blockd):
    pool = await register(blockd)
    await _cache(blockd, pool, 1, PROMPT)  # 32 never seen + 8 partial
    await _cache(blockd, pool, 2, PROMPT, cache_salt="tenant")  # the same tokens under a salt
    stats = (await blockd.stats()).total
    assert {pb.MissReason.Name(m.reason): m.num_tokens for m in stats.miss_tokens} == {
        "MISS_REASON_NEVER_SEEN": 32,
        "MISS_REASON_PARTIAL_BLOCK": 16,
        "MISS_REASON_OTHER_SALT": 32,
    }
    assert stats.eviction_policy == "adaptive" and stats.max_ghosts == 128
    await blockd.admin.Flush(pb.FlushRequest(cache_salt="tenant"), metadata=AUTH)
    why = await blockd.admin.ExplainMiss(
        pb.ExplainMissRequest(token_ids=PROMPT, cache_salt="tenant"), metadata=AUTH
    )
    (pool_why,) = why.pools
    assert why.num_tokens == 40 and pool_why.num_cached_tokens == 0
    assert pool_why.reason == pb.MISS_REASON_FLUSHED and pool_why.evicted_by == "flush"
    assert (pool_why.num_missed_tokens, pool_why.num_partial_tokens, pool_why.first_missing_block) == (
        32,
        8,
        0,
    )
    other = await blockd.workers.RegisterPool(
        pb.RegisterPoolRequest(
            num_blocks=64, block_size=16, namespace=pb.Namespace(model_id="other"), worker_address="w:2"
        )
    )
    await _cache(blockd, other, 1, list(range(5000, 5032)))
    why = await blockd.admin.ExplainMiss(
        pb.ExplainMissRequest(token_ids=list(range(5000, 5032)), pool_id=pool.pool_id), metadata=AUTH
    )
    assert why.pools[0].reason == pb.MISS_REASON_OTHER_NAMESPACE
    assert list(why.pools[0].other_pool_ids) == [other.pool_id]


async def test_cache_policy_and_retention_priority_travel_in_admit_ops(blockd):
    pool = await register(blockd)
    await _cache(blockd, pool, 1, PROMPT, cache_policy=cache_pb.CACHE_POLICY_READ_ONLY, retention_priority=90)
    lookup = await blockd.admin.Lookup(pb.LookupRequest(token_ids=PROMPT), metadata=AUTH)
    assert lookup.matches[0].num_cached_tokens == 0  # read-only: nothing indexed
    await expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        step(blockd, pool, admits=[pb.AdmitOp(sequence_id=2, token_ids=PROMPT, retention_priority=101)]),
        env=blockd,
        text="retention_priority must be 1 .. 100",
    )
    await expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        step(blockd, pool, admits=[pb.AdmitOp(sequence_id=2, token_ids=PROMPT, cache_policy=7)]),
        env=blockd,
        text="cache_policy 7 is not one of",
    )


async def test_pin_not_cached_budget_and_unpin_all(blockd):
    pool = await register(blockd, num_blocks=8)
    empty = await blockd.admin.Pin(pb.PinRequest(token_ids=PROMPT), metadata=AUTH)
    assert (empty.num_pinned_tokens, empty.num_pinned_blocks) == (0, 0)  # kvctl says why
    await blockd.admin.Unpin(pb.UnpinRequest(pin_id=empty.pin_id), metadata=AUTH)
    long_prompt = list(range(2000, 2080))  # 5 blocks: past the budget of 4 (50% of 8)
    await _cache(blockd, pool, 1, long_prompt)
    await expect(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        blockd.admin.Pin(pb.PinRequest(token_ids=long_prompt), metadata=AUTH),
        env=blockd,
        text="past its pin budget of 4",
    )
    await blockd.admin.Pin(pb.PinRequest(token_ids=long_prompt[:32]), metadata=AUTH)
    await blockd.admin.Pin(pb.PinRequest(token_ids=long_prompt[:48]), metadata=AUTH)
    unpinned = await blockd.admin.Unpin(pb.UnpinRequest(all=True), metadata=AUTH)
    assert (unpinned.num_unpinned_pins, unpinned.num_unpinned_blocks) == (2, 5)
    assert (await blockd.stats()).total.num_pinned_blocks == 0
    await expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        blockd.admin.Unpin(pb.UnpinRequest(pin_id="pin-1", all=True), metadata=AUTH),
        env=blockd,
        text="either pin_id or all",
    )
