"""The small pure helpers behind the `sneppx` subcommands: sizes, ages, step-like names, progress bars."""

from __future__ import annotations

import datetime
import io
import sys

import pytest

from SneppX_ALG import storage
from SneppX_ALG.cli import output


def test_sizes_parse_like_people_write_them() -> None:
    assert output.parse_size("5GB") == 5 * 10**9 and output.parse_size("1.5KiB") == 1536
    assert output.parse_size("1000") == 1000 and output.parse_size(" 2 mib ") == 2 << 20
    for bad in ("lots", "5 GBs", "-1GB", ""):
        with pytest.raises(ValueError):
            output.parse_size(bad)


def test_ages_read_from_a_manifest_time() -> None:
    now = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    assert output.age("2026-01-02T03:04:00+00:00", now) == "5s"
    assert output.age("2026-01-02T01:00:00+00:00", now) == "2h 4m"
    assert output.age("2025-12-30T03:04:05+00:00", now) == "3d 0h"
    assert output.age(None, now) == "?" and output.age("yesterday", now) == "?"
    assert output.age("2026-01-03T00:00:00+00:00", now) == "in the future"


def test_step_like_names_of_a_root() -> None:
    assert storage.classify_entry("step-000000100") == (100, "committed")
    assert storage.classify_entry(".tmp-step-000000100-w-host-1-2") == (100, "uncommitted")
    assert storage.classify_entry(".deleting-step-000000100-ab") == (100, "deleting")
    assert storage.classify_entry(".abandoned-step-000000100-ab") == (100, "set-aside")
    assert storage.classify_entry(".invalid-step-000000007-ff") == (7, "set-aside")
    for other in ("step-00000010", "step-000000100x", ".lease-w", "FENCE", "manifest.json", ".tmp-step-"):
        assert storage.classify_entry(other) is None, other


def test_s3_step_locations_split_into_root_and_step() -> None:
    assert output.split_step_uri("s3://b/jobs/a/step-000000100") == ("s3://b/jobs/a", 100)
    assert output.split_step_uri("s3://b/step-000000100/") == ("s3://b", 100)
    assert output.split_step_uri("s3://b/jobs/a") is None and output.split_step_uri("/x/step-000000100") is None


def test_a_progress_bar_only_on_a_terminal_and_for_big_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with output.progress_bar("x", 10 << 30) as progress:
        assert progress is None  # not a terminal
    monkeypatch.setattr(sys, "stderr", Terminal())
    with output.progress_bar("x", 1 << 20) as progress:
        assert progress is None  # too small to need one
    with output.progress_bar("x", 10 << 30, enabled=False) as progress:
        assert progress is None  # --json
    with output.progress_bar("x", 10 << 30) as progress:
        assert progress is not None
        progress(5 << 30, 10 << 30)
