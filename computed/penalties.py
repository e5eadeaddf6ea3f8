"""A request's own changes to its logits before a token is chosen: penalties, bias, min_tokens.

Order (vLLM's and transformers'): min_tokens masking, logit bias, repetition penalty
(prompt and completion), then presence and frequency penalties (completion only). They
apply to greedy requests too, so `sample` takes the argmax of the processed row. The
logprobs a request gets back are computed before any of this (computed/logprobs.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from computed.sequence import SamplingParams


@dataclass(frozen=True)
class TokenHistory:
    """What a penalized row has seen: its prompt and the completion so far."""

    prompt_token_ids: Sequence[int]
    output_token_ids: tuple[int, ...]

    def extended(self, token: int) -> TokenHistory:
        return TokenHistory(self.prompt_token_ids, (*self.output_token_ids, token))


def process(logits: torch.Tensor, p: SamplingParams, history: TokenHistory) -> torch.Tensor:
    """`logits` (V,) float32 with `p`'s processing applied (a new tensor)."""
    logits = logits.float().clone()
    vocab = logits.shape[0]
    device = logits.device
    if p.min_tokens and len(history.output_token_ids) < p.min_tokens and p.banned_until_min_tokens:
        banned = torch.tensor(
            [t for t in p.banned_until_min_tokens if t < vocab], dtype=torch.long, device=device
        )
        logits[banned] = float("-inf")
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long, device=device)
        logits[ids] += torch.tensor([b for _, b in p.logit_bias], dtype=logits.dtype, device=device)
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(
            [*history.prompt_token_ids, *history.output_token_ids], dtype=torch.long, device=device
        ).unique()
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and history.output_token_ids:
        out = torch.tensor(history.output_token_ids, dtype=torch.long, device=device)
        counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)  # (V,)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits
