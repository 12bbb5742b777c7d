"""What a pass decides and hands on: the Plan (actions, status, restarts, events, when to look again), each
Restart, the Membership the pods belong to, the Event to post, and the Settled end of a pass.

Why apart: the plan, the status and event wording and settle all pass these values along; keeping them below
all three lets each be its own module without a cycle.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sneppx_operator import policy
from sneppx_operator.reconcile.actions import Action


@dataclasses.dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class Restart:
    """A restart the plan decided: the failure and whether it counts. The plan's status already holds it
    (restartCount, restartHistory, the rank's slot marked Replacing with the uid of the pod it replaces), and
    that status is written before any action: an operator that dies before the pod's delete goes through finds
    the decision in the status and finishes it, and never decides (or counts) it again."""

    failure: policy.RankLoss
    generation: int
    counted: bool
    why: str
    pod_uid: str = ""


@dataclasses.dataclass(frozen=True)
class Plan:
    actions: tuple[Action, ...]
    status: dict[str, Any]
    restarts: tuple[Restart, ...] = ()
    events: tuple[Event, ...] = ()
    wake_after: float | None = None  # seconds until a time-based decision is due (backoff, windows, TTL)
    recovered_after: float | None = None  # seconds from the last restart to Running again


@dataclasses.dataclass(frozen=True)
class Settled:
    """What one pass ends with: the status to write, the events to post, and `error` when the pass fell
    short; `retryable` says whether trying again (with backoff) can help or only a spec edit can."""

    status: dict[str, Any]
    events: list[Event]
    error: str | None = None
    retryable: bool = True
    wake_after: float | None = None


@dataclasses.dataclass(frozen=True)
class Membership:
    """The pod generation the job's pods belong to and its world size (WORLD_SIZE in every pod)."""

    generation: int
    world_size: int
