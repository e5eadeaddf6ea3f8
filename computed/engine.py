"""The step loop: scheduler + directory + model runner, streaming to requests.

The loop runs as an asyncio task; the forward pass runs in one worker thread so the
event loop keeps serving RPCs. Each iteration sends exactly one batched `Step` to
blockd. Only admissions (and a grow the step cannot run without) wait for its
answer; commits, releases and look-ahead grows travel while the model computes.
The engine knows blockd only as a `Directory` (computed/directory.py).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from computed.compute_thread import ComputeThread
from computed.directory import Directory
from computed.directory_ops import CopyPlan, DirectoryOps, DirectoryResult
from computed.errors import DirectoryUnavailable
from computed.logprobs import TokenLogprobs
from computed.model_runner import ModelRunner
from computed.output import OutputText, TokenDecoder
from computed.scheduler import ScheduledChunk, Scheduler
from computed.sequence import SamplingParams, Sequence

log = structlog.get_logger("computed.engine")
# Loop turns a Step request gets to leave before an inline forward holds the loop.
_RPC_SEND_TURNS = 3
# Loop turns between two steps at most, waiting for readers to take their chunks.
_MAX_TURNS_BETWEEN_STEPS = 8


class EngineObserver(Protocol):
    """Optional hooks for metrics (histograms); counters live in EngineStats.

    A request's phases, each observed once, in this order, from the moments the engine
    stamps (`_Request`): `on_admission` (received by the service -> queued here: parsing,
    tokenization, checks; only when the caller says when it received it), `on_queued`
    (queued -> the start of its first forward: a free slot, blockd's answer, the step in
    progress), `on_first_token` (queued -> its first token, so the queue time plus
    `on_prefill`, first forward -> first token), then `on_finished` (queued -> the last
    token, and the mean time per output token after the first when there are two or more;
    None otherwise). A request cancelled or failed earlier skips the phases it never
    reached."""

    def on_step(self, seconds: float) -> None: ...
    def on_admission(self, seconds: float) -> None: ...
    def on_queued(self, seconds: float) -> None: ...
    def on_first_token(self, seconds: float) -> None: ...
    def on_prefill(self, seconds: float) -> None: ...
    def on_finished(self, seconds: float, per_output_token: float | None) -> None: ...


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    time_to_first_token_seconds: float
    total_time_seconds: float
    num_preemptions: int
    host_cached_tokens: int = 0
    shared_cached_tokens: int = 0


@dataclass(frozen=True)
class GenerationChunk:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token, when the request asked
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # the first chunk's, when asked


@dataclass
class EngineStats:
    """Counters for benchmarks and metrics (all since start)."""

    num_steps: int = 0  # iterations (one directory Step each)
    num_forwards: int = 0  # forward steps run; more than num_steps when decode steps ran in bursts
    num_prefill_tokens: int = 0  # model positions computed for prompts (uncached only)
    num_decode_tokens: int = 0
    forward_seconds: float = 0.0
    directory_wait_seconds: float = 0.0  # engine time blocked on blockd
    busy_seconds: float = 0.0  # wall time of iterations that had work
    num_recoveries: int = 0
    num_blocks_copied: int = 0  # host tier demotions + loads
    num_bytes_copied: int = 0
    num_shared_fetch_failures: int = 0  # blocks a sequence computed after its fetch failed
    num_early_admission_steps: int = 0  # admissions sent while a forward ran (`_forward_admitting`)
    finished: dict[str, int] = field(default_factory=dict)


class ChunkSink(Protocol):
    """Where a request's chunks go: an `asyncio.Queue`, or one key of a GenerateMany
    stream's outbox (computed/outbox.py). `empty()`: its reader took every chunk."""

    def put_nowait(self, chunk: GenerationChunk) -> None: ...
    def empty(self) -> bool: ...


@dataclass
class _Request:
    """A request in flight. Tokens after the first are held until `stream_interval` of
    them are waiting (or the request ends), so each queued chunk is one message."""

    seq: Sequence
    output: OutputText
    queue: ChunkSink
    arrival: float
    stream_interval: int = 1
    first_forward_at: float | None = None  # the start of the first forward it ran in
    first_token_at: float | None = None
    held_tokens: list[int] = field(default_factory=list)
    held_text: list[str] = field(default_factory=list)
    held_logprobs: list[TokenLogprobs] = field(default_factory=list)

    def sends_now(self, first: bool) -> bool:
        """Whether the next token's chunk leaves at once (else it is held)."""
        return first or self.stream_interval == 1 or len(self.held_tokens) + 1 >= self.stream_interval

    def send(
        self, token: int, text: str, first: bool, logprobs: tuple[TokenLogprobs, ...] = (), prompt: tuple = ()
    ) -> None:
        """Queue one token's chunk now, or hold it for the next message."""
        if first or self.stream_interval == 1:
            self.queue.put_nowait(GenerationChunk([token], text, logprobs=logprobs, prompt_logprobs=prompt))
            return
        self.held_tokens.append(token)
        self.held_text.append(text)
        self.held_logprobs.extend(logprobs)
        if len(self.held_tokens) >= self.stream_interval:
            held = tuple(self.held_logprobs)
            self.queue.put_nowait(GenerationChunk(self.held_tokens, "".join(self.held_text), logprobs=held))
            self.held_tokens, self.held_text, self.held_logprobs = [], [], []

    def last(self, tail: str, reason: str, usage: Usage) -> None:
        """Queue the final chunk, carrying whatever is held."""
        text = "".join(self.held_text) + tail
        self.queue.put_nowait(
            GenerationChunk(self.held_tokens, text, reason, usage, tuple(self.held_logprobs))
        )
        self.held_tokens, self.held_text, self.held_logprobs = [], [], []


class Engine:
    """Owns the requests in flight; the scheduler owns their sequences' state.

    Recovery: blockd is lost when a Step fails or the lease renewal fails; either way the
    directory sets its one flag (`Directory.needs_recovery`), which the engine only
    reads; the next iteration recovers once and `recover` clears it.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        directory: Directory,
        observer: EngineObserver | None = None,
        admission_window: float = 0.0,
        compute: ComputeThread | None = None,
    ) -> None:
        """`admission_window`: seconds the first step after idling may wait for requests
        arriving together (see `_gather_arrivals`); 0 steps at the first arrival.
        `compute`: the thread that loaded the model (computed/compute_thread.py says why
        it must be that one); None: a new one."""
        assert admission_window >= 0.0, f"admission window {admission_window} < 0"
        self.scheduler = scheduler
        self._admission_window = admission_window
        self._new_arrivals = False  # a request came since the last `_gather_arrivals`
        # When the last burst began (the first arrival with none running) and how many
        # requests arrived within the window of it: a lone request never waits, a client
        # that sends several at once does (see `_gather_arrivals`).
        self._burst_started = float("-inf")
        self._burst_size = 0
        self.observer = observer
        self.runner = runner
        self._directory = directory
        self.stats = EngineStats()
        self._requests: dict[int, _Request] = {}
        self._fed: list[ChunkSink] = []  # queues sent a chunk since the last step
        # Called once when the drain begins (`stop`); callers add and remove their own.
        self.drain_listeners: set[Callable[[], None]] = set()
        self._sequence_ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._arrived = asyncio.Event()  # a request came (read by `_forward_admitting`)
        # Set when a request arrives or leaves: a running burst of decode steps ends after
        # its current step (read on the compute thread).
        self._interrupt = threading.Event()
        self._stopping = asyncio.Event()
        self._draining = False  # set by stop(): new requests are refused from then on
        self._compute = compute or ComputeThread()
        self._tasks: list[asyncio.Task] = []
        self._shared = getattr(runner, "shared", None)
        if self._shared is not None:
            self._shared.on_reports = self._wake.set  # a finished write has a report to send

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        await self._directory.recover([], self._stopping)
        self._on_registered()
        self._tasks = [
            asyncio.create_task(self._loop(), name="engine-loop"),
            asyncio.create_task(self._directory.renew_forever(self._wake), name="lease"),
        ]

    async def stop(self, drain_seconds: float) -> None:
        """Stop admitting; let running requests finish within the deadline, cancel the rest.
        The drain listeners are called first (a GenerateMany stream with nothing in flight
        ends then, not at the gRPC server's grace)."""
        self._draining = True
        for listener in list(self.drain_listeners):
            listener()
        deadline = time.monotonic() + drain_seconds
        while self.scheduler.has_unfinished() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for req in list(self._requests.values()):
            self.abort(req.seq.sequence_id)
        # One more iteration ships the releases.
        for _ in range(100):
            if not self.scheduler.has_work():
                break
            await asyncio.sleep(0.02)
        self._stopping.set()
        self._wake.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._compute.shutdown()
        if self._shared is not None:
            await self._shared.close()
        await self._directory.close()

    # ----------------------------------------------------------------- requests

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        decoder: TokenDecoder,
        cache_salt: str = "",
        public_prefix_tokens: int = 0,
        cache_policy: str = "store",
        retention_priority: int = 0,
        stream_interval: int = 1,
        sink: ChunkSink | None = None,
        received_at: float | None = None,
    ) -> tuple[int, ChunkSink]:
        """Queue a request; its chunks arrive on `sink` (a new queue when None), which is
        returned (the last chunk has usage): the first token at once, then one chunk per
        `stream_interval` tokens. `received_at` (time.monotonic()): when the caller
        received it, for the admission time (EngineObserver)."""
        assert stream_interval >= 1, f"stream_interval must be >= 1, got {stream_interval}"
        seq = Sequence(
            next(self._sequence_ids),
            list(prompt_token_ids),
            params,
            self.scheduler.config.block_size,
            cache_salt,
            public_prefix_tokens,
            cache_policy,
            retention_priority,
        )
        req = _Request(
            seq,
            OutputText(decoder, params.stop),
            asyncio.Queue() if sink is None else sink,
            time.monotonic(),
            stream_interval,
        )
        if received_at is not None and self.observer is not None:
            self.observer.on_admission(max(0.0, req.arrival - received_at))
        self._requests[seq.sequence_id] = req
        self.runner.add_sequence(seq.sequence_id, params.seed)
        self.scheduler.add(seq)
        self._new_arrivals = True
        self._arrived.set()
        self._interrupt.set()
        # Company for the burst: a request that arrives while another is still in flight.
        # One sent after the last answer came back is a client going one at a time: counted,
        # it made each such request wait out a quiet spell (a quarter of the window, 5 ms)
        # whenever the one before took less than the window (tests/computed/test_engine.py).
        in_flight = len(self._requests) > 1
        if in_flight and time.monotonic() - self._burst_started <= self._admission_window:
            self._burst_size += 1
        self._wake.set()
        return seq.sequence_id, req.queue

    def abort(self, sequence_id: int) -> None:
        """Cancel a request (client went away): its blocks are released next step."""
        req = self._requests.get(sequence_id)
        if req is None:
            return
        self.scheduler.finish(req.seq, "cancelled")
        self._finish(req, "", stopped=True)
        self._interrupt.set()
        self._wake.set()

    @property
    def is_accepting(self) -> bool:
        return not self._draining

    @property
    def pool_id(self) -> str | None:
        """blockd's id of this worker's pool; None before the first registration."""
        lease = self._directory.lease
        return lease.pool_id if lease is not None else None

    @property
    def needs_recovery(self) -> bool:
        return self._directory.needs_recovery

    # --------------------------------------------------------------------- loop

    async def _loop(self) -> None:
        while not self._stopping.is_set():
            if not self.scheduler.has_work() and not self.needs_recovery and not self._has_reports():
                self._wake.clear()
                await self._wake.wait()
                continue
            started = time.monotonic()
            try:
                if self._new_arrivals and not self.scheduler.has_running():
                    await self._gather_arrivals()
                progressed = await self._iteration()
            except Exception:  # the loop must survive anything a step throws
                log.exception("engine_step_failed")
                await asyncio.sleep(0.1)
                progressed = False
            elapsed = time.monotonic() - started
            self.stats.busy_seconds += elapsed
            if self.observer is not None:
                self.observer.on_step(elapsed)
            if progressed:
                if self._compute.own_thread:
                    self._fed.clear()  # its loop served during the forward
                else:
                    await self._serve_between_steps()
            else:
                # Nothing could run (e.g. every admission deferred): let blocks free up.
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=0.01)
                except TimeoutError:
                    pass

    async def _serve_between_steps(self) -> None:
        """An inline forward (computed/compute_thread.py) awaits nothing, so the loop's other
        work (arrivals, health checks, stream writes) runs only here: a turn of the loop,
        and more while a reader has yet to take what this step sent it (a stream's reader
        needs a few turns a chunk; one turn a step left a 24-token stream's last 9 tokens
        to arrive together, tests/computed/test_engine.py). A lone streamed request's warm
        TTFT is the same as with the forward on its own thread (3.9-5.0 ms against
        4.6-6.4, 512-token prefix, medians of 55)."""
        fed, self._fed = self._fed, []
        await asyncio.sleep(0)
        if not fed:
            return
        for _ in range(_MAX_TURNS_BETWEEN_STEPS):
            if all(queue.empty() for queue in fed):
                break
            await asyncio.sleep(0)

    async def _gather_arrivals(self) -> None:
        """Requests arrived while none runs: if the last such burst had company (another
        request within the window of its first), wait while others keep arriving (none for
        a quarter of the window, or the whole window spent), so requests sent together start
        in one step; a client that sends one request at a time never waits. Arrivals after
        it are admitted by the next step as usual. Why: a chat client's 8 concurrent turns
        land over ~9 ms; the first ran a prefill step alone (50-90 ms) before the other 7
        joined (`make bench-peer`, chat). A burst as big as the last one is taken as in
        without the quiet spell (a chat's turns after its first, ~5 ms each). Only requests
        that arrive while one of the burst is in flight count as its company (`add_request`)."""
        self._new_arrivals = False
        now = time.monotonic()
        arrived = len(self.scheduler.waiting)  # nothing runs: these are the burst so far
        if arrived == 0:
            # The flag came from requests admitted while others ran: nothing to gather. (A
            # chat turn's last step used to wait out a quiet spell here, 5-7 ms, before its
            # releases went and the next turn's requests had even been sent.)
            return
        last_burst = self._burst_size
        gather = last_burst > 1 or arrived > 1
        self._burst_started, self._burst_size = now, max(1, arrived)
        if not gather or self._admission_window <= 0:
            return
        deadline = now + self._admission_window
        while not self._stopping.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (last_burst > 1 and len(self.scheduler.waiting) >= last_burst):
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=min(self._admission_window / 4, remaining))
            except TimeoutError:
                return  # a quiet spell: the burst is in

    async def _iteration(self) -> bool:
        if self.needs_recovery:
            await self._recover()
        ops = self.scheduler.plan_ops()
        if self._shared is not None:
            ops.shared_written, ops.shared_failed, ops.shared_missing = self._shared.take_reports()
        self.stats.num_steps += 1
        if ops.must_wait and not self.scheduler.running:  # nothing can step without the answer
            started = time.monotonic()
            result = await self._step(ops)
            self.stats.directory_wait_seconds += time.monotonic() - started
            if result is None:
                return False
            self.scheduler.apply_result(ops, result)
            held = self.scheduler.plan_held_admits()
            if held is not None:
                started = time.monotonic()
                again = await self._step(held)
                self.stats.directory_wait_seconds += time.monotonic() - started
                if again is not None:
                    self.scheduler.apply_result(held, again)
            await self._copy_blocks()
            chunks = self.scheduler.schedule()
            # The admitted sequences' next slots travel while their first forward runs.
            await self._forward_alongside(chunks, self.scheduler.plan_grows())
            return bool(chunks)
        # Admissions and urgent grows are planned a step ahead while others run: the running
        # sequences step as blockd answers (those short of a slot sit it out, `schedule`),
        # and the admitted ones start in the next step. Why: an admission Step held every
        # running row for its round trip (1-5 ms); on a GPU, idle device time.
        chunks = self.scheduler.schedule()
        await self._forward_alongside(chunks, ops)
        return bool(chunks) or not ops.is_empty

    async def _forward_alongside(self, chunks: list[ScheduledChunk], ops: DirectoryOps) -> None:
        """Run `chunks` while `ops` (none of them urgent) travel to blockd; blockd's answer
        is applied, and its copies made, after the forward and before the next one."""
        rpc = None if ops.is_empty else asyncio.create_task(self._step(ops))
        if rpc is not None and not self._compute.own_thread:
            # An inline forward holds the loop: let the request reach gRPC's core first (a
            # few turns: this task's start, the call's invoke task, the batch submit). A
            # chat run's wait for answers after the forwards: 123 ms (no turn) -> 83 (1)
            # -> 37 (3) -> 29 (6); shared, best of 3, three interleaved pairs: 1.03 / 1.03 /
            # 1.03 s -> 0.96 / 0.92 / 1.05 s (chat within noise).
            for _ in range(_RPC_SEND_TURNS):
                await asyncio.sleep(0)
        early: list[tuple[DirectoryOps, asyncio.Task[DirectoryResult | None]]] = []
        if chunks and self._compute.own_thread:
            await self._forward_admitting(chunks, early)
        elif chunks:
            await self._forward(chunks)
        if rpc is not None:
            await self._apply_answer(ops, rpc)  # usually done already: it travelled while the model ran
        # In the order they were sent (the Step stream answers in order): after `ops`.
        for admits, task in early:
            await self._apply_answer(admits, task)

    async def _apply_answer(self, ops: DirectoryOps, step: asyncio.Task[DirectoryResult | None]) -> None:
        """blockd's answer to `ops` (None: the Step failed, `_step` said so), then its copies."""
        started = time.monotonic()
        result = await step
        self.stats.directory_wait_seconds += time.monotonic() - started
        if result is not None:
            self.scheduler.apply_result(ops, result)
            await self._copy_blocks()

    async def _forward_admitting(
        self,
        chunks: list[ScheduledChunk],
        early: list[tuple[DirectoryOps, asyncio.Task[DirectoryResult | None]]],
    ) -> None:
        """`_forward` on the compute thread; requests that arrive meanwhile are admitted at
        once by admissions-only Steps, one in flight at a time (appended to `early`, in the
        order sent), so they join the next forward.

        Why: admitted by the next iteration's Step, sent alongside the next forward, they
        joined the forward after it, a whole step later: 45 ms of every arrival's time to
        first token while 1,040-token prompts were being computed (`bench.serving_http`,
        unrelated, 2 cores), where vLLM's scheduler, whose cache is in process, takes an
        arrival into its next step. Exact all the same: a request whose prefix a running
        sequence is still computing waits for it (`Scheduler.plan_arrivals`)."""
        forward = asyncio.ensure_future(self._forward(chunks))
        self._arrived.clear()
        sent: asyncio.Task[DirectoryResult | None] | None = None  # the early Step in flight
        wanted = False  # a request arrived since the last early Step was planned
        try:
            while not forward.done():
                arrival = asyncio.ensure_future(self._arrived.wait())
                waits = {forward, arrival} if sent is None or sent.done() else {forward, arrival, sent}
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                arrival.cancel()
                if self._arrived.is_set():
                    wanted = True
                    self._arrived.clear()
                # One early Step at a time: arrivals during its round trip go in the next.
                # None once blockd is unreachable: the next iteration recovers first.
                if forward.done() or not wanted or (sent is not None and not sent.done()):
                    continue
                if self.needs_recovery or (sent is not None and _failed(sent)):
                    continue
                wanted = False
                admits = self.scheduler.plan_arrivals()
                if admits is not None:
                    self.stats.num_early_admission_steps += 1
                    sent = asyncio.create_task(self._step(admits))
                    early.append((admits, sent))
        finally:
            if not forward.done():  # cancelled: the forward itself finishes on its thread
                forward.cancel()
        await forward

    async def _copy_blocks(self) -> None:
        """The copies blockd's answer owes, on the compute thread (they touch the pool),
        before the next forward and before the next Step can reuse blocks: device reads
        (host demotions, shared tier stores) before device writes (host loads, then
        shared tier fetches, awaited here: the forward reads them)."""
        plan = self.scheduler.take_copies()
        if not plan:
            return
        if plan.demotions or plan.loads or plan.stores:
            values = await self._compute.run(self.runner.copy_blocks, plan)
            num_blocks = len(plan.demotions) + len(plan.loads)
            self.stats.num_blocks_copied += num_blocks
            self.stats.num_bytes_copied += (
                num_blocks * self.runner.pool.num_bytes // self.runner.pool.num_blocks
            )
            if plan.stores and self._shared is not None:
                self._shared.start_write(values, plan.stores)
        if plan.fetches:
            await self._fetch_shared(plan)

    async def _fetch_shared(self, plan: CopyPlan) -> None:
        """Fetch the shared tier hits into their device blocks; a sequence whose fetch
        failed computes its tokens from the first failed block on."""
        shared = self._shared
        assert shared is not None, "blockd asked for shared tier fetches, but this worker has none"
        kvs = await shared.fetch([f.block for f in plan.fetches])
        first_failed: dict[int, int] = {}  # sequence id -> table index of its first failed block
        for fetch, kv in zip(plan.fetches, kvs):
            seq = fetch.seq
            expected = seq.token_ids[
                fetch.block_index * seq.block_size : (fetch.block_index + 1) * seq.block_size
            ]
            if kv is None or list(fetch.block.token_ids) != expected:
                index = first_failed.get(seq.sequence_id, fetch.block_index)
                first_failed[seq.sequence_id] = min(index, fetch.block_index)
        fetched = [
            (f.block.block_id, kv)
            for f, kv in zip(plan.fetches, kvs)
            if kv is not None and f.block_index < first_failed.get(f.seq.sequence_id, f.block_index + 1)
        ]
        if fetched:
            ids = [block_id for block_id, _ in fetched]
            data = [kv for _, kv in fetched]
            await self._compute.run(shared.apply_fetched, ids, data)
        for fetch in plan.fetches:
            index = first_failed.get(fetch.seq.sequence_id)
            if index is not None and fetch.block_index == index:
                self.scheduler.on_fetch_failed(fetch.seq, index)
                self.stats.num_shared_fetch_failures += 1

    def _has_reports(self) -> bool:
        return self._shared is not None and self._shared.has_reports

    def _on_registered(self) -> None:
        """The shared tier's keys carry the namespace id blockd answered."""
        if self._shared is not None:
            lease = self._directory.lease
            namespace = getattr(lease, "shared_namespace", "") if lease is not None else ""
            self._shared.namespace = bytes.fromhex(namespace) if namespace else None

    async def _step(self, ops: DirectoryOps) -> DirectoryResult | None:
        try:
            return await self._directory.step(ops)
        except DirectoryUnavailable as exc:
            log.warning("blockd_step_failed", error=str(exc))
            self.scheduler.on_step_failed(ops)
            return None

    async def _recover(self) -> None:
        self.stats.num_recoveries += 1
        started = time.monotonic()
        declared = self.scheduler.resync_sequences()
        await self._directory.recover(declared, self._stopping)
        if self._shared is not None:
            self._shared.forget_reports()  # the re-registered pool has no writes pending
        self._on_registered()
        self.scheduler.on_resynced(declared)
        self.stats.directory_wait_seconds += time.monotonic() - started

    async def _forward(self, chunks: list[ScheduledChunk]) -> None:
        """One forward call: a step, or a burst of decode steps back to back when the
        scheduler allows one (`Scheduler.decode_budgets`: rows leave as they end;
        arrivals and cancellations end it after its current step). A burst's steps come
        back one by one while the next runs (`_BurstSteps`), so streaming, stop checks and
        the scheduler's bookkeeping of step j overlap step j + 1 on the compute thread;
        each is taken as if it had been an iteration of its own."""
        batch = self.runner.prepare(chunks)
        budgets = self.scheduler.decode_budgets(chunks)
        started = time.monotonic()
        if self.observer is not None:
            self._first_forwards(chunks, started)
        burst = None if budgets is None else _BurstSteps(chunks, self._take_step, asyncio.get_running_loop())
        try:
            if burst is not None:
                self._interrupt.clear()
                stop_ids = [self.scheduler.stop_token_ids(chunk.seq) for chunk in chunks]
                await self._compute.run(
                    self.runner.run_steps, batch, budgets, stop_ids, self._interrupt, burst.deliver
                )
            else:
                sampled = await self._compute.run(self.runner.run, batch)
        except Exception:  # fail these requests, keep serving the others
            log.exception("forward_failed", sequences=[c.seq.sequence_id for c in chunks])
            for chunk in chunks:
                req = self._requests.get(chunk.seq.sequence_id)
                if chunk.seq.is_finished:
                    continue
                self.scheduler.finish(chunk.seq, "error")
                if req is not None:
                    self._finish(req, "error", stopped=True)
            return
        finally:
            self.stats.forward_seconds += time.monotonic() - started
        if burst is not None:
            burst.take()  # what an inline forward delivered, or what is still queued
        else:
            self._take_step(chunks, sampled)

    def _first_forwards(self, chunks: list[ScheduledChunk], started: float) -> None:
        """Stamp the requests whose first forward this is (their queue time). Only rows
        that have sampled nothing yet can be: a decode row costs one property read."""
        observer = self.observer
        assert observer is not None
        for chunk in chunks:
            seq = chunk.seq
            if seq.num_completion_tokens:
                continue
            req = self._requests.get(seq.sequence_id)
            if req is not None and req.first_forward_at is None:
                req.first_forward_at = started
                observer.on_queued(started - req.arrival)

    def _take_step(self, chunks: list[ScheduledChunk], sampled: list[int | None]) -> None:
        """One forward step's results, in order: counters, the scheduler's bookkeeping
        (K/V now in the pool, tokens appended, commits queued), then each new token out."""
        self.stats.num_forwards += 1
        for chunk in chunks:  # counted before on_forward_done appends the new tokens
            if chunk.seq.num_completion_tokens > 0:
                self.stats.num_decode_tokens += chunk.num_tokens
            else:
                self.stats.num_prefill_tokens += chunk.num_tokens
        for seq in self.scheduler.on_forward_done(chunks, sampled):
            self._emit(seq)

    # ------------------------------------------------------------------ outputs

    def _emit(self, seq: Sequence) -> None:
        req = self._requests.get(seq.sequence_id)
        if req is None:
            return
        first = req.first_token_at is None
        if first:
            req.first_token_at = time.monotonic()
            if self.observer is not None:
                self.observer.on_first_token(req.first_token_at - req.arrival)
                if req.first_forward_at is not None:
                    self.observer.on_prefill(req.first_token_at - req.first_forward_at)
        token = seq.token_ids[-1]
        # The stop token that ended the sequence is in its tokens (and logprobs), not its text.
        silent = seq.finish_reason == "stop" and token in self.scheduler.stop_token_ids(seq)
        # A held chunk needs its text only when it leaves: decode then (or at the end).
        text, hit_stop = req.output.push(
            token, defer=not req.sends_now(first) and not seq.is_finished, silent=silent
        )
        if hit_stop and not seq.is_finished:
            self.scheduler.finish(seq, "stop")
        req.send(token, text, first, *self._logprobs_of(seq, first))
        self._fed.append(req.queue)
        if seq.is_finished:
            self._finish(req, seq.finish_reason or "stop", stopped=hit_stop)

    def _logprobs_of(self, seq: Sequence, first: bool) -> tuple[tuple[TokenLogprobs, ...], tuple]:
        """The newest token's logprobs and, with the first token, the prompt's (when asked):
        the runner kept them (computed/prompt_logprobs.py)."""
        params = seq.params
        if params.logprobs is None and params.prompt_logprobs is None:
            return (), ()
        store = self.runner.logprobs
        entry = store.take(seq.sequence_id, seq.num_tokens - 1) if params.logprobs is not None else None
        prompt = ()
        if first and params.prompt_logprobs is not None:
            prompt = tuple(store.take_prompt(seq.sequence_id, seq.prompt_token_ids))
        return ((entry,) if entry is not None else ()), prompt

    def _finish(self, req: _Request, reason: str, stopped: bool) -> None:
        seq = req.seq
        self._requests.pop(seq.sequence_id, None)
        self.runner.remove_sequence(seq.sequence_id)
        reason = seq.finish_reason or reason
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        now = time.monotonic()
        usage = Usage(
            prompt_tokens=seq.num_prompt_tokens,
            cached_tokens=seq.num_cached_tokens or 0,
            completion_tokens=seq.num_completion_tokens,
            time_to_first_token_seconds=(req.first_token_at or now) - req.arrival,
            total_time_seconds=now - req.arrival,
            num_preemptions=seq.num_preemptions,
            host_cached_tokens=seq.num_host_cached_tokens,
            shared_cached_tokens=seq.num_shared_cached_tokens,
        )
        req.last(req.output.finish(stopped=stopped or reason == "cancelled"), reason, usage)
        self._fed.append(req.queue)
        if self.observer is not None and req.first_token_at is not None:
            n = seq.num_completion_tokens
            per_token = (now - req.first_token_at) / (n - 1) if n > 1 else None
            self.observer.on_finished(now - req.arrival, per_token)


def _failed(step: asyncio.Task[DirectoryResult | None]) -> bool:
    """A finished Step that got no answer (its error, if any, is raised where it is awaited)."""
    return step.cancelled() or step.exception() is not None or step.result() is None


class _BurstSteps:
    """A burst's steps as the compute thread delivers them, taken on the event loop.

    `deliver` (compute thread) queues step j's rows and tokens and wakes the loop; `take`
    (loop) takes every queued step in order: the chunks of the rows that ran step j are
    the burst's chunks j positions further. Invariant: steps are taken in the order they
    ran, each once, and all of them before `Engine._forward` returns (it calls `take`
    after the forward, which also serves an inline compute thread, whose wake-ups run
    only later).
    """

    def __init__(
        self,
        chunks: list[ScheduledChunk],
        take_step: Callable[[list[ScheduledChunk], list[int | None]], None],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._chunks = chunks
        self._take_step = take_step
        self._loop = loop
        self._queued: collections.deque[tuple[list[int], list[int]]] = collections.deque()
        self._num_taken = 0

    def deliver(self, rows: list[int], tokens: list[int]) -> None:
        self._queued.append((rows, tokens))
        self._loop.call_soon_threadsafe(self.take)

    def take(self) -> None:
        while self._queued:
            rows, tokens = self._queued.popleft()
            j = self._num_taken
            self._num_taken += 1
            chunks = [self._chunks[r] for r in rows]
            if j > 0:  # step j of a burst fed the token step j - 1 sampled
                chunks = [
                    c._replace(start=c.start + j, end=c.end + j, write_from=c.write_from + j) for c in chunks
                ]
            self._take_step(chunks, list(tokens))
