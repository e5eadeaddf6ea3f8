"""Tenant isolation: requests with different `cache_salt` never share a block, while
`public_prefix_tokens` lets every tenant share a public prefix (a system prompt) and
keeps everything after it private per salt."""

from __future__ import annotations

from kvcache.v1 import directory_pb2 as dpb
from tests.reliability.stack import BLOCK, Stack, tokens


def test_different_salts_never_share_a_block(guarded: Stack) -> None:
    prompt = tokens(700, 6 * BLOCK + 2)
    first = guarded.generate(prompt, 6, cache_salt="t")
    assert first.usage.cached_tokens == 0
    assert guarded.lookup(prompt, "t") == 6 * BLOCK
    for other in ("t1", "T", "", "t\x00", "tenant-b"):  # a prefix, case, no salt, a NUL, another
        assert guarded.lookup(prompt, other) == 0, other
    again = guarded.generate(prompt, 6, cache_salt="t")
    assert again.usage.cached_tokens == 6 * BLOCK and again.token_ids == first.token_ids

    other = guarded.generate(prompt, 6, cache_salt="t1")
    assert other.usage.cached_tokens == 0, "another tenant was served this tenant's blocks"
    assert other.token_ids == first.token_ids
    unsalted = guarded.generate(prompt, 6)
    assert unsalted.usage.cached_tokens == 0
    assert guarded.wait_idle().num_referenced_blocks == 0
    route = guarded.worker_route(prompt, "t")  # routing (no admin token) sees the salt too
    assert route.num_cached_tokens == 6 * BLOCK
    assert guarded.worker_route(prompt, "t2").num_cached_tokens == 0


def test_public_prefix_is_shared_and_the_rest_stays_private(guarded: Stack) -> None:
    system = tokens(710, 4 * BLOCK)
    private = tokens(711, 2 * BLOCK + 3)  # the SAME private text for both tenants
    prompt = system + private
    public = len(system)

    a = guarded.generate(prompt, 5, cache_salt="alice", public_prefix_tokens=public)
    assert a.usage.cached_tokens == 0
    b = guarded.generate(prompt, 5, cache_salt="bob", public_prefix_tokens=public)
    assert b.usage.cached_tokens == public, "the public prefix must be shared, and only it"
    assert b.token_ids == a.token_ids
    a2 = guarded.generate(prompt, 5, cache_salt="alice", public_prefix_tokens=public)
    assert a2.usage.cached_tokens == public + 2 * BLOCK

    assert guarded.lookup(prompt, "alice", public) == public + 2 * BLOCK
    assert guarded.lookup(prompt, "bob", public) == public + 2 * BLOCK
    assert guarded.lookup(prompt, "carol", public) == public
    assert guarded.lookup(prompt, "carol", 0) == 0, "without the scope the salt starts at block 0"
    # a scope ending inside a block: the salt goes into that block, so only whole blocks are public
    assert guarded.lookup(prompt, "carol", public - 1) == public - BLOCK
    # no salt at all: the public blocks are the same, the salted ones never match
    assert guarded.lookup(prompt, "", 0) == public

    blocks = guarded.admin.ListBlocks(
        dpb.ListBlocksRequest(pool_id=guarded.computed_pool_id()), timeout=10, metadata=guarded.metadata
    ).blocks
    ours = [b for b in blocks if list(b.token_ids) in [prompt[i : i + BLOCK] for i in range(0, 24, BLOCK)]]
    salted = sorted((b.block_index, b.is_salted) for b in ours)
    # the four public blocks once (unsalted), then each tenant's first private block salted
    assert salted.count((4, True)) == 2 and all(not s for i, s in salted if i < 4), salted
    assert guarded.wait_idle().num_referenced_blocks == 0


def test_a_tenant_cannot_flush_by_probing_another_salt(guarded: Stack) -> None:
    """Flush by salt drops only that salt's chains (here: none of alice's)."""
    prompt = tokens(720, 3 * BLOCK)
    guarded.generate(prompt, 2, cache_salt="alice")
    guarded.wait_idle()
    flushed = guarded.admin.Flush(
        dpb.FlushRequest(cache_salt="mallory"), timeout=10, metadata=guarded.metadata
    )
    assert flushed.dropped == 0
    assert guarded.generate(prompt, 2, cache_salt="alice").usage.cached_tokens == 3 * BLOCK
