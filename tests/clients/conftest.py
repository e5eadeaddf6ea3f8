"""Live daemons for the client tests: one blockd (with an admin token) and one computed.

They are started once per session and shared by the test files of this folder; each
test uses prompts of its own (a unique run id in the text) so that tests do not see
each other's cached blocks, except where a test flushes everything on purpose.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.daemons import REPO, Daemon, start_blockd, start_computed

ADMIN_TOKEN = "test-admin-token"
BUILTIN_MODEL = REPO / "computed" / "default_model"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dead_address() -> str:
    """A loopback address where nothing listens."""
    return f"127.0.0.1:{free_port()}"


def unique_prompt(topic: str = "caching") -> str:
    """A prompt several KV blocks long whose first block no other test shares."""
    run = uuid.uuid4().hex[:12]
    return (
        f"# run {run}\n# A note about {topic}: the key and value tensors of a prefix depend only on "
        f"that prefix, so they are computed once, kept in fixed-size blocks, and found again by "
        f"content when the next request starts the same way.\ndef lookup(table, key):\n    return "
    )


def model_args(workdir: Path) -> Path | None:
    """None (computed's built-in model) when it is there, else a tiny random Llama."""
    if (BUILTIN_MODEL / "config.json").exists():
        return None
    from tests.models import make_tiny_model

    path = workdir / "tiny-llama"
    if not (path / "config.json").exists():
        make_tiny_model(path, "llama")
    return path


@dataclass
class LiveStack:
    blockd: Daemon
    computed: Daemon
    model: Path | None

    def kvctl_env(self, token: str | None = ADMIN_TOKEN) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHE_")}
        env.update(
            KVCACHE_BLOCKD=self.blockd.address, KVCACHE_COMPUTED=self.computed.address, PYTHONUNBUFFERED="1"
        )
        if token is not None:
            env["KVCACHE_ADMIN_TOKEN"] = token
        return env


@pytest.fixture(scope="session")
def live(tmp_path_factory: pytest.TempPathFactory) -> LiveStack:
    workdir = tmp_path_factory.mktemp("clients-live")
    model = model_args(workdir)
    blockd = start_blockd(workdir, "--admin-token", ADMIN_TOKEN)
    try:
        computed = start_computed(workdir, blockd.address, model=model)
    except BaseException:
        blockd.stop()
        raise
    yield LiveStack(blockd, computed, model)
    computed.stop()
    blockd.stop()


def run_kvctl(*args: str, env: dict[str, str], timeout: float = 120.0) -> subprocess.CompletedProcess:
    """`python -m clients.kvctl ARGS` as a user would run it (exit code, stdout, stderr)."""
    return subprocess.run(
        [sys.executable, "-m", "clients.kvctl", *args],
        check=False,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
