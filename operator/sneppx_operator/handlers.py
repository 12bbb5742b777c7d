"""kopf entry points, and nothing else: each handler observes, calls pure code, and hands actions to k8s.py.

Each job is reconciled by one loop (wakeups.JobLoops): its passes never overlap, so a restart is decided and
counted once. The loop runs the same level-triggered pass whenever something changes, and at the latest every
resync interval, so a lost event or a crash between two API calls is repaired on the next pass. "Something
changes" is a watch event for the job, one of its pods, a node one of its pods runs on, or its rendezvous
object: those handlers only poke the job's loop. Pods, nodes and rendezvous objects are observed through kopf
indexes (one watch each).

One pass (`reconcile_job`):
    read the job (a fresh GET: the newest status, with its resourceVersion)
    -> its pods from the index, or from a fresh list while the index may lag that status (after a takeover)
    -> reconcile.plan: the actions and the status that records every decision (restarts, counts, phase)
    -> write that status first, conditional on the resourceVersion read
    -> k8s.apply the actions -> reconcile.settle what the API server refused into the status -> events
Writing the decisions before acting on them makes them durable: an operator killed between any two of these
calls finds them in the status and finishes them, and never decides or counts one twice. The resourceVersion
precondition means no two writers (a stale leader, a pass racing a spec edit) overwrite each other's status.

With leader election (`--leader-elect`, the chart's default), every replica watches and indexes but only the
one holding the Lease runs passes; k8s.py refuses any write from a replica that may not act (leader.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import secrets
from collections.abc import Callable, Mapping
from typing import Any

import kopf

from sneppx_operator import builders, config, k8s, leader, metrics, reconcile, wakeups

RESOURCE = (builders.GROUP, builders.VERSION, builders.PLURAL)
RENDEZVOUS_LABELS: dict[str, Any] = {builders.LABEL_JOB: kopf.PRESENT, builders.LABEL_COMPONENT: builders.COMPONENT_RENDEZVOUS}
LOOPS = wakeups.JobLoops()
MIN_PASS_INTERVAL_S = 0.2
# What the operator last read of each job's rendezvous object: the agents' own records (joins, leases, the
# sealer's renewals: at 64 ranks several a second while a generation forms) change nothing it acts on.
_rendezvous_seen: dict[wakeups.Key, reconcile.ObservedObject] = {}
log = logging.getLogger(__name__)


@dataclasses.dataclass
class Election:
    """Leader election settings (set by `python -m sneppx_operator --leader-elect`); None: act alone."""

    namespace: str
    name: str
    lease_duration: float = leader.LEASE_DURATION_S
    renew_deadline: float = leader.RENEW_DEADLINE_S
    retry_period: float = leader.RETRY_PERIOD_S
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)  # of the Lease, when a replica makes it
    owner_deployment: str | None = None  # the Lease's owner, when a replica makes it


ELECTION: Election | None = None
_elector: leader.Elector | None = None


@dataclasses.dataclass
class _Indexes:
    pods: kopf.Index
    nodes: kopf.Index
    rendezvous: kopf.Index


_indexes: _Indexes | None = None


def acting() -> bool:
    """Whether this replica runs passes now: always without an election, else while it holds the Lease."""
    return _elector is None or _elector.holds()


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    global _elector, _indexes
    _indexes = None  # this run's indexes come with its first job event (a process may run the operator twice)
    _rendezvous_seen.clear()
    new_term()  # and it trusts none of them before they match a fresh list
    config.apply(settings)
    k8s.connect()
    if ELECTION is None:
        k8s.set_fence(None)
        metrics.leading(True)
        return
    loop = asyncio.get_running_loop()

    def changed(leading: bool) -> None:  # from the election's thread
        metrics.leading(leading)
        if leading:
            loop.call_soon_threadsafe(_took_over)

    metrics.leading(False)
    _elector = elector_for(ELECTION, changed)
    _elector.start()


def elector_for(election: Election, on_change: Callable[[bool], None], **elector_args: Any) -> leader.Elector:
    """This replica's elector (not started yet), made the fence of every write k8s.py sends; `elector_args` go
    to leader.Elector (the simulation's Lease API, clock and identity)."""
    elector = leader.Elector(
        election.namespace, election.name, lease_duration=election.lease_duration,
        renew_deadline=election.renew_deadline, retry_period=election.retry_period, on_change=on_change,
        labels=election.labels, owner_deployment=election.owner_deployment, **elector_args,
    )
    k8s.set_fence(elector.check)
    return elector


def _took_over() -> None:
    new_term()
    LOOPS.poke_all()


@kopf.on.cleanup()
async def cleanup(**_: Any) -> None:
    """Stop acting first (no pass starts, no write passes the fence), then hand the Lease over."""
    global _elector, _indexes
    if _elector is not None:
        _elector.resign()
    await LOOPS.stop_all()
    if _elector is not None:
        await asyncio.to_thread(_elector.stop)
    _elector, _indexes = None, None


@kopf.index("pods", labels={builders.LABEL_JOB: kopf.PRESENT})
async def job_pods(
    name: str, namespace: str, meta: kopf.Meta, spec: kopf.Spec, status: kopf.Status, **_: Any
) -> dict[tuple[str, str], reconcile.ObservedPod]:
    pod = reconcile.observe_pod(name, meta, spec, status)
    return {} if pod is None else {(namespace, meta["labels"][builders.LABEL_JOB]): pod}


@kopf.index("nodes")
async def job_nodes(name: str, spec: kopf.Spec, status: kopf.Status, **_: Any) -> dict[str, reconcile.ObservedNode]:
    return {name: reconcile.observe_node(name, status, spec)}


@kopf.index("configmaps", labels=RENDEZVOUS_LABELS)
async def job_rendezvous(
    namespace: str, meta: kopf.Meta, body: kopf.Body, **_: Any
) -> dict[tuple[str, str], reconcile.ObservedObject]:
    return {(namespace, meta["labels"][builders.LABEL_JOB]): reconcile.observe_rendezvous(meta, body.get("data"))}


@kopf.on.event(*RESOURCE)
async def job_changed(
    event: Mapping[str, Any], namespace: str, name: str, job_pods: kopf.Index, job_nodes: kopf.Index,
    job_rendezvous: kopf.Index, **_: Any,
) -> None:
    global _indexes
    key = (namespace, name)
    if event.get("type") == "DELETED":
        _forget(key)
        return
    if _indexes is None:
        _indexes = _Indexes(job_pods, job_nodes, job_rendezvous)
    LOOPS.ensure(key, _job_loop)
    LOOPS.poke(key)


@kopf.on.event("pods", labels={builders.LABEL_JOB: kopf.PRESENT})
async def pod_changed(namespace: str, labels: kopf.Labels, **_: Any) -> None:
    LOOPS.poke((namespace, labels[builders.LABEL_JOB]))


@kopf.on.event("configmaps", labels=RENDEZVOUS_LABELS)
async def rendezvous_changed(
    event: Mapping[str, Any], namespace: str, labels: kopf.Labels, meta: kopf.Meta, body: kopf.Body, **_: Any
) -> None:
    """Pokes the job's loop when what a pass reads of the object changed (or the object went)."""
    key = (namespace, labels[builders.LABEL_JOB])
    seen = reconcile.observe_rendezvous(meta, body.get("data"))
    if event.get("type") == "DELETED":
        _rendezvous_seen.pop(key, None)
    elif _rendezvous_seen.get(key) == seen:
        return
    else:
        _rendezvous_seen[key] = seen
    LOOPS.poke(key)


@kopf.on.event("nodes")
async def node_changed(name: str, job_pods: kopf.Index, **_: Any) -> None:
    for key, pods in list(job_pods.items()):
        if any(pod.node == name for pod in pods):
            LOOPS.poke(key)


def _forget(key: wakeups.Key) -> None:
    LOOPS.forget(key)
    metrics.forget(*key)
    _trusted.pop(key, None)
    _listed.pop(key, None)
    _rendezvous_seen.pop(key, None)


async def _job_loop(key: wakeups.Key) -> None:
    """The job's loop: one pass (in a worker thread: it calls the API) when this replica acts, then wait for a
    poke, the next time-based decision or the resync, holding no thread while it waits."""
    retry = 0
    while True:
        delay = config.resync_seconds()
        if acting() and _indexes is not None:
            try:
                settled = await asyncio.to_thread(reconcile_job, key, _indexes)
            except (leader.NotLeaderError, k8s.StatusConflict) as exc:  # nothing of the pass was lost: again
                log.info("pass of %s/%s stopped: %s", *key, exc)
                settled = reconcile.Settled({}, [], wake_after=0.0)
            except Exception:  # the API was unreachable or answered in an unexpected way: try again later
                log.exception("reconciling %s/%s failed; retrying", *key)
                settled = reconcile.Settled({}, [], error="unexpected failure")
            if settled is None:  # the job is gone
                _forget(key)
                return
            retry = retry + 1 if settled.error is not None and settled.retryable else 0
            delay = config.retry_delay(retry - 1) if retry else delay
            if settled.wake_after is not None:
                delay = min(delay, max(settled.wake_after, MIN_PASS_INTERVAL_S))
        # Pokes that come in a burst (a pod's several status changes, the watch events of this pass's own
        # writes) make one pass, not one each.
        await asyncio.sleep(MIN_PASS_INTERVAL_S)
        await LOOPS.wait(key, delay - MIN_PASS_INTERVAL_S)


# Which jobs' pod indexes a pass may plan from. A replica that takes over (and a process that starts) trusts no
# index: its watch may lag the status its predecessor wrote. A pass then lists the pods fresh, and the index is
# trusted again once it holds exactly the pods that list held, each as the list showed it: the same uids are not
# enough, as an index still showing a listed pod Pending would undo the Running the status recorded from the
# list (within a term the index only moves forward, and the statuses this replica writes rest on what it listed
# or indexed). While pods come and go the passes list; once they settle, the index matches.
_term = 0
_trusted: dict[wakeups.Key, int] = {}  # job -> the term its index was last trusted in
_listed: dict[wakeups.Key, frozenset[reconcile.ObservedPod]] = {}  # job -> its last fresh list, until indexed


def new_term() -> None:
    global _term
    _term += 1
    _listed.clear()


def _pods_for_pass(
    key: wakeups.Key, job: reconcile.Job, indexed: list[reconcile.ObservedPod]
) -> list[reconcile.ObservedPod]:
    """The pods a pass plans from: the index's when it is trusted and agrees with the status read; else a
    fresh list from the API server (docs/OPERATOR.md, "Guarantees")."""
    if key in _listed and _listed[key] == frozenset(indexed):
        del _listed[key]  # the index has caught up with the last list
    if _trusted.get(key) == _term and key not in _listed and not reconcile.pods_lag_status(job, indexed):
        return indexed
    fresh = k8s.list_pods(*key)
    _trusted[key], _listed[key] = _term, frozenset(fresh)
    return fresh


def reconcile_job(key: wakeups.Key, indexes: _Indexes) -> reconcile.Settled | None:
    """One pass for one job (module docstring); None when the job is gone."""
    namespace, name = key
    body = k8s.read_job(namespace, name)
    if body is None:
        return None
    job = reconcile.Job.from_body(body)
    nodes: Mapping[str, reconcile.ObservedNode] = {n: next(iter(found)) for n, found in indexes.nodes.items()}
    # The job's own rendezvous object, by name and controller: a label is anyone's to set.
    rendezvous = reconcile.owned_rendezvous(job, indexes.rendezvous.get(key, []))
    pods = _pods_for_pass(key, job, list(indexes.pods.get(key, [])))
    now = datetime.datetime.now(datetime.UTC)
    plan = reconcile.plan(
        job, pods, now=now, heartbeat_key=secrets.token_bytes(32), nodes=nodes, rendezvous=rendezvous,
    )
    version = job.resource_version
    if plan.status:  # the decisions, durable before anything is done about them
        version = k8s.patch_job_status(namespace, name, job.uid, version, reconcile.status_patch(job.status, plan.status))
    settled = reconcile.settle(job, plan, k8s.apply(namespace, plan.actions), now=now)
    if settled.status:
        try:
            k8s.patch_job_status(namespace, name, job.uid, version, reconcile.status_patch(plan.status, settled.status))
        except k8s.StatusConflict:  # the job moved on (e.g. a finalizer taken off): the next pass sees it again
            settled = dataclasses.replace(settled, wake_after=0.0)
    k8s.post_events(job, settled.events)
    history = [reconcile.restart_entry(r, now) for r in plan.restarts]
    metrics.record_pass(namespace, name, settled.status, history, plan.recovered_after)
    return settled
