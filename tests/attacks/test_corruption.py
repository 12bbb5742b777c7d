"""Accidental damage to a valid file: every truncation and every header/table bit flip is detected.

A checkpoint must never load wrong bytes silently and must never crash the reader: each case below gives a
`CheckpointFormatError` from the reader and `(False, [...])` from validate_checkpoint.
"""

from __future__ import annotations

import os
import pathlib
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from SneppX_ALG import checkpoint, errors
from SneppX_ALG.checkpoint import format


@pytest.fixture(scope="module")
def small_file(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("small") / "small.snpx"
    with checkpoint.CheckpointWriter(path, metadata={"run": "corruption", "step": "7"}, config={"dim": 4}) as w:
        w.write("w", np.arange(12, dtype=np.float32).reshape(3, 4))
        w.write("b", np.array([1, -2, 3], dtype=np.int64))
        w.write("flag", np.array(True))
    return path.read_bytes()


def load_everything(path: pathlib.Path) -> None:
    with checkpoint.CheckpointReader(path) as reader:
        for name in reader.names():
            reader.read(name)


def assert_rejected(path: pathlib.Path, what: str) -> None:
    with pytest.raises(errors.CheckpointFormatError):
        load_everything(path)
    ok, problems = checkpoint.validate_checkpoint(path)
    assert not ok and problems, what


def write_byte(path: pathlib.Path, pos: int, value: int) -> None:
    """Changes one byte of the file in place. The cases below damage one file and undo the damage, as
    test_signature_attacks does, rather than rewrite it whole: on ext4 a rewrite that truncates a file flushes it
    at close (auto_da_alloc), about 4 ms a case against microseconds, most of this module's time."""
    with open(path, "r+b") as f:
        f.seek(pos)
        f.write(bytes([value]))


def test_truncation_at_every_length_is_detected(small_file: bytes, tmp_path: pathlib.Path) -> None:
    path = _write(tmp_path / "cut.snpx", small_file)
    for length in reversed(range(len(small_file))):  # each cut from the one before: the file is small_file[:length]
        os.truncate(path, length)
        assert_rejected(path, f"truncated to {length} bytes")


def test_every_bit_flip_in_header_and_table_is_detected(small_file: bytes, tmp_path: pathlib.Path) -> None:
    header = format.decode_header(small_file[:64], actual_size=len(small_file))
    positions = list(range(format.DATA_OFFSET)) + list(range(header.table_offset, len(small_file)))
    path = _write(tmp_path / "flip.snpx", small_file)
    for pos in positions:
        for bit in range(8):
            write_byte(path, pos, small_file[pos] ^ (1 << bit))
            assert_rejected(path, f"bit {bit} of byte {pos}")
        write_byte(path, pos, small_file[pos])


def test_every_padding_byte_is_checked(small_file: bytes, tmp_path: pathlib.Path) -> None:
    header = format.decode_header(small_file[:64], actual_size=len(small_file))
    path = _write(tmp_path / "pad.snpx", small_file)
    with checkpoint.CheckpointReader(_write(tmp_path / "ok.snpx", small_file)) as reader:
        entries = list(reader.table.tensors)
    for entry in entries:
        end = entry.offset + entry.length
        for pos in range(end, format.align_up(end), 97):
            write_byte(path, pos, 0x5A)
            assert_rejected(path, f"padding byte {pos}")
            write_byte(path, pos, small_file[pos])
    assert header.table_offset == format.align_up(entries[-1].offset + entries[-1].length)


def _write(path: pathlib.Path, blob: bytes) -> pathlib.Path:
    path.write_bytes(blob)
    return path


def test_seeded_sample_of_data_bit_flips_in_a_larger_file_is_detected(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "big.snpx"
    rng = np.random.default_rng(1234)
    with checkpoint.CheckpointWriter(path) as w:
        for i in range(4):
            w.write(f"layer{i}", rng.standard_normal((256, 1024), dtype=np.float32))
    blob = path.read_bytes()
    with checkpoint.CheckpointReader(path) as reader:
        ranges = [(t.offset, t.offset + t.length) for t in reader.table.tensors]
    picker = random.Random(99)
    damaged_path = _write(tmp_path / "damaged.snpx", blob)
    for _ in range(300):
        start, end = picker.choice(ranges)
        pos, bit = picker.randrange(start, end), picker.randrange(8)
        write_byte(damaged_path, pos, blob[pos] ^ (1 << bit))
        ok, problems = checkpoint.validate_checkpoint(damaged_path)
        assert not ok and "CRC32C" in problems[0], (pos, bit, problems)
        write_byte(damaged_path, pos, blob[pos])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(min_value=0), st.integers(min_value=0, max_value=255)),
                      min_size=1, max_size=8),
       cut=st.one_of(st.none(), st.integers(min_value=0)),
       tail=st.binary(max_size=64))
def test_fuzz_parser_never_crashes(small_file: bytes, tmp_path: pathlib.Path, edits: list[tuple[int, int]],
                                   cut: int | None, tail: bytes) -> None:
    blob = bytearray(small_file)
    for pos, value in edits:
        blob[pos % len(blob)] = value
    if cut is not None:
        blob = blob[: cut % (len(blob) + 1)]
    blob += tail
    path = tmp_path / "fuzz.snpx"
    path.write_bytes(bytes(blob))
    try:
        load_everything(path)
        loaded = True
    except errors.CheckpointFormatError:
        loaded = False
    ok, problems = checkpoint.validate_checkpoint(path)
    assert ok == loaded
    # every byte is covered by a check: the file loads if and only if it is unchanged
    assert ok == (bytes(blob) == small_file), problems


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=0, max_size=9000))
def test_fuzz_arbitrary_bytes_are_rejected(blob: bytes) -> None:
    try:
        format.decode_header(blob[:64], actual_size=len(blob))
    except errors.CheckpointFormatError:
        return
    pytest.fail("random bytes decoded as an SNPX header")
