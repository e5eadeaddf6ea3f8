"""Routing among two computed workers: cache-aware (blockd's Route) versus round robin."""

from __future__ import annotations

import pytest

from clients.aio_client import AsyncComputedClient, AsyncKVCacheClient
from clients.client import ComputedClient, KVCacheClient
from clients.options import ClientOptions, RetryPolicy
from clients.requests import Prompt
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


def _spy_prompts(monkeypatch: pytest.MonkeyPatch, cls: type) -> list[Prompt]:
    """Every Prompt that `cls.generate_prompt` sends, in order."""
    sent: list[Prompt] = []
    original = cls.generate_prompt

    def spy(self, prompt: Prompt, params, timeout=None):
        sent.append(prompt)
        return original(self, prompt, params, timeout)

    monkeypatch.setattr(cls, "generate_prompt", spy)
    return sent


def test_a_routed_request_sends_its_token_ids_and_answers_as_text_would(two_workers, monkeypatch) -> None:
    blockd, workers = two_workers
    sent = _spy_prompts(monkeypatch, ComputedClient)
    text = unique_prompt("routed ids")
    chat = [("system", unique_prompt("routed chat")), ("user", "Why?")]
    with KVCacheClient(blockd, workers, options=FAST_FAIL) as client:
        routed = [
            client.complete(text, max_tokens=4, cache_salt="routed"),
            client.complete(messages=chat, max_tokens=4, cache_salt="routed"),
        ]
        assert client.num_routed == 2
        assert [(p.text, p.messages) for p in sent] == [(None, None)] * 2 and all(p.token_ids for p in sent)
        sent.clear()
        direct = [
            client.computed(routed[0].worker_address).complete(text, max_tokens=4, cache_salt="direct"),
            client.computed(routed[1].worker_address).complete(
                messages=chat, max_tokens=4, cache_salt="direct"
            ),
        ]
        assert sent[0].text == text and sent[1].messages is not None  # a plain worker call is unchanged
    for a, b in zip(routed, direct):
        assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)
        assert a.usage.prompt_tokens == b.usage.prompt_tokens


async def test_the_async_client_sends_routed_token_ids_too(two_workers, monkeypatch) -> None:
    blockd, workers = two_workers
    sent = _spy_prompts(monkeypatch, AsyncComputedClient)
    text = unique_prompt("async routed ids")
    async with AsyncKVCacheClient(blockd, workers, options=FAST_FAIL) as client:
        routed = await client.complete(text, max_tokens=4, cache_salt="routed")
        direct = await client.computed(routed.worker_address).complete(
            text, max_tokens=4, cache_salt="direct"
        )
    assert sent[0].text is None and sent[0].token_ids and sent[1].text == text
    assert (routed.text, routed.usage.prompt_tokens) == (direct.text, direct.usage.prompt_tokens)
