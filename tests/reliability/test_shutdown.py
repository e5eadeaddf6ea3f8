"""Graceful shutdown: SIGTERM on computed mid-generation drains within --drain-seconds,
refuses new work meanwhile, releases everything and exits 0; SIGTERM on blockd exits 0."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import grpc

from kvcache.v1 import generation_pb2 as gpb
from tests.reliability.stack import assert_accounting, health, start_stack, tokens
from tests.reliability.test_faults import finish, start_streams

# Short enough that the 1,900-token streams cannot finish inside it: decoding in bursts,
# the tiny model makes ~1,000 of their tokens a second here (3 s let them finish).
DRAIN_SECONDS = 1.0


def test_sigterm_drains_then_exits_zero_and_releases_everything(tmp_path: Path, tiny_model: Path) -> None:
    # A long lease: blocks freed after the exit were released by computed, not expired.
    stack = start_stack(
        tmp_path,
        tiny_model,
        ["--lease-ttl", "60"],
        ["--num-blocks", "512", "--drain-seconds", str(DRAIN_SECONDS)],
    )
    pool_id = stack.live_pool().pool_id
    short = start_streams(stack, [tokens(400 + i, 12 + i) for i in range(4)], max_tokens=24)
    long = start_streams(stack, [tokens(410 + i, 20) for i in range(2)], max_tokens=1900)
    for s in short + long:
        assert s.first_token.wait(60)
    # Most of the way through the short streams, so their rest fits the drain window on a loaded
    # machine too (from their first token, 23 tokens now and then did not, under the
    # whole suite on 2 cores); the long ones are far from done.
    deadline = time.monotonic() + 60
    while any(len(s.out) < 20 for s in short) and time.monotonic() < deadline:
        time.sleep(0.005)
    stack.computed.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()

    time.sleep(0.2)  # the signal is handled: new work is refused while running requests drain
    late = gpb.GenerateRequest(prompt_token_ids=tokens(420, 8), max_tokens=4)
    try:
        list(stack.gen.Generate(late, timeout=10))
        raise AssertionError("a request was admitted after SIGTERM")
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
        assert "shutting down" in (exc.details() or "")
    assert health(stack.computed.address) in ("NOT_SERVING", "UNAVAILABLE")

    code = stack.computed.proc.wait(DRAIN_SECONDS + 10)
    took = time.monotonic() - sent
    assert code == 0, stack.computed.log()[-3000:]
    assert took < DRAIN_SECONDS + 5, f"shutdown took {took:.1f}s with --drain-seconds {DRAIN_SECONDS}"
    finish(short + long, timeout=10)
    for s in short:  # finished normally inside the drain window
        assert s.error is None and s.finish_reason == "length" and len(s.out) == 24
    for s in long:  # cut at the deadline, told so
        assert s.error is None and s.finish_reason == "cancelled", (s.error, s.finish_reason)
        assert 0 < len(s.out) < 1900

    stats = stack.stats(pool_id)
    assert stats.num_referenced_blocks == 0 and stats.num_sequences == 0, stats
    assert_accounting(stats)
    stack.close()
    assert stack.blockd.stop(signal.SIGTERM) == 0, stack.blockd.log()[-3000:]


def test_sigterm_on_idle_daemons_exits_zero_fast(tmp_path: Path, tiny_model: Path) -> None:
    stack = start_stack(tmp_path, tiny_model, [], ["--num-blocks", "64", "--drain-seconds", "30"])
    assert stack.generate(tokens(430, 9), 4).finish_reason == "length"
    stack.close()
    started = time.monotonic()
    assert stack.computed.stop(signal.SIGTERM) == 0
    assert time.monotonic() - started < 10, "an idle worker must not wait out the drain deadline"
    started = time.monotonic()
    assert stack.blockd.stop(signal.SIGINT) == 0
    assert time.monotonic() - started < 10
