"""Several models behind one gateway, and a SIGTERM that lets open streams finish."""

from __future__ import annotations

import signal

import openai

from tests.daemons import REPO, start_computed
from tests.gateway.conftest import MODEL, GatewayStack, http, unique_prompt


def test_workers_of_two_models(gw: GatewayStack, open_gateway) -> None:
    # The built-in weights under another directory name: another model id, another hash namespace.
    other = gw.workdir / "other-model"
    other.mkdir(exist_ok=True)
    for file in (REPO / "computed" / "default_model").iterdir():
        if not (other / file.name).exists():
            (other / file.name).symlink_to(file)
    worker = start_computed(
        gw.workdir, gw.blockd.address, "--log-format", "json", model=other, name="computed-other"
    )
    try:
        gateway = open_gateway([gw.workers[0].address, worker.address], blockd=gw.blockd.address)
        client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="-", max_retries=0)
        assert sorted(m.id for m in client.models.list().data) == [MODEL, "other-model"]
        prompt = unique_prompt("two models")
        first = client.completions.create(model="other-model", prompt=prompt, max_tokens=4)
        again = client.completions.create(model="other-model", prompt=prompt, max_tokens=4)
        default = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
        assert first.model == "other-model" and again.usage.prompt_tokens_details.cached_tokens > 0
        assert default.usage.prompt_tokens_details.cached_tokens == 0  # another worker, another namespace
        assert default.choices[0].text == first.choices[0].text  # the same weights
    finally:
        worker.stop()


def test_sigterm_lets_an_open_stream_finish(gw: GatewayStack, open_gateway) -> None:
    gateway = open_gateway([gw.workers[0].address], "--drain-seconds", "30")
    client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="-", max_retries=0)
    stream = client.completions.create(
        model=MODEL,
        prompt=unique_prompt("drain"),
        max_tokens=48,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    next(chunks)
    gateway.proc.send_signal(signal.SIGTERM)
    rest = list(chunks)
    assert rest[-1].usage.completion_tokens == 48, "the stream ran to its end"
    assert gateway.proc.wait(30) == 0
    assert "gateway stopped" in gateway.log()


def test_metrics_count_errors(gw: GatewayStack) -> None:
    try:
        gw.client().completions.create(model="nope", prompt="x", max_tokens=1)
    except openai.NotFoundError:
        pass
    text = http(gw.gateway.address, "GET", "/metrics")[2]
    assert 'gateway_requests_total{endpoint="/v1/completions",status="404"}' in text
