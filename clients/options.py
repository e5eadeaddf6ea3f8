"""Client configuration: deadlines, retries, TLS and the admin token.

Every knob lives in frozen dataclasses validated on construction, so a client is
configured once and never mutated afterwards. `open_channel` / `open_aio_channel`
turn an address plus `TlsOptions` into a gRPC channel.
"""

from __future__ import annotations

import logging
import random
import threading
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import grpc.aio

log = logging.getLogger(__name__)

# How long close_channel waits for gRPC to let a channel go.
CLOSE_WAIT_SECONDS = 2.0

# 64 MiB: a ListBlocks page of 10,000 blocks with 1,024 tokens each still fits.
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff with full jitter for transient failures.

    Attempt k (0-based) that failed with a retryable code waits a uniformly random
    time in [0, min(max_backoff, initial_backoff * multiplier**k)] before attempt
    k+1; after `max_attempts` attempts the last error is raised. Only UNAVAILABLE
    is retried by default: the peer is down or restarting and nothing was done.
    """

    max_attempts: int = 4
    initial_backoff: float = 0.1
    max_backoff: float = 2.0
    multiplier: float = 2.0
    retryable_codes: frozenset[grpc.StatusCode] = frozenset({grpc.StatusCode.UNAVAILABLE})

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.initial_backoff < 0 or self.max_backoff < self.initial_backoff:
            raise ValueError("need 0 <= initial_backoff <= max_backoff")
        if self.multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier}")

    def should_retry(self, code: grpc.StatusCode | None, attempt: int) -> bool:
        """True when a call whose attempt `attempt` (0-based) failed with `code` is retried."""
        return code in self.retryable_codes and attempt + 1 < self.max_attempts

    def backoff(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to sleep after failed attempt `attempt` (0-based)."""
        ceiling = min(self.max_backoff, self.initial_backoff * self.multiplier**attempt)
        return (rng or random).uniform(0.0, ceiling)


NO_RETRY = RetryPolicy(max_attempts=1)


@dataclass(frozen=True)
class TlsOptions:
    """TLS for the client side of a channel.

    root_cert: PEM of the CA that signed the servers' certificates (None: system roots).
    client_cert / client_key: PEM pair for mutual TLS; both or neither.
    server_name: overrides the name checked against the server certificate.
    """

    root_cert: Path | None = None
    client_cert: Path | None = None
    client_key: Path | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("client_cert and client_key go together: give both or neither")
        for path in (self.root_cert, self.client_cert, self.client_key):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"TLS file not found: {path}")

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: Path | None) -> bytes | None:
            return Path(path).read_bytes() if path is not None else None

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.root_cert),
            private_key=read(self.client_key),
            certificate_chain=read(self.client_cert),
        )


@dataclass(frozen=True)
class ClientOptions:
    """How every call of a client is made.

    timeout: deadline of each unary call, in seconds.
    generate_timeout: deadline of a whole Generate stream (decoding on CPU is slow).
    admin_token: sent as "authorization: Bearer <token>" on DirectoryAdminService calls.
    """

    timeout: float = 30.0
    generate_timeout: float = 600.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    tls: TlsOptions | None = None
    admin_token: str | None = None

    def __post_init__(self) -> None:
        if self.timeout <= 0 or self.generate_timeout <= 0:
            raise ValueError("timeouts must be > 0 seconds")
        if self.admin_token is not None and not self.admin_token.strip():
            raise ValueError("admin_token must not be blank (use None for no token)")

    def admin_metadata(self) -> tuple[tuple[str, str], ...]:
        if self.admin_token is None:
            return ()
        return (("authorization", f"Bearer {self.admin_token}"),)


def _channel_options(tls: TlsOptions | None) -> list[tuple[str, object]]:
    options: list[tuple[str, object]] = [
        ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
        # We retry ourselves (RetryPolicy); grpc's transparent retries would hide attempts.
        ("grpc.enable_retries", 0),
    ]
    if tls is not None and tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return options


def open_channel(address: str, tls: TlsOptions | None = None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address, options=_channel_options(None))
    return grpc.secure_channel(address, tls.credentials(), options=_channel_options(tls))


def close_channel(channel: grpc.Channel, address: str, wait: float = CLOSE_WAIT_SECONDS) -> None:
    """Closes a sync channel, waiting at most `wait` seconds.

    A Ctrl-C (any exception a signal handler raises) that lands while gRPC starts a
    streaming or future call can leave that call registered with no thread to drive it,
    and gRPC's own close then waits for it forever (tests/clients/test_client.py shows
    it). The close runs on a daemon thread, so a program that was interrupted still
    ends; a channel that did not close is left to the process exit.
    """
    closing = threading.Thread(target=channel.close, name=f"close {address}", daemon=True)
    closing.start()
    closing.join(wait)
    if closing.is_alive():
        log.warning("the channel to %s did not close; leaving it to the process exit", address)


def open_aio_channel(address: str, tls: TlsOptions | None = None) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address, options=_channel_options(None))
    return grpc.aio.secure_channel(address, tls.credentials(), options=_channel_options(tls))
