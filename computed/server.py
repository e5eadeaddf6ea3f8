"""computed's process: build (model, pool, engine, gRPC server) -> start -> wait -> drain."""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import structlog
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from computed import host_memory, kernels, triton_attention
from computed.compute_thread import ComputeThread
from computed.config import ComputedConfig
from computed.directory_client import DirectoryClient, PoolSpec
from computed.engine import Engine
from computed.host_allocator import keep_large_buffers
from computed.host_kv import HostKV
from computed.kv_pool import KVPool
from computed.logs import configure_logging
from computed.metrics import Histograms, serve_metrics
from computed.model.loader import LoadedModel, load_model, native_bfloat16
from computed.model.tokenizer import Tokenizer
from computed.model_runner import ModelRunner
from computed.scheduler import Scheduler, SchedulerConfig
from computed.service import GenerationServicer, WorkerInfo, add_service
from computed.shared_kv import SharedKV
from computed.shared_store import SharedStore
from kvcache.v1 import generation_pb2

log = structlog.get_logger("computed.server")

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ComputedServer:
    """A built but not yet started daemon. start() registers with blockd before SERVING."""

    def __init__(
        self,
        config: ComputedConfig,
        server: grpc.aio.Server,
        engine: Engine,
        health_servicer: health.aio.HealthServicer,
        address: str,
        directory: DirectoryClient | None = None,
        shared: SharedKV | None = None,
    ) -> None:
        self.config = config
        self.server = server
        self.engine = engine
        self.health = health_servicer
        self.address = address
        self._directory = directory
        self._shared = shared

    async def start(self) -> None:
        await self.server.start()
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self._shared is not None and self._directory is not None:
            await self._measure_shared_tier(self._shared, self._directory)
        await self.engine.start()  # waits for blockd
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        if self.config.ready_file is not None:
            _write_atomically(self.config.ready_file, self.address)
        log.info("computed_serving", address=self.address, blockd=self.config.blockd)

    async def stop(self) -> None:
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.engine.stop(self.config.drain_seconds)
        await self.server.stop(grace=2.0)
        log.info("computed_stopped", **self.engine.stats.finished)

    async def _measure_shared_tier(self, shared: SharedKV, directory: DirectoryClient) -> None:
        """The fetch cost blockd weighs against recompute (before registering). A store
        unreachable now is no reason not to serve: it is retried on every use."""
        seconds = self.config.shared_tier_load_seconds
        reachable = await shared.store.ping()
        if seconds is None:
            seconds = await shared.measure_load_seconds_per_block() if reachable else 0.0
        directory.spec = replace(directory.spec, shared_load_seconds_per_block=seconds)
        (log.info if reachable else log.warning)(
            "shared_tier" if reachable else "shared_tier_unreachable: serving without it until it answers",
            store=shared.store.url,
            load_seconds_per_block=seconds,
            recompute_seconds_per_block=directory.spec.prefill_seconds_per_token * self.config.block_size,
        )

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)


@dataclass(frozen=True)
class _Compute:
    """What the compute thread built: the model and everything holding tensors."""

    loaded: LoadedModel
    host: HostKV | None
    shared: SharedKV | None
    runner: ModelRunner
    num_blocks: int
    load_seconds: float  # the host tier's, per block
    prefill_seconds: float  # per token


def build_server(config: ComputedConfig) -> ComputedServer:
    device = _pick_device(config.device)
    dtype = _pick_dtype(config.dtype, device)
    if device.type == "cpu":
        log.info("host_allocator", keeps_large_buffers=keep_large_buffers())
        _load_cpu_kernels()
    # Every tensor is made on the thread that will run the forward (compute_thread.py says why).
    compute_thread = ComputeThread(own_thread=config.forward_on == "thread")
    built = compute_thread.call(_build_compute, config, device, dtype)
    loaded, host, shared, runner = built.loaded, built.host, built.shared, built.runner
    if config.served_model_name:  # the id clients name, and the namespace's model identity
        loaded = replace(loaded, model_id=config.served_model_name)
    num_blocks, load_seconds, prefill_seconds = built.num_blocks, built.load_seconds, built.prefill_seconds
    tokenizer = Tokenizer(config.model)
    mc = loaded.config
    max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    log.info(
        "model_loaded",
        model=loaded.model_id,
        revision=loaded.revision,
        arch=mc.architecture,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        num_blocks=num_blocks,
        block_size=config.block_size,
        max_model_len=max_model_len,
    )

    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", 16 * 1024 * 1024),
            ("grpc.max_send_message_length", 16 * 1024 * 1024),
            # One daemon per port: gRPC's default SO_REUSEPORT lets a second computed bind
            # a taken port and share its calls.
            ("grpc.so_reuseport", 0),
        ]
    )
    address = _bind(server, config)
    dtype_name = str(dtype).removeprefix("torch.")
    directory = DirectoryClient(
        config.blockd,
        PoolSpec(
            num_blocks=num_blocks,
            block_size=config.block_size,
            model_id=loaded.model_id,
            model_revision=loaded.revision,
            dtype=dtype_name,
            worker_address=config.worker_address or address,
            num_host_blocks=host.num_blocks if host is not None else 0,
            host_load_seconds_per_block=load_seconds,
            prefill_seconds_per_token=prefill_seconds,
            has_shared_tier=shared is not None,
        ),
        credentials=_blockd_credentials(config),
        worker_token=config.worker_token,
    )
    eos = tuple(dict.fromkeys((*mc.eos_token_ids, *tokenizer.eos_token_ids)))
    scheduler = Scheduler(
        SchedulerConfig(
            block_size=config.block_size,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            decode_steps=config.decode_steps,
        ),
        eos,
    )
    registry = CollectorRegistry()
    engine = Engine(
        scheduler,
        runner,
        directory,
        Histograms(registry) if config.metrics_port is not None else None,
        admission_window=config.admission_window_seconds,
        compute=compute_thread,
    )
    if config.metrics_port is not None:
        log.info(
            "metrics_serving", port=serve_metrics(engine, config.metrics_port, registry, config.metrics_host)
        )
    info = WorkerInfo(
        model_id=loaded.model_id,
        model_revision=loaded.revision,
        architecture=mc.architecture,
        dtype=dtype_name,
        device=device.type,
        block_size=config.block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        vocab_size=mc.vocab_size,
        eos_token_ids=eos,
        blockd_address=config.blockd,
    )
    add_service(GenerationServicer(engine, tokenizer, info), server, "GenerationService")
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return ComputedServer(config, server, engine, health_servicer, address, directory, shared)


async def serve(config: ComputedConfig) -> int:
    configure_logging(config.log_format)
    built = build_server(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    start = asyncio.create_task(built.start())
    await asyncio.wait([start, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    if start.done() and start.exception() is not None:
        raise start.exception()
    await stop.wait()
    log.info("computed_draining", drain_seconds=config.drain_seconds)
    start.cancel()
    await built.stop()
    return 0


def _build_compute(config: ComputedConfig, device: torch.device, dtype: torch.dtype) -> _Compute:
    """Model, pools and runner, and the costs blockd weighs (measured before registering:
    no block is held yet). Runs on the compute thread."""
    if dtype == torch.bfloat16 and native_bfloat16(device):
        # bfloat16 K/V and products, float32 sums (load_model says how): twice float32's
        # products a cycle on this kind of CPU, half its K/V bytes.
        loaded = load_model(config.model, device, torch.float32, products=torch.bfloat16)
    else:
        loaded = load_model(config.model, device, dtype)
    mc = loaded.config
    num_blocks = config.num_blocks or _size_pool(config, mc, dtype, device)
    pool = KVPool(mc.num_layers, num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim, dtype, device)
    host = _host_tier(config, pool)
    shared = None
    if config.shared_tier is not None:
        shared = SharedKV(pool, SharedStore(config.shared_tier, config.shared_tier_timeout_seconds))
    graphs = device.type == "cuda" if config.cuda_graphs is None else config.cuda_graphs
    runner = ModelRunner(
        loaded.model, pool, config.block_size, device, host, shared,
        decode_graphs=graphs, max_num_seqs=config.max_num_seqs, max_context=config.max_model_len,
    )  # fmt: skip
    if device.type == "cuda":  # compile the attention kernel now, not under the first requests
        triton_attention.warm_up(mc.num_heads, mc.num_kv_heads, mc.head_dim, dtype, device)
    load_seconds = prefill_seconds = 0.0
    if host is not None or shared is not None:
        prefill_seconds = runner.measure_prefill_seconds_per_token()
    if host is not None:
        load_seconds = host.measure_load_seconds_per_block()
        log.info(
            "host_tier",
            num_host_blocks=host.num_blocks,
            bytes=host.num_bytes,
            load_seconds_per_block=load_seconds,
            recompute_seconds_per_block=prefill_seconds * config.block_size,
        )
    return _Compute(loaded, host, shared, runner, num_blocks, load_seconds, prefill_seconds)


def _load_cpu_kernels() -> None:
    """Load the native decode kernel (0.1-0.3 s; a first build, without `make install`,
    about 15 s) before the model, in this thread: building imports setuptools, whose import
    hooks must not race the model load's imports in another thread."""
    started = time.monotonic()
    if kernels.paged_decode() is not None:
        log.info(
            "cpu_kernels_ready", kernel="kvcache::paged_decode", seconds=round(time.monotonic() - started, 2)
        )
    else:
        log.warning("cpu_kernels_unavailable", reason=kernels.error(), fallback="torch kernels")


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("computed: --device cuda but CUDA is not available; use --device cpu")
    return torch.device(name)


def _pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def _size_pool(config: ComputedConfig, mc, dtype: torch.dtype, device: torch.device) -> int:
    if device.type == "cuda":
        return KVPool.num_blocks_for_gpu_fraction(
            config.gpu_memory_utilization,
            mc.num_layers,
            config.block_size,
            mc.num_kv_heads,
            mc.head_dim,
            dtype,
            device,
        )
    return KVPool.num_blocks_for_budget(
        config.kv_cache_memory_bytes, mc.num_layers, config.block_size, mc.num_kv_heads, mc.head_dim, dtype
    )


def _host_tier(config: ComputedConfig, pool: KVPool) -> HostKV | None:
    """The host tier --host-kv-memory asks for (see ComputedConfig for the default)."""
    per_block = pool.num_bytes // pool.num_blocks
    budget = config.host_kv_memory_bytes
    if budget is None:
        if pool.device.type != "cuda":
            return None
        budget = min(2 * pool.num_bytes, host_memory.available_bytes() // 2)  # a container's limit too
    if budget == 0:
        return None
    if budget < per_block:
        raise SystemExit(
            f"computed: --host-kv-memory {budget} is less than one KV block ({per_block} bytes); "
            f"give at least {per_block}, or 0 to run without a host tier"
        )
    return HostKV(pool, budget // per_block)


def _bind(server: grpc.aio.Server, config: ComputedConfig) -> str:
    if config.tls_cert is not None:
        client_ca = config.tls_client_ca.read_bytes() if config.tls_client_ca else None
        creds = grpc.ssl_server_credentials(
            [(config.tls_key.read_bytes(), config.tls_cert.read_bytes())],
            root_certificates=client_ca,
            require_client_auth=client_ca is not None,
        )
    else:
        creds = None
    try:
        port = (
            server.add_secure_port(config.listen, creds) if creds else server.add_insecure_port(config.listen)
        )
    except RuntimeError:  # grpc's message names no cause; _bind_error finds it
        port = 0
    if port == 0 and not config.listen.startswith("unix:"):
        raise SystemExit(f"computed: cannot listen on {config.listen}: {_bind_error(config.listen)}")
    if config.listen.startswith("unix:"):
        return config.listen
    host = config.listen.rsplit(":", 1)[0]
    return f"{host}:{port}"


def _bind_error(listen: str) -> str:
    """Why `listen` cannot be bound ("address in use" where a plain socket can tell)."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.bind((host, int(port)))
    except (OSError, ValueError) as exc:
        if getattr(exc, "errno", None) == errno.EADDRINUSE:
            return "address in use (another process listens there; one daemon per port)"
        return str(exc)
    return "gRPC refused it"


def _blockd_credentials(config: ComputedConfig) -> grpc.ChannelCredentials | None:
    if config.blockd_tls_ca is None:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=config.blockd_tls_ca.read_bytes(),
        private_key=config.blockd_tls_key.read_bytes() if config.blockd_tls_key else None,
        certificate_chain=config.blockd_tls_cert.read_bytes() if config.blockd_tls_cert else None,
    )


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)
