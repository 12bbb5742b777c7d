"""`sneppx inspect | diff | convert` on files, step directories and S3 steps, as a user runs them."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from SneppX_ALG import CheckpointCoordinator, CheckpointWriter

BF16 = np.dtype(ml_dtypes.bfloat16)


def sneppx(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("sneppx", path=str(pathlib.Path(sys.executable).parent))
    assert exe, "the sneppx console script is installed with the package"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300, check=False)


def model_state(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"embed": rng.standard_normal((32, 16)).astype(BF16), "w": rng.standard_normal((16, 16)).astype(np.float32),
            "steps": np.arange(4, dtype=np.int64)}


def save_steps(root: str, **client: object) -> None:
    """Steps 100 and 200 of a tiny training run (200: one weight nudged, a tensor added)."""
    with CheckpointCoordinator(root, async_save=False, device="cpu", staging_bytes=64 << 10, **client) as c:
        state = model_state()
        c.save(state, step=100, training_state={"epoch": 1})
        state["w"] = state["w"].copy()
        state["w"][3, 4] += 0.5
        state["bias"] = np.zeros(16, np.float32)
        c.save(state, step=200, training_state={"epoch": 2})


# ---- inspect ----------------------------------------------------------------------------------------------


def test_inspect_a_step_directory_shows_manifest_training_state_and_every_shard(tmp_path: pathlib.Path) -> None:
    save_steps(str(tmp_path / "root"))
    step = str(tmp_path / "root" / "step-000000200")
    result = sneppx("inspect", step)
    assert result.returncode == 0, result.stderr
    for expected in ("step 200", "training state", '"epoch": 2', "embed", "bfloat16", "32x16", "shard-00000.snpx"):
        assert expected in result.stdout, expected
    info = json.loads(sneppx("inspect", step, "--json").stdout)
    assert info["kind"] == "step" and info["step"] == 200 and info["training_state"] == {"epoch": 2}
    assert {t["name"]: t["shape"] for t in info["tensors"]} == {"embed": [32, 16], "w": [16, 16], "steps": [4],
                                                                "bias": [16]}
    entries = [e["name"] for shard in info["shards"] for e in shard["tensors"]]
    assert set(entries) >= {"w", "bias"} and info["shards"][0]["file_bytes"] > 0
    # "embed" and "steps" did not change since step 100: step 200 references them there (an incremental step)
    assert info["uses"] == [100] and {e for ref in info["referenced"] for e in ref["entries"]} == {"embed", "steps"}
    assert "referenced in step 100's shard-00000.snpx" in result.stdout


def test_inspect_errors_exit_nonzero_with_the_reason(tmp_path: pathlib.Path) -> None:
    save_steps(str(tmp_path / "root"))
    step = tmp_path / "root" / "step-000000100"
    manifest = step / "manifest.json"
    manifest.write_bytes(manifest.read_bytes().replace(b'"epoch":1', b'"epoch":9'))
    result = sneppx("inspect", str(step))
    assert result.returncode == 1 and "ManifestError" in result.stderr and "checksum" in result.stderr
    plain = tmp_path / "plain"
    plain.mkdir()
    result = sneppx("inspect", str(plain))
    assert result.returncode == 1 and "is a directory, but neither a step directory" in result.stderr
    assert sneppx("inspect", str(tmp_path / "nothing.snpx")).returncode == 1


def test_inspect_shows_a_sharded_safetensors_checkpoint(tmp_path: pathlib.Path) -> None:
    src = tmp_path / "m.snpx"
    with CheckpointWriter(src, metadata={"format": "pt"}) as w:
        for name, value in model_state().items():
            w.write(name, value)
    assert sneppx("convert", str(src), str(tmp_path / "hf"), "--max-shard-size", "1KB").returncode == 0
    info = json.loads(sneppx("inspect", str(tmp_path / "hf"), "--json").stdout)
    assert info["kind"] == "safetensors" and {t["dtype"] for t in info["tensors"]} == {"bfloat16", "float32", "int64"}
    assert len({t["file"] for t in info["tensors"]}) == 3


# ---- diff -------------------------------------------------------------------------------------------------


def test_diff_reports_added_removed_and_changed_tensors_with_exit_1(tmp_path: pathlib.Path) -> None:
    a, b = tmp_path / "a.snpx", tmp_path / "b.snpx"
    with CheckpointWriter(a) as w:
        w.write("same", np.arange(10, dtype=np.float32))
        w.write("gone", np.ones(3, np.int8))
        w.write("nudged", np.zeros((4, 4), np.float32))
        w.write("reshaped", np.zeros(6, np.float32))
    nudged = np.zeros((4, 4), np.float32)
    nudged[1, 2], nudged[3, 3] = 0.25, -2.0
    with CheckpointWriter(b) as w:
        w.write("same", np.arange(10, dtype=np.float32))
        w.write("nudged", nudged)
        w.write("reshaped", np.zeros((2, 3), np.float32))
        w.write("new", np.ones(2, BF16))
    result = sneppx("diff", str(a), str(b))
    assert result.returncode == 1, result.stderr
    assert "- gone  int8 3" in result.stdout and "+ new  bfloat16 2" in result.stdout
    assert "~ reshaped  float32 6 -> float32 2x3" in result.stdout
    assert "~ nudged  float32 4x4  max |a-b| 2, 2 of 16 elements differ" in result.stdout
    report = json.loads(sneppx("diff", str(a), str(b), "--json").stdout)
    assert report["identical"] == 1 and [t["name"] for t in report["added"]] == ["new"]
    assert {t["name"]: t.get("max_abs_diff") for t in report["changed"]} == {"nudged": 2.0, "reshaped": None}
    same = sneppx("diff", str(a), str(a))
    assert same.returncode == 0 and "4 tensor(s) identical, 0 changed" in same.stdout
    missing = sneppx("diff", str(a), str(tmp_path / "missing.snpx"))
    assert missing.returncode == 2 and missing.stderr.startswith("sneppx diff: CheckpointNotFoundError")


def test_diff_of_a_conversion_finds_nothing_and_of_two_steps_finds_the_training(tmp_path: pathlib.Path) -> None:
    save_file(model_state(), tmp_path / "m.safetensors", metadata={"format": "pt"})
    assert sneppx("convert", str(tmp_path / "m.safetensors"), str(tmp_path / "m.snpx")).returncode == 0
    assert sneppx("diff", str(tmp_path / "m.safetensors"), str(tmp_path / "m.snpx")).returncode == 0
    save_steps(str(tmp_path / "root"))
    report = json.loads(sneppx("diff", str(tmp_path / "root" / "step-000000100"),
                               str(tmp_path / "root" / "step-000000200"), "--json").stdout)
    assert [t["name"] for t in report["added"]] == ["bias"] and report["removed"] == []
    assert [(t["name"], t["elements_changed"]) for t in report["changed"]] == [("w", 1)]
    assert report["changed"][0]["max_abs_diff"] == pytest.approx(0.5, rel=1e-6)  # float32 + 0.5, seen in float64
    assert report["identical"] == 2


# ---- convert ----------------------------------------------------------------------------------------------


def test_convert_both_ways_on_the_command_line(tmp_path: pathlib.Path) -> None:
    save_file(model_state(), tmp_path / "m.safetensors", metadata={"format": "pt"})
    to_snpx = sneppx("convert", str(tmp_path / "m.safetensors"), str(tmp_path / "m.snpx"))
    assert to_snpx.returncode == 0 and "wrote" in to_snpx.stdout
    assert sneppx("validate", str(tmp_path / "m.snpx")).returncode == 0
    out = sneppx("convert", str(tmp_path / "m.snpx"), str(tmp_path / "hf"), "--max-shard-size", "1.5KiB")
    assert out.returncode == 0, out.stderr
    assert "model.safetensors.index.json" in os.listdir(tmp_path / "hf")
    assert sneppx("diff", str(tmp_path / "hf"), str(tmp_path / "m.safetensors")).returncode == 0
    assert sneppx("convert", "a.snpx", "b.snpx", "--max-shard-size", "lots").returncode == 2
    assert sneppx("convert", str(tmp_path / "m.safetensors"), str(tmp_path / "x.snpx"), "--max-shard-size",
                  "1GB").returncode == 2
    save_file({"q": np.ones(4, ml_dtypes.float8_e4m3fn)}, tmp_path / "f8.safetensors")
    refused = sneppx("convert", str(tmp_path / "f8.safetensors"), str(tmp_path / "f8.snpx"))
    assert refused.returncode == 1 and "UnsupportedTensorError" in refused.stderr and "cast it" in refused.stderr


def test_convert_signs_snpx_output_with_a_key(tmp_path: pathlib.Path) -> None:
    save_file(model_state(), tmp_path / "m.safetensors")
    key = tmp_path / "k.pem"
    assert sneppx("keygen", str(key)).returncode == 0
    assert sneppx("convert", str(tmp_path / "m.safetensors"), str(tmp_path / "m.snpx"), "--key", str(key)
                  ).returncode == 0
    assert sneppx("verify", str(tmp_path / "m.snpx"), "-k", f"{key}.pub").returncode == 0


# ---- S3 steps (moto and the Versity gateway) --------------------------------------------------------------


@pytest.mark.usefixtures("s3_env")
def test_inspect_diff_and_convert_take_s3_steps(s3_bucket: str, tmp_path: pathlib.Path) -> None:
    root = f"s3://{s3_bucket}/jobs/run1"
    save_steps(root)
    result = sneppx("inspect", f"{root}/step-000000200", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["training_state"] == {"epoch": 2}
    report = json.loads(sneppx("diff", f"{root}/step-000000100", f"{root}/step-000000200", "--json").stdout)
    assert [t["name"] for t in report["changed"]] == ["w"] and [t["name"] for t in report["added"]] == ["bias"]
    converted = sneppx("convert", f"{root}/step-000000200", str(tmp_path / "s.safetensors"))
    assert converted.returncode == 0, converted.stderr
    assert sneppx("validate", f"{root}/step-000000200").returncode == 0
    missing = sneppx("inspect", f"{root}/step-000000300")
    assert missing.returncode == 1 and "CheckpointNotFoundError" in missing.stderr
    whole_root = sneppx("diff", root, f"{root}/step-000000100")
    assert whole_root.returncode == 2 and "sneppx ls" in whole_root.stderr
