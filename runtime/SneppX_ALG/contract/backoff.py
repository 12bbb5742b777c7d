"""One restart backoff for both sides: the operator's wait before a job's replacement pods (failurePolicy.
restartDelay) and the launcher's before it re-forms a node's workers (FaultToleranceManager)."""

from __future__ import annotations

import math
import random


def restart_delay(attempt: int, *, base: float, factor: float, cap: float, jitter: float = 0.0,
                  rng: random.Random | None = None) -> float:
    """Seconds to wait before restart number `attempt` (1, 2, ...; less counts as 1): base * factor**(attempt-1),
    capped, then shortened by a random fraction up to `jitter` (drawn from `rng`, needed when jitter > 0), so that
    nodes that failed together don't come back together (spread downwards, so even delays at the cap stay spread
    and never exceed it)."""
    try:
        grown = base * factor ** (max(attempt, 1) - 1)
    except OverflowError:  # factor**n past a float's range (n > 1023 with factor 2): far past any cap
        grown = math.inf if base > 0 else 0.0
    delay = min(cap, grown)
    if jitter:
        if rng is None:
            raise ValueError("a jittered delay needs rng")
        delay *= 1 - rng.uniform(0, jitter)
    return delay
