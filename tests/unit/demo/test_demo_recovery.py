"""How the demo and `bench elastic` read a recovery out of an ElasticTrainer run's events (demo.recovery_after)."""

from __future__ import annotations

from typing import Any

from SneppX_ALG import demo


def event(t: float, kind: str, agent: str = "node-0", **fields: Any) -> dict[str, Any]:
    return {"t": t, "agent": agent, "kind": kind, **fields}


RUN = [
    event(0.0, "generation", generation=0, world_size=4, members=["node-0", "node-1"]),
    event(0.1, "generation", "node-1", generation=0, world_size=4, members=["node-0", "node-1"]),
    event(0.5, "restored", generation=0, step=None, rolled_back=[]),
    *[event(1.0 + 0.1 * s, "step", generation=0, step=s, metrics={"loss": 3.0}) for s in range(1, 14)],
    # killed at t=2.35; a step that finished before the kill is reported just after it
    event(2.36, "step", generation=0, step=14, metrics={"loss": 3.0}),
    event(2.40, "failure", reason="rank 0's collectives failed: PeerLostError"),
    event(2.41, "failure", reason="rank 1's collectives failed: PeerLostError"),
    event(3.10, "generation", generation=1, world_size=2, members=["node-0"]),
    event(3.30, "restored", generation=1, step=10, rolled_back=[]),
    event(3.50, "step", generation=1, step=11, metrics={"loss": 3.0}),
]


def test_a_recovery_is_timed_from_the_kill_to_each_milestone():
    recovery = demo.recovery_after(RUN, killed_at=2.35)
    assert recovery is not None
    assert round(recovery.detected, 2) == 0.05 and recovery.reason.startswith("rank 0's")  # the first failure
    assert round(recovery.sealed, 2) == 0.75 and recovery.world_size == 2
    assert round(recovery.resumed, 2) == 1.15
    assert recovery.lost_steps == 13 - 10  # step 14 finished after the kill: not counted as done before it


def test_a_recovery_in_progress_is_none_until_the_next_generation_trains():
    assert demo.recovery_after(RUN[:-1], killed_at=2.35) is None
    assert demo.recovery_after(RUN[:-3], killed_at=2.35) is None
    assert demo.recovery_after(RUN, killed_at=4.0) is None  # nothing failed after that


def test_a_run_restored_from_scratch_lost_every_step():
    run = [*RUN[:-2], event(3.30, "restored", generation=1, step=None, rolled_back=[]),
           event(3.50, "step", generation=1, step=1, metrics={"loss": 4.0})]
    recovery = demo.recovery_after(run, killed_at=2.35)
    assert recovery is not None and recovery.lost_steps == 13


def test_the_event_log_reads_only_complete_lines_as_they_are_appended(tmp_path):
    log = demo.EventLog(str(tmp_path / "events"))
    assert log.poll() == []  # the directory does not exist yet
    (tmp_path / "events").mkdir()
    path = tmp_path / "events" / "node-0.events.jsonl"
    path.write_text('{"t": 1.0, "kind": "generation"}\n{"t": 2.0, "ki')
    (tmp_path / "events" / "notes.txt").write_text("not an event file\n")
    assert [e["t"] for e in log.poll()] == [1.0]
    with open(path, "a") as f:
        f.write('nd": "step"}\n')
    (tmp_path / "events" / "node-1.events.jsonl").write_text('{"t": 1.5, "kind": "failure"}\n')
    assert [e["t"] for e in log.poll()] == [1.5, 2.0]
    assert [e["t"] for e in log.events] == [1.0, 1.5, 2.0] and log.poll() == []
