"""The `sneppx` console script as a user runs it: exit codes, JSON output, the inspect table."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import google_crc32c
import numpy as np
import pytest

from SneppX_ALG import CheckpointWriter
from SneppX_ALG.checkpoint import format


def sneppx(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("sneppx", path=str(pathlib.Path(sys.executable).parent))
    assert exe, "the sneppx console script is installed with the package"
    return subprocess.run([exe, *args], capture_output=True, text=True, check=False, timeout=120)


@pytest.fixture
def good(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "good.snpx"
    with CheckpointWriter(path, metadata={"run": "cli", "step": "42"}, config={"dim": 8}) as w:
        w.write("layer0.w", np.ones((8, 16), np.float32))
        w.write("layer0.b", np.zeros(16, np.float16))
    return path


def test_validate_exit_codes_and_json(good: pathlib.Path, tmp_path: pathlib.Path) -> None:
    assert sneppx("validate", str(good)).returncode == 0
    bad = tmp_path / "bad.snpx"
    blob = bytearray(good.read_bytes())
    blob[4096] ^= 0xFF
    bad.write_bytes(blob)
    result = sneppx("validate", str(good), str(bad), "--json")
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert [r["ok"] for r in report] == [True, False]
    assert "layer0.w" in report[1]["errors"][0] and "CRC32C" in report[1]["errors"][0]
    human = sneppx("validate", str(bad), str(tmp_path / "missing.snpx"))
    assert human.returncode == 1 and "INVALID" in human.stdout and "file not found" in human.stdout


def test_inspect_shows_tensors_and_metadata(good: pathlib.Path) -> None:
    result = sneppx("inspect", str(good))
    assert result.returncode == 0, result.stderr
    for expected in ("layer0.w", "float32", "8x16", "512 B", "float16", "step", "42", "unsigned"):
        assert expected in result.stdout
    info = json.loads(sneppx("inspect", str(good), "--json").stdout)
    assert info["tensors"][0] == {"name": "layer0.w", "dtype": "float32", "shape": [8, 16], "bytes": 512,
                                  "offset": 4096, "crc32c": info["tensors"][0]["crc32c"]}
    assert info["metadata"] == {"run": "cli", "step": "42"} and info["config"] == {"dim": 8}


def test_inspect_json_offsets_and_crcs_match_values_computed_independently(good: pathlib.Path) -> None:
    """Offsets from the layout rule of docs/FORMAT.md (tensor 0 at 4096, the next at the following 4096
    boundary), CRC32Cs from another implementation (google-crc32c) over the arrays the fixture wrote."""
    w, b = np.ones((8, 16), np.float32), np.zeros(16, np.float16)
    info = json.loads(sneppx("inspect", str(good), "--json").stdout)
    assert [{k: t[k] for k in ("name", "offset", "bytes", "crc32c")} for t in info["tensors"]] == [
        {"name": "layer0.w", "offset": 4096, "bytes": 512, "crc32c": f"{google_crc32c.value(w.tobytes()):08x}"},
        {"name": "layer0.b", "offset": 8192, "bytes": 32, "crc32c": f"{google_crc32c.value(b.tobytes()):08x}"},
    ]
    assert info["file_bytes"] == good.stat().st_size and info["version"] == "1.0" and info["signed"] is False


def test_sign_of_a_table_with_a_lone_surrogate_exits_1_with_a_message(tmp_path: pathlib.Path) -> None:
    """Another tool wrote metadata "\\ud800" (valid JSON, not UTF-8 text): refused with a typed error, not a
    UnicodeEncodeError traceback from re-encoding the table, and the file is left as it was."""
    table = b'{"tensors":[],"metadata":{"note":"\\ud800"},"config":null}'
    header = format.Header(file_size=format.DATA_OFFSET + len(table), table_offset=format.DATA_OFFSET,
                           table_length=len(table), table_crc32c=google_crc32c.value(table))
    path = tmp_path / "other-tool.snpx"
    path.write_bytes(format.encode_header(header).ljust(format.DATA_OFFSET, b"\0") + table)
    before = path.read_bytes()
    key = tmp_path / "k.pem"
    assert sneppx("keygen", str(key)).returncode == 0
    result = sneppx("sign", str(path), "--key", str(key))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("sneppx sign: CorruptTableError") and "not valid Unicode" in result.stderr
    assert path.read_bytes() == before


def test_inspect_bad_file_exits_1_with_reason(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "x.ckpt"
    path.write_bytes(b"\x80\x04garbage")
    result = sneppx("inspect", str(path))
    assert result.returncode == 1 and "pickle" in result.stderr


def test_seed_recipe_4_validate_a_checkpoint(good: pathlib.Path) -> None:
    # Recipe 4 of the seed, as written, on a file from CheckpointWriter (in a fresh interpreter).
    code = (f"from SneppX_ALG import validate_checkpoint\n"
            f"ok, errors = validate_checkpoint({str(good)!r})\n"
            f"print(ok, errors)    # True []\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=60)
    assert out.stdout.strip() == "True []", out.stderr


def test_validate_with_an_unreadable_trusted_key_exits_2(good: pathlib.Path, tmp_path: pathlib.Path) -> None:
    bad_key = tmp_path / "not-a-key.pem"
    bad_key.write_text("hello")
    result = sneppx("validate", str(good), "--trusted-key", str(bad_key))
    assert result.returncode == 2 and "Traceback" not in result.stderr and result.stderr.startswith("sneppx validate")
