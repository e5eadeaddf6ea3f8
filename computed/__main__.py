"""`computed`: the compute daemon (model + paged KV pool), a worker of blockd."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
from pathlib import Path

from computed.config import (
    DEFAULT_MODEL_DIR,
    DEVICES,
    DTYPES,
    FORWARD_ON,
    LOG_FORMATS,
    WORKER_TOKEN_ENV,
    ComputedConfig,
    resolve_model,
)


def _env(name: str, default=None):
    return os.environ.get(name, default)


def _optional_path(value: str | None) -> Path | None:
    return Path(value) if value else None


def parse_args(argv: list[str] | None = None) -> ComputedConfig:
    p = argparse.ArgumentParser(
        prog="computed",
        description="Compute daemon: serves a Llama-family model with a paged KV pool whose "
        "blocks blockd indexes for prefix caching.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--listen",
        default=_env("COMPUTED_LISTEN", "127.0.0.1:50052"),
        help="gRPC listen address, host:port or unix:PATH [env COMPUTED_LISTEN]",
    )
    p.add_argument(
        "--blockd",
        default=_env("COMPUTED_BLOCKD", "127.0.0.1:50051"),
        help="blockd address [env COMPUTED_BLOCKD]",
    )
    p.add_argument(
        "--model",
        default=_env("COMPUTED_MODEL", str(DEFAULT_MODEL_DIR)),
        help="Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer.json), or a hub id "
        "already in the local hub cache (computed never downloads); default: the built-in model "
        "[env COMPUTED_MODEL]",
    )
    p.add_argument(
        "--served-model-name",
        default=_env("COMPUTED_SERVED_MODEL_NAME"),
        help="the model id clients name in requests (default: the checkpoint's `_name_or_path` when it "
        "names a hub repo, else the hub cache's repo name, else the folder's name) "
        "[env COMPUTED_SERVED_MODEL_NAME]",
    )
    p.add_argument(
        "--device",
        choices=DEVICES,
        default=_env("COMPUTED_DEVICE", "auto"),
        help="auto picks cuda when available [env COMPUTED_DEVICE]",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default=_env("COMPUTED_DTYPE", "auto"),
        help="auto: float32 on CPU, bfloat16 on CUDA; bfloat16 on CPU keeps weights, K/V and products' inputs in bfloat16, sums in float32 [env COMPUTED_DTYPE]",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=int(_env("COMPUTED_BLOCK_SIZE", "16")),
        help="tokens per KV block [env COMPUTED_BLOCK_SIZE]",
    )
    p.add_argument(
        "--num-blocks",
        type=int,
        default=_env("COMPUTED_NUM_BLOCKS"),
        help="KV pool size in blocks (default: sized from --kv-cache-memory on CPU, "
        "--gpu-memory-utilization on CUDA) [env COMPUTED_NUM_BLOCKS]",
    )
    p.add_argument(
        "--kv-cache-memory",
        type=int,
        default=int(_env("COMPUTED_KV_CACHE_MEMORY", 512 << 20)),
        help="KV pool bytes on CPU when --num-blocks is not given [env COMPUTED_KV_CACHE_MEMORY]",
    )
    p.add_argument(
        "--host-kv-memory",
        type=int,
        metavar="BYTES",
        default=_env("COMPUTED_HOST_KV_MEMORY"),
        help="host tier bytes: evicted KV is demoted there and loaded back on a hit; 0 disables it "
        "(default: on CUDA twice the device pool, at most half the free host memory; on CPU 0) "
        "[env COMPUTED_HOST_KV_MEMORY]",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=float(_env("COMPUTED_GPU_MEMORY_UTILIZATION", "0.9")),
        help="share of the GPU's total memory this process may use, as vLLM's flag: the KV pool gets it "
        "less what the loaded weights use [env COMPUTED_GPU_MEMORY_UTILIZATION]",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=int(_env("COMPUTED_MAX_NUM_SEQS", "64")),
        help="sequences running at once [env COMPUTED_MAX_NUM_SEQS]",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=int(_env("COMPUTED_MAX_NUM_BATCHED_TOKENS", "2048")),
        help="model tokens per step; longer prefills are chunked [env COMPUTED_MAX_NUM_BATCHED_TOKENS]",
    )
    p.add_argument(
        "--admission-window-ms",
        type=float,
        default=float(_env("COMPUTED_ADMISSION_WINDOW_MS", "20")),
        help="after idling, once requests have come together, wait up to this long for the next ones before "
        "the first step (until none came for a quarter of it; 0: step at once) [env COMPUTED_ADMISSION_WINDOW_MS]",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=_env("COMPUTED_MAX_MODEL_LEN"),
        help="longest prompt + completion (default: the model's) [env COMPUTED_MAX_MODEL_LEN]",
    )
    p.add_argument(
        "--worker-address",
        default=_env("COMPUTED_WORKER_ADDRESS"),
        help="address announced to blockd, where the gateway and clients reach this worker (default: the "
        "bound address; a wildcard host such as 0.0.0.0 becomes this host's address, its container or "
        "pod IP) [env COMPUTED_WORKER_ADDRESS]",
    )
    p.add_argument(
        "--ready-file",
        default=_env("COMPUTED_READY_FILE"),
        help="write the bound address here once serving [env COMPUTED_READY_FILE]",
    )
    p.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=_env("COMPUTED_LOG_FORMAT", "auto"),
        help="auto: console on a TTY, JSON otherwise [env COMPUTED_LOG_FORMAT]",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=_env("COMPUTED_METRICS_PORT"),
        help="serve Prometheus metrics on this port (0: any free port) [env COMPUTED_METRICS_PORT]",
    )
    p.add_argument(
        "--metrics-host",
        default=_env("COMPUTED_METRICS_HOST", "127.0.0.1"),
        help="interface of the metrics endpoint (0.0.0.0 for a scraper outside the host) [env COMPUTED_METRICS_HOST]",
    )
    p.add_argument("--tls-cert", default=_env("COMPUTED_TLS_CERT"), help="server certificate (PEM)")
    p.add_argument("--tls-key", default=_env("COMPUTED_TLS_KEY"), help="server private key (PEM)")
    p.add_argument(
        "--tls-client-ca",
        default=_env("COMPUTED_TLS_CLIENT_CA"),
        help="require client certificates signed by this CA",
    )
    p.add_argument(
        "--blockd-tls-ca",
        default=_env("COMPUTED_BLOCKD_TLS_CA"),
        help="connect to blockd over TLS, verifying it with this CA",
    )
    p.add_argument(
        "--blockd-tls-cert",
        default=_env("COMPUTED_BLOCKD_TLS_CERT"),
        help="client certificate presented to blockd",
    )
    p.add_argument(
        "--blockd-tls-key", default=_env("COMPUTED_BLOCKD_TLS_KEY"), help="client key presented to blockd"
    )
    p.add_argument(
        "--worker-token",
        default=_env(WORKER_TOKEN_ENV),
        help="blockd's worker token, sent as 'authorization: Bearer <token>' on every call "
        "to blockd (blockd --worker-token) [env COMPUTED_WORKER_TOKEN]",
    )
    p.add_argument(
        "--decode-steps",
        type=int,
        default=int(_env("COMPUTED_DECODE_STEPS", "8")),
        help="decode steps a burst may run back to back while every running request decodes and none "
        "waits (1: back to the scheduler after every step) [env COMPUTED_DECODE_STEPS]",
    )
    p.add_argument(
        "--forward-on",
        choices=FORWARD_ON,
        default=_env("COMPUTED_FORWARD_ON", "thread"),
        help="the thread that runs each step's forward: one of its own (the loop keeps serving "
        "during a step) or the event loop's (a step's end wakes no thread: faster for steady "
        "streams, but requests arriving during a step are admitted over the next few) "
        "[env COMPUTED_FORWARD_ON]",
    )
    p.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="decode steps replayed as CUDA graphs at a ladder of batch sizes (default: on CUDA, "
        "off elsewhere; on CPU --cuda-graphs runs the same static buffers eagerly)",
    )
    p.add_argument(
        "--drain-seconds",
        type=float,
        default=float(_env("COMPUTED_DRAIN_SECONDS", "30")),
        help="on SIGTERM, let running requests finish this long [env COMPUTED_DRAIN_SECONDS]",
    )
    p.add_argument(
        "--shared-tier",
        default=_env("COMPUTED_SHARED_TIER"),
        metavar="URL",
        help="the shared tier's Valkey/Redis store, redis://HOST:PORT[/DB] (rediss:// for TLS; the password "
        "from KVCACHE_SHARED_TIER_PASSWORD): committed blocks are written there and fetched by any worker "
        "of the same model [env COMPUTED_SHARED_TIER]",
    )
    p.add_argument(
        "--shared-tier-timeout",
        type=float,
        metavar="SECONDS",
        default=float(_env("COMPUTED_SHARED_TIER_TIMEOUT", "0.1")),
        help="a shared tier fetch slower than this is a miss [env COMPUTED_SHARED_TIER_TIMEOUT]",
    )
    p.add_argument(
        "--shared-tier-load-seconds",
        type=float,
        metavar="SECONDS",
        default=_env("COMPUTED_SHARED_TIER_LOAD_SECONDS"),
        help="seconds to fetch one block, for blockd's fetch-or-recompute choice (default: measured at "
        "start; 0: always fetch) [env COMPUTED_SHARED_TIER_LOAD_SECONDS]",
    )
    a = p.parse_args(argv)
    try:
        return ComputedConfig(
            listen=a.listen,
            blockd=a.blockd,
            model=resolve_model(a.model),
            served_model_name=a.served_model_name or None,
            device=a.device,
            dtype=a.dtype,
            block_size=a.block_size,
            num_blocks=int(a.num_blocks) if a.num_blocks is not None else None,
            kv_cache_memory_bytes=a.kv_cache_memory,
            host_kv_memory_bytes=int(a.host_kv_memory) if a.host_kv_memory is not None else None,
            gpu_memory_utilization=a.gpu_memory_utilization,
            max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=a.max_num_batched_tokens,
            admission_window_seconds=a.admission_window_ms / 1e3,
            decode_steps=a.decode_steps,
            forward_on=a.forward_on,
            cuda_graphs=a.cuda_graphs,
            max_model_len=int(a.max_model_len) if a.max_model_len is not None else None,
            worker_address=announced_address(a.worker_address, a.listen),
            ready_file=_optional_path(a.ready_file),
            log_format=a.log_format,
            metrics_port=int(a.metrics_port) if a.metrics_port is not None else None,
            metrics_host=a.metrics_host,
            tls_cert=_optional_path(a.tls_cert),
            tls_key=_optional_path(a.tls_key),
            tls_client_ca=_optional_path(a.tls_client_ca),
            blockd_tls_ca=_optional_path(a.blockd_tls_ca),
            blockd_tls_cert=_optional_path(a.blockd_tls_cert),
            blockd_tls_key=_optional_path(a.blockd_tls_key),
            worker_token=a.worker_token or None,  # an empty env value (compose): no token
            drain_seconds=a.drain_seconds,
            shared_tier=a.shared_tier or None,
            shared_tier_timeout_seconds=a.shared_tier_timeout,
            shared_tier_load_seconds=float(a.shared_tier_load_seconds)
            if a.shared_tier_load_seconds is not None
            else None,
        )
    except ValueError as exc:
        p.error(str(exc))


def announced_address(worker_address: str | None, listen: str) -> str | None:
    """The address to announce: a wildcard host (0.0.0.0, ::, or none) in --worker-address, or
    in a fixed-port --listen when no --worker-address is given, becomes this host's address
    (what its hostname resolves to: the container's or pod's IP), so workers scaled from one
    template register where they are reached. None: the bound address (server.py)."""
    address = worker_address or (None if listen.startswith("unix:") else listen)
    if address is None:
        return None
    host, sep, port = address.rpartition(":")
    if not sep or host.strip("[]") not in ("", "0.0.0.0", "::"):
        return worker_address
    if port == "0":
        return worker_address
    return f"{socket.gethostbyname(socket.gethostname())}:{port}"


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    if os.environ.get("COMPUTED_KERNEL_POOL") != "omp":
        # The native kernels run on their own threads (computed/kernels/parallel.h); torch's
        # OpenMP team serves only the few torch ops left, and an active team spinning after
        # them takes the cores from the kernels' threads (a 32-row x 16-token prefill over
        # 1,024 cached tokens: 18.1 ms active against 13.1 passive, 2 cores). Read by the
        # OpenMP runtime when torch loads, below.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from computed.model.config import UnsupportedModelError
    from computed.model.loader import CheckpointError
    from computed.server import serve  # heavy imports (torch) only after --help

    try:
        return asyncio.run(serve(config))
    except (UnsupportedModelError, CheckpointError, FileNotFoundError) as error:
        # A checkpoint this server cannot run: one line naming the file and the fix, no traceback.
        sys.stderr.write(f"computed: {error}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
