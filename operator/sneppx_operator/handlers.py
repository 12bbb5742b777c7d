"""kopf entry points, and nothing else: each handler observes, calls pure code, and hands actions to k8s.py.

Each job is reconciled by one loop, a kopf daemon: its passes never overlap, so a restart is decided and
counted once. The loop runs the same level-triggered pass (reconcile.plan -> k8s.apply -> reconcile.settle)
whenever something changes, and at the latest every resync interval, so a lost event or a crash between two
API calls is repaired on the next pass. "Something changes" is a watch event for the job, one of its pods,
a node one of its pods runs on, or its rendezvous object: those handlers only poke the job's loop
(wakeups.py). Pods, nodes and rendezvous objects are observed through kopf indexes (one watch each).

The loop writes the job's status itself (k8s.patch_job_status) and is the only writer of it, so it plans
each pass from the status it last wrote: a watch event that hasn't arrived yet can't make it count a
restart twice or forget one.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import secrets
from collections.abc import Mapping
from typing import Any

import kopf

from sneppx_operator import builders, config, k8s, metrics, reconcile, wakeups

RESOURCE = (builders.GROUP, builders.VERSION, builders.PLURAL)
RENDEZVOUS_LABELS = {builders.LABEL_JOB: kopf.PRESENT, builders.LABEL_COMPONENT: builders.COMPONENT_RENDEZVOUS}
WAKEUPS = wakeups.Wakeups()
MIN_PASS_INTERVAL_S = 0.2
_written: dict[tuple[str, str, str], dict[str, Any]] = {}  # (namespace, name, uid) -> status last written
log = logging.getLogger(__name__)


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    config.apply(settings)
    k8s.connect()


@kopf.index("pods", labels={builders.LABEL_JOB: kopf.PRESENT})
async def job_pods(
    name: str, namespace: str, meta: kopf.Meta, spec: kopf.Spec, status: kopf.Status, **_: Any
) -> dict[tuple[str, str], reconcile.ObservedPod]:
    pod = reconcile.observe_pod(name, meta, spec, status)
    return {} if pod is None else {(namespace, meta["labels"][builders.LABEL_JOB]): pod}


@kopf.index("nodes")
async def job_nodes(name: str, status: kopf.Status, **_: Any) -> dict[str, reconcile.ObservedNode]:
    return {name: reconcile.observe_node(name, status)}


@kopf.index("configmaps", labels=RENDEZVOUS_LABELS)
async def job_rendezvous(
    namespace: str, meta: kopf.Meta, body: kopf.Body, **_: Any
) -> dict[tuple[str, str], reconcile.ObservedObject]:
    return {(namespace, meta["labels"][builders.LABEL_JOB]): reconcile.observe_rendezvous(meta, body.get("data"))}


@kopf.on.event(*RESOURCE)
async def job_changed(namespace: str, name: str, **_: Any) -> None:
    WAKEUPS.poke((namespace, name))


@kopf.on.event("pods", labels={builders.LABEL_JOB: kopf.PRESENT})
async def pod_changed(namespace: str, labels: kopf.Labels, **_: Any) -> None:
    WAKEUPS.poke((namespace, labels[builders.LABEL_JOB]))


@kopf.on.event("configmaps", labels=RENDEZVOUS_LABELS)
async def rendezvous_changed(namespace: str, labels: kopf.Labels, **_: Any) -> None:
    WAKEUPS.poke((namespace, labels[builders.LABEL_JOB]))


@kopf.on.event("nodes")
async def node_changed(name: str, job_pods: kopf.Index, **_: Any) -> None:
    for key, pods in list(job_pods.items()):
        if any(pod.node == name for pod in pods):
            WAKEUPS.poke(key)


@kopf.daemon(*RESOURCE, cancellation_timeout=30)
async def run_job(
    body: kopf.Body,
    stopped: kopf.DaemonStopped,
    job_pods: kopf.Index,
    job_nodes: kopf.Index,
    job_rendezvous: kopf.Index,
    **_: Any,
) -> None:
    """The job's loop: one pass (in a worker thread: it calls the API), then wait on kopf's event loop for a
    poke, the next time-based decision or the resync, holding no thread while it waits."""
    key = (body["metadata"]["namespace"], body["metadata"]["name"])
    retry = 0
    while not stopped:
        try:
            # to_thread carries kopf's context (its event poster) into the thread.
            settled = await asyncio.to_thread(_reconcile, body, job_pods, job_nodes, job_rendezvous)
        except Exception:  # the API was unreachable or answered in an unexpected way: try again later
            log.exception("reconciling %s/%s failed; retrying", *key)
            settled = reconcile.Settled({}, [], error="unexpected failure")
        retry = retry + 1 if settled.error is not None and settled.retryable else 0
        delay = config.retry_delay(retry - 1) if retry else config.resync_seconds()
        if settled.wake_after is not None:
            delay = min(delay, max(settled.wake_after, MIN_PASS_INTERVAL_S))
        # Pokes that come in a burst (a pod's several status changes, the watch events of this pass's own
        # writes) make one pass, not one each.
        await asyncio.sleep(MIN_PASS_INTERVAL_S)
        await WAKEUPS.wait(key, delay - MIN_PASS_INTERVAL_S, lambda: bool(stopped))


@kopf.on.delete(*RESOURCE)
def delete_job(body: kopf.Body, name: str, namespace: str, uid: str, retry: int, **_: Any) -> None:
    actions = reconcile.cleanup_actions(name, uid, k8s.list_job_pods(namespace, name))
    refused = k8s.apply(namespace, actions).refused
    if refused is not None:  # the finalizer stays until the job's objects are gone
        message = reconcile.describe_refusal(refused)
        k8s.post_events(body, [reconcile.Event("Warning", "FailedDelete", message)])
        raise kopf.TemporaryError(message, delay=config.retry_delay(retry))
    metrics.forget(namespace, name)
    WAKEUPS.forget((namespace, name))
    _written.pop((namespace, name, uid), None)


def _reconcile(
    body: kopf.Body, job_pods: kopf.Index, job_nodes: kopf.Index, job_rendezvous: kopf.Index
) -> reconcile.Settled:
    meta = body["metadata"]
    identity = (meta["namespace"], meta["name"], meta["uid"])
    known = _written.get(identity)
    job = reconcile.Job.from_body(body, status=known)
    key = (job.namespace, job.name)
    nodes: Mapping[str, reconcile.ObservedNode] = {name: next(iter(found)) for name, found in job_nodes.items()}
    rendezvous = next(iter(job_rendezvous.get(key, [])), None)
    now = datetime.datetime.now(datetime.UTC)
    plan = reconcile.plan(
        job, list(job_pods.get(key, [])), now=now, heartbeat_key=secrets.token_bytes(32), nodes=nodes,
        rendezvous=rendezvous,
    )
    settled = reconcile.settle(job, plan, k8s.apply(job.namespace, plan.actions), now=now)
    k8s.post_events(body, settled.events)
    if settled.status:
        actual = body.get("status") or {}
        k8s.patch_job_status(job.namespace, job.name, job.uid, reconcile.status_patch(actual, settled.status))
        _written[identity] = {**actual, **settled.status}
    metrics.record_pass(job.namespace, job.name, settled.status, settled.restarts, settled.recovered_after)
    return settled
