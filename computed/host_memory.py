"""How much host memory this process may still take: the machine's free memory, or less
where a container's memory limit (cgroup v2 `memory.max`, v1 `memory.limit_in_bytes`)
leaves less. The host tier's default size reads it (a pod's limit, not the node's free
memory, is what the kernel enforces: sized past it, the worker is OOM-killed)."""

from __future__ import annotations

import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
# (limit file, usage file): cgroup v2, then v1.
_FILES = (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"))
# cgroup v1 spells "no limit" as a huge number near 2**63.
_UNLIMITED = 1 << 60


def available_bytes(cgroup: Path = CGROUP) -> int:
    """Free host memory, capped by the container's limit less its usage."""
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    headroom = container_headroom(cgroup)
    return free if headroom is None else max(0, min(free, headroom))


def container_headroom(cgroup: Path = CGROUP) -> int | None:
    """The container's memory limit less its usage; None without a limit."""
    for limit_name, usage_name in _FILES:
        try:
            limit = (cgroup / limit_name).read_text().strip()
            usage = int((cgroup / usage_name).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= _UNLIMITED:
            return None
        return int(limit) - usage
    return None
