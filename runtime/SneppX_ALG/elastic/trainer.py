"""ElasticTrainer: training that survives a killed node, a hung rank or a corrupt checkpoint without a person.

    trainer = ElasticTrainer(train_fn=train_loop, checkpoint_dir="/ckpts", max_restarts=5, restart_delay=10,
                             join_timeout=600)
    trainer.run(num_nodes=2, num_gpus=4)

Three kinds of process, all running the script that called run() (so no function is ever pickled, and the
same code runs everywhere, as with torchrun):

- the launcher (the process you started): starts `local_nodes` node agents and restarts one that dies, as a
  cluster restarts a pod; returns a RunResult when train_fn finished everywhere, raises when the run failed;
- a node agent per node (agent.py): rendezvous, heartbeats with the other agents, `num_gpus` workers;
- a worker per GPU (or CPU slot) (worker.py): calls train_fn(ctx) once per membership generation.

Each role is told by environment variables the parent sets (SNEPPX_ELASTIC_ROLE, ...), so re-running the script
in a child reaches run() again, which then plays that role and exits instead of returning. Code before run()
runs in every process: keep it to imports and definitions. On several machines, each runs the script with the
same `checkpoint_dir` and SNEPPX_RUN_ID (and the job key in SNEPPX_HEARTBEAT_KEY_FILE) and
`run(..., local_nodes=1)`; they find each other through the checkpoint store (docs/ELASTIC.md, "ElasticTrainer").

Operator mode: in a pod of an ElasticTrainingJob (SNEPPX_RENDEZVOUS_OBJECT is set) the process you start is
that pod's node agent, with no launcher (the operator replaces failed pods), and the job spec's word, from the
pod's environment (pod.py), wins over run()'s arguments and the constructor's: see `run()`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

from SneppX_ALG import errors
from SneppX_ALG.collectives import Backend
from SneppX_ALG.contract.env import (
    ENV_AGENT_ID,
    ENV_EVENTS,
    ENV_HEARTBEAT_KEY,
    ENV_HEARTBEAT_KEY_FILE,
    ENV_HOST,
    ENV_LAUNCHER_PID,
    ENV_RESULT,
    ENV_ROLE,
    ENV_RUN_ID,
)
from SneppX_ALG.elastic import agent, pod, rendezvous, worker
from SneppX_ALG.records import RecordStore

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # linux/prctl.h
ELASTIC_DIR = "_elastic"  # under checkpoint_dir: the run's records (rendezvous, process-group addresses)


@dataclasses.dataclass(frozen=True)
class RunResult:
    """What a finished run did: every agent's events (generations, failures, restores, steps), oldest first."""

    run_id: str
    events: list[dict[str, Any]]

    @property
    def generations(self) -> list[dict[str, Any]]:
        """One entry per generation (as node rank 0 saw it form): generation, world_size, members."""
        seen: dict[int, dict[str, Any]] = {}
        for e in self.events:
            if e["kind"] == "generation":
                seen.setdefault(e["generation"], e)
        return [seen[g] for g in sorted(seen)]

    @property
    def failures(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == "failure"]


class ElasticTrainer:
    """Runs `train_fn(ctx)` on `num_nodes` x `num_gpus` workers and keeps it running through failures.

    train_fn: called in every worker with a `worker.TrainContext` (rank, world_size, local_rank, node_rank,
        generation, group, coordinator, restore(), save(), report(), membership_changing); on failure it is
        called again, in the same process where the worker survived, for the next generation. It should
        restore first (`ctx.restore(state)`) and save with `ctx.save(state, step)`.
    checkpoint_dir: a local or shared (NFS) directory, or s3://bucket/prefix. It also holds the run's records
        (under `_elastic/`): the rendezvous needs no other server.
    max_restarts: failures survived (scale-ups don't count); one more ends the run with
        RestartBudgetExhaustedError and the history. restart_delay: seconds before re-forming after the first
        failure, doubling after each (jittered, capped at max(60, restart_delay)).
    join_timeout: how long an agent waits for a generation that includes it (RendezvousTimeoutError after).
    min_nodes: the fewest nodes a generation may have (default 1: survivors go on alone).
    last_call: after min_nodes joined, how long a forming generation waits for the others (at the start).
        In an operator's pod the job's spec.elastic gives both instead (rendezvousTimeoutSeconds is join_timeout,
        joinTimeoutSeconds is last_call), as it gives min_nodes.
    hang_timeout: a worker that sends no heartbeat (a thread, every 0.1 s) for this long is stopped or wedged,
        and is killed (raise it if train_fn calls C code that holds the GIL longer than that). step_timeout: a worker that reports no step (ctx.save/ctx.report) for this long is
        killed (None: no limit). heartbeat_timeout: an agent silent this long is gone, with its node.
    backend: for ctx.group: "auto" (CPU: shared memory between the workers of a generation of one node, the
        TCP ring between nodes), "tcp", "shm" or "nccl" (GPU `local_rank`). collective_timeout: the deadline of
        one collective (a failure is normally seen far sooner: see agent.py).
    run_id: the run's name in the store (default SNEPPX_RUN_ID, else a new random one per run()).
    restart_nodes: the launcher restarts a node agent that died (as a cluster restarts its pod), after
        node_restart_delay seconds (default restart_delay), at most max_restarts + num_nodes times; it joins
        at the next checkpoint boundary.
    events_dir: where each agent appends its events as JSON lines (`<agent id>.events.jsonl`: generations,
        failures, restores, rank 0's steps), to watch a run live; default a temporary directory. Either way
        run() returns them in RunResult.events.
    snapshot_every: keep the state in host memory every this many steps, with `snapshot_replicas` copies on
        other nodes, and restore from there first after a failure: a failure then redoes the steps since the
        last snapshot, not since the last checkpoint (0, the default: off; a snapshot costs host memory, see
        docs/ELASTIC.md "Peer-memory snapshots"). ctx.report(step) takes them of the state given to
        ctx.restore(). snapshot_memory_limit: the bytes they may use per rank (default a quarter of the host's
        memory); more needed ends the run at the first snapshot with SnapshotMemoryError.
    """

    def __init__(self, train_fn: Callable[[worker.TrainContext], Any], checkpoint_dir: str,
                 max_restarts: int = 3, restart_delay: float = 1.0, join_timeout: float = 600.0, *,
                 min_nodes: int = 1, last_call: float = 10.0, hang_timeout: float = 1.0,
                 step_timeout: float | None = None, heartbeat_timeout: float = 0.8, backend: Backend = "auto",
                 collective_timeout: float = 300.0, max_to_keep: int | None = 5, rollback_depth: int = 2,
                 run_id: str | None = None, restart_nodes: bool = True, node_restart_delay: float | None = None,
                 events_dir: str | None = None, snapshot_every: int = 0, snapshot_replicas: int = 1,
                 snapshot_memory_limit: int | None = None):
        if not callable(train_fn):
            raise TypeError("train_fn must be a function taking the training context")
        if max_restarts < 0 or restart_delay < 0 or join_timeout <= 0 or min_nodes < 1:
            raise ValueError("need max_restarts >= 0, restart_delay >= 0, join_timeout > 0 and min_nodes >= 1")
        self.train_fn = train_fn
        self.checkpoint_dir = os.fspath(checkpoint_dir)
        self.max_restarts, self.restart_delay, self.join_timeout = max_restarts, restart_delay, join_timeout
        self.min_nodes, self.last_call = min_nodes, last_call
        self.hang_timeout, self.step_timeout, self.heartbeat_timeout = hang_timeout, step_timeout, heartbeat_timeout
        self.backend: Backend = backend
        self.collective_timeout, self.max_to_keep, self.rollback_depth = collective_timeout, max_to_keep, rollback_depth
        self.run_id = run_id
        self.restart_nodes = restart_nodes
        self.node_restart_delay = restart_delay if node_restart_delay is None else node_restart_delay
        self.events_dir = events_dir
        if snapshot_every < 0 or snapshot_replicas < 1 or (snapshot_memory_limit is not None
                                                             and snapshot_memory_limit <= 0):
            raise ValueError("need snapshot_every >= 0, snapshot_replicas >= 1 and snapshot_memory_limit > 0")
        self.snapshot: dict[str, Any] = {"snapshot_every": snapshot_every, "snapshot_replicas": snapshot_replicas,
                         "snapshot_memory_limit": snapshot_memory_limit}

    @property
    def elastic_root(self) -> str:
        return elastic_root(self.checkpoint_dir)

    def run(self, num_nodes: int = 1, num_gpus: int = 1, *, local_nodes: int | None = None) -> RunResult:
        """Trains until train_fn returned on every worker of a generation; see the class docstring.
        num_gpus: workers per node (GPUs; CPU slots without). local_nodes: agents this machine starts
        (default num_nodes: the whole job here).

        In a pod of an ElasticTrainingJob (operator mode) this process is the pod's node agent and never
        returns: it exits 0 when training completed, else non-zero (the pod fails; the operator decides). The
        job spec wins over the arguments: num_nodes and min_nodes are elastic.maxNodes and minNodes
        (SNEPPX_MAX_NODES, SNEPPX_MIN_NODES; later changes come through the job's control record), num_gpus is
        elastic.procsPerNode, checkpoint_dir, max_to_keep and rollback_depth are the job's checkpoint settings,
        step_timeout is failurePolicy.hangTimeoutSeconds (0: none); restart_nodes does not apply."""
        if not (isinstance(num_nodes, int) and isinstance(num_gpus, int) and num_nodes >= 1 and num_gpus >= 1):
            raise ValueError(f"num_nodes and num_gpus must be ints >= 1, got {num_nodes!r}, {num_gpus!r}")
        in_pod = pod.PodEnvironment.from_environ(os.environ)
        if self.min_nodes > num_nodes and in_pod is None:
            raise ValueError(f"min_nodes={self.min_nodes} is more than num_nodes={num_nodes}")
        role = os.environ.get(ENV_ROLE)
        if role == "worker":
            self._exit(worker.main(self.train_fn, self._worker_settings(os.environ[ENV_RUN_ID], in_pod)))
        if role == "agent":
            die_with_launcher(os.environ.get(ENV_LAUNCHER_PID))
            self._exit(agent.NodeAgent(self._agent_settings(num_nodes, num_gpus)).run())
        if role is not None:
            raise errors.ElasticLaunchError(f"{ENV_ROLE}={role!r} is not a role (agent or worker)")
        if in_pod is not None:
            self._exit(agent.NodeAgent(self._pod_agent_settings(in_pod)).run())
        return self._launch(num_nodes, num_gpus, num_nodes if local_nodes is None else local_nodes)

    # -- the roles --

    @staticmethod
    def _exit(code: int) -> NoReturn:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # not sys.exit: nothing after run() in the script may run in an agent or worker

    def _worker_settings(self, run_id: str, in_pod: pod.PodEnvironment | None = None) -> worker.WorkerSettings:
        if in_pod is not None:  # the job spec's checkpoint settings
            return worker.WorkerSettings(
                checkpoint_dir=in_pod.checkpoint_uri, elastic_root=elastic_root(in_pod.checkpoint_uri),
                run_id=run_id, backend=self.backend, collective_timeout=self.collective_timeout,
                max_to_keep=in_pod.max_to_keep, rollback_depth=in_pod.rollback_depth, max_restarts=self.max_restarts,
                **{**self.snapshot, "snapshot_every": in_pod.snapshot_every,
                   "snapshot_replicas": in_pod.snapshot_replicas})
        return worker.WorkerSettings(
            checkpoint_dir=self.checkpoint_dir, elastic_root=self.elastic_root, run_id=run_id, backend=self.backend,
            collective_timeout=self.collective_timeout, max_to_keep=self.max_to_keep,
            rollback_depth=self.rollback_depth, max_restarts=self.max_restarts, **self.snapshot)

    def _pod_agent_settings(self, p: pod.PodEnvironment) -> agent.AgentSettings:
        """This pod's node agent: the run is the job, the agent the pod; its workers run this script again."""
        if not (os.environ.get(ENV_HEARTBEAT_KEY_FILE) or os.environ.get(ENV_HEARTBEAT_KEY)):
            raise errors.ElasticLaunchError(f"operator mode needs the job's key in {ENV_HEARTBEAT_KEY_FILE} (the "
                                            "operator mounts it from the job's Secret)")
        env = {**os.environ, ENV_ROLE: "worker", ENV_RUN_ID: p.job, ENV_AGENT_ID: p.pod_name}
        return agent.AgentSettings(
            run_id=p.job, agent_id=p.pod_name, host=p.host, workers=p.procs_per_node,
            elastic_root=elastic_root(p.checkpoint_uri), worker_command=script_command(), worker_env=env,
            rendezvous=rendezvous.RendezvousConfig(
                min_nodes=min(p.min_nodes, p.max_nodes), max_nodes=p.max_nodes,  # the job spec's times win
                last_call=self.last_call if p.last_call is None else p.last_call,
                join_timeout=self.join_timeout if p.join_timeout is None else p.join_timeout),
            max_restarts=self.max_restarts, restart_delay=self.restart_delay,
            heartbeat_timeout=self.heartbeat_timeout, hang_timeout=self.hang_timeout, step_timeout=p.step_timeout,
            poll_period=1.0, events_path=os.environ.get(ENV_EVENTS) or "-", operator_mode=True,
            checkpoint_dir=p.checkpoint_uri)

    def _agent_settings(self, num_nodes: int, num_gpus: int) -> agent.AgentSettings:
        env = os.environ
        return agent.AgentSettings(
            run_id=env[ENV_RUN_ID], agent_id=env.get(ENV_AGENT_ID) or socket.gethostname(),
            host=env.get(ENV_HOST) or "127.0.0.1", workers=num_gpus, elastic_root=self.elastic_root,
            worker_command=script_command(), worker_env={**env, ENV_ROLE: "worker"},
            rendezvous=rendezvous.RendezvousConfig(min_nodes=self.min_nodes, max_nodes=num_nodes,
                                                   last_call=self.last_call, join_timeout=self.join_timeout),
            max_restarts=self.max_restarts, restart_delay=self.restart_delay,
            heartbeat_timeout=self.heartbeat_timeout, hang_timeout=self.hang_timeout,
            step_timeout=self.step_timeout, events_path=env.get(ENV_EVENTS), result_path=env.get(ENV_RESULT))

    # -- the launcher --

    def _launch(self, num_nodes: int, num_gpus: int, local_nodes: int) -> RunResult:
        command = script_command()
        run_id = self.run_id or os.environ.get(ENV_RUN_ID) or f"run-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
        env = {**os.environ, ENV_ROLE: "agent", ENV_RUN_ID: run_id, ENV_LAUNCHER_PID: str(os.getpid())}
        if not (env.get(ENV_HEARTBEAT_KEY_FILE) or env.get(ENV_HEARTBEAT_KEY)):
            if local_nodes != num_nodes:
                raise errors.ElasticLaunchError(
                    f"nodes on several machines share the job key: set {ENV_HEARTBEAT_KEY_FILE} (or "
                    f"{ENV_HEARTBEAT_KEY}) on each")
            env[ENV_HEARTBEAT_KEY] = secrets.token_hex(32)  # the job's key: heartbeats and collectives authenticate
        records = pod.rendezvous_store(self.elastic_root)  # a bad checkpoint_dir fails here, not in every agent
        verdict = rendezvous.reopen_run(records, run_id)  # a new launch of a finished run is a new run
        if verdict is not None:
            log.info("run %s had finished (%s): starting it again from its newest checkpoint", run_id, verdict)
        with tempfile.TemporaryDirectory(prefix="sneppx-run-") as scratch:
            if self.events_dir is not None:
                os.makedirs(self.events_dir, exist_ok=True)
            nodes = [_Node(f"node-{i}" if local_nodes == num_nodes else env.get(ENV_AGENT_ID) or socket.gethostname(),
                           scratch, self.events_dir or scratch) for i in range(local_nodes)]
            restarts = 0
            for node in nodes:
                node.start(command, env)
            previous_handler = signal.getsignal(signal.SIGTERM)
            if threading.current_thread() is threading.main_thread():  # `kill <launcher>` stops the nodes first
                signal.signal(signal.SIGTERM, _raise_terminated)
            terminated = False
            try:
                while True:
                    for node in nodes:
                        code = node.poll()
                        if node.finished:
                            continue
                        if code is None:
                            if node.proc is None and run_over(records, run_id):  # no need to bring it back now
                                node.finished = True
                            continue
                        if code in (0, agent.EXIT_FAILED):
                            node.finished = True
                            continue
                        if run_over(records, run_id):  # it died as the run ended: nothing left to do
                            node.finished = True
                        elif self.restart_nodes and restarts < self.max_restarts + num_nodes:
                            restarts += 1
                            log.warning("node %s %s: restarting it in %.1fs", node.agent_id, describe_exit(code),
                                        self.node_restart_delay)
                            node.start(command, env, delay=self.node_restart_delay)
                        else:
                            node.finished = True
                    if all(node.finished for node in nodes):
                        break
                    time.sleep(0.05)
            except _Terminated:
                terminated = True
            finally:
                for node in nodes:
                    node.stop()
                if threading.current_thread() is threading.main_thread():
                    signal.signal(signal.SIGTERM, signal.SIG_DFL if terminated else previous_handler)
            if terminated:
                os.kill(os.getpid(), signal.SIGTERM)  # it ends as SIGTERM would have, once its nodes are gone
            events = sorted((e for node in nodes for e in node.events()), key=lambda e: e["t"])
            results = [r for node in nodes if (r := node.result()) is not None]
        if rendezvous_verdict(records, run_id) == "completed":
            return RunResult(run_id, events)  # training completed: a node that gave up on the way changes nothing
        failed = [r for r in results if r["code"] != 0]
        if failed or not results:
            reason = failed[0]["reason"] if failed else "no node agent finished"
            history = [h for r in results for h in r["history"]]
            if "restart budget exhausted" in reason:
                raise errors.RestartBudgetExhaustedError(f"run {run_id} {reason}", history=history)
            raise errors.ElasticRunError(f"run {run_id} {reason}", reason=reason, history=history)
        return RunResult(run_id, events)


class _Node:
    """A node agent process the launcher started (and restarts, with the same agent id, if it dies)."""

    def __init__(self, agent_id: str, scratch: str, events_dir: str):
        self.agent_id = agent_id
        self.events_path = os.path.join(events_dir, f"{agent_id}.events.jsonl")
        self.result_path = os.path.join(scratch, f"{agent_id}.result.json")
        self.proc: subprocess.Popen[bytes] | None = None
        self.finished = False
        self.restart_at: float | None = None
        self.restart: tuple[list[str], dict[str, str]] = ([], {})

    def start(self, command: list[str], env: dict[str, str], delay: float = 0.0) -> None:
        if delay > 0:  # a node that died comes back later; the others' agents aren't held up meanwhile
            self.restart_at, self.restart = time.monotonic() + delay, (command, env)
            self.proc = None
            return
        self.restart_at = None
        self.proc = subprocess.Popen(command, start_new_session=True,  # its own process group: a node
                                     env={**env, ENV_AGENT_ID: self.agent_id, ENV_EVENTS: self.events_path,
                                          ENV_RESULT: self.result_path})

    def poll(self) -> int | None:
        if self.proc is None and self.restart_at is not None and time.monotonic() >= self.restart_at:
            self.start(*self.restart)
        return None if self.proc is None else self.proc.poll()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def events(self) -> list[dict[str, Any]]:
        try:
            with open(self.events_path) as f:
                return [json.loads(line) for line in f if line.endswith("\n")]
        except FileNotFoundError:
            return []

    def result(self) -> dict[str, Any] | None:
        try:
            with open(self.result_path) as f:
                value = json.load(f)
        except (FileNotFoundError, ValueError):
            return None
        return value if isinstance(value, dict) else None


def elastic_root(checkpoint_dir: str) -> str:
    """Where a run's records live beside its checkpoints (the rendezvous, in standalone mode, and the process
    groups' addresses)."""
    return checkpoint_dir.rstrip("/") + "/" + ELASTIC_DIR


def run_over(records: RecordStore, run_id: str) -> bool:
    """Whether an agent marked the run finished (completed or failed)."""
    return rendezvous_verdict(records, run_id) is not None


def rendezvous_verdict(records: RecordStore, run_id: str) -> str | None:
    """The reason an agent gave when it marked the run finished ("completed", "failed: ..."); None: not finished
    (or the store can't say now)."""
    try:
        finished = records.read(rendezvous.finished_key(run_id))
    except errors.RecordError:
        return None
    return None if finished is None else str(finished.value.get("reason", ""))


class _Terminated(BaseException):
    """SIGTERM to the launcher. A BaseException, as agent.Terminated is, so that no `except Exception` on the way
    (a record store call) takes it for an error and carries on."""


def _raise_terminated(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: it is on its way out
    raise _Terminated()


def die_with_launcher(launcher_pid: str | None) -> None:
    """An agent stops when its launcher dies, however it died (SIGKILL, the OOM killer): the kernel sends it
    SIGKILL (PR_SET_PDEATHSIG), and its workers end with it (their control channel closes). Without this a
    relaunch would train beside the orphans in the same checkpoint directory."""
    if launcher_pid is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if str(os.getppid()) != launcher_pid:  # it died before the prctl: the kernel won't tell us any more
        os._exit(128 + signal.SIGKILL)


def script_command() -> list[str]:
    """The command line that started this process (interpreter options, the script or -m module, its
    arguments): run again with a role in the environment, it reaches run() and plays that role."""
    argv = list(getattr(sys, "orig_argv", []))
    if len(argv) < 2 or (sys.argv and sys.argv[0] in ("", "-c") and "-c" not in argv):
        raise errors.ElasticLaunchError(
            "ElasticTrainer.run() starts its agents and workers by running your script again; call it from a "
            "script (python train.py) or a module (python -m pkg.train), not from an interactive session")
    return [sys.executable, *argv[1:]]


def describe_exit(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
