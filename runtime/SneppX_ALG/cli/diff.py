"""`sneppx diff A B`: which tensors two checkpoints add, remove or change.

A and B are anything `sneppx inspect` takes (SNPX files, step directories local or on S3, safetensors), so
`diff model.safetensors model.snpx` checks a conversion and `diff step-000001000 step-000002000` shows what
training changed. Tensors are compared bit for bit; a changed one reports its largest absolute difference
and how many elements differ. Exit 0 when A and B hold the same tensors, 1 when they differ, 2 when one
can't be read (like diff(1)).
"""

from __future__ import annotations

import argparse
import contextlib
import json
from typing import Any

import numpy as np

from SneppX_ALG import errors
from SneppX_ALG.checkpoint import tensors
from SneppX_ALG.cli import output


def add_cli_commands(subparsers: Any) -> None:
    p = subparsers.add_parser("diff", help="tensors added, removed and changed between two checkpoints "
                                           "(exit 0 same, 1 different, 2 unreadable)")
    p.add_argument("a", metavar="A", help="SNPX file, step directory (local or s3://), or safetensors")
    p.add_argument("b", metavar="B")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_diff)


def compare(a: np.ndarray, b: np.ndarray) -> dict[str, Any] | None:
    """None when two arrays of one dtype and shape hold the same bits, else how they differ."""
    if a.tobytes() == b.tobytes():
        return None
    if a.dtype.kind == "b" or a.dtype.kind in "iu":
        wide_a, wide_b = a.astype(np.float64 if a.dtype.kind == "b" else np.int64), b.astype(
            np.float64 if b.dtype.kind == "b" else np.int64)
    else:
        wide_a, wide_b = a.astype(np.complex128 if a.dtype.kind == "c" else np.float64), b.astype(
            np.complex128 if b.dtype.kind == "c" else np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        delta = np.abs(wide_a - wide_b)
    bits_differ = a.reshape(-1).view(np.uint8).reshape(a.size, -1) != b.reshape(-1).view(np.uint8).reshape(
        b.size, -1) if a.size else np.zeros((0, 1), bool)
    changed = int(bits_differ.any(axis=1).sum())
    finite = delta[np.isfinite(delta)]
    return {"max_abs_diff": float(finite.max()) if finite.size else None, "elements_changed": changed,
            "elements": int(a.size)}


def diff(a: tensors.TensorSet, b: tensors.TensorSet, progress: Any = None) -> dict[str, Any]:
    """The differences between two opened checkpoints (tensors read one pair at a time)."""
    added = [n for n in b.info if n not in a.info]
    removed = [n for n in a.info if n not in b.info]
    changed: list[dict[str, Any]] = []
    same = 0
    common = [n for n in a.info if n in b.info]
    total = sum(a.info[n].nbytes + b.info[n].nbytes for n in common)
    done = 0
    for name in common:
        ta, tb = a.info[name], b.info[name]
        if (ta.dtype, ta.shape) != (tb.dtype, tb.shape):
            changed.append({"name": name, "a": {"dtype": ta.dtype, "shape": list(ta.shape)},
                            "b": {"dtype": tb.dtype, "shape": list(tb.shape)}})
        else:
            found = compare(a.read(name), b.read(name))
            if found is None:
                same += 1
            else:
                changed.append({"name": name, "dtype": ta.dtype, "shape": list(ta.shape), **found})
        done += ta.nbytes + tb.nbytes
        if progress is not None:
            progress(done, total)
    return {"a": a.path, "b": b.path,
            "added": [{"name": n, "dtype": b.info[n].dtype, "shape": list(b.info[n].shape)} for n in added],
            "removed": [{"name": n, "dtype": a.info[n].dtype, "shape": list(a.info[n].shape)} for n in removed],
            "changed": changed, "identical": same,
            "metadata_changed": sorted(k for k in set(a.metadata) | set(b.metadata)
                                       if a.metadata.get(k) != b.metadata.get(k)),
            "config_changed": a.config != b.config}


def cmd_diff(args: argparse.Namespace) -> int:
    try:
        with contextlib.ExitStack() as stack:
            a = stack.enter_context(tensors.open_tensors(stack.enter_context(output.local_path(args.a))))
            b = stack.enter_context(tensors.open_tensors(stack.enter_context(output.local_path(args.b))))
            total = a.total_bytes() + b.total_bytes()
            with output.progress_bar("diff", total, not args.json) as progress:
                report = diff(a, b, progress)
    except (errors.SneppXError, OSError, ValueError) as e:
        output.fail("diff", e)
        return output.TROUBLE
    report["a"], report["b"] = args.a, args.b
    differs = bool(report["added"] or report["removed"] or report["changed"] or report["metadata_changed"]
                   or report["config_changed"])
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return output.INVALID if differs else output.OK


def _shape(shape: list[int]) -> str:
    return "x".join(map(str, shape)) or "scalar"


def _print(report: dict[str, Any]) -> None:
    print(f"--- {report['a']}\n+++ {report['b']}")
    for t in report["removed"]:
        print(f"- {t['name']}  {t['dtype']} {_shape(t['shape'])}")
    for t in report["added"]:
        print(f"+ {t['name']}  {t['dtype']} {_shape(t['shape'])}")
    for t in report["changed"]:
        if "a" in t:
            print(f"~ {t['name']}  {t['a']['dtype']} {_shape(t['a']['shape'])} -> "
                  f"{t['b']['dtype']} {_shape(t['b']['shape'])}")
        else:
            biggest = "n/a (NaN or inf)" if t["max_abs_diff"] is None else f"{t['max_abs_diff']:.6g}"
            print(f"~ {t['name']}  {t['dtype']} {_shape(t['shape'])}  max |a-b| {biggest}, "
                  f"{t['elements_changed']} of {t['elements']} elements differ")
    for key in report["metadata_changed"]:
        print(f"~ metadata {key!r}")
    if report["config_changed"]:
        print("~ config")
    print(f"{report['identical']} tensor(s) identical, {len(report['changed'])} changed, "
          f"{len(report['added'])} added, {len(report['removed'])} removed")
