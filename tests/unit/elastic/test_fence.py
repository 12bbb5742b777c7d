"""The worker's commit fence (elastic/rendezvous/fence.py), which Rendezvous.check_fence now calls too, from the records alone.

Each case writes the records an agent would have written (joins, a membership, the floor) into a directory store
and asks both: same outcome, same message. tests/integration/test_rendezvous.py drives check_fence with real
agents; this keeps the worker's reader, which builds no Rendezvous, to the same rule.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from SneppX_ALG import errors
from SneppX_ALG.elastic import rendezvous
from SneppX_ALG.elastic.rendezvous import fence
from SneppX_ALG.records import RecordStore, open_record_store

RUN = "fenced"


def member(agent_id: str) -> rendezvous.Member:
    return rendezvous.Member(agent_id, "0" * 32, "127.0.0.1", "127.0.0.1:1", 1, 0.0)


def membership(generation: int, *agent_ids: str) -> rendezvous.Membership:
    return rendezvous.Membership(RUN, generation, tuple(member(a) for a in agent_ids), sealed_by=agent_ids[0])


def join(store: RecordStore, generation: int, agent_id: str) -> None:
    store.create(rendezvous.join_key(RUN, generation, agent_id),
                 rendezvous.join_to_json(RUN, generation, rendezvous.Join(member(agent_id))))


def seal(store: RecordStore, m: rendezvous.Membership) -> None:
    store.create(rendezvous.membership_key(RUN, m.generation), rendezvous.membership_to_json(m))


def set_floor(store: RecordStore, generation: object) -> None:
    store.create(rendezvous.floor_key(RUN), {"version": 1, "kind": "floor", "run_id": RUN, "generation": generation})


RUNNING = membership(3, "a", "b")
CASES: dict[str, tuple[Callable[[RecordStore], None], str | None]] = {
    "nothing after it": (lambda s: None, None),
    "a late joiner waits": (lambda s: join(s, 4, "c"), None),
    "a member joined the next": (lambda s: (join(s, 4, "c"), join(s, 4, "b")), "generation 4 was joined by b"),
    "the next is sealed": (lambda s: seal(s, membership(4, "c")), "generation 4 is sealed"),
    "its records were removed": (lambda s: set_floor(s, 4), "generation 3's records were removed"),
    "the floor is its own": (lambda s: set_floor(s, 3), None),
    "a floor that is not a number": (lambda s: set_floor(s, True), None),
    "an older membership": (lambda s: seal(s, membership(3, "a", "b")), None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_fence_reader_and_the_rendezvous_give_the_same_answer(tmp_path: Path, case: str) -> None:
    store = open_record_store(str(tmp_path))
    prepare, stale = CASES[case]
    prepare(store)
    agent = rendezvous.Rendezvous(store, RUN, agent_id="a", host="127.0.0.1", heartbeat="127.0.0.1:1", workers=1)
    outcomes = []
    for check in (lambda: agent.check_fence(RUNNING), lambda: fence.check(store, RUNNING)):
        try:
            check()
            outcomes.append(None)
        except errors.StaleGenerationError as e:
            assert e.generation == RUNNING.generation
            outcomes.append(str(e))
    assert outcomes[0] == outcomes[1], outcomes
    if stale is None:
        assert outcomes[1] is None
    else:
        assert outcomes[1] is not None and stale in outcomes[1]


def test_a_fence_that_cannot_be_read_refuses_the_commit(tmp_path: Path) -> None:
    class Unavailable:
        uri = "unavailable://"

        def keys(self, prefix: str, limit: int | None = None) -> list[str]:
            raise errors.RecordUnavailableError("the store is down", key=prefix)

    with pytest.raises(errors.RecordUnavailableError):
        fence.check(Unavailable(), RUNNING)  # type: ignore[arg-type]
