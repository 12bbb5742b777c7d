"""`sneppx validate | inspect`: is a checkpoint whole, and what is in it.

Both take an SNPX file or a step directory (`<root>/step-000001000`, or `s3://bucket/prefix/step-N`);
`inspect` also shows safetensors checkpoints (a file, or shards with their index).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from SneppX_ALG import errors
from SneppX_ALG.checkpoint import manifest as manifest_codec
from SneppX_ALG.checkpoint import signing, tensors, validate
from SneppX_ALG.cli import output


def add_cli_commands(subparsers: Any) -> None:
    p = subparsers.add_parser("validate", help="check every byte of checkpoints (exit 0 if all valid)")
    p.add_argument("paths", nargs="+", metavar="PATH", help="SNPX file or step directory (local or s3://)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--trusted-key", action="append", metavar="PEM",
                   help="also verify the signature against this public key (repeatable)")
    p.set_defaults(func=cmd_validate)

    p = subparsers.add_parser("inspect", help="tensors, dtypes, shapes, sizes and metadata of a checkpoint")
    p.add_argument("path", metavar="PATH", help="SNPX file, step directory (local or s3://), or safetensors")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)


def cmd_validate(args: argparse.Namespace) -> int:
    trusted = None
    if args.trusted_key:
        try:
            trusted = signing.trusted_key_set(args.trusted_key)  # the same key loading as `sneppx verify`
        except errors.KeyFormatError as e:
            print(f"sneppx validate: {e}", file=sys.stderr)
            return output.TROUBLE
    results = []
    for path in args.paths:
        try:
            with output.local_path(path) as local, output.progress_bar(  # files report progress; steps don't
                    path, output.file_size(local) if os.path.isfile(local) else 0, not args.json) as progress:
                ok, problems = validate.validate_checkpoint(local, trusted_keys=trusted, progress=progress)
        except (errors.SneppXError, OSError, ValueError) as e:
            ok, problems = False, [f"{type(e).__name__}: {e}"]
        results.append({"path": path, "ok": ok, "errors": problems})
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            print(f"{'OK     ' if r['ok'] else 'INVALID'} {r['path']}")
            for problem in r["errors"]:
                print(f"        - {problem}")
    return output.OK if all(r["ok"] for r in results) else output.INVALID


def cmd_inspect(args: argparse.Namespace) -> int:
    try:
        with output.local_path(args.path) as local, tensors.open_tensors(local) as found:
            info = _snpx_info(args.path, found) if isinstance(found, tensors.SnpxTensors) else \
                _step_info(args.path, found) if isinstance(found, tensors.StepTensors) else \
                _safetensors_info(args.path, found)
    except (errors.SneppXError, OSError, ValueError) as e:
        output.fail("inspect", e)
        return output.INVALID
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print(info)
    return output.OK


def _entry_json(t: Any) -> dict[str, Any]:
    return {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.length, "offset": t.offset,
            "crc32c": f"{t.crc32c:08x}",
            **({"global_shape": list(t.global_shape), "global_offset": list(t.global_offset or ())}
               if t.global_shape is not None else {})}


def _snpx_info(path: str, found: tensors.SnpxTensors) -> dict[str, Any]:
    reader = found.reader
    h = reader.header
    return {"path": path, "kind": "snpx", "version": f"{h.version_major}.{h.version_minor}",
            "file_bytes": h.file_size, "signed": h.signature_length > 0,
            "tensors": [_entry_json(t) for t in reader.table.tensors], "metadata": reader.metadata,
            "config": reader.config}


def _step_info(path: str, found: tensors.StepTensors) -> dict[str, Any]:
    m = found.manifest
    shards = []
    for name, reader in zip(m["shards"], found.readers, strict=True):
        shards.append({"name": name, "file_bytes": reader.header.file_size,
                       "signed": reader.header.signature_length > 0, "metadata": reader.metadata,
                       "tensors": [_entry_json(t) for t in reader.table.tensors]})
    referenced: dict[tuple[int, str], dict[str, Any]] = {}
    for tensor in m["tensors"]:
        for chunk in manifest_codec.parts_of(tensor):
            ref = manifest_codec.reference(chunk)
            if ref is not None:
                row = referenced.setdefault(ref, {"step": ref[0], "file": ref[1], "entries": [], "bytes": 0})
                row["entries"].append(chunk["entry"])
                row["bytes"] += chunk["nbytes"]
    return {"path": path, "kind": "step", "step": found.step, "created": m.get("created"),
            "uses": list(m.get("uses") or []), "logical_bytes": sum(t["nbytes"] for t in m["tensors"]),
            "referenced": [referenced[k] for k in sorted(referenced)],
            "state_kind": m.get("kind"), "world_size": m.get("world_size"),
            "signed": "files" in m, "training_state": found.training_state, "values": found.values,
            "tensors": [{"name": name, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes,
                         "pieces": len(manifest_codec.parts_of(found._tensors[name]))} for name, t in found.info.items()],
            "shards": shards}


def _safetensors_info(path: str, found: tensors.TensorSet) -> dict[str, Any]:
    assert isinstance(found, tensors.SafetensorsTensors)
    return {"path": path, "kind": "safetensors", "metadata": found.metadata,
            "index_metadata": found.index.get("metadata") if found.index is not None else None,
            "tensors": [{"name": name, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes,
                         "file": found.weight_map[name]} for name, t in found.info.items()]}


def _shape(t: dict[str, Any]) -> str:
    shape = "x".join(map(str, t["shape"])) or "scalar"
    if "global_shape" in t:
        shape += f" (shard of {'x'.join(map(str, t['global_shape']))} at {t['global_offset']})"
    return shape


def _print(info: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    kind = info["kind"]
    if kind == "snpx":
        console.print(f"[bold]{info['path']}[/bold]  SNPX {info['version']}, {output.human(info['file_bytes'])}, "
                      f"{len(info['tensors'])} tensors, {'signed' if info['signed'] else 'unsigned'}")
        table = Table("name", "dtype", "shape", "size", "crc32c")
        for t in info["tensors"]:
            table.add_row(t["name"], t["dtype"], _shape(t), output.human(t["bytes"]), t["crc32c"])
    elif kind == "step":
        size = sum(s["file_bytes"] for s in info["shards"])
        console.print(f"[bold]{info['path']}[/bold]  step {info['step']}, {len(info['shards'])} shard(s), "
                      f"{output.human(size)}, {len(info['tensors'])} tensors, "
                      f"{'signed' if info['signed'] else 'unsigned'}, created {info['created']} "
                      f"({output.age(info['created'])} ago)")
        console.print("training state:", json.dumps(info["training_state"], sort_keys=True)[:2000])
        if info["values"]:
            console.print("values:", json.dumps(info["values"], sort_keys=True)[:2000])
        table = Table("tensor", "dtype", "shape", "size", "pieces")
        for t in info["tensors"]:
            table.add_row(t["name"], t["dtype"], _shape(t), output.human(t["bytes"]), str(t["pieces"]))
        console.print(table)
        for ref in info["referenced"]:
            console.print(f"{len(ref['entries'])} unchanged entries ({output.human(ref['bytes'])}) referenced in "
                          f"step {ref['step']}'s {ref['file']}")
        for shard in info["shards"]:
            table = Table("entry", "dtype", "shape", "size", "crc32c",
                          title=f"{shard['name']}: {output.human(shard['file_bytes'])}, "
                                f"{'signed' if shard['signed'] else 'unsigned'}")
            for t in shard["tensors"]:
                table.add_row(t["name"], t["dtype"], _shape(t), output.human(t["bytes"]), t["crc32c"])
            console.print(table)
        return
    else:
        console.print(f"[bold]{info['path']}[/bold]  safetensors, {len(info['tensors'])} tensors in "
                      f"{len({t['file'] for t in info['tensors']})} file(s)")
        table = Table("name", "dtype", "shape", "size", "file")
        for t in info["tensors"]:
            size = output.human(t["bytes"]) if t["bytes"] >= 0 else "?"
            table.add_row(t["name"], t["dtype"], _shape(t), size, t["file"])
    console.print(table)
    if info.get("metadata"):
        meta = Table("metadata key", "value")
        for k, v in sorted(info["metadata"].items()):
            meta.add_row(k, v if len(v) <= 120 else v[:117] + "...")
        console.print(meta)
    if info.get("config") is not None:
        console.print("config:", json.dumps(info["config"], sort_keys=True)[:2000])
