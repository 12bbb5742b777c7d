"""A real single-node Kubernetes cluster on this machine, from binaries built by tests/tools/build.sh: the control
plane of k8s_cluster.py (etcd, kube-apiserver, kube-controller-manager with its default controllers) plus
kube-scheduler, and one node: kubelet, kube-proxy, containerd with runc, and a CNI bridge.

The pod network is a bridge this module creates (BRIDGE, POD_SUBNET) in the machine's own network namespace;
each pod gets a namespace of its own with an address on it. Pods have no default route: they reach each other on
the bridge and the API server through the `kubernetes` Service (kube-proxy's rule, SERVICE_RANGE routed via the
bridge), and nothing else; the service range is also a blackhole route on the host, so no packet for it can leave
the machine. The API server, the kubelet and kube-proxy listen on NODE_IP, the bridge's own address.

Images are never pulled: the pause image (a static C program that waits for a signal, built here) and the
project's image (tests/image's buildah build) are imported into containerd, and pods use `imagePullPolicy:
Never`. Settings for a VM without systemd: the cgroupfs driver on cgroup v1 (`failCgroupV1: false`), swap
allowed, and containerd's `restrict_oom_score_adj` (this machine refuses a negative oom_score_adj).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import pathlib
import shutil
import signal
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Iterator

import k8s_cluster
import yaml

NODE_NAME = "sneppx-node"
OPERATOR_NAMESPACE, RELEASE = "sneppx-system", "sneppx"  # where the tier installs the chart
BRIDGE = "sneppx0"
POD_SUBNET = "10.244.0.0/24"
NODE_IP = "10.244.0.1"  # the bridge's address: the node's InternalIP, where the API server listens
SERVICE_RANGE = "10.96.0.0/24"
PAUSE_IMAGE = "registry.k8s.io/pause:3.10.2"  # the sandbox image containerd 2.4 asks for, made here
NODE_TOOLS = ("kube-scheduler", "kubelet", "kube-proxy", "containerd", "containerd-shim-runc-v2", "ctr", "runc")
READY_TIMEOUT_S = 180.0
BIN_DIR = pathlib.Path(os.environ.get("SNEPPX_CACHE", pathlib.Path.home() / ".cache" / "sneppx")) / "bin"
RUN_PREFIX = "sneppx-node-"  # /run/sneppx-node-XXXX: sockets and state, and the PIDs this module started
MACHINE_LOCK = pathlib.Path("/run/sneppx-node.lock")  # held while a node runs (_one_node_per_machine)

PAUSE_C = r"""
#include <signal.h>
#include <unistd.h>
static void done(int sig) { (void)sig; _exit(0); }
int main(void) {
    signal(SIGINT, done);
    signal(SIGTERM, done);
    signal(SIGCHLD, SIG_IGN);  /* the sandbox's init: orphans are reaped */
    for (;;) pause();
}
"""


@dataclasses.dataclass
class Node:
    """The running node and its cluster; `stop()` stops all of it and removes the bridge."""

    cluster: k8s_cluster.Cluster
    workdir: pathlib.Path
    run_dir: pathlib.Path  # short: unix socket paths
    processes: dict[str, subprocess.Popen[bytes]]

    @property
    def containerd_socket(self) -> pathlib.Path:
        return self.run_dir / "containerd.sock"

    def ctr(self, *args: str, timeout: float = 300) -> str:
        result = subprocess.run([self.cluster.tool("ctr"), "--address", str(self.containerd_socket),
                                 "--namespace", "k8s.io", *args],
                                capture_output=True, text=True, timeout=timeout, check=False)
        if result.returncode != 0:
            raise AssertionError(f"ctr {' '.join(args)} failed: {result.stderr[-3000:]}")
        return result.stdout

    def import_image(self, archive: pathlib.Path) -> None:
        """Hand an image (a docker-archive tar, named inside) to containerd, as a registry pull would."""
        self.ctr("images", "import", "--no-unpack=false", str(archive))

    def log(self, component: str) -> str:
        return k8s_cluster._log_tail(self.workdir / f"{component}.log", 6000)

    def stop_kubelet(self) -> None:
        k8s_cluster.stop_process(self.processes.pop("kubelet"))

    def start_kubelet(self) -> None:
        self.processes["kubelet"] = _start(self, "kubelet", _kubelet_args(self))

    def stop(self) -> None:
        for name in ("kubelet", "kube-proxy", "kube-scheduler"):
            if name in self.processes:
                k8s_cluster.stop_process(self.processes.pop(name))
        _remove_pods(self)
        if "containerd" in self.processes:
            k8s_cluster.stop_process(self.processes.pop("containerd"))
        self.cluster.stop()
        _unmount_under(self.workdir)
        _unmount_under(self.run_dir)
        _network_down()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def check_can_run() -> str | None:
    """Why a real node can't run here (not root, no overlay), or None."""
    if os.geteuid() != 0:
        return f"a real node needs root (kubelet, containerd, network namespaces); running as uid {os.geteuid()}"
    if "overlay" not in pathlib.Path("/proc/filesystems").read_text():
        return "no overlay filesystem in this kernel (containerd's snapshotter)"
    return None


@contextlib.contextmanager
def running_node(bin_dir: pathlib.Path, workdir: pathlib.Path) -> Iterator[Node]:
    with _one_node_per_machine():
        node = start_node(bin_dir, workdir)
        try:
            yield node
        finally:
            node.stop()


@contextlib.contextmanager
def _one_node_per_machine() -> Iterator[None]:
    """The bridge, its addresses, kube-proxy's rules and the `kubepods` cgroups are the machine's, not a session's:
    a second test session's node (another checkout's run) waits until the first has stopped. Under the lock, what
    start_node finds of another node is a killed session's, never a live one's."""
    with open(MACHINE_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def start_node(bin_dir: pathlib.Path, workdir: pathlib.Path) -> Node:
    for tool in NODE_TOOLS:
        if not os.access(bin_dir / tool, os.X_OK):
            raise k8s_cluster.ClusterStartError(f"{bin_dir / tool} is not built (tests/tools/build.sh)")
    workdir.mkdir(parents=True, exist_ok=True)
    _stop_what_killed_sessions_left()
    _network_up()
    run_dir = pathlib.Path(tempfile.mkdtemp(prefix=RUN_PREFIX, dir="/run"))
    plane = k8s_cluster.ControlPlane(address=NODE_IP, service_range=SERVICE_RANGE, for_nodes=True,
                                     node_monitor_grace="20s")
    try:
        cluster = k8s_cluster.start_cluster(bin_dir, workdir / "control-plane", plane)
    except BaseException:
        _network_down()
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    node = Node(cluster, workdir, run_dir, {})
    (run_dir / "workdir").write_text(str(workdir))
    _remember(node, *cluster.processes)
    try:
        _start_containerd(node)
        _import_pause_image(node)
        node.processes["kube-scheduler"] = _start(node, "kube-scheduler", [
            f"--kubeconfig={_kubeconfig(node, 'kube-scheduler', 'system:kube-scheduler')}",
            "--leader-elect=false", "--secure-port=0", "--v=1"])
        node.processes["kube-proxy"] = _start(node, "kube-proxy", _kube_proxy_args(node))
        node.start_kubelet()
        _wait_ready(node)
        return node
    except BaseException:
        node.stop()
        raise


# --- network ----------------------------------------------------------------------------------------------


def _ip(*args: str, check: bool = True) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise k8s_cluster.ClusterStartError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def _network_up() -> None:
    _network_down()  # what a killed earlier session left
    prefix = POD_SUBNET.split("/")[1]
    _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("addr", "add", f"{NODE_IP}/{prefix}", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    _ip("route", "add", "blackhole", SERVICE_RANGE)


def _cni_config() -> dict:
    return {
        "cniVersion": "1.0.0",
        "name": "sneppx-pods",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": False,  # the bridge keeps NODE_IP; no default route, no forwarding turned on
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_SUBNET, "rangeStart": "10.244.0.10", "gateway": NODE_IP}]],
                    "routes": [{"dst": SERVICE_RANGE, "gw": NODE_IP}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


# --- containerd ---------------------------------------------------------------------------------------------


def _start_containerd(node: Node) -> None:
    bin_dir = pathlib.Path(node.cluster.bin_dir)
    cni_bin = next(bin_dir.glob("cni-v*"))
    cni_conf = node.workdir / "cni"
    cni_conf.mkdir(exist_ok=True)
    (cni_conf / "10-sneppx.conflist").write_text(json.dumps(_cni_config(), indent=2))
    config = node.workdir / "containerd.toml"
    config.write_text(textwrap.dedent(f"""\
        version = 3
        root = "{node.workdir / 'containerd-root'}"
        state = "{node.run_dir / 'state'}"
        [grpc]
          address = "{node.containerd_socket}"
        [ttrpc]
          address = "{node.run_dir / 'containerd.sock.ttrpc'}"
        [plugins.'io.containerd.cri.v1.runtime']
          restrict_oom_score_adj = true
          [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
            BinaryName = "{bin_dir / 'runc'}"
            SystemdCgroup = false
          [plugins.'io.containerd.cri.v1.runtime'.cni]
            bin_dirs = ["{cni_bin}"]
            conf_dir = "{cni_conf}"
        [plugins.'io.containerd.cri.v1.images'.pinned_images]
          sandbox = "{PAUSE_IMAGE}"
        """))
    node.processes["containerd"] = _start(node, "containerd", [f"--config={config}", "--log-level=info"])
    _wait(node, "containerd", lambda: node.containerd_socket.exists() and _ctr_answers(node))


def _ctr_answers(node: Node) -> bool:
    try:
        node.ctr("version", timeout=10)
        return True
    except AssertionError:
        return False


def _import_pause_image(node: Node) -> None:
    """Build the pause program (static, no libc at run time) and import it as PAUSE_IMAGE, a one-layer image."""
    build = node.workdir / "pause-image"
    layer = build / "rootfs"
    layer.mkdir(parents=True, exist_ok=True)
    (build / "pause.c").write_text(PAUSE_C)
    subprocess.run(["gcc", "-static", "-O2", "-o", str(layer / "pause"), str(build / "pause.c")], check=True,
                   capture_output=True)
    archive = build / "pause.tar"
    _docker_archive(archive, PAUSE_IMAGE, layer, entrypoint=["/pause"])
    node.import_image(archive)


def _docker_archive(archive: pathlib.Path, name: str, rootfs: pathlib.Path, entrypoint: list[str]) -> None:
    """A one-layer image in `docker save` format: manifest.json, the config, and the layer tar."""
    import hashlib
    import tarfile

    work = archive.parent / "archive"
    work.mkdir(exist_ok=True)
    layer_tar = work / "layer.tar"
    with tarfile.open(layer_tar, "w") as tar:
        for path in sorted(rootfs.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(rootfs)), recursive=False)
    diff_id = "sha256:" + hashlib.sha256(layer_tar.read_bytes()).hexdigest()
    config = {"architecture": "amd64", "os": "linux", "config": {"Entrypoint": entrypoint, "User": "65535:65535"},
              "rootfs": {"type": "layers", "diff_ids": [diff_id]}}
    config_bytes = json.dumps(config).encode()
    config_name = hashlib.sha256(config_bytes).hexdigest() + ".json"
    (work / config_name).write_bytes(config_bytes)
    manifest = [{"Config": config_name, "RepoTags": [name], "Layers": ["layer.tar"]}]
    (work / "manifest.json").write_text(json.dumps(manifest))
    with tarfile.open(archive, "w") as tar:
        for entry in ("manifest.json", config_name, "layer.tar"):
            tar.add(work / entry, arcname=entry)


# --- kubelet, kube-proxy --------------------------------------------------------------------------------------


def _kubelet_args(node: Node) -> list[str]:
    config = node.workdir / "kubelet-config.yaml"
    certs = node.cluster.workdir / "certs"
    config.write_text(yaml.safe_dump({
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": NODE_IP,
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                           "x509": {"clientCAFile": str(certs / "ca.crt")}},
        "authorization": {"mode": "AlwaysAllow"},  # only the API server holds a client certificate
        "cgroupDriver": "cgroupfs",
        "failCgroupV1": False,
        "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{node.containerd_socket}",
        "nodeStatusUpdateFrequency": "2s",
        "nodeStatusReportFrequency": "10s",
        "syncFrequency": "10s",
        # what's free on a test machine's disk is no reason to evict a test's pods or delete its images
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "0%", "imagefs.available": "0%",
                         "nodefs.inodesFree": "0%"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
        "tlsCertFile": str(_serving_cert(node)[0]),
        "tlsPrivateKeyFile": str(_serving_cert(node)[1]),
        "resolvConf": "",  # pods get no nameservers: nothing outside the machine to ask
        "shutdownGracePeriod": "0s",
    }))
    kubeconfig = _kubeconfig(node, "kubelet", f"system:node:{NODE_NAME}", ("system:nodes",))
    return [f"--config={config}", f"--kubeconfig={kubeconfig}", f"--hostname-override={NODE_NAME}",
            f"--node-ip={NODE_IP}", f"--root-dir={node.workdir / 'kubelet'}", f"--cert-dir={node.workdir / 'pki'}",
            "--v=1"]


def _serving_cert(node: Node) -> tuple[pathlib.Path, pathlib.Path]:
    crt, key = node.workdir / "kubelet.crt", node.workdir / "kubelet.key"
    if not crt.exists():
        pair = node.cluster.ca.issue(NODE_NAME, server=True, addresses=(NODE_IP,), names=(NODE_NAME,))
        crt.write_bytes(pair.cert_pem)
        key.write_bytes(pair.key_pem)
        key.chmod(0o600)
    return crt, key


def _kube_proxy_args(node: Node) -> list[str]:
    config = node.workdir / "kube-proxy-config.yaml"
    config.write_text(yaml.safe_dump({
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(_kubeconfig(node, "kube-proxy", "system:kube-proxy"))},
        "hostnameOverride": NODE_NAME,
        "mode": "iptables",
        "clusterCIDR": POD_SUBNET,
        "bindAddress": NODE_IP,
        "healthzBindAddress": f"{NODE_IP}:{k8s_cluster.free_port()}",
        "metricsBindAddress": f"{NODE_IP}:{k8s_cluster.free_port()}",
        "nodePortAddresses": [f"{NODE_IP}/32"],  # never localhost: no route_localnet
        "conntrack": {"maxPerCore": 0, "min": 0},  # leave the machine's conntrack table as it is
    }))
    return [f"--config={config}", "--v=1"]


def _kubeconfig(node: Node, component: str, user: str, groups: tuple[str, ...] = ()) -> pathlib.Path:
    return node.cluster.write_kubeconfig(node.workdir / f"{component}.kubeconfig", user, groups)


# --- processes ---------------------------------------------------------------------------------------------


def _start(node: Node, name: str, args: list[str]) -> subprocess.Popen[bytes]:
    bin_dir = pathlib.Path(node.cluster.bin_dir)
    log = node.workdir / f"{name}.log"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}", HOME=str(node.workdir))
    with log.open("ab") as out:
        proc = subprocess.Popen([str(bin_dir / name), *args], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env, cwd=node.workdir)
    _remember(node, proc)
    return proc


def _remember(node: Node, *processes: subprocess.Popen[bytes]) -> None:
    """Note the PIDs in the run directory, for _stop_what_killed_sessions_left."""
    with (node.run_dir / "pids").open("a") as f:
        f.writelines(f"{proc.pid}\n" for proc in processes)


def _stop_what_killed_sessions_left() -> None:
    """A test session killed outright (no cleanup ran) leaves its node running: its daemons, its containers
    (processes in the kubelet's `kubepods` cgroups), their mounts and the bridge. Stop all of that first."""
    for stale in pathlib.Path("/run").glob(f"{RUN_PREFIX}*"):
        pids = {int(p) for p in (stale / "pids").read_text().split()} if (stale / "pids").exists() else set()
        for entry in pathlib.Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                if (str(stale).encode() in (entry / "cmdline").read_bytes()  # its containerd shims
                        or b"/kubepods" in (entry / "cgroup").read_bytes()):  # its containers
                    pids.add(int(entry.name))
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(1)
        if (stale / "workdir").exists():
            _unmount_under(pathlib.Path((stale / "workdir").read_text()))
        _unmount_under(stale)
        shutil.rmtree(stale, ignore_errors=True)
    for netns in pathlib.Path("/var/run/netns").glob("cni-*"):
        subprocess.run(["ip", "netns", "delete", netns.name], capture_output=True, check=False)
    _network_down()


def _network_down() -> None:
    """Remove the bridge, the blackhole route and kube-proxy's rules (`kube-proxy --cleanup`)."""
    _ip("route", "del", "blackhole", SERVICE_RANGE, check=False)
    _ip("link", "del", BRIDGE, check=False)
    kube_proxy = shutil.which("kube-proxy", path=str(BIN_DIR))
    if kube_proxy is not None:
        subprocess.run([kube_proxy, "--cleanup"], capture_output=True, check=False, timeout=60)


def _wait(node: Node, what: str, check, timeout: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, proc in node.processes.items():
            if proc.poll() is not None:
                raise k8s_cluster.ClusterStartError(f"{name} exited with {proc.returncode}:\n{node.log(name)}")
        if check():
            return
        time.sleep(0.5)
    raise k8s_cluster.ClusterStartError(f"{what} not ready after {timeout:.0f}s:\n"
                                        + "\n".join(f"--- {n}\n{node.log(n)}" for n in node.processes))


def _wait_ready(node: Node) -> None:
    def ready() -> bool:
        result = node.cluster.kubectl("get", "node", NODE_NAME, "-o", "json", check=False)
        if result.returncode != 0:
            return False
        conditions = json.loads(result.stdout)["status"].get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    _wait(node, f"node {NODE_NAME} Ready", ready)
    _wait(node, "the default ServiceAccount", lambda: node.cluster.kubectl(
        "get", "serviceaccount", "default", check=False).returncode == 0)


def _remove_pods(node: Node) -> None:
    """Stop and remove every pod sandbox containerd still runs (their network namespaces, their mounts)."""
    if "containerd" not in node.processes or node.processes["containerd"].poll() is not None:
        return
    with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
        for task in node.ctr("tasks", "list", "--quiet", timeout=30).split():
            with contextlib.suppress(AssertionError):
                node.ctr("tasks", "kill", "--signal", "SIGKILL", task, timeout=30)
        time.sleep(1)
        for task in node.ctr("tasks", "list", "--quiet", timeout=30).split():
            with contextlib.suppress(AssertionError):
                node.ctr("tasks", "delete", "--force", task, timeout=30)
        for container in node.ctr("containers", "list", "--quiet", timeout=30).split():
            with contextlib.suppress(AssertionError):
                node.ctr("containers", "delete", container, timeout=30)
    for netns in pathlib.Path("/var/run/netns").glob("cni-*"):
        subprocess.run(["ip", "netns", "delete", netns.name], capture_output=True, check=False)


def _unmount_under(root: pathlib.Path) -> None:
    """Unmount what the kubelet and containerd mounted under `root` (deepest first), so it can be deleted."""
    prefix = str(root.resolve()) + "/"
    mounts = [line.split()[4] for line in pathlib.Path("/proc/self/mountinfo").read_text().splitlines()]
    for point in sorted((m for m in mounts if m.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)
