"""TLS options of the client and kvctl against a blockd serving mutual TLS (certs made with openssl)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from clients.client import BlockdClient
from clients.errors import KVCacheError
from clients.healthcheck import health_status
from clients.options import ClientOptions, RetryPolicy, TlsOptions
from tests.clients.conftest import run_kvctl
from tests.daemons import REPO

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certs(folder: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA."""
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=kvcache test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        cwd=folder,
    )
    (folder / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, ext in (("server", ["-extfile", "server.ext"]), ("client", [])):
        openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={name}",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            cwd=folder,
        )
        openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-out",
            f"{name}.pem",
            *ext,
            cwd=folder,
        )
    return {
        name: folder / name for name in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")
    }


@pytest.fixture(scope="module")
def tls_blockd(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("tls")
    certs = make_certs(folder)
    ready = folder / "blockd.ready"
    log = open(folder / "blockd.log", "wb")  # noqa: SIM115 - closed below
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
            str(certs["server.pem"]),
            "--tls-key",
            str(certs["server.key"]),
            "--tls-client-ca",
            str(certs["ca.pem"]),
        ],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    tls = TlsOptions(
        root_cert=certs["ca.pem"], client_cert=certs["client.pem"], client_key=certs["client.key"]
    )
    try:
        deadline = time.monotonic() + 60
        while not (ready.exists() and ready.read_text().strip()):
            assert proc.poll() is None, (folder / "blockd.log").read_text()
            assert time.monotonic() < deadline, "blockd wrote no ready file"
            time.sleep(0.05)
        address = ready.read_text().strip()
        while health_status(address, tls=tls) != "SERVING":
            assert time.monotonic() < deadline, (folder / "blockd.log").read_text()
            time.sleep(0.1)
        yield address, certs
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def test_mutual_tls_with_client_certificate(tls_blockd) -> None:
    address, certs = tls_blockd
    tls = TlsOptions(
        root_cert=certs["ca.pem"], client_cert=certs["client.pem"], client_key=certs["client.key"]
    )
    with BlockdClient(address, ClientOptions(tls=tls)) as blockd:
        assert blockd.get_stats().total.num_blocks == 0


@pytest.mark.parametrize("mode", ["plaintext", "no client certificate"])
def test_refused_without_tls_or_client_certificate(tls_blockd, mode: str) -> None:
    address, certs = tls_blockd
    tls = None if mode == "plaintext" else TlsOptions(root_cert=certs["ca.pem"])
    options = ClientOptions(tls=tls, timeout=5, retry=RetryPolicy(max_attempts=1))
    with BlockdClient(address, options) as blockd, pytest.raises(KVCacheError) as error:
        blockd.get_stats()
    assert error.value.code is grpc.StatusCode.UNAVAILABLE


def test_kvctl_tls_flags(tls_blockd) -> None:
    address, certs = tls_blockd
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHE_")}
    result = run_kvctl(
        "--blockd",
        address,
        "--tls-ca",
        str(certs["ca.pem"]),
        "--tls-cert",
        str(certs["client.pem"]),
        "--tls-key",
        str(certs["client.key"]),
        "flush",
        "--json",
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"dropped": 0, "busy": 0}
    half = run_kvctl("--blockd", address, "--tls-cert", str(certs["client.pem"]), "stats", env=env)
    assert half.returncode == 2 and "both or neither" in half.stderr
