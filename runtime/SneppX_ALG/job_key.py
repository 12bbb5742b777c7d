"""The job's one key: what the heartbeat MACs its datagrams with and what the collectives prove they hold (the
TCP ring's handshake, the shared-memory segment's name).

Separate because two packages that must not depend on each other read it (`elastic.heartbeat` and
`collectives`), the same way: key=, else the key file the operator mounts from the job's Secret, else the hex
variable. Nothing here knows a datagram or a connection.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from SneppX_ALG import _native, errors
from SneppX_ALG.contract.env import ENV_HEARTBEAT_KEY, ENV_HEARTBEAT_KEY_FILE

MIN_KEY_BYTES = 16
KEY_BYTES = _native.HB_KEY_BYTES


def load_key(key: bytes | str | None, environ: Mapping[str, str]) -> bytes:
    """The 32-byte MAC key: from `key` (bytes, or a hex string), else the key file, else the hex variable.

    Keys of exactly 32 bytes are used as they are; others (at least 16 bytes) are hashed to 32 with BLAKE2s-256,
    the same on every member. No key at all is an error, never a silent unauthenticated mode."""
    if key is not None:
        source = "key="
        raw = _from_hex(key, source) if isinstance(key, str) else bytes(key)
    elif environ.get(ENV_HEARTBEAT_KEY_FILE):
        path = environ[ENV_HEARTBEAT_KEY_FILE]
        source = f"{ENV_HEARTBEAT_KEY_FILE}={path}"
        try:
            with open(path, "rb") as f:
                raw = f.read(4096)
        except OSError as e:
            raise errors.HeartbeatKeyError(f"{source}: can't read the heartbeat key ({e.strerror})") from None
    elif environ.get(ENV_HEARTBEAT_KEY):
        source = ENV_HEARTBEAT_KEY
        raw = _from_hex(environ[ENV_HEARTBEAT_KEY], source)
    else:
        raise errors.HeartbeatKeyError(
            f"no heartbeat key: set {ENV_HEARTBEAT_KEY_FILE} to a file of raw key bytes (the operator mounts one from "
            f"the job's Secret) or {ENV_HEARTBEAT_KEY} to the key in hex, or pass key=; every member of a job needs "
            "the same key (make one with: python -c 'import secrets; print(secrets.token_hex(32))')")
    if len(raw) < MIN_KEY_BYTES:
        raise errors.HeartbeatKeyError(f"the heartbeat key from {source} has {len(raw)} bytes; at least "
                                       f"{MIN_KEY_BYTES} are needed (32 random bytes are best)")
    return raw if len(raw) == KEY_BYTES else hashlib.blake2s(raw, digest_size=KEY_BYTES).digest()


def _from_hex(text: str, source: str) -> bytes:
    try:
        return bytes.fromhex(text.strip())
    except ValueError:
        raise errors.HeartbeatKeyError(f"{source} is not a hex string") from None
