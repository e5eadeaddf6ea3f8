"""The README's gateway examples run as written against `make up`'s stack (free ports here)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from clients.stack import Stack
from tests.clients.conftest import free_port
from tests.daemons import REPO

README = (REPO / "README.md").read_text()
SECTION = README.split("## OpenAI-compatible gateway", 1)[1].split("\n## ", 1)[0]
DEFAULT = "127.0.0.1:8000"


def _block(language: str) -> str:
    found = re.findall(rf"```{language}\n(.*?)```", SECTION, re.DOTALL)
    assert len(found) == 1, f"one {language} block in the gateway section"
    assert DEFAULT in found[0]
    return found[0]


def test_make_up_starts_the_gateway_and_the_readme_examples_work(tmp_path: Path) -> None:
    stack = Stack(tmp_path / "run")
    gateway = f"127.0.0.1:{free_port()}"
    # with blockd's admin token, which the gateway's directory mirror needs (its calls are admin ones)
    states = stack.up(
        f"127.0.0.1:{free_port()}", [f"127.0.0.1:{free_port()}"], gateway=gateway, admin_token="s3cret"
    )
    try:
        assert [s.name for s in states] == [
            "blockd",
            "computed",
            "gateway",
            "valkey",
        ]  # valkey: the shared tier
        assert all(s.is_running and s.health == "SERVING" for s in states)
        curl = _block("sh").replace(DEFAULT, gateway)
        done = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=60, check=True)
        reply = json.loads(done.stdout)
        assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] == 16
        sdk = _block("python").replace(DEFAULT, gateway)
        done = subprocess.run(
            [sys.executable, "-c", sdk], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 0, done.stderr
        assert "cached prompt tokens: " in done.stdout and "prompt_tokens_details" in done.stdout
        log = (tmp_path / "run" / "gateway.log").read_text()
        assert "running OPEN" in log
        assert "directory mirror synced" in log and "refuses" not in log
    finally:
        stopped = stack.down()
    assert stopped[0] == "gateway" and stopped[-2:] == ["blockd", "valkey"]
    assert stack.status() == []


def test_gateway_help_answers() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0 and "--api-keys-file" in done.stdout
