"""The node agent of an ElasticTrainer run: one per node, it supervises the node's worker processes and takes the
node through membership generations.

    join (rendezvous) -> run the generation -> it ends:
        every worker finished       -> mark the run finished, exit 0
        agents wait to join         -> the workers stop at a checkpoint boundary -> join the next (bigger) one
        a failure                   -> abort the workers' collectives, count the failure (max_restarts), back off
                                       (restart_delay), join the next generation with who is left
        an error no retry can fix   -> mark the run failed, exit EXIT_FAILED
        a worker OOM-killed (pod)   -> exit 137 without marking the run: the pod fails, OOMKilled (OutOfMemory)

What counts as a failure, and how fast it is seen:
- a worker of this node exits or is killed: its end of the control channel closes (at once);
- a worker stops beating for `hang_timeout` (stopped, or wedged where even a thread can't run): it is killed;
- a worker reports no step for `step_timeout` (alive but stuck, e.g. a deadlock in Python): it is killed;
- a worker's collectives fail (a peer's process died: its connections reset at once, PeerLostError);
- another node's agent falls silent on the heartbeat (`heartbeat_timeout`: the node is gone);
- the next generation was opened by another agent (it saw one of the above first).
Surviving workers keep their processes (worker.py); a killed or dead one is replaced before the next generation.

The node's own state is one `lifecycle.Lifecycle` (elastic.c's table), which the agent moves as it goes through
the above (`_transition`: docs/ELASTIC.md, "Node lifecycle", says which event where); a move the table forbids
raises. Each worker's state in the current generation is a `WorkerState`.

Every decision is written as a JSON line to `events_path` (one file per agent; "-": standard output, the pod's
log in operator mode), with the node's lifecycle state: the figures of `bench elastic` and `bench operator` and the
demo's display come from there.

In operator mode (`operator_mode`, pod.py) the agent is its pod's command: its rendezvous records are in the job's
ConfigMap, it takes the node bounds of each generation from the operator's `job/control` and follows its pause,
and while its node is rank 0 it keeps `job/report` current and reports in `job/hung/<pod>` each peer that has
been out of the generations (neither a member nor waiting to join) for the job's hang timeout: a pod whose agent
is wedged stays Running and Ready, and only that report gets it replaced (pod.AbsentMembers); while too few
agents joined to form the next generation, the agent sealing it reports instead (`_forming`). Failures that end
only this agent (its restart budget, a join timeout) exit with EXIT_NODE_FAILED without marking the run
finished: the pod fails and the operator's failurePolicy decides (a replacement pod, counted against
maxRestarts).

One concept, hence over 500 lines: a node's agent (its settings, its view of each worker process and the loop
that drives them through generations); the rules it applies (rendezvous, fault tolerance, the lifecycle table) are
the modules below it.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from SneppX_ALG import errors
from SneppX_ALG.contract import job_object
from SneppX_ALG.contract.env import ENV_CONTROL_FD, ENV_LOCAL_RANK
from SneppX_ALG.elastic import control, heartbeat, pod, rendezvous
from SneppX_ALG.elastic.fault_tolerance import FaultToleranceManager
from SneppX_ALG.elastic.lifecycle import Lifecycle

log = logging.getLogger(__name__)

EXIT_FAILED = 3  # the run failed for good (budget, rollback limit, join timeout): the result file says why
EXIT_NODE_FAILED = 1  # operator mode: this agent gave up (budget, join timeout); its pod fails and is replaced
EXIT_OOM_KILLED = 128 + signal.SIGKILL  # operator mode: a worker was OOM-killed; the container ends as on cgroup v2
TICK = 0.02  # how often the agent looks at its workers when nothing arrives
FIRST_CONTACT_POLLS = 1.5  # a waiting agent's longest poll period is 1.2 poll_cap (jitter); and a margin


@dataclasses.dataclass(frozen=True)
class AgentSettings:
    run_id: str
    agent_id: str
    host: str
    workers: int
    elastic_root: str
    worker_command: Sequence[str]
    worker_env: Mapping[str, str]
    rendezvous: rendezvous.RendezvousConfig
    max_restarts: int = 3
    restart_delay: float = 1.0
    heartbeat_interval: float = 0.1
    heartbeat_timeout: float = 0.8
    hang_timeout: float = 1.0
    start_timeout: float = 120.0  # a new worker process has this long to import and say it is ready
    step_timeout: float | None = None
    abort_grace: float = 5.0
    poll_period: float = 0.25
    events_path: str | None = None  # "-": standard output
    result_path: str | None = None
    operator_mode: bool = False  # a pod of an ElasticTrainingJob (pod.py): records in the job's ConfigMap
    checkpoint_dir: str = ""  # operator mode: where node rank 0 looks for the last valid checkpoint


class WorkerState(enum.Enum):
    """Where one worker process is in the current generation (the node's own state is its `Lifecycle`)."""

    DEAD = "dead"  # no process (never started, killed, or it exited): replaced before the next generation
    STARTING = "starting"  # spawned, never assigned: it has `start_timeout` to import and say it is ready
    RUNNING = "running"  # assigned to the current generation: its train_fn runs
    DONE = "done"  # its train_fn returned and every rank passed the last barrier: training is over
    BOUNDARY = "boundary"  # it stopped at a checkpoint boundary so that waiting agents can join
    FAILED = "failed"  # its collectives failed (a peer died, or the generation was aborted)


@dataclasses.dataclass(frozen=True)
class Outcome:
    kind: str  # done | boundary | failure | fatal
    reason: str = ""
    suspects: frozenset[str] = frozenset()


class WorkerProcess:
    """One worker process of this node and what the agent knows of it."""

    def __init__(self, local_rank: int):
        self.local_rank = local_rank
        self.proc: subprocess.Popen[bytes] | None = None
        self.channel: control.Channel | None = None
        self.state = WorkerState.DEAD
        self.idle = False  # it said it waits for an `assign` (after starting, or once a generation ended)
        self.generation: int | None = None
        self.rank: int | None = None
        self.fatal: str | None = None  # its fatal error, whenever it was read: it ends the run
        self.last_beat = self.last_progress = time.monotonic()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self.channel is not None

    def spawn(self, command: Sequence[str], env: Mapping[str, str]) -> None:
        mine, theirs = socket.socketpair()
        self.proc = subprocess.Popen(list(command), pass_fds=(theirs.fileno(),),
                                     env={**env, ENV_CONTROL_FD: str(theirs.fileno()),
                                          ENV_LOCAL_RANK: str(self.local_rank)})
        theirs.close()
        self.channel = control.Channel(mine)
        self.state, self.generation, self.idle = WorkerState.STARTING, None, False
        self.last_beat = self.last_progress = time.monotonic()

    def send(self, kind: str, **fields: Any) -> bool:
        if self.channel is None:
            return False
        try:
            self.channel.send(kind, **fields)
            return True
        except control.ChannelClosed:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()
        if self.channel is not None:
            self.channel.close()
        self.proc, self.channel, self.state = None, None, WorkerState.DEAD

    def how_it_ended(self) -> str:
        code = None if self.proc is None else self.proc.poll()
        if code is None:
            return "its control channel closed"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"


class Terminated(BaseException):
    """SIGTERM in operator mode: the pod is being deleted (a resize, the job's end, a node drained).

    A BaseException, as KeyboardInterrupt is: the signal lands wherever the agent's main thread is, often inside
    a record store call, whose `except Exception` turned it into a RecordUnavailableError that the rendezvous
    poll logs and retries; the handler had set SIGTERM to SIG_IGN, so the pod trained on until SIGKILL."""


class OutOfMemory(Exception):
    """Operator mode: the kernel's OOM killer killed a worker (the container's memory limit). On cgroup v2 the
    kubelet has the whole container killed then (memory.oom.group); on v1 only the worker dies. Either way the
    pod ends with 137 and the runtime's reason OOMKilled, so `kubectl get pods`, restartHistory and
    failurePolicy's exit-code rules see the same thing, and a limit too small is not retried inside the pod."""


def _terminate(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the agent is on its way out
    raise Terminated()


class NodeAgent:
    def __init__(self, settings: AgentSettings):
        self.s = settings
        self.records = pod.rendezvous_store(settings.elastic_root)
        self.link = pod.JobLink(self.records, settings.checkpoint_dir, settings.agent_id) if settings.operator_mode \
            else None
        self.absent = pod.AbsentMembers(settings.agent_id) if settings.operator_mode else None  # hung peers
        self.paused = False
        self.step_timeout = settings.step_timeout  # operator mode: the control record's, from the next generation
        self.resumed_from: int | None = None  # the step this generation restored (rank 0's report)
        self.resumed_source = "storage"  # where from: "memory" (peer-memory snapshots) or its step on storage
        # bound once, held for the agent's life: a port released between generations could be taken meanwhile
        self.heartbeat_socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.heartbeat_socket.bind((settings.host, 0))
        self.heartbeat_address = f"{settings.host}:{self.heartbeat_socket.getsockname()[1]}"
        self.rdzv = rendezvous.Rendezvous(self.records, settings.run_id, agent_id=settings.agent_id,
                                          host=settings.host, heartbeat=self.heartbeat_address,
                                          workers=settings.workers, config=settings.rendezvous,
                                          on_forming=self._forming if settings.operator_mode else None)
        self.ft = FaultToleranceManager(max_restarts=settings.max_restarts, restart_delay=settings.restart_delay,
                                        max_restart_delay=max(60.0, settings.restart_delay))
        self.workers = [WorkerProcess(i) for i in range(settings.workers)]
        self.generation: int | None = None
        self.lifecycle = Lifecycle()  # this node's state (elastic.c's table): moved by _transition, checked there
        self.oom_kills = pod.oom_kills() if settings.operator_mode else None  # the container's count at start

    # -- the agent's life --

    def run(self) -> int:
        code, reason = EXIT_FAILED, ""
        if self.s.operator_mode:  # the pod's first process: SIGTERM's default action would not apply to PID 1
            signal.signal(signal.SIGTERM, _terminate)
        self._event("started", pid=os.getpid(), heartbeat=self.heartbeat_address)
        try:
            membership = self._join(None, frozenset())
            while True:
                outcome = self._run_generation(membership)
                if outcome.kind in ("done", "fatal"):  # the run is over: this node leaves it, or fails with it
                    self._transition("leave" if outcome.kind == "done" else "fatal")
                if outcome.kind == "done":
                    if self.link is not None and membership.node_rank(self.s.agent_id) == 0:
                        self.link.report(membership, self.resumed_from, self.resumed_source, force=True)  # the last step saved
                    self.rdzv.finish("completed")
                    code, reason = 0, "completed"
                    return code
                if outcome.kind == "fatal":
                    reason = f"failed: {outcome.reason}"
                    self.rdzv.finish(reason)
                    return code
                if outcome.kind == "failure":
                    delay = self.ft.record_failure(outcome.reason)
                    self._event("backoff", generation=membership.generation, restarts=self.ft.restarts, delay=delay)
                    time.sleep(delay)
                membership = self._join(membership, outcome.suspects)
        except errors.RestartBudgetExhaustedError as e:
            self._transition("budget_exhausted")
            reason = f"failed: {e}"
            if self.s.operator_mode:  # this pod gives up; the operator's budget decides about the job
                code = EXIT_NODE_FAILED
                return code
            self.rdzv.finish(reason)
            return code
        except errors.RendezvousClosedError as e:
            self._transition("leave")  # another agent marked the run finished while this one joined
            finished = self.records.read(rendezvous.finished_key(self.s.run_id))
            reason = str(finished.value.get("reason", "")) if finished is not None else str(e)
            code = 0 if reason == "completed" else EXIT_FAILED
            return code
        except errors.RendezvousTimeoutError as e:
            self._transition("timeout")
            reason = f"failed: {e}"
            code = EXIT_NODE_FAILED if self.s.operator_mode else code
            return code
        except Terminated:
            if not self.lifecycle.finished:  # SIGTERM may come after the node left: then there is nothing to leave
                self._transition("leave")
            code, reason = 128 + signal.SIGTERM, "terminated (SIGTERM): the pod is being deleted"
            for w in self.workers:  # now: what they hold in memory is in the checkpoints or lost anyway
                w.kill()
            return code
        except OutOfMemory as e:
            self._transition("fatal")  # the pod ends: it is not retried here (see OutOfMemory)
            code, reason = EXIT_OOM_KILLED, f"failed: {e}"
            for w in self.workers:
                w.kill()
            return code
        except Exception as e:  # a bug of ours: say what it was wherever the result is read
            reason = f"failed: the node agent crashed: {type(e).__name__}: {e}"
            raise
        finally:
            if self.link is not None:
                self.link.close()
            for w in self.workers:
                w.send("exit")
            deadline = time.monotonic() + 5
            for w in self.workers:
                if w.proc is not None:
                    try:
                        w.proc.wait(max(0.0, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        pass
                w.kill()
            self.heartbeat_socket.close()
            self._event("exit", code=code, reason=reason)
            if self.s.result_path:
                write_json(self.s.result_path, {"code": code, "reason": reason, "history": self.ft.status()["failures"],
                                                "lifecycle": self._lifecycle_status()})

    def _join(self, previous: rendezvous.Membership | None, suspects: frozenset[str]) -> rendezvous.Membership:
        """Joins the first generation (previous None: the lifecycle's `join`) or the one after `previous` (the
        lifecycle is `reconfiguring` already: _run_generation moved it), and records the generation formed
        (`reconfigured`, with the rendezvous' number)."""
        started = time.monotonic()
        if previous is None:
            self._transition("join")
        for w in self.workers:  # replace dead workers while the rendezvous forms
            if not w.alive:
                w.kill()
                w.spawn(self.s.worker_command, self.s.worker_env)
        if self.link is not None:
            self._follow_bounds(self.link.control())
        if self.absent is not None and previous is not None:
            self.absent.ended(time.monotonic())  # its peers are present again once they join the next one
        membership = self.rdzv.join(previous=previous, suspects=suspects)
        self._transition("reconfigured", membership.generation)
        if self.absent is not None:
            self.absent.formed(membership, time.monotonic())
        self.resumed_from = None
        self._event("generation", generation=membership.generation, world_size=membership.world_size,
                    members=list(membership.agent_ids), joined_in=time.monotonic() - started,
                    node_rank=membership.node_rank(self.s.agent_id))
        if self.link is not None and membership.node_rank(self.s.agent_id) == 0:
            self.link.report(membership, None, force=True)
        return membership

    def _follow_bounds(self, control_record: job_object.Control | None) -> None:
        """Operator mode: the next generation forms with the node bounds of the operator's control record
        (elastic.minNodes/maxNodes as they are now; a change never touches a running generation), and its
        workers are held to its hang timeout (failurePolicy.hangTimeoutSeconds; 0: none)."""
        if control_record is None:
            return
        self.step_timeout = float(control_record.hang_timeout_seconds) or None
        config = self.rdzv.config
        try:
            self.rdzv.config = dataclasses.replace(config, min_nodes=max(1, control_record.min_nodes),
                                                   max_nodes=control_record.max_nodes)
        except ValueError as e:
            log.warning("%s: ignoring the control record's node bounds: %s", self.s.agent_id, e)
            return
        if self.rdzv.config != config:
            self._event("bounds", min_nodes=self.rdzv.config.min_nodes, max_nodes=self.rdzv.config.max_nodes)

    def _follow_operator(self, m: rendezvous.Membership, now: float, due: float) -> float:
        """Operator mode, while a generation runs: the pause in the control record (every CONTROL_POLL_S) and,
        on node rank 0, the job's report. Returns when to read the control record next."""
        assert self.link is not None
        if now >= due:
            due = now + pod.CONTROL_POLL_S
            control_record = self.link.control()
            paused = bool(control_record is not None and control_record.paused)
            if paused != self.paused:
                self.paused = paused
                self._event("paused" if paused else "resumed", generation=m.generation,
                            reason=control_record.reason if control_record is not None else "")
                for w in self.workers:
                    w.send("pause" if paused else "resume")
        if self.paused:  # a paused worker makes no progress, and is not hung
            for w in self.workers:
                w.last_progress = now
        if m.node_rank(self.s.agent_id) == 0:
            self.link.report(m, self.resumed_from, self.resumed_source)
        return due

    def _report_absent(self, m: rendezvous.Membership, nxt: rendezvous.NextGeneration, now: float) -> None:
        """Operator mode, after each poll of the running generation: who waits to join (no longer absent) and,
        on node rank 0, `job/hung/<pod>` for each peer out of the generations for the hang timeout (the control
        record's, `step_timeout`). Store errors are logged; what is still due goes at the next poll."""
        assert self.absent is not None and self.link is not None
        self.absent.waiting(nxt.waiting, now)
        if m.node_rank(self.s.agent_id) != 0:
            return
        for hung in self.link.report_hung(self.absent, self.step_timeout):
            self._event("hung_reported", generation=m.generation, pod=hung.pod, rank=hung.rank,
                        last_generation=hung.generation, silent_seconds=hung.silent_seconds)

    def _forming(self, previous: rendezvous.Membership, joined: tuple[str, ...]) -> None:
        """Operator mode, at each poll while this agent seals the generation after `previous`: who has joined
        (no longer absent) and, while fewer than min_nodes did (no generation can form, so no rank 0 of a
        running one will report anyone), `job/hung/<pod>` for each peer out for `pod.stalled_report_after`: a
        wedged pod is replaced before the waiting agents' join timeout ends them (minNodes = maxNodes)."""
        assert self.absent is not None and self.link is not None
        if self.s.agent_id not in previous.agent_ids:  # a late joiner: that generation went on without it
            return
        self.absent.waiting(joined, time.monotonic())
        config = self.rdzv.config
        after = pod.stalled_report_after(self.step_timeout, config.join_timeout, len(joined), config.min_nodes)
        for hung in self.link.report_hung(self.absent, after):
            self._event("hung_reported", generation=previous.generation + 1, pod=hung.pod, rank=hung.rank,
                        last_generation=hung.generation, silent_seconds=hung.silent_seconds, forming=True)

    # -- one generation --

    def _run_generation(self, m: rendezvous.Membership) -> Outcome:
        self.generation = m.generation
        others = {mm.heartbeat: mm.agent_id for mm in m.members if mm.agent_id != self.s.agent_id}
        hb = None
        if others:
            # the members learn of the seal up to one rendezvous poll (jittered) apart, and a peer starts beating
            # only then: one not heard from yet is judged from when it could have started
            hb = heartbeat.HeartbeatMonitor(list(others), sock=self.heartbeat_socket, job_id=self.s.run_id,
                                            interval=self.s.heartbeat_interval, timeout=self.s.heartbeat_timeout,
                                            first_contact_grace=FIRST_CONTACT_POLLS * self.rdzv.config.poll_cap,
                                            generation=m.generation).start()
        try:
            outcome = self._watch(m, hb, others)
            if outcome.kind == "failure":  # the membership re-forms with who is left
                self._transition("peer_failed")
            elif outcome.kind == "boundary":  # it re-forms to take in the agents waiting to join
                self._transition("join")
            if outcome.kind in ("failure", "fatal"):
                outcome = dataclasses.replace(outcome, suspects=self._settle(m, hb, others, outcome.suspects))
                self._abort_workers(m)
                fatal = next((w.fatal for w in self.workers if w.fatal), None)
                if fatal is not None and outcome.kind != "fatal":  # read while the generation ended: it still ends
                    outcome = Outcome("fatal", fatal, outcome.suspects)  # the run, not only the generation
            return outcome
        finally:
            if hb is not None:
                hb.stop()

    def _watch(self, m: rendezvous.Membership, hb: heartbeat.HeartbeatMonitor | None,
               others: Mapping[str, str]) -> Outcome:
        join_pending = False
        next_poll = time.monotonic()
        assign = {"membership": rendezvous.membership_to_json(m), "agent_id": self.s.agent_id,
                  "restarts": self.ft.restarts}
        for w in self.workers:
            if w.alive and w.idle:  # a survivor of the last generation, waiting in the same process
                self._assign(w, m, assign)
            if self.paused:
                w.send("pause")
        control_due = 0.0
        while True:
            # who had exited before this read: a worker's last words (its error) are in its channel before it
            # exits, so they are read first and name the failure, not the exit they caused
            exited = [w for w in self.workers if not w.alive]
            outcome = self._read_workers(m, assign)
            if outcome is not None:
                return outcome
            now = time.monotonic()
            if self.link is not None:
                control_due = self._follow_operator(m, now, control_due)
            for w in self.workers:
                if w in exited:
                    return self._failure(f"worker {w.local_rank} (rank {w.rank}) of {self.s.agent_id} "
                                         f"{w.how_it_ended()}")
                silent = now - w.last_beat
                if silent > (self.s.start_timeout if w.state is WorkerState.STARTING else self.s.hang_timeout):
                    w.kill()
                    return self._failure(f"worker {w.local_rank} (rank {w.rank}) of {self.s.agent_id} sent no "
                                         f"heartbeat for {silent:.1f}s (stopped or wedged): killed")
                stuck = now - w.last_progress
                if self.step_timeout is not None and w.state is WorkerState.RUNNING and stuck > self.step_timeout:
                    w.kill()
                    return self._failure(f"worker {w.local_rank} (rank {w.rank}) of {self.s.agent_id} finished no "
                                         f"step for {stuck:.1f}s (step_timeout): killed")
            if hb is not None:
                gone = {p: s for p, s in hb.status().items() if p in others and s.suspected}
                if gone and self._run_completed():
                    return Outcome("done")  # the others finished and left first
                if gone:
                    return self._failure(heartbeat_reason(gone, others, hb.stats().stalls),
                                         suspects=frozenset(others[p] for p in gone))
            if now >= next_poll:
                next_poll = now + self.s.poll_period
                try:
                    nxt = self.rdzv.poll(m)
                except errors.RecordUnavailableError as e:
                    log.warning("%s: can't poll the rendezvous: %s", self.s.agent_id, e)
                    continue
                if nxt.superseded and not join_pending and not at_boundary(nxt):
                    # a worker's own report, if it came meanwhile, says more than the others' reaction to it
                    return self._read_workers(m, assign) or self._failure(nxt.why())
                if self.absent is not None and not nxt.superseded:
                    self._report_absent(m, nxt, now)
                if nxt.admits and not join_pending:  # a spare beyond max_nodes is never a boundary
                    join_pending = True
                    self._event("join_pending", generation=m.generation, waiting=sorted(nxt.waiting))
                    for w in self.workers:
                        w.send("join_pending")

    def _read_workers(self, m: rendezvous.Membership, assign: dict[str, Any]) -> Outcome | None:
        channels = {w.channel.fileno(): w for w in self.workers if w.channel is not None}
        ready, _, _ = select.select(list(channels), [], [], TICK)
        first: Outcome | None = None
        for fd in ready:
            w = channels[fd]
            try:
                messages = w.channel.receive(0) if w.channel is not None else []
            except control.ChannelClosed:
                if w.proc is not None:
                    try:
                        w.proc.wait(1.0)  # its exit code or signal, for the reason
                    except subprocess.TimeoutExpired:
                        w.proc.kill()
                ended = f"worker {w.local_rank} (rank {w.rank}) of {self.s.agent_id} {w.how_it_ended()}"
                if self._oom_killed(w):
                    raise OutOfMemory(f"{ended}: the kernel's OOM killer (the container's memory limit)")
                first = first or Outcome("failure", ended)
                continue
            for message in messages:  # all of them: a worker's `failed` and `idle` may come in one read
                outcome = self._on_message(w, message, m, assign)
                if first is None or (outcome is not None and outcome.kind == "fatal" and first.kind != "fatal"):
                    first = outcome or first  # a fatal error outranks the failures it caused in the same read
        if first is not None:
            return self._failure(first.reason) if first.kind == "failure" else first
        states = {w.state for w in self.workers}
        if states == {WorkerState.DONE}:
            self._event("done", generation=m.generation)
            return Outcome("done")
        if states == {WorkerState.BOUNDARY}:
            self._event("boundary", generation=m.generation)
            return Outcome("boundary")
        return None

    def _oom_killed(self, w: WorkerProcess) -> bool:
        """Was this SIGKILLed worker the OOM killer's? Its container's OOM count rose since the agent started
        (the agent's own SIGKILLs, of hung workers, leave the count as it was)."""
        if self.oom_kills is None or w.proc is None or w.proc.returncode != -signal.SIGKILL:
            return False
        now = pod.oom_kills()
        return now is not None and now > self.oom_kills

    def _on_message(self, w: WorkerProcess, message: dict[str, Any], m: rendezvous.Membership,
                    assign: dict[str, Any]) -> Outcome | None:
        kind, now = message["kind"], time.monotonic()
        w.last_beat = now
        if kind == "idle":
            w.idle = True
            if w.generation != m.generation:
                self._assign(w, m, assign)
        elif kind == "fatal":  # of whichever generation: an error no restart fixes is not an old generation's alone
            w.fatal = fatal_reason(w, message)
            return Outcome("fatal", w.fatal)
        elif message.get("generation") != m.generation:
            return None  # beats, and the last words of a generation that is over
        elif kind == "saved":
            w.last_progress = now
            if message.get("rank") == 0:
                self._event("saved", generation=m.generation, step=message.get("step"))
        elif kind == "progress":
            w.last_progress = now
            if message.get("rank") == 0:
                self._event("step", generation=m.generation, step=message.get("step"),
                            metrics=message.get("metrics", {}),  # and what the newest snapshot cost, if any
                            **({"snapshot": message["snapshot"]} if isinstance(message.get("snapshot"), dict) else {}))
        elif kind == "restored":
            if message.get("rank") == 0:
                self._event("restored", generation=m.generation, step=message.get("step"),
                            source=message.get("source", "storage"), why=message.get("why", ""),
                            rolled_back=message.get("rolled_back", []),  # and the bytes peers sent it, if any
                            **({"received": message["received"]} if "received" in message else {}))
                step = message.get("step")
                self.resumed_from = step if isinstance(step, int) and not isinstance(step, bool) else None
                self.resumed_source = "memory" if message.get("source") == "memory" else "storage"
                if self.link is not None and m.node_rank(self.s.agent_id) == 0:
                    self.link.report(m, self.resumed_from, self.resumed_source, force=True)
        elif kind == "snapshot_corrupt":  # a copy that failed its CRCs: dropped, another copy or storage used
            self._event("snapshot_corrupt", generation=m.generation, rank=w.rank, step=message.get("step"),
                        source=message.get("source"), problems=message.get("problems", []))
        elif kind == "snapshot_unprotected":  # a part with fewer copies off its node than asked: its node's loss
            self._event("snapshot_unprotected", generation=m.generation, rank=w.rank,  # costs storage's steps
                        place=message.get("place"), copies=message.get("copies"), replicas=message.get("replicas"),
                        nodes=message.get("nodes"))
        elif kind == "snapshot_placed":  # rank 0's: every rank whose part lacks copies off its node (job status)
            if self.link is not None and message.get("rank") == 0 and isinstance(message.get("unprotected"), list):
                self.link.placed(m, message["unprotected"])
                if m.node_rank(self.s.agent_id) == 0:
                    self.link.report(m, self.resumed_from, self.resumed_source, force=True)
        elif kind in ("done", "boundary"):
            w.state = WorkerState(kind)
        elif kind == "failed":
            w.state = WorkerState.FAILED
            return Outcome("failure", f"rank {w.rank}'s collectives failed: {message.get('error', '')[:500]}")
        elif kind == "error":
            return Outcome("failure", f"rank {w.rank}'s train_fn raised: {message.get('error', '')[-1500:]}")
        return None

    def _assign(self, w: WorkerProcess, m: rendezvous.Membership, assign: dict[str, Any]) -> None:
        w.send("assign", local_rank=w.local_rank, **assign)
        w.state, w.generation, w.idle = WorkerState.RUNNING, m.generation, False
        w.rank = m.global_rank(self.s.agent_id, w.local_rank)
        w.last_progress = time.monotonic()

    def _run_completed(self) -> bool:
        try:
            finished = self.records.read(rendezvous.finished_key(self.s.run_id))
        except errors.RecordError:
            return False
        return finished is not None and finished.value.get("reason") == "completed"

    def _failure(self, reason: str, suspects: frozenset[str] = frozenset()) -> Outcome:
        log.warning("%s: %s", self.s.agent_id, reason)
        self._event("failure", generation=self.generation, reason=reason)
        return Outcome("failure", reason, suspects)

    def _settle(self, m: rendezvous.Membership, hb: heartbeat.HeartbeatMonitor | None, others: Mapping[str, str],
                suspects: frozenset[str]) -> frozenset[str]:
        """Before joining the next generation: wait until each other member is known to be alive (heard on the
        heartbeat well after the failure: a dead node sends nothing then) or to have joined it, or has stayed
        silent, so the join names every node that is gone and the sealer need not wait for them (settle_verdict
        has the rule). Live peers settle in about two heartbeat intervals. A one-node generation has no one to
        wait for."""
        if hb is None:
            return frozenset()
        started = time.monotonic()
        while True:
            suspected = set(suspects) | {others[p] for p in hb.suspected_peers() if p in others}
            elapsed = time.monotonic() - started
            since = elapsed - 2 * self.s.heartbeat_interval
            alive = {others[p] for p, view in hb.status().items()
                     if p in others and view.last_alive is not None and view.last_alive < since}
            try:
                moved = set(self.rdzv.poll(m).closing)
            except errors.RecordUnavailableError:
                moved = set()
            settled, gone = settle_verdict(set(others.values()), suspected, alive, moved, elapsed,
                                           self.s.heartbeat_timeout)
            if settled:
                return gone
            time.sleep(TICK)

    def _abort_workers(self, m: rendezvous.Membership) -> None:
        """Ends the generation's collectives on every worker; one that doesn't come back idle within
        `abort_grace` is wedged, and is killed (replaced before the next generation)."""
        for w in self.workers:
            if w.alive and not w.idle and w.state is not WorkerState.STARTING:
                w.send("abort")
        deadline = time.monotonic() + self.s.abort_grace
        while True:
            busy = {w.channel.fileno(): w for w in self.workers
                    if w.alive and not w.idle and w.state is not WorkerState.STARTING and w.channel is not None}
            if not busy or time.monotonic() >= deadline:
                break
            ready, _, _ = select.select(list(busy), [], [], TICK)
            for fd in ready:
                w = busy[fd]
                try:
                    for message in w.channel.receive(0) if w.channel is not None else []:
                        w.last_beat = time.monotonic()
                        w.idle = w.idle or message["kind"] == "idle"
                        if message["kind"] == "fatal":
                            w.fatal = fatal_reason(w, message)
                except control.ChannelClosed:
                    w.kill()
        for w in self.workers:
            if w.alive and not w.idle and w.state is not WorkerState.STARTING:
                log.warning("%s: worker %d did not end generation %d within %.1fs: killed", self.s.agent_id,
                            w.local_rank, m.generation, self.s.abort_grace)
                w.kill()

    def _transition(self, event: str, generation: int | None = None) -> None:
        """Moves this node's lifecycle by `event` and says so (a `lifecycle` event, a log line). An event its
        state does not allow raises LifecycleError and changes nothing: the agent went somewhere the table
        says it can't, a bug to see, not a state to drift into."""
        before = self.lifecycle.state
        after = self.lifecycle.fire(event, generation)
        status = self._lifecycle_status()
        log.info("%s: %s: %s -> %s (generation %s)", self.s.agent_id, event, before, after, status["generation"])
        self._event("lifecycle", event=event, previous=before, **status)

    def _lifecycle_status(self) -> dict[str, Any]:
        """The node's lifecycle for events and the result file: its state, the generation its last
        `reconfigured` recorded (None before the first) and how many transitions it made."""
        node = self.lifecycle
        return {"state": node.state, "generation": node.generation if node.formed else None,
                "transitions": node.transitions}

    def _event(self, kind: str, **fields: Any) -> None:
        if self.s.events_path is None:
            return
        line = json.dumps({"t": time.time(), "agent": self.s.agent_id, "kind": kind, "lifecycle": self.lifecycle.state,
                           **fields}, allow_nan=False)
        if self.s.events_path == "-":
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
            return
        with open(self.s.events_path, "a") as f:
            f.write(line + "\n")


def fatal_reason(w: WorkerProcess, message: dict[str, Any]) -> str:
    """What a worker's `fatal` report says, as the run's reason."""
    return f"rank {w.rank}: {str(message.get('error', ''))[:1500]}"


def heartbeat_reason(gone: Mapping[str, heartbeat.PeerStatus], others: Mapping[str, str], stalls: int) -> str:
    """Why the heartbeat failed a generation (`gone`: the suspected peers' status), told apart: a peer heard from
    that fell silent (for how long), and one never heard from this generation (it never started beating, or
    started later than the first contact grace). Whether this monitor's own thread stalled meanwhile is said too:
    a loaded machine, not a dead peer."""
    silent = sorted((others[p], s.last_alive) for p, s in gone.items() if s.last_alive is not None)
    never = sorted(others[p] for p, s in gone.items() if s.last_alive is None)
    parts = []
    if silent:
        ago = ", ".join(f"{seconds:.1f}s" for _, seconds in silent)
        parts.append(f"node {', '.join(n for n, _ in silent)} fell silent on the heartbeat (last alive {ago} ago)")
    if never:
        parts.append(f"node {', '.join(never)} was never heard from on the heartbeat this generation")
    return "; ".join(parts) + (f" ({stalls} stalls of this monitor)" if stalls else "")


def at_boundary(nxt: rendezvous.NextGeneration) -> bool:
    """Other members joined the next generation while agents wait that it can admit: they stopped at a checkpoint
    boundary for them, which this agent's workers reached too (every rank learns of it in the same `ctx.save`),
    before this agent's own poll saw anyone wait. A boundary, not a failure: if it was a failure after all, the
    workers' collectives tell (the others' abort closes their connections)."""
    return bool(nxt.closing) and not nxt.sealed and not nxt.collected and nxt.admits


def settle_verdict(others: set[str], suspected: set[str], alive: set[str], moved: set[str], elapsed: float,
                   timeout: float) -> tuple[bool, frozenset[str]]:
    """Whether the settle wait is over, and who is gone: (settled, gone).

    A peer is settled once it is alive (heard after the failure), or has joined the next generation. One that is
    suspected is named gone only after it had a heartbeat timeout to answer: a peer suspected a moment before the
    failure (a short stall, a lost burst of datagrams) is often alive, and naming it gone would leave a live node
    out of the next generation. After two timeouts every peer not heard from is gone."""
    pending = others - alive - moved
    gone = frozenset(pending & suspected) if elapsed >= timeout else frozenset()
    if not pending or elapsed >= 2 * timeout:
        return True, frozenset(pending)
    return pending <= gone, gone


def write_json(path: str, value: Any) -> None:
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "w") as f:
        json.dump(value, f)
    os.replace(temporary, path)
