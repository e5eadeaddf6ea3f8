"""clients.spawn, the one daemon spawner of tests, benchmarks and the stack runner."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from clients.spawn import REPO, DaemonExited, DaemonTimeout, daemon_command, log_tail, spawn, wait_ready


def test_a_daemon_that_exits_at_start_up_is_reported_with_its_log(tmp_path: Path) -> None:
    # json.tool cannot use these arguments: it exits at once, as a daemon with a bad flag does.
    with pytest.raises(DaemonExited) as error:
        spawn("fake", "json.tool", tmp_path, [], timeout=30)
    message = str(error.value)
    assert message.startswith("fake exited during start-up:") and "  | " in message
    assert "json.tool: error" in message  # the tail quotes the daemon's own complaint


def test_waiting_ends_at_the_deadline_with_the_state(tmp_path: Path) -> None:
    (tmp_path / "d.log").write_text("line 1\nline 2\n")
    with pytest.raises(DaemonTimeout, match=r"d not SERVING after 0s \(no ready file yet\):\n  \| line 1"):
        wait_ready("d", tmp_path / "d.ready", tmp_path / "d.log", lambda: True, timeout=0.2)


def test_the_command_and_the_log_tail() -> None:
    command = daemon_command("blockd", "127.0.0.1:0", Path("r/blockd.ready"), ["--lease-ttl", "5"])
    assert command[1:] == [
        "-m",
        "blockd",
        "--listen",
        "127.0.0.1:0",
        "--ready-file",
        "r/blockd.ready",
        "--lease-ttl",
        "5",
    ]
    assert log_tail(Path("/nonexistent/x.log")) == "  | (empty log)"


@pytest.mark.parametrize(
    "path", ["bench/stack.py", *sorted(str(p.relative_to(REPO)) for p in (REPO / "clients").glob("*.py"))]
)
def test_the_spawners_users_outside_tests_do_not_import_tests(path: str) -> None:
    tree = ast.parse((REPO / path).read_text())
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in modules if m.split(".")[0] == "tests"}, f"{path} imports from tests/"
