"""The sync and asyncio clients expose the same API: same public names, same signatures.

Both are thin shells over clients.core, so a new RPC is one method in each; this test
fails when one of them gets a method, a parameter or a default the other lacks.
"""

from __future__ import annotations

import inspect
import re

import pytest

from clients import aio_client, client

PAIRS = [
    (client.BlockdClient, aio_client.AsyncBlockdClient),
    (client.ComputedClient, aio_client.AsyncComputedClient),
    (client.KVCacheClient, aio_client.AsyncKVCacheClient),
    (client.GenerateStream, aio_client.AsyncGenerateStream),
]
# Methods of the asyncio classes that answer at once (a stream object, a worker's client).
NOT_AWAITED = {"generate", "generate_prompt", "computed"}
# The protocols that differ by name only.
PROTOCOLS = {"__enter__": "__aenter__", "__exit__": "__aexit__"}
# Constructors that differ on purpose: a sync stream is built around its iterator.
SKIP_INIT = {client.GenerateStream}


def _public(cls: type) -> dict[str, object]:
    names = {n for n in dir(cls) if not n.startswith("_")} | {"__init__", *PROTOCOLS, *PROTOCOLS.values()}
    return {n: inspect.getattr_static(cls, n) for n in names if hasattr(cls, n)}


def _asyncless(annotation: str) -> str:
    """An async annotation spelled as its sync twin: AsyncIterator -> Iterator, AsyncX -> X."""
    return re.sub(r"\bAsync(?=[A-Z])", "", str(annotation))


def _signature(function: object) -> inspect.Signature:
    return inspect.signature(function)  # type: ignore[arg-type]


@pytest.mark.parametrize("sync_cls, async_cls", PAIRS, ids=lambda c: c.__name__)
def test_same_public_names(sync_cls: type, async_cls: type) -> None:
    sync_names = {PROTOCOLS.get(n, n) for n in _public(sync_cls) if n not in PROTOCOLS.values()}
    async_names = {n for n in _public(async_cls) if n not in PROTOCOLS}
    assert sync_names == async_names, (
        f"only in {sync_cls.__name__}: {sorted(sync_names - async_names)}; "
        f"only in {async_cls.__name__}: {sorted(async_names - sync_names)}"
    )


@pytest.mark.parametrize("sync_cls, async_cls", PAIRS, ids=lambda c: c.__name__)
def test_same_signatures(sync_cls: type, async_cls: type) -> None:
    async_members = _public(async_cls)
    for name, member in _public(sync_cls).items():
        if name in PROTOCOLS.values() or (name == "__init__" and sync_cls in SKIP_INIT):
            continue
        twin = async_members[PROTOCOLS.get(name, name)]
        assert type(member) is type(twin), f"{name}: {type(member).__name__} vs {type(twin).__name__}"
        if isinstance(member, property):
            assert (
                _asyncless(_signature(member.fget).return_annotation)
                == _signature(twin.fget).return_annotation
                or _asyncless(_signature(twin.fget).return_annotation)
                == _signature(member.fget).return_annotation
            )
            continue
        if not callable(member):
            continue
        ours, theirs = _signature(member), _signature(twin)
        assert [(p.name, p.kind, p.default, _asyncless(p.annotation)) for p in ours.parameters.values()] == [
            (p.name, p.kind, p.default, _asyncless(p.annotation)) for p in theirs.parameters.values()
        ], f"{sync_cls.__name__}.{name}{ours} != {async_cls.__name__}.{name}{theirs}"
        assert _asyncless(ours.return_annotation) == _asyncless(theirs.return_annotation), (
            f"{name}: returns {ours.return_annotation} vs {theirs.return_annotation}"
        )


@pytest.mark.parametrize("sync_cls, async_cls", PAIRS, ids=lambda c: c.__name__)
def test_async_methods_are_awaited(sync_cls: type, async_cls: type) -> None:
    for name, member in _public(async_cls).items():
        if not inspect.isfunction(member) or name.startswith("__") and name not in PROTOCOLS.values():
            continue
        is_async = inspect.iscoroutinefunction(member) or inspect.isasyncgenfunction(member)
        assert is_async == (name not in NOT_AWAITED), f"{async_cls.__name__}.{name}: awaited={is_async}"
