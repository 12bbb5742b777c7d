"""`sneppx convert SRC DST`: SNPX <-> safetensors (checkpoint/convert.py does the work).

DST ending in `.snpx` gets one SNPX file (from a safetensors file, a sharded checkpoint's index or its
directory, or a step directory); DST ending in `.safetensors` gets one safetensors file; any other DST is a
directory for sharded safetensors with `model.safetensors.index.json`. Exit 0 when converted, 1 when SRC
can't be converted (unreadable, invalid, a dtype the other format lacks), 2 for a bad argument or key.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from SneppX_ALG import errors
from SneppX_ALG.checkpoint import convert, signing
from SneppX_ALG.cli import keys, output


def add_cli_commands(subparsers: Any) -> None:
    p = subparsers.add_parser("convert", help="SNPX <-> safetensors (files, or shards with their index)")
    p.add_argument("src", metavar="SRC", help="safetensors file, index or directory; SNPX file; step directory")
    p.add_argument("dst", metavar="DST", help="X.snpx, X.safetensors, or a directory for sharded safetensors")
    p.add_argument("--max-shard-size", type=_size, metavar="SIZE",
                   help="sharded output: at most this per file, e.g. 5GB (default: the shards SRC came from, "
                        "else 5GB)")
    p.add_argument("--key", metavar="PEM", help="sign the SNPX file with this Ed25519 private key")
    p.set_defaults(func=cmd_convert)


def _size(text: str) -> int:
    try:
        return output.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_convert(args: argparse.Namespace) -> int:
    to_snpx = args.dst.endswith(".snpx")
    if to_snpx and args.max_shard_size is not None:
        print("sneppx convert: --max-shard-size is for safetensors output; an SNPX file is one file", file=sys.stderr)
        return output.TROUBLE
    if not to_snpx and args.key:
        print("sneppx convert: --key signs SNPX output; safetensors has no signatures", file=sys.stderr)
        return output.TROUBLE
    key = None
    if args.key:
        try:
            key = signing.load_private_key(args.key, keys.key_password())
        except errors.KeyFormatError as e:
            output.fail("convert", e)
            return output.TROUBLE
    try:
        with output.local_path(args.src) as src:
            size = output.file_size(src)
            with output.progress_bar(os.path.basename(args.dst.rstrip("/")), size) as progress:
                if to_snpx:
                    written = [convert.to_snpx(src, args.dst, progress=progress, signing_key=key)]
                else:
                    written = convert.to_safetensors(src, args.dst, max_shard_bytes=args.max_shard_size,
                                                     progress=progress)
    except (errors.SneppXError, OSError, ValueError) as e:
        output.fail("convert", e)
        return output.INVALID
    for path in written:
        print(f"wrote {path} ({output.human(output.file_size(path))})")
    return output.OK
