"""The only module that calls the Kubernetes API (besides kopf's own watches) and the only one that writes.

Why one module: every side effect the operator has on a cluster is here, each call is idempotent
(creating what the job already has is success, deleting what is gone is success), it never touches an
object the job doesn't control, and everything above it is pure and testable without a cluster. Calls
are synchronous: the job loops run them in worker threads.

Every write first asks the fence (`set_fence`: the leader election's check, leader.py), so a replica that
is not the leader, or no longer may act as one, sends nothing.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import kubernetes
from kubernetes.client import ApiException

from SneppX_ALG.contract import job_object
from sneppx_operator import builders, reconcile

_lock = threading.Lock()
_api: kubernetes.client.ApiClient | None = None
_fence: Callable[[], None] | None = None
log = logging.getLogger(__name__)
REPORTING_INSTANCE = os.environ.get("POD_NAME") or socket.gethostname()
REQUEST_TIMEOUT_S = 30.0  # no call may hang a job's pass (a partitioned API server)


class StatusConflict(Exception):
    """The job changed since the pass read it (its resourceVersion moved): nothing of the pass was done; plan
    again from what is there now."""


def set_fence(check: Callable[[], None] | None) -> None:
    """`check` raises (leader.NotLeaderError) when this replica must not write; None: always write (one
    replica, no election)."""
    global _fence
    _fence = check


def _guard() -> None:
    if _fence is not None:
        _fence()


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


def api_client() -> kubernetes.client.ApiClient:
    with _lock:
        api = _api
    if api is None:
        connect()
        return api_client()
    return api


_client = api_client


def _core() -> kubernetes.client.CoreV1Api:
    return kubernetes.client.CoreV1Api(_client())


# The kinds each verb is used on, and so the chart's RBAC (charts/.../_helpers.tpl; tests/k8s/test_helm.py
# holds the two to each other). A name already taken is read to name its holder; Secrets are never read (a
# Secret's name carries the job's uid instead); only pods are deleted (the garbage collector removes the rest
# with the job, by their owner references).
KINDS_BY_VERB = {
    "create": ("Pod", "Service", "Secret", "ConfigMap", "ServiceAccount", "Role", "RoleBinding"),
    "read": ("Pod", "Service", "ConfigMap", "ServiceAccount", "Role", "RoleBinding"),
    "delete": ("Pod",),
}


def _calls(verb: str) -> dict[str, Any]:
    """The namespaced create/read/delete call of each kind the operator manages."""
    core = _core()
    rbac = kubernetes.client.RbacAuthorizationV1Api(_client())
    apis = {
        "Pod": (core, "pod"),
        "Service": (core, "service"),
        "Secret": (core, "secret"),
        "ConfigMap": (core, "config_map"),
        "ServiceAccount": (core, "service_account"),
        "Role": (rbac, "role"),
        "RoleBinding": (rbac, "role_binding"),
    }
    return {kind: getattr(apis[kind][0], f"{verb}_namespaced_{apis[kind][1]}") for kind in KINDS_BY_VERB[verb]}


def _read_meta(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    """The object's metadata (camelCase, as in a manifest); None when it is gone."""
    try:
        found = _calls("read")[kind](name, namespace, _request_timeout=REQUEST_TIMEOUT_S)
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
    _guard()
    try:
        _calls("create")[kind](namespace, dict(body), _request_timeout=REQUEST_TIMEOUT_S)
    except ApiException as exc:
        if exc.status != 409:
            raise
    else:
        return True
    if kind not in KINDS_BY_VERB["read"]:  # a Secret: its name carries the job's uid
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
    if uid is None and action.kind in KINDS_BY_VERB["read"]:
        existing = _read_meta(action.kind, namespace, action.name)
        if existing is None or reconcile.controller_uid(existing) != action.owner_uid:
            return False
        uid = existing.get("uid")
    options = kubernetes.client.V1DeleteOptions(
        preconditions=kubernetes.client.V1Preconditions(uid=uid) if uid else None,
        grace_period_seconds=0 if action.force else None,
    )
    _guard()
    try:
        _calls("delete")[action.kind](action.name, namespace, body=options, _request_timeout=REQUEST_TIMEOUT_S)
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
    _guard()
    try:
        _core().patch_namespaced_config_map(
            action.name, namespace, patch, _content_type="application/merge-patch+json",
            _request_timeout=REQUEST_TIMEOUT_S,
        )
    except ApiException as exc:
        if exc.status in (404, 409):
            return False
        raise
    return True


def delete_job(namespace: str, action: reconcile.DeleteJob) -> bool:
    """Delete the ElasticTrainingJob itself (its TTL ran out), only while it is the object with that uid."""
    options = kubernetes.client.V1DeleteOptions(preconditions=kubernetes.client.V1Preconditions(uid=action.uid))
    _guard()
    try:
        kubernetes.client.CustomObjectsApi(_client()).delete_namespaced_custom_object(
            builders.GROUP, builders.VERSION, namespace, builders.PLURAL, action.name, body=options,
            _request_timeout=REQUEST_TIMEOUT_S,
        )
    except ApiException as exc:
        if exc.status in (404, 409):
            return False
        raise
    return True


def drop_finalizer(namespace: str, action: reconcile.DropFinalizer) -> bool:
    """Take one finalizer off the job, only while it is the object with that uid and the finalizer is where it
    was read (a JSON patch with tests: nothing else on the list is touched)."""
    job = read_job(namespace, action.name)
    if job is None or job["metadata"].get("uid") != action.uid:
        return False
    finalizers = list(job["metadata"].get("finalizers") or [])
    if action.finalizer not in finalizers:
        return False
    index = finalizers.index(action.finalizer)
    patch = [
        {"op": "test", "path": "/metadata/uid", "value": action.uid},
        {"op": "test", "path": f"/metadata/finalizers/{index}", "value": action.finalizer},
        {"op": "remove", "path": f"/metadata/finalizers/{index}"},
    ]
    _guard()
    try:
        kubernetes.client.CustomObjectsApi(_client()).patch_namespaced_custom_object(
            builders.GROUP, builders.VERSION, namespace, builders.PLURAL, action.name, patch,
            _content_type="application/json-patch+json", _request_timeout=REQUEST_TIMEOUT_S,
        )
    except ApiException as exc:
        if exc.status in (404, 409, 422):  # gone, or changed since it was read: the next pass looks again
            return False
        raise
    return True


def read_job(namespace: str, name: str) -> dict[str, Any] | None:
    """The job as the API server has it now (a quorum read: the pass plans from the newest status, never from
    a watch event that lags behind its own last write); None when it is gone."""
    try:
        job: Any = kubernetes.client.CustomObjectsApi(_client()).get_namespaced_custom_object(
            builders.GROUP, builders.VERSION, namespace, builders.PLURAL, name, _request_timeout=REQUEST_TIMEOUT_S,
        )
        return dict(job)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def list_pods(namespace: str, job_name: str) -> list[reconcile.ObservedPod]:
    """The job's pods as the API server has them now (a quorum list), for a pass whose watch index contradicts
    the status it read (reconcile.pods_lag_status). Which of them the job owns is the plan's to check."""
    found: Any = _core().list_namespaced_pod(
        namespace, label_selector=f"{builders.LABEL_JOB}={job_name}", _request_timeout=REQUEST_TIMEOUT_S
    )
    pods = []
    for item in _client().sanitize_for_serialization(found).get("items") or []:
        meta = item.get("metadata") or {}
        pod = reconcile.observe_pod(str(meta.get("name")), meta, item.get("spec") or {}, item.get("status") or {})
        if pod is not None:
            pods.append(pod)
    return pods


def patch_job_status(
    namespace: str, name: str, uid: str, resource_version: str, patch: Mapping[str, Any]
) -> str:
    """Merge the status patch into the job's status subresource, only while the job is the object with that uid
    and still at `resource_version` (the version the pass planned from): two writers (a stale leader, a
    pass racing a spec edit) can never overwrite each other's counts. Returns the new resourceVersion;
    raises StatusConflict when the job moved on."""
    if not patch:
        return resource_version
    body = {"metadata": {"uid": uid, "resourceVersion": resource_version}, "status": dict(patch)}
    _guard()
    try:
        written: Any = kubernetes.client.CustomObjectsApi(_client()).patch_namespaced_custom_object_status(
            builders.GROUP, builders.VERSION, namespace, builders.PLURAL, name, body,
            _content_type="application/merge-patch+json", _request_timeout=REQUEST_TIMEOUT_S,
        )
    except ApiException as exc:
        if exc.status in (404, 409):
            raise StatusConflict(f"{namespace}/{name} changed since it was read ({exc.status})") from None
        raise
    return str(written["metadata"]["resourceVersion"])


def _carry_out(namespace: str, action: reconcile.Action) -> bool:
    if isinstance(action, reconcile.Create):
        return create(action.body)
    if isinstance(action, reconcile.PutRecords):
        return put_records(namespace, action)
    if isinstance(action, reconcile.DeleteJob):
        return delete_job(namespace, action)
    if isinstance(action, reconcile.DropFinalizer):
        return drop_finalizer(namespace, action)
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
        return str(json.loads(exc.body or "")["message"])
    except (TypeError, ValueError, KeyError):
        return str(exc.reason or exc)


def post_events(job: reconcile.Job, events: Sequence[reconcile.Event]) -> None:
    """Post the events on the job (core/v1 Events, as `kubectl describe` shows them). Best effort: an event
    that can't be posted is logged, never retried, never fails the pass."""
    if not events:
        return
    reference = kubernetes.client.V1ObjectReference(
        api_version=builders.API_VERSION, kind=builders.KIND, name=job.name, namespace=job.namespace, uid=job.uid,
        resource_version=job.resource_version or None,
    )
    now = datetime.datetime.now(datetime.UTC)
    for event in events:
        body = kubernetes.client.CoreV1Event(
            metadata=kubernetes.client.V1ObjectMeta(generate_name=f"{job.name}.", namespace=job.namespace),
            involved_object=reference, type=event.type, reason=event.reason, message=event.message[:1024],
            first_timestamp=now, last_timestamp=now, count=1, source=kubernetes.client.V1EventSource(
                component=builders.MANAGED_BY),
            reporting_component=f"{builders.GROUP}/operator", reporting_instance=REPORTING_INSTANCE,
        )
        try:
            _guard()
            _core().create_namespaced_event(job.namespace, body, _request_timeout=REQUEST_TIMEOUT_S)
        except ApiException as exc:
            log.warning("could not post event %s on %s/%s: %s", event.reason, job.namespace, job.name, _message(exc))
