"""The decisions every rank of a generation makes alike, pure: the order the snapshot group's ring visits the
ranks (`ring_order`), the hop at which a copy lands on another node (`placement_hop`), the ranks whose replicated
arrays disagree (`divergent`), and which snapshot to restore and who sends each part (`choose`).

Separate because they take what was allgathered and return a verdict, with no buffers or group: tests check
them alone, and every rank reaching the same one is what keeps recovery consistent.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np


def ring_order(workers: list[int]) -> list[int]:
    """The generation's ranks in the order the snapshot group's ring visits them (node i has `workers[i]` ranks,
    numbered on from node i - 1's): one of each node in turn, so that with as many workers on every node no
    rank's neighbour is on its own node and a copy crosses one link, not h."""
    starts = [sum(workers[:i]) for i in range(len(workers))]
    return [starts[node] + local for local in range(max(workers, default=0))
            for node in range(len(workers)) if local < workers[node]]


def placement_hop(places: list[str]) -> int:
    """The smallest h such that rank r + h (around the ring) is on another node than rank r, for every r: each
    rank's copy then never shares its node. 0 when there is none (one node: no copy can survive its loss)."""
    world = len(places)
    return next((h for h in range(1, world) if all(places[r] != places[(r + h) % world] for r in range(world))), 0)


def divergent(digests: np.ndarray) -> list[int]:
    """Ranks whose replicated-array digest differs from the most common one (ties: from rank 0's)."""
    counts = Counter(int(d) for d in digests)
    top = max(counts.values())
    majority = int(digests[0]) if counts[int(digests[0])] == top else next(d for d, n in counts.items() if n == top)
    return [r for r, d in enumerate(digests) if int(d) != majority]


Choice = tuple[tuple[str, int, int], list[int], int]


def choose(lists: list[list[dict[str, Any]]], durable_step: int | None) -> Choice | str:
    """The snapshot to restore: its key, for each of its old ranks the new rank that sends that rank's part, and
    the old rank whose part is sent whole (its own snapshot, which also holds the replicated arrays and plain
    values). The newest step (then the newest generation) for which every old rank's part is held by someone
    and one old rank's own snapshot survives; the lowest new rank holding a part sends it, and an own snapshot
    is preferred to a copy. A reason instead when there is none, or none newer than the newest durable
    checkpoint. Pure: every rank decides alike."""
    holders: dict[tuple[str, int, int], dict[int, int]] = {}
    wholes: dict[tuple[str, int, int], dict[int, int]] = {}
    worlds: dict[tuple[str, int, int], int] = {}
    for rank, listed in enumerate(lists):
        for e in listed:
            key = (e["instance"], e["generation"], e["step"])
            holders.setdefault(key, {}).setdefault(e["source"], rank)
            if e.get("whole"):
                wholes.setdefault(key, {}).setdefault(e["source"], rank)
            worlds[key] = e["world"]
    if not holders:
        return "no snapshot survives (a new job, or every rank that held one is gone)"
    for key in sorted(holders, key=lambda k: (k[2], k[1]), reverse=True):
        if any(r not in holders[key] for r in range(worlds[key])) or not wholes.get(key):
            continue
        if durable_step is not None and durable_step > key[2]:
            return f"the durable checkpoint of step {durable_step} is newer than any snapshot (step {key[2]})"
        senders = [holders[key][r] for r in range(worlds[key])]
        whole = min(wholes[key])
        senders[whole] = wholes[key][whole]
        return key, senders, whole
    newest = max(holders, key=lambda k: (k[2], k[1]))
    lost = [r for r in range(worlds[newest]) if r not in holders[newest]]
    if not lost:
        return (f"no complete snapshot survives: the newest, step {newest[2]}, has no rank's own snapshot left "
                "(the replicated arrays)")
    return (f"no complete snapshot survives: the newest, step {newest[2]}, lost the part of rank(s) "
            f"{', '.join(map(str, lost))} with every copy")
