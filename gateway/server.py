"""The gateway's process: uvicorn on a socket bound here, a ready file, graceful SIGTERM.

SIGTERM/SIGINT: uvicorn stops accepting, lets open requests (streams included) finish
for up to `drain_seconds`, then the app's lifespan closes the channels to the daemons
and the process exits 0 (a second signal stops waiting).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import structlog
import uvicorn

from gateway.app import build_app
from gateway.config import GatewayConfig

log = structlog.get_logger("gateway")


def bind(config: GatewayConfig) -> socket.socket:
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say TCP, and
    # without it a response's headers and body (two writes) wait out a delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, config.port))
    sock.set_inheritable(True)
    return sock


async def serve(config: GatewayConfig) -> int:
    sock = bind(config)
    host, port = sock.getsockname()[:2]
    address = f"{host}:{port}"
    server = _Server(
        uvicorn.Config(
            build_app(config),
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=config.drain_seconds,
            lifespan="on",
            http=config.http,
            proxy_headers=False,  # nothing here reads the client's address
        )
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _stop, server, sig)
    waiter = asyncio.create_task(_announce(server, config, address))
    try:
        await server.serve(sockets=[sock])
    finally:
        waiter.cancel()
    log.info("gateway stopped")
    return 0


class _Server(uvicorn.Server):
    """uvicorn without its signal capture, which re-raises SIGTERM after the drain (exit -15)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _stop(server: uvicorn.Server, sig: int) -> None:
    if server.should_exit:  # a second signal: stop waiting for open requests
        server.force_exit = True
    server.should_exit = True
    log.info("draining", signal=signal.Signals(sig).name, seconds=server.config.timeout_graceful_shutdown)


async def _announce(server: uvicorn.Server, config: GatewayConfig, address: str) -> None:
    while not server.started:
        await asyncio.sleep(0.02)
    if config.api_keys:
        tenants = len(set(config.api_keys.values()))
        log.info("API keys required", keys=len(config.api_keys), tenants=tenants)
    else:
        log.warning("running OPEN: no API keys configured, every caller is served and shares one cache")
    log.info(
        "gateway serving",
        address=f"http://{address}",
        computed=list(config.computed),
        discover=bool(config.blockd and config.discover),
        blockd=config.blockd,
        routing=config.routing,
    )
    if config.ready_file:
        _write_atomically(Path(config.ready_file), address)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)
