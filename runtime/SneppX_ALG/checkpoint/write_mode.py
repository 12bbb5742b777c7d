"""Which way checkpoint files are written on a filesystem, O_DIRECT or buffered, chosen by measurement.

Why: neither mode wins everywhere. O_DIRECT skips the page cache (no second copy, no dirty-page throttling)
and was the faster mode on one VM's disk; on another, buffered writes with write-behind (sync_file_range,
then the written pages dropped) were 1.25-2.1x faster (docs/BENCHMARKS.md). So the first save to a
filesystem writes a probe file in both modes, with the native writer the save itself uses, and the faster
mode is used from then on. The choice is kept in the process and in a small JSON file under
`$XDG_CACHE_HOME/sneppx` (default `~/.cache/sneppx`), keyed by the filesystem (device number, type and
source from /proc/self/mountinfo), so a machine probes each filesystem once; delete the file to probe again.

Overrides, strongest first: `CheckpointWriter(direct=True|False)`; `SNEPPX_WRITE_MODE=direct|buffered`
(`auto`, or unset, probes). A probe that can't run (no space, a read-only cache directory) falls back to
O_DIRECT, the mode used before probing existed, and is not remembered.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import secrets
import threading
import time
from typing import Any

import numpy as np

from SneppX_ALG import _native, errors
from SneppX_ALG.contract.env import ENV_WRITE_MODE

log = logging.getLogger(__name__)

MODES = ("direct", "buffered", "auto")
PROBE_BYTES = 64 << 20  # per probe file: well past the writer's start-up and any small-file effect
PROBE_ROUNDS = 2  # each mode is timed this many times, interleaved, and its fastest counts
CACHE_FILE = "write-modes.json"

_lock = threading.Lock()
_chosen: dict[str, bool] = {}  # filesystem key -> direct


@dataclasses.dataclass(frozen=True)
class Probe:
    """What a probe measured on one filesystem (GB/s of a write through fsync) and what it chose."""

    key: str
    direct_gbps: float
    buffered_gbps: float

    @property
    def direct(self) -> bool:
        return self.direct_gbps >= self.buffered_gbps


def mode_from_env(env: dict[str, str] | None = None) -> str:
    """The mode SNEPPX_WRITE_MODE asks for ("auto" when unset); ValueError for anything else."""
    value = (os.environ if env is None else env).get(ENV_WRITE_MODE, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV_WRITE_MODE}={value!r}: choose one of {', '.join(MODES)}")
    return value


def use_direct(directory: str, direct: bool | None = None) -> bool:
    """Whether a checkpoint file written in `directory` should use O_DIRECT: `direct` when given, else
    SNEPPX_WRITE_MODE, else the measured choice for the directory's filesystem (probing it the first time)."""
    if direct is not None:
        return direct
    mode = mode_from_env()
    if mode != "auto":
        return mode == "direct"
    key = filesystem_key(directory)
    with _lock:  # one probe per filesystem in a process; other threads wait for its answer
        if key not in _chosen:
            choice = _cached_or_probe(directory, key)
            if choice is None:
                return True
            _chosen[key] = choice
        return _chosen[key]


def filesystem_key(directory: str) -> str:
    """Names the filesystem holding `directory`: "<major>:<minor> <type> <source>" from /proc/self/mountinfo,
    or "dev <st_dev>" where there is none (a device number alone can be reused by another filesystem)."""
    dev = os.stat(directory).st_dev
    wanted = f"{os.major(dev)}:{os.minor(dev)}"
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 2 and fields[2] == wanted and " - " in line:
                fstype, source = (line.split(" - ", 1)[1].split() + ["", ""])[:2]
                return f"{wanted} {fstype} {source}"
    return f"dev {dev}"


def cache_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sneppx", CACHE_FILE)


def _cached_or_probe(directory: str, key: str) -> bool | None:
    """The remembered choice for `key`, or a new probe's (remembered for next time); None when the probe
    could not run. Processes on one machine take turns through a lock on the cache file, so eight ranks
    saving at once probe once, not eight times at once (which would measure each other)."""
    path = cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lock_fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        lock_fd = -1  # no cache directory: probe for this process only
    try:
        if lock_fd >= 0:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        entry = _read_cache(path).get(key)
        if isinstance(entry, dict) and entry.get("mode") in ("direct", "buffered"):
            return entry["mode"] == "direct"
        try:
            result = probe(directory, key)
        except (OSError, errors.StorageError) as e:  # no space, a read-only or failing directory
            log.warning("could not measure the write modes in %s (%s): using O_DIRECT", directory, e)
            return None
        log.info("checkpoint writes on %s: %s (O_DIRECT %.2f GB/s, buffered %.2f GB/s, probed in %s)", key,
                 "O_DIRECT" if result.direct else "buffered", result.direct_gbps, result.buffered_gbps, directory)
        if lock_fd >= 0:
            _remember(path, result)
        return result.direct
    finally:
        if lock_fd >= 0:
            os.close(lock_fd)  # releases the flock


def probe(directory: str, key: str = "") -> Probe:
    """Times PROBE_BYTES written through the native writer (through fsync) in each mode, PROBE_ROUNDS times,
    interleaved so a slow spell of a shared disk hits both; the probe files are removed."""
    block = np.random.default_rng().integers(0, 256, 1 << 20, dtype=np.uint8)  # incompressible bytes
    data = np.tile(block, PROBE_BYTES // block.size)
    best = {True: float("inf"), False: float("inf")}
    for _ in range(PROBE_ROUNDS):
        for direct in (True, False):
            path = os.path.join(directory, f".sneppx-write-probe.{os.getpid()}.{secrets.token_hex(4)}.tmp")
            start = time.perf_counter()
            file = _native.NativeFile(path, direct=direct)
            try:
                file.append(data)
                file.finish()
            except BaseException:
                file.abort()
                raise
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            best[direct] = min(best[direct], time.perf_counter() - start)
    return Probe(key, data.nbytes / best[True] / 1e9, data.nbytes / best[False] / 1e9)


def cached_entry(directory: str) -> dict[str, Any] | None:
    """What the cache file holds for the filesystem of `directory` (mode, GB/s of each, when), if anything."""
    entry = _read_cache(cache_path()).get(filesystem_key(directory))
    return entry if isinstance(entry, dict) else None


def _read_cache(path: str) -> dict[str, Any]:
    """The cache file's entries; {} when it is missing or not what this module writes (it is then rewritten)."""
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _remember(path: str, result: Probe) -> None:
    """Adds one filesystem's choice to the cache file (temp file and rename: a reader never sees half)."""
    entries = _read_cache(path)
    entries[result.key] = {"mode": "direct" if result.direct else "buffered",
                           "direct_gbps": round(result.direct_gbps, 3),
                           "buffered_gbps": round(result.buffered_gbps, 3),
                           "probed": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(entries, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not remember the write mode in %s: %s", path, e)
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def forget() -> None:
    """Drops the choices made in this process (tests; the cache file stays)."""
    with _lock:
        _chosen.clear()
