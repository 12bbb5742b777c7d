"""A randomized, seeded simulation of the operator against an adversarial model of the API (issue 38).

Why: the unit tests check each decision alone and test_operator_pass.py checks one pass killed between calls;
the defects that remain only show when the operator's view lags the truth, when others change the job's objects
(PodGC, a drain, a user's kubectl delete, another job's agent), when calls fail and when the process dies
between two calls. This drives the real pass (handlers.reconcile_job) through random schedules of such events
and checks, after every step, the promises of docs/OPERATOR.md as small named invariants.

The model is test_operator_pass.Cluster, extended (SimCluster): the truth (the job, its pods and their nodes,
its rendezvous object) plus the operator's watch view of the pods, which lags the truth by as many changes as each
pass event says (a watch delivers the newest state of each object, so a dropped event is a skipped snapshot; the
view never goes back), and two operator replicas, each with its own handlers.py state and the real leader.py
elector over a model of the Lease, so every write passes the product's fence and is checked against the Lease's
history. Every random choice is in the schedule itself (the pass events carry their lag and their API
fault), so a schedule replays exactly and can be shrunk (delta debugging over the event list).

Reproduce a seed:   .venv/bin/python tests/unit/sneppx_operator/operator_sim.py --seed 17 -v
A campaign:         .venv/bin/python tests/unit/sneppx_operator/operator_sim.py --schedules 2000
(`make chaos-operator`). A failure prints the seed, the invariant, and the shrunk schedule.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import itertools
import logging
import pathlib
import random
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import yaml

sys.path.insert(0, str(pathlib.Path(__file__).parent))  # test_operator_pass, also when run as a script

import kubernetes
from kubernetes.client import ApiException
from test_operator_leader import Leases
from test_operator_pass import KEY, Cluster, Crash, Indexes

from SneppX_ALG.contract import job_object
from SneppX_ALG.elastic import pod as pod_agent
from sneppx_operator import defaults, handlers, k8s, leader, metrics, reconcile

CRD = pathlib.Path(__file__).parents[3] / "crds" / "sneppx.io_elastictrainingjobs.yaml"
STATUS_SCHEMA: dict[str, Any] = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"][
    "openAPIV3Schema"]["properties"]["status"]
START = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
EXIT_CODES = (1, 2, 3, 42, 137, 143, 255)
RULE_CHOICES = (
    {"action": "Ignore", "onExitCodes": {"operator": "In", "values": [42]}},
    {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [3]}},
    {"action": "Restart", "onExitCodes": {"operator": "In", "values": [137, 143]}},
    {"action": "Ignore", "onExitCodes": {"operator": "NotIn", "values": [1, 2, 3, 137]}},
)
# The DisruptionTarget reasons the docs say never count (the cluster's doing, not the job's).
CLUSTER_DISRUPTIONS = ("EvictionByEvictionAPI", "DeletionByPodGC")
# The two replicas' election, with leader.py's default timings (seconds of the model's clock).
ELECTION = handlers.Election("operators", "sneppx-operator")
# What one operator process keeps in handlers.py (its term, which pod indexes it trusts, its elector): each
# replica has its own, swapped in while it runs (SimCluster.switch).
PROCESS_STATE = ("_term", "_trusted", "_listed", "_rendezvous_seen", "_elector")

Event = tuple[Any, ...]


class Violation(AssertionError):
    """An invariant broke: which one, and how."""

    def __init__(self, invariant: str, message: str):
        super().__init__(f"{invariant}: {message}")
        self.invariant = invariant


class ServerError(Exception):
    """A 5xx the client raises (on a read or a status write)."""


# ---- the oracle: what the docs say each cause means, written apart from policy.py --------------------------


def expected_action(spec: Mapping[str, Any], exit_code: int | None, disruption: str | None) -> str:
    """Restart (counted), Ignore (replaced, not counted) or FailJob, as docs/OPERATOR.md states the rules."""
    if disruption in CLUSTER_DISRUPTIONS:
        return "Ignore"
    if exit_code is not None:
        for rule in (spec.get("failurePolicy") or {}).get("rules") or []:
            listed = exit_code in rule["onExitCodes"]["values"]
            if listed == (rule["onExitCodes"]["operator"] == "In"):
                return str(rule["action"])
    return "Restart"


@dataclasses.dataclass
class Cause:
    what: str  # the event that took the pod
    action: str  # Restart (counted), Ignore or FailJob, as the docs' rules say
    # False when no promise covers it: its pod already on its way out (a job failing, a resize or suspend the
    # operator had not yet seen), or two causes raced for one pod. Either outcome is then right.
    covered: bool = True


# ---- the CRD's schema, for the status (the subset of OpenAPI v3 the CRD uses) -----------------------------


def schema_problems(value: Any, schema: Mapping[str, Any], path: str = "status") -> list[str]:
    kind = schema.get("type")
    checks = {"object": dict, "array": list, "string": str, "boolean": bool}
    if kind in checks and not isinstance(value, checks[kind]):
        return [f"{path}: {value!r} is not {kind}"]
    if kind in ("integer", "number") and (isinstance(value, bool) or not isinstance(
            value, int if kind == "integer" else (int, float))):
        return [f"{path}: {value!r} is not {kind}"]
    out: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{path}: {value!r} not in {schema['enum']}")
    if isinstance(value, str) and not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)):
        out.append(f"{path}: length {len(value)} out of bounds")
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if number and not schema.get("minimum", value) <= value <= schema.get("maximum", value):
        out.append(f"{path}: {value} out of bounds")
    if isinstance(value, list):
        if len(value) > schema.get("maxItems", len(value)):
            out.append(f"{path}: {len(value)} items, at most {schema['maxItems']}")
        for i, item in enumerate(value):
            out += schema_problems(item, schema.get("items") or {}, f"{path}[{i}]")
    if isinstance(value, dict) and "properties" in schema:
        for key in schema.get("required") or []:
            if key not in value:
                out.append(f"{path}: {key} is required")
        for key, item in value.items():
            if key not in schema["properties"]:
                out.append(f"{path}.{key}: not in the schema (pruned by the API server)")
            else:
                out += schema_problems(item, schema["properties"][key], f"{path}.{key}")
    return out


# ---- the operator's replicas and their Lease ----------------------------------------------------------------


@dataclasses.dataclass
class Replica:
    """One operator process: its elector (the real leader.py, wired as the fence by handlers.elector_for), its
    handlers.py state while another runs, and what the Lease model saw it do (the write fence's oracle)."""

    identity: str
    state: dict[str, Any]
    elector: leader.Elector | None = None
    fence: Callable[[], None] | None = None
    took_over: bool = False  # its elector said it leads now: a new term begins before its next pass
    renewed_at: float | None = None  # the model's clock at its last successful write of itself into the Lease
    renewed_seq: int = 0  # that write's place in the order of all Lease writes
    read_other: bool = False  # it read a Lease naming another holder (or none) since that write
    next_round: float = 0.0
    stalled_until: float = 0.0  # its election thread starved, or its Lease calls time out, until then


class ReplicaLeases:
    """The Lease API as one replica calls it (leader.py's CoordinationV1Api): the shared model, with what the
    replica read and wrote recorded for the fence's oracle."""

    def __init__(self, cluster: SimCluster, replica: Replica):
        self.cluster, self.replica = cluster, replica

    def read_namespaced_lease(self, name: str, namespace: str, **kw: Any) -> kubernetes.client.V1Lease:
        try:
            lease = self.cluster.leases.read_namespaced_lease(name, namespace, **kw)
        except ApiException:
            self.replica.read_other = True
            raise
        if (lease.spec.holder_identity or "") != self.replica.identity:
            self.replica.read_other = True
        return lease

    def create_namespaced_lease(self, namespace: str, body: kubernetes.client.V1Lease, **kw: Any) -> None:
        before = self.cluster.lease_holder()
        self.cluster.leases.create_namespaced_lease(namespace, body, **kw)
        self.cluster.lease_written(self.replica, before, body)

    def replace_namespaced_lease(self, name: str, namespace: str, body: kubernetes.client.V1Lease,
                                 **kw: Any) -> None:
        before = self.cluster.lease_holder()
        self.cluster.leases.replace_namespaced_lease(name, namespace, body, **kw)
        self.cluster.lease_written(self.replica, before, body)


# ---- the model --------------------------------------------------------------------------------------------


class SimCluster(Cluster):
    """Cluster with a lagging watch view, API faults, others' changes and the invariants' bookkeeping."""

    def __init__(self, spec: Mapping[str, Any], profile: Profile):
        super().__init__(spec)
        self.profile = profile
        self.now = START
        self.history: list[dict[str, reconcile.ObservedPod]] = [{}]  # the pods after each change
        self.seen = [0, 0]  # each replica's view of the pods: history[seen[replica]]
        # The operator's two replicas over one Lease (made released: the first round takes it at once).
        self.leases = Leases()
        self.leases._store(kubernetes.client.V1Lease(
            metadata=kubernetes.client.V1ObjectMeta(name=ELECTION.name, namespace=ELECTION.namespace),
            spec=kubernetes.client.V1LeaseSpec(holder_identity="", renew_time=self.now, lease_duration_seconds=1)))
        self.lease_writes = 0
        self.acquired: list[tuple[int, str]] = []  # (Lease write, identity) of each takeover of the Lease
        self.incarnations = itertools.count()
        self.replicas: list[Replica] = []
        self.current: int | None = None  # the replica whose handlers.py state is swapped in
        self.decided = 0  # the view of the last pass that ran to its end
        self.skew = datetime.timedelta()  # the operator's clock minus the cluster's
        self.held: set[int] = set()  # ranks whose pods created from now on stay Pending
        self.known_pods: set[str] = set()  # uids of the pods created so far
        self.sidecars: set[str] = set()  # uids of pods whose sidecar still runs after the trainer ended
        # The nodes (one pod of the job per node, as for GPU nodes): a drain cordons one, PodGC's force delete of
        # a running pod follows its node's removal, and the autoscaler adds a node when none is free.
        self.nodes = {f"node-{i}": reconcile.ObservedNode(f"node-{i}", True) for i in range(3)}
        self.node_names = itertools.count(3)
        self.foreign: reconcile.ObservedObject | None = None  # another job's object relabelled to this job
        self.hung: dict[str, job_object.HungRank] = {}  # the hang reports in the job's own object, by pod
        self.wedged: set[str] = set()  # uids of pods whose agent is wedged (defect 10: `wedge`)
        self.causes: dict[str, Cause] = {}  # pod uid -> what took it
        self.earned_failure = False  # a cause the docs say fails the job
        self.completed = False
        self.fault: tuple[int, str] | None = None  # (the pass's n-th API call, what goes wrong there)
        self.recovery_due = False  # a restart was decided, and no pass has measured the recovery since
        self.calls = 0

    # -- the API, with faults --

    def _call(self, verb: str) -> str | None:
        """Count the pass's API call; raise (or return) the fault the pass event planned for it."""
        self.calls += 1
        if self.fault is None or self.fault[0] != self.calls:
            return None
        what = self.fault[1]
        if what == "crash":
            raise Crash()
        if what == "error" and verb != "apply":
            raise ServerError("503 the server is unavailable")
        if what == "conflict" and verb == "patch":
            raise k8s.StatusConflict("409 moved on")
        return what  # apply: "error"/"conflict" become a refusal, "timeout" raises after the call went through

    def read_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        fault = self._call("read")
        job = None if self.job is None else copy.deepcopy(self.job)
        if fault == "timeout":
            raise TimeoutError("read timed out")
        return job

    def list_pods(self, namespace: str, name: str) -> list[reconcile.ObservedPod]:
        """A fresh list from the API server: the truth, not the lagging view."""
        fault = self._call("read")
        pods = super().list_pods(namespace, name)
        if fault == "timeout":
            raise TimeoutError("list timed out")
        return pods

    def patch_job_status(self, namespace: str, name: str, uid: str, version: str, patch: Mapping[str, Any]) -> str:
        if not patch:
            return version
        self._fenced()
        fault = self._call("patch")
        if self.job is None:
            raise k8s.StatusConflict("404")
        last = (self._status().get("restartHistory") or [None])[-1]
        written = super().patch_job_status(namespace, name, uid, version, patch)
        problems = schema_problems(self.job["status"], STATUS_SCHEMA)
        if problems:
            raise Violation("status_admitted_by_the_crd_schema", "; ".join(problems[:3]))
        if (self._status().get("restartHistory") or [None])[-1] != last:  # a restart decided
            self.recovery_due = True
            check_a_restart_shows_restarting(self)
        if fault == "timeout":
            raise TimeoutError("the write went through, its answer was lost")
        return written

    def apply(self, namespace: str, actions: Sequence[reconcile.Action]) -> reconcile.Outcome:
        done: list[reconcile.Action] = []
        for action in actions:
            self._fenced()
            fault = self._call("apply")
            if fault in ("error", "conflict"):
                return reconcile.Outcome(tuple(done), reconcile.Refusal(action, 503, "the server is unavailable"))
            if isinstance(action, reconcile.Create):
                check_nothing_created_for_a_deleted_job(self, action)
            if isinstance(action, reconcile.Delete) and action.kind == "Pod":
                check_never_a_healthy_pod_deleted(self, action)
            if isinstance(action, reconcile.PutRecords):  # the base model keeps no removals: hang reports handled
                for key, value in action.records:
                    if value is None and key.startswith(job_object.HUNG_PREFIX):
                        self.hung.pop(key[len(job_object.HUNG_PREFIX):], None)
            if isinstance(action, reconcile.DeleteJob):
                if self.job is not None and self.job["metadata"]["uid"] == action.uid:
                    self._collect_job()
                done.append(action)
            else:
                created = isinstance(action, reconcile.Create) and action.kind == "Pod" and action.name not in self.pods
                done += super().apply(namespace, [action]).done
                pod = self.pods.get(action.name)
                if created and pod is not None:  # a held rank's pod finds no room: it stays unbound, Pending
                    node = None if pod.rank in self.held else self._schedule()
                    self.pods[pod.name] = dataclasses.replace(pod, node=node)
            self._changed()
            if fault == "timeout":
                raise TimeoutError("the call went through, its answer was lost")
        return reconcile.Outcome(tuple(done))

    def measured(self, namespace: str, name: str, status: Mapping[str, Any], history: Sequence[Any],
                 recovered_after: float | None) -> None:
        """metrics.record_pass: a pass's figures; a recovery measured (sneppx_job_recovery_seconds)."""
        if recovered_after is not None:
            self.recovery_due = False

    def _fenced(self) -> None:
        """A write leaves this replica as k8s.py sends one: past the product's fence (handlers.elector_for wired
        it: leader.NotLeaderError when this replica may not act), then checked against the Lease's history."""
        k8s._guard()
        check_one_replica_writes(self)

    def indexes(self) -> Indexes:
        assert self.current is not None
        view = self.history[self.seen[self.current]]
        own = self.rendezvous
        if own is not None:
            own = dataclasses.replace(own, view=dataclasses.replace(own.view, hung=tuple(self.hung.values())))
        objects = [o for o in (self.foreign, own) if o is not None]
        nodes = {name: [node] for name, node in self.nodes.items()}  # the nodes' watch is taken not to lag
        return Indexes({KEY: list(view.values())}, nodes, {KEY: objects} if objects else {})

    # -- the truth changing --

    def _schedule(self) -> str:
        """The node the scheduler binds a new pod to: a ready, uncordoned node holding none of the job's pods
        (a new one from the autoscaler when there is none)."""
        taken = {p.node for p in self.pods.values()}
        free = [n.name for n in self.nodes.values() if n.ready and not n.cordoned and n.name not in taken]
        if free:
            return free[0]
        name = f"node-{next(self.node_names)}"
        self.nodes[name] = reconcile.ObservedNode(name, True)
        return name

    def _changed(self) -> None:
        if self.pods != self.history[-1]:  # a lag is counted in changes to the pods
            self.history.append(dict(self.pods))
        self.now += datetime.timedelta(seconds=1)
        self.election_rounds()
        if self.job is None:
            return
        check_one_pod_per_rank(self)

    def _collect_job(self) -> None:
        """The job is gone: the garbage collector deletes what it owned."""
        self.job = None
        self.pods.clear()
        self.sidecars.clear()

    def _status(self) -> Mapping[str, Any]:
        return (self.job or {}).get("status") or {}

    def _live(self, rank: int) -> reconcile.ObservedPod | None:
        pod = self.pods.get(f"train-{rank}")
        if pod is None or pod.terminating or pod.phase not in ("Pending", "Running"):
            return None
        return pod

    def _record(self, pod: reconcile.ObservedPod, what: str, action: str) -> None:
        """The cause of a pod's end, and the promise that covers it (none for a pod already on its way out)."""
        status = self._status()
        seen = pod.uid in {r.get("uid") for r in status.get("ranks") or []}
        covered = (
            self.job is not None and "deletionTimestamp" not in self.job["metadata"]
            and status.get("phase") not in ("Succeeded", "Failed", "Suspended")
            and pod.generation == status.get("membershipGeneration") and pod.rank < int(status.get("worldSize") or 0)
            and self._wanted() == int(status.get("worldSize") or 0) and not self.earned_failure
            # A pod gone before any pass saw it took what would classify it along (its node, its condition): it is
            # replaced uncounted (docs/OPERATOR.md, "Not guaranteed"). A hung pod or a NotReady node's pod stays.
            and (seen or action != "Restart" or what in ("hang", "node_down"))
        )
        earlier = self.causes.get(pod.uid)
        if earlier is not None:  # two causes raced for one pod: either may be the one the operator saw
            earlier.covered = earlier.covered and covered and earlier.action == action
            if action == "FailJob":
                earlier.action = action
            self._judge()
            return
        self.causes[pod.uid] = Cause(what, action, covered)
        self._judge()

    def _judge(self) -> None:
        """Whether the covered causes so far earn the job its failure (a FailJob exit, or the budget overrun)."""
        covered = [c for c in self.causes.values() if c.covered]
        counted = sum(1 for c in covered if c.action == "Restart")
        budget = int(((self.job or {}).get("spec") or {}).get("failurePolicy", {}).get("maxRestarts", 0))
        self.earned_failure = any(c.action == "FailJob" for c in covered) or counted > budget

    def _edit_spec(self, change: Callable[[dict[str, Any]], None]) -> None:
        if self.job is None or "deletionTimestamp" in self.job["metadata"]:
            return
        before = self._wanted()
        change(self.job["spec"])
        status = self._status()
        if self._wanted() != before and status.get("phase") not in ("Succeeded", "Failed"):
            # A cause the operator had not yet seen when the world size changed under it (suspend, resize) is
            # judged under the new spec, in which its pod is stale: no promise covers it, nor a completion.
            recorded = {e.get("podUid") for e in status.get("restartHistory") or []}
            for uid, cause in self.causes.items():
                if uid not in recorded:
                    cause.covered = False
            self.completed = False
            self.recovery_due = False  # a new generation's start is not a restart's recovery
            self._judge()
        self._bump()

    def _wanted(self) -> int:
        """The world size the spec asks for now."""
        spec = (self.job or {}).get("spec") or {}
        return 0 if spec.get("suspend") else int(spec.get("elastic", {}).get("maxNodes", 0))

    def _bump(self) -> None:
        assert self.job is not None
        meta = self.job["metadata"]
        meta["generation"] += 1
        meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)

    def kubelet(self) -> None:
        """Pods start and become ready; pods being deleted finish; the garbage collector's foreground step."""
        view = self.history[self.decided]
        dependents = bool(self.pods)
        for name, pod in list(self.pods.items()):
            seen = view.get(name)
            if pod.terminating and self.profile.grace_outlasts_a_pass and not (seen and seen.terminating):
                continue  # its grace period outlasts the operator's next pass
            if pod.terminating:
                del self.pods[name]
                self.sidecars.discard(pod.uid)
            elif pod.phase == "Pending" and not (pod.rank in self.held and pod.uid not in self.known_pods) and (
                    pod.node not in self.nodes or self.nodes[pod.node].ready):  # a NotReady node starts nothing
                self.pods[name] = dataclasses.replace(pod, phase="Running", ready=True, created_at=self.now)
        if self.job is not None and "deletionTimestamp" in self.job["metadata"]:
            if dependents:  # the garbage collector deletes the dependents, then (a step later) the job
                self.pods = {n: dataclasses.replace(p, terminating=True) for n, p in self.pods.items()}
            else:
                self._collect_job()
        self._changed()

    def event(self, event: Event) -> None:
        """One change to the world (the operator's passes are apart: run_pass)."""
        kind, *args = event
        if kind == "kubelet":
            self.kubelet()
            return
        if kind == "wedge":
            wedge(self, args[0])
            self._changed()
            return
        if kind in ("fail", "evict_kubelet", "evict_api", "podgc", "user_delete", "hang", "foreign_hang"):
            pod = self._live(args[0])
            if pod is None or (pod.phase != "Running" and kind not in ("podgc", "user_delete")):
                return
            if kind == "podgc" and pod.node is None:  # PodGC leaves an unbound pod that is not being deleted
                return
            spec = self.job["spec"] if self.job else {}
            if kind == "fail":
                code = args[1]
                self.pods[pod.name] = dataclasses.replace(pod, phase="Failed", ready=False, exit_code=code,
                                                          reason="Error")
                self._record(pod, f"exit {code}", expected_action(spec, code, None))
            elif kind == "evict_kubelet":  # node pressure: the kubelet's own eviction counts
                self.pods[pod.name] = dataclasses.replace(pod, phase="Failed", ready=False, reason="Evicted",
                                                          disruption="TerminationByKubelet")
                self._record(pod, kind, expected_action(spec, None, "TerminationByKubelet"))
            elif kind == "evict_api":  # `kubectl drain`: the node cordoned, then DisruptionTarget, a graceful delete
                if pod.node in self.nodes:
                    self.nodes[pod.node] = dataclasses.replace(self.nodes[pod.node], cordoned=True)
                self.pods[pod.name] = dataclasses.replace(pod, terminating=True, reason="Evicted",
                                                          disruption="EvictionByEvictionAPI", deleted_at=self.now)
                self._record(pod, kind, expected_action(spec, None, "EvictionByEvictionAPI"))
            elif kind == "podgc":  # its node is gone: DisruptionTarget DeletionByPodGC and a force delete, at once
                self.nodes.pop(pod.node or "", None)
                del self.pods[pod.name]
                self._record(pod, kind, expected_action(spec, None, "DeletionByPodGC"))
            elif kind == "user_delete":  # kubectl delete pod: a graceful delete
                self.pods[pod.name] = dataclasses.replace(pod, terminating=True, deleted_at=self.now)
                self._record(pod, kind, expected_action(spec, None, None))
            elif kind == "hang":  # its own job's agents report it wedged
                self._report_hang(pod, own=True)
                self._record(pod, kind, expected_action(spec, None, None))
            elif kind == "foreign_hang":  # another job's agent relabels its object
                self._report_hang(pod, own=False)
        elif kind == "complete":  # every rank's trainer exits 0 (with a sidecar still running, if args[0])
            status = self._status()
            world = int(status.get("worldSize") or 0)
            pods = [self._live(r) for r in range(world)]
            ready = all(p is not None and p.phase == "Running" for p in pods)
            if status.get("phase") != "Running" or self._wanted() != world or not ready:
                return
            raced = False
            for pod in pods:
                assert pod is not None
                # A sidecar that runs on keeps the kubelet's phase Running after the trainer exited.
                self.pods[pod.name] = dataclasses.replace(pod, phase="Succeeded", ready=False, exit_code=0,
                                                          pod_phase="Running" if args[0] else "")
                if pod.uid in self.causes:  # a hang report raced the pod's success
                    self.causes[pod.uid].covered = False
                if pod.name in self.hung:  # unread: a pass whose view is a moment older (the pod still Running)
                    raced = True  # may replace it, as one at that moment would; the rank then runs again
                if args[0]:
                    self.sidecars.add(pod.uid)
            self._judge()
            self.completed = not self.earned_failure and not raced
        elif kind == "suspend":
            self._edit_spec(lambda spec: spec.__setitem__("suspend", args[0]))
        elif kind == "resize":
            def resize(spec: dict[str, Any]) -> None:
                spec["elastic"]["maxNodes"] = args[0]
                spec["elastic"]["minNodes"] = min(spec["elastic"]["minNodes"], args[0])
            self._edit_spec(resize)
        elif kind == "hold":
            self.held.add(args[0])
            self.known_pods = {p.uid for p in self.pods.values()}
        elif kind == "clock":
            self.skew += datetime.timedelta(seconds=args[0])
        elif kind == "takeover":  # a rolling update: the leader stops (releasing the Lease) and restarts; the
            # other replica, its view as it was (a lag), takes the release in the round that comes next
            for index, replica in enumerate(self.replicas):
                if replica.elector is not None and replica.elector.holds():
                    self.switch(index)
                    replica.elector.stop()
                    self.start_replica(index)
                    other = 1 - index
                    self.seen[other] = max(self.seen[other], len(self.history) - 1 - args[0])
                    successor = self.replicas[other]
                    if successor.elector is not None and successor.stalled_until <= self.monotonic():
                        successor.elector.campaign_round()  # its round comes first: it takes the release
                        successor.next_round = self.monotonic() + ELECTION.retry_period
                    break
        elif kind == "lease_delete":  # an admin deletes the Lease (before a `helm upgrade`, say)
            self.leases.delete(ELECTION.name)
        elif kind == "lease_replace":  # the Lease made again by another hand: the chart's (no holder), a stranger's
            self.leases.delete(ELECTION.name)
            self.leases._store(kubernetes.client.V1Lease(
                metadata=kubernetes.client.V1ObjectMeta(name=ELECTION.name, namespace=ELECTION.namespace),
                spec=kubernetes.client.V1LeaseSpec(holder_identity=args[0] or None, lease_duration_seconds=15,
                                                   renew_time=self.now if args[0] else None)))
        elif kind == "stall":  # a replica's election thread starves (or its Lease calls time out) for a while
            replica = self.replicas[args[0]]
            replica.stalled_until = max(replica.stalled_until, self.monotonic() + args[1])
        elif kind == "node_down":  # a node stops reporting: NotReady; its pod stays as it was, not ready
            pod = self._live(args[0])
            if pod is not None and pod.node in self.nodes and self.nodes[pod.node].ready:
                self.nodes[pod.node] = dataclasses.replace(self.nodes[pod.node], ready=False, since=self.now)
                self.pods[pod.name] = dataclasses.replace(pod, ready=False)
                self._record(pod, kind, "Restart")
        elif kind == "delete_job" and self.job is not None:
            if args[0] == "foreground":
                self.job["metadata"]["deletionTimestamp"] = job_object.timestamp(self.now)
                self.job["metadata"]["finalizers"] = ["foregroundDeletion"]
                for name, pod in self.pods.items():  # the garbage collector deletes the dependents first
                    self.causes.setdefault(pod.uid, Cause("deleted with its job (foreground)", "Ignore"))
                    self.pods[name] = dataclasses.replace(pod, terminating=True)
            else:
                self._collect_job()
        self._changed()

    def _report_hang(self, pod: reconcile.ObservedPod, own: bool) -> None:
        silent = (self.now - (pod.created_at or self.now)).total_seconds()  # absent since after it started
        report = job_object.HungRank(pod.name, pod.rank, 1, "train-0", silent, job_object.timestamp(self.now))
        if own:
            self.hung[pod.name] = report
        else:
            self.foreign = reconcile.ObservedObject("other-cm", "uid-other", job_object.View(hung=(report,)))

    # -- the operator's replicas --

    def monotonic(self) -> float:
        """The replicas' monotonic clock (leader.py measures only on it): it never steps, as the wall one does."""
        return (self.now - START).total_seconds()

    def switch(self, index: int) -> None:
        """Swap replica `index`'s process state into handlers.py and k8s.py (the other's is kept aside)."""
        if self.current == index:
            return
        if self.current is not None:
            out = self.replicas[self.current]
            out.state = {name: getattr(handlers, name) for name in PROCESS_STATE}
            out.fence = k8s._fence
        replica = self.replicas[index]
        for name, value in replica.state.items():
            setattr(handlers, name, value)
        k8s.set_fence(replica.fence)
        self.current = index

    def start_replica(self, index: int) -> None:
        """A new operator process in slot `index` (a first start, or a restart after a crash or an update): a
        new identity, nothing trusted, its pod view listed afresh."""
        replica = Replica(f"operator-{index}_{next(self.incarnations)}",
                          {"_term": 0, "_trusted": {}, "_listed": {}, "_rendezvous_seen": {}, "_elector": None},
                          next_round=self.monotonic())
        if index == len(self.replicas):
            self.replicas.append(replica)
            self.seen.append(0)
        self.replicas[index] = replica
        if self.current == index:
            self.current = None  # the old process's state dies with it
        self.switch(index)

        def changed(leading: bool) -> None:  # handlers.startup's: a new term for the replica that took over
            replica.took_over = replica.took_over or leading

        elector = handlers.elector_for(ELECTION, changed, identity=replica.identity,
                                       lease_api=ReplicaLeases(self, replica), clock=self.monotonic)
        handlers._elector = replica.elector = elector
        self.seen[index] = len(self.history) - 1

    def election_rounds(self) -> None:
        """Each replica's campaign thread runs its round every retry period (unless it is stalled)."""
        now = self.monotonic()
        for replica in self.replicas:
            if replica.next_round <= now:
                replica.next_round = now + ELECTION.retry_period
                if replica.stalled_until <= now and replica.elector is not None:
                    replica.elector.campaign_round()

    def lease_holder(self) -> str:
        lease = self.leases.objects.get(ELECTION.name)
        return "" if lease is None else lease.spec.holder_identity or ""

    def lease_written(self, replica: Replica, before: str, body: kubernetes.client.V1Lease) -> None:
        self.lease_writes += 1
        if (body.spec.holder_identity or "") != replica.identity:
            return  # a release, or an empty Lease made
        if before != replica.identity:
            self.acquired.append((self.lease_writes, replica.identity))
        replica.renewed_at, replica.renewed_seq, replica.read_other = self.monotonic(), self.lease_writes, False

    def run_pass(self, lag: int, fault: tuple[int, str] | None) -> bool:
        """A pass of each replica that acts (the real handlers.acting()), its pod view `lag` changes behind the
        truth, with `fault` planned for the first. False when none acted."""
        acted = False
        for index in range(len(self.replicas)):
            self.switch(index)
            if self.replicas[index].took_over:  # handlers._took_over, as its event loop runs it
                self.replicas[index].took_over = False
                handlers.new_term()
            if not handlers.acting():
                continue
            acted = True
            self._pass(index, lag, fault)
            fault = None
        return acted

    def _pass(self, index: int, lag: int, fault: tuple[int, str] | None) -> None:
        self.seen[index] = max(self.seen[index], len(self.history) - 1 - lag)
        self.calls, self.fault = 0, fault
        try:
            handlers.reconcile_job(KEY, self.indexes())  # type: ignore[arg-type]
            self.decided = self.seen[index]
        except (k8s.StatusConflict, ServerError, TimeoutError, leader.NotLeaderError):
            pass  # the loop tries again (handlers._job_loop)
        except Crash:  # the process dies: a new one starts, a new candidate for the Lease
            self.start_replica(index)
        finally:
            self.fault = None


# ---- invariants: each a small named check, raising Violation -----------------------------------------------


def check_nothing_created_for_a_deleted_job(cluster: SimCluster, action: reconcile.Create) -> None:
    if cluster.job is None or "deletionTimestamp" in cluster.job["metadata"]:
        raise Violation("nothing_created_for_a_job_being_deleted", f"created {action.kind} {action.name}")


def check_never_a_healthy_pod_deleted(cluster: SimCluster, action: reconcile.Delete) -> None:
    """A Running, ready pod of the current generation, that nothing happened to, of a job that goes on."""
    pod = cluster.pods.get(action.name)
    status = cluster._status()
    if pod is None or pod.uid != action.uid or pod.terminating or pod.phase != "Running" or not pod.ready:
        return
    if status.get("phase") in ("Succeeded", "Failed") or cluster.job is None:
        return
    if pod.generation != status.get("membershipGeneration") or pod.rank >= int(status.get("worldSize") or 0):
        return
    if pod.uid in cluster.causes:
        return
    raise Violation("never_a_healthy_pod_deleted", f"{pod.name} (uid {pod.uid}) deleted while Running and ready")


def check_one_replica_writes(cluster: SimCluster) -> None:
    """The write fence: a write is accepted only from the replica whose last write of itself into the Lease began
    less than the renew deadline ago, which has read no other holder (nor no Lease) since, and after which no
    other replica took the Lease. (leader.py's promise, docs/OPERATOR.md "At most one operator acts", checked
    against the Lease model's history, not against the elector's own state.)"""
    assert cluster.current is not None
    replica = cluster.replicas[cluster.current]
    now = cluster.monotonic()
    if replica.renewed_at is None or now - replica.renewed_at >= ELECTION.renew_deadline:
        raise Violation("one_replica_writes", f"{replica.identity} wrote at {now:.0f} s, its last renewal "
                        f"{replica.renewed_at} (renew deadline {ELECTION.renew_deadline:.0f} s)")
    if replica.read_other:
        raise Violation("one_replica_writes", f"{replica.identity} wrote after reading another holder in the Lease")
    later = [who for seq, who in cluster.acquired if seq > replica.renewed_seq and who != replica.identity]
    if later:
        raise Violation("one_replica_writes", f"{replica.identity} wrote after {later[0]} took the Lease")


def check_a_restart_shows_restarting(cluster: SimCluster) -> None:
    """A pass that decides a restart shows it (Restarting, or the job paused, suspended or ended), never as pods
    being created or a job running: its recovery is then measured (issue 38, defect 8)."""
    phase = cluster._status().get("phase")
    if phase in ("Creating", "Pending", "Running"):
        raise Violation("a_restart_is_shown_and_its_recovery_measured", f"a restart decided, phase {phase}")


def check_one_pod_per_rank(cluster: SimCluster) -> None:
    ranks = [p.rank for p in cluster.pods.values() if not p.terminating and p.phase in ("Pending", "Running")]
    if len(ranks) != len(set(ranks)):
        raise Violation("never_two_pods_for_one_rank", f"live ranks {sorted(ranks)}")


def check_each_restart_counted_as_its_cause(cluster: SimCluster) -> None:
    """Every restart names a pod something happened to (no phantom), once, counted as the policy says; the
    count never exceeds the real failures."""
    status = cluster._status()
    seen: set[str] = set()
    for entry in status.get("restartHistory") or []:
        uid = entry.get("podUid")
        if uid is None:
            continue
        if uid in seen:
            raise Violation("each_failure_counted_once", f"pod {uid} restarted twice: {entry}")
        seen.add(uid)
        cause = cluster.causes.get(uid)
        if cause is None:
            raise Violation("no_phantom_restart", f"a restart of pod {uid}, which nothing happened to: {entry}")
        if not cause.covered:
            continue
        if cause.action == "Ignore" and entry["counted"]:
            raise Violation("voluntary_and_ignored_never_counted", f"{cause.what} counted: {entry}")
        if cause.action == "Restart" and not entry["counted"]:
            raise Violation("real_failure_counted", f"{cause.what} not counted: {entry}")
    real = sum(1 for c in cluster.causes.values() if c.action == "Restart" or not c.covered)
    if int(status.get("restartCount") or 0) > real:
        raise Violation("voluntary_and_ignored_never_counted",
                        f"restartCount {status.get('restartCount')} with {real} real failures: "
                        f"{[(e['reason'], e.get('exitCode'), e['counted']) for e in status.get('restartHistory') or []]}")


STEP_CHECKS = (check_one_pod_per_rank, check_each_restart_counted_as_its_cause)


def check_the_job_ends_as_the_workload_earned(cluster: SimCluster) -> None:
    """Failed exactly when a covered cause earned it (an uncovered one may or may not have), Succeeded when
    every rank did, and restartCount between the covered real failures and those plus the uncovered ones.
    (RestartGroup replaces every rank at once, one counted restart for however many failures: only its
    failure without any real failure is checked.)"""
    if cluster.job is None:
        return
    status = cluster._status()
    phase = status.get("phase")
    causes = list(cluster.causes.values())
    group = cluster.job["spec"]["quorum"]["actionOnLoss"] == "RestartGroup"
    low = sum(1 for c in causes if c.covered and c.action == "Restart")
    high = low + sum(1 for c in causes if not c.covered and c.action == "Restart")
    budget = int(cluster.job["spec"]["failurePolicy"]["maxRestarts"])
    may_fail = cluster.earned_failure or high > budget or any(c.action == "FailJob" for c in causes)
    if group:
        may_fail = may_fail or high > 0
    if cluster.earned_failure and not group and phase != "Failed":
        raise Violation("ends_in_the_phase_earned", f"phase {phase}, but a failure the policy fails ended it")
    if phase == "Failed" and not may_fail:
        ready = reconcile.find_condition(status, "Ready") or {}
        raise Violation("ends_in_the_phase_earned", f"Failed ({ready.get('message')}) without cause")
    if cluster.completed and phase not in ("Succeeded", "Failed"):
        raise Violation("ends_in_the_phase_earned", f"every rank succeeded, phase {phase}")
    count = int(status.get("restartCount") or 0)
    if not group and phase != "Failed" and not low <= count <= high:
        raise Violation("each_failure_counted_once", f"restartCount {count}, {low} real failures ({high} at most)")


def check_no_pod_outlives_its_finished_job(cluster: SimCluster) -> None:
    if cluster.job is not None and cluster._status().get("phase") not in ("Succeeded", "Failed"):
        return
    left = [p.name for p in cluster.pods.values() if p.phase in ("Pending", "Running") or p.uid in cluster.sidecars]
    if left:
        raise Violation("no_pod_outlives_its_finished_job", f"still running: {left}")


def check_restarting_ends_when_quorum_trains(cluster: SimCluster) -> None:
    """Calm, every rank holding a pod and quorum met: Running, as the same pods show with no restart before."""
    status = cluster._status()
    if cluster.job is None or status.get("phase") != "Restarting":
        return
    world, generation = int(status.get("worldSize") or 0), status.get("membershipGeneration")
    pods = [p for p in cluster.pods.values() if not p.terminating and p.generation == generation and p.rank < world]
    healthy = sum(1 for p in pods if p.phase == "Running" and p.ready)
    if len(pods) == world and healthy >= int(cluster.job["spec"]["elastic"]["minNodes"]):
        raise Violation("restarting_ends_when_quorum_trains",
                        f"Restarting with {healthy} of {world} ranks ready and every rank's pod there")


def wedge(cluster: SimCluster, rank: int) -> None:
    """Defect 10's world: the rank's agent is wedged (its pod Running and ready, doing nothing). The agents' side
    is the runtime's own rule: if the others still make min_nodes, they form a generation without it and its rank
    0 reports it; if not, the agent sealing the next one reports it when `pod.stalled_report_after` comes before
    their join timeout; and without a report they give up at that timeout: their pods fail (exit 1)."""
    pod = cluster._live(rank)
    status = cluster._status()
    if cluster.job is None or pod is None or pod.phase != "Running":
        return
    spec = cluster.job["spec"]
    others = [p for r in range(int(status.get("worldSize") or 0))
              if r != rank and (p := cluster._live(r)) is not None and p.phase == "Running"]
    min_nodes = int(spec["elastic"]["minNodes"])
    hang = float(defaults.field(spec.get("failurePolicy") or {}, "failurePolicy.hangTimeoutSeconds"))
    join = float(defaults.field(spec["elastic"], "elastic.rendezvousTimeoutSeconds"))
    if not hang:  # hang reports off: nothing is promised
        return
    after = pod_agent.stalled_report_after(hang, join, len(others), min_nodes)
    cluster.wedged.add(pod.uid)
    cluster._record(pod, "wedged", expected_action(spec, None, None))
    if len(others) >= min_nodes or (after is not None and after < join):
        cluster._report_hang(pod, own=True)
        return
    for survivor in others:  # no report: each gives up at its join timeout (agent.EXIT_NODE_FAILED)
        cluster.pods[survivor.name] = dataclasses.replace(survivor, phase="Failed", ready=False, exit_code=1,
                                                          reason="Error")
        cluster._record(survivor, "join timeout", expected_action(spec, 1, None))


def check_a_wedged_pod_is_replaced_as_hang(cluster: SimCluster) -> None:
    """Each wedged pod whose job went on (nothing voided the promise: a suspend, a resize, the job's end or
    deletion) was replaced with a Hang restart, whether or not a generation could form without it."""
    replaced = {e.get("podUid") for e in cluster._status().get("restartHistory") or [] if e.get("reason") == "Hang"}
    for uid in cluster.wedged - replaced:
        cause = cluster.causes.get(uid)
        if cause is not None and cause.covered:
            raise Violation("a_wedged_pod_is_replaced_as_hang", f"pod {uid} wedged and never replaced as Hang")


def check_every_recovery_measured(cluster: SimCluster) -> None:
    """A job Running again after a restart had its recovery measured (sneppx_job_recovery_seconds)."""
    if cluster.job is not None and cluster._status().get("phase") == "Running" and cluster.recovery_due:
        raise Violation("a_restart_is_shown_and_its_recovery_measured", "Running again, its recovery not measured")


END_CHECKS = (check_a_wedged_pod_is_replaced_as_hang,
              check_the_job_ends_as_the_workload_earned, check_no_pod_outlives_its_finished_job,
              check_restarting_ends_when_quorum_trains, check_every_recovery_measured)


# ---- schedules ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Profile:
    """Which adversities a schedule may draw. The defaults (the `no-known-defects` profile, which fixed seeds
    must pass) would leave out the triggers of open defects; there is none now, and `everything` is the same."""

    max_lag: int = 3
    takeovers: bool = True
    grace_outlasts_a_pass: bool = False  # a pod being deleted gracefully is seen so by a pass before it goes
    clock_steps: bool = True  # the operator's clock steps (NTP, a VM resumed) against the cluster's
    held_pending: bool = True  # a rank's next pods stay Pending (no room on any node)
    faults: bool = True
    others: tuple[str, ...] = ("fail", "evict_kubelet", "evict_api", "podgc", "user_delete", "hang", "foreign_hang")
    sidecars: bool = True
    job_deletes: tuple[str, ...] = ("background", "foreground")
    group_restart: bool = True  # RestartGroup (defect 4 showed whenever quorum was lost to a drain)
    lease_events: bool = True  # the Lease deleted or made again by others, a replica's election thread stalled
    nodes_fail: bool = True  # a node goes NotReady under a pod


EVERYTHING = Profile()  # no open defect's trigger is left out of the defaults now


def job_spec(min_nodes: int, max_nodes: int, on_loss: str, max_restarts: int,
             rules: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    return {
        "template": {"spec": {"containers": [{"name": "trainer", "image": "example.org/t:1"}]}},
        "elastic": {"minNodes": min_nodes, "maxNodes": max_nodes},
        "quorum": {"actionOnLoss": on_loss},
        "checkpoint": {"storage": {"pvc": {"claimName": "ckpt"}}},
        "failurePolicy": {"maxRestarts": max_restarts, "rules": [dict(r) for r in rules],
                          "restartDelay": {"initialSeconds": 0, "multiplier": 2, "maxSeconds": 0}},
    }


def make_spec(rng: random.Random, profile: Profile) -> dict[str, Any]:
    max_nodes = rng.randint(1, 3)
    return job_spec(rng.randint(1, max_nodes), max_nodes,
                    rng.choice(("Pause", "RestartGroup") if profile.group_restart else ("Pause",)),
                    rng.randint(0, 4), rng.sample(RULE_CHOICES, rng.randint(0, 2)))


def make_schedule(rng: random.Random, profile: Profile, length: int) -> list[Event]:
    events: list[Event] = []
    for _ in range(length):
        roll = rng.random()
        if roll < 0.45:
            fault = None
            if profile.faults and rng.random() < 0.3:
                fault = (rng.randint(1, 8), rng.choice(("crash", "error", "conflict", "timeout")))
            events.append(("pass", rng.randint(0, profile.max_lag), fault))
        elif roll < 0.65:
            events.append(("kubelet",))
        elif roll < 0.88:
            kind = rng.choice(profile.others)
            events.append((kind, rng.randrange(3), rng.choice(EXIT_CODES)) if kind == "fail" else (kind, rng.randrange(3)))
        elif roll < 0.92:
            events.append(("suspend", rng.random() < 0.6))
        elif roll < 0.96:
            events.append(("resize", rng.randint(1, 3)))
        elif roll < 0.97:
            events.append(("takeover", rng.randint(0, 2 * profile.max_lag)) if profile.takeovers else ("kubelet",))
        elif roll < 0.985:
            events.append(("complete", profile.sidecars and rng.random() < 0.5))
        else:
            events.append(("delete_job", rng.choice(profile.job_deletes)))
    # Drawn last, each from its own stream: the other events stay those of the seed.
    steps, holds = random.Random(rng.random()), random.Random(rng.random())
    leases, nodes = random.Random(rng.random()), random.Random(rng.random())
    if profile.clock_steps:
        for _ in range(length // 10):
            events.insert(steps.randrange(len(events) + 1), ("clock", steps.choice((-3600, -30, -1, 1, 30, 3600))))
    if profile.held_pending and holds.random() < 0.3:
        events.insert(holds.randrange(len(events) + 1), ("hold", holds.randrange(3)))
    if profile.lease_events:
        for _ in range(length // 10):
            event = leases.choice((("lease_delete",), ("lease_replace", leases.choice(("", "stranger"))),
                                   ("stall", leases.randrange(2), leases.choice((3, 9, 11, 20, 40)))))
            events.insert(leases.randrange(len(events) + 1), event)
    if profile.nodes_fail and nodes.random() < 0.3:
        events.insert(nodes.randrange(len(events) + 1), ("node_down", nodes.randrange(3)))
    return events


@contextlib.contextmanager
def routed_to(cluster_of: Callable[[], SimCluster]) -> Iterator[None]:
    """k8s.py's calls and the pass's clock go to the current simulated cluster (restored after)."""
    saved = {name: getattr(k8s, name) for name in ("read_job", "list_pods", "patch_job_status", "apply", "post_events")}
    saved_datetime, saved_now, saved_fence = handlers.datetime, leader._now, k8s._fence
    saved_record_pass = metrics.record_pass
    saved_process = {name: getattr(handlers, name) for name in PROCESS_STATE}

    class Clock(datetime.datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return cluster_of().now + cluster_of().skew

    for name in ("read_job", "list_pods", "patch_job_status", "apply"):
        setattr(k8s, name, lambda *a, _name=name, **kw: getattr(cluster_of(), _name)(*a, **kw))
    k8s.post_events = lambda *a, **kw: None  # type: ignore[assignment]
    metrics.record_pass = lambda *a, **kw: cluster_of().measured(*a, **kw)  # type: ignore[assignment]
    leader._now = lambda: cluster_of().now + cluster_of().skew  # the renewTime it writes: a clock that steps
    handlers.datetime = type("datetime_module", (), {"datetime": Clock, "UTC": datetime.UTC,  # type: ignore
                                                     "timedelta": datetime.timedelta})
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(k8s, name, value)
        for name, value in saved_process.items():
            setattr(handlers, name, value)
        handlers.datetime, leader._now, metrics.record_pass = saved_datetime, saved_now, saved_record_pass
        k8s.set_fence(saved_fence)


def run(spec: Mapping[str, Any], schedule: Sequence[Event], profile: Profile) -> SimCluster:
    """Start the job, play the schedule checking the step invariants, settle, check the end invariants.
    Raises Violation."""
    cluster = SimCluster(spec, profile)
    with routed_to(lambda: cluster):
        for index in (0, 1):  # two new operator processes: nothing trusted from the last run
            cluster.start_replica(index)
        cluster.election_rounds()  # the first takes the released Lease
        for _ in range(4):  # the job starts
            cluster.run_pass(0, None)
            cluster.kubelet()
        for event in schedule:
            if event[0] == "pass":
                cluster.run_pass(event[1], event[2])
            else:
                cluster.event(event)
            for check in STEP_CHECKS:
                check(cluster)
        for _ in range(60):  # settle: a calm world, a view that catches up, a leader (in a lease duration)
            before = (cluster.writes, len(cluster.history))
            acted = cluster.run_pass(0, None)
            cluster.kubelet()
            for check in STEP_CHECKS:
                check(cluster)
            if acted and (cluster.writes, len(cluster.history)) == before:  # the pass changed nothing, nor did
                break  # the kubelet
        for check in END_CHECKS:
            check(cluster)
    return cluster


def scenario(seed: int, profile: Profile, length: int = 40) -> tuple[dict[str, Any], list[Event]]:
    rng = random.Random(seed)
    return make_spec(rng, profile), make_schedule(rng, profile, length)


def failure_of(spec: Mapping[str, Any], schedule: Sequence[Event], profile: Profile) -> Violation | None:
    try:
        run(spec, schedule, profile)
    except Violation as violation:
        return violation
    return None


def shrink(spec: Mapping[str, Any], schedule: list[Event], profile: Profile, invariant: str) -> list[Event]:
    """Delta debugging (ddmin) over the event list: the smallest schedule found that breaks the same invariant."""
    def fails(candidate: list[Event]) -> bool:
        found = failure_of(spec, candidate, profile)
        return found is not None and found.invariant == invariant

    chunks = 2
    while len(schedule) >= 2:
        size = -(-len(schedule) // chunks)
        parts = [schedule[i:i + size] for i in range(0, len(schedule), size)]
        for i in range(len(parts)):
            rest = [e for j, part in enumerate(parts) if j != i for e in part]
            if fails(rest):
                schedule, chunks = rest, max(chunks - 1, 2)
                break
        else:
            if chunks >= len(schedule):
                break
            chunks = min(len(schedule), chunks * 2)
    return schedule


# The triggers of open defects, each as a way to take it out of a schedule (suspects() isolates them); none is
# open now. The fixed defects' triggers stay in every schedule: a failure that needs one is a new defect. (Defect
# 5's was ("defect 5: ...", lambda schedule: [("pass", 0, e[2]) if e[0] == "pass" else e for e in schedule
# if e[0] != "takeover"], lambda spec: None, {}).)
ABLATIONS: tuple[tuple[str, Callable[[list[Event]], list[Event]], Callable[[dict[str, Any]], None], dict[str, Any]],
                 ...] = ()


def suspects(spec: Mapping[str, Any], schedule: list[Event], profile: Profile) -> list[str]:
    """The defects a failing schedule shows: each whose trigger alone (every other ABLATIONS trigger taken out)
    still fails it. Empty: a failure no known defect explains."""
    if failure_of(*ablated(spec, schedule, profile, keep=None)) is not None:
        return []  # it fails without any of them
    found = []
    for keep, _, _, _ in ABLATIONS:
        if failure_of(*ablated(spec, schedule, profile, keep)) is not None:
            found.append(keep)
    return found


def ablated(spec: Mapping[str, Any], schedule: list[Event], profile: Profile,
            keep: str | None) -> tuple[dict[str, Any], list[Event], Profile]:
    """The schedule with every ABLATIONS trigger but `keep` taken out."""
    changed, events, options = copy.deepcopy(dict(spec)), list(schedule), {}
    for name, edit_schedule, edit_spec, profile_change in ABLATIONS:
        if name != keep:
            edit_spec(changed)
            events = edit_schedule(events)
            options.update(profile_change)
    return changed, events, dataclasses.replace(profile, **options)


def report(seed: int, spec: Mapping[str, Any], schedule: list[Event], profile: Profile, violation: Violation) -> str:
    small = shrink(spec, schedule, profile, violation.invariant)
    policy = spec["failurePolicy"]
    lines = [
        f"seed {seed}: {violation}",
        f"  shows: {suspects(spec, small, profile) or 'no known defect'}",
        (f"  spec: elastic={spec['elastic']} quorum={spec['quorum']} maxRestarts={policy['maxRestarts']} "
         f"rules={policy['rules']}"),
        f"  schedule ({len(schedule)} events) shrunk to {len(small)}:",
    ]
    lines += [f"    {event}" for event in small]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, help="replay this one seed")
    parser.add_argument("--schedules", type=int, default=200, help="how many seeds from --first")
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--length", type=int, default=40)
    parser.add_argument("--profile", choices=("everything", "no-known-defects"), default="everything")
    parser.add_argument("--examples", type=int, default=2, help="shrink and print this many failures per invariant")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.getLogger(leader.__name__).setLevel(logging.ERROR)  # each takeover's line, thousands of them
    profile = EVERYTHING if args.profile == "everything" else Profile()
    seeds = [args.seed] if args.seed is not None else range(args.first, args.first + args.schedules)
    by_invariant: dict[str, list[int]] = {}
    by_defect: dict[str, list[int]] = {}
    started = time.monotonic()
    for seed in seeds:
        spec, schedule = scenario(seed, profile, args.length)
        violation = failure_of(spec, schedule, profile)
        if violation is None:
            if args.verbose:
                print(f"seed {seed}: ok")
            continue
        by_invariant.setdefault(violation.invariant, []).append(seed)
        for defect in suspects(spec, schedule, profile) or ["not isolated (needs two triggers at once, or a new defect)"]:
            by_defect.setdefault(defect, []).append(seed)
        if args.verbose or len(by_invariant[violation.invariant]) <= args.examples:
            print(report(seed, spec, schedule, profile, violation), flush=True)
    print(f"{len(seeds)} schedules of {args.length} events ({args.profile}) in {time.monotonic() - started:.0f}s; "
          f"{sum(map(len, by_invariant.values()))} failed")
    for invariant, failed in sorted(by_invariant.items()):
        print(f"  {invariant}: {len(failed)} (seeds {failed[:10]})")
    print("by defect (a schedule may show several):")
    for defect, failed in sorted(by_defect.items()):
        print(f"  {defect}: {len(failed)} (seeds {failed[:10]})")
    return 1 if by_invariant else 0


if __name__ == "__main__":
    sys.exit(main())
