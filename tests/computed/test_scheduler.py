"""The scheduler driven against the real directory core, with a shadow KV pool.

No model: a "forward" writes each fed token id into a shadow slot table and checks
that every position the chunk attends to holds exactly that sequence's token. That
proves, model-free, that block tables (cache hits included) always point at the right
content, that nothing is written into committed (shared) blocks, and that chunking,
look-ahead grows and preemption never lose or corrupt a token.
"""

from __future__ import annotations

import random

import pytest

from blockd import types as bt
from blockd.directory import BlockDirectory
from computed.directory_ops import AdmitResult, DirectoryOps, DirectoryResult, GrowResult
from computed.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from computed.sequence import SamplingParams, Sequence

VOCAB = 50


def next_token(history: list[int]) -> int:
    """A deterministic stand-in for greedy decoding: depends on the whole history."""
    return (sum((i + 1) * t for i, t in enumerate(history)) * 7 + len(history)) % VOCAB


def reference(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


class Harness:
    def __init__(self, num_blocks: int, block_size: int = 4, **sched) -> None:
        self.bs = block_size
        self.directory = BlockDirectory()
        reg = self.directory.register_pool(num_blocks, block_size, bt.Namespace("test-model"))
        self.pool_id, self.epoch = reg.pool_id, reg.epoch
        self.scheduler = Scheduler(
            SchedulerConfig(block_size=block_size, num_blocks=num_blocks, max_model_len=4096, **sched),
            eos_token_ids=(),
        )
        self.shadow: dict[int, int] = {}  # pool slot -> token id whose K/V it holds
        self.num_model_tokens = 0
        self.max_chunk = 0
        self.urgent_waits = 0  # steps that waited on blockd for a grow alone
        self.num_forwards = 0
        self.num_iterations = 0  # iterations that ran a forward
        self.max_table = 0  # the most blocks any sequence's table held
        self.num_grows = 0  # grows sent to blockd
        self._ids = 0

    def add(self, prompt: list[int], max_tokens: int, salt: str = "") -> Sequence:
        self._ids += 1
        seq = Sequence(
            self._ids,
            list(prompt),
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            self.bs,
            cache_salt=salt,
        )
        self.scheduler.add(seq)
        return seq

    def step_directory(self, ops: DirectoryOps) -> DirectoryResult:
        self.num_grows += len(ops.grows)
        res = self.directory.step(
            self.pool_id,
            self.epoch,
            commits=[bt.CommitOp(c.sequence_id, c.block_ids, c.token_ids) for c in ops.commits],
            releases=[bt.ReleaseOp(s) for s in ops.releases],
            grows=[bt.GrowOp(g.sequence_id, g.num_tokens) for g in ops.grows],
            admits=[
                bt.AdmitOp(a.sequence_id, a.token_ids, a.cache_salt, a.public_prefix_tokens)
                for a in ops.admits
            ],
        )
        self.check_accounting()
        return DirectoryResult(
            grows=[GrowResult(g.sequence_id, g.grown, list(g.new_block_ids)) for g in res.grows],
            admits=[
                AdmitResult(a.sequence_id, a.admitted, list(a.block_ids), a.num_cached_tokens)
                for a in res.admits
            ],
            num_free_blocks=res.num_free_blocks,
            num_evictable_blocks=res.num_evictable_blocks,
        )

    def forward(self, chunks: list[ScheduledChunk]) -> list[int | None]:
        cached = {b.block_id for b in self.directory.list_blocks(self.pool_id, page_size=10_000).blocks}
        out: list[int | None] = []
        for chunk in chunks:
            seq, bs = chunk.seq, self.bs

            def slot(p: int, seq: Sequence = seq, bs: int = bs) -> int:
                return seq.block_table[p // bs] * bs + p % bs

            for p in range(chunk.write_from):  # everything attended to but not written now
                if p < chunk.end:
                    assert self.shadow.get(slot(p)) == seq.token_ids[p], (
                        f"seq {seq.sequence_id} pos {p}: wrong K/V"
                    )
            for p in range(chunk.write_from, chunk.end):
                block = seq.block_table[p // bs]
                assert block not in cached, f"seq {seq.sequence_id} writes into committed block {block}"
                self.shadow[slot(p)] = seq.token_ids[p]
            self.num_model_tokens += chunk.num_tokens
            self.max_chunk = max(self.max_chunk, chunk.num_tokens)
            self.max_table = max(self.max_table, len(seq.block_table))
            out.append(next_token(seq.token_ids[: chunk.end]) if chunk.sample else None)
        return out

    def forward_steps(self, chunks: list[ScheduledChunk]) -> None:
        """The engine's forward: a burst as `decode_budgets` allows (else one step), step j
        feeding the token step j - 1 sampled, each row for its own budget at most; a row
        that finished inside the burst leaves it."""
        self.num_iterations += 1
        budgets = self.scheduler.decode_budgets(chunks) or [1] * len(chunks)
        rows = list(range(len(chunks)))
        for j in range(max(budgets)):
            rows = [r for r in rows if budgets[r] > j and not chunks[r].seq.is_finished]
            if not rows:
                return
            step = [
                chunks[r]._replace(
                    start=chunks[r].start + j, end=chunks[r].end + j, write_from=chunks[r].write_from + j
                )
                for r in rows
            ]
            self.num_forwards += 1
            self.scheduler.on_forward_done(step, self.forward(step))

    def run(self, max_iterations: int = 20_000) -> None:
        """Mirror the engine: wait for blockd only when admitting or urgently growing."""
        for _ in range(max_iterations):
            if not self.scheduler.has_work():
                return
            ops = self.scheduler.plan_ops()
            if ops.must_wait:
                self.urgent_waits += not ops.admits
                self.scheduler.apply_result(ops, self.step_directory(ops))
                chunks = self.scheduler.schedule()
                ahead = self.scheduler.plan_grows()
                result = self.step_directory(ahead)  # in flight while the model runs
                if chunks:
                    self.forward_steps(chunks)
                self.scheduler.apply_result(ahead, result)
            else:
                chunks = self.scheduler.schedule()
                result = self.step_directory(ops)  # in flight while the model runs
                if chunks:
                    self.forward_steps(chunks)
                self.scheduler.apply_result(ops, result)
        raise AssertionError("the scheduler did not finish its work")

    def check_accounting(self) -> None:
        t = self.directory.stats(self.pool_id).total
        assert t.num_free_blocks + t.num_evictable_blocks + t.num_referenced_blocks == t.num_blocks


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def test_second_identical_prompt_hits_and_computes_only_the_tail():
    h = Harness(num_blocks=64)
    p = rand_prompt(random.Random(1), 10 * 4 + 3)
    a = h.add(p, 5)
    h.run()
    before = h.num_model_tokens
    b = h.add(p, 5)
    h.run()
    assert a.completion_token_ids == b.completion_token_ids == reference(p, 5)
    assert b.num_cached_tokens == 40
    # 3 uncached prompt tokens, then 4 decode steps (the 5th token needs no forward)
    assert h.num_model_tokens - before == 3 + 4


def test_a_prompt_that_fills_its_blocks_decodes_without_waiting_for_a_grow():
    """Its first decode token needs a new block: asked while the prefill runs
    (`plan_grows`), not as an urgent grow the next step waits for."""
    h = Harness(num_blocks=64)
    prompts = [rand_prompt(random.Random(9), 4 * 4), rand_prompt(random.Random(10), 6 * 4)]
    seqs = [h.add(p, 6) for p in prompts]
    h.run()
    assert [s.completion_token_ids for s in seqs] == [reference(p, 6) for p in prompts]
    assert h.urgent_waits == 0


def test_fully_cached_prompt_recomputes_only_its_last_position():
    h = Harness(num_blocks=64)
    p = rand_prompt(random.Random(2), 8 * 4)
    h.add(p, 3)
    h.run()
    before = h.num_model_tokens
    seq = h.add(p, 3)
    h.run()
    assert seq.num_cached_tokens == len(p)
    assert seq.completion_token_ids == reference(p, 3)
    assert h.num_model_tokens - before == 1 + 2


def test_chunked_prefill_respects_the_token_budget():
    h = Harness(num_blocks=64, max_num_batched_tokens=8)
    p = rand_prompt(random.Random(3), 45)
    seq = h.add(p, 4)
    h.run()
    assert seq.completion_token_ids == reference(p, 4)
    assert h.max_chunk <= 8


def test_budget_charges_only_uncached_tokens():
    h = Harness(num_blocks=128, max_num_batched_tokens=8)
    shared = rand_prompt(random.Random(4), 40)
    h.add(shared + [1, 2], 1)
    h.run()
    steps_before = h.num_model_tokens
    seq = h.add(shared + [3, 4], 1)
    h.run()
    assert seq.num_cached_tokens == 40
    assert h.num_model_tokens - steps_before == 2


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("decode_steps", [1, 6])
def test_random_workload_under_pressure_matches_reference(seed, decode_steps):
    """Shared prefixes, salts, a pool too small for everyone: preemption must be lossless,
    decode steps run back to back or not."""
    rng = random.Random(seed)
    h = Harness(
        num_blocks=rng.choice([24, 40, 64]),
        max_num_seqs=rng.choice([2, 4, 8]),
        max_num_batched_tokens=rng.choice([6, 16, 64]),
        decode_steps=decode_steps,
    )
    prefixes = [rand_prompt(rng, rng.randrange(0, 30)) for _ in range(3)]
    seqs = []
    for _ in range(12):
        prompt = rng.choice(prefixes) + rand_prompt(rng, rng.randrange(1, 12))
        seqs.append((h.add(prompt, rng.randrange(1, 24), salt=rng.choice(["", "", "t1"])), prompt))
    h.run()
    for seq, prompt in seqs:
        assert seq.completion_token_ids == reference(prompt, seq.params.max_tokens), seq.sequence_id
        assert seq.finish_reason == "length"
    stats = h.directory.stats(h.pool_id).total
    assert stats.num_referenced_blocks == 0, "every block must be released at the end"
    assert stats.num_sequences == 0


def test_decode_steps_run_back_to_back_within_the_slots_grown_ahead():
    h = Harness(num_blocks=64, decode_steps=8)
    rng = random.Random(11)
    prompts = [rand_prompt(rng, 10), rand_prompt(rng, 13)]
    seqs = [h.add(p, 30) for p in prompts]
    h.run()
    assert [s.completion_token_ids for s in seqs] == [reference(p, 30) for p in prompts]
    # 1 prefill step, then 29 decode steps in whole bursts of 8 (8, 8, 8, 5): each grow
    # lands a burst ahead, so no block boundary cuts one short (blocks of 4 here, and
    # the two sequences cross theirs at different steps); never a wait on an urgent grow
    assert h.num_forwards == 1 + 29
    assert h.num_iterations == 1 + 4
    assert h.urgent_waits == 0


def prefilled(h: Harness, prompt: list[int], max_tokens: int) -> list[ScheduledChunk]:
    """Admit and prefill one sequence, apply the next step's grows: its decode chunks."""
    sched = h.scheduler
    h.add(prompt, max_tokens)
    ops = sched.plan_ops()
    sched.apply_result(ops, h.step_directory(ops))
    chunks = sched.schedule()
    sched.on_forward_done(chunks, h.forward(chunks))
    ops = sched.plan_ops()
    sched.apply_result(ops, h.step_directory(ops))
    return sched.schedule()


def test_a_burst_is_bounded_by_its_slots_its_max_tokens_and_waiting_requests():
    h = Harness(num_blocks=64, decode_steps=8)
    chunks = prefilled(h, rand_prompt(random.Random(12), 10), 20)
    assert len(chunks[0].seq.block_table) * 4 >= 11 + 8, "slots grown for a whole burst"
    assert h.scheduler.decode_steps_for(chunks) == 8
    late = h.add(rand_prompt(random.Random(13), 5), 3)
    assert h.scheduler.decode_steps_for(chunks) == 1, "a burst would hold the waiting request back"
    h.scheduler.finish(late, "cancelled")
    assert h.scheduler.decode_steps_for(chunks) == 8
    # 4 tokens asked for, 1 sampled by the prefill: 3 more steps at most
    h = Harness(num_blocks=64, decode_steps=8)
    assert h.scheduler.decode_steps_for(prefilled(h, rand_prompt(random.Random(12), 10), 4)) == 3
    # decode steps of 1: no bursts, grows one slot ahead only
    h = Harness(num_blocks=64)
    chunks = prefilled(h, rand_prompt(random.Random(12), 12), 20)
    assert h.scheduler.decode_steps_for(chunks) == 1 and len(chunks[0].seq.block_table) == 4


def test_slots_are_never_grown_past_the_last_a_sequence_can_write():
    h = Harness(num_blocks=64, block_size=4, decode_steps=8)
    prompt = rand_prompt(random.Random(13), 10)
    seq = h.add(prompt, 3)  # writes positions 0..11 at most: 3 blocks
    h.run()
    assert seq.completion_token_ids == reference(prompt, 3)
    assert h.max_table == 3


@pytest.mark.parametrize("decode_steps", [1, 8])
def test_a_request_for_one_token_grows_nothing(decode_steps):
    """A prompt that fills its blocks, asking for one token: that token is never fed, so no
    slot is grown for it (a grow sent alongside the prefill, during its time to first token).
    Asking for two, the first is fed: one grow, one block more."""
    prompt = rand_prompt(random.Random(14), 4 * 4)
    for max_tokens, grows, table in ((1, 0, 4), (2, 1, 5)):
        h = Harness(num_blocks=64, decode_steps=decode_steps)
        seq = h.add(prompt, max_tokens)
        h.run()
        assert seq.completion_token_ids == reference(prompt, max_tokens)
        assert (h.num_grows, h.max_table) == (grows, table), max_tokens


def test_preemption_happens_and_hits_its_own_blocks():
    h = Harness(num_blocks=12, max_num_seqs=4)
    rng = random.Random(9)
    seqs = [(h.add(p, 20), p) for p in (rand_prompt(rng, 10) for _ in range(3))]
    h.run()
    assert sum(s.num_preemptions for s, _ in seqs) > 0, "the pool was sized to force preemption"
    for seq, prompt in seqs:
        assert seq.completion_token_ids == reference(prompt, 20)


def test_cancel_while_running_releases_blocks():
    h = Harness(num_blocks=32)
    seq = h.add(rand_prompt(random.Random(5), 9), 50)
    for _ in range(5):  # a few iterations in
        ops = h.scheduler.plan_ops()
        h.scheduler.apply_result(ops, h.step_directory(ops))
        chunks = h.scheduler.schedule()
        h.scheduler.on_forward_done(chunks, h.forward(chunks))
    assert seq.num_completion_tokens > 0
    h.scheduler.finish(seq, "cancelled")
    h.run()
    assert h.directory.stats(h.pool_id).total.num_referenced_blocks == 0


def test_sequence_longer_than_the_pool_finishes_with_length():
    h = Harness(num_blocks=4)  # 16 token slots
    seq = h.add(rand_prompt(random.Random(6), 6), 100)
    h.run()
    assert seq.finish_reason == "length"
    assert seq.completion_token_ids == reference(seq.prompt_token_ids, seq.num_completion_tokens)
    assert h.directory.stats(h.pool_id).total.num_referenced_blocks == 0


def test_requests_arriving_together_compute_their_common_prefix_once():
    """16 prompts with one 32-block prefix, added at once: the first computes the prefix,
    the others wait for its blocks (not admitted beside it as misses) and hit them."""
    h = Harness(num_blocks=512, max_num_batched_tokens=64)
    rng = random.Random(7)
    prefix = rand_prompt(rng, 32 * 4)
    prompts = [prefix + rand_prompt(rng, 6) for _ in range(16)]
    seqs = [h.add(p, 3) for p in prompts]
    other = h.add(rand_prompt(rng, 20), 3)  # an unrelated request is not held back
    first = h.scheduler.plan_ops()
    assert [a.sequence_id for a in first.admits] == [seqs[0].sequence_id, other.sequence_id]
    h.scheduler.apply_result(first, h.step_directory(first))
    assert h.scheduler.plan_held_admits() is None  # blockd found the prefix uncached: they wait
    h.run()
    for seq, p in zip(seqs, prompts):
        assert seq.completion_token_ids == reference(p, 3)
    assert seqs[0].num_cached_tokens == 0
    assert all(seq.num_cached_tokens == 32 * 4 for seq in seqs[1:])
    # The prefix once, each request's 6-token tail, 2 decode steps each, and the other request.
    assert h.num_model_tokens == 32 * 4 + 16 * (6 + 2) + 20 + 2


def test_a_salted_request_does_not_wait_for_an_unsalted_prefix():
    h = Harness(num_blocks=256)
    p = rand_prompt(random.Random(8), 16 * 4 + 2)
    a, b = h.add(p, 2), h.add(p, 2, salt="tenant-b")
    ops = h.scheduler.plan_ops()
    assert [x.sequence_id for x in ops.admits] == [a.sequence_id, b.sequence_id]


def test_followers_of_a_computed_prefix_are_admitted_together():
    """With nothing running, the first follower is credited with no cached prefix and
    the rest are held behind it; once blockd's answer says the prefix is cached, they are
    admitted in the same step (a second admission round), not one step later."""
    h = Harness(num_blocks=512)
    rng = random.Random(9)
    prefix = rand_prompt(rng, 32 * 4)
    h.add(prefix + rand_prompt(rng, 6), 2)
    h.run()  # the prefix is committed, nothing runs
    followers = [h.add(prefix + rand_prompt(rng, 6), 20) for _ in range(10)]
    plans = []
    for _ in range(3):
        ops = h.scheduler.plan_ops()
        h.scheduler.apply_result(ops, h.step_directory(ops))
        held = h.scheduler.plan_held_admits()
        if held is not None:
            h.scheduler.apply_result(held, h.step_directory(held))
        plans.append((len(ops.admits), 0 if held is None else len(held.admits)))
        chunks = h.scheduler.schedule()
        if chunks:
            h.scheduler.on_forward_done(chunks, h.forward(chunks))
    assert plans == [(1, 9), (0, 0), (0, 0)]
    assert all(seq.num_cached_tokens == 32 * 4 for seq in followers)
