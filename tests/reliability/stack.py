"""Helpers for the reliability tests: a live blockd + computed pair and the probes we run on it.

Every test here drives real processes (`clients/spawn.py`) over loopback gRPC. The model
is the tiny random Llama of `tests/models.py` with 4-token blocks, so short prompts span
many blocks and a forward step costs milliseconds.
"""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.spawn import Daemon, spawn, start_blockd, start_computed
from kvcache.v1 import directory_pb2 as dpb
from kvcache.v1 import directory_pb2_grpc as dgrpc
from kvcache.v1 import generation_pb2 as gpb
from kvcache.v1 import generation_pb2_grpc as ggrpc

BLOCK = 4  # tokens per KV block in every stack here
VOCAB = 400  # the tiny tokenizer's ids; the model's vocab is 512


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tokens(seed: int, n: int) -> list[int]:
    """A deterministic random prompt of `n` token ids (no special tokens: ids 5 .. VOCAB)."""
    rng = random.Random(seed)
    return [rng.randrange(5, VOCAB) for _ in range(n)]


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (VmRSS of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def health(address: str, credentials: grpc.ChannelCredentials | None = None, service: str = "") -> str:
    """The grpc health status name of `address` (UNAVAILABLE when it does not answer)."""
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5
            )
        except grpc.RpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def raw_call(
    channel: grpc.Channel,
    method: str,
    payload: bytes,
    timeout: float = 10.0,
    metadata: Iterable[tuple[str, str]] | None = None,
    streaming: bool = False,
    max_messages: int = 1_000_000,
) -> tuple[grpc.StatusCode, str, list[bytes]]:
    """Send `payload` as the serialized request of `method` (no client-side parsing);
    answers (status code, details, the raw response messages). A stream is cancelled
    after `max_messages` messages (answered OK)."""
    replies: list[bytes] = []
    try:
        if streaming:
            call = channel.unary_stream(method, request_serializer=None, response_deserializer=None)(
                payload, timeout=timeout, metadata=metadata
            )
            for reply in call:
                replies.append(reply)
                if len(replies) >= max_messages:
                    call.cancel()
                    break
        else:
            replies.append(
                channel.unary_unary(method, request_serializer=None, response_deserializer=None)(
                    payload, timeout=timeout, metadata=metadata
                )
            )
        return grpc.StatusCode.OK, "", replies
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", replies


@dataclass
class Result:
    token_ids: list[int]
    finish_reason: str
    usage: gpb.Usage
    num_messages: int


class Stack:
    """One blockd and one computed; stubs and probes over plain loopback channels."""

    def __init__(self, blockd: Daemon, computed: Daemon | None, model: Path, admin_token: str | None = None):
        self.blockd = blockd
        self.computed = computed
        self.model = model
        self.metadata = (("authorization", f"Bearer {admin_token}"),) if admin_token else None
        self._connect()

    def _connect(self) -> None:
        self._connect_blockd()
        if self.computed is not None:
            self.computed_channel = grpc.insecure_channel(self.computed.address)
            self.gen = ggrpc.GenerationServiceStub(self.computed_channel)

    def _connect_blockd(self) -> None:
        self.blockd_channel = grpc.insecure_channel(self.blockd.address)
        self.admin = dgrpc.DirectoryAdminServiceStub(self.blockd_channel)
        self.worker = dgrpc.BlockDirectoryServiceStub(self.blockd_channel)

    def reconnect(self, blockd_only: bool = False) -> None:
        """New channels after a daemon was replaced (`blockd_only` keeps computed's
        channel, and so its in-flight streams, open)."""
        self.blockd_channel.close()
        if blockd_only:
            self._connect_blockd()
            return
        if self.computed is not None:
            self.computed_channel.close()
        self._connect()

    # ------------------------------------------------------------ computed

    def generate(self, prompt: list[int], max_tokens: int = 8, timeout: float = 120.0, **kw) -> Result:
        request = gpb.GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, **kw)
        out: list[int] = []
        last = None
        count = 0
        for message in self.gen.Generate(request, timeout=timeout):
            out.extend(message.token_ids)
            last = message
            count += 1
        assert last is not None and last.finish_reason, "the stream must end with a finish_reason"
        return Result(out, last.finish_reason, last.usage, count)

    # ------------------------------------------------------------ blockd

    def stats(self, pool_id: str = "") -> dpb.PoolStats:
        reply = self.admin.GetStats(dpb.GetStatsRequest(pool_id=pool_id), timeout=10, metadata=self.metadata)
        return reply.total

    def pools(self) -> list[dpb.PoolInfo]:
        return list(self.admin.ListPools(dpb.ListPoolsRequest(), timeout=10, metadata=self.metadata).pools)

    def live_pool(self) -> dpb.PoolInfo:
        live = [p for p in self.pools() if p.is_live]
        assert len(live) == 1, f"expected one live pool, got {live}"
        return live[0]

    def computed_pool_id(self) -> str:
        """The pool computed registered (GetModelInfo says which)."""
        return self.gen.GetModelInfo(gpb.GetModelInfoRequest(), timeout=10).pool_id

    def lookup(self, prompt: list[int], salt: str = "", public: int = 0) -> int:
        reply = self.admin.Lookup(
            dpb.LookupRequest(token_ids=prompt, cache_salt=salt, public_prefix_tokens=public),
            timeout=10,
            metadata=self.metadata,
        )
        return max((m.num_cached_tokens for m in reply.matches), default=0)

    def worker_route(self, prompt: list[int], salt: str = "", public: int = 0) -> dpb.RouteResponse:
        stub = dgrpc.RoutingServiceStub(self.blockd_channel)
        return stub.Route(
            dpb.RouteRequest(token_ids=prompt, cache_salt=salt, public_prefix_tokens=public), timeout=10
        )

    def flush(self) -> dpb.FlushResponse:
        return self.admin.Flush(dpb.FlushRequest(), timeout=10, metadata=self.metadata)

    def wait_idle(self, timeout: float = 15.0) -> dpb.PoolStats:
        """Poll GetStats until nothing is referenced and no sequence is live (or time runs out)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if (stats.num_referenced_blocks == 0 and stats.num_sequences == 0) or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

    def close(self) -> None:
        self.blockd_channel.close()
        if self.computed is not None:
            self.computed_channel.close()


def assert_accounting(stats: dpb.PoolStats) -> None:
    """free + evictable + referenced == pool size."""
    total = stats.num_free_blocks + stats.num_evictable_blocks + stats.num_referenced_blocks
    assert total == stats.num_blocks, f"free+evictable+referenced={total} != {stats.num_blocks}: {stats}"


def start_stack(
    workdir: Path,
    model: Path,
    blockd_args: Iterable[str] = (),
    computed_args: Iterable[str] = (),
    admin_token: str | None = None,
    blockd_listen: str | None = None,
) -> Stack:
    """blockd (on `blockd_listen` when given) and a computed with 4-token blocks."""
    args = list(blockd_args) + (["--admin-token", admin_token] if admin_token else [])
    blockd = spawn_blockd(workdir, args, blockd_listen)
    try:
        computed = start_computed(
            workdir, blockd.address, "--block-size", str(BLOCK), *computed_args, model=model
        )
    except BaseException:
        blockd.kill()
        raise
    return Stack(blockd, computed, model, admin_token)


def spawn_blockd(workdir: Path, args: list[str], listen: str | None = None, name: str = "blockd") -> Daemon:
    if listen is None:
        return start_blockd(workdir, *args, name=name)
    return spawn(name, "blockd", workdir, args, listen=listen)


def stop_stack(stack: Stack) -> tuple[int | None, int]:
    """SIGTERM both (computed first); answers their exit codes."""
    stack.close()
    computed_code = stack.computed.stop() if stack.computed is not None else None
    return computed_code, stack.blockd.stop()
