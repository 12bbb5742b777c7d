"""What the demo shows a person (with rich): the table of every committed checkpoint validated, scene 2's live
view of a run's events, and the figures of its node loss.

Why a module of its own: the display only reads what the scenes and the run produced; none of it decides
what happens.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from SneppX_ALG import coordinator, storage
from SneppX_ALG.demo.events import recovery_after
from SneppX_ALG.demo.phases import KILLED_NODE, NODES, WORKERS_PER_NODE


def validate_checkpoints(checkpoints: coordinator.CheckpointCoordinator, console: Any) -> bool:
    """Prints a table of every committed step of `checkpoints` (a local root), validated; True if all are valid."""
    from rich.table import Table

    results = Table(title="every committed checkpoint, validated byte by byte")
    for column in ("step", "location", "size", "valid", "errors"):
        results.add_column(column)
    all_valid = True
    for step in checkpoints.committed_steps():
        problems = checkpoints.validate(step)
        all_valid &= not problems
        store = checkpoints.storage
        assert isinstance(store, storage.LocalStorage)  # the demo's roots are local
        location = store.step_path(step)
        size = sum(os.path.getsize(os.path.join(location, f)) for f in os.listdir(location))
        shown = os.path.relpath(location) if not os.path.relpath(location).startswith("..") else location
        results.add_row(str(step), shown, f"{size / 2**20:.1f} MiB", "yes" if not problems else "NO",
                        "; ".join(problems))
    console.print(results)
    return all_valid


class RunDisplay:
    """Scene 2's live view of a run's events: a line for each generation, failure, join and restore, and a
    progress bar with the step, loss, world size and generation (rank 0's)."""

    def __init__(self, console: Any, args: argparse.Namespace):
        from rich import progress

        self.every = args.elastic_every
        self.world: dict[int, int] = {}  # generation -> world size
        self.step = 0
        self.killed_at: float | None = None
        self._said: set[tuple[str, int]] = set()  # (kind, generation) already shown
        self.bar = progress.Progress(
            progress.TextColumn("[bold]elastic run"), progress.BarColumn(),
            progress.TextColumn("step {task.completed:>4.0f}/{task.total:.0f}"),
            progress.TextColumn("loss {task.fields[loss]:.4f}"),
            progress.TextColumn("world size {task.fields[world]}"),
            progress.TextColumn("generation {task.fields[generation]}"), progress.TimeElapsedColumn(),
            console=console, transient=False)
        self._task = self.bar.add_task("", total=args.elastic_steps, loss=float("nan"), world="-", generation="-")

    def say(self, message: str) -> None:
        self.bar.console.print(message)

    def _since_kill(self, event: dict[str, Any]) -> str:
        return "" if self.killed_at is None else f", {event['t'] - self.killed_at:.2f} s after the kill"

    def show(self, e: dict[str, Any]) -> None:
        kind = e["kind"]
        generation = e.get("generation", max(self.world, default=-1))  # a failure ends the newest generation
        first_time = (kind, generation) not in self._said
        self._said.add((kind, generation))
        world = self.world.get(generation, "?")
        if kind == "generation" and first_time:
            self.world[generation] = e["world_size"]
            self.say(f"[bold]generation {generation}[/]: world size {e['world_size']}, nodes "
                     f"{', '.join(e['members'])} (sealed{self._since_kill(e)})")
        elif kind == "failure" and first_time:  # an agent may record several for one incident
            self.say(f"[bold red]{e['agent']} detected a failure[/]{self._since_kill(e)}: {e['reason'][:160]}")
        elif kind == "join_pending" and first_time:
            self.say(f"{', '.join(e['waiting'])} is back and asks to join: the ranks stop at the next checkpoint "
                     f"(every {self.every} steps)")
        elif kind == "restored" and first_time and generation > 0:
            rolled = f", rolled back past {[r['step'] for r in e['rolled_back']]}" if e["rolled_back"] else ""
            where = ("from peer memory" if e.get("source") == "memory"
                     else f"from storage{f' ({why})' if (why := e.get('why')) else ''}")
            self.say(f"generation {generation} restored step {e['step']} {where}, resharded for world size "
                     f"{world}{rolled}")
        elif kind == "step":
            if first_time and generation > 0:
                self.say(f"[bold green]training again[/] at world size {world}{self._since_kill(e)}")
            self.step = e["step"]
            self.bar.update(self._task, completed=e["step"], world=world, generation=generation)
            if "loss" in e["metrics"]:  # ctx.save reports the step again, without metrics
                self.bar.update(self._task, loss=e["metrics"]["loss"])


def print_elastic_story(args: argparse.Namespace, display: RunDisplay, events: list[dict[str, Any]],
                        returncode: int, log_path: str, console: Any) -> bool:
    """The figures of scene 2's node loss, and whether the story happened: 4 ranks, then 2 after the kill,
    then 4 again, and a run that finished."""
    from rich.table import Table

    full = NODES * WORKERS_PER_NODE
    sizes = [display.world[g] for g in sorted(display.world)]
    killed_at = display.killed_at
    recovery = None if killed_at is None else recovery_after(events, killed_at)
    if killed_at is None or recovery is None:
        console.print(f"[bold red]FAILED[/]: {KILLED_NODE} was not killed, or the run did not recover (exit "
                      f"status {returncode}); its log is {log_path}")
        return False
    regrown = next((e for e in events if e["kind"] == "step" and e["t"] > killed_at + recovery.resumed
                    and display.world.get(e["generation"]) == full), None)  # the first step at 4 again
    figures = Table(title=f"{KILLED_NODE} SIGKILLed: seconds after the kill")
    for column in ("", "measured", "goal"):
        figures.add_column(column, justify="right")
    figures.add_row("failure detected", f"{recovery.detected:.2f} s", "under 1 s")
    figures.add_row(f"generation at world size {recovery.world_size} sealed", f"{recovery.sealed:.2f} s", "")
    figures.add_row("training again (its first step)", f"{recovery.resumed:.2f} s", "under 5 s")
    if recovery.source == "memory":
        figures.add_row("steps redone", f"{recovery.lost_steps} (restored from peer memory)", "0 (at most 1)")
    else:
        figures.add_row("steps redone (since the last checkpoint)", f"{recovery.lost_steps} (restored from storage)",
                        f"at most {2 * args.elastic_every}")
    if regrown is not None:
        figures.add_row(f"back at world size {full} (after a {args.node_restart_delay:g} s restart delay)",
                        f"{regrown['t'] - killed_at:.2f} s", "")
    console.print(figures)
    console.print(f"{recovery.lost_steps} steps redone (restored from "
                  + ("peer memory)" if recovery.source == "memory" else f"storage: {recovery.why or 'snapshots off'})"))
    console.print(f"world sizes, generation by generation: {' -> '.join(map(str, sizes))}")
    if (returncode == 0 and regrown is not None and sizes[:1] == [full]
            and recovery.world_size == full - WORKERS_PER_NODE and sizes[-1] == full):
        console.print(f"[bold green]the run survived the loss of a node[/]: it went on at world size "
                      f"{recovery.world_size} and grew back to {full} when {KILLED_NODE} returned; every rank "
                      f"finished step {args.elastic_steps}")
        return True
    console.print(f"[bold red]FAILED[/]: the elastic run (exit status {returncode}) did not shrink to "
                  f"{full - WORKERS_PER_NODE} and grow back to {full} as planned; its log is {log_path}")
    return False
