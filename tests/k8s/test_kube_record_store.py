"""records/kube.py: the compare-and-swap record store over a job's rendezvous ConfigMap, against the real API
server, as the job's agent ServiceAccount (a TokenRequest token held to the Role the operator builds)."""

from __future__ import annotations

import concurrent.futures
import pathlib
import threading
from collections.abc import Iterator

import k8s_cluster
import kubernetes
import pod_runner
import pytest
import yaml

from SneppX_ALG import errors
from SneppX_ALG.contract import job_object
from SneppX_ALG.elastic import rendezvous
from SneppX_ALG.records import kube
from sneppx_operator import builders

pytestmark = pytest.mark.k8s
UID = "00000000-0000-4000-8000-000000000001"


def _agent_client(
    api: kubernetes.client.ApiClient, cluster: k8s_cluster.Cluster, namespace: str, job: str, tmp: pathlib.Path
) -> kubernetes.client.ApiClient:
    core = kubernetes.client.CoreV1Api(api)
    rbac = kubernetes.client.RbacAuthorizationV1Api(api)
    # No job object here: owner references to it would have the garbage collector remove these at once.
    for create, build in ((core.create_namespaced_service_account, builders.build_service_account),
                          (rbac.create_namespaced_role, builders.build_role),
                          (rbac.create_namespaced_role_binding, builders.build_role_binding)):
        body = build(job, namespace, UID)
        body["metadata"].pop("ownerReferences")
        create(namespace, body)
    token = core.create_namespaced_service_account_token(
        builders.agent_name(job), namespace, {"spec": {"expirationSeconds": 600}}
    ).status.token
    path = tmp / f"{job}.kubeconfig"
    path.write_text(yaml.safe_dump(pod_runner.kubeconfig(cluster.server, cluster.ca.cert_pem, token)))
    return kubernetes.config.new_client_from_config(config_file=str(path))


@pytest.fixture
def agent(
    api: kubernetes.client.ApiClient, cluster: k8s_cluster.Cluster, namespace: str, tmp_path: pathlib.Path
) -> Iterator[kubernetes.client.ApiClient]:
    client = _agent_client(api, cluster, namespace, "job", tmp_path)
    yield client
    client.close()


def _make_object(api: kubernetes.client.ApiClient, namespace: str, job: str = "job") -> None:
    control = job_object.Control(False, "", 1, 2, 1, 60)
    body = builders.build_rendezvous_object(job, namespace, UID, control)
    body["metadata"].pop("ownerReferences")  # no job object here; ownership is the operator's concern
    kubernetes.client.CoreV1Api(api).create_namespaced_config_map(namespace, body)


def test_the_agent_reads_writes_and_lists_records_by_compare_and_swap(
    api: kubernetes.client.ApiClient, namespace: str, agent: kubernetes.client.ApiClient
) -> None:
    store = kube.KubernetesRecordStore(namespace, "job-rendezvous", api_client=agent)
    with pytest.raises(errors.RecordUnavailableError, match="does not exist"):
        store.read("rdzv/job/g000000000/membership")  # the operator hasn't made it yet
    _make_object(api, namespace)
    assert store.read(job_object.CONTROL_KEY) is not None
    first = store.create("rdzv/job/g000000000/join/job-0", {"n": 1})
    with pytest.raises(errors.RecordExistsError):
        store.create("rdzv/job/g000000000/join/job-0", {"n": 2})
    swapped = store.swap(first.key, {"n": 3}, first.version)
    with pytest.raises(errors.RecordConflictError):
        store.swap(first.key, {"n": 4}, first.version)
    assert store.read(first.key) == swapped and swapped.value == {"n": 3}
    store.create("rdzv/job/g000000000/join/job-1", {"n": 1})
    store.create("rdzv/job/g000000001/join/job-0", {"n": 1})
    assert store.keys("rdzv/job/g000000000/join/") == [
        "rdzv/job/g000000000/join/job-0", "rdzv/job/g000000000/join/job-1"]
    assert store.keys("rdzv/job/", limit=1) == ["rdzv/job/g000000000/join/job-0"]
    store.delete(first.key)
    store.delete(first.key)  # absent: not an error
    assert store.read(first.key) is None
    with pytest.raises(errors.RecordConflictError):
        store.swap(first.key, {"n": 5}, swapped.version)
    assert store.read(job_object.CONTROL_KEY) is not None, "the operator's record beside them is untouched"


def test_racing_writers_lose_no_update_and_only_one_creates(
    api: kubernetes.client.ApiClient, namespace: str, agent: kubernetes.client.ApiClient
) -> None:
    _make_object(api, namespace)
    store = kube.KubernetesRecordStore(namespace, "job-rendezvous", api_client=agent)
    winners: list[int] = []
    errors_seen: list[BaseException] = []

    def creator(i: int) -> None:
        try:
            store.create("rdzv/job/g000000000/membership", {"sealed_by": i})
            winners.append(i)
        except errors.RecordExistsError:
            pass
        except BaseException as exc:  # noqa: BLE001
            errors_seen.append(exc)

    def incrementer() -> None:
        for _ in range(5):
            while True:
                current = store.read("counter")
                try:
                    if current is None:
                        store.create("counter", {"n": 1})
                    else:
                        store.swap("counter", {"n": current.value["n"] + 1}, current.version)
                    break
                except errors.RecordConflictError:
                    continue

    threads = [threading.Thread(target=creator, args=(i,)) for i in range(6)]
    threads += [threading.Thread(target=incrementer) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors_seen, errors_seen
    assert len(winners) == 1
    assert store.read("rdzv/job/g000000000/membership").value == {"sealed_by": winners[0]}
    assert store.read("counter").value == {"n": 20}, "every compare-and-swap increment landed exactly once"


def test_the_agent_can_not_touch_another_jobs_object_and_a_full_object_is_refused_before_sending(
    api: kubernetes.client.ApiClient, namespace: str, agent: kubernetes.client.ApiClient
) -> None:
    _make_object(api, namespace)
    _make_object(api, namespace, "other")
    theirs = kube.KubernetesRecordStore(namespace, "other-rendezvous", api_client=agent)
    with pytest.raises(errors.RecordStoreError, match="refused this pod's credentials \\(403\\)"):
        theirs.read("job/report")
    with pytest.raises(errors.RecordStoreError, match="refused this pod's credentials \\(403\\)"):
        theirs.create("job/report", {"x": 1})
    store = kube.KubernetesRecordStore(namespace, "job-rendezvous", api_client=agent)
    chunk = {"pad": "x" * 300_000}
    for i in range(3):
        store.create(f"pad/{i}", chunk)
    with pytest.raises(errors.RecordStoreError, match="a ConfigMap holds about"):
        store.create("pad/3", chunk)


def test_the_object_stays_small_over_many_generations(
    api: kubernetes.client.ApiClient, namespace: str, agent: kubernetes.client.ApiClient
) -> None:
    """Each sealer removes the generations before the previous one (rendezvous.Rendezvous.sweep), so a job that
    re-forms for days keeps a few generations' records in its ConfigMap, never 1 MiB of them."""
    _make_object(api, namespace)
    store = kube.KubernetesRecordStore(namespace, "job-rendezvous", api_client=agent)
    agents = [rendezvous.Rendezvous(store, "job", agent_id=f"job-{i}", host="127.0.0.1",
                                    heartbeat=f"127.0.0.1:{29500 + i}", workers=8,
                                    config=rendezvous.RendezvousConfig(min_nodes=3, max_nodes=3)) for i in range(3)]
    sizes = []
    membership = None
    for _ in range(12):
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            joined = list(pool.map(lambda a, previous=membership: a.join(previous=previous), agents))
        membership = joined[0]
        for a in agents:
            a.poll(membership)
        data = kubernetes.client.CoreV1Api(api).read_namespaced_config_map("job-rendezvous", namespace).data
        sizes.append(sum(len(k) + len(v) for k, v in data.items()))
    assert membership is not None and membership.generation == 11
    kept = {rendezvous.generation_of("job", k) for k in store.keys("rdzv/job/")} - {None}
    assert kept == {10, 11}
    assert max(sizes[3:]) <= 1.1 * min(sizes[3:]), sizes  # flat once the sweeps begin, not growing
    assert store.read(job_object.CONTROL_KEY) is not None, "the operator's record is never swept"
