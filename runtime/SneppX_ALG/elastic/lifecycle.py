"""Lifecycle: the states one node of an elastic job goes through, and which events may move it.

The rules live in C (native/src/elastic.c, one table) so that everything that reacts to membership can agree on
them; this class is their Python face. Each node agent (elastic/agent.py, `NodeAgent.lifecycle`) owns one for its
node and fires its events where it goes through them: `join` when it first joins the rendezvous, `reconfigured`
(with the rendezvous' generation) each time a generation including it is sealed, `peer_failed` when a generation
fails, `join` when it stops at a checkpoint boundary for agents waiting to join, `leave` when the run is over
for it, `timeout` when no generation formed in time, `budget_exhausted` when its restart budget is gone, `fatal`
when an error no restart fixes ends it (a worker's fatal error, the OOM killer). Its
state is in every event the agent writes. (The agent's workers have states of their own, `agent.WorkerState`.)

States: init, joining, running, reconfiguring, stopped, failed. Events: join, leave, peer_failed, timeout,
reconfigured, budget_exhausted, fatal. Each `reconfigured` starts a new membership generation. An event the current
state doesn't allow raises LifecycleError and changes nothing. The table, with the reason for each entry and
where the agent fires each event, is in docs/ELASTIC.md ("Node lifecycle").
"""

from __future__ import annotations

import threading

from SneppX_ALG import _native

STATES = _native.LIFECYCLE_STATES
EVENTS = _native.LIFECYCLE_EVENTS
FINAL_STATES = frozenset({"stopped", "failed"})


def next_state(state: str, event: str) -> str | None:
    """The state `event` leads to from `state`, or None where it is not allowed."""
    return _native.lifecycle_next(state, event)


class Lifecycle:
    """One node's lifecycle machine; safe to use from several threads."""

    def __init__(self) -> None:
        self._machine = _native.lifecycle_new()
        self._lock = threading.Lock()
        self._formed = False  # a `reconfigured` was applied: a generation is recorded

    @property
    def state(self) -> str:
        return STATES[int(self._machine.state)]

    @property
    def generation(self) -> int:
        """The membership generation: 0 until the first `reconfigured` (which may record 0 as well: see fire)."""
        return int(self._machine.generation)

    @property
    def formed(self) -> bool:
        """A `reconfigured` was applied: `generation` is the number of a generation this node was a member of."""
        return self._formed

    @property
    def transitions(self) -> int:
        return int(self._machine.transitions)

    @property
    def finished(self) -> bool:
        return self.state in FINAL_STATES

    def allowed_events(self) -> list[str]:
        """The events the current state accepts."""
        state = self.state
        return [event for event in EVENTS if next_state(state, event) is not None]

    def fire(self, event: str, generation: int | None = None) -> str:
        """Applies event and returns the new state. LifecycleError if the state forbids it (checked first).

        generation: for `reconfigured`, the generation the new membership has, as the rendezvous numbers them
        (they start at 0), or None for current + 1. It must be newer than the one recorded, except on the first
        `reconfigured`, which takes any generation, 0 included: 0 then means generation 0, as it says. After
        that, 0 (like any generation not newer) is refused with ValueError, and nothing changes."""
        if generation is not None and event != "reconfigured":
            raise ValueError(f"only 'reconfigured' takes a generation, not {event!r}")
        with self._lock:
            explicit_zero = event == "reconfigured" and generation == 0
            if explicit_zero and self._formed and next_state(self.state, event) is not None:
                raise ValueError(f"generation 0 is not newer than the current {self.generation}")
            # elastic.c reads 0 as "current + 1"; an explicit 0 on the first `reconfigured` (the machine still at
            # its initial 0, so C records 1) is set back to the 0 it asked for
            _native.lifecycle_fire(self._machine, event, generation or 0)
            if event == "reconfigured":
                if explicit_zero:
                    self._machine.generation = 0
                self._formed = True
            return self.state

    def __repr__(self) -> str:
        return f"Lifecycle({self.state}, generation {self.generation})"
