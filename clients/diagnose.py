"""What looks wrong, in kvctl's words: addresses checked before a call, failures explained after.

The daemons speak of RPCs (`ListPools`) and answer UNIMPLEMENTED to a call meant
for the other daemon; a user typed kvctl commands and two addresses. This module
turns the first into the second: a missing port or a URL scheme is refused before
any call, RPC names in a daemon's message become the kvctl command that makes that
call, and an UNIMPLEMENTED answer is checked against the services the address
actually serves (gRPC server reflection) so a swapped --blockd/--computed is named.
"""

from __future__ import annotations

import re

import grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from clients.errors import KVCacheError
from clients.options import TlsOptions, close_channel, open_channel

DEFAULT_PORTS = {"blockd": 50051, "computed": 50052}
# The gRPC service that tells each daemon apart.
SERVICE_OF = {"kvcache.v1.DirectoryAdminService": "blockd", "kvcache.v1.GenerationService": "computed"}
# gRPC name-resolver prefixes that are valid targets as they are.
_GRPC_TARGETS = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:")
_URL_SCHEMES = ("http://", "https://", "grpc://", "grpcs://")
RPC_COMMANDS = {
    "GetStats": "kvctl stats",
    "ListPools": "kvctl pools",
    "ListBlocks": "kvctl blocks",
    "Lookup": "kvctl lookup",
    "Flush": "kvctl flush",
    "Pin": "kvctl pin",
    "Unpin": "kvctl unpin",
    "WatchEvents": "kvctl watch",
    "Route": "kvctl route",
    "Generate": "kvctl generate",
    "GetModelInfo": "kvctl info",
}
_RPC_NAME = re.compile(r"\b(" + "|".join(RPC_COMMANDS) + r")\b")


def check_address(address: str, service: str) -> str:
    """The address itself when it looks like HOST:PORT or a gRPC target (unix:PATH, dns:///...).

    Raises ValueError with what looks wrong and the likely fix: a URL scheme
    (gRPC takes none), a missing port (gRPC would quietly try 443), a port that is
    not a number from 1 to 65535.
    """
    port = DEFAULT_PORTS[service]
    value = address.strip()
    if not value:
        raise ValueError(f"the {service} address is empty; e.g. 127.0.0.1:{port}")
    scheme = next((s for s in _URL_SCHEMES if value.lower().startswith(s)), None)
    if scheme is not None:
        rest = value[len(scheme) :].rstrip("/")
        suggestion = rest if _split_port(rest)[1] else f"{rest}:{port}"
        tls = " and --tls-ca for TLS" if scheme in ("https://", "grpcs://") else ""
        raise ValueError(
            f"{address!r} is a URL; give {service}'s address as HOST:PORT without "
            f"{scheme}, e.g. {suggestion}{tls}"
        )
    if value.lower().startswith(_GRPC_TARGETS):
        return value
    host, port_text = _split_port(value)
    if not port_text:
        raise ValueError(
            f"{address!r} has no port; e.g. {host or '127.0.0.1'}:{port} ({service}'s default port is {port})"
        )
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"the port of {address!r} is not a number from 1 to 65535")
    return value


def in_kvctl_words(text: str) -> str:
    """A daemon's message with RPC names replaced by the kvctl command that makes the call."""
    return _RPC_NAME.sub(lambda m: f"`{RPC_COMMANDS[m.group(1)]}`", text)


def explain_unimplemented(error: KVCacheError, tls: TlsOptions | None) -> str | None:
    """For an UNIMPLEMENTED answer: which daemon the address serves instead, or None if unknown."""
    if error.code is not grpc.StatusCode.UNIMPLEMENTED:
        return None
    served = served_daemons(error.address, tls)
    if not served or error.service in served:
        return None
    other = served[0]
    return (
        f"{error.address} serves {other}, not {error.service}: give it as --{other} "
        f"(are --blockd and --computed swapped? blockd's default port is {DEFAULT_PORTS['blockd']}, "
        f"computed's {DEFAULT_PORTS['computed']})"
    )


def served_daemons(address: str, tls: TlsOptions | None, timeout: float = 2.0) -> list[str]:
    """ "blockd" and/or "computed", as the server at `address` lists its services; [] if it cannot say."""
    channel = open_channel(address, tls)
    try:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        for reply in stub.ServerReflectionInfo(iter([request]), timeout=timeout):
            names = [s.name for s in reply.list_services_response.service]
            return [SERVICE_OF[n] for n in names if n in SERVICE_OF]
        return []
    except grpc.RpcError:
        return []
    finally:
        close_channel(channel, address)


def _split_port(value: str) -> tuple[str, str]:
    """(host, port) of HOST:PORT or [V6]:PORT; port "" when there is none (a bare IPv6 has none)."""
    if value.startswith("["):
        host, _, rest = value.partition("]")
        return host + "]", rest[1:] if rest.startswith(":") else ""
    host, sep, port = value.rpartition(":")
    if not sep or ":" in host:
        return value, ""
    return host, port
