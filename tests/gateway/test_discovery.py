"""The gateway learns its workers from blockd's pools, and counts a dead one out within seconds."""

from __future__ import annotations

import json
import time

import openai

from gateway.discovery import live_worker_addresses
from kvcache.v1 import directory_pb2 as pb
from tests.daemons import start_computed
from tests.gateway.conftest import MODEL, GatewayStack, http, unique_prompt


def test_live_worker_addresses_skip_lapsed_and_anonymous_pools() -> None:
    pools = [
        pb.PoolInfo(pool_id="a", worker_address="localhost:7001", is_live=True),
        pb.PoolInfo(pool_id="b", worker_address="10.0.0.2:7001", is_live=False),  # lease lapsed
        pb.PoolInfo(pool_id="c", worker_address="", is_live=True),  # announces no address
        pb.PoolInfo(pool_id="d", worker_address="127.0.0.1:7001", is_live=True),  # "a" spelt otherwise
        pb.PoolInfo(pool_id="e", worker_address="10.0.0.3:7001", is_live=True),
    ]
    assert live_worker_addresses(pools) == ("127.0.0.1:7001", "10.0.0.3:7001")


def _health(address: str) -> dict:
    return json.loads(http(address, "GET", "/health")[2])


def _wait_health(address: str, workers_up: int, timeout: float) -> float:
    """Seconds until /health counts `workers_up` workers up (fails after `timeout`)."""
    start = time.monotonic()
    while (health := _health(address))["workers_up"] != workers_up:
        assert time.monotonic() - start < timeout, f"after {timeout} s /health still says {health}"
        time.sleep(0.1)
    return time.monotonic() - start


def test_workers_come_from_blockd_and_a_dead_one_leaves_health(gw: GatewayStack, open_gateway) -> None:
    gateway = open_gateway([], blockd=gw.blockd.address)  # no --computed: every worker from blockd
    _wait_health(gateway.address, len(gw.workers), timeout=10)
    client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="-", max_retries=0)
    assert (
        client.completions.create(model=MODEL, prompt=unique_prompt(), max_tokens=2).usage.completion_tokens
        == 2
    )

    extra = start_computed(gw.workdir, gw.blockd.address, "--log-format", "json", name="computed-scaled")
    try:
        _wait_health(gateway.address, len(gw.workers) + 1, timeout=10)  # scaled up: no restart
        assert "worker discovered" in gateway.log()
        extra.kill()  # no goodbye: the lease is still live at blockd
        seconds = _wait_health(gateway.address, len(gw.workers), timeout=5)
        assert seconds < 5, seconds
    finally:
        extra.stop()
    reply = client.completions.create(model=MODEL, prompt=unique_prompt(), max_tokens=2)
    assert reply.usage.completion_tokens == 2  # the dead worker is skipped
