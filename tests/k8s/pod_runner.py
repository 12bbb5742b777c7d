"""A kubelet stand-in for the test cluster: pods of one namespace run as local processes.

Why: the test cluster has no scheduler and no kubelet (k8s_cluster.py), and the operator's lifecycle (a rank's
process killed, a node gone NotReady with its pods stuck Terminating, exit codes) is only tested for real if
pods really run and really die. The runner does for one namespace what a scheduler and kubelets would:

* binds each pending pod to a Ready fake Node (the Binding subresource, as the scheduler does);
* runs the pod's first container's command (`python` is this interpreter) as a local process, with the pod's
  environment (the downward API's pod IP is 127.0.0.1) and its volumes mapped to local directories: a
  persistentVolumeClaim to one shared directory (the "PVC"), a Secret or ConfigMap to its files, an emptyDir to a
  directory of its own, and the projected API token to a kubeconfig with a token requested for the pod's
  ServiceAccount (TokenRequest, bound to the pod), so the process talks to the API server as that account, under
  its RBAC; environment values under a mount path are rewritten to the local directory;
* reports Running and Ready, then the exit code (Succeeded/Failed) in pod status, as the kubelet does;
* on a pod's deletion, sends SIGTERM to the pod's process group (a runtime signals PID 1 only: a known
  difference), then SIGKILL after its grace period, and removes the pod (the final delete a kubelet makes);
* keeps its Nodes' heartbeat fresh (a cluster with a node controller would otherwise mark them NotReady), and
  taints them NoSchedule so that a real scheduler beside it never places other pods there (it binds directly);
* `set_node_ready(name, False)` marks a Node NotReady and stops acting for it: its processes are killed (the
  machine is gone) and its pods' deletions are never finished, so they stay Terminating until force-deleted.

Loopback only: the processes reach the API server on 127.0.0.1 and nothing else.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Self

import kubernetes
import yaml

TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
POLL_S = 0.1
HEARTBEAT_S = 5.0  # a node controller's grace is 20 s or more
TAINT = {"key": "sneppx.io/pod-runner", "effect": "NoSchedule"}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclasses.dataclass
class _Running:
    uid: str
    node: str
    proc: subprocess.Popen[bytes]
    log: pathlib.Path
    reported_end: bool = False
    stop_sent_at: float | None = None


class PodRunner:
    """Play kubelet for `namespace` (see the module docstring). Use as a context manager."""

    def __init__(
        self,
        api: kubernetes.client.ApiClient,
        server: str,
        ca_pem: bytes,
        namespace: str,
        workdir: pathlib.Path,
        nodes: tuple[str, ...] = ("node-a", "node-b", "node-c"),
    ) -> None:
        self.core = kubernetes.client.CoreV1Api(api)
        self.server, self.ca_pem, self.namespace = server, ca_pem, namespace
        self.workdir = workdir
        self.checkpoints = workdir / "pvc"
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        self.nodes = nodes
        self.not_ready: set[str] = set()
        self.running: dict[str, _Running] = {}  # by pod name
        self.errors: list[str] = []
        self._next_node = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=f"pod-runner-{namespace}", daemon=True)

    # -- lifecycle -------------------------------------------------------------------------------------------

    def __enter__(self) -> Self:
        for name in self.nodes:
            try:
                self.core.create_node({"metadata": {"name": name, "labels": {"sneppx.io/test-node": "true"}},
                                       "spec": {"taints": [TAINT]}})
            except kubernetes.client.ApiException as exc:
                if exc.status != 409:
                    raise
            self._write_node_ready(name, True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        with self._lock:
            for running in self.running.values():
                _kill(running.proc)
            self.running.clear()

    # -- what tests do ---------------------------------------------------------------------------------------

    def kill(self, pod: str, sig: int = signal.SIGKILL) -> None:
        """Send a real signal to the pod's process (its container "crashes")."""
        with self._lock:
            running = self.running[pod]
        os.killpg(running.proc.pid, sig)

    def pid(self, pod: str) -> int | None:
        with self._lock:
            running = self.running.get(pod)
        return None if running is None else running.proc.pid

    def node_of(self, pod: str) -> str | None:
        with self._lock:
            running = self.running.get(pod)
        return None if running is None else running.node

    def set_node_ready(self, name: str, ready: bool) -> None:
        """NotReady: the node's processes die with it and its kubelet stops (pods stay Terminating)."""
        with self._lock:
            if ready:
                self.not_ready.discard(name)
            else:
                self.not_ready.add(name)
                for running in self.running.values():
                    if running.node == name:
                        _kill(running.proc)
            self._write_node_ready(name, ready)  # under the lock: a heartbeat can't write Ready after it

    def log_of(self, pod: str) -> str:
        path = self.workdir / "logs" / f"{pod}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # -- the loop --------------------------------------------------------------------------------------------

    def _write_node_ready(self, name: str, ready: bool) -> None:
        condition = {
            "type": "Ready",
            "status": "True" if ready else "Unknown",
            "reason": "KubeletReady" if ready else "NodeStatusUnknown",
            "message": "the test's kubelet stand-in" if ready else "Kubelet stopped posting node status.",
            "lastTransitionTime": _now(),
            "lastHeartbeatTime": _now(),
        }
        self.core.patch_node_status(name, {"status": {"conditions": [condition]}})

    def _loop(self) -> None:
        beat = time.monotonic()
        while not self._stop.is_set():
            try:
                self._once()
                if time.monotonic() - beat >= HEARTBEAT_S:
                    beat = time.monotonic()
                    self._heartbeat()
            except Exception as exc:  # noqa: BLE001  (keep playing kubelet; the fixture fails on errors)
                self.errors.append(repr(exc))
            self._stop.wait(POLL_S)

    def _heartbeat(self) -> None:
        """Ready again for each Ready node, under the lock: set_node_ready(False) between the check and the
        write would otherwise be undone by it."""
        with self._lock:
            for name in self.nodes:
                if name not in self.not_ready:
                    self.core.patch_node_status(name, {"status": {"conditions": [
                        {"type": "Ready", "status": "True", "reason": "KubeletReady", "lastHeartbeatTime": _now()}]}})

    def _once(self) -> None:
        pods = {p.metadata.name: p for p in self.core.list_namespaced_pod(self.namespace).items}
        with self._lock:
            for name, running in list(self.running.items()):
                pod = pods.get(name)
                if pod is None or pod.metadata.uid != running.uid:  # force-deleted: the kubelet kills it
                    _kill(running.proc)
                    del self.running[name]
        for pod in pods.values():
            node = pod.spec.node_name
            if node in self.not_ready:
                continue
            if pod.metadata.deletion_timestamp is not None:
                self._terminate(pod)
            elif node is None:
                self._bind(pod)
            elif pod.metadata.name not in self.running and pod.status.phase in (None, "Pending"):
                self._start(pod)
            else:
                self._report_end(pod)

    def _bind(self, pod: Any) -> None:
        ready = [n for n in self.nodes if n not in self.not_ready]
        if not ready:
            return
        node = ready[self._next_node % len(ready)]
        self._next_node += 1
        body = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": pod.metadata.name},
                "target": {"apiVersion": "v1", "kind": "Node", "name": node}}
        try:
            self.core.create_namespaced_pod_binding(pod.metadata.name, self.namespace, body,
                                                    _preload_content=False)
        except kubernetes.client.ApiException as exc:
            if exc.status not in (404, 409):
                raise

    def _start(self, pod: Any) -> None:
        name = pod.metadata.name
        root = self.workdir / "pods" / f"{name}-{pod.metadata.uid[:8]}"
        mounts = self._volumes(pod, root)
        container = pod.spec.containers[0]
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(root), "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
        fields = {"status.podIP": "127.0.0.1", "metadata.name": name, "metadata.namespace": self.namespace,
                  "spec.nodeName": pod.spec.node_name}
        for item in container.env or []:
            if item.value is not None:
                env[item.name] = _mapped(item.value, mounts)
            elif item.value_from is not None and item.value_from.field_ref is not None:  # the downward API
                env[item.name] = fields[item.value_from.field_ref.field_path]
        if TOKEN_PATH in mounts:
            env["KUBECONFIG"] = str(pathlib.Path(mounts[TOKEN_PATH]) / "kubeconfig")
        command = [*(container.command or []), *(container.args or [])]
        if command and command[0] in ("python", "python3"):
            command[0] = sys.executable
        command = [_mapped(part, mounts) for part in command]
        logs = self.workdir / "logs"
        logs.mkdir(exist_ok=True)
        log = logs / f"{name}.log"
        with log.open("ab") as out:
            proc = subprocess.Popen(command, env=env, cwd=root, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        with self._lock:
            self.running[name] = _Running(pod.metadata.uid, pod.spec.node_name, proc, log)
        status = {
            "phase": "Running",
            "hostIP": "127.0.0.1",
            "podIP": "127.0.0.1",
            "startTime": _now(),
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": _now()},
                {"type": "Ready", "status": "True", "lastTransitionTime": _now()},
            ],
            "containerStatuses": [self._container_status(container, {"running": {"startedAt": _now()}}, True)],
        }
        self._patch_status(pod, status)

    def _volumes(self, pod: Any, root: pathlib.Path) -> dict[str, str]:
        """mountPath -> local directory for the first container's mounts."""
        volumes = {v.name: v for v in pod.spec.volumes or []}
        mounts: dict[str, str] = {}
        for mount in pod.spec.containers[0].volume_mounts or []:
            volume = volumes[mount.name]
            local = root / "volumes" / mount.name
            if volume.persistent_volume_claim is not None:
                local = self.checkpoints / (mount.sub_path or "")
            local.mkdir(parents=True, exist_ok=True)
            if volume.secret is not None:
                secret = self.core.read_namespaced_secret(volume.secret.secret_name, self.namespace)
                for key, value in (secret.data or {}).items():
                    (local / key).write_bytes(base64.b64decode(value))
            if volume.config_map is not None:
                config_map = self.core.read_namespaced_config_map(volume.config_map.name, self.namespace)
                for key, text in (config_map.data or {}).items():
                    (local / key).write_text(text)
            if volume.projected is not None and mount.mount_path == TOKEN_PATH:
                self._token_files(pod, local)
            mounts[mount.mount_path] = str(local)
        return mounts

    def _token_files(self, pod: Any, local: pathlib.Path) -> None:
        """What the kubelet projects (a token for the pod's ServiceAccount, bound to the pod; the CA; the
        namespace), plus a kubeconfig that uses them (the process isn't in a cluster network)."""
        request = {"spec": {"expirationSeconds": 3600, "boundObjectRef": {
            "apiVersion": "v1", "kind": "Pod", "name": pod.metadata.name, "uid": pod.metadata.uid}}}
        token = self.core.create_namespaced_service_account_token(
            pod.spec.service_account_name, self.namespace, request).status.token
        (local / "token").write_text(token)
        (local / "ca.crt").write_bytes(self.ca_pem)
        (local / "namespace").write_text(self.namespace)
        (local / "kubeconfig").write_text(yaml.safe_dump(kubeconfig(self.server, self.ca_pem, token)))

    def _report_end(self, pod: Any) -> None:
        with self._lock:
            running = self.running.get(pod.metadata.name)
        if running is None or running.reported_end or running.uid != pod.metadata.uid:
            return
        code = running.proc.poll()
        if code is None:
            return
        exit_code = 128 - code if code < 0 else code  # killed by signal N: the kubelet reports 128+N
        reason = "Completed" if exit_code == 0 else "Error"
        terminated = {"exitCode": exit_code, "reason": reason, "finishedAt": _now(), "startedAt": _now()}
        status = {
            "phase": "Succeeded" if exit_code == 0 else "Failed",
            "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": _now()}],
            "containerStatuses": [
                self._container_status(pod.spec.containers[0], {"terminated": terminated}, False)
            ],
        }
        self._patch_status(pod, status)
        running.reported_end = True

    def _terminate(self, pod: Any) -> None:
        """A deleted pod: SIGTERM, SIGKILL after its grace period, then the kubelet's final delete."""
        with self._lock:
            running = self.running.get(pod.metadata.name)
        if running is not None and running.uid == pod.metadata.uid and running.proc.poll() is None:
            grace = pod.spec.termination_grace_period_seconds
            grace = 30 if grace is None else grace
            if running.stop_sent_at is None:
                running.stop_sent_at = time.monotonic()
                # the whole process group, where a runtime signals PID 1 only: the behaviour its tests were
                # written against. (The resize test's failures under either, the old agent leaving no exit event or
                # ending 0, were the agent's: a SIGTERM landing in a ConfigMap call was swallowed as a store error.)
                _signal(running.proc, signal.SIGTERM)
            if time.monotonic() - running.stop_sent_at < grace:
                return
            _kill(running.proc)
        options = kubernetes.client.V1DeleteOptions(
            grace_period_seconds=0, preconditions=kubernetes.client.V1Preconditions(uid=pod.metadata.uid)
        )
        try:
            self.core.delete_namespaced_pod(pod.metadata.name, self.namespace, body=options)
        except kubernetes.client.ApiException as exc:
            if exc.status not in (404, 409):
                raise
        with self._lock:
            if self.running.get(pod.metadata.name) is running:
                self.running.pop(pod.metadata.name, None)

    def _container_status(self, container: Any, state: dict[str, Any], ready: bool) -> dict[str, Any]:
        return {"name": container.name, "image": container.image, "imageID": "", "ready": ready,
                "restartCount": 0, "state": state}

    def _patch_status(self, pod: Any, status: dict[str, Any]) -> None:
        try:
            self.core.patch_namespaced_pod_status(pod.metadata.name, self.namespace,
                                                  {"metadata": {"uid": pod.metadata.uid}, "status": status})
        except kubernetes.client.ApiException as exc:
            if exc.status not in (404, 409, 422):
                raise


def kubeconfig(server: str, ca_pem: bytes, token: str) -> dict[str, Any]:
    """A kubeconfig that authenticates with a bearer token (a ServiceAccount's)."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": {
            "server": server, "certificate-authority-data": base64.b64encode(ca_pem).decode()}}],
        "users": [{"name": "agent", "user": {"token": token}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "agent"}}],
        "current-context": "test",
    }


def _mapped(value: str, mounts: dict[str, str]) -> str:
    """An environment value or argument with a mount path (or file:// URI of one) pointing at its local dir. A
    path that exists on this machine is left alone: it is the "image's" own file (this interpreter, a test
    script), which may well live under a mount path such as /tmp when the repository is checked out there."""
    if os.path.exists(value):
        return value
    for path, local in sorted(mounts.items(), key=lambda item: -len(item[0])):
        if value == path or value.startswith(path + "/"):
            return local + value[len(path):]
        if value.startswith("file://" + path):
            return "file://" + local + value[len("file://" + path):]
    return value


def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _kill(proc: subprocess.Popen[bytes]) -> None:
    _signal(proc, signal.SIGKILL)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
