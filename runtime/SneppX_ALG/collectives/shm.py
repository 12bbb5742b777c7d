"""Shared memory's setup: what ranks that can share a segment have in common (`host_identity`), the segment's
name (from the job key), and where its outcome is published. The data path is C (native/src/shm.c).

Separate because who shares a host is a question of its own (boot, /dev/shm, PID namespace, a launcher's key),
asked by `ProcessGroup` when it picks a backend and by nothing in the ring.
"""

from __future__ import annotations

import hmac
import os
import struct

from SneppX_ALG.collectives import store as store_lib
from SneppX_ALG.contract.env import ENV_HOST_KEY


def shm_key(generation: int, what: str) -> str:
    return store_lib.generation_key(generation, f"comm/shm/{what}")


def host_identity() -> str:
    """What ranks that can share memory have in common: the machine's boot, the /dev/shm they see and their PID
    namespace (pods on one node share the boot, but neither /dev/shm nor PIDs), and $SNEPPX_HOST_KEY if set (a
    launcher that wants ranks of one machine kept apart, e.g. one group per NUMA node, gives each its own)."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    shm, pids = os.stat("/dev/shm"), os.stat("/proc/self/ns/pid")
    return f"{boot}:{shm.st_dev}:{shm.st_ino}:{pids.st_ino}:{os.environ.get(ENV_HOST_KEY, '')}"


SHM_DIR = "/dev/shm"  # where glibc's shm_open keeps the names


def unlink_segment(name: str) -> None:
    """Removes a segment's name, as shm_unlink(3) does; a name already gone (another rank was first) is no error."""
    try:
        os.unlink(SHM_DIR + name)
    except FileNotFoundError:
        pass


def shm_name(key: bytes, generation: int, nonce: bytes) -> str:
    """The segment's name, from the job key: the store carries only the nonce, so a reader of the store without
    the key cannot name it, and no rank of another generation opens it."""
    digest = hmac.new(key, b"sneppx-shm\0" + struct.pack("!Q", generation) + nonce, "sha256").hexdigest()
    return f"/sneppx-{digest[:40]}"
