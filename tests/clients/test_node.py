"""The Node.js client (clients/node) against live daemons, run with `node`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from tests.clients.conftest import ADMIN_TOKEN, LiveStack, dead_address
from tests.daemons import REPO

NODE_DIR = REPO / "clients" / "node"
NODE = shutil.which("node")

pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")


def run_smoke(*args: str) -> subprocess.CompletedProcess:
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.fail("clients/node/node_modules is missing: run `make install` (npm install)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHE_")}
    return subprocess.run(
        [NODE, "smoke.js", *args],
        cwd=NODE_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def test_smoke_generates_twice_and_hits_the_cache(live: LiveStack) -> None:
    result = run_smoke(
        "--blockd", live.blockd.address, "--computed", live.computed.address, "--admin-token", ADMIN_TOKEN
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(result.stdout)
    assert summary["ok"] is True
    assert summary["first"]["usage"]["cached_tokens"] == 0
    assert summary["second"]["usage"]["cached_tokens"] > 0
    assert summary["second"]["streamed_chunks"] >= 1
    assert summary["stats"]["hit_tokens"] >= summary["second"]["usage"]["cached_tokens"]


def test_smoke_fails_when_a_daemon_is_down(live: LiveStack) -> None:
    computed = dead_address()
    result = run_smoke("--blockd", live.blockd.address, "--computed", computed, "--admin-token", ADMIN_TOKEN)
    assert result.returncode != 0
    assert f"computed at {computed} is unreachable (UNAVAILABLE)" in result.stderr


def test_smoke_fails_without_the_admin_token(live: LiveStack) -> None:
    result = run_smoke("--blockd", live.blockd.address, "--computed", live.computed.address)
    assert result.returncode != 0
    assert "UNAUTHENTICATED" in result.stderr
