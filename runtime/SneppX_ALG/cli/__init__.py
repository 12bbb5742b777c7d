"""The `sneppx` command line: look at and check checkpoints without writing Python.

    sneppx validate PATH... [--json]   exit 0 if every file is valid, 1 otherwise (2: unreadable --trusted-key)
    sneppx inspect PATH [--json]       tensors, dtypes, shapes, sizes and metadata
    sneppx keygen KEY.pem [--public P]  new Ed25519 key pair (KEY.pem.pub by default); exit 2 if KEY exists
    sneppx sign PATH --key KEY.pem     sign a checkpoint file or directory; exit 1 if it is invalid
    sneppx verify PATH... -k PUB.pem   signature and every byte; exit 0 if all valid, 1 if not, 2 bad key

Each subcommand is a small function over the library API; the library does the work.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from SneppX_ALG import errors
from SneppX_ALG.checkpoint import file, signing, validate
from SneppX_ALG.cli import keys

# Files smaller than this validate in well under a second: no progress bar.
_PROGRESS_MIN_BYTES = 256 << 20


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


@contextmanager
def _progress(path: str, enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A progress bar on stderr for big files when it is a terminal; None otherwise."""
    try:
        size = os.path.getsize(path)
    except OSError:
        size = 0
    if not enabled or size < _PROGRESS_MIN_BYTES or not sys.stderr.isatty():
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), transient=True) as bar:
        task = bar.add_task(os.path.basename(path), total=size)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def cmd_validate(args: argparse.Namespace) -> int:
    trusted = None
    if args.trusted_key:
        try:
            trusted = signing.trusted_key_set(args.trusted_key)  # the same key loading as `sneppx verify`
        except errors.KeyFormatError as e:
            print(f"sneppx validate: {e}", file=sys.stderr)
            return 2
    results = []
    for path in args.paths:
        with _progress(path, not args.json) as progress:
            ok, problems = validate.validate_checkpoint(path, trusted_keys=trusted, progress=progress)
        results.append({"path": path, "ok": ok, "errors": problems})
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            print(f"{'OK     ' if r['ok'] else 'INVALID'} {r['path']}")
            for problem in r["errors"]:
                print(f"        - {problem}")
    return 0 if all(r["ok"] for r in results) else 1


def cmd_inspect(args: argparse.Namespace) -> int:
    try:
        reader = file.CheckpointReader(args.path, verify=False)
    except errors.SneppXError as e:
        print(f"sneppx inspect: {e}", file=sys.stderr)
        return 1
    with reader:
        h = reader.header
        tensors = [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.length,
                    "offset": t.offset, "crc32c": f"{t.crc32c:08x}",
                    **({"global_shape": list(t.global_shape), "global_offset": list(t.global_offset or ())}
                       if t.global_shape is not None else {})} for t in reader.table.tensors]
        info = {"path": args.path, "version": f"{h.version_major}.{h.version_minor}", "file_bytes": h.file_size,
                "signed": h.signature_length > 0, "tensors": tensors, "metadata": reader.metadata,
                "config": reader.config}
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"[bold]{args.path}[/bold]  SNPX {info['version']}, {_human(h.file_size)}, "
                  f"{len(tensors)} tensors, {'signed' if info['signed'] else 'unsigned'}")
    table = Table("name", "dtype", "shape", "size", "crc32c")
    for t in tensors:
        shape = "x".join(map(str, t["shape"])) or "scalar"
        if "global_shape" in t:
            shape += f" (shard of {'x'.join(map(str, t['global_shape']))} at {t['global_offset']})"
        table.add_row(t["name"], t["dtype"], shape, _human(t["bytes"]), t["crc32c"])
    console.print(table)
    if reader.metadata:
        meta = Table("metadata key", "value")
        for k, v in sorted(reader.metadata.items()):
            meta.add_row(k, v if len(v) <= 120 else v[:117] + "...")
        console.print(meta)
    if reader.config is not None:
        console.print("config:", json.dumps(reader.config, sort_keys=True)[:2000])
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sneppx", description="SneppX checkpoint tools")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate", help="check every byte of checkpoints (exit 0 if all valid)")
    p.add_argument("paths", nargs="+", metavar="PATH")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--trusted-key", action="append", metavar="PEM",
                   help="also verify the signature against this public key (repeatable)")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("inspect", help="list tensors, dtypes, shapes, sizes and metadata")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)

    keys.add_cli_commands(sub)  # keygen, sign, verify
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))

