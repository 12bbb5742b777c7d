"""The operator's status writes (k8s.patch_job_status with reconcile's plans) against the real API server and the
real CRD: a thousand ranks failing at once still make a status the server accepts, a field the status no longer
has is removed, and a write from a stale view is refused. No operator runs here: the writes are made directly."""

from __future__ import annotations

import dataclasses
import datetime

import k8s_helpers
import kubernetes
import pytest

from SneppX_ALG.contract import job_object
from sneppx_operator import builders, k8s, reconcile

pytestmark = pytest.mark.k8s
NOW = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)


@pytest.fixture
def job(api: kubernetes.client.ApiClient, namespace: str) -> reconcile.Job:
    """A suspended job of 1024 nodes (suspended: nothing may act on it but this test)."""
    body = k8s_helpers.valid_job("big", max_nodes=1024, min_nodes=1)
    body["spec"]["suspend"] = True
    body["spec"]["failurePolicy"] = {"maxRestarts": 0}
    k8s_helpers.create(api, namespace, body)
    k8s.connect()
    return reconcile.Job.from_body(k8s.read_job(namespace, "big") or {})


def _observed(rank: int, **fields: object) -> reconcile.ObservedPod:
    return reconcile.ObservedPod(f"big-{rank}", rank, 1, "Running", True, False, f"node-{rank % 7}",
                                 uid=f"uid-{rank}", controller_uid="x", **fields)  # type: ignore[arg-type]


def _write(job: reconcile.Job, plan: reconcile.Plan) -> reconcile.Job:
    k8s.patch_job_status(job.namespace, job.name, job.uid, job.resource_version,
                         reconcile.status_patch(job.status, plan.status))
    return reconcile.Job.from_body(k8s.read_job(job.namespace, job.name) or {})


def _running(job: reconcile.Job) -> reconcile.Job:
    running = dataclasses.replace(job, spec={**job.spec, "suspend": False})
    pods = [dataclasses.replace(_observed(r), controller_uid=job.uid) for r in range(1024)]
    control = builders.control_record(running.spec, paused=False, reason="", pod_generation=1)
    view = reconcile.ObservedObject("cm", job.uid, job_object.View(control=control))
    written = _write(job, reconcile.plan(running, pods, now=NOW, heartbeat_key=bytes(32), rendezvous=view))
    return dataclasses.replace(written, spec=running.spec)


def test_a_thousand_ranks_failing_at_once_write_a_status_the_api_server_accepts(job: reconcile.Job) -> None:
    running = _running(job)
    assert running.status["phase"] == "Running" and len(running.status["ranks"]) == 1024
    failed = [dataclasses.replace(_observed(r, exit_code=137, reason="OOMKilled"), phase="Failed",
                                  controller_uid=job.uid) for r in range(1024)]
    plan = reconcile.plan(running, failed, now=NOW, heartbeat_key=bytes(32), rendezvous=None)
    after = _write(running, plan)
    assert after.status["phase"] == "Failed"
    failed_condition = next(c for c in after.status["conditions"] if c["type"] == "Failed")
    assert failed_condition["reason"] == "RestartBudgetExhausted"
    assert "and 1016 more (ranks 8-1023)" in failed_condition["message"]


def test_a_field_the_status_no_longer_has_is_removed_by_the_patch(job: reconcile.Job) -> None:
    running = _running(job)
    pods = [dataclasses.replace(_observed(r), controller_uid=job.uid) for r in range(1024)]
    control = builders.control_record(running.spec, paused=False, reason="", pod_generation=1)
    broken = reconcile.ObservedObject("cm", job.uid, job_object.View(control=control, problems=("job/report: bad",)))
    with_problems = _write(running, reconcile.plan(running, pods, now=NOW, heartbeat_key=bytes(32),
                                                   rendezvous=broken))
    assert with_problems.status["rendezvous"]["problems"] == ["job/report: bad"]
    with_problems = dataclasses.replace(with_problems, spec=running.spec)
    fixed = reconcile.ObservedObject("cm", job.uid, job_object.View(control=control))
    plan = reconcile.plan(with_problems, pods, now=NOW, heartbeat_key=bytes(32), rendezvous=fixed)
    cleared = _write(with_problems, plan)
    assert "problems" not in cleared.status.get("rendezvous", {}), cleared.status.get("rendezvous")
    again = reconcile.plan(dataclasses.replace(cleared, spec=running.spec), pods, now=NOW,
                           heartbeat_key=bytes(32), rendezvous=fixed)
    assert reconcile.status_patch(cleared.status, again.status) == {}, "nothing is sent again"


def test_a_status_write_from_a_stale_view_is_refused(job: reconcile.Job) -> None:
    running = _running(job)
    stale = job  # read before _running wrote the status
    with pytest.raises(k8s.StatusConflict):
        k8s.patch_job_status(stale.namespace, stale.name, stale.uid, stale.resource_version, {"restartCount": 99})
    assert (k8s.read_job(job.namespace, job.name) or {})["status"]["restartCount"] == running.status["restartCount"]


def test_every_other_rank_of_a_thousand_short_of_snapshot_copies_writes_a_condition_the_api_server_accepts(
        job: reconcile.Job) -> None:
    running = _running(job)
    spec = {**running.spec, "checkpoint": {**running.spec["checkpoint"], "snapshotEveryNSteps": 1}}
    pods = [dataclasses.replace(_observed(r), controller_uid=job.uid) for r in range(1024)]
    control = builders.control_record(spec, paused=False, reason="", pod_generation=1)
    report = job_object.Report(1, 1024, tuple(f"big-{r}" for r in range(1024)), None, None,
                               "2026-01-02T03:04:00Z", tuple(range(0, 1024, 2)))
    view = reconcile.ObservedObject("cm", job.uid, job_object.View(control=control, report=report))
    after = _write(running, reconcile.plan(dataclasses.replace(running, spec=spec), pods, now=NOW,
                                           heartbeat_key=bytes(32), rendezvous=view))
    protected = next(c for c in after.status["conditions"] if c["type"] == "SnapshotsProtected")
    assert (protected["status"], protected["reason"]) == ("False", "CopiesOnSameNode")
    assert protected["message"].startswith("the snapshots of ranks 0, 2, 4,") and "and 496 more" in protected["message"]
