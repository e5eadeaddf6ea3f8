"""The computed workers blockd knows: the worker addresses of its live pools (`ListPools`).

Every worker registers its pool with blockd under the address clients reach it at
(`computed --worker-address`, its pod or container address in a fleet), so blockd is
already the fleet's registry. The gateway reads it every `Fleet` refresh: a worker
started anywhere (`docker compose up --scale computed=N`, a StatefulSet scaled up) is
served within a refresh, with no gateway restart and no file edit.

`ListPools` is an admin call: against a blockd with `--admin-token` the gateway needs
`--blockd-admin-token`; refused or unreachable, discovery answers None and the fleet
keeps the workers it has (and says so once).
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
import grpc.aio
import structlog

from clients.routing import normalize_address
from kvcache.v1 import directory_pb2 as pb
from kvcache.v1 import directory_pb2_grpc

log = structlog.get_logger("gateway")


def live_worker_addresses(pools: Iterable[pb.PoolInfo]) -> tuple[str, ...]:
    """The addresses of live pools that announce one, normalized, first listed first, once each."""
    out: dict[str, None] = {}
    for pool in pools:
        if pool.is_live and pool.worker_address:
            out.setdefault(normalize_address(pool.worker_address), None)
    return tuple(out)


class PoolDiscovery:
    """Asks blockd's `ListPools` for the live workers' addresses."""

    def __init__(self, channel: grpc.aio.Channel, admin_token: str | None, timeout: float) -> None:
        self._stub = directory_pb2_grpc.DirectoryAdminServiceStub(channel)
        self._metadata = (("authorization", f"Bearer {admin_token}"),) if admin_token else ()
        self._timeout = timeout
        self._failing: grpc.StatusCode | None = None

    async def addresses(self) -> tuple[str, ...] | None:
        """The live workers' addresses; None when blockd did not answer (said once per outage)."""
        try:
            reply = await self._stub.ListPools(
                pb.ListPoolsRequest(), timeout=self._timeout, metadata=self._metadata
            )
        except grpc.RpcError as error:
            if self._failing != error.code():
                hint = " (give --blockd-admin-token)" if error.code() in _REFUSED else ""
                log.warning(f"worker discovery: blockd's ListPools failed{hint}", code=error.code().name)
                self._failing = error.code()
            return None
        self._failing = None
        return live_worker_addresses(reply.pools)


_REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
