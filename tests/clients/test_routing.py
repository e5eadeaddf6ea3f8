"""Routing among two computed workers: cache-aware (blockd's Route) versus round robin."""

from __future__ import annotations

import pytest

from clients.aio_client import AsyncKVCacheClient
from clients.client import KVCacheClient
from clients.options import ClientOptions, RetryPolicy
from tests.clients.conftest import dead_address, model_args, unique_prompt
from tests.daemons import start_blockd, start_computed

FAST_FAIL = ClientOptions(retry=RetryPolicy(max_attempts=2, initial_backoff=0.05), generate_timeout=120.0)


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("routing")
    model = model_args(workdir)
    blockd = start_blockd(workdir)
    daemons = [blockd]
    try:
        for name in ("computed-a", "computed-b"):
            daemons.append(start_computed(workdir, blockd.address, model=model, name=name))
        yield blockd.address, [d.address for d in daemons[1:]]
    finally:
        for daemon in reversed(daemons):
            daemon.stop()


def test_cache_aware_sends_a_repeat_to_the_worker_that_has_it(two_workers) -> None:
    blockd, workers = two_workers
    with KVCacheClient(blockd, workers, routing="cache-aware", options=FAST_FAIL) as client:
        for i in range(3):
            prompt = unique_prompt(f"routing {i}")
            first = client.complete(prompt, max_tokens=2)
            repeat = client.complete(prompt, max_tokens=2)
            assert repeat.worker_address == first.worker_address
            assert repeat.usage.cached_tokens > 0
        assert client.num_routed == 6 and client.num_round_robin == 0


def test_round_robin_alternates_and_misses_the_other_workers_cache(two_workers) -> None:
    blockd, workers = two_workers
    with KVCacheClient(blockd, workers, routing="round-robin", options=FAST_FAIL) as client:
        prompt = unique_prompt("round robin")
        first = client.complete(prompt, max_tokens=2)
        repeat = client.complete(prompt, max_tokens=2)
        assert {first.worker_address, repeat.worker_address} == set(workers)
        assert repeat.usage.cached_tokens == 0  # the prefix lives in the other worker's pool
        assert client.num_round_robin == 2 and client.num_routed == 0


def test_falls_back_to_round_robin_when_blockd_is_unreachable(two_workers) -> None:
    _, workers = two_workers
    with KVCacheClient(dead_address(), workers, routing="cache-aware", options=FAST_FAIL) as client:
        results = [client.complete(unique_prompt("fallback"), max_tokens=2) for _ in range(2)]
        assert {r.worker_address for r in results} == set(workers)
        assert client.num_round_robin == 2 and client.num_routed == 0


def test_skips_an_unreachable_worker(two_workers) -> None:
    blockd, workers = two_workers
    addresses = [dead_address(), workers[0]]
    with KVCacheClient(blockd, addresses, routing="round-robin", options=FAST_FAIL) as client:
        results = [client.complete(unique_prompt("failover"), max_tokens=2) for _ in range(2)]
        assert [r.worker_address for r in results] == [workers[0], workers[0]]


async def test_async_client_routes_too(two_workers) -> None:
    blockd, workers = two_workers
    async with AsyncKVCacheClient(blockd, workers, options=FAST_FAIL) as client:
        prompt = unique_prompt("async routing")
        first = await client.complete(prompt, max_tokens=2)
        repeat = await client.complete(prompt, max_tokens=2)
        assert repeat.worker_address == first.worker_address and repeat.usage.cached_tokens > 0
        assert client.num_routed == 2
