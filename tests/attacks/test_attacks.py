"""Hostile files: every one is rejected with the right typed error and a message a person can act on.

The artifacts are made by make_attacks.py and committed; expected.json says what each must raise.
"""

from __future__ import annotations

import json
import os
import pathlib
import tracemalloc

import pytest

from SneppX_ALG import checkpoint, errors

HERE = pathlib.Path(__file__).resolve().parent
EXPECTED = json.loads((HERE / "expected.json").read_text())


def load_everything(path: str) -> None:
    with checkpoint.CheckpointReader(path) as reader:
        for name in reader.names():
            reader.read(name)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_hostile_file_is_rejected_with_typed_error(name: str) -> None:
    path = str(HERE / f"{name}.snpx")
    want = EXPECTED[name]
    with pytest.raises(errors.CheckpointFormatError) as caught:
        load_everything(path)
    assert type(caught.value).__name__ == want["error"], f"{name}: got {caught.value!r}"
    assert want["message"].lower() in str(caught.value).lower()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_validate_reports_hostile_file_without_raising(name: str) -> None:
    ok, problems = checkpoint.validate_checkpoint(HERE / f"{name}.snpx")
    assert not ok
    assert problems and any(EXPECTED[name]["message"].lower() in p.lower() for p in problems), problems


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_hostile_file_allocates_no_more_than_its_size(name: str) -> None:
    path = HERE / f"{name}.snpx"
    tracemalloc.start()
    try:
        checkpoint.validate_checkpoint(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Parsed JSON objects cost more than their bytes; a length field trusted before it is bounded would cost GiBs.
    assert peak < (1 << 20) + 24 * os.path.getsize(path), f"{name}: peak {peak} bytes"


def test_pickle_is_refused_without_running_it(tmp_path: pathlib.Path) -> None:
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):  # what an attacker ships: code that runs on unpickling
            return (open, (str(marker), "w"))

    import pickle

    path = tmp_path / "model.ckpt"
    path.write_bytes(pickle.dumps(Payload()))
    with pytest.raises(errors.UnsafeFormatError, match="never loads pickles"):
        checkpoint.CheckpointReader(path)
    assert not marker.exists()
