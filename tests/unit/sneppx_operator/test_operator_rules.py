"""The operator's counting and phase rules over several passes, against a small model of the cluster: one
disruption is classified the same whichever moment the passes see it, what must not count never counts (an
Ignored exit, a drain, a pod collected with its node), a job being deleted gets nothing, no pod outlives its
finished job, a restart's recovery ends and is measured.

The model is the pure side only: reconcile.plan, its actions carried out at once (a delete removes the pod, a
create adds it Pending), reconcile.settle, and the status written back; the world moves between passes. The
whole pass with its API calls is tests/unit/sneppx_operator/test_operator_pass.py.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sneppx_operator import reconcile

START = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
KEY = bytes(32)
IGNORE_42 = [{"action": "Ignore", "onExitCodes": {"operator": "In", "values": [42]}}]


def spec(*, min_nodes: int = 1, max_nodes: int = 2, max_restarts: int = 5, on_loss: str = "Pause",
         rules: list[Any] | None = None) -> dict[str, Any]:
    return {
        "template": {"spec": {"containers": [{"name": "trainer", "image": "example.org/t:1"}]}},
        "elastic": {"minNodes": min_nodes, "maxNodes": max_nodes},
        "quorum": {"actionOnLoss": on_loss},
        "checkpoint": {"storage": {"pvc": {"claimName": "ckpt"}}},
        "failurePolicy": {"maxRestarts": max_restarts, "rules": rules or [],
                          "restartDelay": {"initialSeconds": 0, "multiplier": 2, "maxSeconds": 0}},
    }


class World:
    """A job, its pods and the nodes; each pass plans, carries out every action at once and writes the status."""

    def __init__(self, job_spec: dict[str, Any], nodes: int = 2) -> None:
        self.spec = job_spec
        self.status: dict[str, Any] = {}
        self.deleting = False
        self.pods: dict[str, reconcile.ObservedPod] = {}
        self.nodes = {f"node-{i}": reconcile.ObservedNode(f"node-{i}", True) for i in range(nodes)}
        self.uids = itertools.count(1)
        self.now = START
        self.created = 0
        self.phases: list[str] = []
        self.recoveries: list[float] = []

    def job(self) -> reconcile.Job:
        return reconcile.Job("train", "ns", "uid-1", 1, self.spec, self.status, deleting=self.deleting)

    def run_pass(self) -> reconcile.Plan:
        self.now += datetime.timedelta(seconds=1)
        job = self.job()
        plan = reconcile.plan(job, list(self.pods.values()), now=self.now, heartbeat_key=KEY, nodes=self.nodes)
        for action in plan.actions:
            if isinstance(action, reconcile.Create) and action.kind == "Pod" and action.name not in self.pods:
                labels = action.body["metadata"]["labels"]
                rank = int(labels["sneppx.io/rank"])
                self.pods[action.name] = reconcile.ObservedPod(
                    action.name, rank, int(labels["sneppx.io/membership-generation"]), "Pending", False, False,
                    None, uid=f"pod-{next(self.uids)}", controller_uid="uid-1",
                )
                self.created += 1
            elif isinstance(action, reconcile.Delete) and action.kind == "Pod":
                pod = self.pods.get(action.name)
                if pod is not None and pod.uid == action.uid:
                    del self.pods[action.name]
        settled = reconcile.settle(job, plan, reconcile.Outcome(plan.actions), now=self.now)
        if settled.status:
            self.status = settled.status
            self.phases.append(self.status["phase"])
        if plan.recovered_after is not None:
            self.recoveries.append(plan.recovered_after)
        return plan

    def kubelet(self, *, start: bool = True) -> None:
        """The scheduler puts a pending pod on its rank's node, or another Ready one; the kubelet starts it
        (unless `start` is false: it stays Pending, e.g. its image is still pulled)."""
        ready = [n for n, node in sorted(self.nodes.items()) if node.ready and not node.cordoned]
        for name, pod in list(self.pods.items()):
            if pod.phase != "Pending" or pod.terminating:
                continue
            if pod.node is None and ready:
                own = f"node-{pod.rank}"
                pod = dataclasses.replace(pod, node=own if own in ready else ready[0])
            if start and pod.node is not None:
                pod = dataclasses.replace(pod, phase="Running", ready=True)
            self.pods[name] = pod

    def settle_down(self, passes: int = 12, **kubelet: Any) -> None:
        for _ in range(passes):
            self.run_pass()
            self.kubelet(**kubelet)

    def change(self, uid: str, **fields: Any) -> None:
        """The pod with this uid changes, if it is still there (the operator may have replaced it)."""
        for name, pod in list(self.pods.items()):
            if pod.uid == uid:
                self.pods[name] = dataclasses.replace(pod, **fields)

    def remove(self, uid: str) -> None:
        self.pods = {name: pod for name, pod in self.pods.items() if pod.uid != uid}

    def history(self) -> list[tuple[str, bool, int | None]]:
        return [(h["reason"], h["counted"], h.get("rank")) for h in self.status.get("restartHistory") or []]


def running_world(job_spec: dict[str, Any], nodes: int = 2) -> World:
    world = World(job_spec, nodes)
    world.settle_down()
    assert world.status["phase"] == "Running", world.status
    return world


# -- one disruption, whichever moment the passes see it ---------------------------------------------------------

def _pod_gc_orphan(world: World, uid: str) -> list[Any]:
    """The node is deleted; the pod garbage collector marks the pod Failed with DisruptionTarget
    DeletionByPodGC and force-deletes it (grace 0)."""
    return [
        lambda: world.nodes.pop("node-1"),
        lambda: world.change(uid, phase="Failed", ready=False, reason="Evicted", disruption="DeletionByPodGC"),
        lambda: world.change(uid, terminating=True, deleted_at=world.now),
    ]


def _node_lost(world: World, uid: str) -> list[Any]:
    """The node goes NotReady; the taint manager deletes the pod, and once the node is out of service the pod
    garbage collector force-deletes it."""
    return [
        lambda: world.nodes.update({"node-1": reconcile.ObservedNode("node-1", False, world.now)}),
        lambda: world.change(uid, terminating=True, deleted_at=world.now, reason="Evicted",
                             disruption="DeletionByTaintManager"),
        lambda: world.change(uid, phase="Failed", ready=False, disruption="DeletionByPodGC"),
    ]


def _drain(world: World, uid: str) -> list[Any]:
    """`kubectl drain`: the node is cordoned; the Eviction API marks the pod and deletes it gracefully; the
    agent exits 143."""
    return [
        lambda: world.nodes.update({"node-1": reconcile.ObservedNode("node-1", True, cordoned=True)}),
        lambda: world.change(uid, terminating=True, deleted_at=world.now, reason="Evicted",
                             disruption="EvictionByEvictionAPI"),
        lambda: world.change(uid, phase="Failed", ready=False, exit_code=143),
    ]


DISRUPTIONS = {  # name -> (the world's steps, the one classification every observation order must give)
    "pod GC of a deleted node's pod": (_pod_gc_orphan, ("Evicted", False)),
    "node lost, taint manager, then pod GC": (_node_lost, ("NodeNotReady", True)),
    "drain": (_drain, ("Evicted", False)),
}


@pytest.mark.parametrize("on_loss", ["Pause", "RestartGroup"])
@pytest.mark.parametrize("seen", list(itertools.product([False, True], repeat=3)),
                         ids=lambda seen: "seen-" + "".join("x" if s else "-" for s in seen))
@pytest.mark.parametrize("name", sorted(DISRUPTIONS))
def test_a_disruption_is_classified_the_same_whichever_moments_the_passes_see(
    name: str, seen: tuple[bool, ...], on_loss: str
) -> None:
    """Exhaustive over which of the disruption's states a pass sees (none of those before the pod is gone,
    some, all). Oracle: the disruption's own classification (reason, counted), once. With minNodes 1 the rank restarts alone; with
    minNodes = maxNodes and RestartGroup the one group restart that follows counts exactly when the loss
    does (and stands for it in restartHistory)."""
    steps, (reason, counted) = DISRUPTIONS[name]
    group = on_loss == "RestartGroup"
    world = running_world(spec(min_nodes=2 if group else 1, on_loss=on_loss))
    uid = world.pods["train-1"].uid
    for step, look in zip(steps(world, uid), seen, strict=True):
        step()
        if look:
            world.run_pass()
    world.remove(uid)  # in the end it is gone
    world.settle_down()
    expected = [("QuorumLost", counted, None)] if group else [(reason, counted, 1)]
    assert world.history() == expected
    assert world.status["restartCount"] == (1 if counted else 0)
    assert world.status["phase"] == "Running"


# -- what must not count, never counts -------------------------------------------------------------------------

@pytest.mark.parametrize("max_restarts", [0, 1, 2])
@pytest.mark.parametrize("exit_code", [1, 42, 137])
def test_a_group_restart_counts_exactly_when_the_exit_behind_it_does(exit_code: int, max_restarts: int) -> None:
    """minNodes = maxNodes with RestartGroup: one rank's exit makes one group restart, counted unless the exit
    code's rule is Ignore; with maxRestarts 0 a counted one fails the job and an Ignored one never does."""
    world = running_world(spec(min_nodes=2, on_loss="RestartGroup", max_restarts=max_restarts, rules=IGNORE_42))
    world.change(world.pods["train-1"].uid, phase="Failed", ready=False, exit_code=exit_code)
    world.settle_down()
    counted = exit_code != 42
    if counted and max_restarts == 0:  # the restart past the budget is not made: the job fails
        assert world.status["phase"] == "Failed" and world.status["restartCount"] == 0
    else:
        assert world.history() == [("QuorumLost", counted, None)]
        assert world.status["phase"] == "Running" and world.status["restartCount"] == (1 if counted else 0)
        assert world.status["membershipGeneration"] == 2


# -- a job being deleted ---------------------------------------------------------------------------------------

@settings(max_examples=80, deadline=None)
@given(gone=st.lists(st.booleans(), min_size=3, max_size=3), exit_codes=st.lists(
    st.sampled_from([None, 0, 1, 42]), min_size=3, max_size=3), on_loss=st.sampled_from(["Pause", "RestartGroup"]))
def test_a_job_being_deleted_creates_nothing_and_counts_nothing(
    gone: list[bool], exit_codes: list[int | None], on_loss: str
) -> None:
    """Foreground deletion: the garbage collector deletes the pods while the job still exists (with its
    deletionTimestamp); whatever it has deleted and however the rest ended, no pass creates, restarts or
    counts anything, nor writes a status."""
    world = running_world(spec(min_nodes=3, max_nodes=3, max_restarts=0, on_loss=on_loss, rules=IGNORE_42))
    before = dict(world.status)
    world.deleting = True
    for rank, (is_gone, code) in enumerate(zip(gone, exit_codes, strict=True)):
        uid = world.pods[f"train-{rank}"].uid
        if is_gone:
            world.remove(uid)
        elif code is not None:
            world.change(uid, phase="Succeeded" if code == 0 else "Failed", ready=False, exit_code=code)
    created = world.created
    for _ in range(3):
        plan = world.run_pass()
        assert plan.restarts == () and plan.status == {}
        assert not [a for a in plan.actions if isinstance(a, reconcile.Create)]
    assert world.created == created and world.status == before


# -- no pod outlives its finished job --------------------------------------------------------------------------

def _raw_pod(rank: int, kubelet_phase: str, trainer_exit: int | None, *, terminating: bool = False) -> Any:
    """A pod as the API server has it: a trainer and a classic sidecar."""
    trainer: dict[str, Any] = {"name": "trainer", "state": {"running": {}}}
    if trainer_exit is not None:
        trainer["state"] = {"terminated": {"exitCode": trainer_exit, "reason": "Completed" if trainer_exit == 0
                                           else "Error"}}
    sidecar_state = {"running": {}} if kubelet_phase in reconcile.ACTIVE_POD_PHASES else {"terminated": {"exitCode": 0}}
    meta: dict[str, Any] = {
        "uid": f"pod-{rank}", "labels": {"sneppx.io/rank": str(rank), "sneppx.io/membership-generation": "1"},
        "ownerReferences": [{"uid": "uid-1", "controller": True}],
    }
    if terminating:
        meta["deletionTimestamp"] = "2026-01-02T03:00:00Z"
    return reconcile.observe_pod(
        f"train-{rank}", meta, {"nodeName": f"node-{rank}", "containers": [{"name": "trainer"}, {"name": "log"}]},
        {"phase": kubelet_phase, "containerStatuses": [trainer, {"name": "log", "state": sidecar_state}]},
    )


KUBELET_PHASES = ["Pending", "Running", "Succeeded", "Failed", "Unknown"]
POD_STATES = [(phase, code, terminating) for phase in KUBELET_PHASES for code in (None, 0, 1)
              for terminating in (False, True) if not (phase == "Pending" and code is not None)]


@pytest.mark.parametrize("end", ["Succeeded", "Failed"])
@pytest.mark.parametrize("state", POD_STATES, ids=[f"{p}-trainer-{c}-{'terminating' if t else 'live'}"
                                                   for p, c, t in POD_STATES])
def test_a_finished_job_stops_every_pod_a_container_of_which_still_runs(state: Any, end: str) -> None:
    """Exhaustive over the kubelet's phase, the trainer's end and Terminating: once the job has ended, a pod is
    deleted exactly when a container of it may still run (a sidecar beside an ended trainer holds the node's
    GPUs) and it is not already being deleted; a pod the kubelet has finished is kept for its logs."""
    kubelet_phase, code, terminating = state
    pod = _raw_pod(1, kubelet_phase, code, terminating=terminating)
    job = reconcile.Job("train", "ns", "uid-1", 1, spec(), {"phase": end})
    plan = reconcile.plan(job, [pod], now=START, heartbeat_key=KEY)
    deleted = [a for a in plan.actions if isinstance(a, reconcile.Delete)]
    assert bool(deleted) == (kubelet_phase in reconcile.ACTIVE_POD_PHASES and not terminating)


def test_a_job_whose_trainers_succeeded_beside_live_sidecars_ends_with_no_pod_running() -> None:
    """Every trainer exits 0 while its sidecar runs on (the pods stay Running): the ranks are done, the job
    Succeeds, and the next pass deletes the pods (the old cleanup judged them by the trainer and kept them)."""
    world = running_world(spec())
    for rank in (0, 1):
        world.pods[f"train-{rank}"] = dataclasses.replace(
            _raw_pod(rank, "Running", 0), uid=world.pods[f"train-{rank}"].uid)
    world.run_pass()
    assert world.status["phase"] == "Succeeded"
    world.run_pass()
    assert world.pods == {}


# -- the phase of a restart ------------------------------------------------------------------------------------

def test_a_group_restart_shows_restarting_until_every_rank_is_back_and_its_recovery_is_measured() -> None:
    world = running_world(spec(min_nodes=2, on_loss="RestartGroup"))
    seen = len(world.phases)
    world.change(world.pods["train-1"].uid, phase="Failed", ready=False, exit_code=1)
    world.settle_down()
    after = world.phases[seen:]
    assert after[0] == "Restarting" and set(after) == {"Restarting", "Running"}, after
    assert after.index("Running") == after.count("Restarting")  # Restarting, then Running for good
    assert len(world.recoveries) == 1 and world.recoveries[0] > 0


def test_restarting_ends_once_the_job_trains_with_quorum_while_a_replacement_is_pending() -> None:
    """minNodes 1 of 2: after rank 1's restart its replacement stays Pending (no node for it yet); the job shows
    the phase the same pods show without any restart (Running, Ready True), and the recovery is measured."""
    world = running_world(spec(min_nodes=1))
    world.change(world.pods["train-1"].uid, phase="Failed", ready=False, exit_code=1)
    world.settle_down(start=False)
    assert world.pods["train-1"].phase == "Pending" and world.status["restartCount"] == 1
    fresh = World(spec(min_nodes=1))
    fresh.settle_down(passes=1)
    fresh.pods = dict(world.pods)
    fresh.settle_down(passes=3, start=False)
    assert world.status["phase"] == fresh.status["phase"] == "Running"
    ready = {c["type"]: c for c in world.status["conditions"]}["Ready"]
    assert ready["status"] == "True"
    assert len(world.recoveries) == 1


# -- a replacement gone before any pass saw it -----------------------------------------------------------------

@pytest.mark.parametrize("seen", [False, True])
def test_a_replacement_deleted_before_any_pass_saw_it_is_recreated_and_not_counted(seen: bool) -> None:
    """Issue 38's suspicion, confirmed and left as a documented limit (docs/OPERATOR.md, "Not guaranteed"): the
    operator counts a deletion only of a pod its status recorded (by uid). A replacement deleted by someone
    before any pass saw it is recreated and not counted; seen once (Pending) first, its deletion counts
    (PodDeleted). Telling "deleted" from "not yet in this replica's watch index" needs the create's uid or a
    fresh list, not a pure rule. Either way the slot is refilled and nothing is counted twice."""
    world = running_world(spec(min_nodes=1))
    world.change(world.pods["train-1"].uid, phase="Failed", ready=False, exit_code=1)
    world.run_pass()  # the restart: counted, the pod deleted
    world.run_pass()  # the replacement created
    replacement = world.pods["train-1"].uid
    if seen:
        world.run_pass()  # seen Pending: its uid is recorded
    world.remove(replacement)
    world.settle_down()
    assert world.history() == [("PodFailed", True, 1)] + ([("PodDeleted", True, 1)] if seen else [])
    assert world.status["phase"] == "Running" and world.pods["train-1"].uid != replacement
