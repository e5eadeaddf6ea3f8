"""Log probabilities a request asked for: the chosen token's and the k most likely.

They are the model's own distribution (log-softmax of the raw float32 logits), taken
before penalties, bias, temperature and truncation, as vLLM's default `raw_logprobs`
and as transformers' `log_softmax(logits)` give them: a request's settings never change
what its tokens' probabilities are reported as.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprobs:
    """The logprob of `token_id` at one position and the `top` alternatives there,
    most likely first (ties: lower id first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def gather(logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]) -> list[TokenLogprobs]:
    """Row i of `logits` (N, V) scores `token_ids[i]`, with `num_top[i]` alternatives."""
    assert logits.dim() == 2 and logits.shape[0] == len(token_ids) == len(num_top)
    if not token_ids:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (N, V)
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=logits.device)
    chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()  # (N,)
    k = max(num_top)
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(token_ids)
    if k > 0:
        values, indices = torch.topk(logprobs, k, dim=-1)  # (N, k)
        values_list, indices_list = values.tolist(), indices.tolist()
        tops = [
            tuple(zip(indices_list[i][:n], values_list[i][:n], strict=True)) for i, n in enumerate(num_top)
        ]
    return [TokenLogprobs(t, lp, top) for t, lp, top in zip(token_ids, chosen, tops, strict=True)]
