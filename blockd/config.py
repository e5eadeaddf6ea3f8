"""Frozen, validated configuration: the directory's limits and the daemon's flags."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from blockd.eviction import DEFAULT_POLICY, POLICY_NAMES

MAX_POOL_BLOCKS = 16_777_216
MAX_BLOCK_SIZE = 1024
LOG_FORMATS = ("auto", "console", "json")
EVENT_LOOPS = ("auto", "uvloop", "asyncio")  # the gateway's --loop words
SHARED_TIER_SCHEMES = ("redis://", "rediss://", "unix://")


@dataclass(frozen=True)
class DirectoryConfig:
    """Limits and policies of the pure directory core."""

    # Long enough for 128K-context models; a prompt beyond it is INVALID_ARGUMENT.
    max_sequence_tokens: int = 131_072
    # A lease lapses this long after the worker's last RegisterPool/RenewLease/Step.
    lease_ttl_seconds: float = 10.0
    # A device eviction demotes a block to its worker's host tier when it was seen
    # (computed or hit, on any pool: `blockd.sightings`) more than this many times
    # (0: every evicted block; 1: seen twice, i.e. not a one-off).
    demote_min_hits: int = 0
    eviction_policy: str = DEFAULT_POLICY
    # Hashes each pool remembers after they leave its index (blockd.ghosts): for miss
    # reasons and the uses a recommitted block gets back. Per block of the pool, capped.
    ghosts_per_block: float = 2.0
    max_ghosts: int = 1_048_576
    # At most this share of each pool's blocks may be pinned (Pin answers
    # RESOURCE_EXHAUSTED past it), so pins never starve the requests.
    pin_budget: float = 0.5
    # Events kept for WatchEvents replay; older ones are answered with a GAP.
    event_log_capacity: int = 10_000
    # ... and at most this many bytes of them (STORED events carry their tokens).
    event_log_max_bytes: int = 64 * 1024 * 1024
    # Blocks of the shared tier blockd indexes per namespace (least recently used leave
    # first; their values stay in the store until the server evicts them).
    shared_index_max_blocks: int = 1 << 20
    # Route skips a pool whose load exceeds the least loaded pool's by more than this,
    # so one worker holding a hot prefix is not swamped.
    route_load_margin: float = 0.25
    # Epoch given to a pool id the directory has never seen. The server passes the
    # wall clock in ms so epochs keep growing across blockd restarts (fencing).
    initial_epoch: int = 1
    # Pool records kept (live pools and tombstones of lapsed ones). When full, the
    # tombstone that lapsed first is forgotten; with only live pools, RESOURCE_EXHAUSTED.
    max_pools: int = 1_024

    def __post_init__(self) -> None:
        if not 1 <= self.max_sequence_tokens <= 16_777_216:
            raise ValueError(f"max_sequence_tokens must be 1 .. 16777216, got {self.max_sequence_tokens}")
        if not (math.isfinite(self.lease_ttl_seconds) and 0 < self.lease_ttl_seconds <= 86_400):
            raise ValueError(f"lease_ttl_seconds must be in (0, 86400], got {self.lease_ttl_seconds}")
        if self.eviction_policy not in POLICY_NAMES:
            raise ValueError(f"eviction_policy must be one of {POLICY_NAMES}, got {self.eviction_policy!r}")
        if not (math.isfinite(self.ghosts_per_block) and 0 <= self.ghosts_per_block <= 64):
            raise ValueError(f"ghosts_per_block must be in [0, 64], got {self.ghosts_per_block}")
        if self.max_ghosts < 0:
            raise ValueError(f"max_ghosts must be >= 0, got {self.max_ghosts}")
        if not (math.isfinite(self.pin_budget) and 0 <= self.pin_budget <= 1):
            raise ValueError(f"pin_budget must be in [0, 1], got {self.pin_budget}")
        if self.event_log_capacity < 1:
            raise ValueError(f"event_log_capacity must be >= 1, got {self.event_log_capacity}")
        if self.shared_index_max_blocks < 1:
            raise ValueError(f"shared_index_max_blocks must be >= 1, got {self.shared_index_max_blocks}")
        if self.demote_min_hits < 0:
            raise ValueError(f"demote_min_hits must be >= 0, got {self.demote_min_hits}")
        if self.event_log_max_bytes < 1:
            raise ValueError(f"event_log_max_bytes must be >= 1, got {self.event_log_max_bytes}")
        if not 0 <= self.route_load_margin <= 1:
            raise ValueError(f"route_load_margin must be in [0, 1], got {self.route_load_margin}")
        if self.initial_epoch < 1:
            raise ValueError(f"initial_epoch must be >= 1, got {self.initial_epoch}")


@dataclass(frozen=True)
class TlsConfig:
    cert_file: Path
    key_file: Path
    # When set, clients must present a certificate signed by this CA.
    client_ca_file: Path | None = None

    def __post_init__(self) -> None:
        for path in (self.cert_file, self.key_file, self.client_ca_file):
            if path is not None and not path.is_file():
                raise ValueError(f"TLS file not found: {path}")


@dataclass(frozen=True)
class BlockdConfig:
    """The daemon: where it listens, who may administer it, and the core's limits."""

    listen: str = "127.0.0.1:50051"  # host:port, [v6]:port or unix:PATH
    admin_token: str | None = None  # None: admin calls need no token
    # None: worker calls need no token and a live pool may be re-registered without
    # its pool token (an open worker API, for a loopback or private network).
    worker_token: str | None = None
    route_token: str | None = None  # None: Route needs no token
    ready_file: Path | None = None
    metrics_port: int | None = None  # None: no Prometheus endpoint
    metrics_host: str = "127.0.0.1"
    log_format: str = "auto"
    # auto: uvloop's event loop when installed (a C loop), else asyncio's. bench.blockd_fleet's
    # closed loop on uvloop: 4,463 against 4,359 Steps/s (means of 4 pairs, each pair's order
    # alternating; uvloop ahead in 3): a small gain, the loop's own share of a Step is small.
    event_loop: str = "auto"
    tls: TlsConfig | None = None
    # Seconds in-flight calls get to finish on SIGTERM/SIGINT.
    shutdown_grace_seconds: float = 5.0
    directory: DirectoryConfig = field(default_factory=DirectoryConfig)
    # Test hook (env BLOCKD_TEST_HASH_BYTES): truncate block hashes to force collisions.
    test_hash_bytes: int | None = None
    # The shared tier's store (redis://HOST:PORT[/DB], rediss:// for TLS): blockd rebuilds
    # its index from it at start and deletes what a Flush drops. None: the index starts
    # empty and a Flush forgets records without deleting keys.
    shared_tier: str | None = None
    # Seconds between re-reads of the store's index after the start-up rebuild (None: at
    # start only). With shards, what other shards' workers wrote becomes findable here.
    shared_tier_reread_seconds: float | None = None

    def __post_init__(self) -> None:
        if not self.listen.startswith("unix:") and ":" not in self.listen:
            raise ValueError(f"listen must be HOST:PORT or unix:PATH, got {self.listen!r}")
        for name, token in (
            ("admin", self.admin_token),
            ("worker", self.worker_token),
            ("route", self.route_token),
        ):
            if token is not None and not token.strip():
                raise ValueError(f"{name} token must not be blank (omit it to disable {name} auth)")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65_535:
            raise ValueError(f"metrics port must be 0 .. 65535, got {self.metrics_port}")
        if self.test_hash_bytes is not None and not 1 <= self.test_hash_bytes <= 16:
            raise ValueError(f"BLOCKD_TEST_HASH_BYTES must be 1 .. 16, got {self.test_hash_bytes}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log format must be one of {LOG_FORMATS}, got {self.log_format!r}")
        if self.event_loop not in EVENT_LOOPS:
            raise ValueError(f"--loop must be one of {', '.join(EVENT_LOOPS)}, got {self.event_loop!r}")
        if self.shared_tier is not None and not self.shared_tier.startswith(SHARED_TIER_SCHEMES):
            raise ValueError(
                f"--shared-tier must be a redis://HOST:PORT[/DB] or rediss:// URL, got {self.shared_tier!r}"
            )
        if self.shared_tier_reread_seconds is not None:
            if self.shared_tier is None:
                raise ValueError("--shared-tier-reread-seconds needs --shared-tier")
            if not 0.1 <= self.shared_tier_reread_seconds <= 86_400:
                raise ValueError(
                    f"--shared-tier-reread-seconds must be 0.1 .. 86400, got {self.shared_tier_reread_seconds}"
                )
        if not 0 <= self.shutdown_grace_seconds <= 300:
            raise ValueError(f"shutdown grace must be 0 .. 300 s, got {self.shutdown_grace_seconds}")
