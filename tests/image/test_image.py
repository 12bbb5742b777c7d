"""The image a user deploys, built from the Dockerfile as it is and run as a pod runs it (container_image.py):
its user, its read-only root, the CLI, the demo, and the operator started from it with the chart's own
pod spec against the real kube-apiserver.
"""

from __future__ import annotations

import json
import os
import pathlib
import secrets
import signal
import subprocess
import urllib.parse
import urllib.request

import image_fixtures
import k8s_cluster
import k8s_helpers
import kubernetes
import pytest
from container_image import REPO, Image, command_pid

pytestmark = [pytest.mark.image, image_fixtures.BUILD_TIMEOUT]

CHART = REPO / "charts" / "sneppx-operator"
# Where a pod's /var/run/secrets/kubernetes.io/serviceaccount leads in this image (/var/run -> /run). The
# resolved path, because buildah 1.28 follows an absolute link on the host when it makes a mount point.
SERVICE_ACCOUNT_DIR = "/run/secrets/kubernetes.io/serviceaccount"

# Reports what one process sees, as JSON: who it is, where it is, and which paths it may write.
_PROBE = """
import errno, json, os, sys
def write(path):
    try:
        with open(os.path.join(path, ".probe"), "w"):
            pass
        return "ok"
    except OSError as exc:
        return errno.errorcode[exc.errno]
root = next(line.split() for line in open("/proc/self/mountinfo") if line.split()[4] == "/")
print(json.dumps({"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(), "cwd": os.getcwd(),
                  "home": os.environ["HOME"], "root_options": root[5].split(","),
                  "writes": {path: write(path) for path in sys.argv[1:]}}))
"""


def _probe(image: Image, *paths: str, **options) -> dict:
    result = image.run(["python", "-c", _PROBE, *paths], **options)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout)


def test_runs_as_a_numeric_non_root_user(image: Image) -> None:
    uid, _, gid = image.user.partition(":")
    assert uid.isdigit() and gid.isdigit() and int(uid) != 0 and int(gid) != 0, (
        f"USER {image.user!r}: the kubelet can check runAsNonRoot only for a numeric, non-zero user"
    )
    # Plainly, with nothing of ours in between: the image's own USER and WORKDIR.
    plain = image.buildah("run", image.container, "--", "sh", "-c", "id -u; id -g; pwd").stdout.split()
    assert plain == [uid, gid, "/workspace"]
    seen = _probe(image)
    assert (seen["uid"], seen["gid"], seen["groups"]) == (int(uid), int(gid), [int(gid)])


def test_only_tmp_and_workspace_are_writable_on_a_read_only_root(image: Image) -> None:
    seen = _probe(image, "/", "/etc", "/usr/local/lib", "/workspace", "/tmp")
    assert "ro" in seen["root_options"]
    # EROFS, not EACCES: the root is read-only, not merely owned by someone else.
    assert seen["writes"] == {
        "/": "EROFS", "/etc": "EROFS", "/usr/local/lib": "EROFS", "/workspace": "ok", "/tmp": "ok",
    }
    assert (seen["cwd"], seen["home"]) == ("/workspace", "/tmp"), "cwd and HOME must be writable"


def test_sneppx_help(image: Image) -> None:
    result = image.run(["sneppx", "--help"])
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.startswith("usage: sneppx"), result.stdout[:2000]


def demo_command() -> list[str]:
    """What `make demo` runs, with the image's python: the Makefile stays the one place that says it."""
    dry_run = subprocess.run(
        ["make", "-s", "-n", "-o", ".venv/.installed", "demo", "PY=python"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )
    (command,) = dry_run.stdout.splitlines()
    return command.split()


def test_the_demo_trains_crashes_resumes_and_validates(image: Image) -> None:
    command = demo_command()
    assert command[:2] == ["python", "-m"], command
    result = image.run(command)
    output = f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    assert result.returncode == 0 and "FAILED" not in result.stdout, output


_SHIPPED = """
import json, os, shutil, sysconfig
site = sysconfig.get_path("purelib")
print(json.dumps({
    "compilers": [tool for tool in ("gcc", "cc", "c++", "ld") if shutil.which(tool)],
    "test_dirs": [root for root, dirs, _ in os.walk(site) if "tests" in dirs],
    "kubernetes_aio": os.path.exists(os.path.join(site, "kubernetes", "aio")),
    "build_leftovers": [p for p in ("/wheels", "/src", "/root/.cache") if os.path.exists(p)],
    "tmp": os.listdir("/tmp"),  # HOME is /tmp while pip installs: a pip cache would land here
    "pip": bool(shutil.which("pip")),
}))
"""


def test_ships_only_what_runs(image: Image, record_property: pytest.RecordProperty) -> None:
    result = image.run(["python", "-c", _SHIPPED], writable=["/workspace"])  # the image's own /tmp
    assert result.returncode == 0, result.stderr[-4000:]
    shipped = json.loads(result.stdout)
    assert shipped == {
        "compilers": [], "test_dirs": [], "kubernetes_aio": False, "build_leftovers": [], "tmp": [],
        "pip": True,  # kept on purpose: users extend the image with `FROM sneppx` + `pip install`
    }
    *base, runtime = image.layer_bytes
    sizes = (
        f"image {sum(image.layer_bytes) / 1e6:.0f} MB: "
        f"base {sum(base) / 1e6:.0f} MB + runtime layer {runtime / 1e6:.0f} MB"
    )
    record_property("image_size", sizes)
    print(sizes)


@pytest.mark.k8s
def test_the_operator_from_the_image_runs_a_job_with_the_charts_pod_spec(
    image: Image,
    cluster: k8s_cluster.Cluster,
    api: kubernetes.client.ApiClient,
    namespace: str,
    tmp_path: pathlib.Path,
) -> None:
    """Start the operator container exactly as the chart's Deployment describes it (command, args, env,
    user, read-only root, its one emptyDir), with the credentials a pod of its ServiceAccount gets."""
    release = f"sx{secrets.token_hex(3)}"
    liveness_port = k8s_cluster.free_port()
    cluster.helm(
        "install", release, str(CHART), "--namespace", namespace,
        "--set", f"watchNamespaces={{{namespace}}}", "--set", f"operator.livenessPort={liveness_port}",
    )
    name = f"{release}-sneppx-operator"
    deployment = json.loads(cluster.kubectl("get", "deployment", name, "-n", namespace, "-o", "json").stdout)
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # The probe listens on every interface in a pod; here the network is the host's, so loopback only.
    argv = [arg.replace("//0.0.0.0:", "//127.0.0.1:") for arg in container["command"] + container["args"]]
    assert f"--namespace={namespace}" in argv
    emptydirs = {volume["name"] for volume in pod["volumes"] if "emptyDir" in volume}
    writable = [mount["mountPath"] for mount in container["volumeMounts"] if mount["name"] in emptydirs]
    user = f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}"

    # What the kubelet mounts for the pod's ServiceAccount, and the Service environment it sets.
    account = tmp_path / "serviceaccount"
    account.mkdir()
    token = cluster.kubectl("create", "token", pod["serviceAccountName"], "-n", namespace).stdout.strip()
    (account / "token").write_text(token)
    (account / "ca.crt").write_bytes(cluster.ca.cert_pem)
    (account / "namespace").write_text(namespace)
    server = urllib.parse.urlsplit(cluster.server)
    downward = {"metadata.name": f"{name}-0", "metadata.namespace": namespace}  # what the kubelet fills in
    env = {item["name"]: item["value"] if "value" in item else downward[item["valueFrom"]["fieldRef"]["fieldPath"]]
           for item in container.get("env", [])}
    env |= {"KUBERNETES_SERVICE_HOST": str(server.hostname), "KUBERNETES_SERVICE_PORT": str(server.port)}

    log = tmp_path / "operator.log"
    launcher = image.start(
        argv, log, env=env, user=user, writable=writable, read_only={SERVICE_ACCOUNT_DIR: account}
    )
    try:
        k8s_helpers.wait_for(
            lambda: _answers(f"http://127.0.0.1:{liveness_port}/healthz") or launcher.poll() is not None,
            "the liveness endpoint",
            timeout=180,
        )
        assert launcher.poll() is None, log.read_text()[-4000:]
        custom = kubernetes.client.CustomObjectsApi(api)
        core = kubernetes.client.CoreV1Api(api)
        custom.create_namespaced_custom_object(
            k8s_helpers.GROUP, k8s_helpers.VERSION, namespace, k8s_helpers.PLURAL,
            k8s_helpers.valid_job("img", max_nodes=2),
        )
        k8s_helpers.wait_for(
            lambda: len(core.list_namespaced_pod(namespace, label_selector="sneppx.io/job=img").items) == 2,
            "the job's pods, created by the operator in the image (and admitted as restricted)",
            timeout=120,
        )
        k8s_helpers.wait_for(
            lambda: (
                custom.get_namespaced_custom_object(
                    k8s_helpers.GROUP, k8s_helpers.VERSION, namespace, k8s_helpers.PLURAL, "img"
                ).get("status")
                or {}
            ).get("phase"),
            "the job's status, written by the operator in the image",
            timeout=120,
        )
        os.kill(command_pid(launcher), signal.SIGTERM)  # as the kubelet stops a container
        assert launcher.wait(timeout=120) == 0, log.read_text()[-4000:]
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGKILL)
            launcher.wait()
    output = log.read_text()
    assert "Traceback" not in output and "orbidden" not in output, output[-4000:]
    lease = kubernetes.client.CoordinationV1Api(api).read_namespaced_lease(name, namespace)
    assert lease.spec.holder_identity == "", "it led through the chart's Lease and handed it over on SIGTERM"


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False
