"""Who is writing under a root right now, so that cleanup removes only what is provably abandoned.

Why: a save builds its step under names nobody reads (a `.tmp-step-*` directory, or S3 objects without a
`COMMITTED` marker), and `cleanup()` removes such leftovers of crashed saves. Without knowing whether their
writer is alive, a second coordinator (or an evaluator) opening the root mid-save would remove a save in
flight. So every writer makes a claim on each step it writes before it writes anything of it, shows signs of
life while the step is in flight, and withdraws the claim once the step is committed or aborted:

* local root: the temporary directory is the claim. Its name says who owns it
  (`.tmp-step-<step>-<writer>-<host>-<pid>-<pid start>`), `mkdir` creates it whole, and the writer touches it
  (mtime) as its sign of life; no second file to write, sync or leak.
* S3: one object per writer, `<prefix>/.lease-<writer>`, a JSON record of the same owner fields, the steps in
  flight and the expiry; its Last-Modified (against the server's Date header) is the sign of life.

A claim stands (`still_writing`) when:

* it was made by this process: this process knows its own writers (`held_here`), whatever the record says;
* else, when it names this host (the same kernel boot and pid namespace, where its pid names a process we can
  ask about): that process still exists (pid and start time, so a reused pid doesn't count) and the claim is
  fresh;
* else (another machine sharing the root): it is fresh, i.e. its last sign of life is younger than the expiry.

Why a heartbeat rather than an age threshold on the leftovers: a save's length has no useful bound (a large
model on a slow bucket takes as long as it takes), while a writer that refreshes every `expiry / 10`
(LEASE_EXPIRY_S is 10 minutes, so once a minute) only loses its claim by being unable to touch the root for
ten minutes. Such a stalled writer finds out at its commit, which checks that every part it wrote is still
there and fails rather than commit a step with parts missing. Ages are measured on the clock of whatever keeps
the root (a file's mtime against this host's clock: hosts sharing a file system must agree within minutes; on
S3, the server's own).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import secrets
import threading
from collections.abc import Callable, Iterable

from SneppX_ALG import errors

log = logging.getLogger(__name__)

LEASE_PREFIX = ".lease-"
LEASE_EXPIRY_S = 600.0

# writer id -> steps in flight, for every writer of this process (the authority on this process's own claims)
_held_here: dict[str, frozenset[int]] = {}
_held_lock = threading.Lock()


def held_here(writer: str) -> frozenset[int]:
    with _held_lock:
        return _held_here.get(writer, frozenset())


@functools.cache
def this_host() -> str:
    """12 hex digits naming the kernel boot and pid namespace this process runs in: processes with the same
    value can check each other's pids. "" where /proc can't tell (claims of others then expire by age
    only)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return hashlib.blake2b(f"{boot}/{namespace}".encode(), digest_size=6).hexdigest()


def process_start(pid: int) -> int | None:
    """The start time of process `pid` (clock ticks after boot), or None if it doesn't exist, has exited (a
    zombie), or /proc can't say."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def process_alive(pid: int, start: int | None) -> bool:
    """Whether process `pid` exists and is the one that started at `start` (None: any)."""
    if not pid_alive(pid):
        return False
    if not os.path.isdir("/proc/self"):
        return True  # no procfs: kill(0) is all this host can tell
    now = process_start(pid)
    return now is not None and (start is None or now == start)


@dataclasses.dataclass(frozen=True)
class Owner:
    """Who made a claim: a writer (random id, one per storage object) in a process on a host."""

    writer: str
    host: str
    pid: int
    pid_start: int | None

    @classmethod
    def me(cls, writer: str) -> Owner:
        pid = os.getpid()  # asked each time, not cached: the process may have forked
        return cls(writer, this_host(), pid, process_start(pid))

    def name(self) -> str:
        """The owner as a name part: `<writer>-<host>-<pid>-<pid start>` (unknowns as "none" and 0)."""
        return f"{self.writer}-{self.host or 'none'}-{self.pid}-{self.pid_start or 0}"

    @classmethod
    def from_name(cls, text: str) -> Owner | None:
        parts = text.split("-")
        if len(parts) != 4 or not all(parts) or not parts[2].isdigit() or not parts[3].isdigit():
            return None
        writer, host, pid, start = parts
        return cls(writer, "" if host == "none" else host, int(pid), int(start) or None)


def still_writing(owner: Owner, step: int, age_s: float, expiry_s: float) -> bool:
    """Whether `owner` may still be writing `step`, its last sign of life `age_s` seconds ago."""
    if owner.host and owner.host == this_host():
        if owner.pid == os.getpid():
            return step in held_here(owner.writer)
        if not process_alive(owner.pid, owner.pid_start):
            return False
    return age_s < expiry_s


@dataclasses.dataclass(frozen=True)
class Claim:
    """A published lease (S3): its owner, the steps it says are in flight, and how long it lasts unrefreshed."""

    owner: Owner
    steps: frozenset[int]
    expiry_s: float

    def standing(self, age_s: float) -> frozenset[int]:
        """The steps still protected from cleanup, its last refresh `age_s` seconds ago."""
        return frozenset(s for s in self.steps if still_writing(self.owner, s, age_s, self.expiry_s))

    def is_abandoned(self, age_s: float) -> bool:
        """Whether cleanup may delete the lease itself: nothing of it stands, and it isn't this process's
        (those are withdrawn by their writer, or expire: deleting one while its writer publishes it again
        could hide a claim from other processes)."""
        if self.standing(age_s):
            return False
        mine = bool(self.owner.host) and self.owner.host == this_host() and self.owner.pid == os.getpid()
        return not mine or age_s >= self.expiry_s


class WriterLease:
    """This writer's claims on the steps it has in flight under one root.

    `hold(step)` makes the claim before anything of the step is written (a cleaner that sees a part of the
    step then sees the claim) and starts a thread that calls `refresh()` every `expiry_s / 10`;
    `release(step)` withdraws it once the step is committed or aborted. `publish()`, `refresh()` and
    `withdraw()` are the backend's (see the module docstring): each is called with the lease's lock held.
    """

    def __init__(self, *, publish: Callable[[], None], refresh: Callable[[], None],
                 withdraw: Callable[[], None], expiry_s: float = LEASE_EXPIRY_S):
        self.writer = secrets.token_hex(8)
        self.expiry_s = expiry_s
        self._publish, self._refresh, self._withdraw = publish, refresh, withdraw
        self.steps: set[int] = set()
        self._lock = threading.Lock()
        self._stop: threading.Event | None = None

    def owner(self) -> Owner:
        return Owner.me(self.writer)

    def hold(self, step: int) -> None:
        with self._lock:
            self.steps.add(step)
            self._note_held()
            try:
                self._publish()
            except BaseException:
                self.steps.discard(step)
                self._note_held()
                raise
            if self._stop is None:
                self._stop = threading.Event()
                threading.Thread(target=self._heartbeat, args=(self._stop,), name="sneppx-lease",
                                 daemon=True).start()

    def release(self, step: int) -> None:
        """Ends the claim on `step` (no-op if not held). Never raises: a claim that can't be withdrawn stops
        being refreshed, so it expires (and on this host, cleanup knows at once that it ended)."""
        with self._lock:
            if step not in self.steps:
                return
            self.steps.discard(step)
            self._note_held()
            if not self.steps and self._stop is not None:
                self._stop.set()
                self._stop = None
            try:
                self._publish() if self.steps else self._withdraw()
            except (errors.SneppXError, OSError) as e:
                log.warning("claim of checkpoint writer %s on step %d not withdrawn: %s", self.writer, step,
                            e)

    def _note_held(self) -> None:
        with _held_lock:
            if self.steps:
                _held_here[self.writer] = frozenset(self.steps)
            else:
                _held_here.pop(self.writer, None)

    def _heartbeat(self, stop: threading.Event) -> None:
        while not stop.wait(self.expiry_s / 10):
            with self._lock:
                if stop.is_set():
                    return
                try:
                    self._refresh()
                except (errors.SneppXError, OSError) as e:
                    log.warning("claim of checkpoint writer %s not refreshed: %s", self.writer, e)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


LEASE_FORMAT = "sneppx.lease"  # a lease object on S3 (storage/s3.py publishes it)


def encode_claim(owner: Owner, steps: Iterable[int], expiry_s: float) -> bytes:
    """The lease object a writer publishes on S3: who it is and which steps it has in flight."""
    claim = {"format": LEASE_FORMAT, "writer": owner.writer, "host": owner.host, "pid": owner.pid,
             "pid_start": owner.pid_start, "steps": sorted(steps), "expiry_s": expiry_s}
    return json.dumps(claim, sort_keys=True).encode()


def parse_claim(raw: bytes) -> Claim | None:
    """The claim a lease object records, or None when it is not one (it then claims nothing)."""
    try:
        fields = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not (isinstance(fields, dict) and fields.get("format") == LEASE_FORMAT
            and isinstance(fields.get("writer"), str) and isinstance(fields.get("host"), str)
            and isinstance(fields.get("pid"), int) and isinstance(fields.get("pid_start"), (int, type(None)))
            and isinstance(fields.get("steps"), list) and all(isinstance(s, int) for s in fields["steps"])
            and isinstance(fields.get("expiry_s"), (int, float))):
        return None
    owner = Owner(fields["writer"], fields["host"], fields["pid"], fields["pid_start"])
    return Claim(owner, frozenset(fields["steps"]), float(fields["expiry_s"]))
