"""Bearer-token authentication of call metadata, compared in constant time.

blockd has three independent credentials, each optional: the admin token (operator
calls), the worker token (the worker API) and the route token (Route). Each is a
`BearerAuth`; with no token configured, every call of that kind is allowed.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable


class AuthError(Exception):
    """Raised for a call that may not proceed."""


class MissingCredentials(AuthError):
    """No `authorization: Bearer <token>` metadata (UNAUTHENTICATED)."""


class WrongCredentials(AuthError):
    """A bearer token that is not the configured one (PERMISSION_DENIED)."""


class BearerAuth:
    """Checks call metadata against one configured token. `role` names the token in
    messages ("admin", "worker", "route"), `flag` the blockd flag that sets it."""

    def __init__(self, token: str | None, role: str, flag: str) -> None:
        self._token = token.encode("utf-8") if token else None
        self._role = role
        self._flag = flag

    @property
    def is_enabled(self) -> bool:
        return self._token is not None

    def check(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> None:
        if self._token is None:
            return
        values = [value for key, value in metadata or () if key.lower() == "authorization"]
        if not values:
            raise MissingCredentials(
                f"{self._role} call without credentials: send metadata "
                f"'authorization: Bearer <{self._role} token>' (blockd {self._flag})"
            )
        value = values[0] if isinstance(values[0], str) else values[0].decode("utf-8", "replace")
        scheme, _, presented = value.strip().partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            raise MissingCredentials(f"authorization metadata must be 'Bearer <{self._role} token>'")
        if not hmac.compare_digest(presented.strip().encode("utf-8"), self._token):
            raise WrongCredentials(f"the {self._role} token is wrong")


def admin_auth(token: str | None) -> BearerAuth:
    """The admin token's check (operator calls)."""
    return BearerAuth(token, "admin", "--admin-token")


def worker_auth(token: str | None) -> BearerAuth:
    """The worker token's check (RegisterPool, RenewLease, Step, Resync)."""
    return BearerAuth(token, "worker", "--worker-token")


def route_auth(token: str | None) -> BearerAuth:
    """The route token's check (Route)."""
    return BearerAuth(token, "route", "--route-token")
