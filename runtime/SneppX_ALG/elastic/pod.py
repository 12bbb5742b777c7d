"""Operator mode: an ElasticTrainer whose process is the command of an ElasticTrainingJob's pod plays one node.

Why a module of its own: in a pod the job spec, not the script, is the word on the job's shape. The operator puts
it in every rank's environment (operator/sneppx_operator/builders.py, `rank_env`), and one place reads it
(`PodEnvironment`), so the agent and its workers agree on where the records and checkpoints are. The other half
is the agent's link to the job's rendezvous object beyond the rendezvous itself (`JobLink`): the operator's
`job/control` record in (node bounds for the next generation, pause), node rank 0's `job/report` out (what
`kubectl get etj` shows) and its `job/hung/<pod>` reports about peers that stayed out of the generations for the
job's hang timeout, or that stall the forming of the next one (`AbsentMembers` keeps track of who is out and
since when).

Where records live in a pod (docs/OPERATOR.md, "Inside the pods"):
- the rendezvous (`rdzv/<job>/...`) in the job's ConfigMap (`records.kube`), the only object the pod's token may
  touch; old generations are removed by the sealer of each new one (rendezvous.Rendezvous.sweep), so the object
  stays small whatever the number of generations;
- the process groups' addresses (`_elastic/comm/...`) in the checkpoint store, as in standalone mode: a
  generation of W workers writes 2 W of them, too many for a 1 MiB object on a large job, and they are read only
  by the generation's own workers.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import os
import socket
import time
from collections.abc import Iterable, Mapping

from SneppX_ALG import coordinator as coordinator_lib
from SneppX_ALG import errors, storage
from SneppX_ALG.contract import job_object, record
from SneppX_ALG.contract.env import (
    ENV_CHECKPOINT_URI,
    ENV_HANG_TIMEOUT,
    ENV_HOST,
    ENV_JOB,
    ENV_LAST_CALL,
    ENV_MAX_NODES,
    ENV_MAX_TO_KEEP,
    ENV_MIN_NODES,
    ENV_OBJECT,
    ENV_POD_NAME,
    ENV_PROCS_PER_NODE,
    ENV_RENDEZVOUS_TIMEOUT,
    ENV_ROLLBACK_DEPTH,
    ENV_SNAPSHOT_EVERY,
    ENV_SNAPSHOT_REPLICAS,
)
from SneppX_ALG.elastic import rendezvous
from SneppX_ALG.records import kube, open_record_store

log = logging.getLogger(__name__)

CHECKPOINT_POLL_S = 2.0  # how often node rank 0's agent looks for a newly committed step (one listing)
CONTROL_POLL_S = 1.0  # how often an agent reads the operator's control record while a generation runs
MEMORY_LOCATION = "memory"  # resumedFrom.location of a step restored from peer-memory snapshots
REPORT_MIN_INTERVAL_S = 1.0  # rank 0's report is rewritten at most this often (it changes with each checkpoint)
HUNG_REPORTS_PER_POLL = 8  # hang reports node rank 0 writes at one poll at most (the others at the next polls)
ABSENCE_MARGIN_S = 1.0  # added to a hang report's silent_seconds: see `hung_record`


@dataclasses.dataclass(frozen=True)
class PodEnvironment:
    """What the operator's environment says about this pod's node (None outside a pod: standalone mode)."""

    job: str  # the run id
    pod_name: str  # the agent id
    host: str  # the pod's IP: where its heartbeat and its workers' process groups listen
    procs_per_node: int
    min_nodes: int
    max_nodes: int
    step_timeout: float | None  # SNEPPX_HANG_TIMEOUT_SECONDS (0: none)
    checkpoint_uri: str
    max_to_keep: int | None
    rollback_depth: int
    snapshot_every: int = 0
    snapshot_replicas: int = 1
    # The job's rendezvous times (None: a pod made by an operator that did not set them; the trainer's own apply)
    join_timeout: float | None = None  # SNEPPX_RENDEZVOUS_TIMEOUT_SECONDS (elastic.rendezvousTimeoutSeconds)
    last_call: float | None = None  # SNEPPX_LAST_CALL_SECONDS (elastic.joinTimeoutSeconds)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> PodEnvironment | None:
        """None unless SNEPPX_RENDEZVOUS_OBJECT is set; ElasticLaunchError naming a variable that is missing or
        not what the operator writes."""
        if not environ.get(ENV_OBJECT):
            return None

        def text(name: str) -> str:
            value = environ.get(name, "")
            if not value:
                raise errors.ElasticLaunchError(f"{ENV_OBJECT} is set (operator mode) but {name} is not: "
                                                "the operator sets both in every rank's pod")
            return value

        def number(name: str, low: int) -> int:
            try:
                value = int(text(name))
            except ValueError:
                raise errors.ElasticLaunchError(f"{name}={environ[name]!r} is not an integer") from None
            if value < low:
                raise errors.ElasticLaunchError(f"{name}={value} is below {low}")
            return value

        job, pod = text(ENV_JOB), text(ENV_POD_NAME)
        for name, value in ((ENV_JOB, job), (ENV_POD_NAME, pod)):
            if not record.is_segment(value):
                raise errors.ElasticLaunchError(f"{name}={value!r} is not a Kubernetes name")
        def optional(name: str, low: int) -> float | None:
            return float(number(name, low)) if environ.get(name) else None

        hang = number(ENV_HANG_TIMEOUT, 0)
        keep = number(ENV_MAX_TO_KEEP, 0) if environ.get(ENV_MAX_TO_KEEP) else 5
        return cls(
            job=job, pod_name=pod, host=environ.get(ENV_HOST) or socket.gethostbyname(socket.gethostname()),
            procs_per_node=number(ENV_PROCS_PER_NODE, 1), min_nodes=number(ENV_MIN_NODES, 1),
            max_nodes=number(ENV_MAX_NODES, 1), step_timeout=float(hang) if hang else None,
            checkpoint_uri=text(ENV_CHECKPOINT_URI), max_to_keep=keep or None,
            rollback_depth=number(ENV_ROLLBACK_DEPTH, 0) if environ.get(ENV_ROLLBACK_DEPTH)
            else 2,
            snapshot_every=number(ENV_SNAPSHOT_EVERY, 0) if environ.get(ENV_SNAPSHOT_EVERY) else 0,
            snapshot_replicas=number(ENV_SNAPSHOT_REPLICAS, 1)
            if environ.get(ENV_SNAPSHOT_REPLICAS) else 1,
            join_timeout=optional(ENV_RENDEZVOUS_TIMEOUT, 1), last_call=optional(ENV_LAST_CALL, 0))


def rendezvous_store(elastic_root: str, environ: Mapping[str, str] = os.environ) -> record.RecordStore:
    """Where a run's rendezvous records are (its generations, the `finished` verdict and, in a pod, the job's
    control and report records): the job's ConfigMap in a pod (SNEPPX_RENDEZVOUS_OBJECT set: operator mode),
    else beside the checkpoints (`elastic_root`). The one place that decides it: the launcher, the agent and
    the worker's commit fence all call this."""
    if environ.get(ENV_OBJECT):
        return kube.KubernetesRecordStore.from_environment(environ)
    return open_record_store(elastic_root)


def process_group_store(elastic_root: str) -> record.RecordStore:
    """Where the process groups' addresses are (`_elastic/comm/...`): beside the checkpoints, in a pod too (the
    module's docstring says why)."""
    return open_record_store(elastic_root)


# The container's memory cgroup as a container sees it: cgroup v2's memory.events, then v1's memory.oom_control.
OOM_COUNTERS = ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control")


def oom_kills(paths: Iterable[str] = OOM_COUNTERS) -> int | None:
    """How many processes the kernel's OOM killer has killed in this container's memory cgroup (the `oom_kill`
    line, kernel 4.13+), or None where no counter can be read (not in a container, an older kernel)."""
    for path in paths:
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for line in lines:
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return None


def now_rfc3339() -> str:
    return job_object.timestamp(datetime.datetime.now(datetime.UTC))


class JobLink:
    """An agent's side of the job's rendezvous object beyond the rendezvous: it reads the operator's control
    record and, while its node is rank 0 of a generation, keeps `job/report` up to date (generation, world size,
    members, the newest committed checkpoint, the one the generation resumed from).

    The last valid checkpoint is the newest step committed on the current timeline (a commit point is written
    only once every rank's part is durable and present); its `time` is when this agent first saw it, within
    CHECKPOINT_POLL_S of the commit."""

    def __init__(self, store: record.RecordStore, checkpoint_uri: str, agent_id: str):
        self.store = store
        self.checkpoint_uri = checkpoint_uri.rstrip("/")
        self.agent_id = agent_id
        self._checkpoints: coordinator_lib.CheckpointCoordinator | None = None
        self._seen: dict[int, str] = {}  # step -> when this agent first saw it committed
        self._last_valid: int | None = None
        self._checked_at = 0.0
        self._written: dict[str, object] | None = None
        self._written_at = 0.0
        self._unprotected: tuple[int, list[int]] | None = None  # (generation, its ranks short of snapshot copies)

    def control(self) -> job_object.Control | None:
        """The operator's control record; None when it is absent, unreadable (logged) or the store is down."""
        try:
            stored = self.store.read(job_object.CONTROL_KEY)
            return None if stored is None else job_object.parse_control(stored.value)
        except errors.RecordError as e:
            log.warning("%s: can't read the operator's control record: %s", self.agent_id, e)
            return None

    def report(self, membership: rendezvous.Membership, resumed_from: int | None, resumed_source: str = "storage",
               *, force: bool = False) -> None:
        """Writes `job/report` if anything in it changed (at most every REPORT_MIN_INTERVAL_S unless `force`).
        Only node rank 0 of `membership` calls it. Store errors are logged: the next call tries again.
        resumed_source "memory": the step came from peer-memory snapshots, and its location says so."""
        now = time.monotonic()
        if force or now - self._checked_at >= CHECKPOINT_POLL_S:
            self._checked_at = now
            self._last_valid = self._newest_committed()
        body = {"generation": membership.generation, "world_size": membership.world_size,
                "members": list(membership.agent_ids), "last_valid_checkpoint": self._ref(self._last_valid),
                "resumed_from": self._ref(resumed_from, in_memory=resumed_source == "memory")}
        if self._unprotected is not None and self._unprotected[0] == membership.generation:
            body["snapshot_unprotected"] = self._unprotected[1]
        if body == self._written or (not force and now - self._written_at < REPORT_MIN_INTERVAL_S):
            return
        value = {"version": job_object.RECORD_VERSION, "kind": "report", **body, "reported_at": now_rfc3339()}
        try:
            job_object.parse_report(value)  # what the operator will accept (pod names as members)
            put(self.store, job_object.REPORT_KEY, value)
        except errors.RecordError as e:
            log.warning("%s: can't write the job's report: %s", self.agent_id, e)
            return
        self._written, self._written_at = body, now

    def placed(self, membership: rendezvous.Membership, unprotected: list[object]) -> None:
        """Rank 0's word on where `membership`'s snapshot copies went: the ranks whose part has fewer copies off
        its node than asked. The next report of that generation carries them (only ranks of its world, the
        first MAX_UNPROTECTED_RANKS: a report the operator would refuse is never written)."""
        ranks = sorted({r for r in unprotected if isinstance(r, int) and not isinstance(r, bool)
                        and 0 <= r < membership.world_size})
        self._unprotected = (membership.generation, ranks[:job_object.MAX_UNPROTECTED_RANKS])

    def _ref(self, step: int | None, *, in_memory: bool = False) -> dict[str, object] | None:
        if step is None:
            return None
        seen = self._seen.setdefault(step, now_rfc3339())
        location = MEMORY_LOCATION if in_memory else f"{self.checkpoint_uri}/{storage.step_name(step)}"
        return {"step": step, "location": location, "time": seen}

    def _newest_committed(self) -> int | None:
        try:
            if self._checkpoints is None:
                self._checkpoints = coordinator_lib.CheckpointCoordinator(
                    self.checkpoint_uri, read_only=True, async_save=False, device="cpu")
            steps = self._checkpoints.committed_steps()
        except (errors.SneppXError, OSError) as e:
            log.warning("%s: can't list the committed checkpoints: %s", self.agent_id, e)
            return self._last_valid
        return steps[-1] if steps else None

    def report_hung(self, absent: AbsentMembers, timeout: float | None, *,
                    limit: int = HUNG_REPORTS_PER_POLL) -> list[job_object.HungRank]:
        """Writes `job/hung/<pod>` for each peer `absent` says has been out of the generations for `timeout`
        seconds (None or 0: never), at most `limit` of them, and restarts each one's window (`AbsentMembers.
        reported`): the operator replaces that pod, and its replacement gets a whole hang timeout of its own.
        Only node rank 0 of the running generation calls it, after a poll of the rendezvous (so a peer that
        waits to join is never reported), or the agent sealing the next generation while too few joined to
        form it, after its listing of the joins (`stalled_report_after`). A store error is logged and ends
        this round: the peers still due are reported at the next poll. Returns what it wrote."""
        # Both clocks read once, before any write: each window restarts no later than its report can be seen,
        # and a slow write doesn't put a later `reported_at` beside an older `silent_seconds`.
        now, wall = time.monotonic(), datetime.datetime.now(datetime.UTC)
        written: list[job_object.HungRank] = []
        for absence in absent.due(now, timeout)[:limit]:
            hung = hung_record(absence, self.agent_id, now, wall)
            key = job_object.hung_key(absence.agent_id)
            value = job_object.hung_to_json(hung)
            try:
                job_object.parse_hung(value, key)  # what the operator will accept (a pod name, a valid time)
                put(self.store, key, value)
            except errors.RecordError as e:
                log.warning("%s: can't report %s hung: %s", self.agent_id, absence.agent_id, e)
                if isinstance(e, errors.RecordCorruptError):  # not a pod name: never reportable, don't retry
                    absent.reported(absence.agent_id, now)
                    continue
                break
            absent.reported(absence.agent_id, now)
            written.append(hung)
        return written

    def close(self) -> None:
        if self._checkpoints is not None:
            self._checkpoints.close()


@dataclasses.dataclass(frozen=True)
class Absence:
    """A peer that was a member of an earlier generation this agent took part in, and is now neither a member
    of the current generation nor waiting to join the next one."""

    agent_id: str  # its pod's name
    rank: int  # its node rank in the last generation it was a member of (that this agent took part in)
    generation: int  # that generation
    since: float  # monotonic: when this agent saw the first generation without it form, or last reported it


class AbsentMembers:
    """Who has been out of the generations, and since when, as one agent sees it (operator mode; pure: the
    agent feeds it what it sees, and the times, so tests need no processes).

    Why: a pod whose agent is wedged (SIGSTOPped, frozen, stuck in uninterruptible sleep, deadlocked short of
    joining) stays Running and Ready. The others exclude it (heartbeat silence; the next generation forms
    without it) and train on, and nothing else would ever replace it: the job would run a node short for ever,
    or stall when minNodes = maxNodes. A pod that really died is seen by the operator from its status, far
    sooner than any hang timeout; one that is out of the generations that long, and not even waiting to join,
    is hung, and node rank 0 reports it (`JobLink.report_hung`). When the others can't form a generation
    without it (fewer than min_nodes joined: minNodes = maxNodes, say), no generation runs and nobody is rank
    0: then the agent sealing the next generation reports a member of the last one that has not joined, after
    `stalled_report_after` (before the waiting agents' join timeout).

    - `formed(m, now)`: a generation this agent is a member of formed; each member's node rank and the
      generation are remembered, and every peer remembered from an earlier generation that is not in this
      one is absent from `now` on (unless it already was: its absence goes on).
    - `waiting(ids, now)`: a poll of the running generation saw `ids` waiting to join the next one; they are
      no longer absent (a peer that stops waiting without becoming a member is absent again from `now`).
    - `ended(now)`: the generation this agent was a member of is over and it waits to join the next: its
      members are present again only once seen joined (`waiting`, from the sealer's listing of the joins).
    - `due(now, timeout)`: the peers absent for at least `timeout` seconds (None or 0: none), longest first.
    - `reported(id, now)`: its window starts again at `now`.

    The agent itself is never absent: a worker of its own that hangs, it kills and replaces itself. At most
    `limit` peers are remembered (a job has at most 1024 nodes); past that, those out the longest are
    forgotten."""

    def __init__(self, agent_id: str, limit: int = job_object.MAX_MEMBERS):
        self.agent_id = agent_id
        self.limit = limit
        self._last: dict[str, tuple[int, int]] = {}  # agent id -> (node rank, generation): the last one it was in
        self._members: frozenset[str] = frozenset()
        self._waiting: frozenset[str] = frozenset()
        self._since: dict[str, float] = {}  # the absent peers

    def formed(self, membership: rendezvous.Membership, now: float) -> None:
        self._members, self._waiting = frozenset(membership.agent_ids), frozenset()
        for rank, member in enumerate(membership.members):
            self._last[member.agent_id] = (rank, membership.generation)
        if len(self._last) > self.limit:
            out = sorted((a for a in self._last if a not in self._members), key=lambda a: (self._last[a][1], a))
            for agent in out[:len(self._last) - self.limit]:
                del self._last[agent]
                self._since.pop(agent, None)
        self._update(now)

    def waiting(self, agent_ids: Iterable[str], now: float) -> None:
        self._waiting = frozenset(agent_ids)
        self._update(now)

    def ended(self, now: float) -> None:
        self._members, self._waiting = frozenset(), frozenset()
        self._update(now)

    def due(self, now: float, timeout: float | None) -> list[Absence]:
        if not timeout or timeout <= 0:
            return []
        found = sorted((since, agent) for agent, since in self._since.items() if now - since >= timeout)
        return [Absence(agent, *self._last[agent], since) for since, agent in found]

    def reported(self, agent_id: str, now: float) -> None:
        if agent_id in self._since:
            self._since[agent_id] = now

    def absent(self) -> dict[str, float]:
        """The absent peers and since when (monotonic)."""
        return dict(self._since)

    def _update(self, now: float) -> None:
        present = self._members | self._waiting
        for agent in [a for a in self._since if a in present]:
            del self._since[agent]
        for agent in self._last:
            if agent not in present and agent != self.agent_id:
                self._since.setdefault(agent, now)


def stalled_report_after(hang_timeout: float | None, join_timeout: float, joined: int, min_nodes: int) -> float | None:
    """How long a member of the generation before may stay out of the forming one before the agent sealing it
    reports that pod hung, with `joined` agents joined of the `min_nodes` it needs (None: not now, or never).

    Only while fewer than `min_nodes` joined: then no generation can form without the absent ones, nobody is
    rank 0 of a running one to report them, and the job stands still; with enough, the generation forms
    without them and its rank 0 reports them after the hang timeout as usual. The hang timeout (0: hang
    reports are off), but at most half the join timeout: every agent waiting there gives up at the join
    timeout (its pod fails), so the report leaves the other half for the operator to replace the wedged pod
    (restart delay, pod start) and for the replacement to join. A pod that never was a member (one still
    Pending, or pulling its image) is never absent, so never reported."""
    if not hang_timeout or hang_timeout <= 0 or joined >= min_nodes:
        return None
    return min(hang_timeout, join_timeout / 2)


def hung_record(absence: Absence, reported_by: str, now: float, wall: datetime.datetime) -> job_object.HungRank:
    """The `job/hung/<pod>` record about `absence` at monotonic time `now`, wall-clock time `wall`.

    `silent_seconds` is how long the peer has been absent, plus ABSENCE_MARGIN_S, rounded up to the millisecond;
    `reported_at` is `wall` to the second (rounded down). So `reported_at - silent_seconds` is at least a second
    before this agent saw the absence begin, never after: the operator, which acts only on a report whose
    silence began after the pod it names was created (`creationTimestamp`, whole seconds, rounded down), never
    takes a report for one about a pod that was created after the absence began (its replacement, say) even
    when the two fall in the same second."""
    silent = math.ceil((max(0.0, now - absence.since) + ABSENCE_MARGIN_S) * 1000) / 1000
    return job_object.HungRank(pod=absence.agent_id, rank=absence.rank, generation=absence.generation,
                               reported_by=reported_by, silent_seconds=silent,
                               reported_at=job_object.timestamp(wall))


def put(store: record.RecordStore, key: str, value: Mapping[str, object]) -> record.Record:
    """Creates the record or replaces whatever it holds (compare-and-swap, again on a conflict): for records
    that one writer owns at a time, such as rank 0's report."""
    for _ in range(16):
        try:
            current = store.read(key)
        except errors.RecordCorruptError:
            store.delete(key)
            continue
        try:
            return store.create(key, value) if current is None else store.swap(key, value, current.version)
        except (errors.RecordExistsError, errors.RecordConflictError):
            continue
    raise errors.RecordUnavailableError(f"{key} kept changing under {store.uri}", key=key)
