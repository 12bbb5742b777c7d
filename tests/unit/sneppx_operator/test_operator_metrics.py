"""The operator's Prometheus metrics (operator/sneppx_operator/metrics.py), read back in the text format."""

from __future__ import annotations

import datetime

import prometheus_client
from prometheus_client.parser import text_string_to_metric_families

from sneppx_operator import metrics


def samples() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = prometheus_client.generate_latest().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_pass_records_restarts_by_reason_recovery_and_the_jobs_gauges() -> None:
    five_minutes_ago = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
    status = {
        "phase": "Running", "membershipGeneration": 3, "worldSize": 4, "readyNodes": 4, "restartCount": 2,
        "rendezvous": {"generation": 7}, "lastValidCheckpoint": {
            "step": 1200, "location": "file:///c", "time": five_minutes_ago.strftime("%Y-%m-%dT%H:%M:%SZ")},
    }
    before = samples()
    metrics.record_pass("ns-m", "train", status, [{"reason": "Hang"}, {"reason": "PodFailed"}], 4.5)
    after = samples()
    job = (("job", "train"), ("namespace", "ns-m"))
    for reason in ("Hang", "PodFailed"):
        key = ("sneppx_job_restarts_total", tuple(sorted((*job, ("reason", reason)))))
        assert after[key] - before.get(key, 0.0) == 1.0
    assert after[("sneppx_job_recovery_seconds_count", ())] - before.get(("sneppx_job_recovery_seconds_count", ()), 0) == 1
    assert after[("sneppx_job_membership_generation", job)] == 3
    assert after[("sneppx_job_rendezvous_generation", job)] == 7
    assert after[("sneppx_job_world_size", job)] == 4 and after[("sneppx_job_restart_count", job)] == 2
    assert after[("sneppx_job_last_valid_checkpoint_step", job)] == 1200
    assert 299 <= after[("sneppx_job_checkpoint_age_seconds", job)] <= 400
    assert after[("sneppx_job_phase", tuple(sorted((*job, ("phase", "Running")))))] == 1
    assert after[("sneppx_job_phase", tuple(sorted((*job, ("phase", "Paused")))))] == 0

    metrics.forget("ns-m", "train")
    assert ("sneppx_job_world_size", job) not in samples(), "a deleted job's gauges go"
