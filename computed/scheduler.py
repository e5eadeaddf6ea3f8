"""Continuous batching over a paged pool whose blocks blockd hands out (pure: no I/O).

One engine iteration is: `plan_ops()` -> (the engine sends them to blockd as ONE
`Step`) -> `apply_result()` -> `schedule()` -> forward -> `on_forward_done()`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from computed.directory_ops import (
    AdmitOp,
    CommitOp,
    CopyPlan,
    DirectoryOps,
    DirectoryResult,
    GrowOp,
    ResyncSequence,
    SharedFetch,
)
from computed.prefix_wait import PrefixLeaders
from computed.sequence import Sequence, SequenceId, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    block_size: int
    num_blocks: int
    max_model_len: int
    # Sequences running at once: bounds the decode batch and the blocks held.
    max_num_seqs: int = 64
    # Model tokens per step; only uncached tokens are charged (chunked prefill).
    max_num_batched_tokens: int = 2048
    # Decode steps one forward call may run back to back when every running sequence
    # decodes and nobody waits (`decode_steps_for`); grows reserve slots this far ahead.
    decode_steps: int = 1

    def __post_init__(self) -> None:
        assert self.decode_steps >= 1, "decode_steps must be >= 1"
        assert self.block_size >= 1, "block_size must be >= 1"
        assert self.num_blocks >= 1, "num_blocks must be >= 1"
        assert self.max_num_seqs >= 1, "max_num_seqs must be >= 1"
        assert self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1"
        assert self.max_model_len >= 2, "max_model_len must be >= 2"


class ScheduledChunk(NamedTuple):
    """Feed positions [start, end) of `seq`; write K/V only for positions >= write_from.

    `write_from > start` only when a fully cached prompt recomputes its last position:
    that K/V already sits in a committed (shared) block and must not be written.
    (Immutable, as a tuple: a step makes one per running sequence, and a frozen
    dataclass's constructor cost 2 us of the step loop's serial time each.)
    """

    seq: Sequence
    start: int
    end: int
    write_from: int
    sample: bool

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


class Scheduler:
    """Waiting and running queues, token budget, and preemption by recompute.

    Ordering: running sequences keep admission order; decodes are scheduled before
    prefill chunks (they cost one token each and users are waiting on them). Waiting
    sequences are admitted first come, first served; a preempted sequence goes back to
    the front. When a running sequence needs a block and blockd has none, the most
    recently admitted sequence is preempted (its blocks released; committed ones stay
    cached, so its re-admission usually hits them).

    Directory work is collected here and shipped once per step: commits of blocks
    whose K/V the previous forward finished, releases of finished/preempted
    sequences, grows (asked one block ahead so decode rarely waits), and admissions.
    """

    def __init__(self, config: SchedulerConfig, eos_token_ids: tuple[int, ...]) -> None:
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._admitting: dict[SequenceId, Sequence] = {}
        self._pending_commits: list[CommitOp] = []
        self._pending_releases: list[SequenceId] = []
        # Free + evictable blocks as blockd last reported them (None: unknown yet).
        self._num_available_blocks: int | None = None
        # plan_ops held a request behind a sequence admitted in the same plan.
        self._held_behind_admits = False
        # Host tier copies blockd's answers asked for, not yet run (see take_copies).
        self._copies = CopyPlan()

    # ------------------------------------------------------------------ queues

    def add(self, seq: Sequence) -> None:
        assert seq.status is SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(
            self.waiting or self.running or self._admitting or self._pending_commits or self._pending_releases
        )

    def has_running(self) -> bool:
        """Some sequence is admitted (being admitted, prefilling or decoding)."""
        return bool(self.running or self._admitting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._admitting)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (stop string, cancellation...): its blocks are released next step."""
        if seq.is_finished:
            return
        was_running = seq.status is SequenceStatus.RUNNING
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if was_running:
            self.running.remove(seq)
            self._pending_releases.append(seq.sequence_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        # A sequence in `_admitting` is released when its admission result arrives.

    # ------------------------------------------------------------ directory ops

    def plan_ops(self) -> DirectoryOps:
        """The directory work of this step. Pending commits/releases leave with it."""
        self._held_behind_admits = False
        ops = DirectoryOps(commits=self._pending_commits, releases=self._pending_releases)
        self._pending_commits, self._pending_releases = [], []
        ops.grows = self._grows()
        ops.admits = self._plan_admits(ops)
        return ops

    def plan_grows(self) -> DirectoryOps:
        """The one-step-ahead grows of sequences that started running since `plan_ops`
        (admitted by its answer), to send while this step's forward runs (call after
        `schedule`). Why: a prompt that fills its last block (a chat turn's usually
        does) has no slot for its first decode token; asked only at the next step, that
        grow held the model back for a Step round trip (4-5 ms) after every such prefill."""
        return DirectoryOps(grows=self._grows())

    def _grows(self) -> list[GrowOp]:
        """Running sequences whose table cannot hold one token more than they have. This
        step writes at most up to the newest token (a fully cached prompt writes nothing):
        short of that the grow is urgent; the slot after it lets the next decode run
        without waiting on blockd. Never past the last slot the sequence can write (its
        prompt plus max_tokens less one: none after the prompt's for max_tokens 1). With
        `decode_steps` > 1 the table is grown two bursts ahead, 2 * decode_steps - 1 slots
        past the newest token: a grow asked now
        lands after this step's forward, so it must already cover the next burst. Grown
        one burst ahead, any sequence nearing the end of a block cut the whole batch's
        burst short (bursts of 8, 6, 8, 8, 1, 8, 7, 2, ... in `bench.peer`'s shared
        workload, where rows cross block boundaries at three different steps)."""
        grows = []
        limit = min(self.config.max_model_len, self.config.num_blocks * self.config.block_size)
        ahead = 2 * self.config.decode_steps - 1
        for seq in self.running:
            needed_now, capacity = len(seq.token_ids), len(seq.block_table) * seq.block_size
            # Never past the last slot it can write: a request for one token grows nothing.
            # (Its prefill sent blockd a grow for a slot no token would ever use: one more
            # Step during its time to first token, its reply waking both daemons' threads on
            # the cores the forward ran on, and one more block to release after it.)
            last_slot = seq.num_prompt_tokens + seq.params.max_tokens - 1
            wanted = max(needed_now, min(needed_now + ahead, last_slot))
            wanted = min(wanted, limit)
            if capacity < wanted:
                grows.append(GrowOp(seq.sequence_id, wanted, is_urgent=capacity < needed_now))
        return grows

    def plan_held_admits(self) -> DirectoryOps | None:
        """Admissions only, for requests this step's `plan_ops` held behind a sequence it
        admitted, once blockd's answer has said what that sequence found cached (call after
        `apply_result`); None when none may go now. Why: with nothing running, the first
        request admitted is credited with no cached prefix, so the ones sharing its first
        block wait for it, though that prefix may be cached already: a chat turn's first
        request then ran a 50-90 ms prefill step alone while the other 7 waited for it to
        "compute" the cached system prompt (`make bench-peer`, chat). One more round trip
        to blockd (a few ms) admits them into the same step. Exact either way: a request
        still held waits for blocks really being computed."""
        if not self._held_behind_admits:
            return None
        self._held_behind_admits = False
        ops = DirectoryOps()
        ops.admits = self._plan_admits(ops)
        return ops if ops.admits else None

    def plan_arrivals(self) -> DirectoryOps | None:
        """Admissions only, for requests waiting while a forward runs (the engine sends them
        at once, and applies blockd's answer after that forward and the Step sent with it);
        None when none may go now. Commits, releases and grows wait for the next
        `plan_ops`: the forward in flight is still changing them; the blocks their grows
        will ask for are kept out of the admissions' budget all the same."""
        admits = self._plan_admits(DirectoryOps(grows=self._grows()))
        return DirectoryOps(admits=admits) if admits else None

    def _plan_admits(self, ops: DirectoryOps) -> list[AdmitOp]:
        """Admit waiting sequences in order, while seats and (roughly) blocks last. One whose
        prefix an admitted sequence is still computing waits for it (PrefixLeaders) and
        hits those blocks a step later; later requests with other prefixes go ahead."""
        admits: list[AdmitOp] = []
        if not self.waiting:
            return admits  # the common decode step: nothing to admit, no prefixes to weigh
        budget = self._num_available_blocks
        if budget is not None:
            budget -= sum(1 for g in ops.grows)
        leaders = PrefixLeaders(self.config.block_size)
        for seq in self.running:
            leaders.add_running(seq)
        for seq in self._admitting.values():
            leaders.add_admitted(seq)
        admitted: list[Sequence] = []
        for seq in self.waiting:
            if len(self.running) + len(admits) >= self.config.max_num_seqs:
                break
            if leaders.should_wait(seq):
                self._held_behind_admits = self._held_behind_admits or bool(admitted)
                continue
            blocks = -(-seq.num_tokens // self.config.block_size)
            # Blocks may come back as cache hits, so this only stops obvious misses;
            # blockd has the final word (admitted=False changes nothing).
            if budget is not None and admits and blocks > budget:
                break
            admits.append(
                AdmitOp(
                    seq.sequence_id,
                    list(seq.token_ids),
                    seq.cache_salt,
                    seq.public_prefix_tokens,
                    seq.cache_policy,
                    seq.retention_priority,
                )
            )
            admitted.append(seq)
            leaders.add_admitted(seq)
            if budget is not None:
                budget -= blocks
        if admitted:
            taken = {seq.sequence_id for seq in admitted}
            self.waiting = deque(seq for seq in self.waiting if seq.sequence_id not in taken)
            for seq in admitted:
                self._admitting[seq.sequence_id] = seq
        return admits

    def apply_result(self, ops: DirectoryOps, result: DirectoryResult) -> None:
        """Take blockd's answer: admitted sequences start running; failed grows preempt."""
        if result.num_free_blocks is not None:
            self._num_available_blocks = result.num_free_blocks + (result.num_evictable_blocks or 0)
        self._copies.demotions.extend(result.demotions)
        self._copies.stores.extend(result.shared_stores)
        by_id = {seq.sequence_id: seq for seq in self.running}
        urgent = {g.sequence_id for g in ops.grows if g.is_urgent}
        starved: list[Sequence] = []
        for outcome in result.grows:
            seq = by_id.get(outcome.sequence_id)
            if seq is None:
                continue  # finished or preempted meanwhile; its release covers the blocks
            if outcome.grown:
                seq.block_table.extend(outcome.new_block_ids)
            elif outcome.sequence_id in urgent:
                starved.append(seq)
        refused: list[Sequence] = []
        for outcome in result.admits:
            seq = self._admitting.pop(outcome.sequence_id)
            if seq.is_finished:  # cancelled while blockd was answering
                if outcome.admitted:
                    self._pending_releases.append(seq.sequence_id)
                continue
            if not outcome.admitted:
                refused.append(seq)
                continue
            self._copies.loads.extend(outcome.loads)
            num_loads = len(outcome.loads) + len(outcome.shared_loads)
            first_fetch = outcome.num_cached_tokens // self.config.block_size - len(outcome.shared_loads)
            for i, block in enumerate(outcome.shared_loads):
                self._copies.fetches.append(SharedFetch(seq, first_fetch + i, block))
            self._start(
                seq, outcome.block_ids, outcome.num_cached_tokens, num_loads, len(outcome.shared_loads)
            )
        # Refused admissions keep their place at the front, in order.
        self.waiting.extendleft(reversed(refused))
        for seq in starved:
            if seq.status is SequenceStatus.RUNNING:
                self._preempt_for(seq)

    def take_copies(self) -> CopyPlan:
        """The copies the answers applied so far owe: the engine runs them before the next
        forward (demotions before loads). Empty without a host tier."""
        plan, self._copies = self._copies, CopyPlan()
        return plan

    def on_step_failed(self, ops: DirectoryOps) -> None:
        """blockd never answered: admissions go back to waiting; resync covers the rest."""
        returned = [self._admitting.pop(a.sequence_id) for a in ops.admits]
        self.waiting.extendleft(reversed([s for s in returned if not s.is_finished]))

    def resync_sequences(self) -> list[ResyncSequence]:
        """Running sequences as blockd must know them after a restart. One with no K/V
        written yet (admitted, still waiting for its first prefill chunk) is left out:
        blockd refuses an empty token list, and `on_resynced` admits it again."""
        return [
            ResyncSequence(
                seq.sequence_id,
                list(seq.block_table),
                seq.token_ids[: seq.num_computed_tokens],
                seq.cache_salt,
                seq.public_prefix_tokens,
            )
            for seq in self.running
            if seq.num_computed_tokens > 0
        ]

    def on_resynced(self, declared: list[ResyncSequence]) -> None:
        """blockd now knows exactly the `declared` sequences, their written blocks committed.
        A running sequence left out goes back to the front of the waiting queue; a release
        is kept only for a declared sequence that finished during the recovery (its client
        cancelled), else blockd would hold its blocks forever."""
        declared_ids = {live.sequence_id for live in declared}
        self._pending_commits.clear()
        self._pending_releases = [sid for sid in self._pending_releases if sid in declared_ids]
        requeued = [seq for seq in self.running if seq.sequence_id not in declared_ids]
        for seq in requeued:
            self.running.remove(seq)
            seq.status = SequenceStatus.WAITING
            seq.block_table = []
            seq.num_computed_tokens = 0
            seq.num_committed_blocks = 0
        self.waiting.extendleft(reversed(requeued))
        for seq in self.running:
            seq.num_committed_blocks = seq.num_full_blocks()

    def on_fetch_failed(self, seq: Sequence, block_index: int) -> None:
        """The shared tier fetch of `seq`'s block `block_index` found nothing valid: its
        tokens from that block on are computed by the sequence itself, into the same
        blocks (its own, uncommitted), and no longer count as cached."""
        if seq.status is not SequenceStatus.RUNNING:
            return
        cut = block_index * self.config.block_size
        assert cut >= seq.num_committed_blocks * self.config.block_size, (
            "a fetched block is not committed yet"
        )
        seq.num_computed_tokens = min(seq.num_computed_tokens, cut)
        if seq.num_cached_tokens is not None and seq.num_cached_tokens > cut:
            lost = seq.num_cached_tokens - cut
            seq.num_cached_tokens = cut
            seq.num_shared_cached_tokens = max(0, seq.num_shared_cached_tokens - lost)

    def _start(
        self,
        seq: Sequence,
        block_ids: list[int],
        num_cached_tokens: int,
        num_loads: int = 0,
        num_shared_loads: int = 0,
    ) -> None:
        """Run an admitted sequence. Its `num_loads` blocks after the device hits are
        copied in from the host tier (or fetched from the shared tier, the last
        `num_shared_loads` of them) before the next forward: computed, not committed
        yet (the commit after that forward makes them findable)."""
        bs = self.config.block_size
        assert len(block_ids) * bs >= seq.num_tokens, "table must cover prompt"
        seq.status = SequenceStatus.RUNNING
        seq.block_table = list(block_ids)
        seq.num_computed_tokens = num_cached_tokens
        seq.num_committed_blocks = num_cached_tokens // bs - num_loads
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = min(num_cached_tokens, seq.num_prompt_tokens)
            seq.num_shared_cached_tokens = min(num_shared_loads * bs, seq.num_cached_tokens)
            seq.num_host_cached_tokens = min((num_loads - num_shared_loads) * bs, seq.num_cached_tokens)
        self.running.append(seq)

    def _preempt_for(self, starved: Sequence) -> None:
        """Free blocks for `starved` by preempting the most recently admitted sequence."""
        victim = self.running[-1]
        if victim is starved and len(self.running) == 1:
            blocks_needed = -(-(starved.num_tokens + 1) // self.config.block_size)
            if blocks_needed > self.config.num_blocks:
                self.finish(starved, "length")  # the whole pool cannot hold it
                return
        self.running.remove(victim)
        victim.status = SequenceStatus.WAITING
        victim.block_table = []
        victim.num_computed_tokens = 0
        victim.num_committed_blocks = 0
        victim.num_preemptions += 1
        self._pending_releases.append(victim.sequence_id)
        self.waiting.appendleft(victim)

    # ---------------------------------------------------------------- forward

    def schedule(self) -> list[ScheduledChunk]:
        """This step's forward: decodes first, then prefill chunks within the budget."""
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        for seq in self.running:
            if budget <= 0:
                break
            num_tokens, computed = len(seq.token_ids), seq.num_computed_tokens
            if computed < num_tokens - 1:
                continue  # prefilling (`is_prefilling`, inlined: this loop runs every step)
            if len(seq.block_table) * seq.block_size < max(computed, num_tokens):
                continue  # waiting for a block
            chunks.append(ScheduledChunk(seq, num_tokens - 1, num_tokens, computed, True))
            budget -= 1
        for seq in self.running:
            if budget <= 0:
                break
            if not seq.is_prefilling:
                continue
            start = seq.num_computed_tokens
            end = min(seq.num_tokens, start + budget)
            chunks.append(ScheduledChunk(seq, start, end, start, end == seq.num_tokens))
            budget -= end - start
        return chunks

    def decode_budgets(self, chunks: list[ScheduledChunk]) -> list[int] | None:
        """How many decode steps each of `chunks` may run back to back in one forward call
        (a burst: step j feeds the token step j - 1 sampled; `ModelRunner.run_steps`), or
        None where no burst may run: unless every running sequence decodes in them and no
        request waits to be admitted (a burst would hold it back). A row's budget is at
        most `decode_steps`, the slots its table already holds, and the tokens it may
        still produce; a row leaves the burst when its budget is spent or it samples a
        stop token (`stop_token_ids`), and the others go on."""
        steps = self.config.decode_steps
        if steps <= 1 or not chunks or self.waiting or self._admitting or len(chunks) != len(self.running):
            return None
        bs, max_len = self.config.block_size, self.config.max_model_len
        budgets = []
        for chunk in chunks:
            seq = chunk.seq
            if not chunk.sample or chunk.end - chunk.start != 1 or chunk.write_from != chunk.start:
                return None
            budget = min(
                steps,
                len(seq.block_table) * bs - chunk.start,  # step j writes slot start + j
                seq.params.max_tokens - seq.num_completion_tokens,
                max_len - seq.num_tokens,
            )
            budgets.append(max(1, budget))
        return budgets if max(budgets) > 1 else None

    def decode_steps_for(self, chunks: list[ScheduledChunk]) -> int:
        """The longest any of `chunks` may run in a burst (`decode_budgets`), 1 for none."""
        budgets = self.decode_budgets(chunks)
        return 1 if budgets is None else max(budgets)

    def stop_token_ids(self, seq: Sequence) -> frozenset[int]:
        """The tokens that end `seq` (EOS unless ignored, and its stop_token_ids)."""
        ids = frozenset(seq.params.stop_token_ids)
        return ids if seq.params.ignore_eos else ids | self.eos_token_ids

    def on_forward_done(self, chunks: list[ScheduledChunk], sampled: list[int | None]) -> list[Sequence]:
        """Record the forward's K/V and sampled tokens; returns sequences that got a token."""
        grew: list[Sequence] = []
        for chunk, token in zip(chunks, sampled, strict=True):
            seq = chunk.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # cancelled while the forward ran; its release is queued
            seq.num_computed_tokens = max(seq.num_computed_tokens, chunk.end)
            self._queue_commits(seq)
            if chunk.sample:
                assert token is not None, "a sampling chunk must yield a token"
                seq.token_ids.append(token)
                grew.append(seq)
                reason = self._stop_reason(seq, token)
                if reason is not None:
                    self.finish(seq, reason)
        return grew

    def _queue_commits(self, seq: Sequence) -> None:
        bs = self.config.block_size
        first, last = seq.num_committed_blocks, seq.num_full_blocks()
        if last <= first:
            return
        self._pending_commits.append(
            CommitOp(seq.sequence_id, seq.block_table[first:last], seq.token_ids[first * bs : last * bs])
        )
        seq.num_committed_blocks = last

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if seq.num_completion_tokens >= params.max_tokens:
            return "length"
        if seq.num_tokens >= self.config.max_model_len:
            return "length"
        if seq.num_tokens > self.config.num_blocks * self.config.block_size:
            return "length"  # the next token's K/V would not fit even in an empty pool
        return None
