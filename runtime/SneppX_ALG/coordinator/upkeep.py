"""The root's upkeep by the committing rank's writer: the fences a restore made applied, an invalid step of the
number being saved moved aside, and retention planned and applied.

Why a module of its own: these change which steps a root shows (they move and delete steps) but write none;
retention is also what `sneppx gc` runs (CheckpointCoordinator.retention_plan), without a writer thread. The
rules themselves are pure, in retention.py and timeline.py; here they are applied to a root's steps.
"""

from __future__ import annotations

import logging

from SneppX_ALG import errors
from SneppX_ALG.coordinator import retention, steps, timeline

log = logging.getLogger(__name__)


def apply_fences(root: steps.Steps, *, stored: bool) -> None:
    """Before a commit: the steps a restore abandoned (and, with `stored`, those of a fence record an interrupted
    process left) are moved aside, listed first in the durable fence record (docs/FORMAT.md, "Timelines and
    fencing"), so they are never visible again, even if this is cut short."""
    store = root.store
    fences = []
    if stored:
        found = root.stored_fence()
        fences += [found] if found is not None else []
    pending = root.pending_fence()
    fences += [pending] if pending is not None else []
    for fence in fences:
        store.write_root_file(timeline.FENCE_RECORD, timeline.encode_fence(fence))
        for step in reversed(fence.abandoned):
            reason = "invalid" if step in fence.invalid else "abandoned"
            try:
                aside = store.set_aside(step, reason)
            except errors.CheckpointNotFoundError:
                continue  # moved already (a fence record finished by a later process), or deleted
            log.info("new timeline from step %d: step %d set aside as %s", fence.restored, step, aside)
        store.remove_root_file(timeline.FENCE_RECORD)
        root.fence_applied(fence)
    if pending is not None or stored:  # the rollback is no longer pending (or one a dead writer left is stale)
        store.remove_root_file(timeline.ROLLBACK_RECORD)


def set_aside_if_invalid(root: steps.Steps, step: int) -> None:
    """A committed step being saved again (after a rollback past it): an invalid copy is moved aside so
    the new one can commit; a valid one stays and finalize() refuses to overwrite it. An invalid one that
    another visible step references stays too (its files hold that step's bytes: moving it would break a
    step that may well be valid), and the save is refused before anything is written."""
    try:
        problems = root.check(step)[1]
    except errors.CheckpointNotFoundError:
        return
    if problems:
        users = [s for s in root.visible() if s != step and step in root.uses(s)]
        if users:
            raise errors.CheckpointExistsError(
                f"step {step} is committed (and invalid: {problems[0]}), and step(s) {users} reference its "
                "files: it is not set aside, and a step is never overwritten", path=root.store.uri)
        aside = root.store.set_aside(step, "invalid")
        root.forget([step])
        log.warning("step %d was committed but invalid (%s); moved to %s", step, problems[0], aside)


def retain(root: steps.Steps, new_step: int, max_to_keep: int | None, keep_every_n_steps: int | None) -> None:
    """Retention after `new_step` committed (plan_retention, then apply_retention). A step that can't be
    read now stops retention for this save: nothing is deleted on a guess."""
    try:
        plan = plan_retention(root, new_step, max_to_keep, keep_every_n_steps)
    except errors.CheckpointUnreadableError as e:
        log.warning("retention skipped after step %d: %s", new_step, e)
        return
    apply_retention(root, plan)
    invalid = plan.invalid.get(new_step, [])
    if invalid:
        raise errors.CommittedStepInvalidError(
            f"step {new_step} was committed but does not validate when read back: {'; '.join(invalid[:3])}. "
            "Retention kept the newest step that does.", path=root.store.uri)


def plan_retention(root: steps.Steps, new_step: int | None, max_to_keep: int | None,
                   keep_every_n_steps: int | None) -> retention.Plan:
    """What retention deletes after `new_step` committed (None: the newest visible step): what
    retention.steps_to_delete says, never the newest step that validates, and set-aside steps beyond
    max_to_keep. The one rule for the writer after each save and for `sneppx gc`.

    Which step is the newest valid one is learned by reading it, and only when a deletion could touch
    it: when this process knows (from a read) of a valid step newer than every step to delete, nothing
    is read. Otherwise the steps are validated newest first (the new step first: usually it is valid)
    until one validates. In the steady state that is one read-back every max_to_keep saves (a step
    validated stays known valid until it is the oldest kept); with max_to_keep=1 it is every save:
    keeping a single copy means proving the new one good before the old one goes.

    A step a writer restored and has not saved after (the root's rollback record) is kept, with every step it
    references: the writer's next save continues that chain. The record is read before the steps are listed,
    so a writer that commits meanwhile has set the abandoned steps aside first, and its step is the newest.
    Raises CheckpointUnreadableError when a step can't be read now, FenceRecordError when the record is bad."""
    rollback = root.stored_rollback()
    committed = root.visible()
    if new_step is None:
        new_step = committed[-1] if committed else None
    doomed: list[int] = []
    protected: int | None = None
    rejected: dict[int, list[str]] = {}
    if new_step is not None:
        doomed = retention.steps_to_delete(committed, new_step=new_step, max_to_keep=max_to_keep,
                                           keep_every_n_steps=keep_every_n_steps)
        known = root.known_valid
        if doomed and (known is None or known not in committed or known <= max(doomed)):
            protected, rejected = root.newest_valid(committed)
            doomed = retention.steps_to_delete(
                committed, new_step=new_step, max_to_keep=max_to_keep, keep_every_n_steps=keep_every_n_steps,
                protected=frozenset() if protected is None else frozenset({protected}))
    restored = rollback.restored if rollback is not None and rollback.restored in committed else None
    doomed = [s for s in doomed if s != restored]
    pinned: set[int] = set()
    if doomed:  # never a step that a kept one references (incremental steps): it would break that step
        pinned = retention.referenced([s for s in committed if s not in doomed], root.uses) & set(doomed)
        doomed = [s for s in doomed if s not in pinned]
    return retention.Plan(keep=[s for s in committed if s not in doomed], delete=doomed,
                          remove_set_aside=retention.set_aside_to_delete(root.store.set_aside_steps(),
                                                                         max_to_keep=max_to_keep),
                          protected=protected, invalid=rejected, pinned=sorted(pinned), restored=restored)


def apply_retention(root: steps.Steps, plan: retention.Plan) -> None:
    """Deletes the steps and set-aside steps `plan` names (one already gone is passed over), newest first: a
    step is referenced only by newer ones, so a deletion cut short never leaves a step whose references are
    gone (the kill harness found the oldest-first order doing that)."""
    for step in sorted(plan.delete, reverse=True):
        try:
            root.store.delete(step)
        except errors.CheckpointNotFoundError:
            continue
        log.info("retention: deleted checkpoint step %d", step)
    root.forget(plan.delete)
    for name in plan.remove_set_aside:
        root.store.remove_set_aside(name)
        log.info("retention: removed set-aside step %s", name)
