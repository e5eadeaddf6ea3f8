"""Seeded token-id prompts. Ids avoid the default model's special tokens (0-6)."""

from __future__ import annotations

import random

FIRST_ID = 7  # the default model's ids 0-6 are <|bos|>, <|eos|>, ... <|end|>
VOCAB = 4096  # the default model's vocabulary


def random_tokens(rng: random.Random, n: int, vocab: int = VOCAB) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


def shared_prefix_prompts(
    seed: int, num_requests: int, prefix_len: int, unique_len: int, vocab: int = VOCAB
) -> list[list[int]]:
    """`num_requests` prompts: one random prefix + a random suffix each (seeded)."""
    rng = random.Random(seed)
    prefix = random_tokens(rng, prefix_len, vocab)
    return [prefix + random_tokens(rng, unique_len, vocab) for _ in range(num_requests)]


def unrelated_prompts(seed: int, num_requests: int, length: int, vocab: int = VOCAB) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_tokens(rng, length, vocab) for _ in range(num_requests)]
