"""Faults against real processes: blockd killed and restarted mid-load, computed killed,
clients that cancel or die mid-stream.

What must hold: no request is lost, greedy outputs equal the no-fault run, blockd's
accounting returns to idle (nothing referenced, no live sequence), a dead worker's pool
is freed within two lease TTLs and its old epoch is refused.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from kvcache.v1 import directory_pb2 as dpb
from kvcache.v1 import generation_pb2 as gpb
from tests.daemons import REPO, start_computed
from tests.reliability.stack import (
    BLOCK,
    Stack,
    assert_accounting,
    free_port,
    health,
    spawn_blockd,
    start_stack,
    stop_stack,
    tokens,
)

MAX_TOKENS = 48


@dataclass
class Stream:
    """One streaming request run on its own thread."""

    prompt: list[int]
    out: list[int] = field(default_factory=list)
    finish_reason: str = ""
    error: grpc.RpcError | None = None
    first_token: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    def run(self, stack: Stack, max_tokens: int) -> None:
        request = gpb.GenerateRequest(prompt_token_ids=self.prompt, max_tokens=max_tokens, ignore_eos=True)
        try:
            for message in stack.gen.Generate(request, timeout=120):
                self.out.extend(message.token_ids)
                if self.out:
                    self.first_token.set()
                self.finish_reason = message.finish_reason or self.finish_reason
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.first_token.set()
            self.done.set()


def start_streams(stack: Stack, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[Stream]:
    streams = [Stream(p) for p in prompts]
    for s in streams:
        threading.Thread(target=s.run, args=(stack, max_tokens), daemon=True).start()
    return streams


def finish(streams: list[Stream], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    for s in streams:
        assert s.done.wait(max(0.0, deadline - time.monotonic())), "a request never finished"


def workload() -> list[list[int]]:
    """24 prompts: half share a 3-block system prefix (so hits and shared blocks exist)."""
    system = tokens(1, 3 * BLOCK)
    return [(system if i % 2 else []) + tokens(100 + i, 5 + (7 * i) % 23) for i in range(24)]


def resynced_sequences(log: str) -> list[int]:
    """The `sequences` count of every pool_resynced record of computed's JSON log."""
    counts = []
    for line in log.splitlines():
        if '"pool_resynced"' in line:
            counts.append(json.loads(line)["sequences"])
    return counts


@pytest.mark.parametrize("kills", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_blockd_killed_mid_load_and_restarted_on_the_same_address(
    tmp_path: Path, tiny_model: Path, kills: int
) -> None:
    listen = f"127.0.0.1:{free_port()}"
    stack = start_stack(
        tmp_path, tiny_model, ["--lease-ttl", "5"], ["--num-blocks", "512"], blockd_listen=listen
    )
    try:
        prompts = workload()
        reference = start_streams(stack, prompts)
        finish(reference)
        assert all(s.error is None and len(s.out) == MAX_TOKENS for s in reference)
        pool_id = stack.live_pool().pool_id
        stack.flush()  # the fault run recomputes every prefix (with hits among its own requests)

        lost = 0
        for kill in range(kills):
            first, second = prompts[:16], prompts[16:]
            streams = start_streams(stack, first)
            for s in streams[:4]:
                assert s.first_token.wait(60), "no token before the kill"
            stack.blockd.kill()
            streams += start_streams(stack, second)  # arrive while blockd is down
            time.sleep(1.0)
            stack.blockd = spawn_blockd(tmp_path, ["--lease-ttl", "5"], listen=listen, name=f"blockd{kill}")
            stack.reconnect(blockd_only=True)
            finish(streams)
            for s, ref in zip(streams, reference, strict=True):
                assert s.error is None, f"request lost: {s.error}"
                lost += s.error is not None
                assert s.finish_reason == "length"
                assert s.out == ref.out, "greedy output changed by the fault"
            idle = stack.wait_idle()
            assert idle.num_referenced_blocks == 0 and idle.num_sequences == 0, idle
            assert_accounting(idle)
            assert stack.live_pool().pool_id == pool_id, "computed must re-register its pool id"
        assert lost == 0
        resyncs = resynced_sequences(stack.computed.log())
        assert len(resyncs) >= kills + 1 and max(resyncs) > 0, (
            f"no resync carried live sequences, so no kill hit the load: {resyncs}"
        )
        assert health(stack.computed.address) == "SERVING"
    finally:
        stop_stack(stack)


def test_computed_killed_pool_freed_within_two_ttls_and_old_epoch_refused(
    tmp_path: Path, tiny_model: Path
) -> None:
    ttl = 2.0
    stack = start_stack(tmp_path, tiny_model, ["--lease-ttl", str(ttl)], ["--num-blocks", "256"])
    try:
        old = stack.live_pool()
        streams = start_streams(stack, workload()[:8], max_tokens=400)
        for s in streams:
            assert s.first_token.wait(60)
        assert stack.stats().num_referenced_blocks > 0
        stack.computed.kill()
        killed_at = time.monotonic()
        while True:
            stats = stack.stats(old.pool_id)
            if stats.num_referenced_blocks == 0 and stats.num_sequences == 0:
                break
            assert time.monotonic() - killed_at < 2 * ttl, f"pool not freed within 2 TTLs: {stats}"
            time.sleep(0.05)
        assert_accounting(stats)
        assert stats.num_free_blocks == stats.num_blocks, "the dead worker's cache must be dropped too"
        info = next(p for p in stack.pools() if p.pool_id == old.pool_id)
        assert not info.is_live and info.epoch > old.epoch

        stale = dpb.StepRequest(
            pool_id=old.pool_id, epoch=old.epoch, admits=[dpb.AdmitOp(sequence_id=1, token_ids=[1, 2, 3])]
        )
        with pytest.raises(grpc.RpcError) as err:
            stack.worker.Step(stale, timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "RegisterPool" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stack.worker.RenewLease(dpb.RenewLeaseRequest(pool_id=old.pool_id, epoch=old.epoch), timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert stack.stats(old.pool_id).num_sequences == 0, "a refused call must change nothing"

        stack.computed = start_computed(
            tmp_path,
            stack.blockd.address,
            "--block-size",
            str(BLOCK),
            "--num-blocks",
            "256",
            model=tiny_model,
            name="computed2",
        )
        stack.reconnect()
        new = stack.live_pool()
        assert new.pool_id != old.pool_id and new.worker_address == stack.computed.address
        result = stack.generate(tokens(7, 10), 5)
        assert result.finish_reason == "length" and len(result.token_ids) == 5
        assert stack.wait_idle().num_referenced_blocks == 0
    finally:
        stop_stack(stack)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path):
    s = start_stack(tmp_path_factory.mktemp("faults"), tiny_model, [], ["--num-blocks", "256"])
    yield s
    stop_stack(s)


def test_client_cancel_mid_stream_releases_blocks(stack: Stack) -> None:
    request = gpb.GenerateRequest(prompt_token_ids=tokens(11, 30), max_tokens=1500, ignore_eos=True)
    calls = [stack.gen.Generate(request, timeout=60) for _ in range(3)]
    for call in calls:
        for count, _ in enumerate(call, 1):
            if count == 3:
                break
    assert stack.stats().num_referenced_blocks > 0
    for call in calls:
        call.cancel()
    idle = stack.wait_idle(10)
    assert idle.num_referenced_blocks == 0 and idle.num_sequences == 0, idle
    assert_accounting(idle)


CLIENT = """
import sys, grpc
from kvcache.v1 import generation_pb2 as pb, generation_pb2_grpc as g
stub = g.GenerationServiceStub(grpc.insecure_channel(sys.argv[1]))
request = pb.GenerateRequest(prompt_token_ids=list(range(20, 60)), max_tokens=1500, ignore_eos=True)
for message in stub.Generate(request):
    print(len(message.token_ids), flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_client_process_releases_blocks(stack: Stack, sig: int) -> None:
    clients = [
        subprocess.Popen(
            [sys.executable, "-c", CLIENT, stack.computed.address],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for _ in range(3)
    ]
    try:
        for client in clients:
            for _ in range(3):  # three messages streamed: the request is mid-generation
                assert client.stdout.readline(), "client got no tokens"
        assert stack.stats().num_sequences >= 3
        for client in clients:
            client.send_signal(sig)
    finally:
        for client in clients:
            client.kill()
            client.wait(10)
    idle = stack.wait_idle(10)
    assert idle.num_referenced_blocks == 0 and idle.num_sequences == 0, idle
    assert_accounting(idle)
    assert stack.generate(tokens(12, 9), 3).finish_reason == "length"  # still serving


def test_blockd_restart_while_admitted_sequences_wait_for_their_first_chunk(
    tmp_path: Path, tiny_model: Path
) -> None:
    """Chunked prefill (16 tokens a step) leaves admitted sequences with nothing computed
    yet; a resync must not declare them with no tokens (blockd refuses an empty token
    list, and the worker would retry that refused resync forever)."""
    listen = f"127.0.0.1:{free_port()}"
    stack = start_stack(
        tmp_path,
        tiny_model,
        [],
        ["--num-blocks", "256", "--max-num-batched-tokens", "16"],
        blockd_listen=listen,
    )
    try:
        prompts = [tokens(300 + i, 60) for i in range(8)]
        reference = start_streams(stack, prompts, max_tokens=8)
        finish(reference)
        stack.flush()
        streams = start_streams(stack, prompts, max_tokens=8)
        deadline = time.monotonic() + 30
        while stack.stats().num_sequences < len(prompts):  # all admitted, most not prefilled
            assert time.monotonic() < deadline, "the requests were never admitted together"
            time.sleep(0.005)
        stack.blockd.kill()
        time.sleep(0.5)
        stack.blockd = spawn_blockd(tmp_path, [], listen=listen, name="blockd-restarted")
        stack.reconnect(blockd_only=True)
        finish(streams, timeout=60)
        for s, ref in zip(streams, reference, strict=True):
            assert s.error is None and s.out == ref.out
        idle = stack.wait_idle()
        assert idle.num_referenced_blocks == 0 and idle.num_sequences == 0, idle
        assert "blockd_refused" not in stack.computed.log()
    finally:
        stop_stack(stack)


def test_client_cancels_while_blockd_is_down(tmp_path: Path, tiny_model: Path) -> None:
    """Streams cancelled during the worker's recovery: the resync declares them (it was
    built before they went away), so their releases must still reach the new blockd."""
    listen = f"127.0.0.1:{free_port()}"
    stack = start_stack(tmp_path, tiny_model, [], ["--num-blocks", "256"], blockd_listen=listen)
    try:
        request = gpb.GenerateRequest(prompt_token_ids=tokens(21, 30), max_tokens=1500, ignore_eos=True)
        calls = [stack.gen.Generate(request, timeout=60) for _ in range(4)]
        for call in calls:
            next(call)
        stack.blockd.kill()
        # The worker notices at its next Step (after the decode burst under way, if any)
        # and starts recovering with these 4 sequences live: its first retry says so.
        deadline = time.monotonic() + 30
        while "blockd_recovery_retry" not in stack.computed.log():
            assert time.monotonic() < deadline, "computed never started recovering"
            time.sleep(0.02)
        for call in calls:
            call.cancel()
        time.sleep(0.3)
        stack.blockd = spawn_blockd(tmp_path, [], listen=listen, name="blockd-restarted")
        stack.reconnect(blockd_only=True)
        deadline = time.monotonic() + 30
        while not resynced_sequences(stack.computed.log())[1:]:
            assert time.monotonic() < deadline, "computed never resynced"
            time.sleep(0.05)
        assert resynced_sequences(stack.computed.log())[-1] == 4
        idle = stack.wait_idle()
        assert idle.num_referenced_blocks == 0 and idle.num_sequences == 0, idle
        assert_accounting(idle)
        assert stack.generate(tokens(22, 9), 3).finish_reason == "length"
    finally:
        stop_stack(stack)
