"""The host tier's default respects a container's memory limit."""

from __future__ import annotations

from pathlib import Path

from computed.host_memory import available_bytes, container_headroom


def test_a_cgroup_v2_limit_caps_what_is_available(tmp_path: Path) -> None:
    (tmp_path / "memory.max").write_text("8589934592\n")  # an 8 GiB pod
    (tmp_path / "memory.current").write_text("6442450944\n")  # 6 GiB in use
    assert container_headroom(tmp_path) == 2 << 30
    assert available_bytes(tmp_path) <= 2 << 30


def test_no_limit_leaves_the_machines_free_memory(tmp_path: Path) -> None:
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("100\n")
    assert container_headroom(tmp_path) is None
    assert available_bytes(tmp_path) == available_bytes(tmp_path / "absent") > 0


def test_cgroup_v1(tmp_path: Path) -> None:
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(str(4 << 30))
    (tmp_path / "memory" / "memory.usage_in_bytes").write_text(str(1 << 30))
    assert container_headroom(tmp_path) == 3 << 30
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(str(9223372036854771712))  # v1's "none"
    assert container_headroom(tmp_path) is None
