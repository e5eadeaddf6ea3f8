"""The shared tier end to end: a real Valkey server, real blockd, two real computed workers.

A 2,048-token prefix computed on worker A serves a request on worker B from the store
with the same greedy tokens; A killed and restarted comes back warm; blockd restarted
rebuilds its index from the store; the store killed or restarted empty costs misses,
never wrong tokens; salted blocks never cross tenants; a flush empties the keys.
"""

from __future__ import annotations

import time

import pytest
import valkey

from clients.spawn import free_port, spawn, start_valkey, valkey_server_binary
from kvcache.v1 import directory_pb2
from tests.computed.test_generation import Stack, hf_greedy, prompt
from tests.daemons import start_blockd, start_computed
from tests.models import make_tiny_model

pytestmark = pytest.mark.skipif(valkey_server_binary() is None, reason="no valkey-server binary")

BLOCK = 16
PREFIX = 2048
SHARED = directory_pb2.TIER_SHARED


class Fleet:
    """valkey + blockd + workers A and B, restartable one by one."""

    def __init__(self, root, model_dir):
        self.root, self.model_dir = root, model_dir
        self.valkey = start_valkey(root / "valkey")
        self.url = f"redis://{self.valkey.address}"
        self.blockd = start_blockd(root, "--shared-tier", self.url)
        self.a = self._worker("a")
        self.b = self._worker("b")

    def _worker(self, name: str):
        daemon = start_computed(
            self.root,
            self.blockd.address,
            "--block-size",
            str(BLOCK),
            "--num-blocks",
            "300",
            "--shared-tier",
            self.url,
            "--shared-tier-load-seconds",
            "0",  # tiny CPU models recompute faster than any fetch: always fetch here
            model=self.model_dir,
            name=f"computed-{name}",
        )
        return Stack(self.blockd, daemon, self.model_dir)

    def restart_worker(self, name: str) -> Stack:
        old = getattr(self, name)
        old.computed.kill()
        setattr(self, name, self._worker(name))
        return getattr(self, name)

    def restart_blockd(self) -> None:
        address = self.blockd.address
        assert self.blockd.stop() == 0, self.blockd.log()
        self.blockd = spawn("blockd", "blockd", self.root, ["--shared-tier", self.url], listen=address)
        for stack in (self.a, self.b):
            stack.blockd = self.blockd

    def keys(self) -> list[bytes]:
        return list(valkey.Valkey.from_url(self.url).scan_iter(match="kvcache:*"))

    def shared_blocks(self) -> int:
        stats = self.a.admin.GetStats(directory_pb2.GetStatsRequest(), timeout=10).total
        return stats.shared.num_blocks

    def wait_shared(self, at_least: int, timeout: float = 20.0) -> int:
        deadline = time.monotonic() + timeout
        while (num := self.shared_blocks()) < at_least:
            assert time.monotonic() < deadline, f"{num} blocks in the shared tier, not {at_least}"
            time.sleep(0.05)
        return num

    def wait_shared_prefix(self, tokens: list[int], num_tokens: int, timeout: float = 20.0) -> None:
        """Until `num_tokens` of `tokens` are findable in the shared tier (written and
        reported): some pool's match finds them there."""
        deadline = time.monotonic() + timeout
        request = directory_pb2.LookupRequest(token_ids=tokens)
        while True:
            matches = self.a.admin.Lookup(request, timeout=10).matches
            found = max((m.num_shared_cached_tokens for m in matches), default=0)
            if found >= num_tokens:
                return
            assert time.monotonic() < deadline, f"{found} tokens in the shared tier, not {num_tokens}"
            time.sleep(0.05)

    def stop(self) -> None:
        for stack in (self.a, self.b):
            stack.computed.stop()
        self.blockd.stop()
        self.valkey.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared")
    model_dir = make_tiny_model(root / "model", "llama", max_position_embeddings=4096)
    f = Fleet(root, model_dir)
    yield f
    f.stop()


def _on(stack: Stack, tokens: list[int], n: int = 8, **kw):
    return stack.generate(tokens, n, **kw)


def test_a_prefix_computed_on_a_serves_b_from_the_store(fleet: Fleet):
    p = prompt(1, PREFIX + 5)
    cold, u1 = _on(fleet.a, p)
    assert u1.cached_tokens == 0
    assert fleet.wait_shared(PREFIX // BLOCK) >= PREFIX // BLOCK, "A's blocks never reached the shared tier"
    warm, u2 = _on(fleet.b, p)
    assert warm == cold == hf_greedy(fleet.model_dir, p, 8)
    assert (u2.cached_tokens, u2.shared_cached_tokens) == (PREFIX, PREFIX)
    match = {
        m.worker_address: m for m in fleet.a.admin.Lookup(directory_pb2.LookupRequest(token_ids=p)).matches
    }
    assert match[fleet.a.computed.address].num_shared_cached_tokens == 0  # A holds it in its device pool
    pools = fleet.a.admin.GetStats(directory_pb2.GetStatsRequest(), timeout=10).pools
    assert sum(pool.shared.num_loads for pool in pools) >= PREFIX // BLOCK
    assert sum(pool.shared.num_demotions for pool in pools) >= PREFIX // BLOCK


def test_a_restarted_worker_comes_back_warm(fleet: Fleet):
    p = prompt(2, 40 * BLOCK + 3)
    known = fleet.shared_blocks()
    cold, _ = _on(fleet.a, p)
    fleet.wait_shared(known + 40)
    a = fleet.restart_worker("a")
    warm, usage = _on(a, p)
    assert warm == cold
    assert usage.shared_cached_tokens == 40 * BLOCK


def test_a_restarted_blockd_rebuilds_the_shared_index(fleet: Fleet):
    p = prompt(3, 30 * BLOCK + 1)
    known = fleet.shared_blocks()
    cold, _ = _on(fleet.b, p)
    before = fleet.wait_shared(known + 30)
    fleet.restart_blockd()
    assert fleet.wait_shared(before) == before, "blockd did not rebuild its index from the store"
    warm, usage = _on(fleet.a, p)  # A's device pool was reset when blockd restarted
    assert warm == cold
    assert (usage.cached_tokens, usage.shared_cached_tokens) == (30 * BLOCK, 30 * BLOCK)


def test_salted_blocks_never_cross_tenants(fleet: Fleet):
    p = prompt(4, 12 * BLOCK + 1)
    known = fleet.shared_blocks()
    cold, _ = _on(fleet.a, p, cache_salt="tenant-1")
    fleet.wait_shared(known + 12)
    other, u_other = _on(fleet.b, p, cache_salt="tenant-2")
    same, u_same = _on(fleet.b, p, cache_salt="tenant-1")
    assert other == same == cold
    assert u_other.cached_tokens == 0
    assert u_same.shared_cached_tokens == 12 * BLOCK


def test_the_store_down_or_restarted_empty_costs_misses_only(fleet: Fleet):
    p = prompt(5, 20 * BLOCK + 2)
    known = fleet.shared_blocks()
    cold, _ = _on(fleet.a, p)
    fleet.wait_shared(known + 20)
    port = int(fleet.valkey.address.rsplit(":", 1)[1])
    fleet.valkey.kill()
    down, u_down = _on(fleet.b, p)  # the fetch fails at once: B computes everything
    assert down == cold and u_down.shared_cached_tokens == 0
    q = prompt(6, 9 * BLOCK)
    assert _on(fleet.b, q)[0] == hf_greedy(fleet.model_dir, q, 8)  # writes are dropped, serving goes on
    fleet.valkey = start_valkey(fleet.root / "valkey", port=port)  # back, and empty
    time.sleep(1.2)  # the workers leave a failed store alone for a second
    r = prompt(7, 10 * BLOCK + 1)
    known = fleet.shared_blocks()
    cold_r, _ = _on(fleet.a, r)
    fleet.wait_shared(known + 10)
    fleet.valkey.kill()
    fleet.valkey = start_valkey(fleet.root / "valkey", port=port)  # empty again: blockd's records are stale
    time.sleep(1.2)
    stale, usage = _on(fleet.b, r)
    assert stale == cold_r and usage.shared_cached_tokens == 0
    pools = fleet.a.admin.GetStats(directory_pb2.GetStatsRequest(), timeout=10).pools
    assert sum(pool.shared.num_evictions for pool in pools) > 0, "the stale records were not dropped"


def test_flush_empties_the_namespace_keys(fleet: Fleet):
    p = prompt(8, 6 * BLOCK)
    _on(fleet.a, p)
    # This prompt's own writes, not a count: an earlier test's writes landing late once
    # made the count, and this prompt's keys, written after the flush, stayed behind.
    fleet.wait_shared_prefix(p, 6 * BLOCK)
    assert fleet.keys()
    reply = fleet.a.admin.Flush(directory_pb2.FlushRequest(tier=SHARED), timeout=10)
    assert [row.tier for row in reply.tiers] == [SHARED] and reply.tiers[0].dropped > 0
    assert fleet.keys() == []
    assert fleet.shared_blocks() == 0


def test_both_daemons_start_and_serve_while_the_store_is_unreachable(tmp_path, fleet: Fleet):
    dead = f"redis://127.0.0.1:{free_port()}"  # nothing listens there
    blockd = start_blockd(tmp_path, "--shared-tier", dead)
    try:
        computed = start_computed(
            tmp_path, blockd.address, "--block-size", str(BLOCK), "--shared-tier", dead, model=fleet.model_dir
        )
        stack = Stack(blockd, computed, fleet.model_dir)
        try:
            p = prompt(9, 5 * BLOCK + 1)
            first, _ = stack.generate(p, 6)
            again, usage = stack.generate(p, 6)
            assert first == again == hf_greedy(fleet.model_dir, p, 6)
            assert (
                usage.cached_tokens == 5 * BLOCK and usage.shared_cached_tokens == 0
            )  # the device pool serves
            assert "shared_tier_unreachable" in computed.log()
            assert "shared tier unreachable" in blockd.log()
        finally:
            assert computed.stop() == 0, computed.log()
    finally:
        assert blockd.stop() == 0, blockd.log()
