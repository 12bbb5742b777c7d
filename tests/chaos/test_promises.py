"""The promise oracle (promises.py) over made-up run records: it asserts a memory recovery only where the schedule
and the records make it certain, and names each broken promise."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import chaos_harness
import promises
import pytest

CONFIG = chaos_harness.Config(nodes=2, gpus=1, snapshot=1, replicas=1, incremental=False, backend="auto", steps=16,
                              every=5, node_restart_delay=60.0)
KILL = chaos_harness.Fault("kill_node", 8, node=1)


def test_rank_0s_progress_proves_which_snapshot_is_held_everywhere() -> None:
    def events(last: int, done: tuple[int, ...] = ()) -> dict[int, dict[str, Any]]:
        return {s: {"step": s, **({"snapshot": {"background_ms": 1.0}} if s in done else {})}
                for s in range(1, last + 1)}

    assert promises.complete_snapshot(events(8), 1, costs_tell=True) == 6  # report(8) follows take(7): 6 was done
    assert promises.complete_snapshot(events(8, (8,)), 1, costs_tell=True) == 7  # and 7's background ended
    assert promises.complete_snapshot(events(8, (8,)), 1, costs_tell=False) == 6  # another object's, maybe
    assert promises.complete_snapshot(events(2), 1, costs_tell=True) == 0
    assert promises.complete_snapshot(events(9), 4, costs_tell=True) == 4  # take(8) waited for 4
    assert promises.complete_snapshot(events(8), 4, costs_tell=True) == 0
    assert promises.complete_snapshot(events(7, (6,)), 4, costs_tell=True) == 4  # 4's background ended
    assert promises.complete_snapshot(events(10, (10,)), 6, costs_tell=True) == 6


def write_run(out: Path, last: int, after: list[dict[str, Any]], markers: tuple[str, ...] = ()) -> None:
    (out / "restored").mkdir(parents=True)
    (out / "events").mkdir()
    records = [{"generation": 0, "rank": r, "world_size": 2, "time": 100.0, "step": 0, "source": None}
               for r in range(2)] + [{"generation": 1, "rank": r, "world_size": 2, "time": 200.0, **a}
                                     for r, a in enumerate(after)]
    for i, record in enumerate(records):
        (out / "restored" / f"{i}.json").write_text(json.dumps(record))
    (out / "events" / "node-0.events.jsonl").write_text("".join(
        json.dumps({"kind": "step", "generation": 0, "step": s}) + "\n" for s in range(1, last + 1)))
    for name in markers:
        (out / f"once-{name}").write_text("1")
        os.utime(out / f"once-{name}", (150.0, 150.0))


def judged(out: Path, after: list[dict[str, Any]], *, config: chaos_harness.Config = CONFIG,
           faults: tuple[chaos_harness.Fault, ...] = (KILL,), last: int = 8, markers: tuple[str, ...] = ()) -> list[str]:
    write_run(out, last, after, markers)
    fired = [f"{f}: fired (at step {last}, 0.0s to fire)" for f in faults]
    return promises.broken(chaos_harness.Schedule(0, config, faults), out, fired)


MEMORY = [{"step": 6, "source": "memory"}] * 2


@pytest.mark.parametrize(("after", "broken"), [
    (MEMORY, False),
    ([{"step": 7, "source": "memory"}] * 2, False),
    ([{"step": 7, "source": "/ckpts/step-000000007"}] * 2, False),  # a committed step newer than it knows of
    ([{"step": 6, "source": "/ckpts/step-000000006"}] * 2, True),  # as new as the snapshot: memory wins
    ([{"step": 5, "source": "/ckpts/step-000000005"}] * 2, True),
    ([{"step": 0, "source": None}] * 2, True),  # started over
    ([{"error": "RollbackLimitError: step 8 is invalid and none is valid"}] * 2, True),  # ended there
    ([{"error": "CommProtocolError: a piece corrupted on its way"}] * 2, False),  # the next generation tries again
])
def test_a_recovery_after_one_node_lost_must_come_from_the_complete_snapshot(
        tmp_path: Path, after: list[dict[str, Any]], broken: bool) -> None:
    problems = judged(tmp_path, after)
    assert bool(problems) == broken, problems
    assert all(p.startswith("broken promise: generation 1") for p in problems)


UNCERTAIN = ["snapshots off", "one kubernetes node", "world-sized array", "second kill during recovery",
             "second kill soon", "stop first", "diverged before", "not fired"]


@pytest.mark.parametrize("case", UNCERTAIN)
def test_no_promise_is_asserted_where_the_schedule_does_not_make_it_certain(tmp_path: Path, case: str) -> None:
    config, faults, markers = CONFIG, (KILL,), ()
    if case == "snapshots off":
        config = dataclasses.replace(CONFIG, snapshot=0)
    elif case == "one kubernetes node":
        config = dataclasses.replace(CONFIG, places="a,a")
    elif case == "world-sized array":
        config = dataclasses.replace(CONFIG, ranks_array=True)
    elif case == "second kill during recovery":
        faults = (KILL, chaos_harness.Fault("kill_node", chaos_harness.RECOVERY, node=0))
    elif case == "second kill soon":
        faults = (KILL, chaos_harness.Fault("kill_worker", 10, node=0))
    elif case == "stop first":
        faults = (chaos_harness.Fault("stop_node", 8, node=1, hold=4.0), KILL)
    elif case == "diverged before":
        faults, markers = (chaos_harness.Fault("diverge", 7, node=0), KILL), ("diverge",)
    write_run(tmp_path, 8, [{"step": 0, "source": None}] * 2, markers)
    fired = [f"{f}: {'no target' if case == 'not fired' else 'fired'} (at step 8, 0.0s to fire)" for f in faults]
    assert promises.broken(chaos_harness.Schedule(0, config, faults), tmp_path, fired) == []
    if case == "diverged before":  # the same diverge after the restore leaves the promise standing
        os.utime(tmp_path / "once-diverge", (300.0, 300.0))
        assert promises.broken(chaos_harness.Schedule(0, config, faults), tmp_path, fired)


def test_a_later_kill_and_flipped_steps_leave_the_promise_standing(tmp_path: Path) -> None:
    faults = (chaos_harness.Fault("flip_checkpoint", 8), KILL, chaos_harness.Fault("kill_node", 11, node=0))
    assert judged(tmp_path / "good", MEMORY, faults=faults) == []
    assert judged(tmp_path / "bad", [{"step": 5, "source": "/ckpts/step-000000005"}] * 2, faults=faults)


@pytest.mark.parametrize("loss", [chaos_harness.Fault("stop_node", 8, node=1, hold=4.0),
                                  chaos_harness.Fault("kill_agent", 8, node=0),
                                  chaos_harness.Fault("raise", 7, node=1)])
def test_a_lone_stop_or_raise_is_one_nodes_worth_too(tmp_path: Path, loss: chaos_harness.Fault) -> None:
    markers = ("raise",) if loss.kind == "raise" else ()
    assert judged(tmp_path / "good", MEMORY, faults=(loss,), markers=markers) == []
    assert judged(tmp_path / "bad", [{"step": 0, "source": None}] * 2, faults=(loss,), markers=markers)
    no_marker = judged(tmp_path / "unmarked", [{"step": 0, "source": None}] * 2, faults=(loss,))
    assert bool(no_marker) == (loss.kind != "raise")  # a raise that left no marker never happened: no promise
