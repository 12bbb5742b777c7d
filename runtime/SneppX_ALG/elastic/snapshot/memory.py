"""How much host memory peer-memory snapshots need (`needed_bytes`), and how much this process may use
(`host_memory`: the machine's, or its container's cgroup limit).

Separate because it is the one part that asks the operating system, and the bound a `Keeper` enforces before it
allocates anything.
"""

from __future__ import annotations

import os

DEFAULT_MEMORY_FRACTION = 0.25  # of the host's memory, when no snapshot_memory_limit is given


def needed_bytes(state_bytes: int, unique_bytes: int, replicas: int) -> int:
    """Host memory snapshots of this rank hold at most: two of its own (the complete one and the one being
    taken), two of each peer's unique part it keeps (assumed as large as its own), and two parts in transit
    (what it sends, what it forwards)."""
    return 2 * (state_bytes + replicas * unique_bytes) + 2 * unique_bytes


CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # v2, v1


def host_memory(limits: tuple[str, ...] = CGROUP_LIMITS) -> int:
    """The memory this process may use: the machine's, or its container's limit when lower (in a pod the
    machine's memory is not what the OOM killer counts against)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in limits:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            return min(total, int(text))
    return total
