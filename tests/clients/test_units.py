"""The clients' pure parts: retry backoff, routing choice, prefix trees, results, errors."""

from __future__ import annotations

import random

import click
import grpc
import pytest

from clients.errors import KVCacheError
from clients.kvctl import parse_token_ids
from clients.options import ClientOptions, RetryPolicy, TlsOptions
from clients.prefix_tree import build_prefix_forest
from clients.requests import Prompt, SamplingParams
from clients.routing import RoundRobin, choose_routed, normalize_address
from clients.types import BlockInfo, Completion, GenerateChunk, PoolMatch, Route, Usage, to_dict


def test_backoff_grows_exponentially_with_jitter_and_is_capped() -> None:
    policy = RetryPolicy(max_attempts=6, initial_backoff=0.1, max_backoff=0.5, multiplier=2.0)
    rng = random.Random(7)
    for attempt, ceiling in enumerate([0.1, 0.2, 0.4, 0.5, 0.5]):
        samples = [policy.backoff(attempt, rng) for _ in range(200)]
        assert all(0.0 <= s <= ceiling for s in samples)
        assert max(samples) > 0.8 * ceiling, "jitter spreads over the whole window"
        assert len(set(samples)) > 150, "jittered, not fixed"


def test_retry_only_unavailable_and_only_up_to_max_attempts() -> None:
    policy = RetryPolicy(max_attempts=3)
    assert policy.should_retry(grpc.StatusCode.UNAVAILABLE, 0)
    assert policy.should_retry(grpc.StatusCode.UNAVAILABLE, 1)
    assert not policy.should_retry(grpc.StatusCode.UNAVAILABLE, 2)
    for code in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.PERMISSION_DENIED,
    ):
        assert not policy.should_retry(code, 0)


@pytest.mark.parametrize(
    "kwargs", [{"max_attempts": 0}, {"initial_backoff": 3.0, "max_backoff": 1.0}, {"multiplier": 0.5}]
)
def test_retry_policy_rejects_nonsense(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)


def test_options_validate_and_build_admin_metadata(tmp_path) -> None:
    assert ClientOptions().admin_metadata() == ()
    assert ClientOptions(admin_token="s3cret").admin_metadata() == (("authorization", "Bearer s3cret"),)
    with pytest.raises(ValueError):
        ClientOptions(timeout=0)
    with pytest.raises(ValueError):
        ClientOptions(admin_token="  ")
    with pytest.raises(ValueError, match="both or neither"):
        TlsOptions(client_cert=tmp_path / "c.pem")
    with pytest.raises(ValueError, match="not found"):
        TlsOptions(root_cert=tmp_path / "missing.pem")


def test_error_messages_are_one_line() -> None:
    down = KVCacheError("blockd", "127.0.0.1:50051", grpc.StatusCode.UNAVAILABLE, "failed to connect\nto all")
    assert str(down) == "blockd at 127.0.0.1:50051 is unreachable (UNAVAILABLE)"
    assert down.is_unreachable and not down.is_auth
    refused = KVCacheError("computed", "h:1", grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be\n >= 1")
    assert str(refused) == "computed at h:1: max_tokens must be >= 1 (INVALID_ARGUMENT)"
    assert KVCacheError("blockd", "h:1", grpc.StatusCode.PERMISSION_DENIED, "wrong").is_auth


def test_round_robin_cycles() -> None:
    rr = RoundRobin(["a:1", "b:2", "c:3"])
    assert [rr.next() for _ in range(7)] == ["a:1", "b:2", "c:3", "a:1", "b:2", "c:3", "a:1"]
    with pytest.raises(ValueError):
        RoundRobin([])


def _match(address: str, cached: int) -> PoolMatch:
    return PoolMatch(
        pool_id=f"pool-{address}", worker_address=address, num_cached_tokens=cached, load=0.0, num_sequences=0
    )


def test_choose_routed_takes_the_best_known_worker_as_the_client_spells_it() -> None:
    mine = ["localhost:50052", "127.0.0.1:50053"]
    route = Route("p1", "127.0.0.1:50052", 32, (_match("127.0.0.1:50052", 32), _match("127.0.0.1:50053", 0)))
    assert choose_routed(route, mine) == "localhost:50052"
    # The best pool belongs to a worker this client was not given: the next known one wins.
    foreign = Route("p9", "10.0.0.9:50052", 64, (_match("10.0.0.9:50052", 64), _match("127.0.0.1:50053", 16)))
    assert choose_routed(foreign, mine) == "127.0.0.1:50053"
    assert choose_routed(Route(None, None, 0, ()), mine) is None
    assert normalize_address("dns:///localhost:1") == "127.0.0.1:1"


def _block(
    block_id: int, index: int, parent: bytes | None, tokens: list[int], pool: str = "p", refs: int = 0
) -> BlockInfo:
    return BlockInfo(pool, block_id, bytes([block_id]) * 16, parent, tuple(tokens), refs, False, index, False)


def test_prefix_forest_compresses_runs_and_branches() -> None:
    # 0 -> 1 -> 2 -> {3, 5 -> 6}; 4 is another first block; 7's parent is not cached.
    b = {i: bytes([i]) * 16 for i in range(10)}
    blocks = [
        _block(0, 0, None, [1, 2]),
        _block(1, 1, b[0], [3, 4]),
        _block(2, 2, b[1], [5, 6]),
        _block(3, 3, b[2], [7, 8], refs=2),
        _block(5, 3, b[2], [9, 9]),
        _block(6, 4, b[5], [8, 8]),
        _block(4, 0, None, [0, 0]),
        _block(7, 5, b"\xee" * 16, [1, 1]),
        _block(1, 0, None, [4, 4], pool="other"),
    ]
    forest = build_prefix_forest(blocks)
    assert list(forest) == ["other", "p"]
    roots = forest["p"]
    assert [r.block_ids for r in roots] == [[0, 1, 2], [4], [7]]
    trunk = roots[0]
    assert trunk.token_ids == [1, 2, 3, 4, 5, 6]
    assert [c.block_ids for c in trunk.children] == [[3], [5, 6]]
    assert trunk.children[0].max_ref_count == 2
    assert roots[2].is_orphan and not trunk.is_orphan
    assert len(list(trunk.walk())) == 3
    assert trunk.to_dict()["children"][1]["token_ids"] == [9, 9, 8, 8]


def test_completion_from_chunks_and_json_keys() -> None:
    usage = Usage(10, 8, 3, 0.01, 0.05, 0)
    chunks = [
        GenerateChunk("r1", (5,), "he", None, None),
        GenerateChunk("r1", (6, 7), "llo", "length", usage),
    ]
    completion = Completion.from_chunks(chunks, "127.0.0.1:50052")
    assert completion.text == "hello" and completion.token_ids == (5, 6, 7)
    as_json = completion.to_dict()
    assert {"text", "token_ids", "finish_reason", "usage"} <= set(as_json)
    assert {"prompt_tokens", "cached_tokens", "completion_tokens", "time_to_first_token_seconds"} <= set(
        as_json["usage"]
    )
    assert to_dict(_block(1, 0, None, [1]))["block_hash"] == "01" * 16
    with pytest.raises(ValueError, match="without finish_reason"):
        Completion.from_chunks(chunks[:1], "x")


def test_prompt_needs_exactly_one_form_and_builds_requests() -> None:
    with pytest.raises(ValueError):
        Prompt.of("text", token_ids=[1])
    with pytest.raises(ValueError):
        Prompt.of()
    request = Prompt.of(
        messages=[("system", "s"), {"role": "user", "content": "u"}], cache_salt="t"
    ).to_request(SamplingParams.of(max_tokens=4, stop="END", temperature=0.0))
    assert [m.role for m in request.messages] == ["system", "user"]
    assert request.max_tokens == 4 and request.HasField("temperature") and not request.HasField("top_p")
    assert list(request.stop) == ["END"] and request.cache_salt == "t"


def test_parse_token_ids() -> None:
    assert parse_token_ids("1,2, 3") == [1, 2, 3]
    for bad in ("1,x", "", "-1"):
        with pytest.raises(click.BadParameter):
            parse_token_ids(bad)


def test_kvctl_help_explains_every_option_and_names_the_env_vars() -> None:
    from click.testing import CliRunner

    from clients.kvctl import cli

    for command in cli.commands.values():
        undocumented = [p.name for p in command.params if isinstance(p, click.Option) and not p.help]
        assert not undocumented, f"kvctl {command.name}: {undocumented}"
    shown = CliRunner().invoke(cli, ["--help"], terminal_width=200).output
    for variable in (
        "KVCACHE_BLOCKD",
        "KVCACHE_COMPUTED",
        "KVCACHE_ADMIN_TOKEN",
        "KVCACHE_TIMEOUT",
        "KVCACHE_TLS_CA",
        "KVCACHE_TLS_SERVER_NAME",
    ):
        assert variable in shown
