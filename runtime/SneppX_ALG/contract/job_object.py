"""The rendezvous object of a job in operator mode: its name, its layout, and the records the operator and the
in-pod agents exchange through it. Pure (no Kubernetes client): the operator and the runtime both import it, so
the two sides can't disagree on a field.

Why one ConfigMap per job, not a coordination.k8s.io Lease: the rendezvous needs many small records (a join per
agent per generation, a membership, a lease, the records below), each written by compare-and-swap. A ConfigMap's
`data` is a map of strings of up to 1 MiB in all, so every record of a job is one entry of one object, and one
`resourceVersion` precondition makes any read-modify-write of it atomic. A Lease carries only a holder and a few
times; records would have to live in its annotations (256 KiB in all, and shown by every `kubectl describe`).
One object also keeps the agents' RBAC to a single `resourceNames` entry.

Layout: each record of `contract.record` is one `data` entry whose key is the record's key with "/" written as
"." (and "." and "_" escaped as "_." and "__", so the mapping is one-to-one); ConfigMap keys allow
`[-._a-zA-Z0-9]` and at most 253 characters, which a record key of a job (`rdzv/<job>/g000000007/join/<pod>`)
fits. The value is the record's JSON text (`record.encode`).

Records shared by the operator and the agents, next to the rendezvous's own (`rdzv/...`, which the operator never
reads):

    job/control        the operator's: `paused` (quorum lost with actionOnLoss Pause: survivors stop stepping and
                       keep their state until it is false again), the node bounds the next generation forms with
                       (`min_nodes`, `max_nodes`: a change takes effect at the next generation), the pod
                       generation, `hang_timeout_seconds`
    job/report         rank 0's agent's: the membership generation it trains in, its world size and members (pod
                       names), the last valid checkpoint and the one it resumed from, and (optional, with
                       peer-memory snapshots on) `snapshot_unprotected`: the ranks whose part has fewer copies
                       off its node than asked
    job/hung/<pod>     written by node rank 0's agent for a peer absent from the job's generations for the hang
                       timeout: the operator deletes that pod (a restart with reason Hang) and removes the record

Readers refuse anything else under these keys (`RecordCorruptError`); the operator reports such a record and
ignores it rather than acting on it.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import re
from collections.abc import Mapping
from typing import Any

from SneppX_ALG import errors
from SneppX_ALG.contract import record

RECORD_VERSION = 1
MAX_DATA_KEY_CHARS = 253  # a ConfigMap data key
MAX_MEMBERS = 1024
MAX_LOCATION_CHARS = 2048
MAX_REASON_CHARS = 1024
MAX_UNPROTECTED_RANKS = 4096  # a report names at most this many ranks whose snapshots lack copies off their node
CONTROL_KEY = "job/control"
REPORT_KEY = "job/report"
HUNG_PREFIX = "job/hung/"

_DATA_KEY_RE = re.compile(r"^[-._a-zA-Z0-9]{1,253}$")
_POD_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_TIME_RE = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,9})?Z$")


def object_name(job_name: str) -> str:
    """The job's rendezvous ConfigMap. Job names are at most 50 characters (the CRD), so this fits."""
    return f"{job_name}-rendezvous"


def data_key(key: str) -> str:
    """The ConfigMap data key of a record key; `RecordValueError` when it would be longer than 253 characters."""
    record.check_key(key)
    encoded = key.replace("_", "__").replace(".", "_.").replace("/", ".")
    if len(encoded) > MAX_DATA_KEY_CHARS:
        raise errors.RecordValueError(
            f"the key is {len(encoded)} characters as a ConfigMap key; at most {MAX_DATA_KEY_CHARS} fit", key=key
        )
    return encoded


def record_key(encoded: str) -> str | None:
    """The record key a data key stands for; None for a key this layout never writes."""
    if not _DATA_KEY_RE.match(encoded):
        return None
    out: list[str] = []
    index = 0
    while index < len(encoded):
        char = encoded[index]
        if char == "_":
            following = encoded[index + 1 : index + 2]
            if following not in ("_", "."):
                return None
            out.append(following)
            index += 2
            continue
        out.append("/" if char == "." else char)
        index += 1
    key = "".join(out)
    try:
        record.check_key(key)
    except errors.RecordValueError:
        return None
    return key if data_key(key) == encoded else None


def timestamp(when: datetime.datetime) -> str:
    """RFC 3339 in UTC to the second, as Kubernetes writes times."""
    return when.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: object) -> datetime.datetime:
    """An RFC 3339 UTC time written by `timestamp` (fractions allowed); ValueError otherwise."""
    if not isinstance(text, str) or not _TIME_RE.match(text):
        raise ValueError(f"{text!r} is not an RFC 3339 UTC time")
    return datetime.datetime.strptime(text[:19], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=datetime.UTC)


@dataclasses.dataclass(frozen=True)
class CheckpointRef:
    """A checkpoint as reported: its step, where it is, and when it was committed."""

    step: int
    location: str
    time: str


@dataclasses.dataclass(frozen=True)
class Control:
    paused: bool
    reason: str
    min_nodes: int
    max_nodes: int
    pod_generation: int
    hang_timeout_seconds: int


@dataclasses.dataclass(frozen=True)
class Report:
    generation: int
    world_size: int
    members: tuple[str, ...]
    last_valid_checkpoint: CheckpointRef | None
    resumed_from: CheckpointRef | None
    reported_at: str
    # Ranks whose peer-memory snapshot has fewer copies off its node than asked (sorted, the first
    # MAX_UNPROTECTED_RANKS); None: snapshots are off, or the agent doesn't say (the field is optional).
    snapshot_unprotected: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class HungRank:
    pod: str
    rank: int
    generation: int
    reported_by: str
    silent_seconds: float
    reported_at: str


@dataclasses.dataclass(frozen=True)
class View:
    """What the operator reads from the object: the records it acts on, and what it found wrong."""

    control: Control | None = None
    report: Report | None = None
    hung: tuple[HungRank, ...] = ()
    problems: tuple[str, ...] = ()


def hung_key(pod: str) -> str:
    return HUNG_PREFIX + pod


def control_to_json(control: Control) -> dict[str, Any]:
    return {
        "version": RECORD_VERSION,
        "kind": "control",
        "paused": control.paused,
        "reason": control.reason[:MAX_REASON_CHARS],
        "min_nodes": control.min_nodes,
        "max_nodes": control.max_nodes,
        "pod_generation": control.pod_generation,
        "hang_timeout_seconds": control.hang_timeout_seconds,
    }


def checkpoint_to_json(ref: CheckpointRef | None) -> dict[str, Any] | None:
    return None if ref is None else {"step": ref.step, "location": ref.location, "time": ref.time}


def report_to_json(report: Report) -> dict[str, Any]:
    return {
        "version": RECORD_VERSION,
        "kind": "report",
        "generation": report.generation,
        "world_size": report.world_size,
        "members": list(report.members),
        "last_valid_checkpoint": checkpoint_to_json(report.last_valid_checkpoint),
        "resumed_from": checkpoint_to_json(report.resumed_from),
        "reported_at": report.reported_at,
        **({} if report.snapshot_unprotected is None else {"snapshot_unprotected": list(report.snapshot_unprotected)}),
    }


def hung_to_json(hung: HungRank) -> dict[str, Any]:
    return {
        "version": RECORD_VERSION,
        "kind": "hung",
        "pod": hung.pod,
        "rank": hung.rank,
        "generation": hung.generation,
        "reported_by": hung.reported_by,
        "silent_seconds": hung.silent_seconds,
        "reported_at": hung.reported_at,
    }


def _fields(value: Any, key: str, kind: str, names: set[str]) -> Mapping[str, Any]:
    expected = {"version", "kind"} | names
    if not isinstance(value, Mapping) or set(value) != expected:
        found = sorted(value) if isinstance(value, Mapping) else type(value).__name__
        raise errors.RecordCorruptError(f"a {kind} record has the fields {sorted(expected)}, not {found}", key=key)
    if value["version"] != RECORD_VERSION or value["kind"] != kind:
        raise errors.RecordCorruptError(
            f"not a version {RECORD_VERSION} {kind} record (version {value['version']!r}, kind {value['kind']!r})",
            key=key,
        )
    return value


def _count(value: Any, key: str, name: str, maximum: int = 10**12) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= maximum:
        raise errors.RecordCorruptError(f"{name} is not an integer in 0..{maximum}", key=key)
    return value


def _pod(value: Any, key: str, name: str) -> str:
    if not isinstance(value, str) or not _POD_NAME_RE.match(value):
        raise errors.RecordCorruptError(f"{name} is not a pod name", key=key)
    return value


def _time(value: Any, key: str, name: str) -> str:
    try:
        parse_time(value)
    except ValueError:
        raise errors.RecordCorruptError(f"{name} is not an RFC 3339 UTC time", key=key) from None
    return str(value)


def _checkpoint(value: Any, key: str, name: str) -> CheckpointRef | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or set(value) != {"step", "location", "time"}:
        raise errors.RecordCorruptError(f"{name} has the fields step, location and time", key=key)
    location = value["location"]
    if not isinstance(location, str) or not 0 < len(location) <= MAX_LOCATION_CHARS or not location.isprintable():
        raise errors.RecordCorruptError(f"{name}.location is not printable text of 1-{MAX_LOCATION_CHARS} chars",
                                        key=key)
    return CheckpointRef(_count(value["step"], key, f"{name}.step"), location, _time(value["time"], key, f"{name}.time"))


def parse_control(value: Any, key: str = CONTROL_KEY) -> Control:
    fields = _fields(value, key, "control", {"paused", "reason", "min_nodes", "max_nodes", "pod_generation",
                                             "hang_timeout_seconds"})
    if not isinstance(fields["paused"], bool):
        raise errors.RecordCorruptError("paused is not a boolean", key=key)
    reason = fields["reason"]
    if not isinstance(reason, str) or len(reason) > MAX_REASON_CHARS:
        raise errors.RecordCorruptError(f"reason is not text of at most {MAX_REASON_CHARS} chars", key=key)
    min_nodes = _count(fields["min_nodes"], key, "min_nodes", MAX_MEMBERS)
    max_nodes = _count(fields["max_nodes"], key, "max_nodes", MAX_MEMBERS)
    if min_nodes > max_nodes:
        raise errors.RecordCorruptError("min_nodes is larger than max_nodes", key=key)
    return Control(fields["paused"], reason, min_nodes, max_nodes, _count(fields["pod_generation"], key,
                   "pod_generation"), _count(fields["hang_timeout_seconds"], key, "hang_timeout_seconds"))


def parse_report(value: Any, key: str = REPORT_KEY) -> Report:
    optional = {"snapshot_unprotected"} & set(value) if isinstance(value, Mapping) else set()  # older agents
    fields = _fields(value, key, "report", {"generation", "world_size", "members", "last_valid_checkpoint",
                                            "resumed_from", "reported_at", *optional})
    members = fields["members"]
    if not isinstance(members, list) or len(members) > MAX_MEMBERS:
        raise errors.RecordCorruptError(f"members is not a list of at most {MAX_MEMBERS} pod names", key=key)
    world_size = _count(fields["world_size"], key, "world_size", 1 << 20)
    return Report(
        _count(fields["generation"], key, "generation"),
        world_size,
        tuple(_pod(m, key, "a member") for m in members),
        _checkpoint(fields["last_valid_checkpoint"], key, "last_valid_checkpoint"),
        _checkpoint(fields["resumed_from"], key, "resumed_from"),
        _time(fields["reported_at"], key, "reported_at"),
        _unprotected(fields.get("snapshot_unprotected"), world_size, key),
    )


def _unprotected(value: Any, world_size: int, key: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) > MAX_UNPROTECTED_RANKS
            or any(not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < world_size for r in value)
            or any(a >= b for a, b in itertools.pairwise(value))):
        raise errors.RecordCorruptError(
            f"snapshot_unprotected is not an ascending list of at most {MAX_UNPROTECTED_RANKS} ranks below "
            f"world_size", key=key)
    return tuple(value)


def parse_hung(value: Any, key: str) -> HungRank:
    fields = _fields(value, key, "hung", {"pod", "rank", "generation", "reported_by", "silent_seconds",
                                          "reported_at"})
    pod = _pod(fields["pod"], key, "pod")
    if key != hung_key(pod):
        raise errors.RecordCorruptError(f"names pod {pod!r}, not the one in its key", key=key)
    silent = fields["silent_seconds"]
    if not record.is_finite_number(silent) or silent < 0:
        raise errors.RecordCorruptError("silent_seconds is not a finite number >= 0", key=key)
    return HungRank(pod, _count(fields["rank"], key, "rank"), _count(fields["generation"], key, "generation"),
                    _pod(fields["reported_by"], key, "reported_by"), float(silent),
                    _time(fields["reported_at"], key, "reported_at"))


def read_view(data: Mapping[str, str] | None) -> View:
    """The operator's reading of the object's `data`: every record it acts on that parses, and a line for each
    that doesn't (never raises: a hostile or broken record must not stop the operator)."""
    control: Control | None = None
    report: Report | None = None
    hung: list[HungRank] = []
    problems: list[str] = []
    for encoded, text in sorted((data or {}).items()):
        key = record_key(encoded)
        if key is None or not (key in (CONTROL_KEY, REPORT_KEY) or key.startswith(HUNG_PREFIX)):
            continue
        try:
            if not isinstance(text, str):
                raise errors.RecordCorruptError("the stored value is not text", key=key)
            value = record.decode(key, text.encode("utf-8", "surrogatepass"))
            if key == CONTROL_KEY:
                control = parse_control(value, key)
            elif key == REPORT_KEY:
                report = parse_report(value, key)
            else:
                hung.append(parse_hung(value, key))
        except errors.RecordCorruptError as exc:
            problems.append(f"{key}: {exc}")
    return View(control, report, tuple(hung), tuple(problems))


def encode_value(key: str, value: Mapping[str, Any]) -> str:
    """A record's value as the object stores it (the JSON text of `record.encode`)."""
    return record.encode(key, value).decode("utf-8")
