"""The real `python -m blockd` process: flags, health, reflection, signals, TLS."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from kvcache.v1 import directory_pb2 as pb
from kvcache.v1 import directory_pb2_grpc as pb_grpc
from tests.daemons import REPO, start_blockd

SERVICES = {
    "kvcache.v1.BlockDirectoryService",
    "kvcache.v1.DirectoryAdminService",
    "kvcache.v1.RoutingService",
    "grpc.health.v1.Health",
}


def run_blockd(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "blockd", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def test_help_lists_the_flags():
    result = run_blockd("--help")
    assert result.returncode == 0
    for flag in (
        "--listen",
        "--lease-ttl",
        "--admin-token",
        "--max-sequence-tokens",
        "--eviction-policy",
        "--ready-file",
        "--metrics-port",
        "--log-format",
        "--loop",
        "--tls-cert",
        "--tls-key",
        "--tls-client-ca",
    ):
        assert flag in result.stdout
    console_script = shutil.which("blockd", path=str(Path(sys.executable).parent))
    if console_script:  # installed with `pip install -e .`
        assert (
            subprocess.run(
                [console_script, "--help"], capture_output=True, timeout=60, check=False
            ).returncode
            == 0
        )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lease-ttl", "-1"], "lease_ttl_seconds"),
        (["--listen", "nonsense"], "HOST:PORT"),
        (["--tls-cert", "/nonexistent.pem"], "--tls-key"),
        (["--eviction-policy", "random"], "invalid choice"),
        (["--loop", "libev"], "invalid choice"),
    ],
)
def test_bad_flags_exit_2_with_a_message(args, message):
    result = run_blockd(*args)
    assert result.returncode == 2 and message in result.stderr


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_either_event_loop_serves_steps_and_drains_on_sigterm(tmp_path, loop):
    """`--loop`: asyncio's loop and uvloop's (auto's choice when installed) serve alike."""
    daemon = start_blockd(tmp_path, "--loop", loop)
    try:
        with grpc.insecure_channel(daemon.address) as channel:
            workers = pb_grpc.BlockDirectoryServiceStub(channel)
            pool = workers.RegisterPool(pb.RegisterPoolRequest(num_blocks=16, block_size=4), timeout=5)
            request = pb.StepRequest(
                pool_id=pool.pool_id, epoch=pool.epoch, admits=[pb.AdmitOp(sequence_id=1, token_ids=[1] * 9)]
            )
            replies = list(workers.StepStream(iter([pb.StepStreamRequest(step=request)]), timeout=5))
            assert [len(r.step.admits[0].block_ids) for r in replies] == [3]
    finally:
        assert daemon.stop(signal.SIGTERM) == 0


def test_daemon_serves_health_reflection_and_stops_cleanly_on_sigterm(tmp_path):
    daemon = start_blockd(tmp_path, "--admin-token", "tok", "--lease-ttl", "5")
    try:
        with grpc.insecure_channel(daemon.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", *SERVICES - {"grpc.health.v1.Health"}):
                reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
            assert SERVICES <= services
            workers = pb_grpc.BlockDirectoryServiceStub(channel)
            pool = workers.RegisterPool(pb.RegisterPoolRequest(num_blocks=16, block_size=4), timeout=5)
            assert pool.lease_ttl_seconds == 5
            assert pool.epoch > 1_600_000_000_000  # epochs start at the wall clock in ms
            reply = workers.Step(
                pb.StepRequest(
                    pool_id=pool.pool_id,
                    epoch=pool.epoch,
                    admits=[pb.AdmitOp(sequence_id=1, token_ids=[1, 2, 3, 4, 5])],
                )
            )
            assert reply.admits[0].admitted
            admin = pb_grpc.DirectoryAdminServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                admin.GetStats(pb.GetStatsRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            stats = admin.GetStats(
                pb.GetStatsRequest(), metadata=(("authorization", "Bearer tok"),), timeout=5
            )
            assert stats.total.num_referenced_blocks == 2
    finally:
        code = daemon.stop(signal.SIGTERM)
    assert code == 0, daemon.log()
    lines = [json.loads(line) for line in daemon.log().splitlines() if line.startswith("{")]
    events = [line["event"] for line in lines]
    assert "serving" in events and "stopped" in events  # JSON logs when not on a terminal


def test_admin_token_from_the_environment(tmp_path):
    daemon = start_blockd(tmp_path, env={"BLOCKD_ADMIN_TOKEN": "from-env"})
    try:
        with grpc.insecure_channel(daemon.address) as channel:
            admin = pb_grpc.DirectoryAdminServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                admin.ListPools(
                    pb.ListPoolsRequest(), metadata=(("authorization", "Bearer other"),), timeout=5
                )
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            admin.ListPools(
                pb.ListPoolsRequest(), metadata=(("authorization", "Bearer from-env"),), timeout=5
            )
    finally:
        assert daemon.stop(signal.SIGINT) == 0


def test_tls(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "blockd",
            "--listen",
            "127.0.0.1:0",
            "--ready-file",
            str(ready),
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        for _ in range(600):
            if ready.exists() and ready.read_text().strip():
                break
            assert proc.poll() is None, proc.stderr.read()
            __import__("time").sleep(0.05)
        address = ready.read_text().strip()
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(address, credentials) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = health.Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
