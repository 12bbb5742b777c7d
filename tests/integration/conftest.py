"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def launched() -> Iterator[list[Any]]:
    """Where a test puts the training runs it starts (elastic_script.Run and its kin): any of their processes
    still there when the test ends, passed or failed, is killed."""
    started: list[Any] = []
    yield started
    for run in started:
        if run.proc.poll() is None or run.processes():
            run.kill()
