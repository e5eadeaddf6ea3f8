"""kvctl as a user runs it (`python -m clients.kvctl`), against live daemons."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid

from kvcache.v1 import directory_pb2
from tests.clients.conftest import LiveStack, dead_address, run_kvctl, unique_prompt
from tests.daemons import REPO

POOL_STATS_FIELDS = {f.name for f in directory_pb2.PoolStats.DESCRIPTOR.fields}
USAGE_KEYS = {"prompt_tokens", "cached_tokens", "completion_tokens", "time_to_first_token_seconds"}


def kvctl_json(live: LiveStack, *args: str) -> dict:
    result = run_kvctl(*args, "--json", env=live.kvctl_env())
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def generate_json(live: LiveStack, prompt: str, *extra: str) -> dict:
    return kvctl_json(live, "generate", prompt, "--max-tokens", "3", *extra)


def assert_one_line_error(result, code: int, text: str) -> None:
    assert result.returncode == code, (result.returncode, result.stderr)
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    assert text in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_generate_json_has_stable_keys_and_repeat_hits(live: LiveStack) -> None:
    prompt = unique_prompt("kvctl generate")
    first = generate_json(live, prompt)
    assert {"text", "token_ids", "finish_reason", "usage"} <= set(first)
    assert USAGE_KEYS <= set(first["usage"])
    assert first["usage"]["completion_tokens"] == len(first["token_ids"]) >= 1
    assert first["usage"]["cached_tokens"] == 0
    second = generate_json(live, prompt)
    assert second["usage"]["cached_tokens"] > 0
    assert second["text"] == first["text"]


def test_flush_then_repeat_shows_zero_cached_tokens(live: LiveStack) -> None:
    prompt = unique_prompt("kvctl flush")
    generate_json(live, prompt)
    flushed = kvctl_json(live, "flush")
    assert set(flushed) == {"dropped", "busy"}
    assert flushed["dropped"] >= 1 and flushed["busy"] == 0
    assert generate_json(live, prompt)["usage"]["cached_tokens"] == 0
    # Without a flush in between the same prompt hits again.
    assert generate_json(live, prompt)["usage"]["cached_tokens"] > 0


def test_global_json_flag_and_salt_scoped_flush(live: LiveStack) -> None:
    prompt = unique_prompt("kvctl salt")
    generate_json(live, prompt, "--salt", "tenant-x")
    result = run_kvctl("--json", "flush", "--salt", "tenant-x", env=live.kvctl_env())
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["dropped"] >= 1
    assert generate_json(live, prompt, "--salt", "tenant-x")["usage"]["cached_tokens"] == 0


def test_generate_streams_text_and_reports_cache_and_ttft(live: LiveStack) -> None:
    prompt = unique_prompt("kvctl human")
    run_kvctl("generate", prompt, "--max-tokens", "3", env=live.kvctl_env())
    result = run_kvctl("generate", prompt, "--max-tokens", "3", env=live.kvctl_env())
    assert result.returncode == 0, result.stderr
    as_json = generate_json(live, prompt)
    assert result.stdout.rstrip("\n") == as_json["text"].rstrip("\n")
    assert "cached" in result.stderr and "TTFT" in result.stderr
    assert f"cached {as_json['usage']['cached_tokens']} (" in result.stderr


def test_system_prompt_makes_a_chat(live: LiveStack) -> None:
    system = unique_prompt("kvctl system")
    first = generate_json(live, "What is a block?", "--system", system)
    second = generate_json(live, "What is a hash?", "--system", system)
    assert first["usage"]["cached_tokens"] == 0 < second["usage"]["cached_tokens"]


def test_stats_pools_blocks_tree_lookup(live: LiveStack) -> None:
    prompt = unique_prompt("kvctl inspect")
    generate_json(live, prompt)
    stats = kvctl_json(live, "stats")
    assert POOL_STATS_FIELDS <= set(stats)
    assert stats["num_cached_blocks"] >= 1 and len(stats["pools"]) == 1
    pools = kvctl_json(live, "pools")["pools"]
    assert len(pools) == 1 and pools[0]["is_live"] and pools[0]["block_size"] == 16
    blocks = kvctl_json(live, "blocks")["blocks"]
    assert len(blocks) == stats["num_cached_blocks"]
    assert all(len(b["block_hash"]) == 32 for b in blocks)
    lookup = kvctl_json(live, "lookup", prompt)
    assert lookup["matches"][0]["num_cached_tokens"] >= 16
    tokens = ",".join(str(t) for t in range(40))
    assert kvctl_json(live, "lookup", "--tokens", tokens)["num_tokens"] == 40
    tree = kvctl_json(live, "tree")
    texts = [_texts(node) for pool in tree["pools"] for node in pool["roots"]]
    assert any("kvctl inspect" in "".join(t) for t in texts), "the run that holds the prompt, decoded"
    human = run_kvctl("stats", env=live.kvctl_env())
    assert human.returncode == 0 and "hit rate" in human.stdout and "num_cached_blocks" in human.stdout
    human_tree = run_kvctl("tree", env=live.kvctl_env())
    assert human_tree.returncode == 0 and "cached prefixes" in human_tree.stdout


def _texts(node: dict) -> list[str]:
    out = [node["text"] or ""]
    for child in node["children"]:
        out.extend(_texts(child))
    return out


def test_pin_and_unpin(live: LiveStack) -> None:
    prompt = unique_prompt("kvctl pin")
    generate_json(live, prompt)
    pin = kvctl_json(live, "pin", prompt, "--ttl", "30")
    assert pin["pin_id"] and pin["num_pinned_blocks"] >= 1
    unpin = kvctl_json(live, "unpin", pin["pin_id"])
    assert unpin == {"pin_id": pin["pin_id"], "num_unpinned_blocks": pin["num_pinned_blocks"]}


def test_admin_commands_need_the_token(live: LiveStack) -> None:
    missing = run_kvctl("stats", env=live.kvctl_env(token=None))
    assert_one_line_error(missing, 4, "(UNAUTHENTICATED)")
    assert "--admin-token" in missing.stderr
    wrong = run_kvctl("flush", env=live.kvctl_env(token="not-the-token"))
    assert_one_line_error(wrong, 4, "(PERMISSION_DENIED)")
    ok = run_kvctl("--admin-token", "test-admin-token", "stats", "--json", env=live.kvctl_env(token=None))
    assert ok.returncode == 0, ok.stderr


def test_unreachable_daemons_give_one_line_errors(live: LiveStack) -> None:
    blockd = dead_address()
    result = run_kvctl("--blockd", blockd, "stats", env=live.kvctl_env())
    assert_one_line_error(result, 3, f"error: blockd at {blockd} is unreachable (UNAVAILABLE)")
    computed = dead_address()
    result = run_kvctl("--computed", computed, "generate", "hello", env=live.kvctl_env())
    assert_one_line_error(result, 3, f"error: computed at {computed} is unreachable (UNAVAILABLE)")


def test_refusals_and_usage_errors(live: LiveStack) -> None:
    refused = run_kvctl("unpin", "no-such-pin", env=live.kvctl_env())
    assert_one_line_error(refused, 1, f"blockd at {live.blockd.address}: ")
    bad = run_kvctl("generate", "hello", "--max-tokens", "0", env=live.kvctl_env())
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    neither = run_kvctl("lookup", env=live.kvctl_env())
    assert neither.returncode == 2 and "TEXT or --tokens" in neither.stderr


# ---------------------------------------------------------------- first contact and trust (issue 16)


def test_an_address_without_port_or_with_a_scheme_says_so(live: LiveStack) -> None:
    no_port = run_kvctl("--blockd", "127.0.0.1", "stats", env=live.kvctl_env())
    assert no_port.returncode == 2 and "has no port" in no_port.stderr and "127.0.0.1:50051" in no_port.stderr
    url = run_kvctl("--blockd", f"http://{live.blockd.address}", "stats", env=live.kvctl_env())
    assert url.returncode == 2 and "is a URL" in url.stderr
    assert f"e.g. {live.blockd.address}" in url.stderr, "the hint is the address without the scheme"
    env = {**live.kvctl_env(), "KVCACHE_COMPUTED": "localhost"}
    from_env = run_kvctl("generate", "hello", env=env)
    assert (
        from_env.returncode == 2
        and "KVCACHE_COMPUTED" in from_env.stderr
        and "has no port" in from_env.stderr
    )


def test_swapped_addresses_are_named(live: LiveStack) -> None:
    blockd_is_computed = run_kvctl("--blockd", live.computed.address, "stats", env=live.kvctl_env())
    assert_one_line_error(blockd_is_computed, 2, f"{live.computed.address} serves computed, not blockd")
    computed_is_blockd = run_kvctl("--computed", live.blockd.address, "generate", "hi", env=live.kvctl_env())
    assert_one_line_error(computed_is_blockd, 2, f"{live.blockd.address} serves blockd, not computed")
    assert "Method not found" not in blockd_is_computed.stderr + computed_is_blockd.stderr


def test_errors_name_kvctl_commands_not_rpcs(live: LiveStack) -> None:
    result = run_kvctl("stats", "--pool", "no-such-pool", env=live.kvctl_env())
    assert_one_line_error(result, 1, "`kvctl pools` shows the known ones")
    assert "ListPools" not in result.stderr


def test_a_deadline_mid_stream_reports_the_partial_completion(live: LiveStack) -> None:
    args = (
        "--timeout",
        "3",
        "generate",
        unique_prompt("kvctl deadline"),
        "--max-tokens",
        "7000",
        "--ignore-eos",
    )
    as_json = run_kvctl(*args, "--json", env=live.kvctl_env())
    assert as_json.returncode == 3, as_json.stderr
    partial = json.loads(as_json.stdout)
    assert partial["finish_reason"] == "timeout" and partial["text"]
    assert partial["usage"]["completion_tokens"] == len(partial["token_ids"]) >= 1
    assert partial["usage"]["cached_tokens"] is None, "unknown without the server's usage, not guessed as 0"
    assert as_json.stderr.count("\n") == 1 and "partial (finish_reason timeout)" in as_json.stderr
    human = run_kvctl(*args, env=live.kvctl_env())
    assert human.returncode == 3 and human.stdout.strip(), human.stderr
    assert "(--timeout) expired after" in human.stderr and "did not answer" not in human.stderr


def test_tables_keep_whole_ids_when_piped(live: LiveStack) -> None:
    prompt = unique_prompt("kvctl pipe")
    generate_json(live, prompt)
    pool_id = kvctl_json(live, "pools")["pools"][0]["pool_id"]
    env = {k: v for k, v in live.kvctl_env().items() if k != "COLUMNS"}
    for command in (("pools",), ("stats",), ("lookup", prompt)):
        result = run_kvctl(*command, env=env)
        assert result.returncode == 0, result.stderr
        assert pool_id in result.stdout and "…" not in result.stdout, (command, result.stdout)
    assert live.computed.address in run_kvctl("pools", env=env).stdout


def test_pin_of_one_block_says_one_block(live: LiveStack) -> None:
    tokens = ",".join(str(3 + (uuid.uuid4().int >> k) % 380) for k in range(0, 120, 6))  # 20 tokens
    kvctl_json(live, "generate", "--tokens", tokens, "--max-tokens", "2")
    pinned = run_kvctl("pin", "--tokens", tokens, "--ttl", "30", env=live.kvctl_env())
    assert pinned.returncode == 0, pinned.stderr
    assert "pinned 16 tokens (1 block)" in pinned.stdout, pinned.stdout
    pin_id = pinned.stdout.split()[-1]
    unpinned = run_kvctl("unpin", pin_id, env=live.kvctl_env())
    assert unpinned.returncode == 0 and "unpinned 1 block\n" in unpinned.stdout, unpinned.stdout


def test_watch_shows_new_events_only_and_exits_130_on_ctrl_c(live: LiveStack) -> None:
    generate_json(live, unique_prompt("kvctl watch history"))  # history the watch must not replay
    before = kvctl_json(live, "stats")["last_event_sequence"]
    assert before >= 1
    proc = subprocess.Popen(
        [sys.executable, "-m", "clients.kvctl", "watch", "--json"],
        cwd=REPO,
        env=live.kvctl_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
        first = None
        deadline = time.monotonic() + 90
        while first is None and time.monotonic() < deadline:
            generate_json(live, unique_prompt("kvctl watch live"))  # until the watch has subscribed
            try:
                first = json.loads(lines.get(timeout=2))
            except queue.Empty:
                continue
        assert first is not None, "no event reached kvctl watch"
        assert first["sequence"] > before, "without --after, watch starts at the current last event"
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, proc.stderr.read()
    assert "Traceback" not in proc.stderr.read()


def test_why_cache_policy_and_unpin_all(live: LiveStack) -> None:
    prompt = unique_prompt("kvctl why " + "padding words " * 8)
    why = kvctl_json(live, "why", prompt)
    assert why["pools"][0]["reason"] == "never_seen" and why["pools"][0]["num_cached_tokens"] == 0
    generate_json(live, prompt, "--cache-policy", "read_only", "--priority", "90")
    why = kvctl_json(live, "why", prompt)
    assert why["pools"][0]["reason"] == "not_stored", why  # computed, never stored
    human = run_kvctl("why", prompt, env=live.kvctl_env())
    assert human.returncode == 0 and "not_stored" in human.stdout, human.stdout
    not_cached = run_kvctl("pin", prompt, env=live.kvctl_env())
    assert_one_line_error(not_cached, 1, "nothing to pin")
    generate_json(live, prompt)
    assert kvctl_json(live, "pin", prompt, "--ttl", "30")["num_pinned_blocks"] >= 1
    unpinned = kvctl_json(live, "unpin", "--all")
    assert unpinned["num_unpinned_pins"] >= 1
    stats = kvctl_json(live, "stats")
    assert stats["miss_tokens"].get("not_stored", 0) > 0 and stats["eviction_policy"] == "adaptive"


def test_an_empty_prompt_is_a_usage_error_naming_the_argument(live: LiveStack) -> None:
    for command in ("lookup", "route", "pin", "why", "generate"):
        result = run_kvctl(command, "", env=live.kvctl_env())
        assert result.returncode == 2, (command, result.returncode, result.stderr)
        assert "'TEXT'" in result.stderr and "the prompt is empty" in result.stderr, result.stderr
        assert "token_ids" not in result.stderr and "INVALID_ARGUMENT" not in result.stderr
    tokens = run_kvctl("lookup", "--tokens", "", env=live.kvctl_env())
    assert tokens.returncode == 2 and "'--tokens'" in tokens.stderr, tokens.stderr
