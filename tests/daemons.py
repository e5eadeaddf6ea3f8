"""Spawn the real daemons as subprocesses on free loopback ports, for tests.

Each daemon is started with `--listen 127.0.0.1:0 --ready-file F`; it binds a free
port, and once it serves it writes its bound address to F. We then wait for grpc
health to say SERVING. Logs go to a file beside the ready file so a failing test can
show them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Daemon:
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


def wait_serving(address: str, timeout: float = 60.0, service: str = "") -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with grpc.insecure_channel(address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        except grpc.RpcError as exc:
            last = exc
        time.sleep(0.05)
    raise TimeoutError(f"{address} not SERVING after {timeout}s: {last}")


def spawn(name: str, module: str, workdir: Path, args: list[str], env: dict | None = None,
          timeout: float = 120.0, listen: str = "127.0.0.1:0") -> Daemon:
    workdir.mkdir(parents=True, exist_ok=True)
    ready = workdir / f"{name}.ready"
    ready.unlink(missing_ok=True)
    log_path = workdir / f"{name}.log"
    full_args = [sys.executable, "-m", module, "--listen", listen, "--ready-file", str(ready), *args]
    proc_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(full_args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=proc_env)
    deadline = time.monotonic() + timeout
    while not ready.exists() or not ready.read_text().strip():
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log_path.read_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"{name} wrote no ready file in {timeout}s:\n{log_path.read_text()}")
        time.sleep(0.05)
    address = ready.read_text().strip()
    daemon = Daemon(name, proc, address, log_path, full_args)
    if not address.startswith("unix:"):
        wait_serving(address, timeout=max(5.0, deadline - time.monotonic()))
    return daemon


def start_blockd(workdir: Path, *args: str, env: dict | None = None, name: str = "blockd") -> Daemon:
    return spawn(name, "blockd", workdir, list(args), env=env)


def start_computed(workdir: Path, blockd_address: str, *args: str, model: str | Path | None = None,
                   env: dict | None = None, name: str = "computed") -> Daemon:
    extra = ["--blockd", blockd_address]
    if model is not None:
        extra += ["--model", str(model)]
    return spawn(name, "computed", workdir, extra + list(args), env=env, timeout=300.0)
