"""`sneppx keygen | sign | verify`: Ed25519 keys, signing a checkpoint, verifying one."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from SneppX_ALG import errors
from SneppX_ALG.checkpoint import signing, verify
from SneppX_ALG.contract.env import ENV_KEY_PASSWORD


def add_cli_commands(subparsers: Any) -> None:
    """Adds the keygen, sign and verify subcommands to the `sneppx` argument parser."""
    p = subparsers.add_parser("keygen", help="make an Ed25519 key pair (PEM)")
    p.add_argument("private_key", help="where to write the private key (mode 0600; never overwritten)")
    p.add_argument("--public", help="where to write the public key (default: PRIVATE.pub)")
    p.set_defaults(func=cli_keygen)
    p = subparsers.add_parser("sign", help="sign a checkpoint file or checkpoint directory in place")
    p.add_argument("path")
    p.add_argument("--key", required=True, help="private key PEM")
    p.set_defaults(func=cli_sign)
    p = subparsers.add_parser("verify", help="check a checkpoint's signature and every byte; exit 0 if valid")
    p.add_argument("paths", nargs="+")
    p.add_argument("--trusted-key", "-k", action="append", required=True,
                   help="trusted public key PEM (repeatable)")
    p.set_defaults(func=cli_verify)


def key_password() -> bytes | None:
    """The private key's password from SNEPPX_KEY_PASSWORD (None: an unencrypted key)."""
    value = os.environ.get(ENV_KEY_PASSWORD)
    return value.encode() if value else None


def cli_keygen(args: argparse.Namespace) -> int:
    private, public = signing.generate_keypair()
    public_path = args.public or f"{args.private_key}.pub"
    try:
        signing.save_private_key(args.private_key, private, key_password())
        signing.save_public_key(public_path, public)
    except errors.SneppXError as e:
        print(f"sneppx keygen: {e}", file=sys.stderr)
        return 2
    print(f"key id {signing.key_id_hex(public)}\nprivate {args.private_key}\npublic  {public_path}")
    return 0


def cli_sign(args: argparse.Namespace) -> int:
    try:
        key = signing.load_private_key(args.key, key_password())
    except errors.KeyFormatError as e:
        print(f"sneppx sign: {e}", file=sys.stderr)
        return 2
    try:
        kid = verify.sign_checkpoint(args.path, key)
    except (errors.SneppXError, OSError) as e:  # OSError: e.g. no permission to write next to the file
        print(f"sneppx sign: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"signed {args.path} with key {kid.hex()}")
    return 0


def cli_verify(args: argparse.Namespace) -> int:
    try:
        keys = signing.trusted_key_set(args.trusted_key)
    except errors.KeyFormatError as e:
        print(f"sneppx verify: {e}", file=sys.stderr)
        return 2
    all_ok = True
    for path in args.paths:
        try:
            verified = verify.check_checkpoint(path, keys)
        except (errors.SneppXError, OSError) as e:
            all_ok = False
            print(f"INVALID {path}\n        - {type(e).__name__}: {e}")
            continue
        print(f"OK      {path} (signed by key {verified.key_id.hex()[:16]})")
    return 0 if all_ok else 1
