"""Choosing O_DIRECT or buffered writes per filesystem (checkpoint/write_mode.py): overrides, the probe, its cache.

The probe writes real files through the native writer (made small here); what it measures is never asserted,
only that it ran once, chose one of the two, and that the choice is what later saves use.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator

import numpy as np
import pytest

from SneppX_ALG import _native, checkpoint
from SneppX_ALG.checkpoint import write_mode
from SneppX_ALG.contract.env import ENV_WRITE_MODE


@pytest.fixture
def auto(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> Iterator[list[str]]:
    """Auto mode with a cache under tmp_path and a 1 MiB probe; yields the directories probed."""
    monkeypatch.setenv(ENV_WRITE_MODE, "auto")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(write_mode, "PROBE_BYTES", 1 << 20)
    probed: list[str] = []
    real_probe = write_mode.probe

    def counting_probe(directory: str, key: str = "") -> write_mode.Probe:
        probed.append(directory)
        return real_probe(directory, key)

    monkeypatch.setattr(write_mode, "probe", counting_probe)
    write_mode.forget()
    yield probed
    write_mode.forget()


def test_the_first_save_probes_and_later_saves_and_processes_reuse_the_choice(
        auto: list[str], tmp_path: pathlib.Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    choice = write_mode.use_direct(str(data))
    assert auto == [str(data)]
    assert list(data.iterdir()) == [], "the probe files are removed"
    entries = json.loads(pathlib.Path(write_mode.cache_path()).read_text())
    entry = entries[write_mode.filesystem_key(str(data))]
    assert entry["mode"] == ("direct" if choice else "buffered")
    assert entry["direct_gbps"] > 0 and entry["buffered_gbps"] > 0

    assert write_mode.use_direct(str(data)) == choice  # this process remembers
    write_mode.forget()  # as a new process: the cache file answers
    assert write_mode.use_direct(str(data)) == choice
    assert len(auto) == 1, "probed again although the choice was cached"


def test_the_cached_choice_is_what_a_checkpoint_writer_uses(auto: list[str], tmp_path: pathlib.Path) -> None:
    key = write_mode.filesystem_key(str(tmp_path))
    for mode in ("buffered", "direct"):
        path = pathlib.Path(write_mode.cache_path())
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({key: {"mode": mode}}))
        write_mode.forget()
        writer = checkpoint.CheckpointWriter(tmp_path / f"{mode}.snpx")
        writer.open()
        assert writer._file is not None and writer._file.is_direct == (mode == "direct")
        writer.abort()
    assert auto == []


def test_a_damaged_cache_file_is_probed_over_and_rewritten(auto: list[str], tmp_path: pathlib.Path) -> None:
    path = pathlib.Path(write_mode.cache_path())
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\x00not json")
    write_mode.use_direct(str(tmp_path))
    assert len(auto) == 1
    assert write_mode.filesystem_key(str(tmp_path)) in json.loads(path.read_text())


def test_the_argument_beats_the_environment_which_beats_the_probe(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: pathlib.Path) -> None:
    def no_probe(*args: object) -> write_mode.Probe:
        raise AssertionError("probed although the mode was given")

    monkeypatch.setattr(write_mode, "probe", no_probe)
    write_mode.forget()
    for env, expected in (("direct", True), ("buffered", False), (" Buffered ", False)):
        monkeypatch.setenv(ENV_WRITE_MODE, env)
        assert write_mode.use_direct(str(tmp_path)) is expected
        assert write_mode.use_direct(str(tmp_path), direct=not expected) is (not expected)


def test_an_unknown_mode_in_the_environment_is_a_clear_error(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv(ENV_WRITE_MODE, "fast")
    with pytest.raises(ValueError, match="SNEPPX_WRITE_MODE='fast': choose one of direct, buffered, auto"):
        checkpoint.CheckpointWriter(tmp_path / "x.snpx").open()
    assert list(tmp_path.iterdir()) == []


def test_a_probe_that_fails_falls_back_to_o_direct_and_is_not_remembered(auto: list[str],
                                                                         tmp_path: pathlib.Path) -> None:
    _native.fault_arm("write", 1, "ENOSPC")  # the disk is full
    try:
        assert write_mode.use_direct(str(tmp_path)) is True
    finally:
        _native.fault_arm("write", 0, "kill")
    assert [p for p in tmp_path.iterdir() if p.name != "cache"] == [], "a failed probe left its file behind"
    assert not pathlib.Path(write_mode.cache_path()).exists() or write_mode.filesystem_key(str(tmp_path)) not in \
        json.loads(pathlib.Path(write_mode.cache_path()).read_text())
    write_mode.forget()
    write_mode.use_direct(str(tmp_path))
    assert len(auto) == 2, "the failed probe's fallback was remembered"


def test_the_filesystem_key_names_the_type_and_device(tmp_path: pathlib.Path) -> None:
    key = write_mode.filesystem_key(str(tmp_path))
    major_minor, fstype, *_ = key.split()
    assert ":" in major_minor and fstype  # e.g. "254:0 ext4 /dev/vda", "0:38 tmpfs tmpfs"


def test_a_checkpoint_written_in_either_mode_reads_back(tmp_path: pathlib.Path) -> None:
    state = {f"t{i}": np.random.default_rng(i).standard_normal(300_000 + i).astype(np.float32) for i in range(4)}
    for direct in (True, False):
        path = tmp_path / f"{direct}.snpx"
        with checkpoint.CheckpointWriter(path, direct=direct) as w:
            for name, array in state.items():
                w.write(name, array)
        assert checkpoint.validate_checkpoint(path) == (True, [])
        with checkpoint.CheckpointReader(path) as r:
            for name, array in state.items():
                np.testing.assert_array_equal(r.read(name), array)
