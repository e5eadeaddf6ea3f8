"""The sync Python client against live blockd + computed."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import grpc
import pytest

from clients.client import BlockdClient, ComputedClient, KVCacheClient
from clients.errors import KVCacheError
from clients.options import ClientOptions, RetryPolicy
from clients.prefix_tree import build_prefix_forest
from clients.routing import normalize_address
from tests.clients.conftest import ADMIN_TOKEN, LiveStack, dead_address, free_port, unique_prompt
from tests.daemons import REPO, spawn

OPTIONS = ClientOptions(admin_token=ADMIN_TOKEN, timeout=30.0, generate_timeout=120.0)


@pytest.fixture()
def client(live: LiveStack) -> KVCacheClient:
    with KVCacheClient(live.blockd.address, [live.computed.address], options=OPTIONS) as c:
        yield c


def test_repeat_reports_cached_tokens_and_same_greedy_output(client: KVCacheClient) -> None:
    prompt = unique_prompt()
    block_size = client.computed().model_info().block_size
    first = client.complete(prompt, max_tokens=6, temperature=0.0)
    second = client.complete(prompt, max_tokens=6, temperature=0.0)
    assert first.usage.cached_tokens == 0
    assert first.usage.prompt_tokens == second.usage.prompt_tokens >= 2 * block_size
    assert second.usage.cached_tokens > 0
    assert second.usage.cached_tokens % block_size == 0
    assert second.usage.cached_tokens <= second.usage.prompt_tokens
    assert second.token_ids == first.token_ids and second.text == first.text
    assert first.usage.completion_tokens == len(first.token_ids) >= 1
    assert first.finish_reason in ("stop", "length")
    assert first.worker_address == client.computed_addresses[0]


def test_generate_streams_chunks_with_usage_on_the_last(client: KVCacheClient) -> None:
    prompt = unique_prompt("streaming")
    stream = client.generate(prompt, max_tokens=5, ignore_eos=True)
    chunks = list(stream)
    assert len(chunks) >= 1
    assert all(not c.is_last and c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.finish_reason == "length" and last.usage is not None
    assert last.usage.completion_tokens == 5 == sum(len(c.token_ids) for c in chunks)
    assert len({c.request_id for c in chunks}) == 1
    assert stream.worker_address == client.computed_addresses[0]
    again = client.complete(prompt, max_tokens=5, ignore_eos=True)
    assert again.text == "".join(c.text for c in chunks)


def test_chat_messages_share_the_system_prompt(client: KVCacheClient) -> None:
    system = unique_prompt("a system prompt")
    first = client.complete(messages=[("system", system), ("user", "What is a block?")], max_tokens=3)
    second = client.complete(messages=[("system", system), ("user", "Why hash blocks?")], max_tokens=3)
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens > 0


def test_stats_count_the_hit_tokens(client: KVCacheClient) -> None:
    prompt = unique_prompt("statistics")
    client.complete(prompt, max_tokens=2)
    before = client.blockd.get_stats()
    repeat = client.complete(prompt, max_tokens=2)
    after = client.blockd.get_stats()
    assert repeat.usage.cached_tokens > 0
    assert after.total.hit_tokens - before.total.hit_tokens >= repeat.usage.cached_tokens
    assert after.total.queried_tokens - before.total.queried_tokens >= repeat.usage.prompt_tokens
    assert after.total.num_admissions > before.total.num_admissions
    assert len(after.pools) == 1
    pool = after.pools[0]
    assert after.total.pool_id in (None, pool.pool_id)  # the contract empties it only over several pools
    assert pool.num_free_blocks + pool.num_evictable_blocks + pool.num_referenced_blocks == pool.num_blocks
    assert 0.0 < after.total.hit_rate <= 1.0


def test_lookup_route_and_pools_after_generate(client: KVCacheClient, live: LiveStack) -> None:
    prompt = unique_prompt("lookups")
    computed = client.computed()
    token_ids = computed.tokenize(prompt)
    block_size = computed.model_info().block_size
    assert client.blockd.lookup(token_ids)[0].num_cached_tokens == 0
    client.complete(prompt, max_tokens=2)
    matches = client.blockd.lookup(token_ids)
    assert len(matches) == 1
    assert ((len(token_ids) - 1) // block_size) * block_size <= matches[0].num_cached_tokens <= len(token_ids)
    assert client.blockd.lookup(token_ids, cache_salt="another-tenant")[0].num_cached_tokens == 0
    route = client.blockd.route(token_ids)
    assert route.num_cached_tokens == matches[0].num_cached_tokens
    assert normalize_address(route.worker_address) == normalize_address(live.computed.address)
    pools = client.blockd.list_pools()
    assert [p.pool_id for p in pools] == [route.pool_id]
    assert pools[0].is_live and pools[0].block_size == block_size


def test_blocks_pages_and_prefix_tree_hold_the_prompt(client: KVCacheClient) -> None:
    prompt = unique_prompt("trees")
    computed = client.computed()
    token_ids = computed.tokenize(prompt)
    block_size = computed.model_info().block_size
    client.complete(prompt, max_tokens=2)
    blocks = list(client.blockd.iter_blocks(page_size=3))  # several pages
    assert len({(b.pool_id, b.block_id) for b in blocks}) == len(blocks)
    assert blocks == sorted(blocks, key=lambda b: (b.pool_id, b.block_id))
    forest = build_prefix_forest(blocks)
    first_block = tuple(token_ids[:block_size])
    root = next(
        r for roots in forest.values() for r in roots if tuple(r.token_ids[:block_size]) == first_block
    )
    full = (len(token_ids) // block_size) * block_size
    node, path = root, list(root.token_ids)
    while len(path) < full:  # follow the branch that continues the prompt
        want = token_ids[len(path) : len(path) + block_size]
        node = next(c for c in node.children if c.token_ids[:block_size] == want)
        path += node.token_ids
    assert path[:full] == token_ids[:full]


def test_flush_by_salt_drops_that_tenant_only(client: KVCacheClient) -> None:
    prompt = unique_prompt("tenants")
    client.complete(prompt, max_tokens=2, cache_salt="tenant-a")
    client.complete(prompt, max_tokens=2, cache_salt="tenant-b")
    assert client.complete(prompt, max_tokens=2, cache_salt="tenant-b").usage.cached_tokens > 0
    result = client.blockd.flush(cache_salt="tenant-a")
    assert result.dropped >= 1 and result.busy == 0
    assert client.complete(prompt, max_tokens=2, cache_salt="tenant-a").usage.cached_tokens == 0
    assert client.complete(prompt, max_tokens=2, cache_salt="tenant-b").usage.cached_tokens > 0


def test_pin_and_unpin(client: KVCacheClient) -> None:
    prompt = unique_prompt("pins")
    token_ids = client.computed().tokenize(prompt)
    client.complete(prompt, max_tokens=2)
    pin = client.blockd.pin(token_ids, ttl_seconds=60)
    assert pin.pin_id and pin.num_pinned_blocks >= 1 and pin.num_pinned_tokens >= 1
    assert 0 < pin.expires_in_seconds <= 60
    assert client.blockd.get_stats().total.num_pinned_blocks >= pin.num_pinned_blocks
    assert client.blockd.unpin(pin.pin_id) == pin.num_pinned_blocks


def test_tokenize_detokenize_and_model_info(client: KVCacheClient, live: LiveStack) -> None:
    computed = client.computed()
    token_ids = computed.tokenize("def add(a, b):\n    return a + b\n", add_special_tokens=False)
    assert computed.detokenize(token_ids) == "def add(a, b):\n    return a + b\n"
    info = computed.model_info()
    assert info.block_size == 16 and info.num_blocks > 0 and info.vocab_size > max(token_ids)
    assert info.pool_id is not None


def test_admin_calls_need_the_token_routing_does_not(live: LiveStack) -> None:
    with BlockdClient(live.blockd.address) as anonymous:
        with pytest.raises(KVCacheError) as missing:
            anonymous.get_stats()
        assert missing.value.code is grpc.StatusCode.UNAUTHENTICATED and missing.value.is_auth
        assert anonymous.route([1, 2, 3]).pool_id is not None
    with BlockdClient(live.blockd.address, ClientOptions(admin_token="wrong")) as wrong:
        with pytest.raises(KVCacheError) as denied:
            wrong.flush()
        assert denied.value.code is grpc.StatusCode.PERMISSION_DENIED


def test_bad_request_is_refused_at_once_not_retried(live: LiveStack) -> None:
    with ComputedClient(live.computed.address) as computed:
        started = time.monotonic()
        with pytest.raises(KVCacheError) as error:
            computed.complete("hello", max_tokens=0)
        assert error.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert time.monotonic() - started < 5
        assert "\n" not in str(error.value) and str(error.value).startswith(
            f"computed at {live.computed.address}"
        )


def test_deadline_exceeded_is_reported(live: LiveStack) -> None:
    with ComputedClient(live.computed.address) as computed:
        with pytest.raises(KVCacheError) as error:
            computed.complete(unique_prompt(), max_tokens=64, ignore_eos=True, timeout=0.001)
        assert error.value.code is grpc.StatusCode.DEADLINE_EXCEEDED and error.value.is_unreachable


def test_unreachable_daemon_fails_after_bounded_retries() -> None:
    address = dead_address()
    policy = RetryPolicy(max_attempts=3, initial_backoff=0.05, max_backoff=0.1)
    with BlockdClient(address, ClientOptions(retry=policy)) as blockd:
        started = time.monotonic()
        with pytest.raises(KVCacheError) as error:
            blockd.get_stats()
        assert time.monotonic() - started < 5
    assert str(error.value) == f"blockd at {address} is unreachable (UNAVAILABLE)"


def test_retries_reach_a_daemon_that_comes_up_late(tmp_path) -> None:
    port = free_port()
    started: list = []
    starter = threading.Timer(
        0.5, lambda: started.append(spawn("late-blockd", "blockd", tmp_path, [], listen=f"127.0.0.1:{port}"))
    )
    policy = RetryPolicy(max_attempts=50, initial_backoff=0.1, max_backoff=0.4)
    starter.start()
    try:
        with BlockdClient(f"127.0.0.1:{port}", ClientOptions(retry=policy, timeout=90)) as blockd:
            stats = blockd.get_stats()
        assert stats.total.num_blocks == 0 and stats.pools == ()
    finally:
        starter.join()
        for daemon in started:
            daemon.stop()


# Ctrl-C lands as gRPC starts its channel thread for a new call (the window behind a CI
# hang of `make demo`): the call stays registered with no thread to drive it.
_INTERRUPTED_CALL = """
import sys
from clients.client import KVCacheClient

client = KVCacheClient(sys.argv[1], [sys.argv[2]])
client.complete("one request first", max_tokens=2)


def interrupt_there(frame, event, arg):
    if event == "call" and frame.f_code.co_name == "_run_channel_spin_thread":
        sys.settrace(None)
        raise KeyboardInterrupt
    return None


sys.settrace(interrupt_there)
try:
    client.complete("a request Ctrl-C cuts short", max_tokens=2)
except KeyboardInterrupt:
    print("interrupted", flush=True)
sys.settrace(None)
client.close()
print("closed", flush=True)
"""


def test_close_returns_after_a_ctrl_c_inside_grpc(live: LiveStack) -> None:
    """gRPC's own close would wait forever for the orphaned call; the client's gives up
    after CLOSE_WAIT_SECONDS (clients/options.py), so an interrupted program still ends."""
    args = [sys.executable, "-c", _INTERRUPTED_CALL, live.blockd.address, live.computed.address]
    try:
        run = subprocess.run(args, check=False, cwd=REPO, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"close() hangs after the interrupt: {hung.stdout!r}")
    assert "interrupted" in run.stdout, (
        f"the interrupt never fired: does grpc {grpc.__version__} still start calls through "
        f"_run_channel_spin_thread? {run.stdout + run.stderr}"
    )
    assert run.stdout.split() == ["interrupted", "closed"], run.stdout + run.stderr
    assert run.returncode == 0, run.stderr
