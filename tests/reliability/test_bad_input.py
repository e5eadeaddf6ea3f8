"""Malformed and hostile requests to both daemons: each gets its documented status code and
a message that says what to fix, and both daemons keep serving with nothing leaked.

Every case is sent as raw bytes through a generic channel call (no client-side checks),
so invalid UTF-8, corrupt wire data and oversized messages reach the server as sent.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import pytest

from kvcache.v1 import directory_pb2 as dpb
from kvcache.v1 import generation_pb2 as gpb
from tests.reliability.stack import BLOCK, Stack, assert_accounting, health, raw_call, tokens

G = "/kvcache.v1.GenerationService/"
W = "/kvcache.v1.BlockDirectoryService/"
A = "/kvcache.v1.DirectoryAdminService/"
R = "/kvcache.v1.RoutingService/"
C = grpc.StatusCode
TEST_POOL = "reliability-bad-input"
NUM_POOL_BLOCKS = 16


class Ctx:
    """What a case needs to build its request: a freshly reset pool of our own on blockd."""

    pool_token = ""  # the test pool's owner token (a live pool is reset only by its owner)

    def __init__(self, stack: Stack) -> None:
        self.stack = stack

    def pool(self) -> tuple[str, int]:
        """Register (reset) our test pool; answers (pool_id, epoch)."""
        reply = self.stack.worker.RegisterPool(
            dpb.RegisterPoolRequest(
                num_blocks=NUM_POOL_BLOCKS,
                block_size=BLOCK,
                namespace=dpb.Namespace(model_id="bad-input"),
                pool_id=TEST_POOL,
                pool_token=Ctx.pool_token,
            ),
            timeout=10,
        )
        Ctx.pool_token = reply.pool_token  # kept across cases: each builds a new Ctx
        return reply.pool_id, reply.epoch

    def admitted(self, sequence_id: int = 1) -> tuple[str, int, list[int]]:
        """Our pool with one admitted 6-token sequence; answers (pool_id, epoch, block_ids)."""
        pool_id, epoch = self.pool()
        reply = self.stack.worker.Step(
            dpb.StepRequest(
                pool_id=pool_id,
                epoch=epoch,
                admits=[dpb.AdmitOp(sequence_id=sequence_id, token_ids=[1, 2, 3, 4, 5, 6])],
            ),
            timeout=10,
        )
        return pool_id, epoch, list(reply.admits[0].block_ids)

    def step(self, **ops) -> bytes:
        pool_id, epoch = self.pool()
        return dpb.StepRequest(pool_id=pool_id, epoch=epoch, **ops).SerializeToString()


@dataclass(frozen=True)
class Case:
    name: str
    method: str
    build: Callable[[Ctx], bytes]
    code: grpc.StatusCode
    fragment: str  # part of the message that says what to fix
    streaming: bool = False


def gen(**kw) -> Callable[[Ctx], bytes]:
    return lambda ctx: gpb.GenerateRequest(**kw).SerializeToString()


def ok_prompt(**kw) -> Callable[[Ctx], bytes]:
    return gen(prompt_token_ids=[10, 11, 12, 13, 14], **kw)


def msg(message) -> Callable[[Ctx], bytes]:
    return lambda ctx: message.SerializeToString()


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2) with `payload` as it is: no UTF-8 check."""
    assert number < 16 and len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


def stale_epoch(ctx: Ctx) -> bytes:
    pool_id, old = ctx.pool()
    ctx.pool()  # registered again: `old` is stale
    return dpb.RenewLeaseRequest(pool_id=pool_id, epoch=old).SerializeToString()


def commit_foreign(ctx: Ctx) -> bytes:
    pool_id, epoch, table = ctx.admitted()
    foreign = next(b for b in range(NUM_POOL_BLOCKS) if b not in table)
    return dpb.StepRequest(
        pool_id=pool_id,
        epoch=epoch,
        commits=[dpb.CommitOp(sequence_id=1, block_ids=[foreign], token_ids=[1, 2, 3, 4])],
    ).SerializeToString()


def commit_partial(ctx: Ctx) -> bytes:
    pool_id, epoch, table = ctx.admitted()
    return dpb.StepRequest(
        pool_id=pool_id,
        epoch=epoch,
        commits=[dpb.CommitOp(sequence_id=1, block_ids=table[:1], token_ids=[1, 2, 3])],
    ).SerializeToString()


def admit_duplicate(ctx: Ctx) -> bytes:
    pool_id, epoch, _ = ctx.admitted(sequence_id=7)
    return dpb.StepRequest(
        pool_id=pool_id, epoch=epoch, admits=[dpb.AdmitOp(sequence_id=7, token_ids=[1])]
    ).SerializeToString()


def resync_out_of_range(ctx: Ctx) -> bytes:
    pool_id, epoch = ctx.pool()
    return dpb.ResyncRequest(
        pool_id=pool_id,
        epoch=epoch,
        sequences=[dpb.ResyncSequence(sequence_id=1, block_ids=[NUM_POOL_BLOCKS + 5], token_ids=[1, 2])],
    ).SerializeToString()


NAN, INF = math.nan, math.inf
CASES = [
    # ---------------------------------------------------------------- computed
    Case("empty request", G + "Generate", gen(), C.INVALID_ARGUMENT, "empty prompt", True),
    Case(
        "two prompt kinds",
        G + "Generate",
        gen(prompt="hi", prompt_token_ids=[5]),
        C.INVALID_ARGUMENT,
        "exactly one",
        True,
    ),
    Case(
        "token id beyond vocab",
        G + "Generate",
        gen(prompt_token_ids=[5, 2**32 - 1]),
        C.INVALID_ARGUMENT,
        "out of range",
        True,
    ),
    Case(
        "prompt longer than the context",
        G + "Generate",
        gen(prompt_token_ids=[7] * 500),
        C.INVALID_ARGUMENT,
        "context",
        True,
    ),
    Case(
        "prompt larger than the pool",
        G + "Generate",
        gen(prompt_token_ids=[7] * 100),
        C.RESOURCE_EXHAUSTED,
        "--num-blocks",
        True,
    ),
    Case("max_tokens 0", G + "Generate", ok_prompt(max_tokens=0), C.INVALID_ARGUMENT, "max_tokens", True),
    Case(
        "max_tokens negative",
        G + "Generate",
        ok_prompt(max_tokens=-5),
        C.INVALID_ARGUMENT,
        "max_tokens",
        True,
    ),
    Case(
        "max_tokens huge",
        G + "Generate",
        ok_prompt(max_tokens=2**31 - 1),
        C.INVALID_ARGUMENT,
        "max_tokens",
        True,
    ),
    Case(
        "temperature NaN", G + "Generate", ok_prompt(temperature=NAN), C.INVALID_ARGUMENT, "temperature", True
    ),
    Case(
        "temperature inf", G + "Generate", ok_prompt(temperature=INF), C.INVALID_ARGUMENT, "temperature", True
    ),
    Case(
        "temperature negative",
        G + "Generate",
        ok_prompt(temperature=-1.0),
        C.INVALID_ARGUMENT,
        "temperature",
        True,
    ),
    Case(
        "temperature above 100",
        G + "Generate",
        ok_prompt(temperature=1e3),
        C.INVALID_ARGUMENT,
        "temperature",
        True,
    ),
    Case("top_p NaN", G + "Generate", ok_prompt(top_p=NAN), C.INVALID_ARGUMENT, "top_p", True),
    Case("top_p 0", G + "Generate", ok_prompt(top_p=0.0), C.INVALID_ARGUMENT, "top_p", True),
    Case("top_p -inf", G + "Generate", ok_prompt(top_p=-INF), C.INVALID_ARGUMENT, "top_p", True),
    Case("top_k negative", G + "Generate", ok_prompt(top_k=-1), C.INVALID_ARGUMENT, "top_k", True),
    Case("empty stop string", G + "Generate", ok_prompt(stop=[""]), C.INVALID_ARGUMENT, "stop", True),
    Case(
        "too many stop strings",
        G + "Generate",
        ok_prompt(stop=[str(i) for i in range(17)]),
        C.INVALID_ARGUMENT,
        "stop",
        True,
    ),
    Case(
        "stop token beyond vocab",
        G + "Generate",
        ok_prompt(stop_token_ids=[10**9]),
        C.INVALID_ARGUMENT,
        "stop_token_ids",
        True,
    ),
    Case(
        "oversized cache_salt",
        G + "Generate",
        ok_prompt(cache_salt="s" * 2000),
        C.INVALID_ARGUMENT,
        "cache_salt",
        True,
    ),
    Case(
        "request_id of 1 MB (echoed in every response)",
        G + "Generate",
        ok_prompt(request_id="r" * 1_000_000),
        C.INVALID_ARGUMENT,
        "request_id",
        True,
    ),
    Case(
        "chat message without role",
        G + "Generate",
        gen(messages=[gpb.ChatMessage(role="", content="hi")]),
        C.INVALID_ARGUMENT,
        "role",
        True,
    ),
    Case(
        "invalid UTF-8 prompt",
        G + "Generate",
        lambda ctx: field(1, b"\xff\xfe"),
        C.INVALID_ARGUMENT,
        "UTF-8",
        True,
    ),
    Case(
        "invalid UTF-8 cache_salt",
        G + "Generate",
        lambda ctx: ok_prompt()(ctx) + bytes([12 << 3 | 2, 2]) + b"\xc3\x28",
        C.INVALID_ARGUMENT,
        "UTF-8",
        True,
    ),
    Case(
        "corrupt wire data",
        G + "Generate",
        lambda ctx: b"\x0a\xff\xff\xff\xff\x0f",
        C.INVALID_ARGUMENT,
        "GenerateRequest",
        True,
    ),
    Case(
        "message over 16 MiB",
        G + "Generate",
        lambda ctx: _big(17 << 20),
        C.RESOURCE_EXHAUSTED,
        "larger than max",
        True,
    ),
    Case(
        "tokenize text and messages",
        G + "Tokenize",
        msg(gpb.TokenizeRequest(text="a", messages=[gpb.ChatMessage(role="user", content="b")])),
        C.INVALID_ARGUMENT,
        "either text or messages",
    ),
    Case(
        "detokenize beyond vocab",
        G + "Detokenize",
        msg(gpb.DetokenizeRequest(token_ids=[4_000_000_000])),
        C.INVALID_ARGUMENT,
        "out of range",
    ),
    Case(
        "invalid UTF-8 tokenize", G + "Tokenize", lambda ctx: field(1, b"\x80"), C.INVALID_ARGUMENT, "UTF-8"
    ),
    # ---------------------------------------------------------------- blockd, worker calls
    Case(
        "register 0 blocks",
        W + "RegisterPool",
        msg(dpb.RegisterPoolRequest(num_blocks=0, block_size=4)),
        C.INVALID_ARGUMENT,
        "num_blocks",
    ),
    Case(
        "register 2^32-1 blocks",
        W + "RegisterPool",
        msg(dpb.RegisterPoolRequest(num_blocks=2**32 - 1, block_size=4)),
        C.INVALID_ARGUMENT,
        "num_blocks",
    ),
    Case(
        "register block size 0",
        W + "RegisterPool",
        msg(dpb.RegisterPoolRequest(num_blocks=8)),
        C.INVALID_ARGUMENT,
        "block_size",
    ),
    Case(
        "register block size 4096",
        W + "RegisterPool",
        msg(dpb.RegisterPoolRequest(num_blocks=8, block_size=4096)),
        C.INVALID_ARGUMENT,
        "block_size",
    ),
    Case(
        "register bad pool id",
        W + "RegisterPool",
        msg(dpb.RegisterPoolRequest(num_blocks=8, block_size=4, pool_id="../../etc/passwd")),
        C.INVALID_ARGUMENT,
        "pool_id",
    ),
    Case(
        "register huge model id",
        W + "RegisterPool",
        msg(
            dpb.RegisterPoolRequest(
                num_blocks=8, block_size=4, namespace=dpb.Namespace(model_id="m" * 10_000)
            )
        ),
        C.INVALID_ARGUMENT,
        "model_id",
    ),
    Case(
        "renew unknown pool",
        W + "RenewLease",
        msg(dpb.RenewLeaseRequest(pool_id="no-such-pool", epoch=1)),
        C.NOT_FOUND,
        "RegisterPool",
    ),
    Case("renew stale epoch", W + "RenewLease", stale_epoch, C.FAILED_PRECONDITION, "stale"),
    Case(
        "step without pool id", W + "Step", msg(dpb.StepRequest(epoch=1)), C.INVALID_ARGUMENT, "RegisterPool"
    ),
    Case(
        "admit no tokens",
        W + "Step",
        lambda ctx: ctx.step(admits=[dpb.AdmitOp(sequence_id=1)]),
        C.INVALID_ARGUMENT,
        "token_ids is empty",
    ),
    Case(
        "admit over max tokens",
        W + "Step",
        lambda ctx: ctx.step(admits=[dpb.AdmitOp(sequence_id=1, token_ids=[1] * 140_000)]),
        C.INVALID_ARGUMENT,
        "--max-sequence-tokens",
    ),
    Case("admit live sequence id", W + "Step", admit_duplicate, C.INVALID_ARGUMENT, "unique"),
    Case(
        "admit oversized salt",
        W + "Step",
        lambda ctx: ctx.step(admits=[dpb.AdmitOp(sequence_id=1, token_ids=[1], cache_salt="s" * 1025)]),
        C.INVALID_ARGUMENT,
        "cache_salt",
    ),
    Case(
        "release unknown sequence",
        W + "Step",
        lambda ctx: ctx.step(releases=[dpb.ReleaseOp(sequence_id=99)]),
        C.NOT_FOUND,
        "never admitted",
    ),
    Case(
        "grow past the pool",
        W + "Step",
        lambda ctx: ctx.step(admits=[dpb.AdmitOp(sequence_id=1, token_ids=[1] * 4 * (NUM_POOL_BLOCKS + 1))]),
        C.RESOURCE_EXHAUSTED,
        "blocks",
    ),
    Case("commit foreign block", W + "Step", commit_foreign, C.INVALID_ARGUMENT, "foreign"),
    Case("commit partial block", W + "Step", commit_partial, C.INVALID_ARGUMENT, "partial block"),
    Case(
        "resync block out of range", W + "Resync", resync_out_of_range, C.INVALID_ARGUMENT, "outside the pool"
    ),
    Case(
        "invalid UTF-8 worker address",
        W + "RegisterPool",
        lambda ctx: (
            dpb.RegisterPoolRequest(num_blocks=8, block_size=4).SerializeToString()
            + field(4, b"\xed\xa0\x80")
        ),
        C.INVALID_ARGUMENT,
        "UTF-8",
    ),
    Case("corrupt Step bytes", W + "Step", lambda ctx: b"\x1a\x05\x08", C.INVALID_ARGUMENT, "StepRequest"),
    Case(
        "message over 64 MiB", W + "Step", lambda ctx: _big(65 << 20), C.RESOURCE_EXHAUSTED, "larger than max"
    ),
    # ---------------------------------------------------------------- blockd, admin and routing
    Case(
        "stats of unknown pool",
        A + "GetStats",
        msg(dpb.GetStatsRequest(pool_id="nope")),
        C.NOT_FOUND,
        "ListPools",
    ),
    Case(
        "page size 20000",
        A + "ListBlocks",
        msg(dpb.ListBlocksRequest(page_size=20_000)),
        C.INVALID_ARGUMENT,
        "page_size",
    ),
    Case(
        "forged page token",
        A + "ListBlocks",
        msg(dpb.ListBlocksRequest(page_token="W1swXV0=")),
        C.INVALID_ARGUMENT,
        "page_token",
    ),
    Case(
        "pin ttl NaN",
        A + "Pin",
        msg(dpb.PinRequest(token_ids=[1], ttl_seconds=NAN)),
        C.INVALID_ARGUMENT,
        "ttl_seconds",
    ),
    Case(
        "pin ttl negative",
        A + "Pin",
        msg(dpb.PinRequest(token_ids=[1], ttl_seconds=-1)),
        C.INVALID_ARGUMENT,
        "ttl_seconds",
    ),
    Case(
        "pin ttl a century",
        A + "Pin",
        msg(dpb.PinRequest(token_ids=[1], ttl_seconds=3.2e9)),
        C.INVALID_ARGUMENT,
        "ttl_seconds",
    ),
    Case("unpin unknown", A + "Unpin", msg(dpb.UnpinRequest(pin_id="nope")), C.NOT_FOUND, "unknown pin"),
    Case(
        "lookup no tokens", A + "Lookup", msg(dpb.LookupRequest()), C.INVALID_ARGUMENT, "token_ids is empty"
    ),
    Case(
        "flush unknown pool", A + "Flush", msg(dpb.FlushRequest(pool_id="nope")), C.NOT_FOUND, "unknown pool"
    ),
    Case(
        "watch unknown pool",
        A + "WatchEvents",
        msg(dpb.WatchEventsRequest(pool_id="nope")),
        C.NOT_FOUND,
        "unknown pool",
        True,
    ),
    Case("route no tokens", R + "Route", msg(dpb.RouteRequest()), C.INVALID_ARGUMENT, "token_ids is empty"),
    Case(
        "pool id of 70,000 characters",
        A + "GetStats",
        msg(dpb.GetStatsRequest(pool_id="p" * 70_000)),
        C.NOT_FOUND,
        "ListPools",
    ),
    Case(
        "step for a 70,000-character pool id",
        W + "Step",
        msg(dpb.StepRequest(pool_id="p" * 70_000, epoch=1)),
        C.NOT_FOUND,
        "RegisterPool",
    ),
    Case(
        "invalid UTF-8 lookup salt", A + "Lookup", lambda ctx: field(2, b"\xff"), C.INVALID_ARGUMENT, "UTF-8"
    ),
]

# blockd answers undecodable requests with grpc's default UNKNOWN "Unexpected DecodeError"
# (its servicers are registered with the generated helpers, whose deserializer raises):
# these cases fail until blockd maps a DecodeError to INVALID_ARGUMENT, as computed does.
BLOCKD_DECODE_CASES = {"invalid UTF-8 worker address", "corrupt Step bytes", "invalid UTF-8 lookup salt"}
# blockd echoes client strings unbounded in error messages (`unknown pool {pool_id!r}`):
# a long pool id makes the trailers exceed grpc's 16 KiB metadata limit, and the client
# gets RESOURCE_EXHAUSTED "Stream removed" instead of NOT_FOUND and its message.
BLOCKD_ECHO_CASES = {"pool id of 70,000 characters", "step for a 70,000-character pool id"}


def _big(size: int) -> bytes:
    """A well-formed message of about `size` bytes (one unknown bytes field, number 15)."""
    return bytes([15 << 3 | 2]) + _varint(size) + b"\0" * size


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def test_the_table_is_big_enough() -> None:
    assert len(CASES) >= 25 and len({c.name for c in CASES}) == len(CASES)
    assert {c.method.split("/")[1] for c in CASES} >= {
        "kvcache.v1.GenerationService",
        "kvcache.v1.BlockDirectoryService",
        "kvcache.v1.DirectoryAdminService",
        "kvcache.v1.RoutingService",
    }


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_request_gets_its_status_and_a_useful_message(hostile: Stack, case: Case) -> None:
    ctx = Ctx(hostile)
    channel = hostile.computed_channel if case.method.startswith(G) else hostile.blockd_channel
    code, details, replies = raw_call(
        channel, case.method, case.build(ctx), timeout=30, streaming=case.streaming
    )
    known = (
        " (blockd bug: undecodable requests are UNKNOWN)"
        if case.name in BLOCKD_DECODE_CASES
        else " (blockd bug: error messages echo unbounded input)"
        if case.name in BLOCKD_ECHO_CASES
        else ""
    )
    assert (code, case.fragment in details) == (case.code, True), (
        f"{case.name}: got {code.name} {details!r}, want {case.code.name} with {case.fragment!r}{known}"
    )
    assert not replies, "an error must come before any response message"


def test_daemons_still_serve_and_nothing_leaked_after_bad_input(hostile: Stack) -> None:
    ctx = Ctx(hostile)
    for case in CASES:  # once more in one go, then check the aftermath
        channel = hostile.computed_channel if case.method.startswith(G) else hostile.blockd_channel
        raw_call(channel, case.method, case.build(ctx), timeout=30, streaming=case.streaming)
    ctx.pool()  # reset our own test pool: what is left referenced belongs to computed
    for address in (hostile.blockd.address, hostile.computed.address):
        assert health(address) == "SERVING"
    result = hostile.generate(tokens(500, 14), 6)
    assert result.finish_reason == "length" and len(result.token_ids) == 6
    # absurd but valid sampling values are served, not refused or crashing
    greedy = hostile.generate(tokens(501, 9), 5).token_ids
    assert hostile.generate(tokens(501, 9), 5, temperature=1e-45).token_ids == greedy
    assert (
        len(
            hostile.generate(
                tokens(502, 9), 5, temperature=100.0, top_p=1e-45, top_k=2**31 - 1, seed=2**64 - 1
            ).token_ids
        )
        == 5
    )
    idle = hostile.wait_idle()
    assert idle.num_referenced_blocks == 0 and idle.num_sequences == 0, idle
    assert_accounting(idle)
    assert hostile.computed.is_alive() and hostile.blockd.is_alive()
