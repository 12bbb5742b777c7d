"""The randomized controller simulation (operator_sim.py) in plain pytest: a fixed set of seeds that pass on
today's operator, and the minimal schedules of the defects of issue 38 it found: those fixed as regression
tests, those open each an xfail(strict=True) named for its defect, to flip when the fix merges.
`make chaos-operator` runs a campaign of new seeds.
"""

from __future__ import annotations

from typing import Any

import operator_sim as sim
import pytest

# The clean profile: every adversity (a lagging view, takeovers, two replicas over a Lease that is deleted and
# made again, stalls, node NotReady) but counting a pod lost before the operator saw it (the open suspicion).
CLEAN = sim.Profile()
SEEDS_PER_CASE = 100


@pytest.mark.parametrize("first", range(0, 800, SEEDS_PER_CASE))
def test_fixed_seeds_keep_every_invariant(first: int) -> None:
    failed = []
    for seed in range(first, first + SEEDS_PER_CASE):
        spec, schedule = sim.scenario(seed, CLEAN)
        violation = sim.failure_of(spec, schedule, CLEAN)
        if violation is not None:
            failed.append(sim.report(seed, spec, schedule, CLEAN, violation))
    assert not failed, "\n".join(failed)


IGNORE_42 = {"action": "Ignore", "onExitCodes": {"operator": "In", "values": [42]}}
FAIL_3 = {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [3]}}
# The minimal schedules the simulation found for issue 38's defects, each run in sim.EVERYTHING; docs/TESTING.md
# has the seeds that found them. (issue 38's defect, spec, schedule)
FIXED_DEFECTS: dict[str, tuple[str, dict[str, Any], list[sim.Event]]] = {
    "PodGC's force delete counted": ("defect 2", sim.job_spec(1, 2, "Pause", 0), [("podgc", 0)]),
    "a drained pod gone before a pass saw it counted": (
        "defect 2", sim.job_spec(1, 2, "Pause", 2), [("evict_api", 1), ("kubelet",)]),
    "RestartGroup counts an Ignored exit": (
        "defect 4", sim.job_spec(2, 2, "RestartGroup", 0, [IGNORE_42]), [("fail", 1, 42)]),
    "RestartGroup counts a drain": ("defect 4", sim.job_spec(2, 2, "RestartGroup", 1), [("evict_api", 1)]),
    "a sidecar outlives the finished job": ("defect 6", sim.job_spec(1, 2, "Pause", 2), [("complete", True)]),
    "foreground deletion recreates pods": (
        "defect 7", sim.job_spec(1, 1, "Pause", 2), [("delete_job", "foreground"), ("kubelet",), ("pass", 0, None)]),
    "Restarting never ends while a replacement is Pending": (
        "defect 9", sim.job_spec(1, 2, "Pause", 3),
        [("hold", 1), ("fail", 1, 1), ("pass", 0, None), ("kubelet",), ("pass", 0, None)]),
    "another job's ConfigMap relabelled to this job": (
        "defect 3", sim.job_spec(1, 1, "Pause", 4), [("foreign_hang", 0)]),
    "a new leader's view older than the status": (
        "defect 5", sim.job_spec(2, 2, "Pause", 3), [("takeover", 5), ("pass", 3, None)]),
    "a group restart counted twice from a view that lags within one term": (  # seed 408: an index matched by uids alone
        "defect 5 (what is left: a lagging view, no takeover)", sim.job_spec(2, 3, "RestartGroup", 4),
        [("fail", 2, 3), ("evict_api", 0), ("kubelet",), ("pass", 0, (5, "conflict")), ("pass", 0, None),
         ("kubelet",), ("pass", 3, None), ("pass", 2, None)]),
    "a hang report dropped unread while the view lags the pod's start": (  # seed 630; every report read was removed
        "defect 5's cause (a new consequence)", sim.job_spec(1, 2, "Pause", 4),
        [("resize", 1), ("pass", 1, (3, "timeout")), ("pass", 0, None), ("kubelet",), ("hang", 0), ("pass", 2, None)]),
    "a group restart shows Creating and its recovery is never measured": (
        "defect 8", sim.job_spec(1, 1, "RestartGroup", 1), [("user_delete", 0)]),
    # The leader election's planted bugs (docs/TESTING.md): each schedule fails with its bug planted back.
    "a follower makes a missing Lease its own at once": (  # seed 16 with the bug planted
        "defect 1", sim.job_spec(2, 2, "RestartGroup", 2, [FAIL_3]), [("stall", 0, 20), ("suspend", True),
                                                                      ("lease_delete",)]),
    "a leader acts on after reading another holder in the Lease": (
        "defect 1", sim.job_spec(1, 2, "Pause", 3),
        [("lease_replace", "stranger"), ("kubelet",), ("kubelet",), ("fail", 0, 1), ("pass", 0, None)]),
    "the renew deadline ignored": (  # seed 11 with the bug planted
        "mutation audit", sim.job_spec(2, 2, "RestartGroup", 4, [FAIL_3, IGNORE_42]), [("evict_api", 0),
                                                                                       ("stall", 0, 11)]),
    "the write fence always passes": (  # seed 11 with the bug planted
        "mutation audit", sim.job_spec(2, 2, "RestartGroup", 4, [FAIL_3, IGNORE_42]), [("stall", 0, 11),
                                                                                       ("resize", 1)]),
}
# A defect the simulation finds and is not fixed yet goes in as a schedule of its own, marked
# xfail(strict=True, raises=sim.Violation), and moves to FIXED_DEFECTS with its fix (none is open now).

# Defect 10 is the agents' (no report while no generation can form): `sim.wedge` models them with the runtime's
# rule, and these are its cases: minNodes = maxNodes (nothing forms without the wedged pod), and minNodes 1.
WEDGED = {"no generation forms without it": sim.job_spec(2, 2, "Pause", 1),
          "the others form one without it": sim.job_spec(1, 2, "Pause", 1)}
WEDGE_SCHEDULE: list[sim.Event] = [("wedge", 1), ("pass", 0, None), ("kubelet",), ("pass", 0, None)]


@pytest.mark.parametrize("name", list(WEDGED))
def test_a_wedged_pod_is_replaced_once_as_hang(name: str) -> None:
    cluster = sim.run(WEDGED[name], WEDGE_SCHEDULE, sim.EVERYTHING)
    status = cluster._status()
    assert [(e["reason"], e["rank"], e["counted"]) for e in status["restartHistory"]] == [("Hang", 1, True)]


def test_defect_10_planted_back_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The old agents: nobody reports a member missing while the next generation forms."""
    monkeypatch.setattr(sim.pod_agent, "stalled_report_after", lambda *args: None)
    with pytest.raises(sim.Violation, match="a_wedged_pod_is_replaced_as_hang"):
        sim.run(WEDGED["no generation forms without it"], WEDGE_SCHEDULE, sim.EVERYTHING)
    sim.run(WEDGED["the others form one without it"], WEDGE_SCHEDULE, sim.EVERYTHING)  # rank 0 of theirs reports


@pytest.mark.parametrize("name", list(FIXED_DEFECTS))
def test_fixed_defect_schedules(name: str) -> None:
    _, spec, schedule = FIXED_DEFECTS[name]
    sim.run(spec, schedule, sim.EVERYTHING)


def test_a_pod_deleted_before_any_pass_saw_it_is_replaced_uncounted() -> None:
    """Issue 38's suspicion, confirmed and decided: a replacement deleted before the operator saw it is not
    counted. What would classify its loss (its node, its DisruptionTarget) went with it, and a count must never
    charge the budget for what may have been the cluster's doing (docs/OPERATOR.md, "Not guaranteed")."""
    schedule = [("user_delete", 1), ("pass", 0, None), ("kubelet",), ("pass", 0, None), ("user_delete", 1)]
    cluster = sim.run(sim.job_spec(1, 2, "Pause", 3), schedule, CLEAN)
    assert cluster.job is not None
    status = cluster.job["status"]
    assert status["restartCount"] == 1 and status["phase"] == "Running"
    assert [(e["reason"], e["counted"]) for e in status["restartHistory"]] == [("PodDeleted", True)]


def test_a_failure_shrinks_to_a_schedule_that_still_fails_and_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shrinker keeps the failure (the same invariant) and the report names the seed. (The oracle planted
    wrong: every cause Ignored, so a counted restart breaks an invariant.)"""
    monkeypatch.setattr(sim, "expected_action", lambda spec, exit_code, disruption: "Ignore")
    failing = ((seed, *sim.scenario(seed, CLEAN)) for seed in range(100))
    seed, spec, schedule, violation = next((s, sp, sc, v) for s, sp, sc in failing
                                           if (v := sim.failure_of(sp, sc, CLEAN)) is not None)
    small = sim.shrink(spec, schedule, CLEAN, violation.invariant)
    assert len(small) < len(schedule)
    again = sim.failure_of(spec, small, CLEAN)
    assert again is not None and again.invariant == violation.invariant
    text = sim.report(seed, spec, schedule, CLEAN, violation)
    assert text.startswith(f"seed {seed}: ") and "no known defect" in text


def test_the_schedule_is_the_whole_randomness() -> None:
    """A seed replays exactly: the same schedule, the same end."""
    spec, schedule = sim.scenario(11, CLEAN)
    first, second = sim.run(spec, schedule, CLEAN), sim.run(spec, schedule, CLEAN)
    assert first.job == second.job and first.pods == second.pods


def test_the_schema_check_refuses_what_the_api_server_would() -> None:
    good = {"phase": "Running", "restartCount": 1}
    assert sim.schema_problems(good, sim.STATUS_SCHEMA) == []
    assert sim.schema_problems({"phase": "Sleeping"}, sim.STATUS_SCHEMA)
    assert sim.schema_problems({"restartCount": "1"}, sim.STATUS_SCHEMA)
    assert sim.schema_problems({"unknown": 1}, sim.STATUS_SCHEMA)
    assert sim.schema_problems({"restartHistory": [{}] * 1000}, sim.STATUS_SCHEMA)
