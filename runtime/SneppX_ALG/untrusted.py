"""JSON someone else wrote: what parsing it would cost, refused before it is parsed.

Python's json module builds a whole document before its caller sees any of it, recursing once per level of
nesting, and an empty object or array costs it 20-30 times its bytes. Every reader of bytes another process wrote
(a checkpoint's table, a manifest, a commit marker, an update envelope, a record) calls `check_json_cost` on them
first: their nesting and their number of objects and arrays per byte are measured without parsing
(native/src/json_scan.c, one pass), so a hostile document costs that pass, not memory many times its size.
docs/FORMAT.md, "Limits and errors", has the figures.
"""

from __future__ import annotations

import math
from typing import Any

from SneppX_ALG import _native, errors

# Real documents hold far fewer: a tensor entry is at least 75 bytes for at most 4 objects and arrays.
BYTES_PER_CONTAINER = 16
FREE_CONTAINERS = 16  # so that small documents ("{}", a record's few fields) always pass


def check_json_cost(raw: bytes | bytearray | memoryview, *, what: str, max_depth: int,
                    limit: type[errors.SneppXError] = errors.LimitExceededError,
                    malformed: type[errors.SneppXError] = errors.CorruptTableError, dense_ok: bool = False,
                    **where: Any) -> None:
    """Raises `limit` for a document nested deeper than max_depth or (unless dense_ok) with more objects and
    arrays than one per BYTES_PER_CONTAINER bytes (plus FREE_CONTAINERS), `malformed` when its brackets don't
    balance or a string never ends; `where` goes to the error (path=, for example).

    dense_ok: for documents that carry a user's own JSON in any shape (a step manifest's training state): their
    parse still costs memory in proportion to their bytes (at most about 30x), and their size is capped."""
    shape = _native.json_shape(raw, max_depth)
    if shape is None:
        raise malformed(f"{what} is not valid JSON (brackets that don't balance or match, or a string that never "
                        "ends)", **where)
    containers, depth = shape
    if depth > max_depth:
        raise limit(f"{what} nests deeper than {max_depth}", **where)
    allowed = FREE_CONTAINERS + len(raw) // BYTES_PER_CONTAINER
    if containers > allowed and not dense_ok:
        raise limit(f"{what} holds {containers} objects and arrays in {len(raw)} bytes, more than one per "
                    f"{BYTES_PER_CONTAINER} bytes ({allowed}): refused before parsing, whose memory would be many "
                    "times its size", **where)


def finite_float(text: str) -> float:
    """json.loads' parse_float for documents that must be written again: a number too large for a double (1e999)
    parses to infinity, which JSON can't hold, so it is refused as a ValueError like any other bad JSON."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value
