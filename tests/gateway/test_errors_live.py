"""Every error row of the gateway, live: OpenAI's error shape with the right HTTP status."""

from __future__ import annotations

import json
import uuid

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


AUTH = {"Authorization": f"Bearer {KEY_A}"}


@pytest.mark.parametrize(
    ("path", "body", "param", "lead"),
    [
        ("/v1/completions", {"prompt": [1, 10**9], "max_tokens": 2}, "prompt", "prompt: token id 1000000000"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "stop_token_ids": [10**9]},
            "stop_token_ids",
            "stop_token_ids: 1000000000",
        ),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"1000000000": 5}}, "logit_bias", "logit_bias: "),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 10**6},
            "max_completion_tokens",
            "prompt has",
        ),
        ("/detokenize", {"tokens": [999_999_999]}, "tokens", "tokens: token id 999999999"),
    ],
)
def test_worker_refusals_name_the_requests_fields(
    gw: GatewayStack, path: str, body: dict, param: str, lead: str
) -> None:
    status, _, text = http(gw.gateway.address, "POST", path, {"model": MODEL, **body}, AUTH)
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == param, text
    assert error["message"].startswith(lead), error["message"]
    assert not error["message"].startswith(("prompt_token_ids", "token_ids")), error["message"]
    if param == "max_completion_tokens":
        assert "max_completion_tokens" in error["message"] and "max_tokens" not in error["message"]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({}, "one of 'prompt' (a string) or 'messages' (a list of messages) is required"),
        ({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "not both"),
    ],
)
def test_tokenize_says_which_input_it_needs(gw: GatewayStack, body: dict, says: str) -> None:
    status, _, text = http(gw.gateway.address, "POST", "/tokenize", {"model": MODEL, **body}, AUTH)
    assert status == 400 and says in json.loads(text)["error"]["message"], text


def test_probes_answer_head_as_get(gw: GatewayStack) -> None:
    for path in ("/health", "/version", "/metrics", "/v1/models", f"/v1/models/{MODEL}"):
        get_status, get_headers, _ = http(gw.gateway.address, "GET", path, None, AUTH)
        status, headers, body = http(gw.gateway.address, "HEAD", path, None, AUTH)
        assert (status, body) == (get_status, ""), path
        assert status == 200 and headers["content-type"] == get_headers["content-type"], path


def test_head_health_is_503_without_workers(gw: GatewayStack, open_gateway) -> None:
    gateway = open_gateway([dead_address()], blockd=dead_address())
    assert http(gateway.address, "HEAD", "/health")[:3:2] == (503, "")


def test_request_metrics_use_route_templates_not_raw_paths(gw: GatewayStack) -> None:
    address = gw.gateway.address
    ids = [f"rand-{uuid.uuid4().hex[:8]}" for _ in range(3)]
    for model in ids:
        assert http(address, "GET", f"/v1/models/{model}", None, AUTH)[0] == 404
        assert http(address, "GET", f"/nowhere/{model}")[0] == 404
    assert http(address, "GET", "/v1/models", None, AUTH)[0] == 200
    assert http(address, "POST", "/tokenize", {"model": MODEL, "prompt": "hello"}, AUTH)[0] == 200
    assert http(address, "POST", "/detokenize", {"model": MODEL, "tokens": [5]}, AUTH)[0] == 200
    series = [
        line
        for line in http(address, "GET", "/metrics")[2].splitlines()
        if line.startswith("gateway_requests_total")
    ]
    assert not [line for line in series if any(model in line for model in ids)], series
    for endpoint, status in [
        ("/v1/models/{model}", "404"),
        ("unmatched", "404"),
        ("/v1/models", "200"),
        ("/tokenize", "200"),
        ("/detokenize", "200"),
    ]:
        assert any(f'endpoint="{endpoint}",status="{status}"' in line for line in series), (endpoint, series)
