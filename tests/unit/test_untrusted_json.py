"""JSON someone else wrote is measured before it is parsed (native/src/json_scan.c, SneppX_ALG.untrusted): the
scan's counts are the parser's, and a table that would cost many times its size to parse is refused unparsed."""

from __future__ import annotations

import json
import pathlib
import tracemalloc
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from SneppX_ALG import _native, checkpoint, errors, untrusted
from SneppX_ALG.checkpoint import format

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner), max_leaves=40)


def containers_and_depth(value: Any) -> tuple[int, int]:
    if isinstance(value, (list, dict)):
        children = [containers_and_depth(v) for v in (value.values() if isinstance(value, dict) else value)]
        return 1 + sum(c for c, _ in children), 1 + max((d for _, d in children), default=0)
    return 0, 0


@given(JSON, st.booleans())
def test_the_scan_counts_what_the_parser_builds(value: Any, ascii_only: bool) -> None:
    """Strings hold brackets, quotes and backslashes (hypothesis' text() finds them): none is counted."""
    raw = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert _native.json_shape(raw, 4096) == containers_and_depth(value)


@given(st.binary(max_size=200))
def test_any_bytes_scan_to_counts_or_none_and_valid_json_always_scans(raw: bytes) -> None:
    shape = _native.json_shape(raw, 64)
    try:
        value = json.loads(raw)
    except ValueError:
        return
    assert shape == containers_and_depth(value) or (shape is not None and shape[1] == 65)


@pytest.mark.parametrize(("raw", "shape"), [
    (b'"\\"', None),            # the escaped quote leaves the string open
    (b'"\\', None),             # a backslash at the end
    (b"[}", None),              # mismatched
    (b"]", None),
    (b"[[", None),
    (b'["]"]', (1, 1)),         # a bracket in a string is not a container
    (b"[" * 70 + b"]" * 70, (64, 65)),  # stops one past max_depth
])
def test_scan_edges(raw: bytes, shape: tuple[int, int] | None) -> None:
    assert _native.json_shape(raw, 64) == shape


def write_table_file(path: pathlib.Path, raw: bytes) -> None:
    header = format.Header(file_size=format.DATA_OFFSET + len(raw), table_offset=format.DATA_OFFSET,
                           table_length=len(raw), table_crc32c=_native.crc32c(raw))
    with open(path, "wb") as f:
        f.write(format.encode_header(header))
        f.write(bytes(format.DATA_OFFSET - format.HEADER_SIZE))
        f.write(raw)


def peak_bytes(fn: Any) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_16_mib_table_of_empty_objects_is_refused_unparsed(tmp_path: pathlib.Path) -> None:
    """Parsed, it would cost ~25x its size (about 400 MiB); refused, it costs its one read."""
    raw = b'{"tensors":[' + b",".join([b"{}"] * ((16 << 20) // 3)) + b'],"metadata":{},"config":null}'
    path = tmp_path / "dense.snpx"
    write_table_file(path, raw)
    results: list[tuple[bool, list[str]]] = []
    peak = peak_bytes(lambda: results.append(checkpoint.validate_checkpoint(path)))
    ok, problems = results[0]
    assert not ok and "objects and arrays" in problems[0], problems
    assert peak < 2 * len(raw), f"peak {peak / len(raw):.1f}x the table"


def test_a_valid_16_mib_table_validates_within_a_small_multiple_of_its_size(tmp_path: pathlib.Path) -> None:
    """190,000 empty tensors: every entry parsed and checked, memory about 6x the table (docs/FORMAT.md)."""
    tensors = tuple(format.TensorEntry(f"layers.{i:07d}.weight", "uint8", (0,), format.DATA_OFFSET, 0, 0)
                    for i in range(190_000))
    raw = format.encode_table(format.Table(tensors=tensors))
    assert len(raw) > 15 << 20
    path = tmp_path / "many.snpx"
    write_table_file(path, raw)
    results: list[tuple[bool, list[str]]] = []
    peak = peak_bytes(lambda: results.append(checkpoint.validate_checkpoint(path)))
    assert results[0] == (True, [])
    assert peak < 10 * len(raw), f"peak {peak / len(raw):.1f}x the table"


def test_a_writer_refuses_what_readers_refuse() -> None:
    dense = {"layers": [[] for _ in range(100)]}
    with pytest.raises(errors.LimitExceededError, match="objects and arrays"):
        format.encode_table(format.Table(tensors=(), config=dense))
    untrusted.check_json_cost(json.dumps({"layers": [[1, 2, 3, 4, 5]] * 100}).encode(), what="x", max_depth=8)

