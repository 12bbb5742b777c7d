"""A real Kubernetes API for tests: etcd + kube-apiserver as local processes, the way envtest does it, plus
the garbage collector and namespace controller of a real kube-controller-manager.

Why: schema and CEL validation, the status subresource, RBAC, Pod Security admission and server-side
apply only behave for real on a real API server, and there is no Docker here for kind. The binaries are
built from pinned Go modules by tests/tools/build.sh and cached by version; this module makes the
certificates, starts etcd and kube-apiserver on free loopback ports, waits for /readyz, writes kubeconfigs
and installs the CRDs, then starts kube-controller-manager (same Kubernetes version) with only two
controllers: the garbage collector (an object whose owner is deleted is deleted too, which the operator relies
on to remove a job's pods, Service, Secret, ...) and the namespace controller (a deleted namespace is emptied
and goes away, about 5 s after the deletion: the controller waits that long before it starts). Before
returning it checks the garbage collector works: a probe ConfigMap's dependent is collected.

No other controller runs, and there is no scheduler or kubelet: pods stay Pending unless a test writes their
status (or tests/k8s/pod_runner.py plays kubelet), Nodes are never tainted or their pods evicted, no
ServiceAccount or quota status is made for anyone.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import ipaddress
import json
import os
import pathlib
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

REPO = pathlib.Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "tests" / "tools" / "build.sh"
CRD_DIR = REPO / "crds"

# Loopback only: the apiserver allocates ClusterIPs from this range (no traffic is ever sent to them),
# and the project never writes private-range addresses.
SERVICE_CLUSTER_IP_RANGE = "127.200.0.0/24"
STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 15.0
TOOLS = ("etcd", "kube-apiserver", "kube-controller-manager", "kubectl", "helm")

# The controllers kube-controller-manager runs (1.36 names; `kube-controller-manager --help` lists them all).
CONTROLLERS = ("garbage-collector-controller", "namespace-controller")
# The user it authenticates as (a client certificate), and the bootstrap ClusterRoles that user is bound to:
# its own (informers, events), plus the roles the two controllers have in a real cluster, where each runs as
# its own ServiceAccount (--use-service-account-credentials). Bound to the one user here instead.
CONTROLLER_MANAGER_USER = "system:kube-controller-manager"
CONTROLLER_ROLES = ("system:controller:generic-garbage-collector", "system:controller:namespace-controller")


@dataclasses.dataclass(frozen=True)
class ControlPlane:
    """How start_cluster runs the control plane. The default serves the API on loopback to tests alone: no
    node, pods never run (or run under pod_runner). `for_nodes` makes it a cluster a real kubelet joins
    (tests/node): the API on the node's address (pods reach it through the `kubernetes` Service), Node
    authorization and NodeRestriction for the kubelet, ServiceAccount admission (pods get API tokens), and
    kube-controller-manager's default controllers (Deployments, node lifecycle, evictions, service accounts),
    each under its own ServiceAccount as in a real cluster."""

    address: str = "127.0.0.1"
    service_range: str = SERVICE_CLUSTER_IP_RANGE
    for_nodes: bool = False
    node_monitor_grace: str = "40s"  # for_nodes: a node silent this long is NotReady (Kubernetes' default)

    @property
    def service_ip(self) -> str:
        """The `kubernetes` Service's ClusterIP: the range's first address."""
        return str(next(ipaddress.ip_network(self.service_range).hosts()))


class ClusterStartError(RuntimeError):
    """etcd or kube-apiserver did not come up; the message carries the tail of its log."""


class ControllerManagerError(RuntimeError):
    """kube-controller-manager did not come up or its garbage collector did nothing; the message carries the
    tail of its log. Not a ClusterStartError, which the fixtures retry (a free port taken in between): it binds
    no port, so starting again would only fail the same way."""


def build_tools() -> pathlib.Path:
    """Build (or reuse) the pinned binaries and return their directory. Never skips: a failure raises."""
    result = subprocess.run(["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ClusterStartError(
            f"tests/tools/build.sh failed ({result.returncode}):\n{result.stderr[-4000:]}"
        )
    bin_dir = pathlib.Path(result.stdout.strip().splitlines()[-1])
    for tool in TOOLS:
        if not os.access(bin_dir / tool, os.X_OK):
            raise ClusterStartError(f"build.sh finished but {bin_dir / tool} is not executable")
    return bin_dir


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- certificates -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KeyPair:
    cert_pem: bytes
    key_pem: bytes


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _validity(builder: x509.CertificateBuilder) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return builder.not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(
        now + datetime.timedelta(days=2)
    )


class CertificateAuthority:
    """A throwaway CA for one test session: it signs the serving cert and every client cert."""

    def __init__(self) -> None:
        self._key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sneppx-test-ca")])
        builder = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False)
        )
        self._cert = _validity(builder).sign(self._key, hashes.SHA256())
        self.cert_pem = self._cert.public_bytes(serialization.Encoding.PEM)

    def issue(
        self,
        common_name: str,
        *,
        organizations: tuple[str, ...] = (),
        server: bool = False,
        addresses: tuple[str, ...] = ("127.0.0.1",),
        names: tuple[str, ...] = ("localhost",),
    ) -> KeyPair:
        key = ec.generate_private_key(ec.SECP256R1())
        attributes = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
        attributes.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attributes))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False
            )
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address(address)) for address in addresses]
                    + [x509.DNSName(name) for name in names]
                ),
                critical=False,
            )
        cert = _validity(builder).sign(self._key, hashes.SHA256())
        return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def service_account_keys() -> KeyPair:
    """The key pair the apiserver signs and verifies service-account tokens with (public key as 'cert')."""
    key = ec.generate_private_key(ec.SECP256R1())
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return KeyPair(public, _key_pem(key))


# --- processes ----------------------------------------------------------------------------------------


def _log_tail(path: pathlib.Path, limit: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError as exc:
        return f"(no log: {exc})"


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if it doesn't exit in time."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=STOP_TIMEOUT_S)


def _wait_until(check, proc: subprocess.Popen[bytes], what: str, log: pathlib.Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    last_error = "never answered"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ClusterStartError(f"{what} exited with {proc.returncode}:\n{_log_tail(log)}")
        try:
            if check():
                return
            last_error = "answered, not ready"
        except (OSError, urllib.error.URLError) as exc:
            last_error = repr(exc)
        time.sleep(0.25)
    raise ClusterStartError(f"{what} not ready after {STARTUP_TIMEOUT_S}s ({last_error}):\n{_log_tail(log)}")


@dataclasses.dataclass
class Cluster:
    """A running etcd + kube-apiserver pair and what a test needs to talk to it."""

    bin_dir: pathlib.Path
    workdir: pathlib.Path
    server: str
    kubeconfig: pathlib.Path
    ca: CertificateAuthority
    processes: list[subprocess.Popen[bytes]]

    def tool(self, name: str) -> str:
        return str(self.bin_dir / name)

    def run(
        self,
        tool: str,
        *args: str,
        check: bool = True,
        input_text: str | None = None,
        kubeconfig: pathlib.Path | None = None,
        timeout: float = 120.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl or helm against this cluster; a failure raises with both output streams."""
        env = dict(os.environ, KUBECONFIG=str(kubeconfig or self.kubeconfig), HOME=str(self.workdir))
        env.setdefault("HELM_CACHE_HOME", str(self.workdir / "helm-cache"))
        env.setdefault("HELM_CONFIG_HOME", str(self.workdir / "helm-config"))
        env.setdefault("HELM_DATA_HOME", str(self.workdir / "helm-data"))
        result = subprocess.run(
            [self.tool(tool), *args],
            capture_output=True,
            text=True,
            input=input_text,
            env=env,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"{tool} {' '.join(args)} failed ({result.returncode}):\n"
                f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"
            )
        return result

    def kubectl(self, *args: str, **kwargs) -> subprocess.CompletedProcess[str]:
        return self.run("kubectl", *args, **kwargs)

    def helm(self, *args: str, **kwargs) -> subprocess.CompletedProcess[str]:
        return self.run("helm", *args, **kwargs)

    def write_kubeconfig(self, path: pathlib.Path, user: str, groups: tuple[str, ...] = ()) -> pathlib.Path:
        """A kubeconfig that authenticates as `user` in `groups` with a client cert from the session CA.

        Client-certificate users are real identities to RBAC: CN is the user name and O the groups, so
        CN=system:serviceaccount:NS:NAME is held to exactly the RBAC a ServiceAccount gets.
        """
        pair = self.ca.issue(user, organizations=groups)
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "sneppx-test",
                    "cluster": {
                        "server": self.server,
                        "certificate-authority-data": base64.b64encode(self.ca.cert_pem).decode(),
                    },
                }
            ],
            "users": [
                {
                    "name": user,
                    "user": {
                        "client-certificate-data": base64.b64encode(pair.cert_pem).decode(),
                        "client-key-data": base64.b64encode(pair.key_pem).decode(),
                    },
                }
            ],
            "contexts": [{"name": "sneppx-test", "context": {"cluster": "sneppx-test", "user": user}}],
            "current-context": "sneppx-test",
        }
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path

    def stop(self) -> None:
        # In reverse start order: kube-controller-manager, then the apiserver (so it doesn't spend its
        # shutdown retrying a vanished etcd), then etcd.
        for proc in reversed(self.processes):
            stop_process(proc)


def start_cluster(
    bin_dir: pathlib.Path, workdir: pathlib.Path, plane: ControlPlane = ControlPlane()
) -> Cluster:
    """Start etcd and kube-apiserver with envtest's flags, wait for /readyz, install the CRDs, then start
    kube-controller-manager and wait until its garbage collector works."""
    workdir.mkdir(parents=True, exist_ok=True)
    certs = workdir / "certs"
    certs.mkdir(exist_ok=True)
    ca = CertificateAuthority()
    service_names = ("kubernetes", "kubernetes.default", "kubernetes.default.svc",
                     "kubernetes.default.svc.cluster.local")
    serving = ca.issue("kube-apiserver", server=True, addresses=tuple(dict.fromkeys(
        ("127.0.0.1", plane.address, plane.service_ip))), names=("localhost", *service_names))
    admin = ca.issue("sneppx-test-admin", organizations=("system:masters",))
    kubelet_client = ca.issue("kube-apiserver-kubelet-client", organizations=("system:masters",))
    sa = service_account_keys()
    files = {
        "ca.crt": ca.cert_pem,
        "apiserver.crt": serving.cert_pem,
        "apiserver.key": serving.key_pem,
        "admin.crt": admin.cert_pem,
        "admin.key": admin.key_pem,
        "kubelet-client.crt": kubelet_client.cert_pem,
        "kubelet-client.key": kubelet_client.key_pem,
        "sa.pub": sa.cert_pem,
        "sa.key": sa.key_pem,
    }
    for name, data in files.items():
        (certs / name).write_bytes(data)
        (certs / name).chmod(0o600)

    processes: list[subprocess.Popen[bytes]] = []
    try:
        etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        etcd_log = workdir / "etcd.log"
        etcd = subprocess.Popen(
            [
                str(bin_dir / "etcd"),
                "--name=sneppx-test",
                f"--data-dir={workdir / 'etcd-data'}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-cluster=sneppx-test=http://127.0.0.1:{peer_port}",
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
            stdout=etcd_log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        processes.append(etcd)
        _wait_until(
            lambda: b'"health":"true"' in urllib.request.urlopen(f"{etcd_url}/health", timeout=2).read(),
            etcd,
            "etcd",
            etcd_log,
        )

        server = f"https://{plane.address}:{api_port}"
        api_log = workdir / "kube-apiserver.log"
        if plane.for_nodes:
            access = [
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                f"--kubelet-client-certificate={certs / 'kubelet-client.crt'}",
                f"--kubelet-client-key={certs / 'kubelet-client.key'}",
                "--kubelet-preferred-address-types=InternalIP",  # never a DNS lookup of the node's name
            ]
        else:
            access = ["--authorization-mode=RBAC", "--disable-admission-plugins=ServiceAccount"]
        apiserver = subprocess.Popen(
            [
                str(bin_dir / "kube-apiserver"),
                f"--etcd-servers={etcd_url}",
                f"--bind-address={plane.address}",
                f"--advertise-address={plane.address}",
                f"--secure-port={api_port}",
                f"--cert-dir={certs}",
                f"--tls-cert-file={certs / 'apiserver.crt'}",
                f"--tls-private-key-file={certs / 'apiserver.key'}",
                f"--client-ca-file={certs / 'ca.crt'}",
                "--allow-privileged=true",
                f"--service-cluster-ip-range={plane.service_range}",
                *access,
                f"--service-account-issuer={server}/",
                f"--service-account-key-file={certs / 'sa.pub'}",
                f"--service-account-signing-key-file={certs / 'sa.key'}",
                "--v=1",
            ],
            stdout=api_log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        processes.append(apiserver)
        tls = ssl.create_default_context(cafile=str(certs / "ca.crt"))
        tls.load_cert_chain(str(certs / "admin.crt"), str(certs / "admin.key"))

        def readyz() -> bool:
            with urllib.request.urlopen(f"{server}/readyz", context=tls, timeout=5) as response:
                return response.status == 200 and response.read().strip() == b"ok"

        _wait_until(readyz, apiserver, "kube-apiserver", api_log)
        cluster = Cluster(bin_dir, workdir, server, workdir / "kubeconfig", ca, processes)
        cluster.write_kubeconfig(cluster.kubeconfig, "sneppx-test-admin", ("system:masters",))
        # Before the controller-manager, so the garbage collector's first discovery already sees the CRDs'
        # resources (it rediscovers only every 30 s).
        install_crds(cluster)
        start_controller_manager(cluster, tls, plane)
        return cluster
    except BaseException:
        for proc in reversed(processes):
            stop_process(proc)
        raise


def start_controller_manager(
    cluster: Cluster, tls: ssl.SSLContext, plane: ControlPlane = ControlPlane()
) -> subprocess.Popen[bytes]:
    """Start kube-controller-manager with the garbage collector and namespace controller only (appended to
    cluster.processes, so Cluster.stop() stops it first) and wait until the garbage collector visibly works.

    Flags: only CONTROLLERS (no node lifecycle or taint eviction, so pod_runner's fake Nodes are never tainted
    and their pods never evicted; nothing that needs a cloud, a kubelet or a signing key); one instance, so no
    leader election (no Lease to wait for); every controller under the kubeconfig's own identity
    (CONTROLLER_MANAGER_USER, with CONTROLLER_ROLES bound to it), not per-controller ServiceAccount tokens; no
    HTTPS serving (--secure-port=0: no port to pick, no self-signed certificate written anywhere; readiness is
    the probe below). It writes nothing but its log; HOME and the working directory are the workdir anyway.

    With `plane.for_nodes`: the default controllers, each under its own ServiceAccount, as in a real cluster."""
    rbac = [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": f"sneppx-test:{role.removeprefix('system:controller:')}"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [
                {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": CONTROLLER_MANAGER_USER}
            ],
        }
        for role in CONTROLLER_ROLES
    ]
    cluster.kubectl("apply", "--server-side", "-f", "-", input_text=yaml.safe_dump_all(rbac))
    kubeconfig = cluster.write_kubeconfig(
        cluster.workdir / "kube-controller-manager.kubeconfig", CONTROLLER_MANAGER_USER
    )
    log = cluster.workdir / "kube-controller-manager.log"
    api = _Api(cluster.server, tls)
    owner, dependent = _garbage_collector_probe(api)
    proc = subprocess.Popen(
        [
            cluster.tool("kube-controller-manager"),
            f"--kubeconfig={kubeconfig}",
            *(
                [
                    "--controllers=*",
                    "--use-service-account-credentials=true",
                    f"--service-account-private-key-file={cluster.workdir / 'certs' / 'sa.key'}",
                    f"--root-ca-file={cluster.workdir / 'certs' / 'ca.crt'}",
                    f"--node-monitor-grace-period={plane.node_monitor_grace}",
                ]
                if plane.for_nodes
                else [f"--controllers={','.join(CONTROLLERS)}", "--use-service-account-credentials=false"]
            ),
            "--leader-elect=false",
            "--secure-port=0",
            "--v=2",  # the garbage collector's "Deleting item" lines, and what it could not do
        ],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=cluster.workdir,
        env=dict(os.environ, HOME=str(cluster.workdir)),
    )
    cluster.processes.append(proc)
    try:
        _wait_until(
            lambda: api("GET", owner)[0] == 404 and api("GET", dependent)[0] == 404,
            proc,
            "kube-controller-manager's garbage collector (the probe ConfigMap and its dependent deleted)",
            log,
        )
    except ClusterStartError as exc:
        raise ControllerManagerError(str(exc)) from None
    return proc


class _Api:
    """Just enough of a JSON client (admin certificate) for the start-up probe; 404 answers, not raises."""

    def __init__(self, server: str, tls: ssl.SSLContext) -> None:
        self.server, self.tls = server, tls

    def __call__(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        request = urllib.request.Request(
            self.server + path,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Accept": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, context=self.tls, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return exc.code, {}
            raise ClusterStartError(f"{method} {path}: {exc.code} {exc.read()[-2000:]!r}") from exc


def _garbage_collector_probe(api: _Api) -> tuple[str, str]:
    """A ConfigMap owned (controller, blockOwnerDeletion) by a ConfigMap that is deleted in the foreground:
    only the garbage collector finishes that (it deletes the dependent, then the owner's foregroundDeletion
    finalizer). Made before the controller-manager starts; returns the two paths that must answer 404."""
    configmaps = "/api/v1/namespaces/default/configmaps"
    owner = api("POST", configmaps, {"metadata": {"name": "sneppx-gc-probe-owner"}})[1]["metadata"]
    reference = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": owner["name"],
        "uid": owner["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
    body = {"metadata": {"name": "sneppx-gc-probe-dependent", "ownerReferences": [reference]}}
    dependent = api("POST", configmaps, body)[1]["metadata"]
    api("DELETE", f"{configmaps}/{owner['name']}", {"propagationPolicy": "Foreground"})
    return f"{configmaps}/{owner['name']}", f"{configmaps}/{dependent['name']}"


def install_crds(cluster: Cluster) -> None:
    cluster.kubectl("apply", "--server-side", "-f", str(CRD_DIR))
    for path in sorted(CRD_DIR.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        cluster.kubectl(
            "wait", "--for=condition=Established", "--timeout=60s", f"crd/{crd['metadata']['name']}"
        )
        # Established comes before the watch cache is ready; until then lists answer 429.
        resource = f"{crd['spec']['names']['plural']}.{crd['spec']['group']}"
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while cluster.kubectl("get", resource, "--all-namespaces", check=False).returncode != 0:
            if time.monotonic() > deadline:
                cluster.kubectl("get", resource, "--all-namespaces")  # raises with the error text
            time.sleep(0.25)


def main() -> None:
    """Start a cluster by hand: `python tests/k8s/k8s_cluster.py`, then use the printed KUBECONFIG."""
    import tempfile

    bin_dir = build_tools()
    cluster = start_cluster(bin_dir, pathlib.Path(tempfile.mkdtemp(prefix="sneppx-k8s-")))
    print(
        f"export KUBECONFIG={cluster.kubeconfig}\nexport PATH={bin_dir}:$PATH\n"
        f"# API server {cluster.server}; Ctrl-C stops the cluster",
        flush=True,
    )
    stop_signals = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)  # so sigwait, not a handler, receives them
    try:
        signal.sigwait(stop_signals)
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
