"""When to save and which steps to keep: small pure policies (orbax's "checkpoint manager" decisions)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable


def is_save_step(step: int, every: int | None, last_saved: int | None) -> bool:
    """True on multiples of `every` that were not saved already (every=None or 0: never)."""
    return bool(every) and step % every == 0 and step != last_saved  # type: ignore[operator]


def steps_to_delete(committed: list[int], *, new_step: int, max_to_keep: int | None,
                    keep_every_n_steps: int | None = None, protected: frozenset[int] = frozenset()) -> list[int]:
    """Retention, decided after `new_step` was committed: keeps the newest max_to_keep steps, every step
    divisible by keep_every_n_steps, new_step itself and `protected` (e.g. the last step known valid).
    Only steps older than new_step are ever deleted, so the newest good copy survives until a newer one
    is committed. max_to_keep None or 0 keeps everything."""
    if not max_to_keep or max_to_keep < 0:
        return []
    ordered = sorted(set(committed) | {new_step})
    keep = set(ordered[-max_to_keep:]) | {new_step} | set(protected)
    if keep_every_n_steps:
        keep |= {s for s in ordered if s % keep_every_n_steps == 0}
    return [s for s in ordered if s not in keep and s < new_step]


def referenced(kept: Iterable[int], uses_of: Callable[[int], list[int]]) -> set[int]:
    """Every step that a kept step references (an incremental step's `uses`), and what those reference in turn:
    none of them may be deleted while the steps that reference them are kept. (A step's references point at
    the steps that hold the bytes, so one level is enough for the kept steps themselves; the closure keeps a
    referenced step whole too, so it stays a valid step, not a visible one that fails.)"""
    found: set[int] = set()
    todo = list(kept)
    while todo:
        for used in uses_of(todo.pop()):
            if used not in found:
                found.add(used)
                todo.append(used)
    return found


def set_aside_to_delete(set_aside: list[tuple[int, str]], *, max_to_keep: int | None) -> list[str]:
    """Names of set-aside steps (`.invalid-*`, `.abandoned-*`, as (step, name)) beyond the newest max_to_keep
    by step number: kept for inspection, bounded like the committed steps. max_to_keep None or 0 keeps all."""
    if not max_to_keep or max_to_keep < 0:
        return []
    return [name for _, name in sorted(set_aside)[:-max_to_keep]]


@dataclasses.dataclass(frozen=True)
class Plan:
    """What retention decided for a root: the committed steps to `keep` and to `delete` (oldest first),
    set-aside steps to remove, the step kept because it is the newest that validates (`protected`: None when
    no deletion needed it read, or when none validates), the problems of the steps read and found invalid
    on the way to it, the steps kept only because a kept step references them (`pinned`), and the step a
    writer restored and has not saved after (`restored`, from the root's rollback record: kept, and its chain)."""

    keep: list[int]
    delete: list[int]
    remove_set_aside: list[str]
    protected: int | None
    invalid: dict[int, list[str]]
    pinned: list[int] = dataclasses.field(default_factory=list)
    restored: int | None = None
