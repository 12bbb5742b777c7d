"""`reopen_run`: a new launch of a finished run is a new run (its records removed, its verdict returned).

Separate because the launcher calls it once, before any agent exists: it is no part of an agent's state machine,
only of the run's records.
"""

from __future__ import annotations

import logging

from SneppX_ALG import errors
from SneppX_ALG.contract import record
from SneppX_ALG.elastic.rendezvous.keys import finished_key, floor_key

log = logging.getLogger(__name__)


def reopen_run(store: record.RecordStore, run_id: str) -> str | None:
    """Makes a finished run new: a launch under the run id of a run marked finished trains again (from its
    newest checkpoint) instead of stopping every agent with the old verdict. If `rdzv/<run_id>/finished`
    exists, removes every record of the run and returns the old verdict (its reason, for a log line);
    otherwise changes nothing and returns None. The launcher calls it once, before any agent of the launch
    joins.

    Why this order is safe: the records are listed before `finished` is read, so the list holds records of
    the finished run only (agents of a new launch write theirs once `finished` is gone); `finished` is removed
    last, so an agent of the old run still on its way out keeps finding the run finished, not generations
    vanishing under it; and the floor goes just before it, so the generations below it never reappear as
    "not sealed yet" while it stands. Interrupted, it is done again by the next launch (`finished` stays)."""
    if not isinstance(run_id, str) or not record.is_segment(run_id):
        raise ValueError(f"run_id {run_id!r} is not an id: [A-Za-z0-9][A-Za-z0-9._-]*, at most 253 chars")
    keys = store.keys(f"rdzv/{run_id}/")
    try:
        finished = store.read(finished_key(run_id))
    except errors.RecordCorruptError as e:  # not a verdict: `Rendezvous.join` ignores it too
        log.warning("run %s: ignoring an invalid finished record: %s", run_id, e)
        return None
    if finished is None:
        return None
    last = (floor_key(run_id), finished_key(run_id))
    for key in [k for k in keys if k not in last] + list(last):
        store.delete(key)
    log.info("run %s was finished (%r): its rendezvous records were removed for a new launch", run_id,
             finished.value.get("reason"))
    return str(finished.value.get("reason", ""))
