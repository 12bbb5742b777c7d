"""The only module that calls the Kubernetes API (besides kopf's own watching and status patches).

Why one module: every side effect the operator has on a cluster is here, each call is idempotent
(creating what exists is success, deleting what is gone is success), and everything above it is pure
and testable without a cluster. Calls are synchronous: kopf runs sync handlers in a thread pool.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import kopf
import kubernetes
from kubernetes.client import ApiException

from sneppx_operator import builders, reconcile

_lock = threading.Lock()
_api: kubernetes.client.ApiClient | None = None


def connect() -> None:
    """(Re)load credentials: the pod's service account in a cluster, else KUBECONFIG / ~/.kube/config.

    Called at every operator startup, so a restarted operator (or a test) never keeps stale credentials.
    """
    global _api
    configuration = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=configuration)
    except kubernetes.config.ConfigException:
        # The package reads KUBECONFIG once, at import; read it now so a changed environment counts.
        kubernetes.config.load_kube_config(
            config_file=os.environ.get("KUBECONFIG") or None, client_configuration=configuration
        )
    with _lock:
        previous, _api = _api, kubernetes.client.ApiClient(configuration)
    if previous is not None:
        previous.close()


def _core() -> kubernetes.client.CoreV1Api:
    with _lock:
        api = _api
    if api is None:
        connect()
        return _core()
    return kubernetes.client.CoreV1Api(api)


def create(body: Mapping[str, Any]) -> bool:
    """Create a namespaced Pod, Service or Secret. False when it already exists (409)."""
    core = _core()
    creators = {
        "Pod": core.create_namespaced_pod,
        "Service": core.create_namespaced_service,
        "Secret": core.create_namespaced_secret,
    }
    try:
        creators[str(body["kind"])](body["metadata"]["namespace"], dict(body))
    except ApiException as exc:
        if exc.status == 409:
            return False
        raise
    return True


def delete(kind: str, namespace: str, name: str) -> bool:
    """Delete a namespaced Pod, Service or Secret. False when it is already gone (404)."""
    core = _core()
    deleters = {
        "Pod": core.delete_namespaced_pod,
        "Service": core.delete_namespaced_service,
        "Secret": core.delete_namespaced_secret,
    }
    try:
        deleters[kind](name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


def apply(namespace: str, actions: Iterable[reconcile.Action]) -> list[reconcile.Action]:
    """Carry out the actions in order; return those that changed something."""
    done: list[reconcile.Action] = []
    for action in actions:
        if isinstance(action, reconcile.Create):
            changed = create(action.body)
        else:
            changed = delete(action.kind, namespace, action.name)
        if changed:
            done.append(action)
    return done


def list_pod_names(namespace: str, job_name: str) -> list[str]:
    pods = _core().list_namespaced_pod(namespace, label_selector=f"{builders.LABEL_JOB}={job_name}")
    return [pod.metadata.name for pod in pods.items]


def post_events(body: kopf.Body | Mapping[str, Any], events: Sequence[reconcile.Event]) -> None:
    """Queue events on the job through kopf's poster (batched, retried, never blocks a handler)."""
    for event in events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message[:1024])
