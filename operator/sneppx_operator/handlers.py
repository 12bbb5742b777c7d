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
def reconcile_job(body: kopf.Body, job_pods: kopf.Index, patch: kopf.Patch, **_: Any) -> None:
    _reconcile(body, job_pods, patch)


@kopf.timer(*RESOURCE, interval=config.resync_seconds(), initial_delay=config.resync_seconds())
def resync_job(body: kopf.Body, job_pods: kopf.Index, patch: kopf.Patch, **_: Any) -> None:
    _reconcile(body, job_pods, patch)


@kopf.on.delete(*RESOURCE)
def delete_job(name: str, namespace: str, **_: Any) -> None:
    k8s.apply(namespace, reconcile.cleanup_actions(name, k8s.list_pod_names(namespace, name)))


def _reconcile(body: kopf.Body, job_pods: kopf.Index, patch: kopf.Patch) -> None:
    job = reconcile.Job.from_body(body)
    observed = list(job_pods.get((job.namespace, job.name), []))
    plan = reconcile.plan(
        job, observed, now=datetime.datetime.now(datetime.UTC), heartbeat_key=secrets.token_bytes(32)
    )
    done = k8s.apply(job.namespace, plan.actions)
    k8s.post_events(body, reconcile.events_for(done, job.status.get("phase"), plan.status))
    patch.status.update(reconcile.status_patch(job.status, plan.status))
