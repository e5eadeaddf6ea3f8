"""The gateway's configuration: frozen, validated, built once in __main__."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.routing import POLICIES

ROUTING_MODES = tuple(POLICIES)
LOG_FORMATS = ("auto", "console", "json")
EVENT_LOOPS = ("auto", "uvloop", "asyncio")
HTTP_PARSERS = ("auto", "httptools", "h11")


@dataclass(frozen=True)
class GatewayConfig:
    listen: str = "127.0.0.1:8000"
    # None: no blockd, every request goes to the least-loaded worker of its model.
    blockd: str | None = "127.0.0.1:50051"
    computed: tuple[str, ...] = ("127.0.0.1:50052",)
    # A policy of gateway.routing. cache-aware: the directory mirror (else blockd's Route) says
    # what each worker caches, the queue each one has says what waiting there costs
    # (least-loaded when neither can answer); prefix: cache affinity only; least-loaded,
    # round-robin: never ask blockd.
    routing: str = "cache-aware"
    # API key -> tenant; empty: open (every caller shares one cache, said at start-up).
    api_keys: Mapping[str, str] = field(default_factory=dict)
    # The first N prompt tokens are hashed without the tenant's salt (a shared system prompt).
    public_prefix_tokens: int = 0
    # Requests a worker may have in flight from this gateway; all full -> 429.
    max_inflight_per_worker: int = 256
    # Deadline of one whole generation (-> 504).
    request_timeout: float = 600.0
    # Deadline of Tokenize/Route/GetModelInfo; blockd slower than this is skipped.
    route_timeout: float = 1.0
    # Serve blockd's live pools' workers too (their announced addresses, read by ListPools every
    # second): scaling the workers needs no restart. Needs blockd (and its admin token if it has one).
    discover: bool = True
    # blockd's route token (blockd --route-token), sent on Route.
    route_token: str | None = None
    # The directory mirror (gateway.mirror): blockd's block index kept here from its event
    # stream, so a routed request needs no Route round trip (Route serves while it is out of
    # sync). Off: every routed request asks Route.
    mirror: bool = True
    # Each worker's requests on one GenerateMany stream (gateway/worker_stream.py): one
    # message per engine step for all of them. Off: a Generate call per request.
    generate_many: bool = True
    # blockd shards whose event streams feed the mirror, one mirror each (docs/sharding.md):
    # with shards, --blockd is the fleet router (Route, ListPools) and every shard streams its
    # own pools' events. Empty: the mirror follows --blockd itself.
    blockd_shards: tuple[str, ...] = ()
    # The most block hashes the mirror holds (about 100 bytes each); above it, Route serves.
    mirror_max_blocks: int = 4_000_000
    # blockd's admin token (blockd --admin-token): the mirror's calls (ListPools, ListBlocks,
    # GetStats, WatchEvents) are admin calls.
    blockd_admin_token: str | None = None
    ready_file: str | None = None
    log_format: str = "auto"
    # SIGTERM: stop accepting, let running requests finish this long.
    drain_seconds: float = 30.0
    # model id -> checkpoint folder whose tokenizer the gateway runs itself (no Tokenize call).
    tokenizers: Mapping[str, str] = field(default_factory=dict)
    # auto: uvloop and httptools when installed (C event loop and HTTP parser: less time per
    # request in the gateway), else asyncio's loop and h11.
    event_loop: str = "auto"
    http: str = "auto"

    def __post_init__(self) -> None:
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"--listen must be HOST:PORT, got {self.listen!r}")
        if not self.computed and not (self.blockd and self.discover):
            raise ValueError(
                "need a --computed address, or --blockd with --discover to learn the workers from it"
            )
        if self.blockd_shards and not self.blockd:
            raise ValueError("--blockd-shard needs --blockd (the fleet router that answers Route)")
        for address in (*self.computed, *([self.blockd] if self.blockd else []), *self.blockd_shards):
            if address.rpartition(":")[2] == "" or "://" in address:
                raise ValueError(f"daemon addresses are HOST:PORT, got {address!r}")
        if self.routing not in ROUTING_MODES:
            raise ValueError(f"--routing must be one of {', '.join(ROUTING_MODES)}, got {self.routing!r}")
        if self.event_loop not in EVENT_LOOPS:
            raise ValueError(f"--loop must be one of {', '.join(EVENT_LOOPS)}, got {self.event_loop!r}")
        if self.http not in HTTP_PARSERS:
            raise ValueError(f"--http must be one of {', '.join(HTTP_PARSERS)}, got {self.http!r}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}")
        if self.public_prefix_tokens < 0:
            raise ValueError("--public-prefix-tokens must be >= 0")
        if self.mirror_max_blocks < 1:
            raise ValueError("--mirror-max-blocks must be >= 1")
        if self.max_inflight_per_worker < 1:
            raise ValueError("--max-inflight-per-worker must be >= 1")
        if self.request_timeout <= 0 or self.route_timeout <= 0 or self.drain_seconds < 0:
            raise ValueError("timeouts must be > 0 (drain >= 0)")

    @property
    def host(self) -> str:
        return self.listen.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.listen.rpartition(":")[2])
