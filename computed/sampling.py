"""Turn last-position logits into tokens: penalties and bias, greedy, temperature, min-p,
top-k, top-p, seeded."""

from __future__ import annotations

import math

import torch

from computed import kernels
from computed.penalties import TokenHistory, process
from computed.sequence import SamplingParams


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    histories: list[TokenHistory | None] | None = None,
) -> list[int]:
    """One token per row of `logits` (N, vocab), float32.

    A row whose params process logits (penalties, bias, min_tokens: computed/penalties.py)
    gets them first, from its `histories` entry. Greedy rows take the argmax (ties: lowest
    id, as transformers does). Sampled rows apply temperature, then min-p, top-k and top-p
    (nucleus) and draw with the row's own generator, so a request with a seed is
    reproducible whatever it is batched with.
    """
    assert logits.dim() == 2 and logits.shape[0] == len(params) == len(generators)
    tokens = _argmax(logits).tolist()  # (N,)
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.is_greedy and not p.processes_logits:
            continue
        row_logits = logits[row]
        if p.processes_logits:
            history = histories[row] if histories is not None else None
            assert history is not None, "a row that processes its logits needs its token history"
            row_logits = process(row_logits, p, history)
        tokens[row] = int(row_logits.argmax()) if p.is_greedy else _sample_row(row_logits, p, gen)
    return tokens


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)`; on CPU float32 by the native kernel (the same indices,
    several times faster: see computed/kernels/argmax.cpp)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        op = kernels.argmax_rows()
        if op is not None and logits.shape[1] > 0:
            return op(logits)
    return logits.argmax(dim=-1)


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    # Shift by the max first: a tiny temperature then sends the others to -inf, not
    # everything to inf (which would make the softmax NaN).
    logits = logits.float()
    scaled = (logits - logits.max()) / p.temperature  # (V,)
    if p.min_p > 0.0:
        # probability < min_p * max probability  <=>  scaled < log(min_p) (the max is 0 here)
        scaled = scaled.masked_fill(scaled < math.log(p.min_p), float("-inf"))
    if 0 < p.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p (keeps >= 1 token).
        drop = probs.cumsum(dim=-1) - probs >= p.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(0, order, sorted_logits)
    probs = scaled.softmax(dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen).item())


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
