"""A worker process of an ElasticTrainer run: it calls the user's train_fn once per membership generation.

Why the process outlives a generation: starting Python, importing the user's framework and initialising a GPU
take seconds, and reconnecting does not. When a generation ends (a peer failed, agents join at a checkpoint
boundary), the agent aborts this worker's collectives, train_fn returns with an error, and the same process
waits for the next `assign`: a new process group, a new coordinator, a resharded restore (in-process
reconfiguration). Only a worker that died or wedged is replaced by a new process.

The agent talks to it over `control.Channel`. A thread beats on it every `control.BEAT_INTERVAL`, so the agent
tells a stopped (SIGSTOP) or wedged process from a busy one; another reads it, so `abort` reaches the process
groups while train_fn runs. When the agent's end closes (the node is gone) the worker exits at once.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import socket
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from SneppX_ALG import collectives, errors
from SneppX_ALG import coordinator as coordinator_lib
from SneppX_ALG.collectives import store as store_lib
from SneppX_ALG.contract.env import ENV_CONTROL_FD, ENV_GENERATION, ENV_NODE_NAME
from SneppX_ALG.elastic import control, fault_tolerance, pod, rendezvous, snapshot
from SneppX_ALG.elastic.rendezvous import fence

log = logging.getLogger(__name__)



@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    """What every worker of a run is configured with (from the ElasticTrainer's arguments)."""

    checkpoint_dir: str
    elastic_root: str  # where the run's records live (rendezvous, process-group addresses)
    run_id: str
    backend: collectives.Backend = "auto"
    collective_timeout: float = 300.0
    max_to_keep: int | None = 5
    async_save: bool = True
    rollback_depth: int = 2
    max_restarts: int = 3
    snapshot_every: int = 0  # steps between peer-memory snapshots (0: none)
    snapshot_replicas: int = 1
    snapshot_memory_limit: int | None = None  # bytes (None: a quarter of the host's memory)


@dataclasses.dataclass(frozen=True)
class Assignment:
    """One generation as one worker sees it (the agent's `assign` message)."""

    membership: rendezvous.Membership
    agent_id: str
    local_rank: int
    restarts: int

    @property
    def generation(self) -> int:
        return self.membership.generation

    @property
    def node_rank(self) -> int:
        return self.membership.node_rank(self.agent_id)

    @property
    def rank(self) -> int:
        return self.membership.global_rank(self.agent_id, self.local_rank)

    @property
    def local_world_size(self) -> int:
        return self.membership.members[self.node_rank].workers

    @property
    def master(self) -> tuple[str, int]:
        """Node 0's host and a port for torchrun-style code: the number of its heartbeat port (UDP), which
        makes it stable within the generation and different between agents on one host."""
        first = self.membership.members[0]
        return first.host, int(first.heartbeat.rsplit(":", 1)[1])


class TrainContext:
    """What `train_fn(ctx)` gets: who this rank is in the current membership generation, its process groups,
    the run's (sharded) checkpoint coordinator, and what was restored.

    rank, world_size, local_rank, local_world_size, node_rank, num_nodes, generation, restarts
    group: the generation's ProcessGroup for training collectives (allreduce, reduce_scatter, ...)
    coordinator: a CheckpointCoordinator on `checkpoint_dir` saving one shard per rank (its own process group)
    restored: the CheckpointInfo of the last `restore()` (step, training_state; location "memory" when it came
        from peer-memory snapshots), or None
    rolled_back: the newer committed steps that restore() skipped because they did not validate
    device: "cpu", or "cuda:<local_rank>" with backend="nccl"
    """

    def __init__(self, assignment: Assignment, settings: WorkerSettings, group: collectives.ProcessGroup,
                 coordinator: coordinator_lib.CheckpointCoordinator, worker: Worker,
                 snapshot_group: collectives.ProcessGroup | None = None):
        self.rank = assignment.rank
        self.world_size = assignment.membership.world_size
        self.local_rank = assignment.local_rank
        self.local_world_size = assignment.local_world_size
        self.node_rank = assignment.node_rank
        self.num_nodes = len(assignment.membership.members)
        self.generation = assignment.generation
        self.restarts = assignment.restarts
        self.group = group
        self.coordinator = coordinator
        self.device = f"cuda:{assignment.local_rank}" if settings.backend == "nccl" else "cpu"
        self.restored: coordinator_lib.CheckpointInfo | None = None
        self.rolled_back: list[coordinator_lib.SkippedCheckpoint] = []
        self._settings = settings
        self._worker = worker
        self._assignment = assignment
        self._snapshot_group = snapshot_group
        self._live_state: Any = None  # what restore() filled: report(step) snapshots it when snapshot_every is set
        self._snapshot_steps: dict[int, int] = {}  # id of an object snapshot in this generation: its last step

    @property
    def membership_changing(self) -> bool:
        """True once agents wait to join (or this generation is ending): the next `save()` is the last of the
        generation. A loop that saves with `ctx.save` needs no other check."""
        return self._worker.join_pending.is_set() or self._worker.aborted.is_set()

    def restore(self, obj: Any) -> coordinator_lib.CheckpointInfo | None:
        """Loads the newest checkpoint that validates into `obj` (a dict of arrays, or an object with
        `load_sharded_state_dict`), resharded for this world size, rolling back past invalid steps: at most
        `rollback_depth` of them. RollbackLimitError past that, or when steps were committed and none validates
        (fault_tolerance.check_rollback, the FaultToleranceManager's rule): a decision for a person, so the run
        ends (the worker reports `fatal`). None: nothing was ever committed, start from scratch. Every rank
        calls it.

        With snapshot_every set, peer memory comes first: the newest snapshot every old rank's part of survives
        somewhere (resharded to this world size, every CRC checked), when no durable checkpoint is newer. The
        `restored` report says which it was, and why storage was used."""
        self._live_state = obj
        keeper = self._worker.snapshots
        listed = self.coordinator.committed_steps()
        checked: list[snapshot.Durable] = []
        decision = None
        if keeper is not None and self._snapshot_group is not None:
            def durable(floor: int | None, verdicts: Sequence[snapshot.Divergence],
                        ) -> tuple[list[snapshot.Durable], list[int]]:
                checked[:], unchecked = self._check_durable(listed, floor, verdicts)
                return checked, unchecked

            got = keeper.recover(obj, self._snapshot_group, durable)
            decision = got.decision
            if got.step is not None:
                from_memory = coordinator_lib.CheckpointInfo(got.step, "memory", got.training_state, {})
                self.restored, self.rolled_back = from_memory, [_skipped(d) for d in checked if d.step > got.step]
                self._snapshot_steps[id(obj)] = got.step
                self._worker.report("restored", generation=self.generation, rank=self.rank, step=got.step,
                                    source="memory", why=got.why, received=got.received,
                                    rolled_back=_described(self.rolled_back))
                return from_memory
        step = decision.step if decision is not None and decision.source == "storage" else None
        passed = [_skipped(d) for d in checked if step is None or d.step > step]  # newest first, as checked
        if decision is not None and decision.source == "none":  # every committed step is ruled out: a person's call
            raise errors.RollbackLimitError(decision.why, skipped=list(passed))
        before = len(self.coordinator.skipped)
        info = self.coordinator.restore(obj, step)
        skipped = passed + [s for s in self.coordinator.skipped[before:] if s.step not in {p.step for p in passed}]
        fault_tolerance.check_rollback(skipped, None if info is None else info.step,
                                       rollback_depth=self._settings.rollback_depth)
        self.restored, self.rolled_back = info, skipped
        why = decision.why if decision is not None else "peer-memory snapshots are off"
        self._worker.report("restored", generation=self.generation, rank=self.rank,
                            step=None if info is None else info.step, source="storage", why=why,
                            rolled_back=_described(skipped))
        return info

    def _check_durable(self, listed: list[int], floor: int | None, verdicts: Sequence[snapshot.Divergence],
                       ) -> tuple[list[snapshot.Durable], list[int]]:
        """The committed steps the restore decision depends on, each checked byte by byte (rank 0 checks, every
        rank learns the result, and rank 0's listing): those at or above `floor` (the newest usable snapshot's step), newest first
        until one counts; with divergence verdicts, newest first until one counts whatever the floor. None
        without either: storage's own search then checks each step as it loads it. (checked, unchecked)."""
        group = self._snapshot_group
        assert group is not None
        if floor is None and not verdicts:
            return [], list(listed)
        result: dict[str, Any] | None = None
        if group.rank == 0:
            found: list[list[Any]] = []
            gone: list[int] = []
            try:
                for step in reversed(listed):
                    if floor is not None and step < floor and not verdicts:
                        break
                    try:
                        manifest, problems = self.coordinator.checked(step)
                    except errors.CheckpointNotFoundError:
                        gone.append(step)  # deleted by retention since it was listed
                        continue
                    generation = manifest.get("generation") if manifest is not None and not problems else None
                    found.append([step, generation, problems[:5]])
                    if not problems and snapshot.binds(verdicts, generation, step) is None:
                        break
                seen = {step for step, _, _ in found} | set(gone)
                result = {"checked": found, "unchecked": [s for s in listed if s not in seen]}
            except errors.SneppXError as e:
                result = {"error": f"{type(e).__name__}: {e}"}
        answer = snapshot.allgather_json(group, result)[0]
        if "error" in answer:
            raise errors.SnapshotError(f"rank 0 could not check the committed steps a restore depends on: "
                                       f"{answer['error']}")
        checked = [snapshot.Durable(step, generation, tuple(problems))
                   for step, generation, problems in answer["checked"]]
        return checked, answer["unchecked"]  # rank 0's listing for all: a late commit may land between listings

    def snapshot(self, obj: Any, step: int, *, training_state: Any = None) -> None:
        """Keeps `obj` (what save() takes) at `step` in host memory, with a copy on another node (in the
        background), when `step` is a multiple of snapshot_every; does nothing when snapshots are off, so a
        loop may call it every step. Every rank, same step. A failure then costs the steps since the last
        snapshot, not since the last checkpoint (docs/ELASTIC.md, "Peer-memory snapshots"). With
        snapshot_every set, report(step) snapshots the state given to restore() by itself."""
        every = self._settings.snapshot_every
        keeper = self._worker.snapshots
        if (keeper is None or self._snapshot_group is None or step % every
                or step == self._snapshot_steps.get(id(obj))):
            return
        a = self._assignment
        place = os.environ.get(ENV_NODE_NAME) or a.agent_id  # a pod's Kubernetes node, else its agent
        # the state restore() fills, or (before any restore) what the run restores from; anything else is kept
        # beside it and never restored into it, however alike their layouts (issue 37, defect 2)
        role = snapshot.STATE if self._live_state is None or obj is self._live_state else snapshot.OTHER
        keeper.take(obj, step, self._snapshot_group, instance=a.membership.instance, generation=a.generation,
                    place=place, rank=a.rank, training_state=training_state, role=role)
        self._snapshot_steps[id(obj)] = step

    def save(self, obj: Any, step: int, *, training_state: Any = None) -> None:
        """Saves checkpoint `step` (every rank, same step; it commits in the background) and reports progress.
        If agents wait to join, every rank learns it here at the same step (one small allreduce): the step is
        committed, then `save` raises MembershipChangingError, which the ElasticTrainer catches to form the
        bigger generation. Don't catch it in train_fn.

        A step that is committed already (an earlier generation committed it after this one restored: the
        fence's window, docs/ELASTIC.md "Safety"; or train_fn saves the step it restored) counts as saved: the
        CheckpointExistsError, here or from a later call that learns it, is not train_fn's failure."""
        pending = np.array([1 if self._worker.join_pending.is_set() else 0], dtype=np.int64)
        self.group.allreduce(pending, op="max")
        self._submit(obj, step, training_state)
        self._worker.report("saved", generation=self.generation, rank=self.rank, step=int(step))
        if pending[0]:
            call_counting_committed_as_saved(self.coordinator.wait)
            raise errors.MembershipChangingError(
                f"generation {self.generation} ends at step {step}: agents are waiting to join", step=step)
        self._worker.wait_while_paused(self.rank, self.generation)

    def _submit(self, obj: Any, step: int, training_state: Any) -> None:
        """coordinator.save, where a step committed already counts as saved. An async save's outcome comes with
        the next call: an earlier step's CheckpointExistsError, raised before `step` began, is followed by
        saving `step` itself. Every rank decides alike (the group learns one outcome, and calls in one order)."""
        for attempt in range(2):
            try:
                self.coordinator.save(obj, step, training_state=training_state)
                return
            except errors.SneppXError as e:
                if not is_committed_already(e):
                    raise
                log.info("generation %d: a step was committed already, counted as saved: %s", self.generation, e)
                if attempt or self.coordinator.last_saved_step == step:
                    return  # the outcome of `step` itself

    def report(self, step: int, **metrics: float) -> None:
        """Tells the agent that `step` finished (a worker that reports no step for the trainer's step_timeout
        counts as hung); `metrics` (e.g. loss=) are shown by the agent's log and the demo's display.
        While the job is paused (operator mode: quorum lost with actionOnLoss Pause) it waits here, the
        training state kept in memory, until the job resumes or the generation ends."""
        keeper = self._worker.snapshots
        self._worker.report("progress", generation=self.generation, rank=self.rank, step=int(step),
                            metrics={k: float(v) for k, v in metrics.items()},
                            **({"snapshot": keeper.costs} if keeper is not None and keeper.costs else {}))
        if self._live_state is not None:
            self.snapshot(self._live_state, int(step))
        self._worker.wait_while_paused(self.rank, self.generation)


class Worker:
    """The worker process' side of the control channel (see the module docstring)."""

    def __init__(self, channel: control.Channel, settings: WorkerSettings,
                 train_fn: Callable[[TrainContext], Any]):
        self.channel = channel
        self.settings = settings
        self.train_fn = train_fn
        self.join_pending = threading.Event()
        self.aborted = threading.Event()
        self.running = threading.Event()  # cleared while the job is paused
        self.running.set()
        self._assignments: queue.Queue[dict[str, Any]] = queue.Queue()
        self._groups: list[collectives.ProcessGroup] = []
        self._groups_lock = threading.Lock()
        self.snapshots = snapshot.Keeper(
            replicas=settings.snapshot_replicas, memory_limit=settings.snapshot_memory_limit,
            report=lambda kind, **fields: self.report(kind, generation=self.generation, **fields),
        ) if settings.snapshot_every > 0 else None  # outlives generations: so does this process
        self.generation: int | None = None  # the one being run

    def report(self, kind: str, **fields: Any) -> None:
        try:
            self.channel.send(kind, **fields)
        except control.ChannelClosed:
            os._exit(1)  # the agent is gone: so is this node

    def serve(self) -> int:
        threading.Thread(target=self._beat, name="sneppx-worker-beat", daemon=True).start()
        threading.Thread(target=self._read, name="sneppx-worker-control", daemon=True).start()
        self.report("idle")
        while True:
            message = self._assignments.get()
            if message["kind"] == "exit":
                return 0
            assignment = Assignment(
                rendezvous.parse_membership(message["membership"], key="assign", run_id=self.settings.run_id,
                                            generation=message["membership"]["generation"]),
                message["agent_id"], message["local_rank"], message["restarts"])
            self.join_pending.clear()  # the agent sends `assign` only once this worker is idle
            self.aborted.clear()
            self._run_generation(assignment)
            self.report("idle", generation=assignment.generation)

    def wait_while_paused(self, rank: int, generation: int) -> None:
        """Returns at once unless the job is paused; then when it resumes. CollectiveAbortedError if the
        generation ends meanwhile (train_fn returns, and the worker is assigned the next one)."""
        while not self.running.wait(0.1):
            if self.aborted.is_set():
                raise errors.CollectiveAbortedError(f"generation {generation} ended while the job was paused",
                                                    rank=rank, generation=generation)

    def _beat(self) -> None:
        stop = threading.Event()
        while not stop.wait(control.BEAT_INTERVAL):
            self.report("beat")

    def _read(self) -> None:
        while True:
            try:
                messages = self.channel.receive(None)
            except control.ChannelClosed:
                os._exit(1)  # the agent died (its node was killed): never outlive it
            for message in messages:
                if message["kind"] in ("assign", "exit"):
                    self._assignments.put(message)
                elif message["kind"] == "join_pending":
                    self.join_pending.set()
                elif message["kind"] in ("pause", "resume"):
                    (self.running.clear if message["kind"] == "pause" else self.running.set)()
                elif message["kind"] == "abort":
                    self.aborted.set()
                    with self._groups_lock:
                        for group in self._groups:
                            group.abort()

    def _run_generation(self, a: Assignment) -> None:
        s = self.settings
        self.generation = a.generation
        set_torchrun_environment(a, s)
        records = pod.process_group_store(s.elastic_root)  # process groups' addresses, beside the checkpoints
        fence_store = pod.rendezvous_store(s.elastic_root)  # the rendezvous records: the commit fence reads them
        host = a.membership.members[a.node_rank].host  # where this node's agent is reachable: so are we
        coordinator = None
        groups: list[collectives.ProcessGroup] = []
        try:
            names = ["train", "checkpoint"] + (["snapshot"] if self.snapshots is not None else [])
            # each agent is a node of its own, even where a test runs several on one host: shared memory only
            # among the workers of a one-node generation; checkpoint and snapshot groups keep to the ring
            train_backend = "tcp" if s.backend == "auto" and len(a.membership.members) > 1 else s.backend
            for name in names:  # async saves and snapshots run their collectives beside training's
                # named by the sealed membership, not only its number: a run id used again (a job created
                # again under its name, on the same volume) starts at generation 0 again
                prefix = f"comm/{s.run_id}/{a.membership.instance}/{name}"
                ring_rank = a.rank if name != "snapshot" else snapshot.ring_order(  # a node's neighbours elsewhere
                    [m.workers for m in a.membership.members]).index(a.rank)
                groups.append(collectives.ProcessGroup(
                    store_lib.RecordKeyStore(records, prefix), ring_rank, a.membership.world_size, a.generation,
                    backend=train_backend if name == "train" else "tcp", host=host, timeout=s.collective_timeout,
                    device=a.local_rank, aborted=self.aborted))  # an abort ends its setup too
                with self._groups_lock:
                    self._groups = list(groups)
                    if self.aborted.is_set():
                        raise errors.CollectiveAbortedError(f"generation {a.generation} was aborted",
                                                            rank=a.rank, generation=a.generation)
            coordinator = coordinator_lib.CheckpointCoordinator(
                s.checkpoint_dir, max_to_keep=s.max_to_keep, async_save=s.async_save, device="cpu",
                group=groups[1], commit_fence=lambda: commit_fence(fence_store, a.membership, self.snapshots))
            self.train_fn(TrainContext(a, s, groups[0], coordinator, self, groups[2] if len(groups) > 2 else None))
            call_counting_committed_as_saved(coordinator.close)  # the last save commits (or fails) on every rank
            coordinator = None
            groups[0].barrier()  # every rank is done: no agent leaves while a peer still needs it
            self.report("done", generation=a.generation)
        except errors.MembershipChangingError as e:
            self.report("boundary", generation=a.generation, step=e.step)
        except (errors.RollbackLimitError, errors.SnapshotMemoryError, errors.ShardingMismatchError) as e:
            # no restart fixes these: the same state meets the same steps (a shape that doesn't fit stays so)
            self.report("fatal", generation=a.generation, error=f"{type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - every failure of a generation is reported to the agent, by kind
            if self.aborted.is_set() or isinstance(e, errors.CollectiveError | errors.StoreError |
                                                   errors.ShardedCheckpointError | errors.SnapshotError):
                self.report("failed", generation=a.generation, error=f"{type(e).__name__}: {e}")
            else:  # the user's code failed: this process is replaced, and the failure counted
                self.report("error", generation=a.generation, error=traceback.format_exc(limit=20)[-4000:])
                os._exit(1)
        finally:
            with self._groups_lock:
                self._groups = []
            for group in groups:
                group.abort()  # a no-op when the call that ended it was a success
                group.close()
            if self.snapshots is not None:
                try:
                    self.snapshots.wait()  # the snapshot in flight ended with its group
                except errors.SneppXError as e:
                    log.info("generation %d: its snapshot in flight ends with it: %s", a.generation, e)
            if coordinator is not None:
                try:
                    coordinator.close()
                except errors.SneppXError as e:
                    log.info("generation %d: its unfinished save ends with the generation: %s", a.generation, e)


def commit_fence(store: Any, membership: rendezvous.Membership, keeper: snapshot.Keeper | None) -> None:
    """What rank 0 checks right before a step's commit point: the generation is not over (`fence.check`), and
    no snapshot of this generation found its ranks' replicated arrays unequal (rank 0 writes them: the step
    would hold whichever copy rank 0 has). A verdict that comes after a commit binds that step at restore
    instead (`snapshot.choose`)."""
    fence.check(store, membership)
    diverged = [d for d in (keeper.divergences if keeper is not None else [])
                if (d.instance, d.generation) == (membership.instance, membership.generation)]
    if diverged:
        raise errors.ReplicaDivergenceError(
            f"generation {membership.generation}: the replicated arrays of its ranks diverged at step "
            f"{diverged[0].step}: nothing it saves is committed", step=diverged[0].step, ranks=[])


def _skipped(d: snapshot.Durable) -> coordinator_lib.SkippedCheckpoint:
    """A checked committed step a restore passed over: invalid, or saved after replicas diverged."""
    return coordinator_lib.SkippedCheckpoint(d.step, d.problems or (
        "saved after its generation's replicated arrays may have diverged (a snapshot found them unequal)",))


def _described(skipped: list[coordinator_lib.SkippedCheckpoint]) -> list[dict[str, Any]]:
    return [{"step": s.step, "problems": list(s.problems[:3])} for s in skipped]


def is_committed_already(error: BaseException) -> bool:
    """True for a save that failed only because its step is committed already: CheckpointExistsError where the
    commit found it (rank 0, or a group of one), or the ShardedCheckpointError every other rank gets for it
    (rank 0's failure alone, described as that error: engine.py's reports carry errors as text)."""
    if isinstance(error, errors.CheckpointExistsError):
        return True
    return (isinstance(error, errors.ShardedCheckpointError) and list(error.failures) == [0]
            and str(error.failures[0]).startswith(f"{errors.CheckpointExistsError.__name__}:"))


def call_counting_committed_as_saved(call: Callable[[], None]) -> None:
    """coordinator.wait or close: an async save's outcome, where a step committed already counts as saved."""
    try:
        call()
    except errors.SneppXError as e:
        if not is_committed_already(e):
            raise
        log.info("a step was committed already, counted as saved: %s", e)


def set_torchrun_environment(a: Assignment, s: WorkerSettings) -> None:
    """The variables torchrun sets, so code written for its contract runs unchanged."""
    master_addr, master_port = a.master
    os.environ.update({
        "RANK": str(a.rank), "WORLD_SIZE": str(a.membership.world_size), "LOCAL_RANK": str(a.local_rank),
        "LOCAL_WORLD_SIZE": str(a.local_world_size), "GROUP_RANK": str(a.node_rank),
        "NODE_RANK": str(a.node_rank), "ROLE_RANK": str(a.rank), "ROLE_WORLD_SIZE": str(a.membership.world_size),
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "TORCHELASTIC_RUN_ID": s.run_id,
        "TORCHELASTIC_RESTART_COUNT": str(a.restarts), "TORCHELASTIC_MAX_RESTARTS": str(s.max_restarts),
        ENV_GENERATION: str(a.generation),
    })


def main(train_fn: Callable[[TrainContext], Any], settings: WorkerSettings) -> int:
    """A worker process' whole life (the ElasticTrainer calls it when SNEPPX_CONTROL_FD is set)."""
    channel = control.Channel(socket.socket(fileno=int(os.environ[ENV_CONTROL_FD])))
    return Worker(channel, settings, train_fn).serve()
