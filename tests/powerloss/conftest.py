"""Fixtures of the power-loss tests: the recording shim, compiled once per session."""

from __future__ import annotations

import pathlib

import oplog
import pytest


@pytest.fixture(scope="session")
def recorder_shim(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return oplog.build_shim(tmp_path_factory.mktemp("recorder"))
