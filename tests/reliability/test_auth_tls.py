"""Auth and transport: the admin token on every admin RPC, and TLS on both daemons and on
the link between them, with client certificates (mutual TLS).

tests/clients/test_tls.py covers the Python client and kvctl against a mutual-TLS blockd;
this file covers computed's TLS server, computed -> blockd over mutual TLS, and refusals
(plaintext, no client certificate, a certificate from another CA).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from kvcache.v1 import directory_pb2 as dpb
from kvcache.v1 import directory_pb2_grpc as dgrpc
from kvcache.v1 import generation_pb2 as gpb
from kvcache.v1 import generation_pb2_grpc as ggrpc
from tests.daemons import REPO
from tests.reliability.conftest import ADMIN_TOKEN
from tests.reliability.stack import BLOCK, Stack, health, raw_call, tokens

A = "/kvcache.v1.DirectoryAdminService/"
C = grpc.StatusCode

# ---------------------------------------------------------------- admin token

ADMIN_CALLS = [
    ("GetStats", dpb.GetStatsRequest(), C.OK),
    ("ListPools", dpb.ListPoolsRequest(), C.OK),
    ("ListBlocks", dpb.ListBlocksRequest(page_size=2), C.OK),
    ("Lookup", dpb.LookupRequest(token_ids=[1, 2, 3, 4, 5]), C.OK),
    ("Flush", dpb.FlushRequest(cache_salt="no-such-tenant"), C.OK),
    ("Pin", dpb.PinRequest(token_ids=[1, 2, 3, 4, 5], ttl_seconds=1), C.OK),
    ("Unpin", dpb.UnpinRequest(pin_id="no-such-pin"), C.NOT_FOUND),
    ("WatchEvents", dpb.WatchEventsRequest(), C.OK),
]
CREDENTIALS = [
    ("none", None, C.UNAUTHENTICATED, "authorization"),
    ("wrong token", f"Bearer {ADMIN_TOKEN}x", C.PERMISSION_DENIED, "wrong"),
    ("token prefix", f"Bearer {ADMIN_TOKEN[:-1]}", C.PERMISSION_DENIED, "wrong"),
    ("other scheme", f"Basic {ADMIN_TOKEN}", C.UNAUTHENTICATED, "Bearer"),
    ("empty bearer", "Bearer ", C.UNAUTHENTICATED, "Bearer"),
    ("right token", f"Bearer {ADMIN_TOKEN}", None, ""),
    ("scheme in lower case", f"bearer {ADMIN_TOKEN}", None, ""),
]


@pytest.mark.parametrize("credential", CREDENTIALS, ids=[c[0] for c in CREDENTIALS])
@pytest.mark.parametrize("call", ADMIN_CALLS, ids=[c[0] for c in ADMIN_CALLS])
def test_admin_calls_need_the_token(guarded: Stack, call, credential) -> None:
    method, request, authorized_code = call
    _, header, code, fragment = credential
    metadata = None if header is None else (("authorization", header),)
    streaming = method == "WatchEvents"
    got, details, _ = raw_call(
        guarded.blockd_channel,
        A + method,
        request.SerializeToString(),
        timeout=1.0,
        metadata=metadata,
        streaming=streaming,
        max_messages=1,
    )
    if streaming and got == C.DEADLINE_EXCEEDED:
        got = C.OK  # authorized: the stream was open, waiting for events
    want = authorized_code if code is None else code
    assert got == want, (got, details)
    assert fragment in details
    assert ADMIN_TOKEN not in details, "an error message must never echo the token"


def test_worker_and_routing_calls_need_no_token(guarded: Stack) -> None:
    assert guarded.generate(tokens(800, 9), 3).finish_reason == "length"  # computed sends no token
    assert guarded.worker_route(tokens(800, 9)).pool_id
    assert health(guarded.blockd.address) == "SERVING"


# ---------------------------------------------------------------- TLS


def openssl(folder: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True, timeout=60)


def make_pki(folder: Path) -> dict[str, bytes]:
    """Two CAs: `ca` signs the server and client certificates; `rogue` signs an intruder's."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for ca in ("ca", "rogue"):
        openssl(
            folder,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            f"/CN={ca}",
            "-keyout",
            f"{ca}.key",
            "-out",
            f"{ca}.pem",
        )
    for name, ca, ext in (
        ("server", "ca", ["-extfile", "server.ext"]),
        ("client", "ca", []),
        ("intruder", "rogue", []),
    ):
        openssl(
            folder,
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
        )
        openssl(
            folder,
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            f"{ca}.pem",
            "-CAkey",
            f"{ca}.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-out",
            f"{name}.pem",
            *ext,
        )
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.suffix in (".pem", ".key")}


@dataclass
class TlsDaemon:
    proc: subprocess.Popen
    address: str | None
    log: Path

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def spawn_tls(folder: Path, name: str, module: str, args: list[str], wait: bool = True) -> TlsDaemon:
    """Like tests.daemons.spawn, but health is checked by the caller (over TLS)."""
    ready = folder / f"{name}.ready"
    log = folder / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, "--listen", "127.0.0.1:0", "--ready-file", str(ready), *args],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    daemon = TlsDaemon(proc, None, log)
    deadline = time.monotonic() + 180
    while wait and not (ready.exists() and ready.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            daemon.stop()
            raise AssertionError(f"{name} did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    daemon.address = ready.read_text().strip() if wait else None
    return daemon


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path):
    folder = tmp_path_factory.mktemp("tls")
    pki = make_pki(folder)
    path = {name: str(folder / name) for name in pki}
    blockd = spawn_tls(
        folder,
        "blockd",
        "blockd",
        [
            "--tls-cert",
            path["server.pem"],
            "--tls-key",
            path["server.key"],
            "--tls-client-ca",
            path["ca.pem"],
        ],
    )
    try:
        computed = spawn_tls(
            folder,
            "computed",
            "computed",
            [
                "--blockd",
                blockd.address,
                "--model",
                str(tiny_model),
                "--block-size",
                str(BLOCK),
                "--num-blocks",
                "64",
                "--tls-cert",
                path["server.pem"],
                "--tls-key",
                path["server.key"],
                "--tls-client-ca",
                path["ca.pem"],
                "--blockd-tls-ca",
                path["ca.pem"],
                "--blockd-tls-cert",
                path["client.pem"],
                "--blockd-tls-key",
                path["client.key"],
            ],
        )
    except BaseException:
        blockd.stop()
        raise
    yield blockd, computed, pki, path, folder
    assert computed.stop() == 0, computed.log.read_text()[-3000:]
    assert blockd.stop() == 0, blockd.log.read_text()[-3000:]


def creds(pki: dict[str, bytes], client: str | None = "client", ca: str = "ca") -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=pki[f"{ca}.pem"],
        private_key=pki[f"{client}.key"] if client else None,
        certificate_chain=pki[f"{client}.pem"] if client else None,
    )


def test_mutual_tls_end_to_end(tls_stack) -> None:
    blockd, computed, pki, _, _ = tls_stack
    assert health(blockd.address, creds(pki)) == "SERVING"
    assert health(computed.address, creds(pki)) == "SERVING"
    with grpc.secure_channel(computed.address, creds(pki)) as channel:
        stub = ggrpc.GenerationServiceStub(channel)
        request = gpb.GenerateRequest(prompt_token_ids=tokens(810, 14), max_tokens=5, ignore_eos=True)
        first = list(stub.Generate(request, timeout=60))
        second = list(stub.Generate(request, timeout=60))
        pool_id = stub.GetModelInfo(gpb.GetModelInfoRequest(), timeout=10).pool_id
    assert first[-1].usage.completion_tokens == 5
    # the cache hit proves computed's commits reached blockd over its mutual-TLS link
    assert second[-1].usage.cached_tokens == 12
    with grpc.secure_channel(blockd.address, creds(pki)) as channel:
        pools = dgrpc.DirectoryAdminServiceStub(channel).ListPools(dpb.ListPoolsRequest(), timeout=10).pools
    assert [p.pool_id for p in pools if p.is_live] == [pool_id]


@pytest.mark.parametrize(
    "how", ["plaintext", "no client certificate", "certificate of another CA", "server not trusted"]
)
def test_tls_refuses_unauthenticated_peers(tls_stack, how: str) -> None:
    blockd, computed, pki, _, _ = tls_stack
    credentials = {
        "plaintext": None,
        "no client certificate": creds(pki, client=None),
        "certificate of another CA": creds(pki, client="intruder"),
        "server not trusted": creds(pki, ca="rogue"),
    }[how]
    for address in (blockd.address, computed.address):
        assert health(address, credentials) == "UNAVAILABLE", (how, address)
    channel = (
        grpc.secure_channel(computed.address, credentials)
        if credentials
        else grpc.insecure_channel(computed.address)
    )
    with channel, pytest.raises(grpc.RpcError) as err:
        list(
            ggrpc.GenerationServiceStub(channel).Generate(
                gpb.GenerateRequest(prompt_token_ids=[5, 6, 7], max_tokens=2), timeout=10
            )
        )
    assert err.value.code() == C.UNAVAILABLE


@pytest.mark.parametrize("client_cert", ["intruder", pytest.param(None, marks=pytest.mark.slow)])
def test_computed_without_a_valid_client_certificate_never_registers(
    tls_stack, tiny_model: Path, client_cert: str | None
) -> None:
    blockd, _, pki, path, folder = tls_stack
    args = [
        "--blockd",
        blockd.address,
        "--model",
        str(tiny_model),
        "--block-size",
        str(BLOCK),
        "--num-blocks",
        "16",
        "--blockd-tls-ca",
        path["ca.pem"],
    ]
    if client_cert:
        args += [
            "--blockd-tls-cert",
            path[f"{client_cert}.pem"],
            "--blockd-tls-key",
            path[f"{client_cert}.key"],
        ]
    name = f"computed-{client_cert or 'no-cert'}"
    daemon = spawn_tls(folder, name, "computed", args, wait=False)
    try:
        deadline = time.monotonic() + 120
        while daemon.log.read_text().count("blockd_recovery_retry") < 2:  # loaded, then refused, twice
            assert daemon.proc.poll() is None, daemon.log.read_text()[-3000:]
            assert time.monotonic() < deadline, daemon.log.read_text()[-3000:]
            time.sleep(0.1)
        assert not (folder / f"{name}.ready").exists(), "it must not serve unregistered"
        with grpc.secure_channel(blockd.address, creds(pki)) as channel:
            pools = (
                dgrpc.DirectoryAdminServiceStub(channel).ListPools(dpb.ListPoolsRequest(), timeout=10).pools
            )
        assert len(pools) == 1, "only the legitimate worker registered"
    finally:
        daemon.stop()
