"""Ed25519 keys: made, named (the key id a signature block carries), written and read as PEM, and the set of
trusted public keys a verifier accepts.

Why a module of its own: keys are handled by tools and operators (`sneppx keygen`, trusted_keys=) apart from
any checkpoint; signing.py uses them to sign and check signature blocks.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from SneppX_ALG import _native, errors

KEY_ID_BYTES = 32


def generate_keypair() -> tuple[ed25519.Ed25519PrivateKey, ed25519.Ed25519PublicKey]:
    """A new Ed25519 key pair (private, public)."""
    private = ed25519.Ed25519PrivateKey.generate()
    return private, private.public_key()


def key_id(key: ed25519.Ed25519PublicKey | ed25519.Ed25519PrivateKey) -> bytes:
    """SHA-256 of the raw 32-byte public key: names the key in a signature block without revealing more."""
    public = key.public_key() if isinstance(key, ed25519.Ed25519PrivateKey) else key
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).digest()


def key_id_hex(key: ed25519.Ed25519PublicKey | ed25519.Ed25519PrivateKey) -> str:
    return key_id(key).hex()


def _write_new_file(path: str, data: bytes, mode: int) -> None:
    """Creates `path` (never overwrites: losing a private key is not recoverable) and fsyncs it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    except FileExistsError:
        raise errors.StorageError(f"{path} already exists; refusing to overwrite a key", path=path) from None
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    _native.fsync_path(os.path.dirname(os.path.abspath(path)))


def save_private_key(path: str | os.PathLike[str], key: ed25519.Ed25519PrivateKey,
                     password: bytes | None = None) -> None:
    """PKCS#8 PEM, mode 0600, encrypted when a password is given. Refuses to overwrite an existing file."""
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption())
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)
    _write_new_file(os.fspath(path), pem, 0o600)


def save_public_key(path: str | os.PathLike[str], key: ed25519.Ed25519PublicKey) -> None:
    """SubjectPublicKeyInfo PEM (what `openssl pkey -pubout` writes)."""
    pem = key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    _write_new_file(os.fspath(path), pem, 0o644)


def _read_key_file(path: str | os.PathLike[str]) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 16)
    except FileNotFoundError:
        raise errors.KeyFormatError(f"key file {os.fspath(path)} not found") from None
    except IsADirectoryError:
        raise errors.KeyFormatError(f"key file {os.fspath(path)} is a directory") from None
    return data


def load_private_key(path: str | os.PathLike[str],
                     password: bytes | None = None) -> ed25519.Ed25519PrivateKey:
    """An Ed25519 private key from a PEM file; KeyFormatError for anything else."""
    try:
        key = serialization.load_pem_private_key(_read_key_file(path), password=password)
    except (ValueError, TypeError) as e:
        raise errors.KeyFormatError(f"{os.fspath(path)}: not a readable PEM private key ({e})") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise errors.KeyFormatError(f"{os.fspath(path)}: a {type(key).__name__}, not an Ed25519 key")
    return key


def public_key_from_bytes(data: bytes, *, source: str = "key") -> ed25519.Ed25519PublicKey:
    """An Ed25519 public key from PEM (public or private) or the raw 32 bytes."""
    if len(data) == 32 and not data.startswith(b"-----"):
        return ed25519.Ed25519PublicKey.from_public_bytes(data)
    try:
        key: Any = serialization.load_pem_public_key(data)
    except ValueError:
        try:
            key = serialization.load_pem_private_key(data, password=None).public_key()
        except (ValueError, TypeError) as e:
            raise errors.KeyFormatError(f"{source}: not a PEM Ed25519 public key ({e})") from None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise errors.KeyFormatError(f"{source}: a {type(key).__name__}, not an Ed25519 key")
    return key


def load_public_key(path: str | os.PathLike[str]) -> ed25519.Ed25519PublicKey:
    """An Ed25519 public key from a PEM file (a private key file gives its public half)."""
    return public_key_from_bytes(_read_key_file(path), source=os.fspath(path))


def trusted_key_set(trusted_keys: Any) -> dict[bytes, ed25519.Ed25519PublicKey]:
    """key id -> public key: from keys, PEM paths, PEM or raw bytes (one or an iterable)."""
    if trusted_keys is None:
        return {}
    items: Iterable[Any]
    single = (ed25519.Ed25519PublicKey, ed25519.Ed25519PrivateKey, str, bytes, os.PathLike)
    if isinstance(trusted_keys, single):
        items = [trusted_keys]
    elif isinstance(trusted_keys, dict):
        items = trusted_keys.values()
    else:
        items = trusted_keys
    keys: dict[bytes, ed25519.Ed25519PublicKey] = {}
    for item in items:
        if isinstance(item, ed25519.Ed25519PrivateKey):
            public = item.public_key()
        elif isinstance(item, ed25519.Ed25519PublicKey):
            public = item
        elif isinstance(item, bytes):
            public = public_key_from_bytes(item)
        elif isinstance(item, (str, os.PathLike)):
            public = load_public_key(item)
        else:
            raise errors.KeyFormatError(f"can't use a {type(item).__name__} as a trusted key")
        keys[key_id(public)] = public
    return keys
