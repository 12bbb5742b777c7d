"""The decisions every rank of a generation makes alike, pure: the order the snapshot group's ring visits the
ranks (`ring_order`), which ranks keep a copy of each part, on other nodes (`copy_holders`), the ranks whose
replicated arrays disagree (`divergent`), and which snapshot to restore and who sends each part (`choose`).

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


def copy_holders(places: list[str], replicas: int) -> list[list[int]]:
    """For each ring position, the positions that keep a copy of its unique part: up to `replicas` of them, each
    on another node than the part's own (a copy on its own node dies with it), per part, so that pods sharing a
    node cost only their own copies, not everyone's. Each copy goes first to a node holding no copy of that part
    yet, then to the position holding the fewest copies so far (the memory they cost is spread), then to the
    nearest downstream (fewer ring rounds). A part of a node with no other node has none. Pure, and parts are
    placed in ring order, a copy of each at a time: every rank computes the same answer."""
    world = len(places)
    load = [0] * world
    holders: list[list[int]] = [[] for _ in range(world)]
    for _ in range(replicas):  # every part's first copy, then every part's second: the load stays even
        for source, chosen in enumerate(holders):
            candidates = [q for q in range(world) if places[q] != places[source] and q not in chosen]
            if not candidates:
                continue
            best = min(candidates, key=lambda q: (any(places[q] == places[c] for c in chosen), load[q],
                                                  (q - source) % world))
            chosen.append(best)
            load[best] += 1
    return holders


def copy_distance(holders: list[list[int]], source: int) -> int:
    """How far around the ring `source`'s part travels: to its farthest holder (0: it keeps no copy)."""
    world = len(holders)
    return max(((q - source) % world for q in holders[source]), default=0)


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
