"""Operator mode: an ElasticTrainer whose process is the command of an ElasticTrainingJob's pod plays one node.

Why a module of its own: in a pod the job spec, not the script, is the word on the job's shape. The operator puts
it in every rank's environment (operator/sneppx_operator/builders.py, `rank_env`), and one place reads it
(`PodEnvironment`), so the agent and its workers agree on where the records and checkpoints are. The other half
is the agent's link to the job's rendezvous object beyond the rendezvous itself (`JobLink`): the operator's
`job/control` record in (node bounds for the next generation, pause), node rank 0's `job/report` out (what
`kubectl get etj` shows).

Where records live in a pod (docs/OPERATOR.md, "Inside the pods"):
- the rendezvous (`rdzv/<job>/...`) in the job's ConfigMap (`storage.kube`), the only object the pod's token may
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
import os
import socket
import time
from collections.abc import Mapping

from SneppX_ALG import coordinator as coordinator_lib
from SneppX_ALG import errors, storage
from SneppX_ALG.elastic import rendezvous
from SneppX_ALG.storage import job_object, kube, record

log = logging.getLogger(__name__)

CHECKPOINT_POLL_S = 2.0  # how often node rank 0's agent looks for a newly committed step (one listing)
CONTROL_POLL_S = 1.0  # how often an agent reads the operator's control record while a generation runs
REPORT_MIN_INTERVAL_S = 1.0  # rank 0's report is rewritten at most this often (it changes with each checkpoint)


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

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> PodEnvironment | None:
        """None unless SNEPPX_RENDEZVOUS_OBJECT is set; ElasticLaunchError naming a variable that is missing or
        not what the operator writes."""
        if not environ.get(job_object.ENV_OBJECT):
            return None

        def text(name: str) -> str:
            value = environ.get(name, "")
            if not value:
                raise errors.ElasticLaunchError(f"{job_object.ENV_OBJECT} is set (operator mode) but {name} is not: "
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

        job, pod = text(job_object.ENV_JOB), text(job_object.ENV_POD_NAME)
        for name, value in ((job_object.ENV_JOB, job), (job_object.ENV_POD_NAME, pod)):
            if not record.is_segment(value):
                raise errors.ElasticLaunchError(f"{name}={value!r} is not a Kubernetes name")
        hang = number(job_object.ENV_HANG_TIMEOUT, 0)
        keep = number(job_object.ENV_MAX_TO_KEEP, 0) if environ.get(job_object.ENV_MAX_TO_KEEP) else 5
        return cls(
            job=job, pod_name=pod, host=environ.get(job_object.ENV_HOST) or socket.gethostbyname(socket.gethostname()),
            procs_per_node=number(job_object.ENV_PROCS_PER_NODE, 1), min_nodes=number(job_object.ENV_MIN_NODES, 1),
            max_nodes=number(job_object.ENV_MAX_NODES, 1), step_timeout=float(hang) if hang else None,
            checkpoint_uri=text(job_object.ENV_CHECKPOINT_URI), max_to_keep=keep or None,
            rollback_depth=number(job_object.ENV_ROLLBACK_DEPTH, 0) if environ.get(job_object.ENV_ROLLBACK_DEPTH)
            else 2)


def rendezvous_store(elastic_root: str, environ: Mapping[str, str] = os.environ) -> record.RecordStore:
    """Where the rendezvous records are: the job's ConfigMap in a pod, else beside the checkpoints."""
    if environ.get(job_object.ENV_OBJECT):
        return kube.KubernetesRecordStore.from_environment(environ)
    return storage.open_record_store(elastic_root)


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

    def control(self) -> job_object.Control | None:
        """The operator's control record; None when it is absent, unreadable (logged) or the store is down."""
        try:
            stored = self.store.read(job_object.CONTROL_KEY)
            return None if stored is None else job_object.parse_control(stored.value)
        except errors.RecordError as e:
            log.warning("%s: can't read the operator's control record: %s", self.agent_id, e)
            return None

    def report(self, membership: rendezvous.Membership, resumed_from: int | None, *, force: bool = False) -> None:
        """Writes `job/report` if anything in it changed (at most every REPORT_MIN_INTERVAL_S unless `force`).
        Only node rank 0 of `membership` calls it. Store errors are logged: the next call tries again."""
        now = time.monotonic()
        if force or now - self._checked_at >= CHECKPOINT_POLL_S:
            self._checked_at = now
            self._last_valid = self._newest_committed()
        body = {"generation": membership.generation, "world_size": membership.world_size,
                "members": list(membership.agent_ids), "last_valid_checkpoint": self._ref(self._last_valid),
                "resumed_from": self._ref(resumed_from)}
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

    def _ref(self, step: int | None) -> dict[str, object] | None:
        if step is None:
            return None
        seen = self._seen.setdefault(step, now_rfc3339())
        return {"step": step, "location": f"{self.checkpoint_uri}/{storage.step_name(step)}", "time": seen}

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

    def close(self) -> None:
        if self._checkpoints is not None:
            self._checkpoints.close()


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
