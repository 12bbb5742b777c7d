"""The actions a plan asks k8s.apply to carry out, and what came of them (the Outcome, a Refusal).

Why apart: these are the whole vocabulary between the pure side (plan, settle) and the API calls (k8s.py);
they are plain data, so the plan is tested by comparing them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from sneppx_operator import builders


@dataclasses.dataclass(frozen=True)
class Create:
    body: Mapping[str, Any]

    @property
    def kind(self) -> str:
        return str(self.body["kind"])

    @property
    def name(self) -> str:
        return str(self.body["metadata"]["name"])


@dataclasses.dataclass(frozen=True)
class Delete:
    """Delete an object only while `owner_uid` (the job) controls it; `uid`, when known, is sent as the
    delete's precondition so an object replaced under the same name is never the one deleted. `force`
    deletes with a grace period of 0 (a pod whose kubelet is gone or stuck)."""

    kind: str
    name: str
    owner_uid: str
    uid: str | None = None
    force: bool = False


@dataclasses.dataclass(frozen=True)
class PutRecords:
    """Write (or, with None, remove) records of the job's rendezvous object, by record key."""

    name: str
    owner_uid: str
    records: tuple[tuple[str, Mapping[str, Any] | None], ...]
    kind: str = "ConfigMap"


@dataclasses.dataclass(frozen=True)
class DeleteJob:
    """Delete the job itself (ttlSecondsAfterFinished), only while it is still the object with `uid`."""

    name: str
    uid: str
    kind: str = builders.KIND


@dataclasses.dataclass(frozen=True)
class DropFinalizer:
    """Take a finalizer an earlier operator version put on the job off it (owner references collect the job's
    objects; a finalizer would only make deleting the job hang while no operator serves its namespace)."""

    name: str
    uid: str
    finalizer: str
    kind: str = builders.KIND


Action = Create | Delete | PutRecords | DeleteJob | DropFinalizer


@dataclasses.dataclass(frozen=True)
class Refusal:
    """The API server refused an action, or (name_in_use) its name is held by an object the job doesn't
    control. `holder` describes that object's controller ("" when it has none)."""

    action: Action
    code: int
    message: str
    name_in_use: bool = False
    holder: str = ""


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What k8s.apply did: the actions that changed something, and the refusal that stopped it, if any.
    Actions run in order and stop at the first refusal: later ones depend on earlier ones (pods mount
    the Secret) or would be refused the same way (quota)."""

    done: tuple[Action, ...] = ()
    refused: Refusal | None = None
