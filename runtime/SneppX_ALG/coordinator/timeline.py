"""Timelines: a restore to an older step starts a new one, and the steps it abandons are fenced off. Pure.

Why: after `restore(step=2000)` training goes on from 2000 and saves 2100, 2200, ... The committed 3000 and
4000 belong to a timeline that was abandoned; were they left in place, `latest()` after a restart would
resume from 4000, and retention would count them as the newest steps. So before the first save of the new
timeline commits, the steps newer than the restored one are moved out of the step namespace (set aside as
`.abandoned-...`, or `.invalid-...` for those the restore found invalid). Several moves are not atomic, so a
durable fence record (`FENCE` at the root) lists them first; readers skip every step it lists, and the writer
removes it once every listed step is moved. Spec: docs/FORMAT.md, "Timelines and fencing".

Until that first save, the rollback is only pending: a writer that restores and never saves (an evaluator) must
leave the root as it was, so readers still see the newer steps. But retention run beside it (`sneppx gc`) must
not delete the restored step's chain, which the next save continues; so a writer's restore that rolls back also
records the pending fence at the root (`ROLLBACK`, the same encoding), which readers ignore and retention obeys.
The first commit after it (or the writer's close without one) removes it.
"""

from __future__ import annotations

import dataclasses
import json

from SneppX_ALG import errors

FENCE_RECORD = "FENCE"
ROLLBACK_RECORD = "ROLLBACK"  # a pending fence: keeps retention off the restored step's chain, hides nothing
FENCE_FORMAT = "sneppx.fence"
FENCE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Fence:
    """The steps a restore to `restored` abandoned, and which of them that restore found invalid."""

    restored: int
    abandoned: tuple[int, ...]
    invalid: tuple[int, ...] = ()


def fence_after(restored: int, visible: list[int], invalid: set[int] | frozenset[int] = frozenset(),
                ) -> Fence | None:
    """The fence a restore to `restored` makes over the visible steps, or None when none is newer."""
    newer = tuple(sorted(s for s in visible if s > restored))
    if not newer:
        return None
    return Fence(restored, newer, tuple(s for s in newer if s in invalid))


def encode_fence(fence: Fence) -> bytes:
    return json.dumps({"format": FENCE_FORMAT, "version": FENCE_VERSION, "restored": fence.restored,
                       "abandoned": list(fence.abandoned), "invalid": list(fence.invalid)},
                      sort_keys=True, separators=(",", ":")).encode()


def decode_fence(raw: bytes, *, where: str) -> Fence:
    """The fence a record holds; FenceRecordError when it is not one this format describes."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise errors.FenceRecordError(f"fence record is not JSON: {e}", path=where) from None
    if not isinstance(doc, dict) or doc.get("format") != FENCE_FORMAT or doc.get("version") != FENCE_VERSION:
        raise errors.FenceRecordError(f"not a version-{FENCE_VERSION} SneppX fence record", path=where)
    restored, abandoned, invalid = doc.get("restored"), doc.get("abandoned"), doc.get("invalid")

    def steps(value: object) -> bool:
        return isinstance(value, list) and all(type(s) is int and s >= 0 for s in value)

    if type(restored) is not int or restored < 0 or not steps(abandoned) or not steps(invalid):
        raise errors.FenceRecordError("fence record fields are malformed", path=where)
    assert isinstance(abandoned, list) and isinstance(invalid, list)
    if not set(invalid) <= set(abandoned) or any(s <= restored for s in abandoned):
        raise errors.FenceRecordError("fence record lists steps it can't abandon", path=where)
    return Fence(restored, tuple(abandoned), tuple(invalid))
