"""The `sneppx` command line: look after checkpoints and checkpoint roots without writing Python.

    sneppx validate PATH... [--json]        exit 0 if every checkpoint is valid, 1 otherwise
    sneppx inspect PATH [--json]            tensors, dtypes, shapes, sizes, metadata (a file, a step, safetensors)
    sneppx diff A B [--json]                tensors added, removed, changed; exit 0 same, 1 different
    sneppx convert SRC DST                  SNPX <-> safetensors (files, or shards with their index)
    sneppx ls ROOT [--full|--quick] [--json]  every step: valid?, size, age, signer; what latest() picks and why
    sneppx gc ROOT --keep N [--apply]       what retention would delete (never the newest valid step)
    sneppx keygen KEY.pem [--public P]      new Ed25519 key pair (KEY.pem.pub by default); exit 2 if KEY exists
    sneppx sign PATH --key KEY.pem          sign a checkpoint file or directory; exit 1 if it is invalid
    sneppx verify PATH... -k PUB.pem        signature and every byte; exit 0 if all valid, 1 if not, 2 bad key

Exit codes everywhere: 0 good, 1 invalid (or different, or not converted), 2 a bad argument, key or location.
One module per group of subcommands, each a small function over the library API; the library does the work.
"""

from __future__ import annotations

import argparse

from SneppX_ALG.cli import convert, diff, files, keys, roots


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sneppx", description="SneppX checkpoint tools")
    sub = parser.add_subparsers(dest="command", required=True)
    files.add_cli_commands(sub)  # validate, inspect
    diff.add_cli_commands(sub)
    convert.add_cli_commands(sub)
    keys.add_cli_commands(sub)  # keygen, sign, verify
    roots.add_cli_commands(sub)  # ls, gc
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))
