"""A live stack for the gateway tests: blockd, two computed workers and the gateway in front.

Started once per session. The gateway requires API keys (two tenants, given through
GATEWAY_API_KEYS as an operator would); `open_gateway` starts more gateways with other
flags (dead workers, tiny limits) for the error rows. Every test uses prompts of its
own (`unique_prompt`) so that tests do not see each other's cached blocks.
"""

from __future__ import annotations

import http.client as httplib
import json
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from openai import AsyncOpenAI, OpenAI

from clients.client import BlockdClient
from clients.types import PoolStats
from tests.daemons import Daemon, start_blockd, start_computed, start_gateway

KEY_A, KEY_B = "key-tenant-a", "key-tenant-b"
MODEL = "default_model"


def unique_prompt(topic: str = "caching") -> str:
    """A prompt several KV blocks long whose first block no other test shares."""
    run = uuid.uuid4().hex[:12]
    return (
        f"# run {run}\n# A note about {topic}: the key and value tensors of a prefix depend only on "
        f"that prefix, so they are computed once, kept in fixed-size blocks, and found again by "
        f"content when the next request starts the same way.\ndef lookup(table, key):\n    return "
    )


def http(
    address: str, method: str, path: str, body: object = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], str]:
    """One raw HTTP exchange with a gateway: (status, headers, body text)."""
    connection = httplib.HTTPConnection(address, timeout=60)
    try:
        payload = body if isinstance(body, (str, bytes)) or body is None else json.dumps(body)
        connection.request(
            method, path, body=payload, headers={"Content-Type": "application/json", **(headers or {})}
        )
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read().decode()
    finally:
        connection.close()


@dataclass
class GatewayStack:
    blockd: Daemon
    workers: list[Daemon]
    gateway: Daemon
    workdir: Path

    @property
    def base_url(self) -> str:
        return f"http://{self.gateway.address}/v1"

    def client(self, key: str = KEY_A, **kwargs: object) -> OpenAI:
        return OpenAI(base_url=self.base_url, api_key=key, max_retries=0, **kwargs)

    def aclient(self, key: str = KEY_A, **kwargs: object) -> AsyncOpenAI:
        return AsyncOpenAI(base_url=self.base_url, api_key=key, max_retries=0, **kwargs)

    def stats(self) -> PoolStats:
        with BlockdClient(self.blockd.address) as blockd:
            return blockd.get_stats().total

    def wait_idle(self, timeout: float = 10.0) -> PoolStats:
        """blockd's totals once no sequence holds a block (or the last seen after `timeout` s)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if (stats.num_sequences == 0 and stats.num_referenced_blocks == stats.num_pinned_blocks) or (
                time.monotonic() > deadline
            ):
                return stats
            time.sleep(0.05)


@pytest.fixture(scope="session")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayStack]:
    workdir = tmp_path_factory.mktemp("gateway")
    blockd = start_blockd(workdir, "--log-format", "json")
    daemons = [blockd]
    try:
        with ThreadPoolExecutor(2) as pool:  # a worker takes seconds to start: start both at once
            futures = [
                pool.submit(start_computed, workdir, blockd.address, "--log-format", "json", name=name)
                for name in ("computed-a", "computed-b")
            ]
            errors = [f.exception() for f in futures]
        workers = [f.result() for f in futures if f.exception() is None]
        daemons += workers
        for error in errors:
            if error is not None:
                raise error
        env = {"GATEWAY_API_KEYS": f"{KEY_A}=tenant-a,{KEY_B}=tenant-b"}
        gateway = start_gateway(workdir, [w.address for w in workers], blockd=blockd.address, env=env)
        daemons.append(gateway)
        yield GatewayStack(blockd, workers, gateway, workdir)
    finally:
        for daemon in reversed(daemons):
            daemon.stop()


@pytest.fixture
def open_gateway(gw: GatewayStack) -> Iterator[Callable[..., Daemon]]:
    """Start another gateway (no keys unless given) with the flags a test needs; stopped after it."""
    started: list[Daemon] = []

    def start(computed: list[str], *args: str, blockd: str | None = None) -> Daemon:
        daemon = start_gateway(gw.workdir, computed, *args, blockd=blockd, name=f"gateway-{len(started)}")
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()


def dead_address() -> str:
    """A loopback address where nothing listens."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"
