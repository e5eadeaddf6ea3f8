"""Tenant isolation of the cache and cache-aware routing, live."""

from __future__ import annotations

import json
import time

import openai

from tests.gateway.conftest import KEY_A, KEY_B, MODEL, GatewayStack, dead_address, http, unique_prompt


def _cached(client: openai.OpenAI, prompt: str) -> int:
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    return reply.usage.prompt_tokens_details.cached_tokens


def test_tenant_b_never_gets_tenant_a_cached_tokens(gw: GatewayStack) -> None:
    a, b = gw.client(KEY_A), gw.client(KEY_B)
    prompt = unique_prompt("tenants")
    assert _cached(a, prompt) == 0
    assert _cached(a, prompt) > 0  # A's own repeat hits
    assert _cached(b, prompt) == 0  # the same text from B: none of A's blocks
    assert _cached(b, prompt) > 0  # B's own repeat hits its own blocks


def test_caller_cannot_pick_a_salt(gw: GatewayStack) -> None:
    body = {"model": MODEL, "prompt": "import ", "max_tokens": 2, "cache_salt": "tenant:8:tenant-a"}
    status, _, text = http(
        gw.gateway.address, "POST", "/v1/completions", body, {"Authorization": f"Bearer {KEY_B}"}
    )
    assert status == 400 and json.loads(text)["error"]["param"] == "cache_salt"


def test_public_prefix_is_shared_and_the_rest_is_not(gw: GatewayStack, open_gateway) -> None:
    keys = gw.workdir / "keys.txt"
    keys.write_text("# key=tenant\nk-one=one\nk-two=two\n")
    gateway = open_gateway(
        [w.address for w in gw.workers],
        "--api-keys-file",
        str(keys),
        "--public-prefix-tokens",
        "32",
        blockd=gw.blockd.address,
    )
    one, two = (
        openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key=k, max_retries=0)
        for k in ("k-one", "k-two")
    )
    prompt = unique_prompt("public")
    assert _cached(one, prompt) == 0
    assert _cached(two, prompt) == 32  # the two public blocks, nothing of one's private blocks
    assert _cached(two, prompt) > 32  # its own private blocks now


def _metric(address: str, name: str) -> float:
    for line in http(address, "GET", "/metrics")[2].splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{") and line.split()[0] == name:
            return float(line.split()[-1])
    return 0.0


def _routed(address: str) -> float:
    return _metric(address, 'gateway_routing_decisions_total{decision="routed"}')


def _answers(address: str) -> tuple[float, float]:
    """(routed requests the directory mirror answered, those blockd's Route answered)."""
    return (
        _metric(address, 'gateway_route_answers_total{source="mirror"}'),
        _metric(address, 'gateway_route_answers_total{source="route"}'),
    )


def _wait_mirror_synced(address: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while _metric(address, "gateway_directory_mirror_synced") != 1.0:
        assert time.monotonic() < deadline, "the gateway's directory mirror never synced"
        time.sleep(0.05)


def test_every_repeat_hits_across_two_workers(gw: GatewayStack) -> None:
    """Three prompt families over two workers: round robin would send each repeat to the
    other worker. The gateway's mirror of blockd's index places every one (no Route call)."""
    _wait_mirror_synced(gw.gateway.address)
    client = gw.client()
    before, (mirror, route) = _routed(gw.gateway.address), _answers(gw.gateway.address)
    prompts = [unique_prompt(f"family {i}") for i in range(3)]
    for prompt in prompts:
        _cached(client, prompt)
    for prompt in prompts:
        assert _cached(client, prompt) >= 32
    assert _routed(gw.gateway.address) == before + 6
    assert _answers(gw.gateway.address) == (mirror + 6, route)


def test_without_the_mirror_route_places_every_request(gw: GatewayStack, open_gateway) -> None:
    gateway = open_gateway([w.address for w in gw.workers], "--no-mirror", blockd=gw.blockd.address)
    client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="-", max_retries=0)
    prompts = [unique_prompt(f"no mirror {i}") for i in range(2)]
    for prompt in prompts + prompts:
        _cached(client, prompt)
    assert [_cached(client, p) >= 32 for p in prompts] == [True, True]
    assert _answers(gateway.address) == (0.0, 6.0)
    assert _metric(gateway.address, "gateway_directory_mirror_synced") == 0.0


def test_the_mirror_places_each_tenant_by_its_own_blocks(gw: GatewayStack) -> None:
    """The mirror places both tenants' requests: A's repeat finds A's blocks, B's first request
    (the same text) none of them, B's repeat its own. (What the mirror counts for each salt is
    compared with blockd's Route in test_mirror.py.)"""
    _wait_mirror_synced(gw.gateway.address)
    a, b = gw.client(KEY_A), gw.client(KEY_B)
    prompt = unique_prompt("tenant placement")
    mirror, route = _answers(gw.gateway.address)
    assert _cached(a, prompt) == 0
    assert _cached(a, prompt) > 0
    assert _cached(b, prompt) == 0
    assert _cached(b, prompt) > 0
    assert _answers(gw.gateway.address) == (mirror + 4, route)


def test_without_blockd_it_serves_least_loaded(gw: GatewayStack, open_gateway) -> None:
    gateway = open_gateway([w.address for w in gw.workers], blockd=dead_address())
    client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="-", max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": unique_prompt()}], max_tokens=3
    )
    assert reply.usage.completion_tokens == 3
    metrics = http(gateway.address, "GET", "/metrics")[2]
    assert 'gateway_routing_decisions_total{decision="least_loaded"} 1.0' in metrics


def test_a_dead_worker_is_skipped(gw: GatewayStack, open_gateway) -> None:
    gateway = open_gateway([dead_address(), gw.workers[0].address], blockd=gw.blockd.address)
    client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="-", max_retries=0)
    for _ in range(3):
        reply = client.completions.create(model=MODEL, prompt=unique_prompt(), max_tokens=2)
        assert reply.usage.completion_tokens == 2
