"""The engine, fake-free: real Scheduler, real tiny model runner, blockd's real core.

The directory is `InProcessDirectory` (blockd's `BlockDirectory` behind computed's
`Directory` protocol), so these tests check what only the assembled step loop does:
a repeated prompt is served from cache with the same greedy tokens, blocks go back
to blockd when requests finish or are cancelled, and a failed Step is recovered.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import pytest
import torch

from blockd.directory import BlockDirectory
from computed.attention import SpanInput
from computed.compute_thread import ComputeThread
from computed.engine import Engine, GenerationChunk
from computed.host_kv import HostKV
from computed.kv_pool import KVPool
from computed.model import load_model
from computed.model_runner import ForwardInput, ModelRunner
from computed.scheduler import Scheduler, SchedulerConfig
from computed.sequence import SamplingParams
from tests.computed.inprocess_directory import InProcessDirectory
from tests.models import TinyModels

BLOCK = 4
NUM_BLOCKS = 64
PROMPT = [11 + 7 * i % 300 for i in range(18)]  # 4 full blocks and 2 tokens


class SilentDecoder:
    """Token ids are what these tests check; text is not."""

    def push(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


def build(
    tiny_models: TinyModels,
    num_blocks: int = NUM_BLOCKS,
    num_host_blocks: int = 0,
    admission_window: float = 0.0,
    compute: ComputeThread | None = None,
    decode_steps: int = 1,
) -> tuple[Engine, InProcessDirectory]:
    loaded = load_model(tiny_models.get("llama"), torch.device("cpu"), torch.float32)
    c = loaded.config
    pool = KVPool(
        c.num_layers, num_blocks, BLOCK, c.num_kv_heads, c.head_dim, torch.float32, torch.device("cpu")
    )
    host = HostKV(pool, num_host_blocks) if num_host_blocks else None
    runner = ModelRunner(loaded.model, pool, BLOCK, torch.device("cpu"), host)
    scheduler = Scheduler(
        SchedulerConfig(
            block_size=BLOCK, num_blocks=num_blocks, max_model_len=256, decode_steps=decode_steps
        ),
        eos_token_ids=(),
    )
    directory = InProcessDirectory(BlockDirectory(), num_blocks, BLOCK, num_host_blocks=num_host_blocks)
    return Engine(scheduler, runner, directory, admission_window=admission_window, compute=compute), directory


async def generate(
    engine: Engine,
    prompt: list[int],
    max_tokens: int,
    stream_interval: int = 1,
    stop_token_ids: tuple[int, ...] = (),
    decoder=None,
) -> list[GenerationChunk]:
    _, queue = engine.add_request(
        prompt,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stop_token_ids),
        decoder or SilentDecoder(),
        stream_interval=stream_interval,
    )
    chunks = [await asyncio.wait_for(queue.get(), timeout=30)]
    while chunks[-1].finish_reason is None:
        chunks.append(await asyncio.wait_for(queue.get(), timeout=30))
    return chunks


def token_ids(chunks: list[GenerationChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def num_referenced_blocks(directory: InProcessDirectory) -> int:
    return directory.directory.stats().total.num_referenced_blocks


async def settle(engine: Engine) -> None:
    """Let the loop ship the last releases (they ride on the next Step)."""
    for _ in range(200):
        if not engine.scheduler.has_work():
            # The Step carrying them left the scheduler; a few loop turns let it land.
            await asyncio.sleep(0.05)
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the engine kept work pending")


def test_second_identical_prompt_is_served_from_cache(tiny_models: TinyModels) -> None:
    async def run() -> None:
        engine, directory = build(tiny_models)
        await engine.start()
        try:
            assert engine.pool_id == directory.lease.pool_id
            cold = await generate(engine, PROMPT, max_tokens=6)
            await settle(engine)
            assert num_referenced_blocks(directory) == 0, "a finished request keeps blocks referenced"
            warm = await generate(engine, PROMPT, max_tokens=6)
            await settle(engine)
        finally:
            await engine.stop(drain_seconds=1)
        assert cold[-1].usage.cached_tokens == 0 and warm[-1].usage.cached_tokens == 16
        assert cold[-1].finish_reason == warm[-1].finish_reason == "length"
        assert token_ids(warm) == token_ids(cold), "the cached prefix changed the greedy tokens"
        assert num_referenced_blocks(directory) == 0
        assert engine.stats.num_prefill_tokens < 2 * len(PROMPT), "the warm prompt was recomputed"

    asyncio.run(run())


@pytest.mark.parametrize(
    ("interval", "sizes"),
    [(1, [1, 1, 1, 1, 1, 1, 1, 0]), (3, [1, 3, 3, 0]), (4, [1, 4, 2]), (1000, [1, 6])],
)
def test_stream_interval_groups_tokens_after_the_first(
    tiny_models: TinyModels, interval: int, sizes: list[int]
) -> None:
    """The first token comes alone (time to first token), then one chunk per `interval`
    tokens; the last chunk carries what is left with usage; the tokens are the same."""

    async def run() -> tuple[list[GenerationChunk], list[GenerationChunk]]:
        engine, _ = build(tiny_models)
        await engine.start()
        try:
            every = await generate(engine, PROMPT, max_tokens=7)
            grouped = await generate(engine, PROMPT, max_tokens=7, stream_interval=interval)
        finally:
            await engine.stop(drain_seconds=1)
        return every, grouped

    every, grouped = asyncio.run(run())
    assert [len(c.token_ids) for c in grouped] == sizes
    assert token_ids(grouped) == token_ids(every)
    assert grouped[-1].usage is not None and grouped[-1].usage.completion_tokens == 7
    assert all(c.finish_reason is None for c in grouped[:-1])


def test_a_prefix_evicted_to_the_host_tier_comes_back_with_the_same_tokens(tiny_models: TinyModels) -> None:
    other = [301 + 5 * i % 200 for i in range(26)]  # needs every device block: evicts PROMPT's

    async def run() -> None:
        engine, directory = build(tiny_models, num_blocks=8, num_host_blocks=16)
        await engine.start()
        try:
            cold = await generate(engine, PROMPT, max_tokens=6)
            await settle(engine)
            await generate(engine, other, max_tokens=4)
            await settle(engine)
            assert directory.directory.lookup(PROMPT)[0].num_host_cached_tokens == 16, (
                "PROMPT was not demoted"
            )
            warm = await generate(engine, PROMPT, max_tokens=6)
            await settle(engine)
        finally:
            await engine.stop(drain_seconds=1)
        assert warm[-1].usage.cached_tokens == 16 and warm[-1].usage.host_cached_tokens == 16
        assert token_ids(warm) == token_ids(cold), "the host tier changed the greedy tokens"
        host = directory.directory.stats().total.host
        assert host.num_loads == 4 and host.num_demotions >= 4 and host.num_referenced_blocks == 0
        assert num_referenced_blocks(directory) == 0
        # Loaded blocks were committed after the copy: findable in the device pool again.
        match = directory.directory.lookup(PROMPT)[0]
        assert (match.num_cached_tokens, match.num_host_cached_tokens) == (16, 0)

    asyncio.run(run())


def test_cancelled_request_releases_its_blocks(tiny_models: TinyModels) -> None:
    async def run() -> None:
        engine, directory = build(tiny_models)
        await engine.start()
        try:
            sequence_id, queue = engine.add_request(
                PROMPT, SamplingParams(max_tokens=200, ignore_eos=True), SilentDecoder()
            )
            first = await asyncio.wait_for(queue.get(), timeout=30)
            assert first.token_ids and num_referenced_blocks(directory) > 0
            engine.abort(sequence_id)
            await settle(engine)
            assert num_referenced_blocks(directory) == 0, "a cancelled request keeps blocks referenced"
            last = first
            while last.finish_reason is None:
                last = queue.get_nowait()
            assert last.finish_reason == "cancelled"
        finally:
            await engine.stop(drain_seconds=1)

    asyncio.run(run())


@pytest.mark.parametrize("failure", ["step_fails", "blockd_restarts"])
def test_lost_directory_is_recovered_once_and_requests_finish(tiny_models: TinyModels, failure: str) -> None:
    async def run() -> None:
        engine, directory = build(tiny_models)
        await engine.start()
        try:
            reference = await generate(engine, PROMPT, max_tokens=4)
            await settle(engine)
            if failure == "step_fails":
                directory.fail_next_step()
            else:
                directory.restart_blockd()
            again = await generate(engine, PROMPT, max_tokens=4)
            await settle(engine)
        finally:
            await engine.stop(drain_seconds=1)
        assert token_ids(again) == token_ids(reference)
        assert engine.stats.num_recoveries == 1 and not engine.needs_recovery
        assert directory.num_recoveries == 2  # the start counts as the first
        assert num_referenced_blocks(directory) == 0

    asyncio.run(run())


@pytest.mark.parametrize("window", [0.0, 0.3])
def test_a_burst_of_requests_starts_in_one_step(tiny_models: TinyModels, window: float) -> None:
    """Requests sent together land a few ms apart. With an admission window, once a burst
    has been seen, the first step after idling waits for the next burst's requests (none
    came for a quarter of the window) and they start in one step; a request sent alone
    never waits. Without a window, the first request's step runs alone."""

    async def run() -> list[list[int]]:
        engine, _ = build(tiny_models, admission_window=window)
        rows: list[int] = []
        forward = engine.runner.run

        def counted(inp):
            rows.append(inp.num_chunks)
            time.sleep(0.005)  # a burst's first request is still in flight when the others land
            return forward(inp)

        engine.runner.run = counted
        firsts = []
        await engine.start()
        try:
            for burst in range(3):
                rows.clear()
                tasks = []
                for i in range(3 if burst < 2 else 1):  # distinct first blocks: none waits for a prefix
                    prompt = [40 + 3 * burst + i, *PROMPT[1:]]
                    max_tokens = 16 if burst < 2 else 2
                    tasks.append(asyncio.create_task(generate(engine, prompt, max_tokens=max_tokens)))
                    await asyncio.sleep(0.02)
                await asyncio.gather(*tasks)
                await settle(engine)
                firsts.append(list(rows))
        finally:
            await engine.stop(drain_seconds=1)
        return firsts

    first_burst, second_burst, alone = asyncio.run(run())
    assert first_burst[0] == 1, first_burst  # nothing seen yet: the first request goes at once
    assert second_burst[0] == (3 if window else 1), second_burst
    assert alone == [1, 1], alone  # a lone request: its prefill step, then its decode step


def test_a_burst_as_big_as_the_last_starts_without_a_quiet_spell(tiny_models: TinyModels) -> None:
    """Once a burst of 3 was seen, the next burst's third request starts the step at once:
    it does not wait out a quarter of the window (75 ms here) for a fourth."""

    async def run() -> float:
        engine, _ = build(tiny_models, admission_window=0.3)
        started: list[float] = []
        forward = engine.runner.run

        def timed(inp):
            started.append(time.monotonic())
            time.sleep(0.005)  # the burst's first request is still in flight when the others land
            return forward(inp)

        engine.runner.run = timed
        await engine.start()
        try:
            for burst in range(2):
                started.clear()
                tasks = []
                for i in range(3):
                    prompt = [60 + 3 * burst + i, *PROMPT[1:]]
                    tasks.append(asyncio.create_task(generate(engine, prompt, max_tokens=16)))
                    sent = time.monotonic()
                    await asyncio.sleep(0.02)
                await asyncio.gather(*tasks)
                await settle(engine)
        finally:
            await engine.stop(drain_seconds=1)
        return started[0] - sent

    waited = asyncio.run(run())
    assert waited < 0.05, f"the full burst waited {waited * 1e3:.0f} ms for more"


def test_requests_sent_one_after_another_never_wait(tiny_models: TinyModels) -> None:
    """A client that sends each request when the last one's answer came back is not a burst,
    however soon it sends: with a window of 300 ms, each request's first forward starts at
    once, not after a quiet spell of 75 ms (each request here is over well within the
    window, so the old rule took the next one as the first one's company)."""

    async def run() -> list[float]:
        engine, _ = build(tiny_models, admission_window=0.3)
        started: list[float] = []
        forward = engine.runner.run

        def timed(inp):
            started.append(time.monotonic())
            return forward(inp)

        engine.runner.run = timed
        waits = []
        await engine.start()
        try:
            for i in range(4):
                started.clear()
                sent = time.monotonic()
                await generate(engine, [80 + i, *PROMPT[1:]], max_tokens=1)
                waits.append(started[0] - sent)
        finally:
            await engine.stop(drain_seconds=1)
        return waits

    waits = asyncio.run(run())
    assert max(waits) < 0.05, f"sequential requests waited {[round(w * 1e3) for w in waits]} ms"


def test_no_gathering_without_a_waiting_request(tiny_models: TinyModels) -> None:
    """The arrival flag can outlive its requests (they were admitted while others ran):
    with nothing waiting, the engine does not sit out a quiet spell (a quarter of the
    window, 75 ms here), and the last burst's size stays, so the next burst still gathers."""

    async def run() -> tuple[float, int]:
        engine, _ = build(tiny_models, admission_window=0.3)
        engine._burst_size, engine._new_arrivals = 3, True
        started = time.monotonic()
        await engine._gather_arrivals()
        return time.monotonic() - started, engine._burst_size

    waited, burst = asyncio.run(run())
    assert waited < 0.03, waited
    assert burst == 3


def test_the_loop_serves_between_steps(tiny_models: TinyModels) -> None:
    """With the forward on the loop's thread (`--forward-on loop`), it awaits nothing, so the
    engine yields after each step: a streamed token reaches its reader before the next step runs, not in a
    burst when the engine next waits for blockd (or at the end)."""

    async def run() -> list[int]:
        engine, _ = build(tiny_models, compute=ComputeThread(own_thread=False))
        await engine.start()
        try:
            _, queue = engine.add_request(
                PROMPT, SamplingParams(max_tokens=24, ignore_eos=True), SilentDecoder(), stream_interval=1
            )
            steps = []
            while True:
                chunk = await queue.get()  # as a stream's handler reads (no wait_for task between)
                steps.append(engine.stats.num_steps)
                if chunk.finish_reason is not None:
                    return steps
        finally:
            await engine.stop(0)

    steps = asyncio.run(asyncio.wait_for(run(), timeout=60))  # at each chunk's arrival
    # The last two chunks (the last token, the finish) come from one step.
    assert len(steps) == 25
    assert all(a < b for a, b in itertools.pairwise(steps[:-1])), f"tokens arrived in bursts: steps {steps}"


def test_a_request_that_arrives_during_a_forward_joins_the_next_one(tiny_models: TinyModels) -> None:
    """With the forward on its own thread, a request that arrives while it runs is admitted
    at once (an admissions-only Step) and computed by the very next forward; admitted by
    the next iteration's Step instead, it joined the forward after that one."""

    async def run() -> tuple[list[int], int, int, list[int], list[int]]:
        engine, directory = build(tiny_models)
        rows: list[int] = []
        forward = engine.runner.run

        def slow(inp):
            rows.append(inp.num_chunks)
            time.sleep(0.05)  # long enough for the arrival below to land inside it
            return forward(inp)

        engine.runner.run = slow
        await engine.start()
        try:
            first = asyncio.create_task(generate(engine, PROMPT, max_tokens=12))
            while len(rows) < 3:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.02)  # inside the third forward
            running = len(rows)
            second = asyncio.create_task(generate(engine, [90, *PROMPT[1:]], max_tokens=3))
            a, b = await asyncio.gather(first, second)
            await settle(engine)
            assert num_referenced_blocks(directory) == 0
        finally:
            await engine.stop(drain_seconds=1)
        return rows, running, engine.stats.num_early_admission_steps, token_ids(a), token_ids(b)

    rows, running, early, a, b = asyncio.run(asyncio.wait_for(run(), timeout=60))
    assert rows.index(2) == running, f"forwards' rows {rows}; the second arrived during forward {running}"
    assert early == 1
    alone = asyncio.run(_alone(tiny_models, [90, *PROMPT[1:]], 3))
    assert b == alone and len(a) == 12, "joining early changes no token"


async def _alone(tiny_models: TinyModels, prompt: list[int], max_tokens: int) -> list[int]:
    engine, _ = build(tiny_models)
    await engine.start()
    try:
        return token_ids(await generate(engine, prompt, max_tokens=max_tokens))
    finally:
        await engine.stop(drain_seconds=1)


def test_a_forward_thread_engine_keeps_no_record_of_fed_queues(tiny_models: TinyModels) -> None:
    """The queues a step fed are tracked for the turns between inline steps only: with the
    forward on its own thread (the default) the record is cleared every step, not grown."""

    async def run() -> int:
        engine, _ = build(tiny_models, compute=ComputeThread(own_thread=True))
        await engine.start()
        try:
            await generate(engine, PROMPT, max_tokens=12)
            return len(engine._fed)
        finally:
            await engine.stop(0)

    assert asyncio.run(run()) <= 2  # at most the last step's two chunks (last token, finish)


def test_decode_bursts_give_the_tokens_and_finishes_of_single_steps(tiny_models: TinyModels) -> None:
    """Decode steps run back to back in one forward call (`decode_steps`) change nothing a
    client sees: the same greedy tokens, the same finish reasons, a stop token inside a
    burst ends its request there, and every block goes back."""
    prompts = [PROMPT, PROMPT[:9] + [5, 6, 7], [3 + 2 * i for i in range(13)]]
    max_tokens = [21, 17, 9]

    async def run(decode_steps: int, stops: list[tuple[int, ...]]):
        engine, directory = build(tiny_models, decode_steps=decode_steps)
        await engine.start()
        try:
            outs = await asyncio.gather(
                *(generate(engine, p, m, stop_token_ids=s) for p, m, s in zip(prompts, max_tokens, stops))
            )
            await settle(engine)
            held = num_referenced_blocks(directory)
        finally:
            await engine.stop(drain_seconds=1)
        return [(token_ids(o), o[-1].finish_reason) for o in outs], engine.stats, held

    free, _, _ = asyncio.run(run(1, [(), (), ()]))
    tokens = free[1][0]
    # A stop token for the second request: its first new value after the third token.
    at = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])
    stops = [(), (tokens[at],), ()]
    single, single_stats, _ = asyncio.run(run(1, stops))
    burst, burst_stats, held = asyncio.run(run(8, stops))
    assert single[1] == (tokens[: at + 1], "stop")
    assert burst == single
    assert held == 0
    assert single_stats.num_forwards <= single_stats.num_steps
    assert burst_stats.num_forwards > 2 * burst_stats.num_steps, "no decode steps ran back to back"
    assert burst_stats.num_decode_tokens == single_stats.num_decode_tokens


class CharDecoder:
    """Each token id is one character: enough to see which tokens' text a client gets."""

    def push(self, token_id: int) -> str:
        return chr(0x100 + token_id)

    def flush(self) -> str:
        return ""


def test_the_stop_token_that_ends_a_completion_is_in_its_tokens_not_its_text(tiny_models: TinyModels) -> None:
    """vLLM's rule (`include_stop_str_in_output` false): the stop token id that ended the
    completion is returned among its token ids, and none of its text is (both with one
    chunk a token and with tokens held for a later chunk)."""

    async def run(stop_token_ids: tuple[int, ...], stream_interval: int) -> list[GenerationChunk]:
        engine, _ = build(tiny_models)
        await engine.start()
        try:
            return await generate(engine, PROMPT, 12, stream_interval, stop_token_ids, CharDecoder())
        finally:
            await engine.stop(0)

    free = token_ids(asyncio.run(run((), 1)))
    at = next(i for i in range(2, len(free)) if free[i] not in free[:i])  # a first occurrence
    for stream_interval in (1, 4):
        chunks = asyncio.run(run((free[at],), stream_interval))
        assert token_ids(chunks) == free[: at + 1] and chunks[-1].finish_reason == "stop"
        assert "".join(c.text for c in chunks) == "".join(chr(0x100 + t) for t in free[:at])


def test_a_burst_is_the_steps_run_one_by_one_and_ends_at_an_interrupt_or_a_stop(
    tiny_models: TinyModels,
) -> None:
    engine, _ = build(tiny_models)
    runner = engine.runner
    a, b = PROMPT, [5 + 3 * i for i in range(9)]
    tables = [list(range(10)), list(range(10, 20))]  # 40 slots each
    params = [SamplingParams(max_tokens=16)] * 2
    prefill = ForwardInput(
        a + b,
        [SpanInput(tables[0], 0, len(a), True), SpanInput(tables[1], 0, len(b), True)],
        [len(a) - 1, len(a) + len(b) - 1],
        [0, 1],
        params,
        [1, 2],
        2,
    )
    first = runner.run(prefill)
    decode = ForwardInput(
        first,
        [SpanInput(tables[0], len(a), 1, True), SpanInput(tables[1], len(b), 1, True)],
        [0, 1],
        [0, 1],
        params,
        [1, 2],
        2,
    )
    one_by_one, inp = [], decode
    for _ in range(6):
        one_by_one.append(runner.run(inp))
        inp = inp.next_decode(one_by_one[-1])
    never = [frozenset[int]()] * 2
    delivered: list[tuple[list[int], list[int]]] = []
    steps = runner.run_steps(decode, 6, never, threading.Event(), lambda *step: delivered.append(step))
    assert steps == one_by_one
    assert delivered == [([0, 1], step) for step in one_by_one], "each step delivered as it ran, in order"
    # Step j is handed over just before step j + 1's forward (its streaming overlaps that
    # forward), the last one before the burst returns.
    events: list[str] = []
    forward, plan = runner._run, runner._plan

    def traced_forward(inp: ForwardInput, batch: object) -> list[int | None]:
        events.append("forward")
        return forward(inp, batch)

    def traced_plan(inp: ForwardInput, previous: object) -> object:
        events.append("plan")
        return plan(inp, previous)

    runner._run, runner._plan = traced_forward, traced_plan  # type: ignore[method-assign]
    try:
        runner.run_steps(decode, 3, never, threading.Event(), lambda *step: events.append("deliver"))
    finally:
        del runner._run, runner._plan
    assert events == [
        "plan",
        "forward",
        "plan",
        "deliver",
        "forward",
        "plan",
        "deliver",
        "forward",
        "deliver",
    ]
    # A step that ran is delivered even when planning the next one fails.
    delivered.clear()
    calls = iter([False, True])

    def failing_plan(inp: ForwardInput, previous: object) -> object:
        if next(calls):
            raise RuntimeError("no plan")
        return plan(inp, previous)

    runner._plan = failing_plan  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError, match="no plan"):
            runner.run_steps(decode, 3, never, threading.Event(), lambda *step: delivered.append(step))
    finally:
        del runner._plan
    assert delivered == [([0, 1], one_by_one[0])]
    interrupted = threading.Event()
    interrupted.set()
    assert runner.run_steps(decode, 6, never, interrupted) == one_by_one[:1]
    # A row that samples a stop token leaves; the other runs on, its tokens unchanged.
    row_b = [step[1] for step in one_by_one]
    at = next(i for i in range(1, 6) if row_b[i] not in row_b[:i])
    stops = [frozenset[int](), frozenset({row_b[at]})]
    left = [[a, b if j <= at else None] for j, (a, b) in enumerate(one_by_one)]
    assert runner.run_steps(decode, 6, stops, threading.Event()) == left
    # So does a row whose budget is spent; a burst ends when no row is left.
    assert runner.run_steps(decode, [2, 4], never, threading.Event()) == [
        [a, b if j < 4 else None] if j < 2 else [None, b] for j, (a, b) in enumerate(one_by_one[:4])
    ]


class PhaseRecorder:
    """An EngineObserver that keeps every call, in order, as (hook, values...)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_step(self, seconds: float) -> None:
        pass

    def on_admission(self, seconds: float) -> None:
        self.calls.append(("admission", seconds))

    def on_queued(self, seconds: float) -> None:
        self.calls.append(("queued", seconds))

    def on_first_token(self, seconds: float) -> None:
        self.calls.append(("first_token", seconds))

    def on_prefill(self, seconds: float) -> None:
        self.calls.append(("prefill", seconds))

    def on_finished(self, seconds: float, per_output_token: float | None) -> None:
        self.calls.append(("finished", seconds, per_output_token))


def test_each_request_reports_its_phases_once_in_order(tiny_models: TinyModels) -> None:
    """Admission (only when the caller says when it received the request), queue, first
    token = queue + prefill, then the total and the time per output token after the first
    (none for a one-token completion)."""

    async def run() -> None:
        engine, _ = build(tiny_models)
        recorder = PhaseRecorder()
        engine.observer = recorder
        await engine.start()
        try:
            received = time.monotonic() - 0.25  # as if parsing and tokenizing took 0.25 s
            _, queue = engine.add_request(
                PROMPT, SamplingParams(max_tokens=6, ignore_eos=True), SilentDecoder(), received_at=received
            )
            while (await asyncio.wait_for(queue.get(), timeout=30)).finish_reason is None:
                pass
            first_calls = list(recorder.calls)
            await generate(engine, PROMPT[:5], max_tokens=1)
            await settle(engine)
        finally:
            await engine.stop(drain_seconds=1)

        kinds = [c[0] for c in first_calls]
        assert kinds == ["admission", "queued", "first_token", "prefill", "finished"], kinds
        admission, queued, first, prefill, finished = (c[1] for c in first_calls)
        assert 0.25 <= admission < 5.0
        assert abs(first - (queued + prefill)) < 1e-6, (
            "time to first token is the queue time plus the prefill"
        )
        assert min(queued, prefill) >= 0 and finished >= first
        per_token = first_calls[-1][2]
        assert per_token is not None and 0 < per_token <= finished - first
        second = recorder.calls[len(first_calls) :]
        assert [c[0] for c in second] == ["queued", "first_token", "prefill", "finished"], second
        assert second[-1][2] is None, "a one-token completion has no time per output token"

    asyncio.run(run())
