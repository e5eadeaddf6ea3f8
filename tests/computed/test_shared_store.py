"""The shared tier's value format and store client, against a real valkey-server:
a header that does not match is a miss, a temporary key is never read, blockd reads
the headers back (rebuild), and a store that is down answers misses at once."""

from __future__ import annotations

import asyncio
import time

import pytest
import valkey

from blockd.shared_store import SharedStoreAdmin
from clients.spawn import start_valkey, valkey_server_binary
from computed.shared_store import TMP_PREFIX, Layout, SharedStore, StoredBlock, block_key, decode, encode

pytestmark = pytest.mark.skipif(valkey_server_binary() is None, reason="no valkey-server binary")

NS = bytes(range(16))
LAYOUT = Layout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=2, dtype="float32", itemsize=4)
ROOT = StoredBlock(3, b"h" * 16, None, (7, 8), None, 0, b"r" * 16)
CHILD = StoredBlock(4, b"c" * 16, b"h" * 16, (9, 10), b"s" * 16, 1, b"d" * 16)
KV = bytes(i % 251 for i in range(LAYOUT.kv_nbytes))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    daemon = start_valkey(tmp_path_factory.mktemp("valkey"))
    yield f"redis://{daemon.address}"
    daemon.stop()


def test_a_value_reads_back_only_under_the_header_it_was_written_with():
    value = encode(NS, CHILD, LAYOUT, KV)
    assert bytes(decode(value, NS, CHILD, LAYOUT)) == KV
    other = Layout(2, 1, 4, 2, "bfloat16", 4)
    assert decode(value, bytes(16), CHILD, LAYOUT) is None  # another namespace
    assert decode(value, NS, CHILD, other) is None  # another dtype
    assert decode(value, NS, ROOT, LAYOUT) is None  # another block
    for changed in (
        StoredBlock(4, b"c" * 16, b"x" * 16, (9, 10), b"s" * 16, 1, b"d" * 16),  # another parent
        StoredBlock(4, b"c" * 16, b"h" * 16, (9, 11), b"s" * 16, 1, b"d" * 16),  # other tokens
        StoredBlock(4, b"c" * 16, b"h" * 16, (9, 10), None, 1, b"d" * 16),  # unsalted
        StoredBlock(4, b"c" * 16, b"h" * 16, (9, 10), b"s" * 16, 2, b"d" * 16),  # another depth
        # the same block under another chain (a collision overwrote the value): a miss
        StoredBlock(4, b"c" * 16, b"h" * 16, (9, 10), b"s" * 16, 1, b"e" * 16),
    ):
        assert decode(value, NS, changed, LAYOUT) is None
    assert decode(value[:-1], NS, CHILD, LAYOUT) is None  # short
    assert decode(b"", NS, CHILD, LAYOUT) is None and decode(None, NS, CHILD, LAYOUT) is None


def test_writes_rename_and_a_temporary_key_is_never_read(server):
    async def run():
        store = SharedStore(server)
        key = block_key(NS, ROOT.block_hash)
        assert await store.write([(key, encode(NS, ROOT, LAYOUT, KV))]) == [True]
        # A writer killed between SET and RENAME leaves only a temporary key behind.
        orphan = block_key(NS, CHILD.block_hash)
        raw = valkey.Valkey.from_url(server)
        raw.set(f"{TMP_PREFIX}:{NS.hex()}:{CHILD.block_hash.hex()}:dead", encode(NS, CHILD, LAYOUT, KV))
        values = await store.fetch([key, orphan])
        assert values[1] is None and bytes(decode(values[0], NS, ROOT, LAYOUT)) == KV
        assert not [k for k in raw.scan_iter(match=f"{TMP_PREFIX}:*") if not k.endswith(b":dead")]
        admin = SharedStoreAdmin(server)
        rebuilt = await admin.read_index()
        await admin.close()
        await store.close()
        return rebuilt

    rebuilt = asyncio.run(run())
    assert [r.seed for r in rebuilt] == [NS]
    (record,) = rebuilt[0].records
    assert (record.block_hash, record.parent_hash, record.depth) == (ROOT.block_hash, None, 0)
    assert record.token_bytes == b"\x07\x00\x00\x00\x08\x00\x00\x00"


def test_a_store_that_is_down_answers_misses_at_once(tmp_path):
    daemon = start_valkey(tmp_path)
    url = f"redis://{daemon.address}"
    daemon.kill()

    async def run():
        store = SharedStore(url, read_timeout=0.05)
        first = await store.fetch([block_key(NS, ROOT.block_hash)])
        started = time.monotonic()
        second = await store.fetch([block_key(NS, ROOT.block_hash)])
        quick = time.monotonic() - started
        written = await store.write([(block_key(NS, ROOT.block_hash), b"x")])
        await store.close()
        return first, second, quick, written, store.counters

    first, second, quick, written, counters = asyncio.run(run())
    assert first == second == [None] and written == [False]
    assert quick < 0.05, "a store known down must not cost another timeout"
    assert counters.num_fetch_errors == 2 and counters.num_write_failures == 1


def test_blockd_reads_the_value_format_computed_writes() -> None:
    # The daemons may not import each other, so each spells the store's value format.
    from blockd import shared_store as reader
    from computed import shared_store as writer

    for name in ("PASSWORD_ENV", "KEY_PREFIX", "MAGIC", "VERSION", "HAS_PARENT", "SALTED"):
        assert getattr(reader, name) == getattr(writer, name), name
    assert reader.HEADER.format == writer.HEADER.format


def test_a_store_restarted_between_uses_costs_neither_daemon_a_command(tmp_path):
    # Both clients keep pooled connections; a restarted store has closed them. The next
    # command must run on a fresh connection, not fail (blockd's Flush once left every
    # key behind this way).
    daemon = start_valkey(tmp_path / "v")
    port = int(daemon.address.rsplit(":", 1)[1])
    url = f"redis://{daemon.address}"
    key = block_key(NS, ROOT.block_hash)

    async def run():
        nonlocal daemon
        store, admin = SharedStore(url), SharedStoreAdmin(url)
        assert await store.write([(key, encode(NS, ROOT, LAYOUT, KV))]) == [True]
        assert len(await admin.read_index()) == 1
        daemon.kill()
        daemon = start_valkey(tmp_path / "v", port=port)  # back, and empty
        written = await store.write([(key, encode(NS, ROOT, LAYOUT, KV))])
        deleted = await admin.delete([], [NS])
        fetched = await store.fetch([key])
        await store.close()
        await admin.close()
        return written, deleted, fetched, store.counters

    try:
        written, deleted, fetched, counters = asyncio.run(run())
    finally:
        daemon.stop()
    assert written == [True] and deleted == 1 and fetched == [None]
    assert counters.num_write_failures == 0 and counters.num_fetch_errors == 0
