"""Crash consistency, shown: a saving process is SIGKILLed at every I/O site and at random times.

Each round forks a child that saves a few checkpoints into one shared root (so leftovers of earlier kills
are there too); all but a round's first are incremental, referencing the frozen part of the state. The
child dies either by the native fault hook (`kill(getpid(), SIGKILL)` in front of the
k-th write/fsync/rename/dirsync/read: every site in turn) or by a SIGKILL from this process after a random
delay. After every kill a new coordinator starts on the root and we check that leftovers are gone, that
every committed step validates (no partial checkpoint is ever visible), that the newest committed step
never goes backwards, and that latest() restores bitwise what was saved at its step.

`make test` runs at least 200 kills; SNEPPX_KILLS=5000 runs thousands.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import shutil
import signal
import time
from collections.abc import Callable

import numpy as np

from SneppX_ALG import CheckpointCoordinator, _native, storage

SAVES_PER_ROUND = 3
TARGET_KILLS = int(os.environ.get("SNEPPX_KILLS", "200"))
ALL_SITES = "write,fsync,rename,dirsync,read"


def state_for(step: int) -> dict:
    """Different at every step, but for a frozen third that every save after a round's first references
    (incremental steps: retention must keep what they reference, a kill at any site included)."""
    rng = np.random.default_rng(step)
    return {"frozen": np.random.default_rng(0).standard_normal((256, 1024)).astype(np.float32),
            "w": rng.standard_normal((64, 256)).astype(np.float32),
            "emb": rng.integers(0, 255, (600, 1024), dtype=np.uint8),
            "opt": {"b": rng.standard_normal(10), "t": np.int64(step)}}


def fork_child(fault_at: int | None, body: Callable[[Callable[[], None]], None]) -> tuple[int, int]:
    """Forks a child that runs body(arm), where arm() arms the fault hook to SIGKILL the child at its fault_at-th
    I/O site from then on (None: no fault); returns (pid, read end of a pipe that gets the count of I/O sites the
    child passed after arm() when it finishes)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        code = 3
        try:
            os.close(read_fd)
            start: list[int] = []

            def arm() -> None:
                if fault_at is not None:
                    _native.fault_arm(ALL_SITES, fault_at, "kill")
                start.append(_native.fault_sites_passed())

            body(arm)
            os.write(write_fd, str(_native.fault_sites_passed() - start[0]).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    return pid, read_fd


def run_child(root: str, first_step: int, fault_at: int | None) -> tuple[int, int]:
    """Forks a child that saves a round of steps from first_step; returns as fork_child does."""
    def body(arm: Callable[[], None]) -> None:
        coord = CheckpointCoordinator(root, max_to_keep=2, staging_bytes=256 << 10, device="cpu")
        arm()
        for step in range(first_step, first_step + SAVES_PER_ROUND):
            coord.save(state_for(step), step=step, training_state={"step": step})
        coord.close()

    return fork_child(fault_at, body)


def reap(pid: int, read_fd: int) -> tuple[bool, int | None]:
    """(killed by SIGKILL?, site count if it finished)."""
    _, status = os.waitpid(pid, 0)
    out = os.read(read_fd, 64)
    os.close(read_fd)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL, f"child died of signal {os.WTERMSIG(status)}"
        return True, None
    assert os.WEXITSTATUS(status) == 0, "the saving child failed without being killed"
    return False, int(out)


class Checker:
    def __init__(self, root: str):
        self.root = root
        self.newest = -1
        self.kills = 0
        self.leftovers_cleaned = 0

    def after_round(self) -> None:
        before = [n for n in os.listdir(self.root) if n.startswith(".")]
        coord = CheckpointCoordinator(self.root, max_to_keep=2, device="cpu")
        try:
            after = [n for n in os.listdir(self.root) if n.startswith(".")]
            assert after == [], f"leftovers not cleaned at start: {after}"
            self.leftovers_cleaned += len(before)
            steps = coord.committed_steps()
            for step in steps:
                assert coord.validate(step) == [], f"committed step {step} is partial or corrupt"
            if not steps:
                assert self.newest == -1, "every committed checkpoint vanished"
                return
            assert max(steps) >= self.newest, f"newest committed step went back from {self.newest} to {max(steps)}"
            self.newest = max(steps)
            got = {"w": np.zeros((64, 256), np.float32), "emb": None, "opt": {}}
            info = coord.restore(got)
            assert info is not None and info.step == self.newest
            assert info.training_state == {"step": info.step}
            want = state_for(info.step)
            assert got["w"].tobytes() == want["w"].tobytes()
            assert got["emb"].tobytes() == want["emb"].tobytes()
            assert got["frozen"].tobytes() == want["frozen"].tobytes()
            assert got["opt"]["b"].tobytes() == want["opt"]["b"].tobytes() and got["opt"]["t"] == info.step
        finally:
            coord.close()


def test_sigkill_at_every_io_site_and_at_random_times_never_exposes_a_partial_checkpoint(tmp_path) -> None:
    root = str(tmp_path / "ckpts")
    checker = Checker(root)
    step = 1

    # Calibrate: how many I/O sites does one round pass, and how long does it take?
    started = time.monotonic()
    pid, fd = run_child(root, step, None)
    killed, sites = reap(pid, fd)
    child_seconds = time.monotonic() - started
    assert not killed and sites is not None and sites > 20
    step += SAVES_PER_ROUND
    checker.after_round()
    newest = json.loads((pathlib.Path(root) / storage.step_name(step - 1) / storage.MANIFEST).read_bytes())
    assert newest.get("uses"), "the round's last save was not incremental: the kills would not cover one"

    # Every site in turn (retention deletes vary a little between rounds, so go a few past the count).
    for k in range(1, sites + 6):
        pid, fd = run_child(root, step, k)
        killed, _ = reap(pid, fd)
        checker.kills += killed
        step += SAVES_PER_ROUND
        checker.after_round()
    site_kills = checker.kills
    assert site_kills >= sites - 2

    # Random timings, seeded, spread over a child's lifetime, until the target count of kills. The lifetime follows
    # the machine's load: a kill that lands after the child finished says it now lives less than that delay, and
    # each kill that lands lets it grow a little. Drawn from the first round's time alone, a calibration at a busy
    # moment sent most kills after the child's end once the load fell (up to 4 x TARGET_KILLS wasted rounds: past
    # pytest's 900 s in two parallel runs of the suite).
    rng = random.Random(1234)
    rounds, lifetime = 0, child_seconds
    while checker.kills < TARGET_KILLS and rounds < 4 * TARGET_KILLS:
        rounds += 1
        delay = rng.uniform(0, lifetime)
        pid, fd = run_child(root, step, None)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)  # may land after the child finished: then it isn't counted
        killed, _ = reap(pid, fd)
        lifetime = lifetime * 1.02 if killed else max(delay, 0.01)
        checker.kills += killed
        step += SAVES_PER_ROUND
        checker.after_round()

    assert checker.kills >= TARGET_KILLS, f"only {checker.kills} kills in {rounds} random rounds"
    assert checker.newest > 0
    assert checker.leftovers_cleaned > 0, "no kill ever left anything behind: the sweep missed the write path"
    print(f"{checker.kills} kills ({site_kills} at the {sites} I/O sites of a round, {checker.kills - site_kills} "
          f"at random times in {rounds} rounds), {checker.leftovers_cleaned} leftovers cleaned, "
          f"newest step {checker.newest}")


def rollback_child(root: str, fault_at: int | None) -> tuple[int, int]:
    """Forks a child that restores step 2 of the chain 1..4 (a rollback: 3 and 4 are fenced off at the next
    commit) and saves step 5, which continues 2's chain; returns as fork_child does."""
    def body(arm: Callable[[], None]) -> None:
        coord = CheckpointCoordinator(root, max_to_keep=2, staging_bytes=256 << 10, device="cpu", full_every=100)
        got: dict = {}
        assert coord.restore(got, 2).step == 2
        arm()
        coord.save(state_for(5), step=5, training_state={"step": 5})
        coord.close()

    return fork_child(fault_at, body)


def test_sigkill_at_every_io_site_of_a_rollback_over_an_incremental_chain(tmp_path) -> None:
    """Steps 1..4 are one incremental chain; a process restores step 2 and saves step 5 (the fence sets 3 and 4
    aside, retention must keep what 5 and 2 reference) and is SIGKILLed at each I/O site in turn, each time on
    a fresh copy of the root. After every kill the root shows one of the three states a rollback may be cut in,
    never a mix: 4 still newest (killed before the fence record), 2 newest (fence durable, 5 not committed), or
    5; every visible step validates and restores bitwise what was saved at it."""
    base = tmp_path / "base"
    with CheckpointCoordinator(str(base), max_to_keep=None, device="cpu", full_every=100) as coord:
        for step in (1, 2, 3, 4):
            coord.save(state_for(step), step=step, training_state={"step": step})
    chain = [json.loads((base / storage.step_name(s) / storage.MANIFEST).read_bytes()).get("uses") for s in (2, 3, 4)]
    assert all(chain), "the steps after the first were not incremental"

    def after(root: pathlib.Path) -> int:
        with CheckpointCoordinator(str(root), read_only=True, device="cpu") as coord:
            steps = coord.committed_steps()
            for step in steps:
                assert coord.validate(step) == [], f"committed step {step} is partial or corrupt"
            got: dict = {}
            info = coord.restore(got)
            assert info is not None and info.step in (2, 4, 5), steps
            want = state_for(info.step)
            for name in ("frozen", "w", "emb"):
                assert got[name].tobytes() == want[name].tobytes(), (info.step, name)
            return info.step

    calibrate = tmp_path / "calibrate"
    shutil.copytree(base, calibrate)
    killed, sites = reap(*rollback_child(str(calibrate), None))
    assert not killed and sites is not None and sites > 10
    assert after(calibrate) == 5
    outcomes: dict[int, int] = {}
    for k in range(1, sites + 3):
        root = tmp_path / f"kill-{k}"
        shutil.copytree(base, root)
        killed, _ = reap(*rollback_child(str(root), k))
        newest = after(root)
        outcomes[newest] = outcomes.get(newest, 0) + 1
        shutil.rmtree(root)
    assert outcomes.get(4) and outcomes.get(2) and outcomes.get(5), outcomes  # every cut was reached
    print(f"rollback over a chain killed at each of its {sites} I/O sites: newest afterwards {outcomes}")
