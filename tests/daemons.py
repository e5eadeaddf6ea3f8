"""The daemon spawner for tests: a re-export of `clients.spawn`, where it lives so that
the benchmarks and the stack runner start daemons the same way without importing tests.

    blockd = start_blockd(tmp_path, "--admin-token", "t")        # free port, waits for SERVING
    computed = start_computed(tmp_path, blockd.address, model=MODEL)
"""

from __future__ import annotations

from clients.spawn import (
    REPO,
    Daemon,
    DaemonExited,
    DaemonTimeout,
    spawn,
    start_blockd,
    start_computed,
    start_gateway,
    wait_serving,
)

__all__ = [
    "REPO",
    "Daemon",
    "DaemonExited",
    "DaemonTimeout",
    "spawn",
    "start_blockd",
    "start_computed",
    "start_gateway",
    "wait_serving",
]
