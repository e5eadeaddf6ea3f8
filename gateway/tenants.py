"""API keys -> tenants, and the cache scope each tenant's requests get (pure, no I/O but the file read).

Keys come as `KEY=TENANT` entries: one a line in a file (`#` starts a comment) or
comma-separated in an environment variable. The cache salt is derived here from the
authenticated tenant, never taken from the caller, so tenant B can never reach blocks
that tenant A's prompts created; a public prefix (the first N tokens, the operator's
setting) is shared by every tenant, as blockd's salt scope allows. With no keys the
gateway runs open: every caller is the anonymous tenant and shares one cache.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

ANONYMOUS = ""


@dataclass(frozen=True)
class CacheScope:
    cache_salt: str
    public_prefix_tokens: int


def parse_keys(entries: Iterable[str], source: str) -> dict[str, str]:
    """`KEY=TENANT` entries (blank ones and `#` comments skipped) -> {key: tenant}."""
    keys: dict[str, str] = {}
    for number, raw in enumerate(entries, 1):
        entry = raw.split("#", 1)[0].strip()
        if not entry:
            continue
        key, sep, tenant = (part.strip() for part in entry.partition("="))
        if not sep or not key or not tenant:
            raise ValueError(f"{source}, entry {number}: expected KEY=TENANT")
        if key in keys and keys[key] != tenant:
            raise ValueError(f"{source}, entry {number}: key given twice for two tenants")
        keys[key] = tenant
    return keys


def load_keys(path: Path | None, env_value: str | None) -> dict[str, str]:
    keys: dict[str, str] = {}
    if path is not None:
        keys.update(parse_keys(path.read_text().splitlines(), str(path)))
    if env_value:
        keys.update(parse_keys(env_value.split(","), "GATEWAY_API_KEYS"))
    return keys


def salt_for(tenant: str) -> str:
    """The cache salt of a tenant: length-prefixed, so no tenant name can spell another's."""
    return f"tenant:{len(tenant)}:{tenant}" if tenant else ""


class Tenants:
    """Who a bearer token is. `is_open`: no keys configured, every caller is anonymous."""

    def __init__(self, keys: Mapping[str, str], public_prefix_tokens: int = 0) -> None:
        self._by_digest = {_digest(k): t for k, t in keys.items()}
        self.public_prefix_tokens = public_prefix_tokens

    @property
    def is_open(self) -> bool:
        return not self._by_digest

    @property
    def names(self) -> list[str]:
        return sorted(set(self._by_digest.values()))

    def authenticate(self, authorization: str | None) -> str | None:
        """The tenant of an `Authorization: Bearer KEY` header; None when it is missing or wrong."""
        if self.is_open:
            return ANONYMOUS
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        return self._by_digest.get(_digest(key.strip()))

    def scope(self, tenant: str) -> CacheScope:
        return CacheScope(salt_for(tenant), self.public_prefix_tokens)


def _digest(key: str) -> bytes:
    # Looked up by digest: the comparison's timing says nothing about the key.
    return hashlib.sha256(key.encode()).digest()
