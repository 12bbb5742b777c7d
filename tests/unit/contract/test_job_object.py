"""The rendezvous object's layout and records (contract/job_object.py): pure, shared by operator and runtime."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from SneppX_ALG import errors
from SneppX_ALG.contract import job_object, record

SEGMENT = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True)


@given(st.lists(SEGMENT, min_size=1, max_size=6))
def test_data_keys_round_trip_and_are_configmap_keys(segments: list[str]) -> None:
    key = "/".join(segments)
    encoded = job_object.data_key(key)
    assert job_object.record_key(encoded) == key
    assert all(c.isalnum() or c in "-._" for c in encoded)


@given(st.lists(SEGMENT, min_size=1, max_size=4), st.lists(SEGMENT, min_size=1, max_size=4))
def test_distinct_keys_never_share_a_data_key(a: list[str], b: list[str]) -> None:
    if a != b:
        assert job_object.data_key("/".join(a)) != job_object.data_key("/".join(b))


def test_the_rendezvous_keys_of_a_job_fit_and_read_well() -> None:
    key = "rdzv/" + "j" * 50 + "/g000000007/join/" + "j" * 50 + "-1023"
    assert job_object.data_key("rdzv/train/g000000007/join/train-1") == "rdzv.train.g000000007.join.train-1"
    assert len(job_object.data_key(key)) <= 253
    with pytest.raises(errors.RecordValueError):
        job_object.data_key("a/" + "b" * 252)


@pytest.mark.parametrize("encoded", ["a_b", "a..b", ".a", "a/b", "a_", "", "x" * 254, "a_x"])
def test_keys_this_layout_never_writes_are_not_records(encoded: str) -> None:
    assert job_object.record_key(encoded) is None


def _report(**change: object) -> dict[str, object]:
    value = job_object.report_to_json(
        job_object.Report(
            generation=3,
            world_size=2,
            members=("train-0", "train-1"),
            last_valid_checkpoint=job_object.CheckpointRef(1200, "file:///ckpt/step-000001200", "2026-01-02T03:04:05Z"),
            resumed_from=None,
            reported_at="2026-01-02T03:04:06Z",
        )
    )
    value.update(change)
    return value


def _data(**records: dict[str, object]) -> dict[str, str]:
    return {job_object.data_key(k): json.dumps(v) for k, v in records.items()}


def test_read_view_parses_what_the_agents_and_operator_write() -> None:
    control = job_object.Control(True, "quorum lost", 1, 2, 4, 1800)
    hung = job_object.HungRank("train-1", 1, 3, "train-0", 31.5, "2026-01-02T03:04:07Z")
    view = job_object.read_view(
        _data(**{
            "job/control": job_object.control_to_json(control),
            "job/report": _report(),
            "job/hung/train-1": job_object.hung_to_json(hung),
            "rdzv/train/g000000000/membership": {"anything": "the operator never reads"},
        })
    )
    assert view.problems == ()
    assert view.control == control
    assert view.report is not None and view.report.last_valid_checkpoint is not None
    assert view.report.last_valid_checkpoint.step == 1200 and view.report.members == ("train-0", "train-1")
    assert view.hung == (hung,)


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("job/report", _report(generation=-1), "generation is not an integer"),
        ("job/report", _report(generation=True), "generation is not an integer"),
        ("job/report", _report(members=["Not A Pod"]), "a member is not a pod name"),
        ("job/report", _report(extra=1), "has the fields"),
        ("job/report", _report(version=2), "not a version 1 report"),
        ("job/report", _report(reported_at="yesterday"), "reported_at is not an RFC 3339"),
        ("job/report", _report(last_valid_checkpoint={"step": 1, "location": "", "time": "2026-01-02T03:04:05Z"}),
         "location is not printable"),
        ("job/hung/train-1", job_object.hung_to_json(
            job_object.HungRank("train-2", 2, 1, "train-0", 1.0, "2026-01-02T03:04:07Z")), "not the one in its key"),
    ],
)
def test_read_view_reports_bad_records_and_ignores_them(key: str, value: object, problem: str) -> None:
    view = job_object.read_view(_data(**{key: value}))  # type: ignore[arg-type]
    assert view.report is None and view.hung == ()
    assert len(view.problems) == 1 and problem in view.problems[0], view.problems


def test_read_view_survives_text_that_is_not_a_record() -> None:
    data = {job_object.data_key("job/report"): "{not json", job_object.data_key("job/control"): "[]"}
    view = job_object.read_view(data)
    assert view.report is None and view.control is None and len(view.problems) == 2


def test_encode_value_is_the_record_encoding() -> None:
    assert job_object.encode_value("job/report", {"b": 1, "a": 2}) == '{"a":2,"b":1}'
    with pytest.raises(errors.RecordValueError):
        job_object.encode_value("job/report", {"x": float("nan")})
    assert record.decode("k", job_object.encode_value("k", {"a": 1}).encode()) == {"a": 1}


@given(st.integers(1, 64).flatmap(lambda world: st.tuples(
    st.just(world), st.none() | st.sets(st.integers(0, world - 1)).map(lambda s: tuple(sorted(s))))))
def test_a_report_round_trips_with_or_without_its_unprotected_ranks(
        world_and_ranks: tuple[int, tuple[int, ...] | None]) -> None:
    world, ranks = world_and_ranks
    report = job_object.Report(3, world, ("train-0",), None, None, "2026-01-02T03:04:06Z", ranks)
    value = json.loads(json.dumps(job_object.report_to_json(report)))
    assert ("snapshot_unprotected" in value) == (ranks is not None)  # an older operator reads a report without it
    assert job_object.parse_report(value) == report


@pytest.mark.parametrize(
    "ranks", [[2], [1, 1], [1, 0], [-1], [True], [0.0], "0", {"0": 1}]
)
def test_a_report_refuses_unprotected_ranks_that_are_not_ascending_ranks_of_the_world(ranks: object) -> None:
    with pytest.raises(errors.RecordCorruptError, match="snapshot_unprotected is not"):
        job_object.parse_report(_report(snapshot_unprotected=ranks))


def test_a_report_refuses_too_many_unprotected_ranks_even_when_each_is_valid() -> None:
    ranks = list(range(job_object.MAX_UNPROTECTED_RANKS + 1))
    with pytest.raises(errors.RecordCorruptError, match="at most 4096"):
        job_object.parse_report(_report(world_size=len(ranks), snapshot_unprotected=ranks))
