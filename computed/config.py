"""computed's configuration: frozen, validated, built once in __main__."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# The project's own small Llama, trained offline on the Python standard library.
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default_model"
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOG_FORMATS = ("auto", "console", "json")
# Which thread runs the forward: the event loop's (it waits out each step) or a thread of
# its own (the loop serves during a step); computed/compute_thread.py says why loop.
FORWARD_ON = ("loop", "thread")
# blockd's worker token (--worker-token); the directory client reads it from here too.
WORKER_TOKEN_ENV = "COMPUTED_WORKER_TOKEN"


@dataclass(frozen=True)
class ComputedConfig:
    listen: str = "127.0.0.1:50052"
    blockd: str = "127.0.0.1:50051"
    model: Path = DEFAULT_MODEL_DIR
    # The model id clients name in requests (and the gateway lists in /v1/models); None: the
    # checkpoint's own (`_name_or_path` when it names a hub repo, else the HF cache's repo name,
    # else the folder's name). Part of the cache namespace, as vLLM's --served-model-name.
    served_model_name: str | None = None
    device: str = "auto"
    # auto: float32 on CPU (exactness against the reference), bfloat16 on CUDA.
    dtype: str = "auto"
    # Tokens per KV block; must equal what blockd registers for this pool.
    block_size: int = 16
    # Pool size in blocks; None sizes it from kv_cache_memory_bytes (CPU) or
    # gpu_memory_utilization (CUDA).
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = 512 * 1024 * 1024
    # As vLLM's flag: the share of the GPU's total memory this process may use. The pool gets
    # this share of the total less what is in use once the weights are loaded (activations
    # are not profiled ahead as vLLM does: the 10% left over is their headroom).
    gpu_memory_utilization: float = 0.9
    # The host tier (a second KV store in host memory, pinned on CUDA) in bytes; 0
    # disables it. None: on CUDA twice the device pool, at most half the host memory
    # available at start; on CPU none (the device pool is host memory already: a
    # bigger --kv-cache-memory serves better than the same bytes behind a copy).
    host_kv_memory_bytes: int | None = None
    max_num_seqs: int = 64
    # Model tokens per step (only uncached tokens are charged); longer prompts are
    # prefilled in chunks.
    max_num_batched_tokens: int = 2048
    # After idling, once requests have been seen arriving together (a client's concurrent
    # streams land over a few ms), the first step waits for the next ones: until none has
    # come for a quarter of this, at most this long. 0: step at the first arrival.
    admission_window_seconds: float = 0.02
    # Decode steps one iteration may run back to back while every running sequence
    # decodes and no request waits (an arrival ends the burst after its current step);
    # 1: an iteration (schedule, directory Step, thread hand-off) per step.
    decode_steps: int = 8
    # "thread": the loop keeps admitting requests during a step; "loop" saves a thread wake a
    # step but admits a burst over several steps (compute_thread.py measured both).
    forward_on: str = "thread"
    # Plain decode steps replayed as CUDA graphs at a ladder of batch sizes
    # (computed/decode_graphs.py). None: on CUDA only; on CPU the same static buffers run
    # eagerly, 1.39x an eager 1-row step and 1.44x 20 rows padded to 32 (`python -m
    # bench.decode_graphs`, 1 thread), so off there.
    cuda_graphs: bool | None = None
    # None: the model's max_position_embeddings.
    max_model_len: int | None = None
    # Address clients use to reach this worker (announced to blockd for routing);
    # None: the bound listen address.
    worker_address: str | None = None
    ready_file: Path | None = None
    log_format: str = "auto"
    metrics_port: int | None = None
    # Loopback by default; 0.0.0.0 where a Prometheus outside the host scrapes it (a pod).
    metrics_host: str = "127.0.0.1"
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    # CA bundle to verify blockd's certificate (TLS to blockd when set).
    blockd_tls_ca: Path | None = None
    blockd_tls_cert: Path | None = None
    blockd_tls_key: Path | None = None
    # Sent as 'authorization: Bearer <token>' on every call to blockd; needed when blockd
    # runs with --worker-token. None: blockd's worker API is open (loopback).
    worker_token: str | None = None
    # SIGTERM: stop admitting, let running requests finish this long, cancel the rest.
    drain_seconds: float = 30.0
    # The shared tier's store, redis://HOST:PORT[/DB] or rediss:// (the password from
    # KVCACHE_SHARED_TIER_PASSWORD). None: no shared tier.
    shared_tier: str | None = None
    # A fetch slower than this is a miss (the tokens are computed): a slow store must
    # never make a hit slower than a miss by much.
    shared_tier_timeout_seconds: float = 0.1
    # Seconds to fetch one block, for blockd's "fetch only when it pays"; None: measured
    # at start-up (0: unknown, always fetch).
    shared_tier_load_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.forward_on not in FORWARD_ON:
            raise ValueError(f"--forward-on must be one of {', '.join(FORWARD_ON)}, got {self.forward_on!r}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}")
        if not 1 <= self.block_size <= 1024:
            raise ValueError(f"--block-size must be in 1..1024, got {self.block_size}")
        if self.num_blocks is not None and not 1 <= self.num_blocks <= 16_777_216:
            raise ValueError(f"--num-blocks must be in 1..16777216, got {self.num_blocks}")
        if self.kv_cache_memory_bytes < 1:
            raise ValueError("--kv-cache-memory must be positive")
        if self.host_kv_memory_bytes is not None and self.host_kv_memory_bytes < 0:
            raise ValueError(
                f"--host-kv-memory must be >= 0 bytes (0 disables the host tier), got {self.host_kv_memory_bytes}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("--gpu-memory-utilization must be in (0, 1]")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("--max-num-seqs and --max-num-batched-tokens must be >= 1")
        if not 1 <= self.decode_steps <= 64:
            raise ValueError(f"--decode-steps must be in 1..64, got {self.decode_steps}")
        if not 0.0 <= self.admission_window_seconds <= 1.0:
            raise ValueError(
                f"--admission-window-ms must be in 0..1000, got {self.admission_window_seconds * 1e3:g}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("--max-model-len must be >= 2")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if (self.blockd_tls_cert is None) != (self.blockd_tls_key is None):
            raise ValueError("--blockd-tls-cert and --blockd-tls-key go together")
        if self.worker_token is not None and not self.worker_token.strip():
            raise ValueError("--worker-token must not be blank (omit it for an open blockd)")
        if self.shared_tier is not None and not self.shared_tier.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ValueError(
                f"--shared-tier must be a redis://HOST:PORT[/DB] or rediss:// URL, got {self.shared_tier!r}"
            )
        if not 0 < self.shared_tier_timeout_seconds <= 60:
            raise ValueError("--shared-tier-timeout must be in (0, 60] seconds")
        if self.shared_tier_load_seconds is not None and self.shared_tier_load_seconds < 0:
            raise ValueError("--shared-tier-load-seconds must be >= 0 (0: always fetch)")
        if self.drain_seconds < 0:
            raise ValueError("--drain-seconds must be >= 0")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("--served-model-name must not be blank (omit it to use the checkpoint's name)")
        if not (self.model / "config.json").is_file():
            raise ValueError(missing_model_message(self.model))


def looks_like_hub_id(value: str) -> bool:
    """ORG/NAME as the Hugging Face Hub spells repositories (and no local path)."""
    org, sep, name = value.partition("/")
    return bool(sep and org and name) and "/" not in name and not value.startswith((".", "~"))


def hub_cache_dirs() -> list[Path]:
    """Where huggingface_hub keeps downloads: HF_HUB_CACHE, HF_HOME/hub, ~/.cache/huggingface/hub."""
    dirs = [os.environ.get("HF_HUB_CACHE"), os.environ.get("HF_HOME") and f"{os.environ['HF_HOME']}/hub"]
    return [Path(d) for d in dirs if d] + [Path.home() / ".cache" / "huggingface" / "hub"]


def resolve_model(value: str) -> Path:
    """--model as a folder: the folder itself, else (a hub id such as Qwen/Qwen3-0.6B) its newest
    complete snapshot in the local Hugging Face cache; else the value as given (validation
    then says what to do). computed never downloads."""
    path = Path(value).expanduser()
    if path.exists() or not looks_like_hub_id(value):
        return path
    for cache in hub_cache_dirs():
        snapshots = cache / f"models--{value.replace('/', '--')}" / "snapshots"
        found = sorted(
            (s for s in snapshots.glob("*") if (s / "config.json").is_file()),
            key=lambda s: s.stat().st_mtime,
        )
        if found:
            return found[-1]
    return path


def missing_model_message(model: Path) -> str:
    """One line for a --model without config.json: a hub id gets how to download it."""
    text = str(model)
    if not model.exists() and looks_like_hub_id(text):
        folder = f"models/{text.rpartition('/')[2]}"
        return (
            f"--model {text}: no such folder, and computed does not download from the Hugging Face Hub "
            f"(nor found it in the local hub cache); download it first, e.g. "
            f"`hf download {text} --local-dir {folder}` (`huggingface-cli download` in older "
            f"huggingface_hub), then --model {folder}"
        )
    if not model.exists():
        return f"--model {text}: no such folder (give a Hugging Face checkpoint folder: config.json, *.safetensors)"
    return f"--model {text}: no config.json there (give a Hugging Face checkpoint folder: config.json, *.safetensors)"
