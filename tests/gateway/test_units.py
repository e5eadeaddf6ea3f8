"""The gateway's pure parts: validation, the status table, response shapes, tenants, config."""

from __future__ import annotations

import grpc
import pytest

from clients.errors import KVCacheError
from clients.requests import WHOLE_COMPLETION
from clients.types import ChatMessage, Usage
from gateway.__main__ import parse_args
from gateway.app import route_label, worker_fields
from gateway.config import GatewayConfig
from gateway.errors import GRPC_STATUS, ApiError, from_daemon
from gateway.responses import Reply, sse, usage_body
from gateway.schema import parse_chat, parse_completion
from gateway.tenants import Tenants, parse_keys, salt_for

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _error(parse, body) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(body)
    return caught.value


# ---------------------------------------------------------------- schema


def test_chat_maps_every_served_parameter() -> None:
    req = parse_chat(
        {
            **CHAT,
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "c"},
            ],
            "max_completion_tokens": 5,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": -1,
            "stop": "x",
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": False,
            "user": "u",
        }
    )
    assert req.prompts[0].messages == (
        ChatMessage("system", "s"),
        ChatMessage("user", "ab"),
        ChatMessage("assistant", "c"),
    )
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.stop) == (5, 0.5, 0.9, (1 << 64) - 1, ("x",))
    assert req.n == 2 and req.stream and req.include_usage
    assert req.sampling_for(1).seed == 0 and req.sampling_for(0).seed == (1 << 64) - 1


@pytest.mark.parametrize(
    ("prompt", "expect"),
    [
        ("abc", [("abc", None)]),
        (["a", "b"], [("a", None), ("b", None)]),
        ([1, 2, 3], [(None, (1, 2, 3))]),
        ([[1], [2, 3]], [(None, (1,)), (None, (2, 3))]),
    ],
)
def test_completion_prompt_forms(prompt, expect) -> None:
    req = parse_completion({"model": "m", "prompt": prompt})
    assert [(p.text, p.token_ids) for p in req.prompts] == expect


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
        ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({**CHAT, "tools": [{"type": "function"}]}, "tools"),
        ({**CHAT, "frequency_penalty": 3}, "frequency_penalty"),
        ({**CHAT, "presence_penalty": "x"}, "presence_penalty"),
        ({**CHAT, "repetition_penalty": 0}, "repetition_penalty"),
        ({**CHAT, "min_p": 1.5}, "min_p"),
        ({**CHAT, "top_k": -2}, "top_k"),
        ({**CHAT, "logit_bias": {"a": 1}}, "logit_bias"),
        ({**CHAT, "logit_bias": {"5": 101}}, "logit_bias"),
        ({**CHAT, "stop_token_ids": [-1]}, "stop_token_ids"),
        ({**CHAT, "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
        ({**CHAT, "use_beam_search": True}, "use_beam_search"),
        ({**CHAT, "skip_special_tokens": False}, "skip_special_tokens"),
        ({**CHAT, "echo": True}, "echo"),
        ({**CHAT, "no_such_parameter": 1}, "no_such_parameter"),
        ({**CHAT, "cache_salt": "x"}, "cache_salt"),
        ({**CHAT, "temperature": -1}, "temperature"),
        ({**CHAT, "temperature": "hot"}, "temperature"),
        ({**CHAT, "top_p": 1.5}, "top_p"),
        ({**CHAT, "n": 17}, "n"),
        ({**CHAT, "max_tokens": 0}, "max_tokens"),
        ({**CHAT, "max_tokens": 2, "max_completion_tokens": 2}, "max_completion_tokens"),
        ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({**CHAT, "stop": [""]}, "stop"),
        ({**CHAT, "seed": 1.5}, "seed"),
        ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
        ({**CHAT, "stream": "yes"}, "stream"),
        ({**CHAT, "model": ""}, "model"),
        ({"messages": CHAT["messages"]}, "model"),
        ({**CHAT, "messages": []}, "messages"),
        ({**CHAT, "messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
        ({**CHAT, "messages": [{"role": "user", "content": "x", "name": 3}]}, "messages[0].name"),
        (
            {**CHAT, "messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]},
            "messages[0].tool_calls",
        ),
        (
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
        ),
        ({**CHAT, "messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ],
)
def test_chat_refusals_name_the_parameter(body, param) -> None:
    error = _error(parse_chat, body)
    assert error.status.http == 400 and error.param == param and param.split("[")[0] in error.message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "prompt": ""}, "prompt"),
        ({"model": "m", "prompt": []}, "prompt"),
        ({"model": "m", "prompt": [1, "a"]}, "prompt"),
        ({"model": "m", "prompt": [-1]}, "prompt"),
        ({"model": "m", "prompt": "a", "echo": "yes"}, "echo"),
        ({"model": "m", "prompt": "a", "logprobs": 21}, "logprobs"),
        ({"model": "m", "prompt": "a", "logprobs": True}, "logprobs"),
        ({"model": "m", "prompt": "a", "add_special_tokens": False}, "add_special_tokens"),
        ({"model": "m", "prompt": "a", "best_of": 3}, "best_of"),
        ({"model": "m", "prompt": "a", "suffix": "z"}, "suffix"),
        ({"model": "m", "prompt": "a", "max_completion_tokens": 3}, "max_completion_tokens"),
    ],
)
def test_completion_refusals_name_the_parameter(body, param) -> None:
    assert _error(parse_completion, body).param == param


def test_noop_defaults_are_accepted() -> None:
    req = parse_completion({"model": "m", "prompt": "a", "echo": False, "best_of": 1, "logprobs": None})
    assert req.n == 1 and not req.stream


# vLLM's server's own defaults for every parameter it accepts (and OpenAI's), as clients send them.
VLLM_NEUTRAL = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0,
    "repetition_penalty": 1.0,
    "logit_bias": None,
    "logprobs": None,
    "top_k": -1,
    "min_p": 0.0,
    "min_tokens": 0,
    "stop_token_ids": [],
    "ignore_eos": False,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "truncate_prompt_tokens": None,
    "allowed_token_ids": None,
    "bad_words": [],
    "prompt_logprobs": None,
    "priority": 0,
    "return_tokens_as_token_ids": None,
    "structured_outputs": None,
    "guided_json": None,
    "response_format": None,
    "seed": None,
    "user": None,
    "n": 1,
    "best_of": None,
    "stream": False,
    "parallel_tool_calls": True,
    "tool_choice": "none",
    "tools": None,
    "kv_transfer_params": None,
    "vllm_xargs": None,
    "cache_salt": None,
}


def test_every_vllm_neutral_value_is_accepted_and_means_off() -> None:
    chat = parse_chat(
        {**CHAT, **VLLM_NEUTRAL, "top_logprobs": 0, "add_generation_prompt": True, "echo": False}
    )
    completion = parse_completion(
        {"model": "m", "prompt": "a", **VLLM_NEUTRAL, "echo": False, "suffix": None}
    )
    for req in (chat, completion):
        s = req.sampling
        assert s.top_k is None and s.min_p == 0.0 and s.repetition_penalty == 1.0 and s.logprobs is None
        assert (
            s.presence_penalty == 0 and s.frequency_penalty == 0 and s.logit_bias == () and s.min_tokens == 0
        )
        assert req.logprobs is None and not req.echo


def test_served_extensions_map_to_the_worker_call() -> None:
    body = {
        **CHAT,
        "messages": [
            {"role": "developer", "content": "d", "name": "ops"},
            {"role": "assistant", "content": "a", "refusal": None, "tool_calls": []},
        ],
        "logprobs": True,
        "top_logprobs": 3,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.2,
        "min_p": 0.1,
        "top_k": 40,
        "logit_bias": {"7": -100, "3": 2.5},
        "stop_token_ids": [2, 9],
        "min_tokens": 2,
    }
    req = parse_chat(body)
    assert req.prompts[0].messages == (ChatMessage("system", "d", "ops"), ChatMessage("assistant", "a"))
    call = req.prompts[0].to_request(req.sampling)
    assert (call.presence_penalty, call.frequency_penalty, call.min_p, call.top_k) == pytest.approx(
        (0.5, -0.5, 0.1, 40)
    )
    assert call.repetition_penalty == pytest.approx(1.2)
    assert dict(call.logit_bias) == {3: 2.5, 7: -100.0} and list(call.stop_token_ids) == [2, 9]
    assert call.logprobs == 3 and not call.HasField("prompt_logprobs") and call.min_tokens == 2
    assert call.messages[0].name == "ops"
    completion = parse_completion({"model": "m", "prompt": "a", "echo": True, "logprobs": 1, "max_tokens": 1})
    call = completion.prompts[0].to_request(completion.sampling)
    assert completion.echo and (call.logprobs, call.prompt_logprobs) == (1, 1)
    # An echoed token prompt needs its tokens' text: prompt logprobs carry it.
    tokens = parse_completion({"model": "m", "prompt": [5, 6], "echo": True})
    assert tokens.sampling.prompt_logprobs == 0 and tokens.sampling.logprobs is None


@pytest.mark.parametrize("stream", [False, True])
def test_only_streams_ask_the_worker_for_every_token(stream) -> None:
    # A non-streaming reply is read whole: the worker groups what follows the first token.
    body = {"model": "m", "prompt": "hi", "stream": stream}
    expect = 0 if stream else WHOLE_COMPLETION
    assert parse_completion(body).sampling.stream_interval == expect
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    assert parse_chat(chat).sampling.stream_interval == expect


def test_a_body_that_is_not_an_object_is_400() -> None:
    assert _error(parse_chat, [1]).status.http == 400


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        (
            {"model": 5},
            "model",
            "'model' must be a non-empty string, one of the ids GET /v1/models lists; got 5",
        ),
        ({"model": None}, "model", "'model' is required"),
        ({"max_tokens": True}, "max_tokens", "'max_tokens' must be an integer >= 1, got true"),
        ({"n": None, "top_k": False}, "top_k", "got false"),
        ({"temperature": "hot"}, "temperature", 'got "hot"'),
        (
            {"stop_token_ids": [-1]},
            "stop_token_ids",
            "integers >= 0 and below the model's vocabulary size; got -1",
        ),
        ({"seed": [1]}, "seed", "got [1]"),
        ({"logit_bias": {"x": 1}}, "logit_bias", 'got "x"'),
        ({"logit_bias": {"1": None}}, "logit_bias", "got null"),
    ],
)
def test_refusals_say_what_to_fix_with_values_in_json(body, param, says) -> None:
    error = _error(parse_completion, {"model": "m", "prompt": "x", **body})
    assert error.param == param and says in error.message, error.message
    assert "True" not in error.message and "None" not in error.message and "'x'" not in error.message


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("code", "http"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 400),
        (grpc.StatusCode.NOT_FOUND, 404),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (grpc.StatusCode.INTERNAL, 500),
    ],
)
def test_grpc_codes_map_to_http(code, http) -> None:
    error = from_daemon(KVCacheError("computed", "127.0.0.1:1", code, "why"))
    assert error.status.http == http
    body = error.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]


@pytest.mark.parametrize(
    ("kind", "body", "details", "param", "message"),
    [
        (
            "completion",
            {},
            "prompt_token_ids: token id 99999 is out of range; the vocab has 384 ids",
            "prompt",
            "prompt: token id 99999 is out of range; the vocab has 384 ids",
        ),
        (
            "chat",
            {},
            "prompt_token_ids: token id 99999 is out of range; the vocab has 384 ids",
            "messages",
            "messages: token id 99999 is out of range; the vocab has 384 ids",
        ),
        ("chat", {}, "logit_bias: 5000 is not below the vocab size 384", "logit_bias", None),
        ("completion", {}, "stop_token_ids: 5000 is not below the vocab size 384", "stop_token_ids", None),
        (
            "chat",
            {"max_completion_tokens": 9000},
            (
                "prompt has 9 tokens and max_tokens is 9000, but the model's context is 2048: at most "
                "2039 completion tokens fit; lower max_tokens to 2039 or shorten the prompt by 6961 tokens"
            ),
            "max_completion_tokens",
            (
                "prompt has 9 tokens and max_completion_tokens is 9000, but the model's context is 2048: "
                "at most 2039 completion tokens fit; lower max_completion_tokens to 2039 or shorten the "
                "prompt by 6961 tokens"
            ),
        ),
        ("completion", {}, "min_tokens must be in [0, max_tokens=4], got 9", "min_tokens", None),
        (
            "chat",
            {},
            "prompt has 3000 tokens but the model's context is 2048: send at most",
            "messages",
            None,
        ),
    ],
)
def test_worker_refusals_speak_of_the_requests_fields(kind, body, details, param, message) -> None:
    refusal = KVCacheError("computed", "127.0.0.1:1", grpc.StatusCode.INVALID_ARGUMENT, details)
    error = from_daemon(refusal, worker_fields(kind, body))
    assert error.status.http == 400 and error.param == param
    assert error.message == (message or details)


def test_detokenize_refusal_names_tokens() -> None:
    details = "token_ids: token id 999999999 is out of range; the vocab has 384 ids"
    refusal = KVCacheError("computed", "127.0.0.1:1", grpc.StatusCode.INVALID_ARGUMENT, details)
    error = from_daemon(refusal, {"token_ids": "tokens"})
    assert error.param == "tokens" and error.message.startswith("tokens: token id 999999999")


def test_metrics_label_a_route_by_its_template() -> None:
    class Route:
        path = "/v1/models/{model:path}"
        path_format = "/v1/models/{model}"

    assert route_label({"route": Route()}) == "/v1/models/{model}"
    assert route_label({}) == "unmatched"


def test_every_grpc_code_has_a_row() -> None:
    assert set(GRPC_STATUS) == set(grpc.StatusCode) - {grpc.StatusCode.OK}


# ---------------------------------------------------------------- responses


def _usage(prompt: int, cached: int, completion: int) -> Usage:
    return Usage(prompt, cached, completion, 0.1, 0.2, 0)


def test_usage_counts_each_prompt_once_and_every_completion() -> None:
    body = usage_body([_usage(10, 8, 3), _usage(10, 0, 4), _usage(5, 0, 1), _usage(5, 0, 2)], n=2)
    assert body == {
        "prompt_tokens": 15,
        "completion_tokens": 10,
        "total_tokens": 25,
        "prompt_tokens_details": {"cached_tokens": 8},
    }


def test_chat_chunks_and_bodies() -> None:
    reply = Reply.new("chat", "m")
    assert reply.id.startswith("chatcmpl-")
    first = reply.chunk(0, "a", None, first=True, with_usage=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "a"} and first["usage"] is None
    last = reply.chunk(0, "", "stop")
    assert last["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    body = reply.body(["x"], ["length"], {})
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "x"
    assert Reply.new("completion", "m").body(["y"], ["stop"], {})["choices"][0]["text"] == "y"


# ---------------------------------------------------------------- tenants


def test_keys_parse_and_authenticate() -> None:
    keys = parse_keys(["# comment", "", "k1=alpha", "k2 = beta  # trailing"], "file")
    assert keys == {"k1": "alpha", "k2": "beta"}
    tenants = Tenants(keys, public_prefix_tokens=16)
    assert not tenants.is_open and tenants.names == ["alpha", "beta"]
    assert tenants.authenticate("Bearer k1") == "alpha" and tenants.authenticate("bearer k2") == "beta"
    assert tenants.authenticate("Bearer k3") is None and tenants.authenticate(None) is None
    assert tenants.authenticate("Basic k1") is None
    assert tenants.scope("alpha").public_prefix_tokens == 16


@pytest.mark.parametrize("entry", ["novalue", "=t", "k="])
def test_bad_key_entries_are_refused(entry) -> None:
    with pytest.raises(ValueError, match="KEY=TENANT"):
        parse_keys([entry], "env")


def test_open_gateway_and_salts() -> None:
    assert Tenants({}).authenticate(None) == "" and Tenants({}).scope("").cache_salt == ""
    assert salt_for("a") != salt_for("b") and salt_for("ab") != salt_for("a") and salt_for("a")


# ---------------------------------------------------------------- config


def test_parse_args_builds_the_config(tmp_path, monkeypatch) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k=t\n")
    monkeypatch.setenv("GATEWAY_API_KEYS", "e=u")
    config = parse_args(
        ["--computed", "a:1,b:2", "--computed", "c:3", "--api-keys-file", str(keys), "--blockd", ""]
    )
    assert config.computed == ("a:1", "b:2", "c:3") and config.blockd is None
    assert dict(config.api_keys) == {"k": "t", "e": "u"}


def test_workers_come_from_blockd_unless_listed_or_turned_off(monkeypatch) -> None:
    for name in ("GATEWAY_DISCOVER", "GATEWAY_COMPUTED", "GATEWAY_BLOCKD"):
        monkeypatch.delenv(name, raising=False)
    assert parse_args([]).discover and parse_args([]).computed == ()  # every worker from blockd
    assert parse_args(["--no-discover"]).computed == ("127.0.0.1:50052",)
    assert parse_args(["--blockd", ""]).computed == ("127.0.0.1:50052",)  # nothing to discover from
    monkeypatch.setenv("GATEWAY_DISCOVER", "0")
    assert not parse_args([]).discover


def test_the_directory_mirror_is_on_unless_turned_off(monkeypatch) -> None:
    monkeypatch.delenv("GATEWAY_MIRROR", raising=False)
    assert parse_args([]).mirror and parse_args([]).blockd_admin_token is None
    assert not parse_args(["--no-mirror"]).mirror
    config = parse_args(["--mirror-max-blocks", "10", "--blockd-admin-token", "t"])
    assert (config.mirror_max_blocks, config.blockd_admin_token) == (10, "t")
    monkeypatch.setenv("GATEWAY_MIRROR", "0")
    assert not parse_args([]).mirror and parse_args(["--mirror"]).mirror


@pytest.mark.parametrize(
    "kwargs",
    [
        {"listen": "8000"},
        {"computed": (), "discover": False},  # no workers and none to learn
        {"computed": (), "blockd": None},
        {"routing": "random"},
        {"max_inflight_per_worker": 0},
        {"computed": ("http://a:1",)},
        {"mirror_max_blocks": 0},
    ],
)
def test_config_refuses_bad_values(kwargs) -> None:
    with pytest.raises(ValueError):
        GatewayConfig(**kwargs)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_streamed_chunk_events_are_the_dict_paths_bytes(kind) -> None:
    """`Reply.chunk_event` (the per-token template) writes what `sse(Reply.chunk(...))` writes."""
    reply = Reply(kind, 'model "q" \u00e9', "id-\\1", 1_700_000_000)
    texts = [
        "",
        " word",
        'a "quote" \\ back',
        "tab\there\nnew",
        "\u00e9\u4e2d\U0001f600",
        "\x00\x1f\x7f",
        "</s>",
    ]
    for index in (0, 3):
        for text in texts:
            for reason in (None, "stop", "length"):
                for first in (False, True):
                    for with_usage in (False, True):
                        for logprobs in (None, {"content": [], "refusal": None}):
                            args = (index, text, reason)
                            kwargs = {"first": first, "with_usage": with_usage, "logprobs": logprobs}
                            assert reply.chunk_event(*args, **kwargs) == sse(reply.chunk(*args, **kwargs))
