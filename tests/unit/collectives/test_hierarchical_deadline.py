"""A hierarchical call (shared memory in each host, rings between) is two or three sub-calls: together they get
the call's one deadline, each what is left of it. Before, each got the whole timeout again, so a call could
last up to 3x its deadline. The sub-groups are fakes on a fake clock (the boundary); the rule is exact."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from SneppX_ALG.collectives import group as group_lib


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeSubGroup:
    """Any call: records the timeout it was given (its last argument) and lets `spent` pass on the clock."""

    def __init__(self, clock: Clock, name: str, spent: list[float], seen: list[tuple[str, float]]):
        self.clock, self.name, self.spent, self.seen = clock, name, spent, seen

    def __getattr__(self, call: str) -> Any:
        def run(*args: Any) -> None:
            self.seen.append((f"{self.name}.{call}", args[-1]))
            self.clock.now += self.spent[len(self.seen) - 1]

        return run


@settings(max_examples=300, deadline=None)
@given(op=st.sampled_from(["allreduce", "reduce_scatter", "allgather", "broadcast", "barrier"]),
       timeout=st.floats(0.01, 600), spent=st.lists(st.floats(0, 400), min_size=3, max_size=3))
def test_the_sub_calls_share_one_deadline(op: str, timeout: float, spent: list[float]) -> None:
    clock, seen = Clock(), []
    h = group_lib._Hierarchical(FakeSubGroup(clock, "host", spent, seen),  # type: ignore[arg-type]
                                FakeSubGroup(clock, "ring", spent, seen),  # type: ignore[arg-type]
                                [[0, 1], [2, 3]], 0)
    h.clock = clock
    data = np.zeros(10, np.float32)
    args = {"allreduce": (data, 10, "float32", "sum"), "reduce_scatter": (data, 10, "float32", "sum"),
            "allgather": (data, 10, "float32"), "broadcast": (data, 0), "barrier": ()}[op]
    getattr(h, op)(*args, timeout)
    assert len(seen) >= 2
    elapsed = 0.0
    for (_, given_timeout), took in zip(seen, spent, strict=False):
        # what is left of the one deadline (a passed one: the sliver), so no sub-call can end after it
        assert given_timeout == pytest.approx(max(timeout - elapsed, group_lib.MIN_SUB_CALL_TIMEOUT), abs=1e-9)
        elapsed += took
