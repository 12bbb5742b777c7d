"""Compare-and-swap records in a job's rendezvous ConfigMap: the `record.RecordStore` of an agent in a pod.

Why: in operator mode the agents rendezvous through the Kubernetes API instead of a shared directory or bucket,
with the per-job ServiceAccount the operator gives their pods (get, watch, update and patch on that one object,
nothing else). The layout of the object (one data entry per record) is `job_object`'s.

Each call reads the object; a write is a JSON merge patch of the one entry it changes, carrying the
`resourceVersion` it read as a precondition, so the API server applies it only if nothing changed the object in
between (409 otherwise: read again and re-check the entry's own condition). A record's `version` is a digest of
its stored text: a swap succeeds only while the entry still holds the text that was read.

The agents can't create the object (RBAC can't grant `create` by name); until the operator has made it, calls
raise `RecordUnavailableError`, which the rendezvous retries. Errors follow `contract.record`: 404 and 5xx, 429
and connection failures are `RecordUnavailableError`; 401 and 403 `RecordStoreError` (naming the object);
a record that would overflow the object (1 MiB) is `RecordStoreError` too, before anything is sent.

This is the only runtime module that imports `kubernetes`, lazily: it is an optional dependency of the runtime
(`pip install sneppx[k8s]`, or the operator image).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from collections.abc import Callable, Mapping
from typing import Any

from SneppX_ALG import errors
from SneppX_ALG.contract import job_object, record
from SneppX_ALG.contract.env import ENV_NAMESPACE, ENV_OBJECT

MAX_OBJECT_BYTES = 1 << 20  # what the API server accepts for a ConfigMap's data
OBJECT_HEADROOM_BYTES = 16 << 10  # metadata and JSON quoting beside the data
REQUEST_TIMEOUT_S = (5.0, 15.0)  # (connect, read) for each API call
MAX_WRITE_ATTEMPTS = 64  # writes that lost the object's resourceVersion race before giving up (transient)


def version_of(text: str) -> str:
    """A record's version: a digest of its stored text (a value's text is canonical JSON, so equal values share
    one, as `record.RecordStore` allows)."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def _kubernetes() -> Any:
    try:
        import kubernetes
    except ImportError:
        raise errors.RecordStoreError(
            "the Kubernetes record store needs the kubernetes package: pip install 'sneppx[k8s]'"
        ) from None
    return kubernetes


class KubernetesRecordStore:
    """`record.RecordStore` over the data of one ConfigMap (see the module docstring). Thread-safe as far as the
    API client is: each call is independent."""

    def __init__(self, namespace: str, name: str, *, api_client: Any = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        kubernetes = _kubernetes()
        self.namespace = namespace
        self.name = name
        self.uri = f"k8s://{namespace}/configmaps/{name}"
        self._client = api_client if api_client is not None else _client_from_environment(kubernetes)
        self._core = kubernetes.client.CoreV1Api(self._client)
        self._api_exception = kubernetes.client.ApiException
        self._sleep = sleep
        self._random = random.Random()

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> KubernetesRecordStore:
        """The store of the job this pod belongs to: the object named in SNEPPX_RENDEZVOUS_OBJECT in
        SNEPPX_NAMESPACE (both set by the operator), with the pod's credentials (its ServiceAccount token in a
        cluster; KUBECONFIG elsewhere)."""
        namespace, name = environ.get(ENV_NAMESPACE), environ.get(ENV_OBJECT)
        if not namespace or not name:
            raise errors.RecordStoreError(
                f"{ENV_NAMESPACE} and {ENV_OBJECT} must name the job's rendezvous object "
                "(the operator sets both in every rank's pod)"
            )
        return cls(namespace, name)

    # -- the RecordStore calls ------------------------------------------------------------------------------

    def create(self, key: str, value: Mapping[str, Any]) -> record.Record:
        encoded, text = job_object.data_key(key), job_object.encode_value(key, value)

        def change(data: Mapping[str, str]) -> str | None:
            if encoded in data:
                raise errors.RecordExistsError(f"{key} exists in {self.uri}", key=key)
            return text

        self._write(key, encoded, change)
        return record.Record(key, json.loads(text), version_of(text))

    def read(self, key: str) -> record.Record | None:
        encoded = job_object.data_key(key)
        text = self._data(key).get(encoded)
        if text is None:
            return None
        value = record.decode(key, text.encode("utf-8", "surrogatepass"))
        return record.Record(key, value, version_of(text))

    def swap(self, key: str, value: Mapping[str, Any], version: str) -> record.Record:
        encoded, text = job_object.data_key(key), job_object.encode_value(key, value)

        def change(data: Mapping[str, str]) -> str | None:
            current = data.get(encoded)
            if current is None or version_of(current) != version:
                raise errors.RecordConflictError(f"{key} in {self.uri} is no longer at version {version}", key=key)
            return text

        self._write(key, encoded, change)
        return record.Record(key, json.loads(text), version_of(text))

    def keys(self, prefix: str = "", *, limit: int | None = None) -> list[str]:
        record.check_prefix(prefix)
        record.check_limit(limit)
        found = sorted(
            key for encoded in self._data(prefix or "(all)")
            if (key := job_object.record_key(encoded)) is not None and key.startswith(prefix)
        )
        return found if limit is None else found[:limit]

    def delete(self, key: str) -> None:
        encoded = job_object.data_key(key)
        self._write(key, encoded, lambda data: None, absent_ok=True)

    # -- the object ----------------------------------------------------------------------------------------

    def _read_object(self, key: str) -> tuple[dict[str, str], str]:
        """(data, resourceVersion) of the object as it is now."""
        try:
            found = self._core.read_namespaced_config_map(self.name, self.namespace,
                                                          _request_timeout=REQUEST_TIMEOUT_S)
        except Exception as exc:
            raise self._error(exc, key) from exc
        return dict(found.data or {}), str(found.metadata.resource_version)

    def _data(self, key: str) -> dict[str, str]:
        return self._read_object(key)[0]

    def _write(self, key: str, encoded: str, change: Callable[[Mapping[str, str]], str | None], *,
               absent_ok: bool = False) -> None:
        """Read, let `change` decide the entry's new text (None removes it; it raises when its condition fails),
        and patch that entry under the read's resourceVersion; again on 409 until it lands."""
        delay = 0.01
        for _ in range(MAX_WRITE_ATTEMPTS):
            data, resource_version = self._read_object(key)
            if absent_ok and encoded not in data:
                return
            text = change(data)
            if text is not None:
                self._check_room(key, encoded, text, data)
            patch = {"metadata": {"resourceVersion": resource_version}, "data": {encoded: text}}
            try:
                self._core.patch_namespaced_config_map(
                    self.name, self.namespace, patch, _content_type="application/merge-patch+json",
                    _request_timeout=REQUEST_TIMEOUT_S,
                )
                return
            except self._api_exception as exc:
                if exc.status != 409:
                    raise self._error(exc, key) from exc
            except Exception as exc:
                raise self._error(exc, key) from exc
            self._sleep(delay * self._random.uniform(0.5, 1.5))  # another writer's change landed first
            delay = min(delay * 2, 0.5)
        raise errors.RecordUnavailableError(
            f"{self.uri} changed under {MAX_WRITE_ATTEMPTS} writes of {key} in a row; its outcome is unknown",
            key=key,
        )

    def _check_room(self, key: str, encoded: str, text: str, data: Mapping[str, str]) -> None:
        size = sum(len(k) + len(v.encode("utf-8", "surrogatepass")) for k, v in data.items() if k != encoded)
        size += len(encoded) + len(text.encode("utf-8", "surrogatepass"))
        if size > MAX_OBJECT_BYTES - OBJECT_HEADROOM_BYTES:
            raise errors.RecordStoreError(
                f"{self.uri} would hold {size} bytes of records with {key}; a ConfigMap holds about "
                f"{MAX_OBJECT_BYTES - OBJECT_HEADROOM_BYTES}", key=key,
            )

    def _error(self, exc: BaseException, key: str) -> errors.RecordError:
        if isinstance(exc, errors.RecordError):
            return exc
        status = getattr(exc, "status", None) if isinstance(exc, self._api_exception) else None
        if status is None:  # no answer: connection refused or reset, a timeout, TLS
            return errors.RecordUnavailableError(f"{self.uri} could not be reached: {exc}", key=key)
        reason = _message(exc)
        if status == 404:
            return errors.RecordUnavailableError(
                f"{self.uri} does not exist (yet): the operator creates it with the job ({reason})", key=key
            )
        if status == 429 or status >= 500:
            return errors.RecordUnavailableError(f"{self.uri} answered {status}: {reason}", key=key)
        if status in (401, 403):
            return errors.RecordStoreError(
                f"{self.uri} refused this pod's credentials ({status}): {reason}", key=key
            )
        return errors.RecordStoreError(f"{self.uri} refused the call ({status}): {reason}", key=key)


def _message(exc: BaseException) -> str:
    try:
        return str(json.loads(getattr(exc, "body", "") or "")["message"])
    except (TypeError, ValueError, KeyError):
        return str(getattr(exc, "reason", "") or exc)


def _client_from_environment(kubernetes: Any) -> Any:
    """An API client with the pod's credentials: its projected ServiceAccount token in a cluster, else
    KUBECONFIG (or ~/.kube/config)."""
    configuration = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=configuration)
    except kubernetes.config.ConfigException:
        try:
            kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None,
                                               client_configuration=configuration)
        except (kubernetes.config.ConfigException, OSError) as exc:
            raise errors.RecordStoreError(
                f"no Kubernetes credentials: not in a pod with a ServiceAccount token, and no kubeconfig ({exc})"
            ) from None
    return kubernetes.client.ApiClient(configuration)
