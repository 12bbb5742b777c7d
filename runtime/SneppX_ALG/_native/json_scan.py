"""The shape of a JSON document measured without parsing it (json_scan.c), so untrusted JSON is refused before the
parser meets its nesting."""

from __future__ import annotations

from typing import Any

from SneppX_ALG._native._lib import as_buffer, ffi, lib, raise_for


def json_shape(data: Any, max_depth: int) -> tuple[int, int] | None:
    """(objects and arrays, deepest nesting) of a JSON document, found without parsing it; the depth stops at
    max_depth + 1. None when its brackets don't balance or match or a string never ends (sx_json_scan)."""
    buf = as_buffer(data)
    out = ffi.new("sx_json_shape *")
    code = lib.sx_json_scan(buf, len(buf), max_depth, out)
    if code == lib.SX_EPROTO:
        return None
    raise_for(code, "json scan")
    return int(out.containers), int(out.depth)
