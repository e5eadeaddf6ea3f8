"""One forward pass over the scheduled chunks, then sampling (runs on the compute thread).

`prepare()` snapshots everything the forward needs on the event-loop thread (the
scheduler keeps mutating sequences there); `run()` builds tensors, runs the model
through the paged pool and samples one token per chunk that asked for one;
`run_steps()` runs several decode steps back to back, each feeding the last one's tokens.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
import torch

from computed.attention import AttentionBatch, SpanInput, decode_cascade
from computed.decode_graphs import DecodeGraphs
from computed.directory_ops import CopyPlan
from computed.host_kv import HostKV
from computed.kv_pool import KVPool
from computed.logprobs import gather
from computed.output_rows import OutputRows
from computed.penalties import TokenHistory
from computed.prompt_logprobs import LogprobStore, PromptRecompute, PromptRows
from computed.sampling import make_generator, sample
from computed.scheduler import ScheduledChunk
from computed.sequence import SamplingParams, Sequence, SequenceId
from computed.shared_kv import SharedKV

log = structlog.get_logger("computed.model_runner")


@dataclass(frozen=True)
class ForwardInput:
    token_ids: list[int]  # (T,) the fed tokens of every chunk, concatenated
    spans: list[SpanInput]
    sample_rows: list[int]  # index into token_ids of each sampled position
    sample_chunks: list[int]  # which chunk each sampled row belongs to
    params: list[SamplingParams]
    sequence_ids: list[SequenceId]
    num_chunks: int
    # Per sampled row: its token history where its params process logits (else None).
    histories: list[TokenHistory | None] = field(default_factory=list)
    # Prompt logprobs (computed/prompt_logprobs.py): rows of this step whose logits are
    # read, and cache-served positions recomputed before it.
    prompt_rows: list[PromptRows] = field(default_factory=list)
    recomputes: list[PromptRecompute] = field(default_factory=list)

    def next_decode(self, sampled: list[int | None]) -> ForwardInput:
        """The decode step after this one (every chunk a decode row that sampled): each
        row feeds its sampled token at the next position, into the same block table (the
        same spans a fresh `prepare` would make once the tokens are appended)."""
        assert len(self.spans) == self.num_chunks == len(self.sample_rows), "not a decode step"
        tokens = [t for t in sampled if t is not None]
        assert len(tokens) == self.num_chunks, "a decode row sampled nothing"
        spans = [SpanInput(s.block_table, s.num_computed_tokens + 1, 1, True) for s in self.spans]
        histories = [h.extended(t) if h is not None else None for h, t in zip(self.histories, tokens)]
        return ForwardInput(
            tokens,
            spans,
            self.sample_rows,
            self.sample_chunks,
            self.params,
            self.sequence_ids,
            self.num_chunks,
            histories,
        )

    def subset(self, rows: list[int]) -> ForwardInput:
        """This decode step for `rows` only (indices of its chunks, ascending): a burst's
        next step once some rows have left it."""
        assert len(self.sample_rows) == self.num_chunks, "not a decode step"
        histories = [self.histories[i] for i in rows] if self.histories else []
        return ForwardInput(
            [self.token_ids[i] for i in rows],
            [self.spans[i] for i in rows],
            list(range(len(rows))),
            list(range(len(rows))),
            [self.params[i] for i in rows],
            [self.sequence_ids[i] for i in rows],
            len(rows),
            histories,
        )


class ModelRunner:
    """Owns the model, the KV pool and each sequence's sampling generator."""

    def __init__(
        self,
        model: torch.nn.Module,
        pool: KVPool,
        block_size: int,
        device: torch.device,
        host: HostKV | None = None,
        shared: SharedKV | None = None,
        decode_graphs: bool = False,
        max_num_seqs: int = 1,
        max_context: int | None = None,
    ) -> None:
        self.model = model
        self.pool = pool
        self.host = host
        self.shared = shared
        self.block_size = block_size
        self.device = device
        self._cascade = decode_cascade(device, pool.dtype, pool.head_dim)
        # Which attention code runs, chosen once for this model and pool (computed.backends).
        choice = model.choose_attention_backend(pool)
        log.info("attention_backend_selected", backend=choice.backend.name, reason=choice.reason)
        # Plain decode steps of up to `max_num_seqs` rows over static buffers, replayed as
        # CUDA graphs on CUDA (computed.decode_graphs); captured here, before any block is live.
        self.decode_graphs: DecodeGraphs | None = None
        if decode_graphs and DecodeGraphs.supports(choice.backend.name):
            # Slot tables as wide as the longest context served (8,192 keys without a limit).
            width = max_context or min(model.rotary.max_positions, 8192)
            self.decode_graphs = DecodeGraphs(model, pool, block_size, max_num_seqs, width)
            graphs = self.decode_graphs
            log.info("decode_graphs_ready", buckets=graphs.buckets, captured=graphs.capture)
        self._generators: dict[SequenceId, torch.Generator] = {}
        self._seeds: dict[SequenceId, int | None] = {}
        self.logprobs = LogprobStore()

    def copy_blocks(self, plan: CopyPlan) -> list[tuple[str, bytes]]:
        """Run a Step answer's copies between the device pool and this worker's memory:
        shared tier stores are read first (with the host demotions, before any load
        writes a block), then host loads. Answers the stores' (key, value) pairs."""
        values: list[tuple[str, bytes]] = []
        if plan.stores:
            assert self.shared is not None, "blockd asked for shared tier stores, but this worker has none"
            values = self.shared.snapshot(plan.stores)
        if plan.demotions or plan.loads:
            assert self.host is not None, "blockd asked for host tier copies, but this worker has none"
            self.host.apply(plan)
        return values

    def measure_prefill_seconds_per_token(self, num_tokens: int = 256) -> float:
        """Seconds of prefill per token, from a warm prefill into blocks nobody holds yet
        (call before registering with blockd: the pool is empty then)."""
        num_tokens = max(1, min(num_tokens, self.pool.num_blocks * self.block_size))
        table = list(range(-(-num_tokens // self.block_size)))
        span = SpanInput(block_table=table, num_computed_tokens=0, num_new_tokens=num_tokens, write_kv=True)
        inp = ForwardInput([0] * num_tokens, [span], [], [], [], [], 1)
        best = float("inf")
        for _ in range(2):  # the first run warms up kernels and allocations
            started = time.perf_counter()
            self.run(inp)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            best = min(best, time.perf_counter() - started)
        return best / num_tokens

    def add_sequence(self, sequence_id: SequenceId, seed: int | None) -> None:
        self._seeds[sequence_id] = seed

    def remove_sequence(self, sequence_id: SequenceId) -> None:
        self._seeds.pop(sequence_id, None)
        self._generators.pop(sequence_id, None)
        self.logprobs.remove(sequence_id)

    def prepare(self, chunks: list[ScheduledChunk]) -> ForwardInput:
        token_ids: list[int] = []
        spans: list[SpanInput] = []
        sample_rows: list[int] = []
        sample_chunks: list[int] = []
        for i, chunk in enumerate(chunks):
            seq, start, end, write_from = chunk.seq, chunk.start, chunk.end, chunk.write_from
            if write_from <= start:
                writes: bool | list[bool] = True
            elif write_from >= end:
                writes = False
            else:
                writes = [p >= write_from for p in range(start, end)]
            # A copy of the table: blockd's answer may extend it while this step runs.
            spans.append(SpanInput(list(seq.block_table), start, end - start, writes))
            token_ids.extend(seq.token_ids[start:end])
            if chunk.sample:
                sample_rows.append(len(token_ids) - 1)
                sample_chunks.append(i)
        sampled_seqs = [chunks[i].seq for i in sample_chunks]
        return ForwardInput(
            token_ids,
            spans,
            sample_rows,
            sample_chunks,
            [seq.params for seq in sampled_seqs],
            [seq.sequence_id for seq in sampled_seqs],
            len(chunks),
            [_history(seq) for seq in sampled_seqs],
            *self.logprobs.plan(chunks, spans),
        )

    @torch.inference_mode()
    def run(self, inp: ForwardInput) -> list[int | None]:
        """Returns, per chunk, the sampled token or None (a prefill chunk that ends early)."""
        return self._run(inp, self._plan(inp, None))

    def _plan(self, inp: ForwardInput, previous: AttentionBatch | None) -> AttentionBatch | None:
        """The step's attention plan, or None where the static decode buffers serve it (they
        derive theirs on the device: building it anyway was the top of a 1-row static step's
        profile, 0.33 of 0.57 s). `previous`: the plan of the step before, over the same rows
        one token back (a burst's), which `next_decode` advances instead of building anew."""
        graphs = self.decode_graphs
        every_row_sampled = len(inp.sample_rows) == len(inp.token_ids)  # a decode step's rows
        if graphs is not None and every_row_sampled and graphs.bucket_for(inp.spans) is not None:
            return None
        if previous is not None:
            return previous.next_decode(inp.spans, self._cascade)
        return AttentionBatch.build(inp.spans, self.block_size, self.device, self._cascade)

    def _run(self, inp: ForwardInput, batch: AttentionBatch | None) -> list[int | None]:
        """`batch`: `_plan`'s answer (None: the static decode buffers serve this step)."""
        for recompute in inp.recomputes:
            self._recompute_prompt_logprobs(recompute)
        out: list[int | None] = [None] * inp.num_chunks
        if batch is None:  # a decode step the static buffers serve
            assert self.decode_graphs is not None
            hidden = self.decode_graphs.run(inp.token_ids, inp.spans)  # (T, hidden)
            assert hidden is not None, "the static buffers refused a step they said they serve"
        elif len(inp.sample_rows) == len(inp.token_ids):  # every row read (an eager decode step)
            input_ids = torch.tensor(inp.token_ids, dtype=torch.long, device=self.device)  # (T,)
            hidden = self.model(input_ids, batch, self.pool)  # (T, hidden)
        elif inp.prompt_rows:  # prompt logprobs read more rows than the sampled ones
            input_ids = torch.tensor(inp.token_ids, dtype=torch.long, device=self.device)  # (T,)
            hidden = self.model(input_ids, batch, self.pool)  # (T, hidden)
            self._prompt_logprobs(hidden, inp.prompt_rows)
            hidden = hidden[inp.sample_rows]  # (S, hidden)
        else:  # the last layer for the sampled rows only (computed.output_rows)
            input_ids = torch.tensor(inp.token_ids, dtype=torch.long, device=self.device)  # (T,)
            read = OutputRows.build(
                inp.spans, inp.sample_rows, inp.sample_chunks, self.block_size, self.device, self._cascade
            )
            hidden = self.model(input_ids, batch, self.pool, read)  # (S, hidden)
        if not inp.sample_rows:
            return out
        logits = self.model.compute_logits(hidden)  # (S, vocab) float32
        generators = [self._generator(sid, p) for sid, p in zip(inp.sequence_ids, inp.params)]
        tokens = sample(logits, inp.params, generators, inp.histories)
        for chunk_index, token in zip(inp.sample_chunks, tokens):
            out[chunk_index] = token
        self._sampled_logprobs(inp, logits, tokens)
        return out

    def _sampled_logprobs(self, inp: ForwardInput, logits: torch.Tensor, tokens: list[int]) -> None:
        """Keep the logprobs of the sampled tokens whose requests asked for them, keyed by
        the position each token takes in its sequence."""
        rows = [i for i, p in enumerate(inp.params) if p.logprobs is not None]
        if not rows:
            return
        num_top = [inp.params[i].logprobs or 0 for i in rows]
        entries = gather(logits[rows], [tokens[i] for i in rows], num_top)
        for i, entry in zip(rows, entries):
            span = inp.spans[inp.sample_chunks[i]]
            self.logprobs.put(inp.sequence_ids[i], span.num_computed_tokens + span.num_new_tokens, [entry])

    def _prompt_logprobs(self, hidden: torch.Tensor, prompt_rows: list[PromptRows]) -> None:
        """hidden: (T, hidden) of every row of the step; each PromptRows' rows scored."""
        for rows in prompt_rows:
            logits = self.model.compute_logits(hidden[rows.first_row : rows.first_row + len(rows.targets)])
            entries = gather(logits, rows.targets, [rows.num_top] * len(rows.targets))
            self.logprobs.put(rows.sequence_id, rows.first_position + 1, entries)

    def _recompute_prompt_logprobs(self, recompute: PromptRecompute) -> None:
        """Hidden states of positions the prefix cache served, from the cached K/V (the
        span writes nothing: its tokens' K/V are read back from the pool, as a cold
        prefill reads what it wrote), for their logits."""
        span = recompute.span
        batch = AttentionBatch.build([span], self.block_size, self.device, self._cascade)
        input_ids = torch.tensor(recompute.token_ids, dtype=torch.long, device=self.device)  # (R,)
        hidden = self.model(input_ids, batch, self.pool)  # (R, hidden)
        rows = PromptRows(
            recompute.sequence_id, 0, span.num_computed_tokens, recompute.targets, recompute.num_top
        )
        self._prompt_logprobs(hidden, [rows])

    @torch.inference_mode()
    def run_steps(
        self,
        inp: ForwardInput,
        budgets: int | list[int],
        stop_ids: list[frozenset[int]],
        interrupt: threading.Event,
        deliver: Callable[[list[int], list[int]], None] | None = None,
    ) -> list[list[int | None]]:
        """A burst: decode steps back to back (`inp` a decode step, every row one chunk),
        each step exactly the `run` of the spans a fresh `prepare` would give.

        Row r runs at most `budgets[r]` steps (an int: every row's; the caller sure its
        table holds the slots) and leaves the burst after a step where it sampled one of
        `stop_ids[r]`; the others go on without it. The burst ends when no row is left, or
        once `interrupt` is set (a request arrived or left), so it never holds another
        request back by more than a step. `deliver(rows, tokens)` gets each step's chunk
        indices and tokens, in order, once each, on this thread: step j's just before step
        j + 1's forward (the last step's before returning, or before raising where planning
        the next step fails). The engine hands them to its event loop, which streams step
        j while step j + 1 runs here (the host off the forward's critical path). Answers,
        per step, the tokens by chunk index (None for a row that had left).

        Why just before the next forward, not at once: the hand-off wakes the loop, whose
        streaming (~0.4 ms of Python for 32 rows) then held the GIL while this thread
        planned the next step in Python: 1.0-1.7 ms a step between forwards (the plan
        alone: 0.16 ms quiet). Woken as the forward starts, the loop streams while the
        model runs outside the GIL (`python -m bench --only serving`'s shared workload
        through our stack alone, 4 interleaved pairs: 3,898 -> 4,027 output tok/s, every
        pair faster).

        Why: a decode step's way through the event loop (schedule, prepare, the thread
        hand-off and back, the directory's Step) cost ~0.5 ms of a 2-8 ms step (in-daemon
        trace of `make bench-peer`'s chat and shared workloads); a burst pays it once. And
        rows leave one by one because 256 streams of varied lengths end a few at a time:
        a burst that ended at the first row's end ran ~1.2 steps (`python -m bench --only
        host_overhead`)."""
        num_rows = inp.num_chunks
        assert len(stop_ids) == num_rows == len(inp.sample_rows) == len(inp.token_ids), "not a decode step"
        left = [budgets] * num_rows if isinstance(budgets, int) else list(budgets)
        assert len(left) == num_rows and min(left) >= 1, f"budgets {left} for {num_rows} rows"
        rows = list(range(num_rows))  # the chunk index of each row of `inp`
        results: list[list[int | None]] = []
        batch = self._plan(inp, None)
        while True:
            sampled = self._run(inp, batch)
            tokens = [t for t in sampled if t is not None]
            step: list[int | None] = [None] * num_rows
            for r, token in zip(rows, tokens, strict=True):
                step[r] = token
            results.append(step)
            ran = rows
            keep = []
            for i, (r, token) in enumerate(zip(rows, tokens)):
                left[r] -= 1
                if left[r] > 0 and token not in stop_ids[r]:
                    keep.append(i)
            try:
                if not keep or interrupt.is_set():
                    return results
                inp = inp.next_decode(sampled)
                if len(keep) == len(rows):
                    batch = self._plan(inp, batch)
                else:
                    inp = inp.subset(keep)
                    rows = [rows[i] for i in keep]
                    batch = self._plan(inp, None)
            finally:  # the burst ends, or the loop streams this step while the next one runs
                if deliver is not None:
                    deliver(ran, tokens)

    def _generator(self, sequence_id: SequenceId, params: SamplingParams) -> torch.Generator | None:
        if params.is_greedy:
            return None
        gen = self._generators.get(sequence_id)
        if gen is None:
            gen = make_generator(self._seeds.get(sequence_id), self.device)
            # A sequence removed while a burst still runs it gets a throwaway generator
            # (its tokens are dropped): keeping it would outlive the sequence.
            if sequence_id in self._seeds:
                self._generators[sequence_id] = gen
        return gen


def _history(seq: Sequence) -> TokenHistory | None:
    if not seq.params.processes_logits:
        return None
    return TokenHistory(seq.prompt_token_ids, tuple(seq.completion_token_ids))
