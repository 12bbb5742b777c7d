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

from SneppX_ALG.storage import job_object
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


def _client() -> kubernetes.client.ApiClient:
    with _lock:
        api = _api
    if api is None:
        connect()
        return _client()
    return api


def _core() -> kubernetes.client.CoreV1Api:
    return kubernetes.client.CoreV1Api(_client())


def _calls(verb: str) -> dict[str, Any]:
    """The namespaced create/read/delete call of each kind the operator manages."""
    core = _core()
    rbac = kubernetes.client.RbacAuthorizationV1Api(_client())
    kinds = {
        "Pod": (core, "pod"),
        "Service": (core, "service"),
        "Secret": (core, "secret"),
        "ConfigMap": (core, "config_map"),
        "ServiceAccount": (core, "service_account"),
        "Role": (rbac, "role"),
        "RoleBinding": (rbac, "role_binding"),
    }
    if verb == "read":  # Secrets are not readable (the chart's RBAC): a Secret's name carries the job's uid
        kinds.pop("Secret")
    return {kind: getattr(api, f"{verb}_namespaced_{name}") for kind, (api, name) in kinds.items()}


def _read_meta(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    """The object's metadata (camelCase, as in a manifest); None when it is gone."""
    try:
        found = _calls("read")[kind](name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return dict(_client().sanitize_for_serialization(found.metadata))


def _holder(meta: Mapping[str, Any]) -> str:
    """Who controls an object, for a person: "StatefulSet postgres (uid ...)", or "" when nothing does."""
    ref = next((r for r in meta.get("ownerReferences") or [] if r.get("controller")), None)
    return f"{ref.get('kind')} {ref.get('name')} (uid {ref.get('uid')})" if ref else ""


class _NameInUse(Exception):
    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


def create(body: Mapping[str, Any]) -> bool:
    """Create one of the job's namespaced objects. False when this job's object is already there; raises
    _NameInUse when the name is held by an object the job (the body's controller) doesn't control."""
    kind, namespace, name = str(body["kind"]), body["metadata"]["namespace"], body["metadata"]["name"]
    try:
        _calls("create")[kind](namespace, dict(body))
    except ApiException as exc:
        if exc.status != 409:
            raise
    else:
        return True
    if kind not in _calls("read"):  # a Secret: its name carries the job's uid
        return False
    existing = _read_meta(kind, namespace, name)
    job_uid = reconcile.controller_uid(body["metadata"])
    if existing is not None and reconcile.controller_uid(existing) != job_uid:
        raise _NameInUse(_holder(existing))
    return False  # the job's own (or deleted in between: the next pass creates it)


def delete(namespace: str, action: reconcile.Delete) -> bool:
    """Delete one of the job's namespaced objects. False when it is already gone or isn't the job's: a
    readable object is checked first, and its uid goes into the delete's preconditions so an object
    recreated under the same name in between is left alone. A forced delete has no grace period (a pod
    whose kubelet is gone: the API server removes it at once)."""
    uid = action.uid
    if uid is None and action.kind in _calls("read"):
        existing = _read_meta(action.kind, namespace, action.name)
        if existing is None or reconcile.controller_uid(existing) != action.owner_uid:
            return False
        uid = existing.get("uid")
    options = kubernetes.client.V1DeleteOptions(
        preconditions=kubernetes.client.V1Preconditions(uid=uid) if uid else None,
        grace_period_seconds=0 if action.force else None,
    )
    try:
        _calls("delete")[action.kind](action.name, namespace, body=options)
    except ApiException as exc:
        if exc.status in (404, 409):  # gone, or (409) a different object now holds the name
            return False
        raise
    return True


def put_records(namespace: str, action: reconcile.PutRecords) -> bool:
    """Write the operator's records into the job's rendezvous ConfigMap (a merge patch of those entries only,
    so the agents' records beside them are untouched). The object's uid is the patch's precondition: a
    ConfigMap recreated under the name by someone else is never written."""
    existing = _read_meta("ConfigMap", namespace, action.name)
    if existing is None or reconcile.controller_uid(existing) != action.owner_uid:
        return False
    data = {
        job_object.data_key(key): None if value is None else job_object.encode_value(key, value)
        for key, value in action.records
    }
    patch = {"metadata": {"uid": existing.get("uid")}, "data": data}
    try:
        _core().patch_namespaced_config_map(
            action.name, namespace, patch, _content_type="application/merge-patch+json"
        )
    except ApiException as exc:
        if exc.status in (404, 409):
            return False
        raise
    return True


def delete_job(namespace: str, action: reconcile.DeleteJob) -> bool:
    """Delete the ElasticTrainingJob itself (its TTL ran out), only while it is the object with that uid."""
    options = kubernetes.client.V1DeleteOptions(preconditions=kubernetes.client.V1Preconditions(uid=action.uid))
    try:
        kubernetes.client.CustomObjectsApi(_client()).delete_namespaced_custom_object(
            builders.GROUP, builders.VERSION, namespace, builders.PLURAL, action.name, body=options
        )
    except ApiException as exc:
        if exc.status in (404, 409):
            return False
        raise
    return True


def patch_job_status(namespace: str, name: str, uid: str, patch: Mapping[str, Any]) -> None:
    """Merge the changed status fields into the job's status subresource, only while it is the job with
    that uid (a job deleted and recreated under the name in between is left alone: 409)."""
    if not patch:
        return
    body = {"metadata": {"uid": uid}, "status": dict(patch)}
    kubernetes.client.CustomObjectsApi(_client()).patch_namespaced_custom_object_status(
        builders.GROUP, builders.VERSION, namespace, builders.PLURAL, name, body,
        _content_type="application/merge-patch+json",
    )


def _carry_out(namespace: str, action: reconcile.Action) -> bool:
    if isinstance(action, reconcile.Create):
        return create(action.body)
    if isinstance(action, reconcile.PutRecords):
        return put_records(namespace, action)
    if isinstance(action, reconcile.DeleteJob):
        return delete_job(namespace, action)
    return delete(namespace, action)


def apply(namespace: str, actions: Iterable[reconcile.Action]) -> reconcile.Outcome:
    """Carry out the actions in order until one is refused. API refusals are returned, not raised, so
    reconcile.settle() can put them into status and events; only a failure to reach the API raises."""
    done: list[reconcile.Action] = []
    for action in actions:
        try:
            changed = _carry_out(namespace, action)
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
