"""The local runner (`python -m clients.stack`) and the demo start, report and stop real daemons."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clients.client import KVCacheClient
from clients.stack import Stack, StackError
from tests.clients.conftest import free_port, model_args, unique_prompt
from tests.daemons import REPO


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_all_gone(pids: list[int], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while any(is_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(is_alive(p) for p in pids), f"still running: {[p for p in pids if is_alive(p)]}"


def pids_in(run_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in run_dir.glob("*.pid")]


def logged_pids(run_dir: Path) -> list[int]:
    """Every pid the stack started in this run folder (it logs "=== pid N" per start)."""
    pids = [
        int(m)
        for log in run_dir.glob("*.log")
        for m in re.findall(r"^=== pid (\d+)$", log.read_text(errors="replace"), re.MULTILINE)
    ]
    assert pids, "the stack logs the pid of each daemon it starts"
    return pids


def run_module(module: str, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def model_flags(tmp_path: Path) -> list[str]:
    model = model_args(tmp_path)
    return ["--model", str(model)] if model else []


def test_up_status_down(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    blockd, computed = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    up = run_module(
        "clients.stack",
        "up",
        "--run-dir",
        str(run_dir),
        "--blockd",
        blockd,
        "--computed",
        computed,
        *model_flags(tmp_path),
    )
    pids = pids_in(run_dir)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert len(pids) == 3 and all(is_alive(p) for p in pids)  # valkey (the shared tier), blockd, computed
        hint = next(line for line in up.stdout.splitlines() if line.startswith("try: "))
        tried = subprocess.run(
            shlex.split(hint.removeprefix("try: ")),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert tried.returncode == 0, f"{hint!r} runs as printed (no kvctl on PATH needed): {tried.stderr}"
        for name in ("blockd", "computed"):
            assert (run_dir / f"{name}.log").exists() and (run_dir / f"{name}.ready").exists()
        status = run_module("clients.stack", "status", "--run-dir", str(run_dir), "--json")
        assert status.returncode == 0, status.stderr
        states = {s["name"]: s for s in json.loads(status.stdout)}
        assert states["blockd"]["address"] == blockd and states["computed"]["address"] == computed
        assert all(s["is_running"] and s["health"] == "SERVING" for s in states.values())
        assert set(states) == {"valkey", "blockd", "computed"}
        with KVCacheClient(blockd, [computed]) as client:
            prompt = unique_prompt("stack")
            client.complete(prompt, max_tokens=2)
            assert client.complete(prompt, max_tokens=2).usage.cached_tokens > 0
        again = run_module(
            "clients.stack", "up", "--run-dir", str(run_dir), "--blockd", blockd, "--computed", computed
        )
        assert again.returncode == 1 and "already running" in again.stderr
    finally:
        down = run_module("clients.stack", "down", "--run-dir", str(run_dir))
    assert down.returncode == 0, down.stderr
    assert "computed, blockd, valkey" in down.stdout
    wait_all_gone(pids)
    assert sorted(logged_pids(run_dir)) == sorted(pids)
    assert not list(run_dir.glob("*.pid"))
    status = run_module("clients.stack", "status", "--run-dir", str(run_dir))
    assert status.returncode == 1
    assert "nothing is running" in status.stdout and "make up" in status.stdout, status.stdout


def test_up_with_shards_puts_each_worker_on_its_shard_behind_the_router(tmp_path: Path) -> None:
    """`up --shards 2` (docs/sharding.md): two blockd processes, the fleet router on --blockd,
    computed i on shard i mod 2, the gateway routing through the router with a mirror per shard."""
    from kvcache.v1 import directory_pb2 as pb
    from kvcache.v1 import directory_pb2_grpc as pb_grpc
    from tests.gateway.conftest import http

    run_dir = tmp_path / "run"
    router, gateway = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    computed = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    up = run_module(
        "clients.stack",
        *("up", "--run-dir", str(run_dir), "--blockd", router, "--shards", "2", "--shared-tier", "off"),
        *("--computed", computed[0], "--computed", computed[1], "--gateway", gateway),
        *model_flags(tmp_path),
    )
    pids = pids_in(run_dir)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        status = run_module("clients.stack", "status", "--run-dir", str(run_dir), "--json")
        states = {s["name"]: s for s in json.loads(status.stdout)}
        assert set(states) == {
            "blockd-shard0",
            "blockd-shard1",
            "blockd-fleet",
            "computed",
            "computed2",
            "gateway",
        }
        assert all(s["is_running"] and s["health"] == "SERVING" for s in states.values()), states
        assert states["blockd-fleet"]["address"] == router
        import grpc

        for i, shard in enumerate(("blockd-shard0", "blockd-shard1")):
            with grpc.insecure_channel(states[shard]["address"]) as channel:
                pools = pb_grpc.DirectoryAdminServiceStub(channel).ListPools(
                    pb.ListPoolsRequest(), timeout=10
                )
            assert [p.worker_address for p in pools.pools] == [computed[i]]  # one worker per shard
        with grpc.insecure_channel(router) as channel:
            pools = pb_grpc.DirectoryAdminServiceStub(channel).ListPools(pb.ListPoolsRequest(), timeout=10)
        assert sorted(p.worker_address for p in pools.pools) == sorted(computed)
        body = {"model": "default_model", "prompt": unique_prompt("shards"), "max_tokens": 2}
        first = http(gateway, "POST", "/v1/completions", {**body, "model": _served_model(gateway)})
        assert first[0] == 200, first
        deadline = time.monotonic() + 20
        while True:  # the gateway's mirrors follow both shards' streams
            metrics = http(gateway, "GET", "/metrics")[2]
            if re.search(r"^gateway_directory_mirror_synced 1", metrics, re.MULTILINE):
                break
            assert time.monotonic() < deadline, "the gateway's shard mirrors never synced"
            time.sleep(0.1)
        again = http(gateway, "POST", "/v1/completions", {**body, "model": _served_model(gateway)})
        assert again[0] == 200 and json.loads(again[2])["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert again[1]["x-kvcache-worker"] == first[1]["x-kvcache-worker"]  # routed to its prefix
    finally:
        down = run_module("clients.stack", "down", "--run-dir", str(run_dir))
    assert down.returncode == 0, down.stderr
    assert down.stdout.index("computed") < down.stdout.index("blockd-shard0")  # workers first
    wait_all_gone(pids)


def _served_model(gateway: str) -> str:
    from tests.gateway.conftest import http

    return json.loads(http(gateway, "GET", "/v1/models")[2])["data"][0]["id"]


def test_failed_start_shows_the_log_tail_and_stops_everything(tmp_path: Path) -> None:
    stack = Stack(tmp_path / "run")
    with pytest.raises(StackError) as error:
        stack.up(
            f"127.0.0.1:{free_port()}",
            [f"127.0.0.1:{free_port()}"],
            model=str(tmp_path / "no-such-model"),
            timeout=120,
        )
    message = str(error.value)
    assert message.startswith("computed exited during start-up") and "  | " in message
    assert "no-such-model" in message
    assert stack.status() == [] and not list((tmp_path / "run").glob("*.pid"))


def test_demo_runs_the_workload_and_stops_the_stack(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_module(
        "clients.demo",
        "--run-dir",
        str(run_dir),
        "--blockd",
        f"127.0.0.1:{free_port()}",
        "--computed",
        f"127.0.0.1:{free_port()}",
        "--requests",
        "4",
        "--max-tokens",
        "2",
        *model_flags(tmp_path),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "hit rate of this run" in result.stdout and "Traceback" not in result.stdout + result.stderr
    assert not list(run_dir.glob("*.pid")), "the demo stops the stack it started"
    wait_all_gone(logged_pids(run_dir))
    again = next(
        (line for line in result.stdout.splitlines() if "first question again" in line), result.stdout
    )
    assert "after a flush" in again and "cached 0 tokens (cold)" in again, again
    assert "TTFT: cold (0 cached tokens)" in result.stdout, "a fresh stack: the first request is cold"
    assert "cached prefix: time to first token" in result.stdout
    assert result.stdout.strip().splitlines()[-1].startswith("the demo's stack is stopped"), (
        "an honest last line"
    )


def _run_prompt_tokens(output: str) -> int:
    found = re.search(r"hit rate of this run: [\d,]+ of ([\d,]+) prompt tokens", output)
    assert found, output
    assert output.count("hit rate") == 1, "one hit rate"
    return int(found.group(1).replace(",", ""))


def test_demo_reuses_a_running_stack_and_leaves_its_cache_alone(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    stack = Stack(run_dir)
    model = model_args(tmp_path)
    stack.up(f"127.0.0.1:{free_port()}", [f"127.0.0.1:{free_port()}"], model=str(model) if model else None)
    try:
        pids, addresses = sorted(pids_in(run_dir)), stack.addresses()
        theirs = unique_prompt("someone else's cache")
        with KVCacheClient(addresses["blockd"], [addresses["computed"]]) as client:
            client.complete(theirs, max_tokens=2)
        runs = [
            run_module("clients.demo", "--run-dir", str(run_dir), "--requests", "3", "--max-tokens", "2")
            for _ in range(2)
        ]
        for run in runs:
            assert run.returncode == 0, run.stdout + run.stderr
            assert "already running" in run.stdout and "blocks dropped" not in run.stdout
            assert "cached 0 tokens (cold)" in run.stdout, "the cold request needs no flush"
        with KVCacheClient(addresses["blockd"], [addresses["computed"]]) as client:
            assert client.complete(theirs, max_tokens=2).usage.cached_tokens > 0, "the demo flushed the stack"
        assert sorted(pids_in(run_dir)) == pids and all(is_alive(p) for p in pids), "left running"
        first, again = (run.stdout for run in runs)
        assert "TTFT: cold (0 cached tokens)" in first
        assert "(cold)" not in again.replace("cached 0 tokens (cold)", ""), "a rerun's requests are all warm"
        assert "every request found its prefix cached" in again
        assert _run_prompt_tokens(first) == _run_prompt_tokens(again), (
            "the hit rate is this run's, not a total"
        )
        assert "try: " in again and "stopped" not in again, "a reused stack keeps running"
    finally:
        stack.down()


def test_demo_stops_the_stack_on_ctrl_c(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "clients.demo",
            "--run-dir",
            str(run_dir),
            "--blockd",
            f"127.0.0.1:{free_port()}",
            "--computed",
            f"127.0.0.1:{free_port()}",
            "--max-tokens",
            "512",
            *model_flags(tmp_path),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "computed.ready").exists() and proc.poll() is None:
            assert time.monotonic() < deadline, "the demo never started computed"
            time.sleep(0.1)
        pids = pids_in(run_dir)
        # Soon after computed serves, mid-workload (512 tokens a question: the workload
        # cannot end before the Ctrl-C lands, however fast the machine).
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output
    assert "Traceback" not in output
    wait_all_gone(pids)
    assert not list(run_dir.glob("*.pid"))
