"""The asyncio Python client against live blockd + computed."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from clients.aio_client import AsyncBlockdClient, AsyncKVCacheClient
from clients.errors import KVCacheError
from clients.options import ClientOptions, RetryPolicy
from tests.clients.conftest import ADMIN_TOKEN, LiveStack, dead_address, unique_prompt

OPTIONS = ClientOptions(admin_token=ADMIN_TOKEN, generate_timeout=120.0)


async def test_streams_then_hits_the_cache(live: LiveStack) -> None:
    async with AsyncKVCacheClient(live.blockd.address, live.computed.address, options=OPTIONS) as client:
        prompt = unique_prompt("asyncio")
        stream = client.generate(prompt, max_tokens=4, ignore_eos=True)
        chunks = [chunk async for chunk in stream]
        assert chunks[-1].is_last and chunks[-1].usage is not None
        assert chunks[-1].usage.cached_tokens == 0
        assert sum(len(c.token_ids) for c in chunks) == 4
        assert stream.worker_address == live.computed.address
        again = await client.complete(prompt, max_tokens=4, ignore_eos=True)
        assert again.usage.cached_tokens > 0
        assert again.text == "".join(c.text for c in chunks)
        stats = await client.blockd.get_stats()
        assert stats.total.hit_tokens >= again.usage.cached_tokens
        token_ids = await client.computed().tokenize(prompt)
        matches = await client.blockd.lookup(token_ids)
        assert matches[0].num_cached_tokens > 0
        assert len(await client.blockd.list_blocks(page_size=5)) >= 1


async def test_concurrent_requests_all_finish(live: LiveStack) -> None:
    async with AsyncKVCacheClient(live.blockd.address, live.computed.address, options=OPTIONS) as client:
        system = unique_prompt("concurrency")
        questions = ["one?", "two?", "three?", "four?"]
        results = await asyncio.gather(
            *(client.complete(messages=[("system", system), ("user", q)], max_tokens=3) for q in questions)
        )
        assert all(r.usage.completion_tokens >= 1 for r in results)
        assert len({r.request_id for r in results}) == len(questions)


async def test_cancelling_a_stream_leaves_the_worker_serving(live: LiveStack) -> None:
    async with AsyncKVCacheClient(live.blockd.address, live.computed.address, options=OPTIONS) as client:
        stream = client.generate(unique_prompt("cancel"), max_tokens=200, ignore_eos=True)
        first = await stream.__anext__()
        assert first.request_id
        await stream.cancel()
        done = await client.complete(unique_prompt("after cancel"), max_tokens=2)
        assert done.usage.completion_tokens >= 1


async def test_errors_are_typed(live: LiveStack) -> None:
    address = dead_address()
    async with AsyncBlockdClient(address, ClientOptions(retry=RetryPolicy(max_attempts=2))) as blockd:
        with pytest.raises(KVCacheError) as error:
            await blockd.get_stats()
    assert str(error.value) == f"blockd at {address} is unreachable (UNAVAILABLE)"
    async with AsyncBlockdClient(live.blockd.address) as anonymous:
        with pytest.raises(KVCacheError) as denied:
            await anonymous.flush()
        assert denied.value.code is grpc.StatusCode.UNAUTHENTICATED
