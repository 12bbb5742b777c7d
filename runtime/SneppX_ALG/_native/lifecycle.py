"""The node lifecycle table (elastic.c): which events may move one node of an elastic job between states."""

from __future__ import annotations

from typing import Any

from SneppX_ALG import errors
from SneppX_ALG._native._lib import ffi, lib, raise_for

LIFECYCLE_STATES: tuple[str, ...] = tuple(ffi.string(lib.sx_elastic_state_name(i)).decode() for i in range(lib.SX_EL_NSTATES))


LIFECYCLE_EVENTS: tuple[str, ...] = tuple(ffi.string(lib.sx_elastic_event_name(i)).decode() for i in range(lib.SX_EL_NEVENTS))


def lifecycle_new() -> Any:
    """A fresh lifecycle machine (sx_elastic) in state "init", generation 0."""
    machine = ffi.new("sx_elastic *")
    lib.sx_elastic_init(machine)
    return machine


def lifecycle_next(state: str, event: str) -> str | None:
    """The state `event` leads to from `state`, or None where it is illegal."""
    code = lib.sx_elastic_next(LIFECYCLE_STATES.index(state), LIFECYCLE_EVENTS.index(event))
    return None if code == lib.SX_ESTATE else LIFECYCLE_STATES[code]


def lifecycle_fire(machine: Any, event: str, generation: int = 0) -> None:
    """Applies event to the machine; LifecycleError if its state doesn't allow it (nothing changes then)."""
    if event not in LIFECYCLE_EVENTS:
        raise ValueError(f"unknown lifecycle event {event!r}; one of {', '.join(LIFECYCLE_EVENTS)}")
    if generation < 0:
        raise ValueError(f"generation must be >= 0, not {generation}")
    state = LIFECYCLE_STATES[machine.state]
    code = lib.sx_elastic_fire(machine, LIFECYCLE_EVENTS.index(event), generation)
    if code == lib.SX_ESTATE:
        raise errors.LifecycleError(f"event {event!r} is not allowed in state {state!r}", state=state, event=event)
    if code == lib.SX_EINVAL:
        raise ValueError(f"generation {generation} is not newer than the current {int(machine.generation)}")
    raise_for(code, f"lifecycle event {event}")
