"""One live stack for the scale-out tests: blockd and two computed workers of one model.

Both workers load the built-in model, so their pools share a hash namespace and
blockd's answers compare them. Each pool is tiny on purpose (POOL_BLOCKS blocks of
BLOCK_SIZE tokens): it holds two 4-block prompt prefixes plus the tail block of one
request, so a workload of four prompt families only fits in the cache when the
families are spread over both workers, and any wider spread evicts.

The stack is started once per session (both workers at once) and shared by the
files of this folder; every test uses token ids of its own (seeded per test) and
waits for the workers to be idle before it reads blockd's state.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.daemons import start_blockd, start_computed
from tests.scaleout.helpers import BLOCK_SIZE, POOL_BLOCKS, Stack


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("scaleout")
    blockd = start_blockd(workdir, "--metrics-port", "0", "--log-format", "json")
    daemons = [blockd]
    try:
        args = (
            "--metrics-port",
            "0",
            "--num-blocks",
            str(POOL_BLOCKS),
            "--block-size",
            str(BLOCK_SIZE),
            "--log-format",
            "json",
        )
        with ThreadPoolExecutor(2) as pool:  # a worker takes seconds to start: start both at once
            futures = [
                pool.submit(start_computed, workdir, blockd.address, *args, name=name)
                for name in ("computed-a", "computed-b")
            ]
            errors = [future.exception() for future in futures]
        daemons += [future.result() for future in futures if future.exception() is None]
        for error in errors:
            if error is not None:
                raise error
        yield Stack(blockd, daemons[1], daemons[2])
    finally:
        for daemon in reversed(daemons):
            daemon.stop()
