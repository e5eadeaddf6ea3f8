"""Tiny grpc health probe: `python -m clients.healthcheck ADDRESS` exits 0 when SERVING.

Used by the local stack runner and as the container health check in docker-compose.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.options import TlsOptions, close_channel, open_channel

UNREACHABLE = "UNREACHABLE"


def health_status(
    address: str, *, service: str = "", timeout: float = 2.0, tls: TlsOptions | None = None
) -> str:
    """ "SERVING", "NOT_SERVING", ... as grpc health says, or "UNREACHABLE"."""
    channel = open_channel(address, tls)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError as error:
        return (
            UNREACHABLE
            if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            else error.code().name
        )
    finally:
        close_channel(channel, address)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clients.healthcheck", description=__doc__)
    parser.add_argument("address", help="host:port of blockd or computed")
    parser.add_argument("--service", default="", help="health service name (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=2.0)
    parser.add_argument("--tls-ca", type=Path, help="use TLS trusting this CA (PEM)")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    tls = TlsOptions(root_cert=args.tls_ca) if args.tls_ca else None
    status = health_status(args.address, service=args.service, timeout=args.timeout, tls=tls)
    if not args.quiet:
        print(f"{args.address}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
