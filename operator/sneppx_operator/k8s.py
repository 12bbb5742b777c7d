"""The only module that calls the Kubernetes API (besides kopf's own watching and status patches).

Why one module: every side effect the operator has on a cluster is here, each call is idempotent
(creating what the job already has is success, deleting what is gone is success), it never touches an
object the job doesn't control, and everything above it is pure and testable without a cluster. Calls
are synchronous: kopf runs sync handlers in a thread pool.
"""

from __future__ import annotations

import json
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


# What the operator may read (the chart's RBAC): Secrets are not readable, so a Secret's owner can't be
# checked; the job's Secret carries the job's uid in its name instead (builders.secret_name).
def _readers(core: kubernetes.client.CoreV1Api) -> dict[str, Any]:
    return {"Pod": core.read_namespaced_pod, "Service": core.read_namespaced_service}


def _read_meta(
    core: kubernetes.client.CoreV1Api, kind: str, namespace: str, name: str
) -> dict[str, Any] | None:
    """The object's metadata (camelCase, as in a manifest); None when it is gone."""
    try:
        found = _readers(core)[kind](name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return dict(core.api_client.sanitize_for_serialization(found.metadata))


def _holder(meta: Mapping[str, Any]) -> str:
    """Who controls an object, for a person: "StatefulSet postgres (uid ...)", or "" when nothing does."""
    ref = next((r for r in meta.get("ownerReferences") or [] if r.get("controller")), None)
    return f"{ref.get('kind')} {ref.get('name')} (uid {ref.get('uid')})" if ref else ""


class _NameInUse(Exception):
    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


def create(body: Mapping[str, Any]) -> bool:
    """Create a namespaced Pod, Service or Secret. False when this job's object is already there; raises
    _NameInUse when the name is held by an object the job (the body's controller) doesn't control."""
    core = _core()
    creators = {
        "Pod": core.create_namespaced_pod,
        "Service": core.create_namespaced_service,
        "Secret": core.create_namespaced_secret,
    }
    kind, namespace, name = str(body["kind"]), body["metadata"]["namespace"], body["metadata"]["name"]
    try:
        creators[kind](namespace, dict(body))
    except ApiException as exc:
        if exc.status != 409:
            raise
    else:
        return True
    if kind not in _readers(core):  # a Secret: its name carries the job's uid
        return False
    existing = _read_meta(core, kind, namespace, name)
    job_uid = reconcile.controller_uid(body["metadata"])
    if existing is not None and reconcile.controller_uid(existing) != job_uid:
        raise _NameInUse(_holder(existing))
    return False  # the job's own (or deleted in between: the next pass creates it)


def delete(namespace: str, action: reconcile.Delete) -> bool:
    """Delete a namespaced Pod, Service or Secret the job controls. False when it is already gone or isn't
    the job's: a readable object is checked first, and its uid goes into the delete's preconditions so an
    object recreated under the same name in between is left alone."""
    core = _core()
    deleters = {
        "Pod": core.delete_namespaced_pod,
        "Service": core.delete_namespaced_service,
        "Secret": core.delete_namespaced_secret,
    }
    uid = action.uid
    if uid is None and action.kind in _readers(core):
        existing = _read_meta(core, action.kind, namespace, action.name)
        if existing is None or reconcile.controller_uid(existing) != action.owner_uid:
            return False
        uid = existing.get("uid")
    options = kubernetes.client.V1DeleteOptions(preconditions=kubernetes.client.V1Preconditions(uid=uid))
    try:
        deleters[action.kind](action.name, namespace, body=options if uid else None)
    except ApiException as exc:
        if exc.status in (404, 409):  # gone, or (409) a different object now holds the name
            return False
        raise
    return True


def apply(namespace: str, actions: Iterable[reconcile.Action]) -> reconcile.Outcome:
    """Carry out the actions in order until one is refused. API refusals are returned, not raised, so
    reconcile.settle() can put them into status and events; only a failure to reach the API raises."""
    done: list[reconcile.Action] = []
    for action in actions:
        try:
            changed = (
                create(action.body) if isinstance(action, reconcile.Create) else delete(namespace, action)
            )
        except _NameInUse as clash:
            refusal = reconcile.Refusal(action, 409, "name in use", name_in_use=True, holder=clash.holder)
            return reconcile.Outcome(tuple(done), refusal)
        except ApiException as exc:
            return reconcile.Outcome(
                tuple(done), reconcile.Refusal(action, int(exc.status or 0), _message(exc))
            )
        if changed:
            done.append(action)
    return reconcile.Outcome(tuple(done))


def _message(exc: ApiException) -> str:
    """The API server's own message (its Status object), which says what to fix; else the HTTP reason."""
    try:
        return str(json.loads(exc.body)["message"])
    except (TypeError, ValueError, KeyError):
        return str(exc.reason or exc)


def list_job_pods(namespace: str, job_name: str) -> list[reconcile.ObservedPod]:
    """The pods labelled with the job's name, as the index sees them (their controllers still to check)."""
    core = _core()
    pods = core.list_namespaced_pod(namespace, label_selector=f"{builders.LABEL_JOB}={job_name}")
    observed = []
    for pod in pods.items:
        manifest = core.api_client.sanitize_for_serialization(pod)
        summary = reconcile.observe_pod(
            manifest["metadata"]["name"],
            manifest["metadata"],
            manifest.get("spec") or {},
            manifest.get("status") or {},
        )
        if summary is not None:
            observed.append(summary)
    return observed


def post_events(body: kopf.Body | Mapping[str, Any], events: Sequence[reconcile.Event]) -> None:
    """Queue events on the job through kopf's poster (batched, retried, never blocks a handler)."""
    for event in events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message[:1024])
