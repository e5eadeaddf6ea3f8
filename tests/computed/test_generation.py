"""computed end to end: real blockd + real computed over gRPC, checked against transformers.

Greedy tokens must equal a plain Hugging Face greedy loop on the same weights, whether
the prefix came from the cache or not.
"""

from __future__ import annotations

import concurrent.futures
import time
import urllib.request

import grpc
import pytest
import torch

from kvcache.v1 import directory_pb2, directory_pb2_grpc, generation_pb2, generation_pb2_grpc
from tests.daemons import start_blockd, start_computed
from tests.models import make_tiny_model

BLOCK = 4


def hf_greedy(model_dir, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = _hf_models.get(model_dir)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
        _hf_models[model_dir] = model
    ids = torch.tensor([prompt])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


_hf_models: dict = {}


class Stack:
    def __init__(self, blockd, computed, model_dir):
        self.blockd, self.computed, self.model_dir = blockd, computed, model_dir
        self.gen = generation_pb2_grpc.GenerationServiceStub(grpc.insecure_channel(computed.address))
        self.admin = directory_pb2_grpc.DirectoryAdminServiceStub(grpc.insecure_channel(blockd.address))

    def generate(self, tokens: list[int], n: int = 8, **kw) -> tuple[list[int], generation_pb2.Usage]:
        req = generation_pb2.GenerateRequest(
            prompt_token_ids=tokens, max_tokens=n, temperature=0.0, ignore_eos=True, **kw
        )
        out: list[int] = []
        usage = None
        for msg in self.gen.Generate(req, timeout=120):
            out.extend(msg.token_ids)
            if msg.finish_reason:
                usage = msg.usage
        assert usage is not None, "the last message must carry usage"
        return out, usage

    def stats(self) -> directory_pb2.PoolStats:
        return self.admin.GetStats(directory_pb2.GetStatsRequest(), timeout=10).total

    def wait_idle(self, timeout: float = 10.0) -> directory_pb2.PoolStats:
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if stats.num_referenced_blocks == 0 or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)


def _stack(tmp_path_factory, arch: str, *computed_args: str) -> Stack:
    root = tmp_path_factory.mktemp(f"stack-{arch}")
    model_dir = make_tiny_model(root / "model", arch)
    blockd = start_blockd(root)
    computed = start_computed(
        root, blockd.address, "--block-size", str(BLOCK), *computed_args, model=model_dir
    )
    return Stack(blockd, computed, model_dir)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def stack(request, tmp_path_factory):
    s = _stack(tmp_path_factory, request.param, "--num-blocks", "256", "--metrics-port", "0")
    yield s
    assert s.computed.stop() == 0, s.computed.log()
    assert s.blockd.stop() == 0, s.blockd.log()


def prompt(seed: int, n: int, vocab: int = 200) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def test_cold_then_warm_equals_reference(stack):
    p = prompt(1, 4 * BLOCK + 2)
    cold, u1 = stack.generate(p, 10)
    warm, u2 = stack.generate(p, 10)
    assert cold == hf_greedy(stack.model_dir, p, 10)
    assert warm == cold
    assert u1.cached_tokens == 0
    assert u2.cached_tokens == 4 * BLOCK, "every full prompt block must hit the second time"
    assert (u2.prompt_tokens, u2.completion_tokens) == (len(p), 10)


def test_shared_prefix_different_suffix(stack):
    base = prompt(2, 3 * BLOCK)
    a, b = base + prompt(3, 5), base + prompt(4, 6)
    out_a, _ = stack.generate(a, 8)
    out_b, ub = stack.generate(b, 8)
    assert ub.cached_tokens == 3 * BLOCK
    assert out_a == hf_greedy(stack.model_dir, a, 8)
    assert out_b == hf_greedy(stack.model_dir, b, 8)


def test_exact_block_multiple_fully_cached(stack):
    p = prompt(5, 5 * BLOCK)
    first, _ = stack.generate(p, 6)
    second, u = stack.generate(p, 6)
    assert u.cached_tokens == len(p), "a block-aligned prompt is entirely cached the second time"
    assert first == second == hf_greedy(stack.model_dir, p, 6)


def test_prompt_shorter_than_one_block(stack):
    p = prompt(6, BLOCK - 1)
    out, u = stack.generate(p, 7)
    assert u.cached_tokens == 0
    assert out == hf_greedy(stack.model_dir, p, 7)


def test_stream_interval_sends_fewer_messages_with_the_same_tokens(stack):
    p = prompt(7, 2 * BLOCK + 3)
    req = generation_pb2.GenerateRequest(
        prompt_token_ids=p, max_tokens=9, temperature=0.0, ignore_eos=True, stream_interval=4
    )
    messages = list(stack.gen.Generate(req, timeout=120))
    # First token alone, then 4 per message, the last with usage (a slow reader may get
    # queued messages merged, never more of them).
    assert len(messages) <= 4, [len(m.token_ids) for m in messages]
    assert len(messages[0].token_ids) in (1, 5, 9), "the first token is sent alone"
    assert [t for m in messages for t in m.token_ids] == hf_greedy(stack.model_dir, p, 9)
    assert messages[-1].finish_reason == "length" and messages[-1].usage.completion_tokens == 9


def test_mixed_batch_arriving_together(stack):
    prompts = [prompt(10 + i, n) for i, n in enumerate([3, 9, 17, 4, 25, 12])]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: stack.generate(p, 9)[0], prompts))
    for p, out in zip(prompts, results):
        assert out == hf_greedy(stack.model_dir, p, 9)


def test_concurrent_requests_sharing_a_cached_prefix(stack):
    """Decodes of sequences that share cached blocks run batched (cascade attention)."""
    base = prompt(80, 4 * BLOCK)
    stack.generate(base + [7], 1)  # the shared blocks are now cached
    prompts = [base + prompt(81 + i, 1 + i) for i in range(5)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: stack.generate(p, 12), prompts))
    for p, (out, usage) in zip(prompts, results):
        assert usage.cached_tokens >= 4 * BLOCK
        assert out == hf_greedy(stack.model_dir, p, 12)


def test_second_identical_prompt_computes_only_uncached_tokens(stack):
    p = prompt(30, 10 * BLOCK + 3)  # 10 full blocks and a partial tail
    stack.generate(p, 1)
    before = _metric(stack, "computed_prefill_tokens_total")
    _, u = stack.generate(p, 1)
    after = _metric(stack, "computed_prefill_tokens_total")
    assert u.cached_tokens == 10 * BLOCK
    assert after - before == len(p) - 10 * BLOCK, "only the uncached tail may run through the model"


def test_metrics_break_the_time_to_first_token_into_its_phases(stack):
    """Every request the daemon served counts once in each phase, and the queue and
    prefill times add up to the time to first token (the same two moments apart)."""
    names = (
        "computed_request_admission_seconds",
        "computed_request_queue_seconds",
        "computed_request_prefill_seconds",
        "computed_time_to_first_token_seconds",
        "computed_request_seconds",
        "computed_time_per_output_token_seconds",
    )
    before = {n: (_metric(stack, n + "_count"), _metric(stack, n + "_sum")) for n in names}
    for i in range(3):
        stack.generate(prompt(50 + i, 2 * BLOCK + 1), 4)
    stack.wait_idle()
    after = {n: (_metric(stack, n + "_count"), _metric(stack, n + "_sum")) for n in names}
    count = {n: after[n][0] - before[n][0] for n in names}
    total = {n: after[n][1] - before[n][1] for n in names}
    assert all(c == 3 for c in count.values()), count
    queue, prefill = total["computed_request_queue_seconds"], total["computed_request_prefill_seconds"]
    assert abs(queue + prefill - total["computed_time_to_first_token_seconds"]) < 1e-6
    assert total["computed_request_seconds"] >= total["computed_time_to_first_token_seconds"] > 0
    assert total["computed_request_admission_seconds"] > 0


def test_no_block_referenced_after_requests(stack):
    stack.generate(prompt(40, 11), 3)
    stats = stack.wait_idle()
    assert stats.num_referenced_blocks == 0
    assert stats.num_free_blocks + stats.num_evictable_blocks == stats.num_blocks


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({}, "empty prompt"),
        ({"prompt_token_ids": [5, 6], "max_tokens": 0}, "max_tokens"),
        ({"prompt_token_ids": [5, 6], "temperature": -0.5}, "temperature"),
        ({"prompt_token_ids": [5] * 5000}, "context"),
        ({"prompt_token_ids": [10**6]}, "out of range"),
        ({"prompt": "x", "prompt_token_ids": [5]}, "exactly one"),
        ({"prompt_token_ids": [5], "top_p": 0.0}, "top_p"),
    ],
)
def test_bad_requests_are_invalid_argument(stack, kwargs, fragment):
    with pytest.raises(grpc.RpcError) as err:
        list(stack.gen.Generate(generation_pb2.GenerateRequest(**kwargs), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in err.value.details()
    out, _ = stack.generate(prompt(50, 6), 2)  # still serving
    assert len(out) == 2


def test_chunked_prefill_matches_reference(tmp_path_factory):
    s = _stack(tmp_path_factory, "llama", "--num-blocks", "128", "--max-num-batched-tokens", "8")
    try:
        p = prompt(60, 45)  # six chunks of at most 8 tokens
        out, _ = s.generate(p, 8)
        assert out == hf_greedy(s.model_dir, p, 8)
        again, u = s.generate(p, 8)
        assert again == out and u.cached_tokens == 44
    finally:
        s.computed.stop()
        s.blockd.stop()


def test_preemption_in_a_tiny_pool_keeps_outputs(tmp_path_factory):
    # 24 blocks of 4 tokens: four requests of 20 + 24 tokens cannot all fit at once.
    s = _stack(tmp_path_factory, "llama", "--num-blocks", "24", "--max-num-seqs", "4")
    try:
        prompts = [prompt(70 + i, 20) for i in range(4)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda p: s.generate(p, 24), prompts))
        for p, (out, _) in zip(prompts, results):
            assert out == hf_greedy(s.model_dir, p, 24)
        assert sum(u.num_preemptions for _, u in results) > 0, "the pool was meant to force preemption"
        assert s.wait_idle().num_referenced_blocks == 0
    finally:
        s.computed.stop()
        s.blockd.stop()


def _metric(stack: Stack, name: str) -> float:
    port = _metrics_port(stack)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in body.splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported:\n{body}")


def _metrics_port(stack: Stack) -> int:
    for line in stack.computed.log().splitlines():
        if "metrics_serving" in line and '"port"' in line:
            import json

            return int(json.loads(line)["port"])
    raise AssertionError("computed did not log its metrics port:\n" + stack.computed.log())


@pytest.fixture(scope="module")
def short_context(tmp_path_factory):
    s = _stack(tmp_path_factory, "llama", "--num-blocks", "64", "--max-model-len", "48")
    yield s
    assert s.computed.stop() == 0, s.computed.log()
    assert s.blockd.stop() == 0, s.blockd.log()


def test_max_tokens_that_cannot_fit_beside_the_prompt_is_refused(short_context):
    with pytest.raises(grpc.RpcError) as err:
        short_context.generate(prompt(60, 47), 8)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt has 47 tokens and max_tokens is 8" in err.value.details()
    assert "at most 1 completion tokens fit" in err.value.details()
    out, _ = short_context.generate(prompt(61, 40), 8)  # exactly fits: 40 + 8 = 48
    assert len(out) == 8


def test_default_max_tokens_stops_at_the_context(short_context):
    responses = list(
        short_context.gen.Generate(
            generation_pb2.GenerateRequest(prompt_token_ids=prompt(62, 47), temperature=0.0, ignore_eos=True),
            timeout=60,
        )
    )
    tokens = [t for r in responses for t in r.token_ids]
    assert len(tokens) == 1 and responses[-1].finish_reason == "length"
