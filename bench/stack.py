"""Both real daemons for one benchmark: blockd + computed (metrics on), stopped in `finally`.

    with Stack(workdir, "--max-num-batched-tokens", "8192", threads=1) as stack:
        stack.computed_address, stack.metrics()["computed_prefill_tokens_total"]

computed is started with `--metrics-port 0 --log-format json`; the port it bound is
read from its `metrics_serving` log line. `metrics()` scrapes the Prometheus text
and answers {sample name: value} for unlabelled samples.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client.parser import text_string_to_metric_families

from clients.spawn import Daemon, start_blockd, start_computed

if TYPE_CHECKING:
    from typing import Self


class Stack:
    """A blockd and one computed on free loopback ports. Invariant: after __exit__
    neither process is running (SIGTERM, then SIGKILL after the grace)."""

    def __init__(
        self, workdir: Path, *computed_args: str, model: str | Path | None = None, threads: int | None = None
    ) -> None:
        self.workdir = workdir
        # torch intra-op threads of computed (OMP_NUM_THREADS); None: torch's default.
        self.env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)} if threads else None
        self.computed_args = computed_args
        self.model = model
        self.blockd: Daemon | None = None
        self.computed: Daemon | None = None
        self.metrics_port: int | None = None

    def __enter__(self) -> Self:
        try:
            self.blockd = start_blockd(self.workdir, "--log-format", "json", "--lease-ttl", "60")
            self.computed = start_computed(
                self.workdir,
                self.blockd.address,
                "--metrics-port",
                "0",
                "--log-format",
                "json",
                *self.computed_args,
                model=self.model,
                env=self.env,
            )
            self.metrics_port = read_metrics_port(self.computed)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for daemon in (self.computed, self.blockd):  # computed first: it releases to blockd
            if daemon is not None:
                daemon.stop(timeout=30.0)

    @property
    def computed_address(self) -> str:
        assert self.computed is not None, "stack not started"
        return self.computed.address

    @property
    def blockd_address(self) -> str:
        assert self.blockd is not None, "stack not started"
        return self.blockd.address

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of computed's /metrics, e.g. computed_prefill_tokens_total."""
        assert self.metrics_port is not None, "stack not started"
        return scrape_metrics(self.metrics_port)


def scrape_metrics(port: int) -> dict[str, float]:
    """Unlabelled samples of the /metrics on loopback `port`: {sample name: value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }


def read_metrics_port(computed: Daemon, timeout: float = 30.0) -> int:
    """The port a computed started with `--metrics-port 0 --log-format json` bound, from
    its `metrics_serving` log line."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in computed.log().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("event") == "metrics_serving":
                return int(record["port"])
        time.sleep(0.05)
    raise RuntimeError(f"computed logged no metrics_serving line:\n{computed.log()[-2000:]}")
