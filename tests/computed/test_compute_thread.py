"""The compute thread: one OS thread for every call, blocking or awaited, in order."""

from __future__ import annotations

import asyncio
import threading

from computed.compute_thread import ComputeThread


def test_calls_and_runs_share_one_thread_in_order() -> None:
    compute = ComputeThread(own_thread=True)
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


def test_inline_calls_and_runs_stay_on_the_callers_thread() -> None:
    """Inline: the caller's thread (the event loop's) runs everything, in order, and a call
    from a second thread is refused (it would start a second OpenMP team)."""
    compute = ComputeThread(own_thread=False)
    seen: list[tuple[str, int]] = []
    compute.call(lambda: seen.append(("call", threading.get_ident())))

    async def runs() -> None:
        for i in range(3):
            await compute.run(lambda i=i: seen.append((f"run{i}", threading.get_ident())))

    asyncio.run(runs())
    assert seen == [("call", threading.get_ident())] + [(f"run{i}", threading.get_ident()) for i in range(3)]
    errors: list[BaseException] = []

    def elsewhere() -> None:
        try:
            compute.call(lambda: None)
        except AssertionError as exc:
            errors.append(exc)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "second thread" in str(errors[0])
