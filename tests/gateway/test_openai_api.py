"""The gateway through the official openai SDK (sync and async, streaming and not)."""

from __future__ import annotations

import json

from clients.client import ComputedClient
from tests.gateway.conftest import KEY_A, MODEL, GatewayStack, http, unique_prompt


def test_models_lists_the_workers_model(gw: GatewayStack) -> None:
    models = gw.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert gw.client().models.retrieve(MODEL).id == MODEL


def test_chat_repeat_reports_cached_tokens(gw: GatewayStack) -> None:
    client = gw.client()
    messages = [{"role": "system", "content": unique_prompt("chat")}, {"role": "user", "content": "Go on."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    assert first.object == "chat.completion" and first.choices[0].message.role == "assistant"
    assert first.usage.prompt_tokens > 32 and first.usage.prompt_tokens_details.cached_tokens == 0
    assert first.usage.completion_tokens == 8 and first.choices[0].finish_reason == "length"
    # The repeat is routed to the worker holding the prefix: every full block is cached.
    assert second.usage.prompt_tokens_details.cached_tokens >= second.usage.prompt_tokens - 16
    assert second.choices[0].message.content == first.choices[0].message.content


def test_greedy_chat_is_grpc_generate_token_for_token(gw: GatewayStack) -> None:
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": unique_prompt("parity")},
    ]
    reply = gw.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    with ComputedClient(gw.workers[0].address) as worker:
        direct = worker.complete(messages=[(m["role"], m["content"]) for m in messages], max_tokens=24)
    assert reply.choices[0].message.content == direct.text
    assert reply.usage.completion_tokens == direct.usage.completion_tokens
    assert reply.usage.prompt_tokens == direct.usage.prompt_tokens


def test_text_parts_are_joined_like_a_string(gw: GatewayStack) -> None:
    text = unique_prompt("parts")
    parts = [{"type": "text", "text": text[:40]}, {"type": "text", "text": text[40:]}]
    client = gw.client()
    as_parts = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=6
    )
    as_text = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=6
    )
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content


def test_chat_stream_with_usage(gw: GatewayStack) -> None:
    messages = [{"role": "user", "content": unique_prompt("stream")}]
    client = gw.client()
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt as `whole`
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_usage_option_has_no_usage_chunk(gw: GatewayStack) -> None:
    stream = gw.client().completions.create(model=MODEL, prompt=unique_prompt(), max_tokens=4, stream=True)
    chunks = list(stream)
    assert all(c.choices and c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sse_wire_format_ends_with_done(gw: GatewayStack) -> None:
    body = {"model": MODEL, "prompt": unique_prompt(), "max_tokens": 3, "stream": True}
    status, headers, text = http(
        gw.gateway.address, "POST", "/v1/completions", body, {"Authorization": f"Bearer {KEY_A}"}
    )
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    lines = [line for line in text.split("\n") if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1


def test_completions_prompt_forms_and_n(gw: GatewayStack) -> None:
    client = gw.client()
    text = unique_prompt("forms")
    with ComputedClient(gw.workers[0].address) as worker:
        ids = worker.tokenize(text)
        direct = worker.complete(text, max_tokens=6)
    by_text = client.completions.create(model=MODEL, prompt=text, max_tokens=6)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6)
    assert by_text.choices[0].text == by_ids.choices[0].text == direct.text
    many = client.completions.create(model=MODEL, prompt=[text, "import "], max_tokens=4, n=2)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == direct.text[: len(many.choices[0].text)]
    assert many.usage.completion_tokens == 16
    id_lists = client.completions.create(model=MODEL, prompt=[ids, ids[:20]], max_tokens=2)
    assert len(id_lists.choices) == 2 and id_lists.usage.prompt_tokens == len(ids) + 20


def test_seeded_sampling_repeats(gw: GatewayStack) -> None:
    client = gw.client()
    prompt = unique_prompt("seed")
    one = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, seed=7)
    two = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, seed=7)
    assert one.choices[0].text == two.choices[0].text


def test_stop_strings(gw: GatewayStack) -> None:
    client = gw.client()
    prompt = unique_prompt("stop")
    free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16).choices[0].text
    stop = free.strip()[:2] or free[:1]
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, stop=[stop]).choices[0]
    assert stop not in cut.text and cut.finish_reason == "stop"


async def test_async_client_streaming_and_not(gw: GatewayStack) -> None:
    client = gw.aclient()
    messages = [{"role": "user", "content": unique_prompt("async")}]
    whole = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10)
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, stream=True, stream_options={"include_usage": True}
    )
    text, usage = "", None
    async for chunk in stream:
        text += "".join(c.delta.content or "" for c in chunk.choices)
        usage = chunk.usage or usage
    assert text == whole.choices[0].message.content
    assert usage is not None and usage.prompt_tokens_details.cached_tokens > 0
    await client.close()


def test_health_and_metrics(gw: GatewayStack) -> None:
    status, _, body = http(gw.gateway.address, "GET", "/health")
    health = json.loads(body)
    assert status == 200
    assert health["status"] == "ok" and health["workers_up"] == 2 and health["models"] == [MODEL]
    first_chunks = _sample(
        http(gw.gateway.address, "GET", "/metrics")[2], "gateway_time_to_first_chunk_seconds_count"
    )
    gw.client().completions.create(model=MODEL, prompt=unique_prompt(), max_tokens=2)
    text = http(gw.gateway.address, "GET", "/metrics")[2]
    assert _sample(text, "gateway_time_to_first_chunk_seconds_count") == first_chunks + 1
    assert 'gateway_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert 'gateway_tokens_total{kind="cached"}' in text


def _sample(text: str, name: str) -> float:
    """An unlabelled sample's value in Prometheus text (0 when it is not there yet)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0
