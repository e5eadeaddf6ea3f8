"""A seeded trace of prompt families with Zipf popularity, for eviction benchmarks.

Two levels of sharing, as in real traffic: `num_apps` system prompts; each of
`num_families` families (a document, a few-shot set, a long chat history) extends one
app's system prompt; each request is its family's prefix + a unique suffix (the
question). Families are drawn with probability proportional to 1 / rank^s.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

MAX_TOKEN = 128_000


@dataclass(frozen=True)
class TraceSpec:
    num_requests: int
    num_families: int = 200
    num_apps: int = 20
    zipf_s: float = 1.1
    app_tokens: tuple[int, int] = (64, 256)  # uniform range, inclusive
    family_tokens: tuple[int, int] = (64, 1024)
    suffix_tokens: tuple[int, int] = (16, 128)
    seed: int = 0

    def __post_init__(self) -> None:
        assert self.num_requests >= 1 and self.num_families >= 1 and self.num_apps >= 1, "sizes must be >= 1"
        assert self.zipf_s > 0, "zipf_s must be positive"

    @property
    def max_prompt_tokens(self) -> int:
        return self.app_tokens[1] + self.family_tokens[1] + self.suffix_tokens[1]


@dataclass(frozen=True)
class Trace:
    prompts: list[list[int]]
    shared_tokens: list[int]  # per request: length of its family prefix (the rest is unique)
    family_ids: list[int]  # per request: its family's popularity rank, 0 = most popular


def make_trace(spec: TraceSpec) -> Trace:
    rng = random.Random(spec.seed)

    def tokens(bounds: tuple[int, int]) -> list[int]:
        return [rng.randrange(MAX_TOKEN) for _ in range(rng.randint(*bounds))]

    apps = [tokens(spec.app_tokens) for _ in range(spec.num_apps)]
    families = [rng.choice(apps) + tokens(spec.family_tokens) for _ in range(spec.num_families)]
    weights = [1.0 / (rank + 1) ** spec.zipf_s for rank in range(spec.num_families)]
    drawn = rng.choices(range(spec.num_families), weights=weights, k=spec.num_requests)
    prompts = [families[f] + tokens(spec.suffix_tokens) for f in drawn]
    return Trace(prompts, [len(families[f]) for f in drawn], drawn)
