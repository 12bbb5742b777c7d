"""The CRD's defaults for the spec fields the operator reads, each in one place.

Why: the API server fills a field's `default:` (crds/sneppx.io_elastictrainingjobs.yaml) in when it stores a job,
but the operator must not depend on that (a job stored before a default existed; a spec in a test); where a field
is absent it uses the same value, from here. tests/unit/sneppx_operator/test_operator_defaults.py checks every
value against the CRD, and that no operator module writes one of these fields' defaults itself. Reads nothing
from disk.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The field's path under spec, dotted -> its default in the CRD.
DEFAULTS: Mapping[str, object] = {
    "elastic.procsPerNode": 1,
    "elastic.port": 29500,
    "elastic.rendezvousTimeoutSeconds": 600,
    "elastic.joinTimeoutSeconds": 30,
    "quorum.actionOnLoss": "Pause",
    "failurePolicy.maxRestarts": 3,
    "failurePolicy.restartDelay.initialSeconds": 10,
    "failurePolicy.restartDelay.multiplier": 2,
    "failurePolicy.restartDelay.maxSeconds": 300,
    "failurePolicy.hangTimeoutSeconds": 1800,
    "failurePolicy.terminatingPodTimeoutSeconds": 300,
    "checkpoint.saveEveryNSteps": 1000,
    "checkpoint.maxToKeep": 3,
    "checkpoint.validation": "Full",
    "checkpoint.rollbackDepth": 2,
    "checkpoint.snapshotEveryNSteps": 0,
    "checkpoint.snapshotReplicas": 1,
    "suspend": False,
}


def field(section: Mapping[str, Any], path: str) -> Any:
    """The value of the field at `path` (dotted, under spec) as `section` (the object that holds it) has it,
    or its default when it is absent: `field(spec["checkpoint"], "checkpoint.maxToKeep")`."""
    return section.get(path.rsplit(".", 1)[-1], DEFAULTS[path])
