"""The operator's kopf settings and environment knobs, set in code so every way of running it
(`python -m sneppx_operator`, `kopf run`, tests' KopfRunner) behaves the same.

Why each setting:
- annotations under `sneppx.io/`: kopf's progress (it has none to keep: the operator has no kopf handlers that
  need it) never goes into `.status` (our status schema is closed and bounded, so kopf's fields would be
  pruned). No finalizer: nothing the operator does needs one (owner references collect a job's objects), and
  a finalizer would make deleting a job hang while no operator serves its namespace.
- peering off: replicas elect a leader on a Lease instead (leader.py); kopf's peering freezes rather than elects.
- kopf posts none of its log lines as Kubernetes events: every write goes through k8s.py, where the leader
  election fences it (a follower writes nothing); the operator posts its own events (reconcile.events_for).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import kopf

from SneppX_ALG.contract.env import ENV_RESYNC_SECONDS
from sneppx_operator.errors import OperatorConfigError

ANNOTATION_PREFIX = "sneppx.io"
DEFAULT_RESYNC_SECONDS = 10.0
MAX_RETRY_DELAY_SECONDS = 300.0


def resync_seconds(environ: Mapping[str, str] = os.environ) -> float:
    """How often each job is reconciled even without a change (pods becoming ready, lost events)."""
    raw = environ.get(ENV_RESYNC_SECONDS, "")
    if not raw:
        return DEFAULT_RESYNC_SECONDS
    try:
        value = float(raw)
    except ValueError:
        raise OperatorConfigError(f"{ENV_RESYNC_SECONDS}={raw!r} is not a number of seconds") from None
    if not 0.1 <= value <= 3600:
        raise OperatorConfigError(f"{ENV_RESYNC_SECONDS}={raw!r} must be between 0.1 and 3600 seconds")
    return value


def retry_delay(retry: int, environ: Mapping[str, str] = os.environ) -> float:
    """Backoff before retrying a pass the API server refused: the resync interval, doubled per retry
    (kopf counts them), capped at MAX_RETRY_DELAY_SECONDS, so a job stuck on a quota or a name clash
    costs a few API calls an hour, not one per resync."""
    return min(resync_seconds(environ) * 2 ** min(retry, 32), MAX_RETRY_DELAY_SECONDS)


def apply(settings: kopf.OperatorSettings) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.posting.enabled = False
    settings.peering.standalone = True
