"""--tokenizer: the gateway's own tokenization gives computed's token ids, and routing uses it.

Equality is checked against live workers' Tokenize (what their Generate sees): the
built-in model (no BOS, its own chat template) and tiny random checkpoints of two
families: Llama (BOS from the post-processor: a text encoded without special tokens
fails here) and Qwen2 (no BOS, ChatML template).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from clients.client import ComputedClient
from clients.requests import Prompt
from gateway.__main__ import tokenizer_specs
from gateway.tokenizer import LocalTokenizer
from tests.daemons import start_computed
from tests.gateway.conftest import MODEL, GatewayStack, http, unique_prompt
from tests.models import make_tiny_model

BUILTIN = Path(__file__).resolve().parents[2] / "computed" / "default_model"
TEXTS = [
    "def fib(n):",
    " leading space, trailing space ",
    "héllo wörld: 世界 🙂 — ünïcödé\n\ttabs\r\nand CRLF",
    "<|begin_of_text|><s> special-looking text </s><|im_end|>",
    "a" * 3000,
]
CHATS = [
    [("user", "Hi")],
    [("system", "You are terse."), ("user", "What is a KV cache?")],
    [("system", "S"), ("user", "q1"), ("assistant", "a1 🙂"), ("user", "q2\n\nwith  spaces ")],
    [("user", "")],
]


def prompts() -> list[Prompt]:
    return [Prompt.of(t) for t in TEXTS] + [Prompt.of(messages=m) for m in CHATS]


@pytest.fixture(scope="module")
def tiny_workers(gw: GatewayStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    root = tmp_path_factory.mktemp("tiny")
    started = {}
    try:
        for arch in ("llama", "qwen2"):
            path = make_tiny_model(root / arch, arch)
            started[arch] = (
                path,
                start_computed(gw.workdir, gw.blockd.address, model=path, name=f"tiny-{arch}"),
            )
        yield started
    finally:
        for _, daemon in started.values():
            daemon.stop()


def assert_same_ids(path: Path, worker: str) -> None:
    local = LocalTokenizer(path)
    with ComputedClient(worker) as computed:
        for prompt in prompts():
            expected = computed.tokenize_prompt(prompt)
            assert local.tokenize(prompt) == tuple(expected), prompt


def test_builtin_model_ids_equal_computed(gw: GatewayStack) -> None:
    assert_same_ids(BUILTIN, gw.workers[0].address)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_model_ids_equal_computed(tiny_workers: dict[str, tuple[Path, object]], arch: str) -> None:
    path, daemon = tiny_workers[arch]
    assert_same_ids(path, daemon.address)


def test_declines_what_it_cannot_render(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((BUILTIN / "tokenizer.json").read_bytes())
    no_template = LocalTokenizer(tmp_path)  # no tokenizer_config.json: no chat template
    assert no_template.tokenize(Prompt.of(messages=[("user", "Hi")])) is None
    assert no_template.tokenize(Prompt.of("Hi")) is not None


def test_specs_are_checked(tmp_path: Path) -> None:
    assert tokenizer_specs([f"m={BUILTIN}", ""]) == {"m": str(BUILTIN)}
    for bad in ("no-equals", f"={BUILTIN}", f"m={tmp_path}"):
        with pytest.raises(ValueError):
            tokenizer_specs([bad])


def _local_count(address: str) -> float:
    status, _, text = http(address, "GET", "/metrics")
    assert status == 200
    found = re.search(r'gateway_tokenizations_total\{where="local"\} (\S+)', text)
    return float(found.group(1)) if found else 0.0


def test_routed_requests_tokenize_locally(gw: GatewayStack, open_gateway) -> None:
    workers = [w.address for w in gw.workers]
    gateway = open_gateway(workers, "--tokenizer", f"{MODEL}={BUILTIN}", blockd=gw.blockd.address)
    body = {"model": MODEL, "prompt": unique_prompt("local"), "max_tokens": 2, "temperature": 0}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": unique_prompt("chat")}], "max_tokens": 2}
    replies = [http(gateway.address, "POST", "/v1/completions", body) for _ in range(2)]
    replies.append(http(gateway.address, "POST", "/v1/chat/completions", chat))
    assert [status for status, _, _ in replies] == [200, 200, 200], replies
    assert _local_count(gateway.address) == 3
    assert '"cached_tokens":0' not in replies[1][2].replace(" ", "")  # routed to the warm worker
