"""Logprobs, prompt logprobs and logit processing through a real blockd + computed,
checked against transformers in float32 on tiny random models.

Prompt logprobs of a cache hit are recomputed from the cached K/V: a warm request
reports the cold request's numbers (computed/prompt_logprobs.py).
"""

from __future__ import annotations

import grpc
import pytest
import torch

from kvcache.v1 import generation_pb2, generation_pb2_grpc
from tests.computed.test_generation import BLOCK, prompt
from tests.daemons import start_blockd, start_computed
from tests.models import make_tiny_model

ATOL = 1e-4  # float32, another kernel order than transformers'


class Stack:
    def __init__(self, blockd, computed, model_dir):
        self.blockd, self.computed, self.model_dir = blockd, computed, model_dir
        self.gen = generation_pb2_grpc.GenerationServiceStub(grpc.insecure_channel(computed.address))
        from transformers import AutoModelForCausalLM

        self.hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()

    def generate(self, tokens: list[int], n: int = 8, **kw) -> list[generation_pb2.GenerateResponse]:
        kw.setdefault("temperature", 0.0)
        req = generation_pb2.GenerateRequest(prompt_token_ids=tokens, max_tokens=n, ignore_eos=True, **kw)
        return list(self.gen.Generate(req, timeout=120))

    def hf_logprobs(self, ids: list[int]) -> torch.Tensor:
        """(len(ids), V) log-softmax of transformers' logits at every position."""
        with torch.no_grad():
            return torch.log_softmax(self.hf(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def stack(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"logprobs-{request.param}")
    model_dir = make_tiny_model(root / "model", request.param)
    blockd = start_blockd(root)
    # Chunks of 8 tokens: prompt logprobs cross chunk boundaries.
    computed = start_computed(
        root,
        blockd.address,
        "--block-size",
        str(BLOCK),
        "--num-blocks",
        "256",
        "--max-num-batched-tokens",
        "8",
        model=model_dir,
    )
    yield Stack(blockd, computed, model_dir)
    assert computed.stop() == 0, computed.log()
    assert blockd.stop() == 0, blockd.log()


def tokens_of(messages) -> list[int]:
    return [t for m in messages for t in m.token_ids]


def test_greedy_tokens_and_logprobs_agree_with_transformers(stack):
    p = prompt(11, 3 * BLOCK + 1)
    messages = stack.generate(p, 6, logprobs=3)
    out = tokens_of(messages)
    entries = [e for m in messages for e in m.logprobs]
    assert len(entries) == len(out) == 6
    reference = stack.hf_logprobs(p + out)[len(p) - 1 : -1]  # the rows that chose each output
    for i, (token, entry) in enumerate(zip(out, entries)):
        assert entry.token.token_id == token
        assert token == int(reference[i].argmax()), "greedy = transformers' argmax"
        assert entry.token.logprob == pytest.approx(float(reference[i, token]), abs=ATOL)
        top = [t.token_id for t in entry.top]
        assert top == reference[i].topk(3).indices.tolist()
        assert [t.logprob for t in entry.top] == pytest.approx(reference[i].topk(3).values.tolist(), abs=ATOL)


def test_prompt_logprobs_agree_with_transformers_cold_and_warm(stack):
    p = prompt(12, 5 * BLOCK + 3)  # 23 tokens: three 8-token chunks cold, 20 cached warm
    cold = stack.generate(p, 2, prompt_logprobs=2, logprobs=0)
    warm = stack.generate(p, 2, prompt_logprobs=2, logprobs=0)
    assert warm[-1].usage.cached_tokens == 5 * BLOCK and cold[-1].usage.cached_tokens == 0
    reference = stack.hf_logprobs(p)
    for messages in (cold, warm):
        entries = list(messages[0].prompt_logprobs)
        assert [e.token.token_id for e in entries] == p
        assert entries[0].token.logprob == 0.0 and not entries[0].top  # the first token has none
        got = [e.token.logprob for e in entries[1:]]
        want = [float(reference[i - 1, p[i]]) for i in range(1, len(p))]
        assert got == pytest.approx(want, abs=ATOL)
        assert all(len(e.top) == 2 for e in entries[1:])
        assert all(not m.prompt_logprobs for m in messages[1:])
    # A hit never changes a logprob: the warm numbers are the cold ones up to float32
    # rounding (the cold run summed over 8-token chunks, the recompute over one span of
    # 20: measured at most 2 ulps, 1.9e-6 here).
    cold_lp = [e.token.logprob for e in cold[0].prompt_logprobs]
    warm_lp = [e.token.logprob for e in warm[0].prompt_logprobs]
    assert warm_lp == pytest.approx(cold_lp, rel=1e-6, abs=1e-6)
    assert tokens_of(warm) == tokens_of(cold)


def test_fully_cached_prompt_still_scores_every_position(stack):
    p = prompt(13, 4 * BLOCK)
    stack.generate(p, 1)  # caches every block
    again = stack.generate(p, 1, prompt_logprobs=0)
    assert again[-1].usage.cached_tokens >= 3 * BLOCK
    reference = stack.hf_logprobs(p)
    got = [e.token.logprob for e in again[0].prompt_logprobs[1:]]
    assert got == pytest.approx([float(reference[i - 1, p[i]]) for i in range(1, len(p))], abs=ATOL)


def hf_processed_greedy(stack, p, n, process) -> list[int]:
    ids = list(p)
    for _ in range(n):
        with torch.no_grad():
            logits = stack.hf(torch.tensor([ids])).logits[0, -1].float()
        ids.append(int(process(logits, ids[: len(p)], ids[len(p) :]).argmax()))
    return ids[len(p) :]


def test_repetition_penalty_is_transformers(stack):
    from transformers import RepetitionPenaltyLogitsProcessor

    p = prompt(14, 2 * BLOCK)
    rp = RepetitionPenaltyLogitsProcessor(1.5)

    def process(logits, prompt_ids, out_ids):
        return rp(torch.tensor([prompt_ids + out_ids]), logits[None])[0]

    got = tokens_of(stack.generate(p, 8, repetition_penalty=1.5))
    assert got == hf_processed_greedy(stack, p, 8, process)


def test_presence_and_frequency_penalties_follow_openai(stack):
    p = prompt(15, 2 * BLOCK)

    def process(logits, prompt_ids, out_ids):
        counts = torch.bincount(torch.tensor(out_ids, dtype=torch.long), minlength=logits.shape[0]).float()
        return logits - 0.7 * counts - 1.5 * (counts > 0).float()

    got = tokens_of(stack.generate(p, 8, presence_penalty=1.5, frequency_penalty=0.7))
    assert got == hf_processed_greedy(stack, p, 8, process)
    assert got != tokens_of(stack.generate(p, 8)) or len(set(got)) == len(got)


def test_logit_bias_min_p_and_min_tokens(stack):
    p = prompt(16, 2 * BLOCK)
    assert tokens_of(stack.generate(p, 5, logit_bias={42: 100.0})) == [42] * 5
    greedy = tokens_of(stack.generate(p, 5))
    # min_p 1 keeps only the most likely token: sampling at any temperature is greedy.
    assert tokens_of(stack.generate(p, 5, temperature=1.5, min_p=1.0, seed=3)) == greedy
    # The first greedy token as a stop token ends at once, unless min_tokens holds it off.
    stop = greedy[0]
    assert tokens_of(stack.generate(p, 5, stop_token_ids=[stop])) == [stop]
    held = tokens_of(stack.generate(p, 5, stop_token_ids=[stop], min_tokens=3))
    assert len(held) >= 3 and stop not in held[:3]


def test_bad_processing_values_are_refused(stack):
    p = prompt(17, 3)
    for bad in (
        {"repetition_penalty": 0.0},
        {"presence_penalty": 3.0},
        {"min_p": 1.5},
        {"logprobs": 21},
        {"logit_bias": {10**6: 1.0}},
        {"min_tokens": 9},
    ):
        with pytest.raises(grpc.RpcError) as err:
            stack.generate(p, 8, **bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad


def test_a_long_cached_prefix_is_recomputed_in_pieces(monkeypatch):
    """The store splits a hit's recompute (here in pieces of 8): the numbers do not move."""
    from computed import prompt_logprobs
    from computed.attention import SpanInput
    from computed.prompt_logprobs import LogprobStore

    class Chunk:
        def __init__(self, seq, start, end):
            self.seq, self.start, self.end = seq, start, end

    class Params:
        prompt_logprobs, logprobs = 0, None

    class Seq:
        sequence_id, params, num_prompt_tokens, token_ids = 1, Params(), 30, list(range(30))

    monkeypatch.setattr(prompt_logprobs, "MAX_RECOMPUTE_TOKENS", 8)
    rows, recomputes = LogprobStore().plan([Chunk(Seq(), 28, 30)], [SpanInput([0] * 8, 28, 2, True)])
    assert [(r.span.num_computed_tokens, r.span.num_new_tokens) for r in recomputes] == [
        (0, 8),
        (8, 8),
        (16, 8),
        (24, 4),
    ]
    assert [r.targets[0] for r in recomputes] == [1, 9, 17, 25] and rows[0].first_position == 28
