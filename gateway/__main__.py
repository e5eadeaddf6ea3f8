"""`gateway`: an OpenAI-compatible HTTP front door to blockd and the computed workers."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable
from pathlib import Path

from gateway.config import EVENT_LOOPS, HTTP_PARSERS, LOG_FORMATS, ROUTING_MODES, GatewayConfig
from gateway.tenants import load_keys

KEYS_ENV = "GATEWAY_API_KEYS"


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def _addresses(values: list[str] | None, default: str) -> tuple[str, ...]:
    raw = values or [default]
    return tuple(a.strip() for value in raw for a in value.split(",") if a.strip())


def tokenizer_specs(values: list[str]) -> dict[str, str]:
    """MODEL=DIR items -> {model: dir}; DIR must hold tokenizer.json."""
    specs = {}
    for value in filter(None, (v.strip() for v in values)):
        model, sep, path = value.partition("=")
        if not sep or not model or not path:
            raise ValueError(f"--tokenizer must be MODEL=DIR, got {value!r}")
        if not (Path(path) / "tokenizer.json").is_file():
            raise ValueError(f"--tokenizer {value}: no tokenizer.json in {path}")
        specs[model] = path
    return specs


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    p = argparse.ArgumentParser(
        prog="gateway",
        description="OpenAI-compatible HTTP gateway (chat/completions, completions, models) in front of "
        "blockd and computed workers, with cache-aware routing and per-tenant cache isolation.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--listen",
        default=_env("GATEWAY_LISTEN", "127.0.0.1:8000"),
        help="HTTP HOST:PORT (port 0: a free one) [env GATEWAY_LISTEN]",
    )
    p.add_argument(
        "--blockd",
        default=_env("GATEWAY_BLOCKD", "127.0.0.1:50051"),
        help="blockd address (its event stream for the directory mirror, and Route); '' for none "
        "(least-loaded only) [env GATEWAY_BLOCKD]",
    )
    p.add_argument(
        "--blockd-shard",
        action="append",
        help="with blockd shards (docs/sharding.md): a shard's address, repeated per shard; the directory "
        "mirror follows every shard's event stream, and --blockd is the fleet router "
        "(python -m blockd.fleet) that answers Route [env GATEWAY_BLOCKD_SHARDS, comma-separated]",
    )
    p.add_argument(
        "--computed",
        action="append",
        default=None,
        help="computed address; repeat or comma-separate for several (default: none with --discover "
        "and --blockd, else 127.0.0.1:50052) [env GATEWAY_COMPUTED]",
    )
    p.add_argument(
        "--discover",
        action=argparse.BooleanOptionalAction,
        default=_env("GATEWAY_DISCOVER", "1") not in ("0", "false", "no", "off"),
        help="also serve the workers blockd lists (its live pools' worker addresses, read every second): "
        "scaling workers needs no restart; ListPools is an admin call (--blockd-admin-token) "
        "[env GATEWAY_DISCOVER=0|1]",
    )
    p.add_argument(
        "--routing",
        choices=ROUTING_MODES,
        default=_env("GATEWAY_ROUTING", "cache-aware"),
        help="cache-aware and prefix: weigh what each worker caches (directory mirror, else blockd's "
        "Route); least-loaded, round-robin: never ask blockd [env GATEWAY_ROUTING]",
    )
    p.add_argument(
        "--api-keys-file",
        default=_env("GATEWAY_API_KEYS_FILE"),
        help="file of KEY=TENANT lines [env GATEWAY_API_KEYS_FILE]; also env GATEWAY_API_KEYS="
        "'KEY=TENANT,...'; no keys at all: the gateway runs open",
    )
    p.add_argument(
        "--public-prefix-tokens",
        type=int,
        default=int(_env("GATEWAY_PUBLIC_PREFIX_TOKENS", "0")),
        help="the first N prompt tokens are cached for every tenant alike (a shared system "
        "prompt) [env GATEWAY_PUBLIC_PREFIX_TOKENS]",
    )
    p.add_argument(
        "--max-inflight-per-worker",
        type=int,
        default=int(_env("GATEWAY_MAX_INFLIGHT_PER_WORKER", "256")),
        help="requests in flight per worker before 429 [env GATEWAY_MAX_INFLIGHT_PER_WORKER]",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=float(_env("GATEWAY_REQUEST_TIMEOUT", "600")),
        help="deadline of a whole generation, seconds (then 504) [env GATEWAY_REQUEST_TIMEOUT]",
    )
    p.add_argument(
        "--route-timeout",
        type=float,
        default=float(_env("GATEWAY_ROUTE_TIMEOUT", "1")),
        help="deadline of Tokenize/Route/GetModelInfo, seconds [env GATEWAY_ROUTE_TIMEOUT]",
    )
    p.add_argument(
        "--route-token",
        default=_env("GATEWAY_ROUTE_TOKEN"),
        help="blockd's route token (blockd --route-token) [env GATEWAY_ROUTE_TOKEN]",
    )
    p.add_argument(
        "--mirror",
        action=argparse.BooleanOptionalAction,
        default=_env("GATEWAY_MIRROR", "1") not in ("0", "false", "no", "off"),
        help="route from a mirror of blockd's block index fed by its event stream (no Route call "
        "per request; Route serves while the mirror is out of sync) [env GATEWAY_MIRROR=0|1]",
    )
    p.add_argument(
        "--generate-many",
        action=argparse.BooleanOptionalAction,
        default=_env("GATEWAY_GENERATE_MANY", "1") not in ("0", "false", "no", "off"),
        help="send each worker's requests on one GenerateMany stream (one message per engine "
        "step for all of them); off: a Generate call per request [env GATEWAY_GENERATE_MANY=0|1]",
    )
    p.add_argument(
        "--mirror-max-blocks",
        type=int,
        default=int(_env("GATEWAY_MIRROR_MAX_BLOCKS", "4000000")),
        help="most block hashes the mirror holds (~100 bytes each); above, Route serves "
        "[env GATEWAY_MIRROR_MAX_BLOCKS]",
    )
    p.add_argument(
        "--blockd-admin-token",
        default=_env("GATEWAY_BLOCKD_ADMIN_TOKEN"),
        help="blockd's admin token (blockd --admin-token), for the mirror's ListPools, ListBlocks, "
        "GetStats and WatchEvents [env GATEWAY_BLOCKD_ADMIN_TOKEN]",
    )
    p.add_argument(
        "--ready-file",
        default=_env("GATEWAY_READY_FILE"),
        help="write the bound HOST:PORT here once serving [env GATEWAY_READY_FILE]",
    )
    p.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=_env("GATEWAY_LOG_FORMAT", "auto"),
        help="auto: console on a TTY, JSON otherwise [env GATEWAY_LOG_FORMAT]",
    )
    p.add_argument(
        "--drain-seconds",
        type=float,
        default=float(_env("GATEWAY_DRAIN_SECONDS", "30")),
        help="on SIGTERM, let open requests finish this long [env GATEWAY_DRAIN_SECONDS]",
    )
    p.add_argument(
        "--tokenizer",
        action="append",
        metavar="MODEL=DIR",
        help="tokenize MODEL's prompts here with DIR's tokenizer.json and chat template instead of "
        "a worker's Tokenize (repeatable) [env GATEWAY_TOKENIZERS, comma-separated]",
    )
    p.add_argument(
        "--loop",
        choices=EVENT_LOOPS,
        default=_env("GATEWAY_LOOP", "auto"),
        help="event loop; auto: uvloop when installed [env GATEWAY_LOOP]",
    )
    p.add_argument(
        "--http",
        choices=HTTP_PARSERS,
        default=_env("GATEWAY_HTTP", "auto"),
        help="HTTP/1.1 parser; auto: httptools when installed [env GATEWAY_HTTP]",
    )
    a = p.parse_args(argv)
    try:
        keys = load_keys(Path(a.api_keys_file) if a.api_keys_file else None, _env(KEYS_ENV))
        computed = a.computed or ([_env("GATEWAY_COMPUTED")] if _env("GATEWAY_COMPUTED") else None)
        return GatewayConfig(
            listen=a.listen,
            blockd=a.blockd or None,
            blockd_shards=_addresses(
                a.blockd_shard
                or ([_env("GATEWAY_BLOCKD_SHARDS")] if _env("GATEWAY_BLOCKD_SHARDS") else None),
                "",
            ),
            computed=_addresses(computed, "" if a.discover and a.blockd else "127.0.0.1:50052"),
            discover=a.discover,
            routing=a.routing,
            api_keys=keys,
            public_prefix_tokens=a.public_prefix_tokens,
            max_inflight_per_worker=a.max_inflight_per_worker,
            request_timeout=a.request_timeout,
            route_timeout=a.route_timeout,
            route_token=a.route_token,
            mirror=a.mirror,
            generate_many=a.generate_many,
            mirror_max_blocks=a.mirror_max_blocks,
            blockd_admin_token=a.blockd_admin_token or None,
            ready_file=a.ready_file,
            log_format=a.log_format,
            drain_seconds=a.drain_seconds,
            event_loop=a.loop,
            http=a.http,
            tokenizers=tokenizer_specs(a.tokenizer or (_env("GATEWAY_TOKENIZERS") or "").split(",")),
        )
    except (ValueError, OSError) as exc:
        p.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    from gateway.logs import configure_logging
    from gateway.server import serve

    configure_logging(config.log_format)
    with asyncio.Runner(loop_factory=loop_factory(config.event_loop)) as runner:
        return runner.run(serve(config))


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop for "uvloop" (and for "auto" when it is installed); None: asyncio's."""
    if name == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if name == "uvloop":
            raise SystemExit("gateway: --loop uvloop needs the uvloop package") from None
        return None
    return uvloop.new_event_loop


if __name__ == "__main__":
    sys.exit(main())
