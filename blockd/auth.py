"""Admin authentication: a shared bearer token, compared in constant time."""

from __future__ import annotations

import hmac
from collections.abc import Iterable


class AuthError(Exception):
    """Raised for an admin call that may not proceed."""


class MissingCredentials(AuthError):
    """No `authorization: Bearer <token>` metadata (UNAUTHENTICATED)."""


class WrongCredentials(AuthError):
    """A bearer token that is not the admin token (PERMISSION_DENIED)."""


class AdminAuth:
    """Checks call metadata against the configured admin token; with no token
    configured every call is allowed."""

    def __init__(self, token: str | None) -> None:
        self._token = token.encode("utf-8") if token else None

    @property
    def is_enabled(self) -> bool:
        return self._token is not None

    def check(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> None:
        if self._token is None:
            return
        values = [value for key, value in metadata or () if key.lower() == "authorization"]
        if not values:
            raise MissingCredentials(
                "admin call without credentials: send metadata 'authorization: Bearer <admin token>'"
            )
        value = values[0] if isinstance(values[0], str) else values[0].decode("utf-8", "replace")
        scheme, _, presented = value.strip().partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            raise MissingCredentials("authorization metadata must be 'Bearer <admin token>'")
        if not hmac.compare_digest(presented.strip().encode("utf-8"), self._token):
            raise WrongCredentials("the admin token is wrong")
