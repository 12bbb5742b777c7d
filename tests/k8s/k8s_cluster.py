"""A real Kubernetes API for tests: etcd + kube-apiserver as local processes, the way envtest does it.

Why: schema and CEL validation, the status subresource, RBAC, Pod Security admission and server-side
apply only behave for real on a real API server, and there is no Docker here for kind. The binaries are
built from pinned Go modules by tests/tools/build.sh and cached by version; this module makes the
certificates, starts both processes on free loopback ports, waits for /readyz and writes kubeconfigs.

There is no kube-controller-manager, scheduler or kubelet: no garbage collection of owned objects,
namespaces stay Terminating after deletion, pods stay Pending unless a test writes their status.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import ipaddress
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


class ClusterStartError(RuntimeError):
    """etcd or kube-apiserver did not come up; the message carries the tail of its log."""


def build_tools() -> pathlib.Path:
    """Build (or reuse) the pinned binaries and return their directory. Never skips: a failure raises."""
    result = subprocess.run(["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ClusterStartError(
            f"tests/tools/build.sh failed ({result.returncode}):\n{result.stderr[-4000:]}"
        )
    bin_dir = pathlib.Path(result.stdout.strip().splitlines()[-1])
    for tool in ("etcd", "kube-apiserver", "kubectl", "helm"):
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
        self, common_name: str, *, organizations: tuple[str, ...] = (), server: bool = False
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
                    [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
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
        # The apiserver first, so it doesn't spend its shutdown retrying a vanished etcd.
        for proc in reversed(self.processes):
            stop_process(proc)


def start_cluster(bin_dir: pathlib.Path, workdir: pathlib.Path) -> Cluster:
    """Start etcd and kube-apiserver with envtest's flags, wait for /readyz, install the CRDs."""
    workdir.mkdir(parents=True, exist_ok=True)
    certs = workdir / "certs"
    certs.mkdir(exist_ok=True)
    ca = CertificateAuthority()
    serving = ca.issue("kube-apiserver", server=True)
    admin = ca.issue("sneppx-test-admin", organizations=("system:masters",))
    sa = service_account_keys()
    files = {
        "ca.crt": ca.cert_pem,
        "apiserver.crt": serving.cert_pem,
        "apiserver.key": serving.key_pem,
        "admin.crt": admin.cert_pem,
        "admin.key": admin.key_pem,
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

        server = f"https://127.0.0.1:{api_port}"
        api_log = workdir / "kube-apiserver.log"
        apiserver = subprocess.Popen(
            [
                str(bin_dir / "kube-apiserver"),
                f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={api_port}",
                f"--cert-dir={certs}",
                f"--tls-cert-file={certs / 'apiserver.crt'}",
                f"--tls-private-key-file={certs / 'apiserver.key'}",
                f"--client-ca-file={certs / 'ca.crt'}",
                "--authorization-mode=RBAC",
                "--allow-privileged=true",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                "--disable-admission-plugins=ServiceAccount",
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
        install_crds(cluster)
        return cluster
    except BaseException:
        for proc in reversed(processes):
            stop_process(proc)
        raise


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
        f"# API server {cluster.server}; Ctrl-C stops etcd and kube-apiserver",
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
