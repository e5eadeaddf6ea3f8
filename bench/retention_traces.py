"""Seeded traces beside the Zipf one (bench.zipf_trace) for the eviction benchmark.

- `make_conversation_trace`: multi-turn chats. Sessions open over one of a few system
  prompts, run a geometric number of turns, and interleave: each request is the next
  turn of a random open session, whose prompt is the whole history so far (system
  prompt, every earlier question and answer) plus the new question. Reuse is recent
  (a session's next turn) and the same blocks are rarely used more than a few times:
  recency is what pays here.
- `make_one_off_trace`: hot families under a flood of one-offs. A share `one_off` of
  the requests (70%) are unique documents behind one of the system prompts, the rest
  draw Zipf families as the Zipf trace does: frequency is what pays, and caching the
  one-offs costs the hot families their blocks.

Both answer a `bench.zipf_trace.Trace`; `shared_tokens` is the reusable part (the
history before the new question; the family prefix; the system prompt of a one-off).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from bench.zipf_trace import MAX_TOKEN, Trace


@dataclass(frozen=True)
class ConversationSpec:
    num_requests: int
    num_apps: int = 8
    open_sessions: int = 24  # sessions interleaving at any time
    mean_turns: float = 6.0  # geometric
    app_tokens: tuple[int, int] = (128, 512)
    question_tokens: tuple[int, int] = (16, 160)
    answer_tokens: tuple[int, int] = (32, 256)
    max_history_tokens: int = 3_072  # a session ends once its prompt would pass this
    seed: int = 0


def make_conversation_trace(spec: ConversationSpec) -> Trace:
    rng = random.Random(spec.seed)

    def tokens(bounds: tuple[int, int]) -> list[int]:
        return [rng.randrange(MAX_TOKEN) for _ in range(rng.randint(*bounds))]

    apps = [tokens(spec.app_tokens) for _ in range(spec.num_apps)]
    app_weights = [1.0 / (rank + 1) for rank in range(spec.num_apps)]
    next_id = 0

    def new_session() -> tuple[int, list[int], int]:
        nonlocal next_id
        next_id += 1
        turns = 1
        while rng.random() > 1.0 / spec.mean_turns:
            turns += 1
        app = rng.choices(range(spec.num_apps), weights=app_weights)[0]
        return next_id, list(apps[app]), turns

    sessions = [new_session() for _ in range(spec.open_sessions)]
    prompts: list[list[int]] = []
    shared: list[int] = []
    families: list[int] = []
    while len(prompts) < spec.num_requests:
        i = rng.randrange(len(sessions))
        session_id, history, turns_left = sessions[i]
        prompt = history + tokens(spec.question_tokens)
        prompts.append(prompt)
        shared.append(len(history))
        families.append(session_id)
        history = prompt + tokens(spec.answer_tokens)
        turns_left -= 1
        if turns_left and len(history) + spec.question_tokens[1] <= spec.max_history_tokens:
            sessions[i] = (session_id, history, turns_left)
        else:
            sessions[i] = new_session()
    return Trace(prompts, shared, families)


@dataclass(frozen=True)
class OneOffSpec:
    num_requests: int
    one_off: float = 0.7  # share of requests that are unique
    num_families: int = 200
    num_apps: int = 20
    zipf_s: float = 1.1
    app_tokens: tuple[int, int] = (64, 256)
    family_tokens: tuple[int, int] = (64, 1024)
    suffix_tokens: tuple[int, int] = (16, 128)
    one_off_tokens: tuple[int, int] = (256, 1_024)
    seed: int = 0


def make_one_off_trace(spec: OneOffSpec) -> Trace:
    rng = random.Random(spec.seed)

    def tokens(bounds: tuple[int, int]) -> list[int]:
        return [rng.randrange(MAX_TOKEN) for _ in range(rng.randint(*bounds))]

    apps = [tokens(spec.app_tokens) for _ in range(spec.num_apps)]
    families = [rng.choice(apps) + tokens(spec.family_tokens) for _ in range(spec.num_families)]
    weights = [1.0 / (rank + 1) ** spec.zipf_s for rank in range(spec.num_families)]
    prompts: list[list[int]] = []
    shared: list[int] = []
    family_ids: list[int] = []
    for _ in range(spec.num_requests):
        if rng.random() < spec.one_off:
            app = rng.choice(apps)
            prompts.append(app + tokens(spec.one_off_tokens))
            shared.append(len(app))
            family_ids.append(-1)
        else:
            family = rng.choices(range(spec.num_families), weights=weights)[0]
            prompts.append(families[family] + tokens(spec.suffix_tokens))
            shared.append(len(families[family]))
            family_ids.append(family)
    return Trace(prompts, shared, family_ids)


def distinct_blocks(prompts: list[list[int]], block_size: int) -> int:
    """Distinct full blocks of the trace (the pool that would never evict)."""
    from bench.prefix_keys import PrefixKeys

    keys = PrefixKeys(block_size)
    seen: set[int] = set()
    for prompt in prompts:
        seen.update(keys.chain(prompt))
    return len(seen)
