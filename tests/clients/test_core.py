"""clients.core and clients.routing.Router: the requests, replies and routing choices
that the sync and asyncio clients share, checked without a server."""

from __future__ import annotations

import time

import grpc
import pytest

from clients import core
from clients.errors import KVCacheError
from clients.options import NO_RETRY, ClientOptions, RetryPolicy
from clients.requests import Prompt, SamplingParams
from clients.routing import Router, Tokenized
from clients.types import ChatMessage, ModelInfo, PoolMatch, Route
from kvcache.v1 import directory_pb2, generation_pb2

OPTIONS = ClientOptions(admin_token="t0k", timeout=7.0, generate_timeout=70.0)


class _Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "down"


def _info(model_id: str = "m", revision: str = "r1") -> ModelInfo:
    return ModelInfo(model_id, revision, "llama", "float32", "cpu", 16, 64, 512, 4000, (2,), True, None, "")


def _route(*workers: str) -> Route:
    matches = tuple(PoolMatch(f"pool-{w}", w, 0, 0.0, 0) for w in workers)
    return Route(matches[0].pool_id if matches else None, workers[0] if workers else None, 0, matches)


def test_admin_calls_carry_the_token_and_routing_calls_do_not() -> None:
    stats = core.get_stats(None, None)
    assert (stats.stub, stats.method, stats.is_admin) == ("admin", "GetStats", True)
    assert core.metadata(stats, OPTIONS) == (("authorization", "Bearer t0k"),)
    route = core.route([1, 2], "salt", 1, 0.5, retry=False)
    assert (route.stub, route.method, route.retry) == ("routing", "Route", NO_RETRY)
    assert core.metadata(route, OPTIONS) == ()
    assert route.request == directory_pb2.RouteRequest(
        token_ids=[1, 2], cache_salt="salt", public_prefix_tokens=1
    )


def test_replies_parse_into_client_types() -> None:
    flush = core.flush("p", None, None)
    assert flush.request == directory_pb2.FlushRequest(pool_id="p")
    result = flush.parse(directory_pb2.FlushResponse(dropped=3, busy=1))
    assert (result.dropped, result.busy) == (3, 1)
    page = core.list_blocks_page(None, 5, "next", None)
    assert page.request.page_token == "next" and page.request.page_size == 5
    assert page.parse(directory_pb2.ListBlocksResponse()).next_page_token == ""
    tokenize = core.tokenize(None, [("user", "hi")], True, None)
    assert list(tokenize.request.messages) == [ChatMessage("user", "hi").to_proto()]
    assert tokenize.parse(generation_pb2.TokenizeResponse(token_ids=[4, 5])) == [4, 5]


def test_deadlines_default_per_kind_of_call() -> None:
    now = time.monotonic()
    assert 6.5 < core.deadline(core.list_pools(None), OPTIONS) - now < 7.5
    generate = core.generate(Prompt.of("hi"), SamplingParams(), None, OPTIONS)
    assert generate.timeout == 70.0
    assert core.deadline(core.watch_events(0, None, None), OPTIONS, is_stream=True) is None


def test_retry_pause_retries_unavailable_then_raises_one_error() -> None:
    retry = RetryPolicy(max_attempts=2, initial_backoff=0.01, max_backoff=0.01)
    deadline = time.monotonic() + 5
    assert 0 <= core.retry_pause("blockd", "a:1", _Unavailable(), 0, deadline, retry) <= 0.01
    with pytest.raises(KVCacheError) as raised:
        core.retry_pause("blockd", "a:1", _Unavailable(), 1, deadline, retry)
    assert str(raised.value) == "blockd at a:1 is unreachable (UNAVAILABLE)"
    with pytest.raises(KVCacheError):  # the pause would end past the deadline
        core.retry_pause(
            "blockd", "a:1", _Unavailable(), 0, time.monotonic(), RetryPolicy(initial_backoff=1.0)
        )


def test_router_places_by_route_then_round_robin_and_counts() -> None:
    router = Router("cache-aware", ["w1:1", "w2:2"])
    assert router.asks_blockd
    assert router.place(_route("other:9", "w2:2")) == "w2:2"
    assert router.place(_route("other:9")) == "w1:1"  # no known worker ranked: round robin
    assert router.place(None) == "w2:2"
    assert (router.num_routed, router.num_round_robin) == (1, 2)
    assert router.failover_order("w2:2") == ["w2:2", "w1:1"]
    assert not Router("cache-aware", ["w1:1"]).asks_blockd
    assert not Router("round-robin", ["w1:1", "w2:2"]).asks_blockd


def test_routed_token_ids_replace_text_or_messages_only_for_the_same_model() -> None:
    text = Prompt.of("hello", cache_salt="s", request_id="r")
    chat = Prompt.of(messages=[("user", "hi")])
    tokenized = Tokenized("w1:1", (1, 7, 9))
    router = Router("cache-aware", ["w1:1", "w2:2", "w3:3"])
    sent = router.prompt_for(text, tokenized, "w1:1")  # the worker that tokenized it
    assert (sent.text, sent.token_ids, sent.cache_salt, sent.request_id) == (None, (1, 7, 9), "s", "r")
    assert router.prompt_for(chat, tokenized, "w1:1").token_ids == (1, 7, 9)
    assert router.unknown_identities(tokenized, "w2:2") == ["w1:1", "w2:2"]
    assert router.prompt_for(text, tokenized, "w2:2") is text  # not known to match: as given
    router.learn("w1:1", _info())
    router.learn("w2:2", _info())
    router.learn("w3:3", _info(revision="r2"))
    assert router.unknown_identities(tokenized, "w2:2") == []
    assert router.prompt_for(text, tokenized, "w2:2").token_ids == (1, 7, 9)
    assert router.prompt_for(text, tokenized, "w3:3") is text
    assert router.prompt_for(text, None, "w1:1") is text


def test_an_empty_prompt_stays_empty_so_generate_still_refuses_it() -> None:
    assert Tokenized("w", (1,)).apply(Prompt.of("")).text == ""
    assert Tokenized("w", (1,)).apply(Prompt.of(messages=[])).messages == ()
    assert Tokenized("w", ()).apply(Prompt.of("x")).text == "x"
