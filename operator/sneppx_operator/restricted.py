"""The restricted Pod Security profile for rank pods: fill in its defaults, then check the finished pod.

Why a module of its own: every rank pod must pass the restricted profile
(https://kubernetes.io/docs/concepts/security/pod-security-standards/), and a pod the API server refuses
would only be found out after the operator has started creating the job's objects. The CRD's CEL rules
reject most of these settings at `kubectl apply` already, with a message on the field; this check is the
complete one. It runs on the finished pod, so it also holds where the installed CRD is older than the
operator (`helm upgrade` never updates CRDs) or the namespace doesn't enforce the profile.

The operator only *fills in* what the template leaves unset (drop ALL capabilities, no privilege
escalation, non-root, RuntimeDefault seccomp); a value the template sets explicitly is never silently
changed: if the profile forbids it, the job is refused with a message that names it. The one exception is
readOnlyRootFilesystem, the operator's own rule beyond the profile (ranks get a writable /tmp instead).

The rules follow k8s.io/pod-security-admission's policy checks for the restricted level at "latest".
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

from sneppx_operator.errors import JobSpecError

SECCOMP_RUNTIME_DEFAULT = {"type": "RuntimeDefault"}
ALLOWED_SECCOMP_TYPES = frozenset({"RuntimeDefault", "Localhost"})
ALLOWED_APPARMOR_TYPES = frozenset({"RuntimeDefault", "Localhost"})
ALLOWED_SELINUX_TYPES = frozenset(
    {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
)
ALLOWED_CAPABILITY_ADDS = frozenset({"NET_BIND_SERVICE"})
ALLOWED_VOLUME_TYPES = (
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "image",
    "persistentVolumeClaim",
    "projected",
    "secret",
)
# The baseline profile's "safe" sysctls (namespaced, can't affect other pods on the node).
SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
        "net.ipv4.tcp_rmem",
        "net.ipv4.tcp_wmem",
    }
)
APPARMOR_ANNOTATION_PREFIX = "container.apparmor.security.beta.kubernetes.io/"
HOST_NAMESPACES = ("hostNetwork", "hostPID", "hostIPC")
PROBES = ("livenessProbe", "readinessProbe", "startupProbe")
LIFECYCLE_HOOKS = ("postStart", "preStop")


def with_pod_defaults(pod_security: Mapping[str, Any] | None) -> dict[str, Any]:
    """The pod-level securityContext with the profile's defaults where the template is silent."""
    security = copy.deepcopy(dict(pod_security or {}))
    security.setdefault("runAsNonRoot", True)
    security.setdefault("seccompProfile", dict(SECCOMP_RUNTIME_DEFAULT))
    return security


def with_container_defaults(container: Mapping[str, Any]) -> dict[str, Any]:
    """The container with the profile's defaults where the template is silent (and a read-only root)."""
    built = copy.deepcopy(dict(container))
    security = dict(built.get("securityContext") or {})
    security.setdefault("allowPrivilegeEscalation", False)
    security.setdefault("privileged", False)
    security.setdefault("runAsNonRoot", True)
    capabilities = dict(security.get("capabilities") or {})
    drop = list(capabilities.get("drop") or [])
    capabilities["drop"] = drop if "ALL" in drop else ["ALL", *drop]  # dropping more is always allowed
    security["capabilities"] = capabilities
    security["readOnlyRootFilesystem"] = True
    built["securityContext"] = security
    return built


def check(pod_spec: Mapping[str, Any], annotations: Mapping[str, str] | None = None) -> None:
    """Raise JobSpecError naming every setting of the finished pod that the restricted profile forbids."""
    found = violations(pod_spec, annotations)
    if found:
        raise JobSpecError(
            "the pod template breaks the restricted Pod Security profile that ranks run under: "
            + "; ".join(found)
        )


def violations(pod_spec: Mapping[str, Any], annotations: Mapping[str, str] | None = None) -> list[str]:
    """Every way the pod (spec and annotations) breaks the restricted profile, as messages a person can act
    on; empty when it complies. Paths are spelled as in the job's spec.template."""
    found: list[str] = []
    where = "spec.template.spec"
    for field in HOST_NAMESPACES:
        if pod_spec.get(field):
            found.append(f"{where}.{field} is not allowed")
    if pod_spec.get("automountServiceAccountToken") is True:
        found.append(
            f"{where}.automountServiceAccountToken: true is not allowed (ranks don't get the API credentials "
            "of the namespace's ServiceAccount)"
        )
    pod_security = pod_spec.get("securityContext") or {}
    found += _security_context_violations(f"{where}.securityContext", pod_security)
    for sysctl in pod_security.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            found.append(
                f"{where}.securityContext.sysctls sets {sysctl.get('name')!r}, not one of the safe sysctls"
            )
    for volume in pod_spec.get("volumes") or []:
        for kind in sorted(set(volume) - {"name", *ALLOWED_VOLUME_TYPES}):
            found.append(
                f"volume {volume.get('name')!r} is a {kind} volume (allowed: {', '.join(ALLOWED_VOLUME_TYPES)})"
            )
    for container in [*(pod_spec.get("initContainers") or []), *(pod_spec.get("containers") or [])]:
        found += _container_violations(container)
    for key, value in (annotations or {}).items():
        if key.startswith(APPARMOR_ANNOTATION_PREFIX) and not (
            value == "runtime/default" or value.startswith("localhost/")
        ):
            found.append(
                f"spec.template.metadata.annotations[{key!r}] is {value!r} "
                "(allowed: runtime/default, localhost/<profile>)"
            )
    return found


def _container_violations(container: Mapping[str, Any]) -> list[str]:
    where = f"container {container.get('name')!r}"
    security = container.get("securityContext") or {}
    found = _security_context_violations(where, security)
    if security.get("privileged"):
        found.append(f"{where} sets securityContext.privileged: true")
    if security.get("allowPrivilegeEscalation") is not False:
        found.append(f"{where} sets securityContext.allowPrivilegeEscalation: true")
    capabilities = security.get("capabilities") or {}
    added = [c for c in capabilities.get("add") or [] if c not in ALLOWED_CAPABILITY_ADDS]
    if added:
        found.append(f"{where} adds capabilities {added} (only NET_BIND_SERVICE may be added)")
    if "ALL" not in (capabilities.get("drop") or []):
        found.append(f"{where} does not drop ALL capabilities")
    if security.get("procMount", "Default") != "Default":
        found.append(f"{where} sets securityContext.procMount: {security['procMount']!r} (allowed: Default)")
    for port in container.get("ports") or []:
        if port.get("hostPort"):
            found.append(f"{where} sets hostPort: {port['hostPort']}")
    for handler_name, handler in _handlers(container):
        for action in ("httpGet", "tcpSocket"):
            if (handler.get(action) or {}).get("host"):
                found.append(
                    f"{where} sets {handler_name}.{action}.host (probes and hooks can't name a host)"
                )
    return found


def _security_context_violations(where: str, security: Mapping[str, Any]) -> list[str]:
    """The rules pod and container securityContexts share."""
    found: list[str] = []
    if security.get("runAsNonRoot") is False:
        found.append(f"{where} sets runAsNonRoot: false (ranks run as a non-root user)")
    if security.get("runAsUser") == 0:
        found.append(f"{where} sets runAsUser: 0 (ranks run as a non-root user)")
    for field, allowed in (
        ("seccompProfile", ALLOWED_SECCOMP_TYPES),
        ("appArmorProfile", ALLOWED_APPARMOR_TYPES),
    ):
        kind = (security.get(field) or {}).get("type")
        if kind is not None and kind not in allowed:
            found.append(f"{where} sets {field}.type: {kind!r} (allowed: {', '.join(sorted(allowed))})")
    selinux = security.get("seLinuxOptions") or {}
    if selinux.get("type", "") not in ALLOWED_SELINUX_TYPES:
        allowed_types = ", ".join(sorted(t for t in ALLOWED_SELINUX_TYPES if t))
        found.append(f"{where} sets seLinuxOptions.type: {selinux['type']!r} (allowed: {allowed_types})")
    for field in ("user", "role"):
        if selinux.get(field):
            found.append(
                f"{where} sets seLinuxOptions.{field} (custom SELinux users and roles are not allowed)"
            )
    if (security.get("windowsOptions") or {}).get("hostProcess"):
        found.append(f"{where} sets windowsOptions.hostProcess: true")
    return found


def _handlers(container: Mapping[str, Any]) -> Iterable[tuple[str, Mapping[str, Any]]]:
    for probe in PROBES:
        if container.get(probe):
            yield probe, container[probe]
    lifecycle = container.get("lifecycle") or {}
    for hook in LIFECYCLE_HOOKS:
        if lifecycle.get(hook):
            yield f"lifecycle.{hook}", lifecycle[hook]
