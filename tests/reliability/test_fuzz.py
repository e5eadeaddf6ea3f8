"""Fuzzing both daemons with generated and mutated requests (seeded, reproducible).

Two fuzzers share one driver:
- hostile values: valid seed messages with fields set to edge values (NaN, 2^64-1, huge
  repeated fields, long or odd strings); every message still parses;
- raw bytes: seed messages with byte-level damage, sent through a generic channel call.

Seeds come from a small stateful model of a worker (our own pool on blockd, with live
sequences, their block tables and commits), so mutations reach deep into Step and Resync,
not only the decoder. What must hold: no INTERNAL/UNKNOWN (nor a call hanging past its deadline), both
daemons alive and SERVING, no block left referenced, greedy output unchanged.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import pytest

from kvcache.v1 import directory_pb2 as dpb
from kvcache.v1 import generation_pb2 as gpb
from tests.reliability.mutate import mutate_bytes, mutate_message
from tests.reliability.stack import BLOCK, Stack, assert_accounting, health, raw_call, tokens

G = "/kvcache.v1.GenerationService/"
W = "/kvcache.v1.BlockDirectoryService/"
A = "/kvcache.v1.DirectoryAdminService/"
R = "/kvcache.v1.RoutingService/"
FUZZ_POOL = "fuzz-pool"
FUZZ_POOL_BLOCKS = 64
C = grpc.StatusCode
BAD = {
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.DATA_LOSS,
}
STREAMING = {G + "Generate", A + "WatchEvents"}
PROBE = tokens(600, 13)
MAX_FUZZ_BYTES = 4 << 20


@dataclass
class WorkerModel:
    """What a well-behaved worker would know of its pool; seeds are built from it."""

    rng: random.Random
    epoch: int = 0
    next_id: int = 1
    # sequence id -> [token ids, block ids, committed block count]
    live: dict[int, list] = field(default_factory=dict)
    pool_token: str = ""  # the pool's proof of ownership, from the last registration

    def register(self) -> dpb.RegisterPoolRequest:
        return dpb.RegisterPoolRequest(
            num_blocks=FUZZ_POOL_BLOCKS,
            block_size=BLOCK,
            pool_id=FUZZ_POOL,
            namespace=dpb.Namespace(model_id="fuzz", dtype="float32"),
            worker_address="127.0.0.1:1",
            pool_token=self.pool_token,
        )

    def step(self) -> dpb.StepRequest:
        rng = self.rng
        request = dpb.StepRequest(pool_id=FUZZ_POOL, epoch=self.epoch)
        ids = list(self.live)
        for seq_id in rng.sample(ids, k=min(len(ids), rng.randint(0, 2))):
            tokens_, table, done = self.live[seq_id]
            full = len(tokens_) // BLOCK
            if done < full:
                n = rng.randint(1, full - done)
                request.commits.add(
                    sequence_id=seq_id,
                    block_ids=table[done : done + n],
                    token_ids=tokens_[done * BLOCK : (done + n) * BLOCK],
                )
        chosen = set()
        for seq_id in rng.sample(ids, k=min(len(ids), rng.randint(0, 1))):
            request.releases.add(sequence_id=seq_id)
            chosen.add(seq_id)
        for seq_id in rng.sample([i for i in ids if i not in chosen], k=min(len(ids) - len(chosen), 1)):
            request.grows.add(sequence_id=seq_id, num_tokens=len(self.live[seq_id][0]) + rng.randint(0, 8))
        for _ in range(rng.randint(0, 2)):
            shared = tokens(7, 8) if rng.random() < 0.5 else []
            request.admits.add(
                sequence_id=self.next_id,
                token_ids=shared + tokens(rng.random(), rng.randint(1, 20)),
                cache_salt=rng.choice(["", "", "tenant-a", "tenant-b"]),
                public_prefix_tokens=rng.choice([0, 0, 4, 8]),
            )
            self.next_id += 1
        return request

    def resync(self) -> dpb.ResyncRequest:
        request = dpb.ResyncRequest(pool_id=FUZZ_POOL, epoch=self.epoch)
        for seq_id, (tokens_, table, _) in self.live.items():
            request.sequences.add(sequence_id=seq_id, block_ids=table, token_ids=tokens_)
        return request

    def renew(self) -> dpb.RenewLeaseRequest:
        return dpb.RenewLeaseRequest(pool_id=FUZZ_POOL, epoch=self.epoch)

    def apply(self, request, reply: bytes) -> None:
        """Follow blockd's answer to an unmutated request."""
        if isinstance(request, dpb.RegisterPoolRequest):
            response = dpb.RegisterPoolResponse.FromString(reply)
            self.epoch, self.pool_token = response.epoch, response.pool_token
            self.live.clear()
        elif isinstance(request, dpb.ResyncRequest):
            for entry in self.live.values():
                entry[2] = len(entry[0]) // BLOCK
        elif isinstance(request, dpb.StepRequest):
            response = dpb.StepResponse.FromString(reply)
            for op in request.commits:
                self.live[op.sequence_id][2] += len(op.block_ids)
            for op in request.releases:
                del self.live[op.sequence_id]
            for op, result in zip(request.grows, response.grows):
                self.live[op.sequence_id][1].extend(result.new_block_ids)
            for op, result in zip(request.admits, response.admits):
                if result.admitted:
                    self.live[op.sequence_id] = [
                        list(op.token_ids),
                        list(result.block_ids),
                        result.num_cached_tokens // BLOCK,
                    ]


def worker_seed(model: WorkerModel) -> tuple[str, object]:
    roll = model.rng.random()
    if roll < 0.06 or model.epoch == 0:
        return W + "RegisterPool", model.register()
    if roll < 0.12:
        return W + "RenewLease", model.renew()
    if roll < 0.2:
        return W + "Resync", model.resync()
    return W + "Step", model.step()


def concurrent_seed(rng: random.Random, pin_ids: list[str]) -> tuple[str, object]:
    """Seeds for computed and for blockd's admin and routing calls (no ordering needed)."""
    roll = rng.random()
    prompt = tokens(rng.randrange(50), rng.randint(1, 30))
    if roll < 0.35:
        kw = rng.choice(
            [
                {},
                {"temperature": 0.8, "seed": 3},
                {"temperature": 1.5, "top_k": 5, "top_p": 0.9, "seed": 4},
                {"stop": ["a", "the"], "stop_token_ids": [300]},
                {"cache_salt": "t1", "public_prefix_tokens": 4},
            ]
        )
        shape = rng.randrange(3)
        if shape == 0:
            request = gpb.GenerateRequest(prompt_token_ids=prompt, max_tokens=rng.randint(1, 12), **kw)
        elif shape == 1:
            request = gpb.GenerateRequest(prompt="def f(x): return", max_tokens=rng.randint(1, 12), **kw)
        else:
            request = gpb.GenerateRequest(
                messages=[
                    gpb.ChatMessage(role="system", content="Be brief."),
                    gpb.ChatMessage(role="user", content="Hello!"),
                ],
                max_tokens=rng.randint(1, 12),
                request_id="r-1",
                **kw,
            )
        return G + "Generate", request
    if roll < 0.42:
        return G + "Tokenize", rng.choice(
            [
                gpb.TokenizeRequest(text="Hello, world", add_special_tokens=True),
                gpb.TokenizeRequest(messages=[gpb.ChatMessage(role="user", content="hi")]),
            ]
        )
    if roll < 0.47:
        return G + "Detokenize", gpb.DetokenizeRequest(token_ids=prompt)
    if roll < 0.5:
        return G + "GetModelInfo", gpb.GetModelInfoRequest()
    pool = rng.choice(["", FUZZ_POOL])
    return rng.choice(
        [
            (A + "GetStats", dpb.GetStatsRequest(pool_id=pool)),
            (A + "ListPools", dpb.ListPoolsRequest()),
            (A + "ListBlocks", dpb.ListBlocksRequest(pool_id=pool, page_size=rng.choice([0, 1, 3]))),
            (
                A + "Lookup",
                dpb.LookupRequest(token_ids=prompt, cache_salt="tenant-a", public_prefix_tokens=4),
            ),
            (A + "Flush", dpb.FlushRequest(pool_id=FUZZ_POOL, cache_salt=rng.choice(["", "tenant-b"]))),
            (A + "Pin", dpb.PinRequest(token_ids=tokens(7, 8), ttl_seconds=5, pool_id=pool)),
            (A + "Unpin", dpb.UnpinRequest(pin_id=pin_ids[-1] if pin_ids else "pin-1")),
            (
                A + "WatchEvents",
                dpb.WatchEventsRequest(after_sequence=rng.choice([0, 5, 2**64 - 1]), pool_id=pool),
            ),
            (R + "Route", dpb.RouteRequest(token_ids=prompt, cache_salt="tenant-a")),
        ]
    )


@dataclass
class Outcome:
    method: str
    code: grpc.StatusCode
    details: str
    payload: bytes
    replies: list[bytes]


def send(stack: Stack, method: str, payload: bytes) -> Outcome:
    channel = stack.computed_channel if method.startswith(G) else stack.blockd_channel
    streaming = method in STREAMING
    code, details, replies = raw_call(
        channel,
        method,
        payload,
        streaming=streaming,
        timeout=1.0 if method == A + "WatchEvents" else 30.0,
        max_messages=50,
    )
    if code == grpc.StatusCode.OK and method == A + "Pin" and replies:
        send.pin_ids.append(dpb.PinResponse.FromString(replies[0]).pin_id)  # unpinned at the end
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and method == A + "WatchEvents":
        code = grpc.StatusCode.OK  # it waits for events forever; a Generate past 30 s is a hang
    return Outcome(method, code, details, payload, replies)


send.pin_ids: list[str] = []  # type: ignore[attr-defined]


def fuzz(stack: Stack, num_messages: int, seed: int, raw: bool) -> tuple[list[Outcome], WorkerModel]:
    """Send `num_messages` messages (a third ordered worker calls on our own pool, the rest
    concurrently on 6 threads); answers every outcome, and the ordered worker's model."""
    rng = random.Random(seed)
    model = WorkerModel(random.Random(seed + 1))
    seeds_seen: list[bytes] = []

    def damage(message) -> bytes:
        data = message.SerializeToString()
        seeds_seen.append(data)
        for _ in range(5):  # oversized messages have their own case in test_bad_input
            damaged = (
                mutate_bytes(data, rng, seeds_seen[-50:])
                if raw
                else mutate_message(message, rng).SerializeToString()
            )
            if len(damaged) <= MAX_FUZZ_BYTES:
                return damaged
        return data

    num_ordered = num_messages // 3
    concurrent_jobs = []
    for _ in range(num_messages - num_ordered):
        method, message = concurrent_seed(rng, send.pin_ids)
        concurrent_jobs.append(
            (method, damage(message) if rng.random() < 0.8 else message.SerializeToString())
        )
    outcomes: list[Outcome] = []
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(send, stack, method, payload) for method, payload in concurrent_jobs]
        for _ in range(num_ordered):
            method, message = worker_seed(model)
            if rng.random() < 0.35:  # well-formed: keeps the model in step with blockd
                outcome = send(stack, method, message.SerializeToString())
                if outcome.code == grpc.StatusCode.OK:
                    model.apply(message, outcome.replies[0])
                elif method != W + "RegisterPool":
                    model.epoch = 0  # lost track (a mutated call changed the pool): register again
            else:
                outcome = send(stack, method, damage(message))
            outcomes.append(outcome)
        outcomes += [f.result() for f in futures]
    return outcomes, model


def check_aftermath(stack: Stack, outcomes: list[Outcome], reference: list[int], model: WorkerModel) -> None:
    """The daemons survived and leaked nothing (checked first, so a status bug cannot hide
    a leak), then: no call got a status that means a bug."""
    assert stack.computed.is_alive() and stack.blockd.is_alive()
    for address in (stack.blockd.address, stack.computed.address):
        assert health(address) == "SERVING"
    for pin_id in send.pin_ids:  # pins are held on purpose; their owner drops them
        raw_call(stack.blockd_channel, A + "Unpin", dpb.UnpinRequest(pin_id=pin_id).SerializeToString())
    send.pin_ids.clear()
    _reset_pool(stack, model)
    assert stack.generate(PROBE, 6).token_ids == reference, "greedy output changed after the fuzzing"
    deadline = time.monotonic() + 20  # pools the fuzzer registered lapse after their 2 s lease
    while True:
        reply = stack.admin.GetStats(dpb.GetStatsRequest(), timeout=10)
        if reply.total.num_referenced_blocks == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for pool in reply.pools:
        assert_accounting(pool)
    assert reply.total.num_referenced_blocks == 0 and reply.total.num_sequences == 0, reply.total
    ours = [p for p in reply.pools if p.pool_id == stack.computed_pool_id()]
    assert len(ours) == 1 and ours[0].num_referenced_blocks == 0, ours

    bad = [o for o in outcomes if o.code in BAD or o.code == C.DEADLINE_EXCEEDED]
    kinds = Counter((o.method.rsplit("/", 1)[1], o.code.name, o.details[:60]) for o in bad)
    examples = [(o.method, o.code.name, o.details[:160], o.payload[:40]) for o in bad[:3]]
    assert not bad, f"{len(bad)} of {len(outcomes)} calls got a bad status: {dict(kinds)}\ne.g. {examples}"


def _reset_pool(stack: Stack, model: WorkerModel) -> None:
    """Register our fuzz pool afresh. A mutated RegisterPool that blockd accepted may own it
    now with a token the model never saw: then only its 2 s lease lapsing frees the id."""
    deadline = time.monotonic() + 10
    while True:
        try:
            stack.worker.RegisterPool(model.register(), timeout=10)
            return
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.PERMISSION_DENIED or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.fixture
def reference(hostile: Stack) -> list[int]:
    return hostile.generate(PROBE, 6).token_ids


@pytest.mark.parametrize("num_messages", [250, pytest.param(5000, marks=pytest.mark.slow)])
def test_fuzz_hostile_field_values(hostile: Stack, reference: list[int], num_messages: int) -> None:
    outcomes, model = fuzz(hostile, num_messages, seed=1234, raw=False)
    assert len(outcomes) == num_messages
    assert sum(o.code == grpc.StatusCode.OK for o in outcomes) > num_messages // 20, "nothing got through"
    check_aftermath(hostile, outcomes, reference, model)


@pytest.mark.parametrize("num_messages", [250, pytest.param(5000, marks=pytest.mark.slow)])
def test_fuzz_raw_bytes(hostile: Stack, reference: list[int], num_messages: int) -> None:
    outcomes, model = fuzz(hostile, num_messages, seed=4321, raw=True)
    assert len(outcomes) == num_messages
    check_aftermath(hostile, outcomes, reference, model)
