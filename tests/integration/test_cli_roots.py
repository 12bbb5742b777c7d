"""`sneppx ls | gc` on a checkpoint root, local and on both S3 servers, as a user runs them."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
from s3_servers import S3Server

from SneppX_ALG import CheckpointCoordinator, generate_keypair
from SneppX_ALG.checkpoint import signing


def sneppx(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("sneppx", path=str(pathlib.Path(sys.executable).parent))
    assert exe, "the sneppx console script is installed with the package"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300, check=False)


def save(root: str, steps: list[int], **kwargs: object) -> None:
    with CheckpointCoordinator(root, async_save=False, device="cpu", max_to_keep=None, **kwargs) as c:
        for step in steps:
            c.save({"w": np.full((64, 64), step, np.float32), "b": np.arange(8.0)}, step=step,
                   training_state={"step": step})


def corrupt(root: pathlib.Path, step: int) -> None:
    """Flips one byte of a tensor in the step's shard: CRC32C catches it, a listing can't."""
    shard = root / f"step-{step:09d}" / "shard-00000.snpx"
    blob = bytearray(shard.read_bytes())
    blob[4096 + 10] ^= 0xFF
    shard.write_bytes(bytes(blob))


def ls(root: str, *extra: str) -> tuple[int, dict[str, object]]:
    result = sneppx("ls", root, "--json", *extra)
    assert result.returncode in (0, 1), result.stderr
    return result.returncode, json.loads(result.stdout)


def rows(listing: dict[str, object]) -> dict[str, dict[str, object]]:
    return {r["name"]: r for r in listing["steps"]}  # type: ignore[union-attr, index]


# ---- ls, local ----------------------------------------------------------------------------------------------


def test_ls_says_which_step_latest_picks_and_why_the_newer_one_was_skipped(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "root"
    save(str(root), [100, 200, 300])
    corrupt(root, 300)
    code, listing = ls(str(root))
    assert code == 1  # a committed step is invalid
    assert listing["latest"] == 200
    with CheckpointCoordinator(root, read_only=True) as c:
        assert c.latest().step == listing["latest"]  # the same answer as the coordinator's
    by_name = rows(listing)
    newest, picked, oldest = by_name["step-000000300"], by_name["step-000000200"], by_name["step-000000100"]
    assert (newest["check"], newest["valid"], newest["latest"]) == ("full", False, False)
    assert "CRC32C" in newest["problems"][0]
    assert (picked["check"], picked["valid"], picked["latest"]) == ("full", True, True)
    assert (oldest["check"], oldest["valid"]) == ("quick", True)  # older than the pick: not read by default
    assert "latest() picks step 200" in listing["why"] and "step 300 skipped" in listing["why"]
    assert picked["bytes"] == sum(f.stat().st_size for f in (root / "step-000000200").iterdir())
    assert picked["age"].endswith("s") and picked["signed"] is False
    human = sneppx("ls", str(root))
    assert human.returncode == 1 and "<- latest()" in human.stdout and "latest() picks step 200" in human.stdout


def test_ls_quick_reads_no_shard_and_full_reads_them_all(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "root"
    save(str(root), [100, 200, 300])
    corrupt(root, 300)
    corrupt(root, 100)
    code, listing = ls(str(root), "--quick")
    assert code == 0 and listing["latest"] == 300  # a flipped byte is invisible without reading the shard
    assert {r["check"] for r in listing["steps"]} == {"quick"} and "--quick" in listing["why"]
    os.unlink(root / "step-000000300" / "shard-00000.snpx")
    code, listing = ls(str(root), "--quick")
    assert code == 1 and listing["latest"] == 200 and "missing" in rows(listing)["step-000000300"]["problems"][0]
    code, listing = ls(str(root), "--full")
    assert code == 1 and listing["latest"] == 200
    assert [(r["step"], r["check"], r["valid"]) for r in listing["steps"]] == [
        (300, "full", False), (200, "full", True), (100, "full", False)]


def test_ls_shows_saves_in_flight_and_steps_a_restore_abandoned(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "root"
    save(str(root), [100, 200, 300])
    leftover = root / ".tmp-step-000000400-w-host-1-2"
    leftover.mkdir()
    (leftover / "shard-00000.snpx").write_bytes(b"x" * 100)
    with CheckpointCoordinator(root, async_save=False, device="cpu", cleanup_on_start=False) as c:
        c.restore({"w": np.zeros((64, 64), np.float32), "b": np.zeros(8)}, step=100)
        c.save({"w": np.zeros((64, 64), np.float32), "b": np.zeros(8)}, step=150)  # the new timeline
    code, listing = ls(str(root))
    assert code == 0 and listing["latest"] == 150
    states = {(r["step"], r["state"]) for r in listing["steps"]}
    assert {(400, "uncommitted"), (300, "set-aside"), (200, "set-aside"), (150, "committed"),
            (100, "committed")} == states
    assert rows(listing)[".tmp-step-000000400-w-host-1-2"]["bytes"] == 100


def test_ls_marks_steps_a_fence_record_abandoned_before_they_are_moved(tmp_path: pathlib.Path) -> None:
    from SneppX_ALG.coordinator import timeline

    root = tmp_path / "root"
    save(str(root), [100, 200, 300])
    (root / timeline.FENCE_RECORD).write_bytes(timeline.encode_fence(timeline.Fence(100, (200, 300))))
    code, listing = ls(str(root))
    assert code == 0 and listing["latest"] == 100
    assert rows(listing)["step-000000300"]["state"] == "abandoned"
    assert "restore to step 100" in rows(listing)["step-000000300"]["note"]


def test_ls_names_signers_and_checks_them_against_trusted_keys(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "root"
    private, public = generate_keypair()
    save(str(root), [100, 200], signing_key=private)
    _, other = generate_keypair()
    (tmp_path / "good.pub").write_bytes(b"")
    signing.save_public_key(tmp_path / "ok.pem", public)
    signing.save_public_key(tmp_path / "other.pem", other)
    code, listing = ls(str(root))
    assert code == 0 and rows(listing)["step-000000200"]["signers"] == [signing.key_id_hex(public)]
    code, listing = ls(str(root), "--trusted-key", str(tmp_path / "ok.pem"))
    assert code == 0 and rows(listing)["step-000000200"]["signer_trusted"] is True
    code, listing = ls(str(root), "--trusted-key", str(tmp_path / "other.pem"))
    assert code == 1 and listing["latest"] is None and "UntrustedKeyError" in listing["why"]
    bad_key = sneppx("ls", str(root), "--trusted-key", str(tmp_path / "good.pub"))
    assert bad_key.returncode == 2 and bad_key.stderr.startswith("sneppx ls: KeyFormatError")


def test_ls_of_an_empty_root_and_of_nothing(tmp_path: pathlib.Path) -> None:
    (tmp_path / "empty").mkdir()
    code, listing = ls(str(tmp_path / "empty"))
    assert code == 0 and listing["latest"] is None and listing["steps"] == []
    assert "no committed step" in listing["why"]
    assert sneppx("ls", "ftp://nowhere/x").returncode == 2


# ---- gc, local ----------------------------------------------------------------------------------------------


def test_gc_keeps_every_step_a_kept_incremental_step_references_and_ls_shows_the_chain(
        tmp_path: pathlib.Path) -> None:
    root = tmp_path / "root"
    # "b" never changes: every later step references step 100's copy (True: "auto" would stop comparing, as "b" is
    # less than 1/8 of the state)
    save(str(root), [100, 200, 300, 400, 500], incremental=True)
    code, listing = ls(str(root), "--quick")
    by_step = {r["step"]: r for r in listing["steps"]}
    assert by_step[100]["uses"] == [] and all(by_step[s]["uses"] == [100] for s in (200, 300, 400, 500))
    assert by_step[500]["bytes"] < by_step[100]["bytes"] and by_step[500]["logical_bytes"] == by_step[100][
        "logical_bytes"]
    report = json.loads(sneppx("gc", str(root), "--keep", "2", "--json").stdout)
    assert report["delete"] == [200, 300] and report["pinned"] == [100], report
    applied = sneppx("gc", str(root), "--keep", "2", "--apply")
    assert applied.returncode == 0 and "step 100 is kept: a kept step references" in applied.stdout
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000000100", "step-000000400", "step-000000500"]
    code, listing = ls(str(root), "--full")
    assert code == 0 and all(r["valid"] for r in listing["steps"]), listing
    shutil.rmtree(root / "step-000000100")  # what a deletion that ignored references would leave
    code, listing = ls(str(root), "--quick")
    assert code == 1 and "references step(s) [100], which are not committed" in rows(listing)["step-000000500"][
        "problems"][0], listing


def test_gc_is_a_dry_run_until_apply(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "root"
    save(str(root), [100, 200, 300, 400, 500], incremental=False)  # full steps: none pins another
    dry = sneppx("gc", str(root), "--keep", "2")
    assert dry.returncode == 0 and "would delete step 100" in dry.stdout and "dry run" in dry.stdout
    assert len(list(root.glob("step-*"))) == 5
    report = json.loads(sneppx("gc", str(root), "--keep", "2", "--keep-every", "200", "--json").stdout)
    assert report["delete"] == [100, 300] and report["applied"] is False
    applied = sneppx("gc", str(root), "--keep", "2", "--apply")
    assert applied.returncode == 0 and "deleted step 300" in applied.stdout
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000000400", "step-000000500"]
    assert sneppx("gc", str(root), "--keep", "0").returncode == 2


def test_gc_never_removes_the_newest_valid_step(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "root"
    save(str(root), [100, 200, 300])
    corrupt(root, 300)
    corrupt(root, 200)
    report = json.loads(sneppx("gc", str(root), "--keep", "1", "--json").stdout)
    assert report["newest_valid"] == 100 and 100 not in report["delete"] and report["delete"] == [200]
    assert sneppx("gc", str(root), "--keep", "1", "--apply").returncode == 0
    with CheckpointCoordinator(root, read_only=True) as c:
        assert c.committed_steps() == [100, 300] and c.latest().step == 100


# ---- both, on S3 (moto and the Versity gateway) ---------------------------------------------------------


def test_ls_and_gc_on_an_s3_root(s3_env: S3Server, s3_bucket: str) -> None:
    root = f"s3://{s3_bucket}/jobs/run1"
    save(root, [100, 200, 300])
    client = s3_env.client()
    client.put_object(Bucket=s3_bucket, Key="jobs/run1/step-000000400/shard-00000.snpx", Body=b"x" * 10)
    code, listing = ls(root)
    assert code == 0 and listing["latest"] == 300
    assert [(r["step"], r["state"], r["check"]) for r in listing["steps"]] == [
        (400, "uncommitted", None), (300, "committed", "full"), (200, "committed", "quick"),
        (100, "committed", "quick")]
    client.delete_object(Bucket=s3_bucket, Key="jobs/run1/step-000000400/shard-00000.snpx")
    assert all(r["bytes"] > 0 and r["age"] != "?" for r in listing["steps"] if r["state"] == "committed")
    code, listing = ls(root, "--full")
    assert code == 0 and all(r["valid"] for r in listing["steps"])
    dry = json.loads(sneppx("gc", root, "--keep", "1", "--json").stdout)
    assert dry["delete"] == [100, 200] and dry["newest_valid"] == 300
    assert sneppx("gc", root, "--keep", "1", "--apply").returncode == 0
    with CheckpointCoordinator(root, read_only=True) as c:
        assert c.committed_steps() == [300]
    shard = "jobs/run1/step-000000300/shard-00000.snpx"
    blob = bytearray(client.get_object(Bucket=s3_bucket, Key=shard)["Body"].read())
    blob[4096 + 10] ^= 0xFF
    client.put_object(Bucket=s3_bucket, Key=shard, Body=bytes(blob))
    code, listing = ls(root)
    assert code == 1 and listing["latest"] is None and "CRC32C" in listing["why"]
