"""Shared pieces of the scale-out tests: the live stack, idleness, metrics scraping."""

from __future__ import annotations

import json
import random
import time
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from clients.client import BlockdClient
from clients.spawn import Daemon

BLOCK_SIZE = 16
POOL_BLOCKS = 9
VOCAB = range(3, 4000)  # ordinary token ids of the built-in model (0..2 are BOS, EOS, PAD)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@dataclass
class Stack:
    """blockd plus two workers; pool ids are looked up (once) by worker address."""

    blockd: Daemon
    worker_a: Daemon
    worker_b: Daemon
    _pool_ids: dict[str, str] = field(default_factory=dict)

    @property
    def workers(self) -> tuple[Daemon, Daemon]:
        return self.worker_a, self.worker_b

    @property
    def worker_addresses(self) -> list[str]:
        return [w.address for w in self.workers]

    def client(self) -> BlockdClient:
        return BlockdClient(self.blockd.address)

    def pool_id(self, worker: Daemon) -> str:
        if not self._pool_ids:
            with self.client() as client:
                self._pool_ids = {p.worker_address: p.pool_id for p in client.list_pools() if p.is_live}
        return self._pool_ids[worker.address]

    def wait_idle(self, timeout: float = 15.0) -> None:
        """Until no worker pool holds a sequence: every finished request's references are
        released (computed ships the release in the step after the last token)."""
        pools = {self.pool_id(w) for w in self.workers}
        deadline = time.monotonic() + timeout
        with self.client() as client:
            while True:
                busy = [p for p in client.get_stats().pools if p.pool_id in pools and p.num_sequences]
                if not busy:
                    return
                assert time.monotonic() < deadline, f"workers still hold sequences: {busy}"
                time.sleep(0.005)


def logged_event(daemon: Daemon, event: str, timeout: float = 10.0) -> dict:
    """The first JSON log line of `daemon` whose "event" is `event`."""
    deadline = time.monotonic() + timeout
    while True:
        for line in daemon.log().splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                if record.get("event") == event:
                    return record
        assert time.monotonic() < deadline, f"{daemon.name} never logged {event!r}:\n{daemon.log()}"
        time.sleep(0.05)


def blockd_metrics_url(blockd: Daemon) -> str:
    """blockd logs its metrics endpoint as host:port in the "serving" line."""
    address = logged_event(blockd, "serving")["metrics"]
    assert address, f"blockd serves no metrics endpoint:\n{blockd.log()}"
    return f"http://{address}/metrics"


def computed_metrics_url(worker: Daemon) -> str:
    """computed logs its metrics port in a "metrics_serving" line (it binds 127.0.0.1)."""
    return f"http://127.0.0.1:{logged_event(worker, 'metrics_serving')['port']}/metrics"


def scrape(url: str) -> Samples:
    """Every sample of a Prometheus text exposition: (sample name, labels) -> value."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name, frozenset(sample.labels.items())] = sample.value
    return samples


def sample(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value; 0 when absent (a labelled counter that has not counted yet)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def labelled(samples: Samples, name: str, label: str) -> dict[str, float]:
    """label value -> sample value for every sample of `name` (single-label metrics)."""
    return {dict(labels)[label]: value for (n, labels), value in samples.items() if n == name}


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.choice(VOCAB) for _ in range(n)]
