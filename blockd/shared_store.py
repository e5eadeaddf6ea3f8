"""blockd's side of the shared tier's store (Valkey/Redis): rebuild and delete, never K/V.

Workers write and read the values (computed.shared_store); blockd only reads their
headers back when it starts (its index of the store is rebuilt from them, so a
restarted fleet starts warm) and deletes keys a Flush dropped. The value format is the
contract's (directory.proto, SharedBlock; `kvcache_contract.shared_value`): this module
reads the header fields it needs and checks the magic and version; anything else is
skipped. Whether a record read back joins the index is `SharedIndex.load`'s to decide
(its chain digest must chain from its parent's).

Keys: `kvcache:{namespace seed hex}:{block hash hex}`; writers use temporary keys
outside that pattern (`kvcache-tmp:...`), renamed onto the key once complete, so a
SCAN never sees a half-written value.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from blockd.shared_tier import SharedRecord
from blockd.types import BlockHash
from kvcache_contract.shared_value import HAS_PARENT, HEADER, MAGIC, SALTED, TOKEN_BYTES, VERSION

log = structlog.get_logger("blockd.shared_store")

PASSWORD_ENV = "KVCACHE_SHARED_TIER_PASSWORD"
KEY_PREFIX = "kvcache"
SCAN_COUNT = 1000
DELETE_BATCH = 1000


def block_key(seed: bytes, block_hash: bytes) -> str:
    return f"{KEY_PREFIX}:{seed.hex()}:{block_hash.hex()}"


def connect(url: str, timeout: float = 2.0):
    """A client of the store at `url` (redis:// or rediss://; the password from
    KVCACHE_SHARED_TIER_PASSWORD, never the command line). Connects lazily.

    A command that finds its pooled connection closed (the store restarted since it
    was last used) is retried once on a fresh one: blockd talks to the store rarely
    (a rebuild, a Flush), so its pooled connection is usually older than the store's
    last restart, and without the retry a Flush would leave every key behind."""
    import valkey.asyncio as valkey
    from valkey.asyncio.retry import Retry
    from valkey.backoff import NoBackoff
    from valkey.exceptions import ConnectionError as StoreConnectionError

    return valkey.from_url(
        url,
        password=os.environ.get(PASSWORD_ENV) or None,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 1, (StoreConnectionError,)),
        retry_on_error=[StoreConnectionError],
    )


@dataclass(frozen=True, slots=True)
class Rebuilt:
    seed: BlockHash
    records: list[SharedRecord]


def parse_header(value: bytes) -> tuple[bytes, SharedRecord, int] | None:
    """(namespace seed, record without tokens, block size) of a value's header; None
    when it is not one this version wrote."""
    if len(value) < HEADER.size:
        return None
    fields = HEADER.unpack_from(value)
    magic, version, flags, seed, block_hash, parent_hash, digest, depth = fields[:8]
    block_size, chain = fields[11], fields[14]
    if magic != MAGIC or version != VERSION or not 1 <= block_size <= 1024:
        return None
    record = SharedRecord(
        BlockHash(block_hash),
        BlockHash(parent_hash) if flags & HAS_PARENT else None,
        b"",
        digest if flags & SALTED else None,
        depth,
        chain,
    )
    return seed, record, block_size


class SharedStoreAdmin:
    """Scans and deletes; every call may raise the client's errors (the caller decides)."""

    def __init__(self, url: str, timeout: float = 2.0) -> None:
        self.url = url
        self._client = connect(url, timeout)

    async def close(self) -> None:
        await self._client.aclose()

    async def read_index(self) -> list[Rebuilt]:
        """Every namespace's records whose header reads back, from one SCAN of the keys:
        per batch, one pipelined read of the fixed headers, then one of the tokens."""
        found: dict[bytes, list[SharedRecord]] = {}
        cursor = 0
        while True:
            cursor, keys = await self._client.scan(cursor, match=f"{KEY_PREFIX}:*", count=SCAN_COUNT)
            if keys:
                await self._read_batch(keys, found)
            if cursor == 0:
                break
        return [Rebuilt(BlockHash(seed), records) for seed, records in found.items()]

    async def _read_batch(self, keys: Sequence[bytes], found: dict[bytes, list[SharedRecord]]) -> None:
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.getrange(key, 0, HEADER.size - 1)
        heads = await pipe.execute(raise_on_error=False)
        parsed = []
        for key, head in zip(keys, heads):
            header = parse_header(head) if isinstance(head, bytes) else None
            if header is not None and _key_matches(key, header[0], header[1].block_hash):
                parsed.append((key, header))
        if not parsed:
            return
        pipe = self._client.pipeline(transaction=False)
        for key, (_, _, block_size) in parsed:
            pipe.getrange(key, HEADER.size, HEADER.size + block_size * TOKEN_BYTES - 1)
        tokens = await pipe.execute(raise_on_error=False)
        for (_, (seed, record, block_size)), token_bytes in zip(parsed, tokens):
            if not isinstance(token_bytes, bytes) or len(token_bytes) != block_size * TOKEN_BYTES:
                continue
            complete = SharedRecord(
                record.block_hash,
                record.parent_hash,
                token_bytes,
                record.salt_digest,
                record.depth,
                record.chain_digest,
            )
            found.setdefault(seed, []).append(complete)

    async def delete(self, keys: Sequence[tuple[bytes, bytes]], namespaces: Sequence[bytes] = ()) -> int:
        """UNLINK the given (seed, hash) keys, and every key of the given namespaces
        (those blockd never knew of too), in batches. Answers how many were deleted."""
        names = [block_key(seed, block_hash) for seed, block_hash in keys]
        for seed in namespaces:
            async for key in self._client.scan_iter(match=f"{KEY_PREFIX}:{seed.hex()}:*", count=SCAN_COUNT):
                names.append(key.decode() if isinstance(key, bytes) else key)
        names = list(dict.fromkeys(names))
        deleted = 0
        for start in range(0, len(names), DELETE_BATCH):
            deleted += await self._client.unlink(*names[start : start + DELETE_BATCH])
        return deleted


async def delete_logged(admin: SharedStoreAdmin, keys, namespaces) -> None:
    """`admin.delete`, where a store that fails only costs a warning: blockd's records are
    gone already, and keys left behind are the server's to evict."""
    try:
        deleted = await admin.delete(keys, namespaces)
    except Exception as exc:  # noqa: BLE001 - the store is optional; the flush is done
        log.warning("shared tier keys not deleted", error=str(exc), num_keys=len(keys))
        return
    log.info("shared tier keys deleted", num_keys=deleted)


def _key_matches(key: bytes | str, seed: bytes, block_hash: bytes) -> bool:
    text = key.decode() if isinstance(key, bytes) else key
    return text == block_key(seed, block_hash)


async def rebuild_forever(admin: SharedStoreAdmin, load, retry_seconds: float = 2.0) -> None:
    """Rebuild the directory's shared index from the store (`load(seed, records)`),
    retrying while the store is unreachable: blockd serves meanwhile, without the
    shared tier's old blocks."""
    warned = False
    while True:
        try:
            namespaces = await admin.read_index()
        except Exception as exc:  # noqa: BLE001 - any store failure: try again later
            if not warned:
                log.warning("shared tier unreachable; serving without its index, retrying", error=str(exc))
                warned = True
            await asyncio.sleep(retry_seconds)
            continue
        total = sum(load(rebuilt.seed, rebuilt.records) for rebuilt in namespaces)
        log.info("shared tier index rebuilt", namespaces=len(namespaces), blocks=total, store=admin.url)
        return


async def reread_forever(admin: SharedStoreAdmin, load, interval: float) -> None:
    """Read the store's index again every `interval` seconds (after the start-up rebuild):
    blocks that other blockd processes' workers wrote (shards, docs/sharding.md) become
    findable here without a restart. `load` skips what the index knows, so a turn costs
    one SCAN and the headers' reads; a turn that fails waits for the next."""
    while True:
        await asyncio.sleep(interval)
        try:
            namespaces = await admin.read_index()
        except Exception as exc:  # noqa: BLE001 - any store failure: the next turn retries
            log.warning("shared tier index re-read failed", error=str(exc))
            continue
        added = sum(load(rebuilt.seed, rebuilt.records) for rebuilt in namespaces)
        if added:
            log.info("shared tier index re-read", new_blocks=added, store=admin.url)
