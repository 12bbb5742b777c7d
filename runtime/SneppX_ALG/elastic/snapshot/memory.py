"""How much host memory peer-memory snapshots need (`needed_bytes` before a snapshot is taken, `needed_by_rank` once
every rank's sizes are known, `recovery_by_rank` for a recovery), and how much this process may use (`host_memory`:
the machine's, or its container's cgroup limit).

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


def needed_by_rank(states: list[int], parts: list[int], holders: list[list[int]]) -> list[int]:
    """Host memory each ring position's snapshots hold at most, from every position's sizes (`states[p]`: its own
    snapshot's bytes; `parts[p]`: its unique part's, as it travels; `holders[p]`: the positions that keep a copy
    of it, `plan.copy_holders`): two of its own, two of each part it keeps (the complete step's and the new
    one's), and two of the largest part that passes through it (the one arriving, the one going on). Exact where
    `needed_bytes` must guess: parts of uneven shards differ, and a position may keep more or fewer than
    `replicas` copies."""
    world = len(states)
    needed = []
    for q in range(world):
        kept = sum(parts[s] for s in range(world) if q in holders[s])
        passing = [parts[s] for s in range(world) for q2 in holders[s]
                   if 0 < (q - s) % world <= (q2 - s) % world]
        needed.append(2 * (states[q] + kept) + 2 * max(passing, default=0))
    return needed


def recovery_by_rank(bundles: list[list[int]], held: list[int]) -> list[int]:
    """Host memory a recovery holds at most on each ring position, from every position's sizes (`bundles[h][d]`:
    the bytes position h sends position d, the boxes of d's new shards in the parts h holds; `held[q]`: what q's
    snapshots hold already): what it holds, what it receives (its own boxes cut from its own parts too), and two
    bundles passing through it on their way (one arriving, one going on)."""
    world = len(held)
    needed = []
    for q in range(world):
        received = sum(bundles[h][q] for h in range(world))
        passing = [bundles[h][d] for h in range(world) for d in range(world) if 0 < (q - h) % world < (d - h) % world]
        needed.append(held[q] + received + 2 * max(passing, default=0))
    return needed


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
