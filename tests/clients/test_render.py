"""kvctl's human output: percentages that never claim a whole, plurals, whole ids in a pipe."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from clients import render
from clients.types import BlockEvent, Namespace, PoolInfo, PoolStats
from kvcache.v1 import directory_pb2


@pytest.mark.parametrize(
    ("part", "whole", "shown"),
    [
        (8096, 8100, "99.95%"),
        (99_999, 100_000, "99.999%"),
        (8100, 8100, "100.0%"),
        (0, 8100, "0.0%"),
        (1, 100_000, "0.001%"),
        (1, 3, "33.3%"),
        (2, 3, "66.7%"),
        (5, 0, "-"),
    ],
)
def test_percent_never_rounds_a_share_to_all_or_nothing(part: int, whole: int, shown: str) -> None:
    assert render.percent(part, whole) == shown


def test_plural() -> None:
    assert render.plural(1, "block") == "1 block"
    assert [render.plural(n, "block") for n in (0, 2, 1234)] == ["0 blocks", "2 blocks", "1,234 blocks"]
    assert render.plural(2, "entry", "entries") == "2 entries"


def _pool(pool_id: str) -> PoolInfo:
    stats = PoolStats(pool_id, 8192, 16, 8000, 100, 92, 0, 150, 2, 8100, 8096, 0, 10, 0)
    namespace = Namespace("a-model-with-a-rather-long-name", "rev", "bfloat16", "")
    return PoolInfo(pool_id, 1, namespace, 16, 8192, "worker-host.example.internal:50052", 7.0, True, stats)


def first_column(text: str) -> str:
    """The first cell of every body row of a rendered table, joined (folded values come out whole)."""
    return "".join(line.split("│")[1].strip() for line in text.splitlines() if line.startswith("│"))


def test_values_fold_on_a_narrow_terminal_instead_of_being_cut() -> None:
    console = Console(width=60, record=True, force_terminal=True)
    pool_id = "pool-0123456789abcdef"
    console.print(render.pools_table([_pool(pool_id)]))
    text = console.export_text(styles=False)
    assert "…" not in text, text
    assert first_column(text) == pool_id
    assert "1 pool" in text


def test_output_console_is_full_width_when_not_a_terminal() -> None:
    console = render.output_console()  # pytest captures stdout: not a terminal
    assert not console.is_terminal and console.width >= 10_000


def _event(kind: int, **fields: object) -> BlockEvent:
    return BlockEvent.from_proto(directory_pb2.WatchEventsResponse(sequence=45, kind=kind, **fields))


def test_watch_lines_show_what_each_event_carries() -> None:
    hashes = [bytes([i]) * 16 for i in range(6)]
    demoted = render.event_line(
        _event(
            directory_pb2.BLOCK_EVENT_KIND_DEMOTED,
            pool_id="pool-5e17e5a4",
            block_hashes=hashes,
            tier=directory_pb2.TIER_HOST,
        )
    )
    assert demoted == (
        "#45 demoted pool pool-5e17e5a4 · tier host · 6 blocks "
        "000000000000 010101010101 020202020202 030303030303 … (+2)"
    )
    assert "blocks []" not in demoted
    stored = render.event_line(
        _event(
            directory_pb2.BLOCK_EVENT_KIND_STORED,
            pool_id="p",
            block_hashes=hashes[:1],
            parent_hash=hashes[2],
            token_ids=range(16),
            block_ids=[3],
            tier=directory_pb2.TIER_DEVICE,
        )
    )
    assert (
        stored
        == "#45 stored  pool p · tier device · 1 block 000000000000 · after 020202020202 · 16 tokens · block ids 3"
    )
    cleared = render.event_line(_event(directory_pb2.BLOCK_EVENT_KIND_CLEARED, pool_id="p"))
    assert cleared == "#45 cleared pool p · every block of the pool dropped"
    assert "resync" in render.event_line(_event(directory_pb2.BLOCK_EVENT_KIND_GAP))


def test_docs_list_every_event_kind_watch_prints() -> None:
    docs = (Path(__file__).parents[2] / "docs" / "clients.md").read_text()
    kinds = [
        v.name.removeprefix("BLOCK_EVENT_KIND_").lower()
        for v in directory_pb2.BlockEventKind.DESCRIPTOR.values
        if v.number != directory_pb2.BLOCK_EVENT_KIND_UNSPECIFIED
    ]
    assert set(kinds) == set(render.EVENT_KINDS)
    for kind in kinds:
        assert f"| `{kind}` |" in docs, kind
