"""The decisions every rank of a generation makes alike, pure: the order the snapshot group's ring visits the
ranks (`ring_order`), which ranks keep a copy of each part, on other nodes (`copy_holders`), the ranks whose
replicated arrays disagree (`divergent`), and the restore arbiter (`choose`): memory or storage, which step, who
sends each old rank's part, and why, from checked inputs only.

Separate because they take what was allgathered and return a verdict, with no buffers or group: tests check
them alone, and every rank reaching the same one is what keeps recovery consistent.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Literal

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


# ---- the restore arbiter ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Held:
    """One snapshot part a rank of the new generation holds, every CRC checked (`Keeper.inventory`)."""

    holder: int  # the new rank that holds it
    instance: str
    generation: int
    step: int
    world: int  # of the generation that took it
    source: int  # the old rank it is of
    whole: bool  # the source's own snapshot (with the replicated arrays and plain values), not a copy of its Shards
    agreed: bool  # the snapshot's allgather found every old rank's replicated arrays equal (or a world of one)
    digest: int  # of its replicated arrays (`replicated_digest`): compared at recovery when not agreed
    holds: str  # the layout of the object it is a snapshot of (`image.layout`)

    @property
    def key(self) -> tuple[str, int, int]:
        return self.instance, self.generation, self.step


@dataclasses.dataclass(frozen=True)
class Durable:
    """A committed step on storage as a check of every byte found it (`CheckpointCoordinator.checked`)."""

    step: int
    generation: int | None  # of the generation that saved it (its manifest's), None when it did not validate
    problems: tuple[str, ...]  # empty: it validates


@dataclasses.dataclass(frozen=True)
class Divergence:
    """A snapshot's allgather found ranks' replicated arrays unequal at `step` of `generation`: from `since` on (the
    step after the newest snapshot of that generation that agreed, 0 when none did: where they may have begun to
    differ), nothing that generation kept is trusted, in memory or on storage (rank 0 writes the replicated
    arrays of a checkpoint, whichever copy is the bad one)."""

    instance: str
    generation: int
    step: int
    since: int


@dataclasses.dataclass(frozen=True)
class Decision:
    """Where a recovery restores from, and why (said in the `restored` event).

    source "memory": the snapshot `key` (its step is `step`); `senders[r]`: the new rank holding old rank r's part,
    `whole`: the old rank whose own snapshot (with the replicated arrays and plain values) is sent whole.
    source "storage": committed step `step`, checked; None: the newest that validates as it loads (a search that
    no divergence verdict can mislead: there is none) or, with nothing committed, a fresh start.
    source "none": nothing that can be trusted is left: the run ends with this reason."""

    source: Literal["memory", "storage", "none"]
    step: int | None
    why: str
    key: tuple[str, int, int] | None = None
    senders: tuple[int, ...] = ()
    whole: int | None = None

    def parts(self) -> list[tuple[int, int]]:
        """(old rank, the new rank that sends its part), the whole one first."""
        assert self.whole is not None
        return [(self.whole, self.senders[self.whole])] + [
            (r, holder) for r, holder in enumerate(self.senders) if r != self.whole]


def binds(divergences: Iterable[Divergence], generation: int | None, step: int, instance: str | None = None,
          ) -> Divergence | None:
    """The divergence verdict that rules out what `generation` kept of `step` (None: none does). A durable
    step's instance is not known: the verdicts a worker holds are of its own run instance."""
    return next((d for d in divergences if d.generation == generation and d.since <= step
                 and (instance is None or d.instance == instance)), None)


def choose(held: Sequence[Held], durable: Sequence[Durable], unchecked: Sequence[int],
           divergences: Sequence[Divergence], target: str) -> Decision:
    """The restore decision, one pure function over checked inputs (every rank decides alike).

    held: the parts the new ranks hold, CRCs checked; durable: committed steps whose every byte was checked;
    unchecked: committed steps listed but not checked (they never count: a step that may be corrupt); divergences:
    verdicts that bind every source; target: the layout of the object being restored (`image.layout`).

    A snapshot counts when it holds `target`, every old rank's part is held by someone, an own snapshot whole
    survives whose replicated arrays were checked (the snapshot's allgather agreed, or every old rank's own
    snapshot is here and their digests are equal), and no divergence verdict binds it. The newest counting
    snapshot (step, then generation) wins when no committed step is newer that is checked and valid and not bound
    by a verdict, and none newer is unchecked; the lowest new rank holding a part sends it, an own snapshot (the
    lowest old rank's) preferred for the whole one. Else the newest checked, valid, unbound committed step, when
    no unchecked step is newer; else storage's own search (newest valid as it loads) when there is no verdict
    that could bind what it finds; else nothing can be trusted."""
    usable, refused = _snapshots(held, divergences, target)
    best = max(usable, key=lambda c: (c[0][2], c[0][1]), default=None)
    good = [d for d in durable if not d.problems and binds(divergences, d.generation, d.step) is None]
    newest_durable = max(good, key=lambda d: d.step, default=None)
    newest_unchecked = max(unchecked, default=None)
    if best is not None:
        key, senders, whole = best
        newer = [s for s in ([newest_durable.step] if newest_durable else []) + list(unchecked) if s > key[2]]
        if not newer:
            return Decision("memory", key[2], f"restored from peer memory (step {key[2]}"
                            + (f"; {refused}" if refused else "") + ")", key, tuple(senders), whole)
    lost = refused or "no snapshot survives (a new job, or every rank that held one is gone)"
    if best is not None:
        lost = f"committed step {max(newer)} is newer than the newest usable snapshot (step {best[0][2]})"
    skipped = _skipped(durable, divergences)
    if newest_durable is not None and (newest_unchecked is None or newest_unchecked < newest_durable.step):
        return Decision("storage", newest_durable.step, f"{lost}; committed step {newest_durable.step} validates"
                        + (f" ({skipped})" if skipped else ""))
    if not divergences:
        return Decision("storage", None, lost + (f" ({skipped})" if skipped else ""))
    return Decision("none", None, f"{lost}; no committed step is checked and free of the divergence verdicts "
                    f"({skipped or 'none left'})")


def _snapshots(held: Sequence[Held], divergences: Sequence[Divergence], target: str,
               ) -> tuple[list[tuple[tuple[str, int, int], list[int], int]], str]:
    """The snapshots that count, as (key, senders, whole), and why the newest that does not count does not."""
    by_key: dict[tuple[str, int, int], list[Held]] = {}
    for h in held:  # another object's snapshots of a step (`ctx.snapshot`) never stand in for the target's
        by_key.setdefault(h.key, [])
        if h.holds == target:
            by_key[h.key].append(h)
    usable, reasons = [], {}
    for key, parts in by_key.items():
        if not parts:
            reasons[key] = f"the snapshot of step {key[2]} holds another object than the one restored"
            continue
        world = parts[0].world
        holders = {r: min(h.holder for h in parts if h.source == r) for r in {h.source for h in parts}}
        wholes = [h for h in parts if h.whole]
        checked = any(h.agreed for h in wholes) or (  # every digest held counts, two of one source's included
            {h.source for h in wholes} == set(range(world)) and len({h.digest for h in wholes}) == 1)
        verdict = binds(divergences, key[1], key[2], key[0])
        lost = [r for r in range(world) if r not in holders]
        why = (f"the replicated arrays of step {key[2]} may differ between ranks (found unequal at step "
               f"{verdict.step}, after agreeing last before step {verdict.since})"
               if verdict is not None
               else f"the newest snapshot, step {key[2]}, lost the part of rank(s) {', '.join(map(str, lost))} "
                    "with every copy" if lost
               else f"the newest snapshot, step {key[2]}, has no rank's own snapshot left (the replicated arrays)"
               if not wholes
               else f"the replicated arrays of step {key[2]} were never compared (its snapshot was cut off before "
                    "its allgather) and not every old rank's own snapshot is left to compare them"
               if not checked else "")
        if why:
            reasons[key] = why
            continue
        first = min(wholes, key=lambda h: (h.source, h.holder))
        senders = [holders[r] for r in range(world)]
        senders[first.source] = first.holder
        usable.append((key, senders, first.source))
    newest_refused = max(reasons, key=lambda k: (k[2], k[1]), default=None)
    newest_usable = max((u[0] for u in usable), key=lambda k: (k[2], k[1]), default=None)
    if newest_refused is None or (newest_usable is not None
                                  and (newest_usable[2], newest_usable[1]) > (newest_refused[2], newest_refused[1])):
        return usable, ""
    return usable, f"no complete snapshot: {reasons[newest_refused]}"


def _skipped(durable: Sequence[Durable], divergences: Sequence[Divergence]) -> str:
    """The checked committed steps that do not count, and why, newest first."""
    out = []
    for d in sorted(durable, key=lambda d: -d.step):
        verdict = binds(divergences, d.generation, d.step) if not d.problems else None
        if d.problems:
            out.append(f"step {d.step} is invalid: {d.problems[0]}")
        elif verdict is not None:
            out.append(f"step {d.step} was saved after replicas may have diverged (found unequal at step "
                       f"{verdict.step}, after agreeing last before step {verdict.since})")
    return "; ".join(out)
