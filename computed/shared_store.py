"""The shared tier's store: K/V blocks in Valkey/Redis, one value per block.

Key: `kvcache:{namespace seed hex}:{block hash hex}` (blockd's chained hash carries
the namespace and, from its salted block on, the tenant's salt). Value: a header, the
block's tokens, then its K/V bytes in the pool's layout `(num_layers, 2, block_size,
num_kv_heads, head_dim)`. A reader checks every header field against what it expects
(namespace, hash, parent, salt digest, chain digest, tokens, layout, dtype, block size,
length): any mismatch, a short value or no value is a miss, never wrong K/V. The value
format is the contract's (`kvcache_contract.shared_value`).

Writes go under a temporary key (outside the `kvcache:*` pattern blockd scans) and
are renamed onto the key, so a worker killed mid-write leaves nothing findable.
Every batch is one pipelined round trip. Reads have a short timeout; a timeout or a
connection error is a miss, and the store is then left alone for a moment (reads
miss at once, writes are dropped) so a store that is down costs no step more than
one timeout. The password comes from KVCACHE_SHARED_TIER_PASSWORD, never the
command line; `rediss://` URLs speak TLS.
"""

from __future__ import annotations

import os
import struct
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import structlog

from kvcache_contract.shared_value import HAS_PARENT, HEADER, MAGIC, SALTED, VERSION

log = structlog.get_logger("computed.shared_store")

PASSWORD_ENV = "KVCACHE_SHARED_TIER_PASSWORD"
KEY_PREFIX = "kvcache"
TMP_PREFIX = "kvcache-tmp"
TOKEN = struct.Struct("<I")
# A temporary key left by a writer that died between SET and RENAME goes by itself.
TMP_TTL_MS = 60_000


@dataclass(frozen=True)
class Layout:
    """What a block's K/V bytes mean: the pool's layer layout, dtype and block size."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # "float32", "bfloat16", ...
    itemsize: int

    @property
    def kv_nbytes(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize


@dataclass(frozen=True)
class StoredBlock:
    """A block's identity as blockd describes it (SharedBlock in the contract)."""

    block_id: int
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    salt_digest: bytes | None
    depth: int
    chain_digest: bytes  # of the block's whole chain, as blockd computed it (zeros: blockd sent none)


def block_key(namespace: bytes, block_hash: bytes) -> str:
    return f"{KEY_PREFIX}:{namespace.hex()}:{block_hash.hex()}"


def encode(namespace: bytes, block: StoredBlock, layout: Layout, kv: bytes) -> bytes:
    assert len(kv) == layout.kv_nbytes, f"{len(kv)} K/V bytes for a {layout.kv_nbytes}-byte block"
    return header(namespace, block, layout) + kv


def header(namespace: bytes, block: StoredBlock, layout: Layout) -> bytes:
    """The part of a value before its K/V bytes: the header, then the block's tokens."""
    fixed = HEADER.pack(*_header_fields(namespace, block, layout))
    return fixed + struct.pack(f"<{len(block.token_ids)}I", *block.token_ids)


def _header_fields(namespace: bytes, block: StoredBlock, layout: Layout) -> tuple:
    """HEADER's fields for `block` in this namespace and layout, in HEADER's order."""
    flags = (HAS_PARENT if block.parent_hash is not None else 0) | (SALTED if block.salt_digest else 0)
    return (
        MAGIC,
        VERSION,
        flags,
        namespace,
        block.block_hash,
        block.parent_hash or bytes(16),
        block.salt_digest or bytes(16),
        block.depth,
        layout.num_layers,
        layout.num_kv_heads,
        layout.head_dim,
        layout.block_size,
        layout.kv_nbytes,
        layout.dtype.encode().ljust(16, b"\0"),
        block.chain_digest,
    )


def decode(value: bytes | None, namespace: bytes, block: StoredBlock, layout: Layout) -> memoryview | None:
    """The K/V bytes of `value` when its header says exactly `block` in this namespace
    and layout; None otherwise (a miss)."""
    if value is None:
        return None
    num_tokens = layout.block_size
    expected = HEADER.size + num_tokens * TOKEN.size + layout.kv_nbytes
    if len(value) != expected:
        return None
    if HEADER.unpack_from(value) != _header_fields(namespace, block, layout):
        return None
    tokens = struct.unpack_from(f"<{num_tokens}I", value, HEADER.size)
    if tokens != tuple(block.token_ids):
        return None
    return memoryview(value)[HEADER.size + num_tokens * TOKEN.size :]


@dataclass
class StoreCounters:
    num_written: int = 0
    num_write_failures: int = 0
    num_fetched: int = 0
    num_fetch_misses: int = 0  # no value, or a header that did not match
    num_fetch_errors: int = 0  # timeouts and connection errors
    bytes_written: int = 0
    bytes_fetched: int = 0
    last_error: str = ""
    errors: dict[str, int] = field(default_factory=dict)


class SharedStore:
    """An asyncio client of the store (valkey.asyncio), pipelined, never raising."""

    def __init__(self, url: str, read_timeout: float = 0.1, write_timeout: float = 2.0, backoff: float = 1.0):
        import valkey.asyncio as valkey
        from valkey.asyncio.retry import Retry
        from valkey.backoff import NoBackoff
        from valkey.exceptions import ConnectionError as StoreConnectionError

        password = os.environ.get(PASSWORD_ENV) or None
        self.url = url
        # A pooled connection the store closed (it restarted) is retried once on a fresh
        # one, so a store restart costs no write and no fetch; a timeout is not retried.
        once = {
            "retry": Retry(NoBackoff(), 1, (StoreConnectionError,)),
            "retry_on_error": [StoreConnectionError],
        }
        # Two connection pools: a slow write batch never delays a read.
        # Large reads: a fetch is often megabytes (bench.shared_tier: 8 MiB for a 2K prefix).
        self._reader = valkey.from_url(
            url,
            password=password,
            socket_timeout=read_timeout,
            socket_connect_timeout=read_timeout,
            socket_read_size=1 << 20,
            **once,
        )
        self._writer = valkey.from_url(
            url, password=password, socket_timeout=write_timeout, socket_connect_timeout=write_timeout, **once
        )
        self._backoff = backoff
        self._down_until = 0.0
        self.counters = StoreCounters()

    @property
    def is_down(self) -> bool:
        return time.monotonic() < self._down_until

    async def close(self) -> None:
        await self._reader.aclose()
        await self._writer.aclose()

    async def ping(self) -> bool:
        try:
            return bool(await self._reader.ping())
        except Exception as exc:  # noqa: BLE001 - any failure means "not reachable now"
            self._failed(exc)
            return False

    async def write(self, items: Sequence[tuple[str, bytes | memoryview]]) -> list[bool]:
        """SET each value under a temporary key, then RENAME it onto its key: one
        pipeline for the batch. Answers, per item, whether it is now under its key."""
        if not items:
            return []
        if self.is_down:
            self.counters.num_write_failures += len(items)
            return [False] * len(items)
        pipe = self._writer.pipeline(transaction=False)
        for key, value in items:
            tmp = f"{TMP_PREFIX}:{key.removeprefix(KEY_PREFIX + ':')}:{uuid.uuid4().hex}"
            pipe.set(tmp, value, px=TMP_TTL_MS)
            pipe.rename(tmp, key)
        try:
            replies = await pipe.execute(raise_on_error=False)
        except Exception as exc:  # noqa: BLE001 - the store is optional: drop, count, go on
            self._failed(exc)
            self.counters.num_write_failures += len(items)
            return [False] * len(items)
        done = [
            not isinstance(replies[2 * i], Exception) and not isinstance(replies[2 * i + 1], Exception)
            for i in range(len(items))
        ]
        num_done = sum(done)
        self.counters.num_written += num_done
        self.counters.num_write_failures += len(items) - num_done
        self.counters.bytes_written += sum(len(v) for (_, v), ok in zip(items, done) if ok)
        return done

    async def fetch(self, keys: Sequence[str]) -> list[bytes | None]:
        """The values of `keys` in one round trip; None for a missing one. A timeout or
        a connection error answers None for all (and the store rests a moment)."""
        if not keys:
            return []
        if self.is_down:
            self.counters.num_fetch_errors += len(keys)
            return [None] * len(keys)
        try:
            values = await self._reader.mget(list(keys))
        except Exception as exc:  # noqa: BLE001 - a miss, never an error to the request
            self._failed(exc)
            self.counters.num_fetch_errors += len(keys)
            return [None] * len(keys)
        self.counters.bytes_fetched += sum(len(v) for v in values if v is not None)
        return list(values)

    def _failed(self, exc: Exception) -> None:
        name = type(exc).__name__
        counters = self.counters
        counters.errors[name] = counters.errors.get(name, 0) + 1
        if counters.last_error != name:
            log.warning("shared tier store failed; missing and dropping for a moment", error=str(exc))
        counters.last_error = name
        self._down_until = time.monotonic() + self._backoff
