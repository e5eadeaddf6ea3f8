"""Every error row of the gateway, live: OpenAI's error shape with the right HTTP status."""

from __future__ import annotations

import json

import openai
import pytest

from tests.gateway.conftest import KEY_A, MODEL, GatewayStack, dead_address, http, unique_prompt


def _chat(client: openai.OpenAI, **kwargs: object) -> object:
    kwargs.setdefault("model", MODEL)
    kwargs.setdefault("messages", [{"role": "user", "content": "Hi"}])
    kwargs.setdefault("max_tokens", 4)
    return client.chat.completions.create(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"temperature": 3}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"messages": []}, "messages"),
        ({"extra_body": {"cache_salt": "tenant-b"}}, "cache_salt"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"extra_body": {"use_beam_search": True}}, "use_beam_search"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ],
)
def test_bad_or_unsupported_parameter_is_400_naming_it(gw: GatewayStack, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(gw.client(), **kwargs)
    error = caught.value.body
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert param in error["message"]


def test_worker_refusal_is_400_with_its_words(gw: GatewayStack) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(gw.client(), max_tokens=100_000)
    assert "max_tokens" in caught.value.body["message"]


def test_bad_json_is_400(gw: GatewayStack) -> None:
    status, _, body = http(
        gw.gateway.address, "POST", "/v1/completions", "{nope", {"Authorization": f"Bearer {KEY_A}"}
    )
    assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"


def test_wrong_key_is_401(gw: GatewayStack) -> None:
    client = gw.client(key="wrong-key")
    with pytest.raises(openai.AuthenticationError) as caught:
        _chat(client)
    assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Basic a2V5"}, {"Authorization": "Bearer "}])
def test_missing_key_is_401(gw: GatewayStack, headers: dict[str, str]) -> None:
    body = {"model": MODEL, "prompt": "import ", "max_tokens": 2}
    status, _, text = http(gw.gateway.address, "POST", "/v1/completions", body, headers)
    assert status == 401 and json.loads(text)["error"]["type"] == "authentication_error"


def test_unknown_model_is_404(gw: GatewayStack) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        _chat(gw.client(), model="gpt-nope")
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"


def test_saturated_workers_are_429(gw: GatewayStack, open_gateway) -> None:
    gateway = open_gateway([gw.workers[0].address], "--max-inflight-per-worker", "1")
    client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="-", max_retries=0)
    long = client.completions.create(
        model=MODEL, prompt=unique_prompt(), max_tokens=4000, stream=True, extra_body={"ignore_eos": True}
    )
    try:
        next(iter(long))
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model=MODEL, prompt="import ", max_tokens=2)
        assert caught.value.body["type"] == "rate_limit_error"
    finally:
        long.close()


def test_no_reachable_worker_is_503(gw: GatewayStack, open_gateway) -> None:
    gateway = open_gateway([dead_address(), dead_address()], blockd=dead_address())
    client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="-", max_retries=0)
    with pytest.raises(openai.InternalServerError) as caught:
        _chat(client)
    assert caught.value.status_code == 503 and caught.value.body["type"] == "server_error"
    assert http(gateway.address, "GET", "/health")[0] == 503


def test_deadline_is_504(gw: GatewayStack, open_gateway) -> None:
    gateway = open_gateway([gw.workers[0].address], "--request-timeout", "0.001")
    client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="-", max_retries=0)
    with pytest.raises(openai.APIStatusError) as caught:
        _chat(client, messages=[{"role": "user", "content": unique_prompt()}])
    assert caught.value.status_code == 504 and caught.value.body["code"] == "deadline_exceeded"


def test_disconnect_mid_stream_cancels_and_leaks_no_block(gw: GatewayStack) -> None:
    before = gw.wait_idle()
    stream = gw.client().completions.create(
        model=MODEL,
        prompt=unique_prompt("disconnect"),
        max_tokens=6000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    assert gw.stats().num_sequences >= 1  # generating now
    stream.close()
    after = gw.wait_idle(timeout=5.0)
    # Cancelled well before 6000 tokens: no sequence left, every block back to free or cached.
    assert after.num_sequences == 0
    assert after.num_referenced_blocks == before.num_referenced_blocks
    assert (
        after.num_free_blocks + after.num_evictable_blocks + after.num_referenced_blocks == after.num_blocks
    )
    metrics = http(gw.gateway.address, "GET", "/metrics")[2]
    assert "gateway_client_disconnects_total 0.0" not in metrics


def test_generation_paths_keep_their_routes(gw: GatewayStack) -> None:
    """The hot path is served before FastAPI's routing; other methods still get its 405, with no key a 401."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, _, _ = http(gw.gateway.address, "GET", path)
        assert status == 405
        status, _, text = http(gw.gateway.address, "POST", path, {"model": MODEL, "prompt": "x"})
        assert status == 401 and json.loads(text)["error"]["message"].startswith(
            "Incorrect or missing API key"
        )
