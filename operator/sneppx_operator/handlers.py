"""kopf entry points, and nothing else: each handler observes, calls pure code, and hands actions to k8s.py.

Every trigger for a job (create, spec update, operator restart, the periodic resync) runs the same
level-triggered reconcile, so a lost event or a crash between two API calls is repaired on the next pass.
Pods are observed through a kopf index (one cluster-wide watch with a label selector), not listed per job.
"""

from __future__ import annotations

import datetime
import secrets
from typing import Any

import kopf

from sneppx_operator import builders, config, k8s, reconcile

RESOURCE = (builders.GROUP, builders.VERSION, builders.PLURAL)


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    config.apply(settings)
    k8s.connect()


@kopf.index("pods", labels={builders.LABEL_JOB: kopf.PRESENT})
def job_pods(
    name: str, namespace: str, meta: kopf.Meta, spec: kopf.Spec, status: kopf.Status, **_: Any
) -> dict[tuple[str, str], reconcile.ObservedPod]:
    pod = reconcile.observe_pod(name, meta, spec, status)
    return {} if pod is None else {(namespace, meta["labels"][builders.LABEL_JOB]): pod}


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE, field="spec")
def reconcile_job(body: kopf.Body, job_pods: kopf.Index, patch: kopf.Patch, retry: int, **_: Any) -> None:
    _reconcile(body, job_pods, patch, retry)


@kopf.timer(*RESOURCE, interval=config.resync_seconds(), initial_delay=config.resync_seconds())
def resync_job(body: kopf.Body, job_pods: kopf.Index, patch: kopf.Patch, retry: int, **_: Any) -> None:
    _reconcile(body, job_pods, patch, retry)


@kopf.on.delete(*RESOURCE)
def delete_job(body: kopf.Body, name: str, namespace: str, uid: str, retry: int, **_: Any) -> None:
    actions = reconcile.cleanup_actions(name, uid, k8s.list_job_pods(namespace, name))
    refused = k8s.apply(namespace, actions).refused
    if refused is not None:  # the finalizer stays until the job's objects are gone
        message = reconcile.describe_refusal(refused)
        k8s.post_events(body, [reconcile.Event("Warning", "FailedDelete", message)])
        raise kopf.TemporaryError(message, delay=config.retry_delay(retry))


def _reconcile(body: kopf.Body, job_pods: kopf.Index, patch: kopf.Patch, retry: int) -> None:
    job = reconcile.Job.from_body(body)
    observed = list(job_pods.get((job.namespace, job.name), []))
    now = datetime.datetime.now(datetime.UTC)
    plan = reconcile.plan(job, observed, now=now, heartbeat_key=secrets.token_bytes(32))
    settled = reconcile.settle(job, plan, k8s.apply(job.namespace, plan.actions), now=now)
    k8s.post_events(body, settled.events)
    patch.status.update(reconcile.status_patch(job.status, settled.status))
    # kopf writes the status patch whether or not the handler raises; raising picks kopf's retry policy.
    if settled.error is not None and settled.retryable:
        raise kopf.TemporaryError(settled.error, delay=config.retry_delay(retry))
    if settled.error is not None:
        raise kopf.PermanentError(settled.error)
