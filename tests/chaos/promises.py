"""The promise oracle of the recovery chaos harness: where a recovery must come from, by docs/ELASTIC.md's "What
is guaranteed", and whether it did. `chaos_harness.judge` asks whether the state is right; this asks what the
recovery cost: a run that restores the right state from storage (or ends) where peer memory was promised is a
broken promise (issue 37, defects 3 and 4, and `choose` taking a snapshot with a part lost).

It asserts only where the schedule and the run's own records make the promise certain despite real-process
timing, and says nothing elsewhere (an oracle with false failures is worse than none):
- snapshots on, no world-sized array (a world that changes ends it with a typed error), and the nodes on at least
  two Kubernetes nodes (`Config.places`; each harness node its own by default), so that every part has a copy
  off its node (`plan.copy_holders`);
- the first generation started fresh, and exactly one fault may have acted before the next generation restored:
  a worker, agent or node killed or stopped, or a rank raising (one Kubernetes node's worth of memory at most,
  which every part survives). A signal may have acted when it fired during recovery or at a step the first
  generation reached (or nearly: faults fire in turn, when progress.json reaches their step), a fault planted
  in the script when its marker file is older than the restore; a diverged replica or flipped held copies
  acting rule the promise out. Flipped committed steps never do: they never make a snapshot count less.
Then a snapshot of a step S was complete on every rank when the first generation ended: a worker's `take` of the
snapshot at step T waits for the one before it (T - snapshot_every) to be held everywhere (its barrier), and
rank 0's progress event of step T + 1 comes after its `take` of T returned; a progress event whose snapshot
costs have `background_ms` says the newest snapshot taken is done. The next generation must restore step S or a
newer one, and from memory when it is S (a committed step as new as a counting snapshot loses to it): restoring
an older step, a fresh start, storage at S, or the run ending there (`RollbackLimitError`) break the promise.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import chaos_harness

# faults that cost one Kubernetes node's memory at most (a stopped node is dropped, or waited for)
LOSSES = ("kill_worker", "kill_agent", "kill_node", "stop_worker", "stop_node", "raise")
MARKERS = {"raise": "raise", "diverge": "diverge", "flip_held": "flip-held"}  # chaos_script's once() markers
MARGIN = 2  # steps a later fault's step must be past the first generation's last, to fire after the restore


@dataclasses.dataclass(frozen=True)
class Promise:
    """Generation `generation` must restore step `step` or a newer one, from memory at `step`; `why` says so."""

    generation: int
    step: int
    why: str


def broken(schedule: chaos_harness.Schedule, out: Path, fired: list[str]) -> list[str]:
    """The promises the run broke: empty where it kept them, or where none is certain."""
    promise = promised(schedule, out, fired)
    if promise is None:
        return []
    problems = []
    for r in sorted(chaos_harness.records(out / "restored"), key=lambda r: r["rank"]):
        if r["generation"] != promise.generation:
            continue
        if "error" in r:
            if r["error"].startswith("RollbackLimitError"):
                problems.append(f"broken promise: generation {promise.generation} rank {r['rank']} ended the run "
                                f"({r['error'][:300]}); {promise.why}")
            continue
        source = r.get("source")
        if r["step"] < promise.step or (r["step"] == promise.step and source != "memory"):
            problems.append(f"broken promise: generation {promise.generation} rank {r['rank']} restored step "
                            f"{r['step']} from {source or 'nothing (a fresh start)'}; {promise.why}")
    return problems[:2]  # every rank decides alike: two say it


def promised(schedule: chaos_harness.Schedule, out: Path, fired: list[str]) -> Promise | None:
    """Where the first recovery must come from, when the schedule and the run's records make it certain."""
    c = schedule.config
    places = c.places.split(",") if c.places else [f"node-{i}" for i in range(c.nodes)]
    if not c.snapshot or c.ranks_array or len(set(places)) < 2:
        return None
    restores = chaos_harness.records(out / "restored")
    generations = sorted({r["generation"] for r in restores})
    if len(generations) < 2:
        return None
    before, after = generations[0], generations[1]
    if any(r.get("step") != 0 or r.get("source") is not None for r in restores if r["generation"] == before):
        return None  # the first generation did not start fresh: not the run this reasoning is about
    steps = progress(out / "events", before)
    last = max(steps, default=0)
    began = min(r["time"] for r in restores if r["generation"] == after)
    said = [*fired, *[""] * (len(schedule.faults) - len(fired))]  # a fault the drive never reached did not fire
    acting = [f for f, what in zip(schedule.faults, said, strict=False) if acted(f, what, out, last, began)]
    if len(acting) != 1 or acting[0].kind not in LOSSES:
        return None  # none (nothing this knows of ended the generation), or more than one node's worth
    loss = acting[0]
    complete = complete_snapshot(steps, c.snapshot, costs_tell=not c.other_snapshot)
    if complete < 1:
        return None
    return Promise(after, complete, (
        f"{loss} lost one Kubernetes node's worth of memory at most (nodes on {', '.join(places)}; every part has a "
        f"copy off its node), and the snapshot of step {complete} was complete on every rank (rank 0 reported step "
        f"{last} in generation {before}): docs/ELASTIC.md promises generation {after} restores step {complete} "
        f"or newer, from memory at {complete}"))


def acted(fault: chaos_harness.Fault, fired: str, out: Path, last: int, began: float) -> bool:
    """Whether `fault` may have fired before the next generation restored (at `began`): a signal that fired
    during recovery or at a step the first generation reached (or nearly: `last` + MARGIN), a fault planted in
    the script whose marker is older; never a flipped committed step, nor held copies (they only delay)."""
    if fault.kind in chaos_harness.SIGNALS:
        return ": fired (" in fired and (fault.at == chaos_harness.RECOVERY or fault.at <= last + MARGIN)
    if fault.kind in MARKERS:
        marker = out / f"once-{MARKERS[fault.kind]}"
        return marker.exists() and marker.stat().st_mtime <= began
    return False


def progress(events: Path, generation: int) -> dict[int, dict[str, Any]]:
    """Rank 0's progress events of `generation` (the agents' `step` events), by step."""
    steps: dict[int, dict[str, Any]] = {}
    for path in sorted(events.glob("*.events.jsonl")) if events.exists() else []:
        for line in path.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue  # an agent killed while writing its last line
            if event.get("kind") == "step" and event.get("generation") == generation \
                    and isinstance(event.get("step"), int):
                steps[event["step"]] = event
    return steps


def complete_snapshot(steps: dict[int, dict[str, Any]], every: int, *, costs_tell: bool) -> int:
    """The newest step whose snapshot rank 0's progress events prove held on every rank (0: none): the event of
    step T + 1 follows the `take` of T (T a multiple of `every`), which waited for the snapshot of T - every;
    with `costs_tell`, its costs with `background_ms` say the snapshot of T itself is done (with another object
    snapshotted each step, the newest taken may be that object's: not told apart)."""
    done = 0
    for step, event in steps.items():
        taken = every * ((step - 1) // every)  # the newest snapshot rank 0 took before this step's report
        if taken >= every and taken == step - 1:
            done = max(done, taken - every)
        if costs_tell and taken >= every and "background_ms" in (event.get("snapshot") or {}):
            done = max(done, taken)
    return done
