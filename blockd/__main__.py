"""`blockd`: the block-directory daemon. Flags fall back to BLOCKD_* environment variables."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import structlog

from blockd import native

# The daemon's directory core is the compiled one where its build is current (blockd.native):
# chosen before the modules below import it. Imported as a library (tests), it stays pure.
if __name__ == "__main__":
    _native_status = native.enable_for_daemon()

from blockd.config import EVENT_LOOPS, BlockdConfig, DirectoryConfig, TlsConfig
from blockd.eviction import POLICY_NAMES
from blockd.logs import configure_logging


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"BLOCKD_{name}", default)


def build_parser() -> argparse.ArgumentParser:
    defaults = DirectoryConfig()
    parser = argparse.ArgumentParser(
        prog="blockd",
        description="Block directory of a prefix-caching KV block service: chained block "
        "hashes, the hash index, references under leases, leaf-first LRU eviction, pins and stats.",
    )
    parser.add_argument(
        "--listen",
        default=_env("LISTEN", "127.0.0.1:50051"),
        help="HOST:PORT (port 0 picks a free one) or unix:PATH [BLOCKD_LISTEN; 127.0.0.1:50051]",
    )
    parser.add_argument(
        "--lease-ttl",
        type=float,
        default=_env("LEASE_TTL", "10"),
        metavar="SECONDS",
        help="a worker's pool is dropped this long after its last call [BLOCKD_LEASE_TTL; 10]",
    )
    parser.add_argument(
        "--admin-token",
        default=_env("ADMIN_TOKEN"),
        metavar="TOKEN",
        help="require 'authorization: Bearer TOKEN' on admin calls [BLOCKD_ADMIN_TOKEN]",
    )
    parser.add_argument(
        "--worker-token",
        default=_env("WORKER_TOKEN"),
        metavar="TOKEN",
        help="require 'authorization: Bearer TOKEN' on worker calls (RegisterPool, RenewLease, Step, "
        "Resync), and a live pool's own pool_token to re-register it; without it the worker API is "
        "open (loopback only) [BLOCKD_WORKER_TOKEN]",
    )
    parser.add_argument(
        "--route-token",
        default=_env("ROUTE_TOKEN"),
        metavar="TOKEN",
        help="require 'authorization: Bearer TOKEN' on Route [BLOCKD_ROUTE_TOKEN]",
    )
    parser.add_argument(
        "--max-sequence-tokens",
        type=int,
        metavar="N",
        default=_env("MAX_SEQUENCE_TOKENS", str(defaults.max_sequence_tokens)),
        help=f"longest token list per sequence [BLOCKD_MAX_SEQUENCE_TOKENS; {defaults.max_sequence_tokens}]",
    )
    parser.add_argument(
        "--eviction-policy",
        choices=POLICY_NAMES,
        default=_env("EVICTION_POLICY", defaults.eviction_policy),
        help="which unreferenced cached leaf goes first: adaptive (LRU plus a frequency bonus "
        "learned from evicted blocks that come back), lru, lfu, lfuda; +seen2: blocks used once "
        f"go first [BLOCKD_EVICTION_POLICY; {defaults.eviction_policy}]",
    )
    parser.add_argument(
        "--demote-min-hits",
        type=int,
        metavar="N",
        default=_env("DEMOTE_MIN_HITS", str(defaults.demote_min_hits)),
        help="demote an evicted block to its worker's host tier only if it was seen (computed or hit, on any "
        "worker) more than N times "
        f"(0: always; 1: seen twice) [BLOCKD_DEMOTE_MIN_HITS; {defaults.demote_min_hits}]",
    )
    parser.add_argument(
        "--event-log-capacity",
        type=int,
        metavar="N",
        default=_env("EVENT_LOG_CAPACITY", str(defaults.event_log_capacity)),
        help="events kept for WatchEvents replay; an older resume point gets a GAP "
        f"[BLOCKD_EVENT_LOG_CAPACITY; {defaults.event_log_capacity}]",
    )
    parser.add_argument(
        "--pin-budget",
        type=float,
        metavar="SHARE",
        default=_env("PIN_BUDGET", str(defaults.pin_budget)),
        help="most of each pool's blocks that pins may hold, 0..1; a Pin past it is "
        f"RESOURCE_EXHAUSTED [BLOCKD_PIN_BUDGET; {defaults.pin_budget}]",
    )
    parser.add_argument(
        "--shared-tier",
        default=_env("SHARED_TIER"),
        metavar="URL",
        help="the shared tier's Valkey/Redis store, redis://HOST:PORT[/DB] (rediss:// for TLS; the "
        "password from KVCACHE_SHARED_TIER_PASSWORD): blockd rebuilds its index of it at start and "
        "deletes what a flush drops [BLOCKD_SHARED_TIER]",
    )
    parser.add_argument(
        "--shared-tier-reread-seconds",
        type=float,
        default=_env("SHARED_TIER_REREAD_SECONDS"),
        metavar="S",
        help="re-read the store's index every S seconds after the start-up rebuild (default: at start "
        "only); with shards, blocks other shards' workers wrote become findable here "
        "[BLOCKD_SHARED_TIER_REREAD_SECONDS]",
    )
    parser.add_argument(
        "--shared-index-max-blocks",
        type=int,
        metavar="N",
        default=_env("SHARED_INDEX_MAX_BLOCKS", str(defaults.shared_index_max_blocks)),
        help="shared tier blocks blockd indexes per namespace; the least recently used are forgotten "
        f"first [BLOCKD_SHARED_INDEX_MAX_BLOCKS; {defaults.shared_index_max_blocks}]",
    )
    parser.add_argument(
        "--ready-file",
        type=Path,
        default=_env("READY_FILE"),
        metavar="PATH",
        help="write the bound address here once serving [BLOCKD_READY_FILE]",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=_env("METRICS_PORT"),
        metavar="PORT",
        help="serve Prometheus metrics on this port (0: any free one) [BLOCKD_METRICS_PORT]",
    )
    parser.add_argument(
        "--metrics-host",
        default=_env("METRICS_HOST", "127.0.0.1"),
        help="interface of the metrics endpoint [BLOCKD_METRICS_HOST; 127.0.0.1]",
    )
    parser.add_argument(
        "--log-format",
        choices=("auto", "console", "json"),
        default=_env("LOG_FORMAT", "auto"),
        help="auto: console on a terminal, JSON otherwise [BLOCKD_LOG_FORMAT; auto]",
    )
    parser.add_argument(
        "--loop",
        choices=EVENT_LOOPS,
        default=_env("LOOP", "auto"),
        help="event loop; auto: uvloop when installed [BLOCKD_LOOP; auto]",
    )
    parser.add_argument(
        "--tls-cert",
        type=Path,
        default=_env("TLS_CERT"),
        metavar="PEM",
        help="server certificate chain; enables TLS with --tls-key [BLOCKD_TLS_CERT]",
    )
    parser.add_argument(
        "--tls-key",
        type=Path,
        default=_env("TLS_KEY"),
        metavar="PEM",
        help="server private key [BLOCKD_TLS_KEY]",
    )
    parser.add_argument(
        "--tls-client-ca",
        type=Path,
        default=_env("TLS_CLIENT_CA"),
        metavar="PEM",
        help="require client certificates signed by this CA [BLOCKD_TLS_CLIENT_CA]",
    )
    parser.add_argument(
        "--shutdown-grace",
        type=float,
        default=_env("SHUTDOWN_GRACE", "5"),
        metavar="SECONDS",
        help="time in-flight calls get on SIGTERM [BLOCKD_SHUTDOWN_GRACE; 5]",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> BlockdConfig:
    """Raises ValueError with a message naming the bad flag's value."""
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if args.tls_client_ca is not None and args.tls_cert is None:
        raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
    tls = TlsConfig(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    directory = DirectoryConfig(
        max_sequence_tokens=args.max_sequence_tokens,
        lease_ttl_seconds=args.lease_ttl,
        eviction_policy=args.eviction_policy,
        demote_min_hits=args.demote_min_hits,
        event_log_capacity=args.event_log_capacity,
        pin_budget=args.pin_budget,
        shared_index_max_blocks=args.shared_index_max_blocks,
        # Epochs start at the wall clock (ms) so they keep growing across restarts.
        initial_epoch=int(time.time() * 1000),
    )
    return BlockdConfig(
        listen=args.listen,
        admin_token=args.admin_token,
        worker_token=args.worker_token,
        route_token=args.route_token,
        ready_file=args.ready_file,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        log_format=args.log_format,
        event_loop=args.loop,
        tls=tls,
        shutdown_grace_seconds=args.shutdown_grace,
        directory=directory,
        shared_tier=args.shared_tier or None,
        shared_tier_reread_seconds=args.shared_tier_reread_seconds,
        # Test hook only: keep this many bytes of each block hash so collisions happen
        # (exact verification must turn every one into a miss).
        test_hash_bytes=int(os.environ["BLOCKD_TEST_HASH_BYTES"])
        if os.environ.get("BLOCKD_TEST_HASH_BYTES")
        else None,
    )


def main(argv: Sequence[str] | None = None, native_status: str = "off: not chosen") -> int:
    """`native_status`: what `native.enable_for_daemon` answered before the directory's
    modules were imported (the start-up log says it)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    configure_logging(config.log_format)
    state, _, detail = native_status.partition(": ")
    structlog.get_logger("blockd").info("directory core", compiled=state == "on", detail=detail)
    from blockd.server import serve  # after logging is configured; keeps --help fast

    try:
        with asyncio.Runner(loop_factory=_event_loop(config.event_loop)) as runner:
            return runner.run(serve(config))
    except RuntimeError as exc:  # e.g. the address is taken
        structlog.get_logger("blockd").error("cannot serve", error=str(exc))
        return 1


def _event_loop(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory of `--loop`'s event loop; None: asyncio's own."""
    if name == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if name == "uvloop":
            raise SystemExit("blockd: --loop uvloop needs the uvloop package") from None
        return None  # auto, without uvloop
    return uvloop.new_event_loop


if __name__ == "__main__":
    sys.exit(main(native_status=_native_status))
