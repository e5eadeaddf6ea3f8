"""The request shapes the common clients send (tests/gateway/fixtures/clients/*.json, each
naming the client and where its shape comes from) answered 200 with a well-formed body or
stream, read back through the openai SDK's own response types; plus vLLM's extras that
tools probe (/tokenize, /detokenize, /version, /v1/models' max_model_len), OpenAI-shaped
errors on unknown paths, x-request-id and the worker header."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.gateway.conftest import KEY_A, MODEL, GatewayStack, http, unique_prompt

FIXTURES = sorted((Path(__file__).parent / "fixtures" / "clients").glob("*.json"))
AUTH = {"Authorization": f"Bearer {KEY_A}"}


def _load(path: Path) -> dict[str, Any]:
    fixture = json.loads(path.read_text())
    fixture["body"] = json.loads(json.dumps(fixture["body"]).replace('"MODEL"', json.dumps(MODEL)))
    return fixture


def _events(text: str) -> list[dict[str, Any]]:
    """The JSON payloads of an SSE body, which must end with [DONE]."""
    lines = [line for line in text.split("\n") if line]
    assert all(line.startswith("data: ") for line in lines), lines[:3]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


def _completion_chunk(event: dict[str, Any]) -> Completion:
    """A streamed completion chunk: Completion's shape, but finish_reason null until the end
    (the SDK reads stream chunks without validating; this checks each field's type)."""
    assert event["object"] == "text_completion" and isinstance(event["id"], str)
    for choice in event["choices"]:
        assert isinstance(choice["text"], str) and choice["finish_reason"] in (None, "stop", "length")
    final = {
        **event,
        "choices": [{**c, "finish_reason": c["finish_reason"] or "length"} for c in event["choices"]],
    }
    chunk = Completion.model_validate(_unscored_first(final))
    for parsed, raw in zip(chunk.choices, event["choices"], strict=True):
        parsed.finish_reason = raw["finish_reason"]
    return chunk


def _unscored_first(body: dict[str, Any]) -> dict[str, Any]:
    """An echoed prompt's first token has no logprob: null in OpenAI's and vLLM's answers,
    which the SDK's types (never validated by the SDK itself) do not allow; checked here
    as 0 / {} once the test has looked at the nulls."""
    choices = []
    for c in body["choices"]:
        lp = c.get("logprobs")
        if lp is not None and "token_logprobs" in lp:
            lp = {
                **lp,
                "token_logprobs": [0.0 if x is None else x for x in lp["token_logprobs"]],
                "top_logprobs": [{} if x is None else x for x in lp["top_logprobs"]],
            }
        choices.append({**c, "logprobs": lp})
    return {**body, "choices": choices}


def _num_choices(body: dict[str, Any]) -> int:
    prompt = body.get("prompt")
    prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    return prompts * (body.get("n") or 1)


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_client_fixture_is_answered(gw: GatewayStack, path: Path) -> None:
    fixture = _load(path)
    body, chat = fixture["body"], fixture["path"].endswith("chat/completions")
    status, headers, text = http(
        gw.gateway.address, "POST", fixture["path"], body, {**AUTH, "x-request-id": path.stem}
    )
    assert status == 200, (fixture["client"], text)
    assert headers["x-request-id"] == path.stem
    assert headers["x-kvcache-worker"] in {w.address for w in gw.workers} | {
        ",".join(sorted({w.address for w in gw.workers}))
    } or all(a in {w.address for w in gw.workers} for a in headers["x-kvcache-worker"].split(","))
    choices = _num_choices(body)
    asks_logprobs = body.get("logprobs") not in (None, False)
    if body.get("stream"):
        events = _events(text)
        usage_asked = (body.get("stream_options") or {}).get("include_usage")
        parsed = [ChatCompletionChunk.model_validate(e) if chat else _completion_chunk(e) for e in events]
        if usage_asked:
            assert parsed[-1].choices == [] and parsed[-1].usage.completion_tokens > 0
            parsed = parsed[:-1]
        assert {c.choices[0].index for c in parsed} == set(range(choices))
        finished = [c.choices[0].finish_reason for c in parsed if c.choices[0].finish_reason]
        assert len(finished) == choices and set(finished) <= {"stop", "length"}
        if asks_logprobs:
            with_tokens = [c for c in parsed if c.choices[0].logprobs is not None]
            assert with_tokens, "a stream that asked for logprobs carries them"
        return
    raw = json.loads(text)
    reply = ChatCompletion.model_validate(raw) if chat else Completion.model_validate(_unscored_first(raw))
    assert len(reply.choices) == choices and reply.usage.total_tokens > 0
    for choice in reply.choices:
        assert choice.finish_reason in ("stop", "length")
        if not asks_logprobs:
            assert choice.logprobs is None
        elif chat:
            assert choice.logprobs.content and all(e.logprob <= 0 for e in choice.logprobs.content)
        else:
            lp = choice.logprobs
            assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    if body.get("echo"):
        _check_echo(body, raw)


def _check_echo(body: dict[str, Any], reply: dict[str, Any]) -> None:
    """lm-eval reads token_logprobs[ctxlen:-1]: every prompt token, then the generated one."""
    prompts = body["prompt"]
    for choice, prompt in zip(reply["choices"], prompts, strict=True):
        lp = choice["logprobs"]
        if isinstance(prompt, str):
            assert choice["text"].startswith(prompt)
        else:
            assert len(lp["tokens"]) == len(prompt) + body["max_tokens"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(x is not None and x <= 0 for x in lp["token_logprobs"][1:])
        assert all(len(top) >= 1 for top in lp["top_logprobs"][1:])
        assert lp["text_offset"] == sorted(lp["text_offset"])


def test_echo_logprobs_score_the_prompt_the_same_cached_or_not(gw: GatewayStack) -> None:
    """lm-eval's loglikelihood: the second request's prefix is cached, its numbers the same."""
    body = {"model": MODEL, "prompt": unique_prompt("echo"), "max_tokens": 1, "logprobs": 1, "echo": True}
    first, second = (
        Completion.model_validate(
            _unscored_first(json.loads(http(gw.gateway.address, "POST", "/v1/completions", body, AUTH)[2]))
        )
        for _ in range(2)
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    a, b = first.choices[0].logprobs, second.choices[0].logprobs
    assert a.tokens == b.tokens and len(a.tokens) == first.usage.prompt_tokens + 1
    assert b.token_logprobs[1:] == pytest.approx(a.token_logprobs[1:], rel=1e-5, abs=1e-5)


def test_greedy_logprobs_name_the_chosen_token_first(gw: GatewayStack) -> None:
    client = gw.client()
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": unique_prompt("lp")}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = reply.choices[0].logprobs.content
    assert "".join(e.token for e in content) == reply.choices[0].message.content
    for entry in content:
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
    streamed = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": unique_prompt("lp")}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    )
    entries = [
        e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert len(entries) == 6


def test_tokenize_detokenize_version_and_models(gw: GatewayStack) -> None:
    address = gw.gateway.address
    status, _, text = http(address, "POST", "/tokenize", {"model": MODEL, "prompt": "hello world"}, AUTH)
    assert status == 200, text
    tokenized = json.loads(text)
    assert tokenized["count"] == len(tokenized["tokens"]) > 0 and tokenized["max_model_len"] > 0
    status, _, text = http(
        address, "POST", "/detokenize", {"model": MODEL, "tokens": tokenized["tokens"]}, AUTH
    )
    assert status == 200 and "hello world" in json.loads(text)["prompt"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    status, _, text = http(address, "POST", "/tokenize", chat, AUTH)
    assert status == 200 and json.loads(text)["count"] > 0
    status, _, text = http(address, "GET", "/version")
    assert status == 200 and json.loads(text)["version"]
    models = gw.client().models.list().data
    assert models[0].model_extra["max_model_len"] == tokenized["max_model_len"]
    status, _, text = http(address, "POST", "/detokenize", {"model": MODEL, "tokens": [10**9]}, AUTH)
    assert status == 400 and json.loads(text)["error"]["type"] == "invalid_request_error"
    status, _, text = http(address, "POST", "/tokenize", {"model": "nope", "prompt": "x"}, AUTH)
    assert status == 404 and json.loads(text)["error"]["param"] == "model"


@pytest.mark.parametrize(
    ("method", "path", "status"), [("GET", "/v1/nothing", 404), ("GET", "/tokenize", 405)]
)
def test_unknown_paths_answer_in_openai_shape(gw: GatewayStack, method: str, path: str, status: int) -> None:
    got, headers, text = http(gw.gateway.address, method, path, None, {"x-request-id": "r-1"})
    error = json.loads(text)["error"]
    assert got == status and path in error["message"] and error["type"] == "invalid_request_error"
    assert headers["x-request-id"] == "r-1"


def test_a_refused_request_echoes_its_request_id(gw: GatewayStack) -> None:
    body = {"model": MODEL, "prompt": "x", "use_beam_search": True}
    status, headers, text = http(
        gw.gateway.address, "POST", "/v1/completions", body, {**AUTH, "x-request-id": "r-2"}
    )
    assert status == 400 and headers["x-request-id"] == "r-2"
    assert json.loads(text)["error"]["param"] == "use_beam_search"


def test_a_long_request_id_is_echoed_but_not_sent_to_the_worker(gw: GatewayStack) -> None:
    long_id = "r" * 1000
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    status, headers, text = http(
        gw.gateway.address, "POST", "/v1/completions", body, {**AUTH, "x-request-id": long_id}
    )
    assert status == 200, text
    assert headers["x-request-id"] == long_id


def test_streamed_echo_leads_with_the_prompt_and_its_logprobs(gw: GatewayStack) -> None:
    text = unique_prompt("stream-echo")
    body = {"model": MODEL, "prompt": text, "max_tokens": 3, "logprobs": 0, "echo": True, "stream": True}
    status, _, raw = http(gw.gateway.address, "POST", "/v1/completions", body, AUTH)
    assert status == 200, raw
    choices = [e["choices"][0] for e in _events(raw)]
    assert choices[0]["text"].startswith(text)
    tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
    scored = [x for c in choices if c["logprobs"] for x in c["logprobs"]["token_logprobs"]]
    whole = json.loads(
        http(gw.gateway.address, "POST", "/v1/completions", {**body, "stream": False}, AUTH)[2]
    )
    assert tokens == whole["choices"][0]["logprobs"]["tokens"]
    assert scored[0] is None and len(tokens) == whole["usage"]["prompt_tokens"] + 3
    assert "".join(c["text"] for c in choices) == whole["choices"][0]["text"]
