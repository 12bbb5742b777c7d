"""What the fuzz targets (tests/fuzz) found, each kept as a regression case beside its fix. docs/TESTING.md,
"Fuzzing", lists them with the target that found each."""

from __future__ import annotations

import datetime
import pathlib
import socket
import threading

import numpy as np
import pytest

from SneppX_ALG import checkpoint, errors, storage
from SneppX_ALG.checkpoint import format
from SneppX_ALG.checkpoint import manifest as manifest_codec
from SneppX_ALG.coordinator import CheckpointCoordinator
from SneppX_ALG.elastic import control
from sneppx_operator import reconcile

NOW = datetime.datetime(2026, 12, 5, tzinfo=datetime.UTC)


@pytest.mark.parametrize(("raw", "phrase"), [
    (b"[" * 100_000, "nests deeper"),             # RecursionError escaped decode_manifest (reasoned from the
                                                  # target's design, then confirmed by hand)
    (b'{"format": 1e999}', "out of range"),       # step_manifest: 1e999 parsed to inf, and the checksum's
                                                  # json.dumps(allow_nan=False) raised ValueError
])
def test_a_hostile_manifest_is_a_manifest_error(raw: bytes, phrase: str) -> None:
    with pytest.raises(errors.ManifestError, match=phrase):
        manifest_codec.decode_manifest(raw, step=7, where="manifest.json")


def test_validate_reports_a_step_whose_manifest_nests_too_deep(tmp_path: pathlib.Path) -> None:
    with CheckpointCoordinator(str(tmp_path), async_save=False) as coordinator:
        coordinator.save({"w": np.arange(4, dtype=np.float32)}, 7)
    step = next(p for p in tmp_path.iterdir() if storage.parse_step_name(p.name) == 7)
    (step / storage.MANIFEST).write_bytes(b"[" * 100_000 + b"]" * 100_000)
    ok, problems = checkpoint.validate_checkpoint(step)
    assert not ok and "nests deeper" in problems[0], problems


def test_a_table_number_out_of_range_is_corrupt_not_infinity(tmp_path: pathlib.Path) -> None:
    """Found beside the manifest's: a config holding 1e999 read as inf, which no table can be written with."""
    raw = b'{"config":{"x":1e999},"metadata":{},"tensors":[]}'
    header = format.Header(file_size=format.DATA_OFFSET + len(raw), table_offset=format.DATA_OFFSET,
                           table_length=len(raw), table_crc32c=checkpoint_crc(raw))
    with pytest.raises(errors.CorruptTableError, match="out of range"):
        format.decode_table(raw, header)


def checkpoint_crc(raw: bytes) -> int:
    from SneppX_ALG import _native

    return _native.crc32c(raw)


def test_a_control_line_nested_too_deep_closes_the_channel() -> None:
    """control_channel: json.loads raised RecursionError, which Channel.receive did not catch; the agent's loop
    died instead of treating the worker as gone."""
    ours, theirs = socket.socketpair()
    channel = control.Channel(ours)
    threading.Thread(target=lambda: (theirs.sendall(b"[" * 100_000 + b"\n"), theirs.close())).start()
    with pytest.raises(control.ChannelClosed, match="not JSON"):
        for _ in range(10):
            channel.receive(timeout=10)
    ours.close()


BASE = {"template": {"spec": {"containers": [{"name": "trainer", "image": "example.org/t:1"}]}},
        "elastic": {"minNodes": 1, "maxNodes": 2}, "checkpoint": {"storage": {"pvc": {"claimName": "ckpt"}}}}


@pytest.mark.parametrize(("change", "phrase"), [
    ({"checkpoint": {"storage": {}}}, "exactly one of pvc or s3"),  # job_spec: KeyError 'pvc' in the first pass
    ({"checkpoint": {"storage": {"pvc": {"claimName": "c"}, "s3": {"bucket": "b"}}}}, "exactly one"),
    ({"checkpoint": {"storage": {"pvc": {"claimName": "c", "subPath": "../x"}}}}, "relative"),
    ({"checkpoint": {"storage": {"pvc": {"claimName": "c"}}, "rollbackDepth": 3, "maxToKeep": 3}}, "rollbackDepth"),
    ({"elastic": {"minNodes": 3, "maxNodes": 2}}, "minNodes"),
    ({"failurePolicy": {"restartDelay": {"initialSeconds": 9, "maxSeconds": 1}}}, "initialSeconds"),
    ({"failurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {"operator": "In", "values": [0]}}]}},
     "must not list 0"),
])
def test_a_spec_the_crd_rules_refuse_fails_the_job_as_invalid_not_the_operator(change: dict, phrase: str) -> None:
    """The API server's CEL rules refuse these; an API server that does not run them (or an object stored before
    a rule existed) must not make the operator crash: the job fails with reason InvalidSpec."""
    job = reconcile.Job(name="train", namespace="ns", uid="u", generation=1, spec={**BASE, **change}, status={})
    plan = reconcile.plan(job, [], now=NOW, heartbeat_key=b"k" * 32)
    ready = next(c for c in plan.status["conditions"] if c["type"] == "Ready")
    assert plan.status["phase"] == "Failed" and ready["reason"] == "InvalidSpec" and phrase in ready["message"]
    assert not [a for a in plan.actions if type(a).__name__ == "Create" and a.body.get("kind") == "Pod"]
