"""The blockd process: gRPC server, health, reflection, lease expiry, metrics, signals."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import os
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from blockd.auth import admin_auth, route_auth, worker_auth
from blockd.config import BlockdConfig, TlsConfig
from blockd.directory import BlockDirectory
from blockd.hashing import DEFAULT_HASHER, truncated_hasher
from blockd.metrics import make_registry, start_metrics_server
from blockd.service import BlockDirectoryService, DirectoryAdminService, RoutingService, add_service
from blockd.shared_store import SharedStoreAdmin, rebuild_forever, reread_forever
from kvcache.v1 import directory_pb2

log = structlog.get_logger("blockd.server")

SERVICE_NAMES = tuple(service.full_name for service in directory_pb2.DESCRIPTOR.services_by_name.values())
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a Step may carry many 128K-token prompts
_LOOPBACK = ("127.0.0.1", "localhost", "[::1]")


@dataclass
class BlockdServer:
    """A built, not yet started blockd: `start`, then `stop` (or `wait_for_termination`)."""

    server: grpc.aio.Server
    address: str
    directory: BlockDirectory
    health: health_aio.HealthServicer
    config: BlockdConfig
    _tasks: list[asyncio.Task] = field(default_factory=list)
    _metrics: asyncio.Server | None = None
    metrics_address: str | None = None
    shared_store: SharedStoreAdmin | None = None

    async def start(self) -> None:
        await self.server.start()
        if self.config.metrics_port is not None:
            self._metrics = await start_metrics_server(
                make_registry(self.directory), self.config.metrics_host, self.config.metrics_port
            )
            host, port = self._metrics.sockets[0].getsockname()[:2]
            self.metrics_address = f"{host}:{port}"
        self._tasks.append(asyncio.create_task(self._expire_forever(), name="blockd-expiry"))
        if self.shared_store is not None:  # in the background: an unreachable store never blocks serving
            self._tasks.append(asyncio.create_task(self._shared_index(), name="blockd-shared-index"))
        for service in ("", *SERVICE_NAMES):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "serving",
            address=self.address,
            metrics=self.metrics_address,
            lease_ttl=self.config.directory.lease_ttl_seconds,
            admin_auth=self.config.admin_token is not None,
            worker_auth=self.config.worker_token is not None,
            route_auth=self.config.route_token is not None,
            tls=self.config.tls is not None,
            shared_tier=self.config.shared_tier,
        )
        if self.config.worker_token is None:
            local = self.address.startswith("unix:") or self.address.rsplit(":", 1)[0] in _LOOPBACK
            (log.info if local else log.warning)(
                "worker API open: no --worker-token, so any caller that reaches this address may "
                "register, step and reset pools; fine on loopback, set --worker-token beyond it",
                address=self.address,
            )

    async def stop(self, grace: float | None = None) -> None:
        """Health NOT_SERVING first (balancers stop sending), then let calls finish."""
        for service in ("", *SERVICE_NAMES):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._metrics is not None:
            self._metrics.close()
        if self.shared_store is not None:
            await self.shared_store.close()
        await self.server.stop(self.config.shutdown_grace_seconds if grace is None else grace)
        log.info("stopped", address=self.address)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()

    async def _shared_index(self) -> None:
        """The shared tier's index: rebuilt from the store at start, then re-read every
        `shared_tier_reread_seconds` when set."""
        assert self.shared_store is not None
        await rebuild_forever(self.shared_store, self.directory.load_shared)
        interval = self.config.shared_tier_reread_seconds
        if interval is not None:
            await reread_forever(self.shared_store, self.directory.load_shared, interval)

    async def _expire_forever(self) -> None:
        """Retire lapsed leases and pins, about four times per lease TTL."""
        period = min(1.0, self.config.directory.lease_ttl_seconds / 4)
        while True:
            await asyncio.sleep(period)
            try:
                for pool_id in self.directory.expire_leases():
                    log.warning("lease lapsed: pool dropped", pool_id=pool_id)
                for pin_id in self.directory.expire_pins():
                    log.info("pin expired", pin_id=pin_id)
            except Exception:
                log.exception("lease expiry failed")


def build_server(
    config: BlockdConfig,
    directory: BlockDirectory | None = None,
    on_pool_registered: Callable[[], None] | None = None,
) -> tuple[BlockdServer, str]:
    """Build (not start) blockd on `config.listen`; answers it and the bound address
    (with the real port when the configured one is 0). `on_pool_registered`: the
    servicer calls it after each registration (`serve` freezes the heap there)."""
    if directory is None:
        hasher = (
            DEFAULT_HASHER if config.test_hash_bytes is None else truncated_hasher(config.test_hash_bytes)
        )
        directory = BlockDirectory(config.directory, hasher=hasher)
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # One daemon per port: without this gRPC sets SO_REUSEPORT, so a second blockd
            # on a taken port binds it too and the kernel splits calls between the two.
            ("grpc.so_reuseport", 0),
        ]
    )
    shared_store = SharedStoreAdmin(config.shared_tier) if config.shared_tier is not None else None
    add_service(
        BlockDirectoryService(directory, worker_auth(config.worker_token), on_pool_registered, shared_store),
        server,
        "BlockDirectoryService",
    )
    add_service(
        DirectoryAdminService(directory, admin_auth(config.admin_token), shared_store),
        server,
        "DirectoryAdminService",
    )
    add_service(RoutingService(directory, route_auth(config.route_token)), server, "RoutingService")
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection((*SERVICE_NAMES, health_name, reflection.SERVICE_NAME), server)
    try:
        if config.tls is not None:
            port = server.add_secure_port(config.listen, _server_credentials(config.tls))
        else:
            port = server.add_insecure_port(config.listen)
    except RuntimeError as exc:
        raise RuntimeError(f"could not bind {config.listen}: {bind_error(config.listen)}") from exc
    if port == 0 and not config.listen.startswith("unix:"):
        raise RuntimeError(f"could not bind {config.listen}: {bind_error(config.listen)}")
    address = _bound_address(config.listen, port)
    blockd = BlockdServer(server, address, directory, health, config, shared_store=shared_store)
    return blockd, address


async def serve(config: BlockdConfig) -> int:
    """build -> start -> (ready file) -> wait for SIGTERM/SIGINT -> stop; answers the exit code."""
    blockd, address = build_server(config, on_pool_registered=gc.freeze if _gc_tuned() else None)
    await blockd.start()
    _tune_gc()  # after start: the server's own long-lived objects are frozen too
    if config.ready_file is not None:
        _write_atomically(config.ready_file, address)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
    log.info("shutting down", grace=config.shutdown_grace_seconds)
    await blockd.stop()
    return 0


# Young collections of at most 2,000 net allocations, whose survivors are never scanned
# again (no older generation is ever collected): see `_tune_gc`.
GC_THRESHOLDS = (2_000, 1_000_000_000, 1_000_000_000)


def _tune_gc() -> None:
    """The directory's records (blocks, sequences, pins) hold no reference cycles,
    yet a busy pool creates thousands of them per second, and nearly all of them outlive
    a young collection. A collection scans what is in its generations, so CPython's
    default thresholds spent ~10% of the daemon's time and paused Steps for the length of
    each older collection. Tuned: a young collection (cycles from the gRPC and asyncio
    layers, which die young) every 2,000 net allocations, and its survivors are never
    scanned again, so each object is scanned once and a pause is one young collection.
    Measured (`bench.blockd_fleet`'s open loop, 64 workers at a GPU's rate): with young
    collections every 50,000 and an older one every 20 of them, each young one paused
    Steps 24-34 ms and the older ones 41 ms, and the Step p99 was 28-48 ms; survivors
    left alone, young collections every 5,000 paused at most 4.7 ms (p99 4.8-5.4 ms),
    every 2,000 at most 3.3 ms (p99 2.5-3.9 ms).

    Its cost: a reference cycle that is still alive at a young collection and dies later
    is never collected. Measured over that run (64 streams, 45,000 Steps): no more
    objects left uncollectable than with older collections left on (320 against 325, all
    of them the start-up's and registrations' frozen objects, below).
    BLOCKD_GC=default keeps CPython's defaults: bench.blockd_gc measures both.

    A pool's registration freezes the heap (`serve` gives the servicer gc.freeze): the
    pool's containers (index, records, ghost table) live as long as it does, and while
    young every young collection traversed them with all they hold. Measured
    (`bench.blockd_grpc`'s open loop after 8 registrations, compiled core): the first
    young collection after them paused Steps 92-133 ms, against 8-15 ms for every
    collection with the freeze."""
    if not _gc_tuned():
        log.info("garbage collection left at CPython's defaults (BLOCKD_GC=default)")
        return
    gc.set_threshold(*GC_THRESHOLDS)
    gc.freeze()


def _gc_tuned() -> bool:
    return os.environ.get("BLOCKD_GC") != "default"


def bind_error(listen: str) -> str:
    """Why `listen` cannot be bound, in the operating system's words ("address in use")
    where a plain socket can tell; gRPC's own error names no cause."""
    host, _, port = listen.rpartition(":")
    if listen.startswith("unix:") or not port.isdigit():
        return "see the address"
    host = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((host, int(port)))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return "address in use (another process listens there; one daemon per port)"
        return exc.strerror or str(exc)
    return "gRPC refused it"


def _server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    client_ca = tls.client_ca_file.read_bytes() if tls.client_ca_file is not None else None
    return grpc.ssl_server_credentials(
        [(tls.key_file.read_bytes(), tls.cert_file.read_bytes())],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def _bound_address(listen: str, port: int) -> str:
    if listen.startswith("unix:"):
        return listen
    host = listen.rsplit(":", 1)[0]
    return f"{host}:{port}"


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)
