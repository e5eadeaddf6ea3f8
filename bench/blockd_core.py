"""Core hot path: admit + release of a 4,096-token prompt (256 blocks of 16), in-process.

cold: every prompt is new (all 256 blocks miss, are allocated, then freed);
warm: the prompt is cached (all 256 blocks are hashed, verified and referenced).
Both go through `BlockDirectory.step`, validation included, with the tokens as a Python
list; "warm, protobuf tokens" passes them as the parsed repeated field the gRPC servicer
hands over for a varint Step (converted through numpy), "warm, packed" as the uint32
bytes computed sends (`token_bytes`, no conversion).
Goal: median <= 100 us per warm admit + release of what computed sends, on the build the
daemon runs: `main` measures each build of the core in its own process
(bench.core_builds).

Side by side, the two wire forms of a Step as the servicer handles them (bytes parsed,
converted, applied): varint token_ids with commits that resend their tokens, against
packed token_bytes with commits by block index.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

from bench import core_builds
from blockd import native
from blockd.directory import BlockDirectory
from blockd.hashing import DEFAULT_HASHER, namespace_seed, token_bytes
from blockd.types import AdmitOp, CommitOp, Namespace, ReleaseOp
from kvcache.v1 import directory_pb2 as pb

PROMPT_TOKENS = 4096
BLOCK_SIZE = 16
GOAL_US = 100.0


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def measure(quick: bool = False) -> dict:
    """The figures, on whichever build of the core this process imported."""
    iterations = 300 if quick else 3000
    rng = random.Random(0)
    prompt = [rng.randrange(128_000) for _ in range(PROMPT_TOKENS)]
    directory = BlockDirectory()
    reg = directory.register_pool(4 * PROMPT_TOKENS // BLOCK_SIZE, BLOCK_SIZE, Namespace("bench"), "bench:0")
    pool_id, epoch = reg.pool_id, reg.epoch

    def admit_release(sequence_id: int, tokens, packed: bytes = b"") -> tuple[float, int]:
        start = time.perf_counter()
        op = AdmitOp(sequence_id, tokens, token_bytes=packed)
        result = directory.step(pool_id, epoch, admits=[op]).admits[0]
        directory.step(pool_id, epoch, releases=[ReleaseOp(sequence_id)])
        return time.perf_counter() - start, result.num_cached_tokens

    gc.collect()
    cold = []
    for i in range(iterations):
        tokens = prompt.copy()
        tokens[0] = 200_000 + i  # a new first block: nothing hits
        seconds, cached = admit_release(i, tokens)
        assert cached == 0
        cold.append(seconds)

    first = directory.step(pool_id, epoch, admits=[AdmitOp(10**9, prompt)]).admits[0]
    directory.step(
        pool_id, epoch, commits=[CommitOp(10**9, first.block_ids, prompt)], releases=[ReleaseOp(10**9)]
    )
    warm = []
    for i in range(iterations):
        seconds, cached = admit_release(10**6 + i, prompt)
        assert cached == PROMPT_TOKENS
        warm.append(seconds)

    wire_tokens = pb.AdmitOp.FromString(pb.AdmitOp(token_ids=prompt).SerializeToString()).token_ids
    warm_pb = []
    for i in range(iterations):
        seconds, cached = admit_release(2 * 10**6 + i, wire_tokens)
        assert cached == PROMPT_TOKENS
        warm_pb.append(seconds)

    packed = token_bytes(prompt)  # what computed sends (its directory client's compact Steps)
    warm_packed = []
    for i in range(iterations):
        seconds, cached = admit_release(3 * 10**6 + i, (), packed)
        assert cached == PROMPT_TOKENS
        warm_packed.append(seconds)

    # Where warm time goes: converting the token list once, and hashing 256 blocks.
    seed = namespace_seed(Namespace("bench"), BLOCK_SIZE)
    data = token_bytes(prompt)
    convert = [_timed(lambda: token_bytes(prompt)) for _ in range(iterations)]
    hashing = [_timed(lambda: DEFAULT_HASHER.chain(seed, data, BLOCK_SIZE)) for _ in range(iterations)]

    wire = _wire_forms(iterations // 3, rng)
    figures = {
        **wire,
        "cold_admit_release_us": round(_median_us(cold), 1),
        "warm_admit_release_us": round(_median_us(warm), 1),
        "warm_p99_us": round(statistics.quantiles(warm, n=100)[98] * 1e6, 1),
        "warm_protobuf_tokens_us": round(_median_us(warm_pb), 1),
        "warm_packed_admit_release_us": round(_median_us(warm_packed), 1),
        "token_conversion_us": round(_median_us(convert), 1),
        "hash_256_blocks_us": round(_median_us(hashing), 1),
        "goal_us": GOAL_US,
    }
    figures["warm_over_cold"] = round(figures["warm_admit_release_us"] / figures["cold_admit_release_us"], 2)
    figures["warm_over_goal"] = round(figures["warm_admit_release_us"] / GOAL_US, 2)
    print(
        f"blockd core ({'compiled' if native.is_enabled() else 'pure'}), {PROMPT_TOKENS}-token prompt "
        f"({PROMPT_TOKENS // BLOCK_SIZE} blocks), {iterations} iterations, median per admit+release:"
    )
    print(f"  cold (all miss): {figures['cold_admit_release_us']:8.1f} us")
    print(f"  warm (all hit):  {figures['warm_admit_release_us']:8.1f} us  (p99 {figures['warm_p99_us']} us)")
    print(f"  warm, protobuf tokens: {figures['warm_protobuf_tokens_us']:8.1f} us")
    print(
        f"  warm, packed token bytes (what computed sends): {figures['warm_packed_admit_release_us']:8.1f} us"
    )
    print(
        f"    of which token list -> bytes {figures['token_conversion_us']} us, "
        f"256 xxh3 chain hashes {figures['hash_256_blocks_us']} us"
    )
    print(
        f"  warm / cold = {figures['warm_over_cold']}x; warm / goal ({GOAL_US:.0f} us) = "
        f"{figures['warm_over_goal']}x"
    )
    print(
        f"  wire form of one admission's Steps (admit 4,096 tokens; commit 128 blocks, release), "
        f"parsed + converted to token bytes, interleaved: varint token_ids + commit with tokens "
        f"{figures['varint_step_us']} us ({figures['varint_step_bytes']} B), packed token_bytes + commit "
        f"by index {figures['packed_step_us']} us ({figures['packed_step_bytes']} B); varint / packed = "
        f"{figures['varint_over_packed']}x"
    )
    return figures


def main(quick: bool = False) -> dict:
    """`measure` in a fresh process per build of the core (bench.core_builds), the daemon's
    first: its figures are the headline ("core" says which build), the pure core's warm
    figure beside them where the compiled one exists. In the process that runs every
    benchmark the pure modules are usually imported already, and measuring there had
    reported the pure core's figure as the daemon's (313 us in BENCHMARKS.md before this
    ran in a child; measured one after the other on this 2-core machine: compiled 96 us,
    pure 211)."""
    builds = core_builds.builds()
    found = {build: core_builds.in_child(build, "bench.blockd_core", f"measure({quick})") for build in builds}
    figures = dict(found[builds[0]])
    figures["core"] = builds[0]
    if "compiled" in found:
        figures["pure_warm_admit_release_us"] = found["pure"]["warm_admit_release_us"]
        figures["pure_cold_admit_release_us"] = found["pure"]["cold_admit_release_us"]
    return figures


def _wire_forms(iterations: int, rng: random.Random) -> dict:
    """What the wire form costs blockd per admission, side by side: the Step bytes of
    one admission (a 4,096-token prompt) and of its finish (commit of its 128 uncached
    blocks, release) parsed (`StepRequest.FromString`), converted
    (`messages.step_ops_from`) and turned into token bytes (`validation.packed_tokens`,
    what admission and commit validation do first). The directory's work after that is
    the same for both forms, so it is left out: on a shared machine its noise (eviction
    dominates it) would hide this difference."""
    from blockd import messages  # the servicer's converter (imports the generated code)
    from blockd.validation import packed_tokens

    tokens = [rng.randrange(128_000) for _ in range(PROMPT_TOKENS)]
    half = PROMPT_TOKENS // 2
    requests = {}
    for packed in (False, True):
        request = pb.StepRequest(pool_id="pool-wire", epoch=1_700_000_000_123)
        commit = request.commits.add(sequence_id=1, block_ids=range(128, 256))
        request.releases.add(sequence_id=1)
        if packed:
            request.admits.add(sequence_id=2, token_bytes=token_bytes(tokens))
        else:
            commit.token_ids.extend(tokens[half:])
            request.admits.add(sequence_id=2, token_ids=tokens)
        requests[packed] = request.SerializeToString()

    def handle(data: bytes) -> None:
        commits, _, _, admits = messages.step_ops_from(pb.StepRequest.FromString(data))
        for op in commits:
            packed_tokens(op.token_ids, op.token_bytes, "commit")
        for op in admits:
            packed_tokens(op.token_ids, op.token_bytes, "admit")

    samples: dict[bool, list[float]] = {False: [], True: []}
    for i in range(iterations * 10):  # alternate which form goes first
        for packed in (False, True) if i % 2 else (True, False):
            samples[packed].append(_timed(lambda: handle(requests[packed])))  # noqa: B023
    varint, packed = _median_us(samples[False]), _median_us(samples[True])
    return {
        "varint_step_us": round(varint, 1),
        "packed_step_us": round(packed, 1),
        "varint_over_packed": round(varint / packed, 2),
        "varint_step_bytes": len(requests[False]),
        "packed_step_bytes": len(requests[True]),
    }


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    main(parser.parse_args().quick)
