"""The compute thread: one OS thread for every call, blocking or awaited, in order."""

from __future__ import annotations

import asyncio
import threading

from computed.compute_thread import ComputeThread


def test_calls_and_runs_share_one_thread_in_order() -> None:
    compute = ComputeThread()
    seen: list[tuple[str, int]] = []
    try:
        compute.call(lambda: seen.append(("call", threading.get_ident())))

        async def runs() -> None:
            await asyncio.gather(
                *(compute.run(lambda i=i: seen.append((f"run{i}", threading.get_ident()))) for i in range(3))
            )

        asyncio.run(runs())
    finally:
        compute.shutdown()
    assert [name for name, _ in seen] == ["call", "run0", "run1", "run2"]
    threads = {ident for _, ident in seen}
    assert len(threads) == 1 and threading.get_ident() not in threads
