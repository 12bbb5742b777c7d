"""Operator mode's hang reports (elastic/pod.py): who is out of the generations and since when (`AbsentMembers`,
fed memberships, waiting joiners and times by hand), and the `job/hung/<pod>` records node rank 0 writes about
them (`JobLink.report_hung`), read back the way the operator reads them. The agent calling these while a real
job trains is tests/k8s/test_training_e2e.py."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from SneppX_ALG import errors
from SneppX_ALG.contract import job_object
from SneppX_ALG.elastic import pod, rendezvous
from SneppX_ALG.records import open_record_store

HANG = 30.0


def membership(generation: int, *agents: str) -> rendezvous.Membership:
    members = tuple(rendezvous.Member(a, f"{i:032x}", "127.0.0.1", f"127.0.0.1:{29500 + i}", 2, 0.0)
                    for i, a in enumerate(sorted(agents)))
    return rendezvous.Membership("train", generation, members, members[0].agent_id)


def due(absent: pod.AbsentMembers, now: float, timeout: float | None = HANG) -> list[tuple[str, int, int, float]]:
    return [(a.agent_id, a.rank, a.generation, a.since) for a in absent.due(now, timeout)]


def test_a_member_that_is_out_of_the_generations_for_the_hang_timeout_is_due() -> None:
    absent = pod.AbsentMembers("train-0")
    absent.formed(membership(1, "train-0", "train-1", "train-2"), now=100.0)
    assert absent.absent() == {} and due(absent, 1000.0) == []
    absent.formed(membership(2, "train-0", "train-2"), now=110.0)  # train-1 (node rank 1 of generation 1) is out
    absent.waiting([], now=111.0)
    assert absent.absent() == {"train-1": 110.0}
    assert due(absent, 139.9) == []
    assert due(absent, 140.0) == [("train-1", 1, 1, 110.0)]
    # another generation without it: its absence goes on from the first one
    absent.formed(membership(3, "train-0", "train-2"), now=120.0)
    assert due(absent, 140.0) == [("train-1", 1, 1, 110.0)]


def test_a_report_restarts_the_window_so_a_replacement_gets_a_whole_hang_timeout() -> None:
    absent = pod.AbsentMembers("train-0")
    absent.formed(membership(1, "train-0", "train-1"), now=0.0)
    absent.formed(membership(2, "train-0"), now=5.0)
    assert [a for a, *_ in due(absent, 35.0)] == ["train-1"]
    absent.reported("train-1", now=35.0)
    assert due(absent, 64.9) == []
    assert due(absent, 65.0) == [("train-1", 1, 1, 35.0)]  # still its last generation's rank and number
    absent.reported("train-0", now=70.0)  # not absent: nothing to restart
    assert absent.absent() == {"train-1": 35.0}


def test_a_peer_that_waits_to_join_or_is_a_member_again_is_not_absent() -> None:
    absent = pod.AbsentMembers("train-0")
    absent.formed(membership(1, "train-0", "train-1", "train-2"), now=0.0)
    absent.formed(membership(2, "train-0"), now=1.0)
    assert set(absent.absent()) == {"train-1", "train-2"}
    absent.waiting(["train-1"], now=20.0)  # its replacement joined the next generation
    assert set(absent.absent()) == {"train-2"}
    assert [a for a, *_ in due(absent, 40.0)] == ["train-2"]
    absent.waiting(["train-1"], now=45.0)  # still waiting: not absent
    assert "train-1" not in absent.absent()
    absent.waiting([], now=50.0)  # it stopped waiting (its join withdrawn) without becoming a member: a new window
    assert absent.absent()["train-1"] == 50.0
    absent.formed(membership(3, "train-0", "train-1", "train-2"), now=60.0)  # both back
    assert absent.absent() == {} and due(absent, 1e6) == []
    absent.formed(membership(4, "train-0", "train-1"), now=70.0)  # train-2 out again: a new absence
    assert due(absent, 100.0) == [("train-2", 2, 3, 70.0)]


def test_the_agent_itself_and_agents_never_seen_in_its_generations_are_never_absent() -> None:
    absent = pod.AbsentMembers("train-1")
    absent.formed(membership(5, "train-1"), now=0.0)  # a replacement: it knows nothing of train-0 before
    absent.waiting(["train-9"], now=1.0)
    absent.formed(membership(6, "train-1", "train-2"), now=2.0)
    absent.waiting([], now=3.0)
    assert absent.absent() == {}  # train-9 was only ever waiting; train-2 is a member
    absent.formed(membership(7, "train-1"), now=4.0)
    assert set(absent.absent()) == {"train-2"}  # never itself


def test_no_hang_timeout_means_no_reports() -> None:
    absent = pod.AbsentMembers("train-0")
    absent.formed(membership(1, "train-0", "train-1"), now=0.0)
    absent.formed(membership(2, "train-0"), now=1.0)
    assert due(absent, 1e9, None) == [] and due(absent, 1e9, 0) == [] and due(absent, 1e9, 0.0) == []
    assert due(absent, 1e9, 5) != []


def test_what_is_remembered_is_bounded() -> None:
    absent = pod.AbsentMembers("a-0000", limit=8)
    for generation in range(1, 21):  # a new peer in every generation, then out
        absent.formed(membership(generation, "a-0000", f"b-{generation:04d}"), now=float(generation))
    # 8 remembered: itself, the current generation's other member, and the 6 peers out the shortest time
    assert set(absent.absent()) == {f"b-{g:04d}" for g in range(14, 20)}


# ---- the records ------------------------------------------------------------------------------------------


def operator_view(records: Any) -> job_object.View:
    """The job's records as the operator reads them (job_object.read_view over the object's data)."""
    data = {}
    for key in records.keys("job/"):
        stored = records.read(key)
        data[job_object.data_key(key)] = job_object.encode_value(key, stored.value)
    return job_object.read_view(data)


def test_rank_0_writes_what_the_operator_reads_and_the_silence_began_before_the_absence(tmp_path: Path) -> None:
    records = open_record_store(str(tmp_path / "object"))
    link = pod.JobLink(records, str(tmp_path / "ckpts"), "train-0")
    absent = pod.AbsentMembers("train-0")
    before = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    started = time.monotonic()
    absent.formed(membership(3, "train-0", "train-1", "train-2"), now=started - 60)
    absent.formed(membership(4, "train-0", "train-1"), now=started - 42.25)  # train-2 went 42.25 s ago
    assert link.report_hung(absent, None) == [] and link.report_hung(absent, 0) == []
    written = link.report_hung(absent, HANG)
    after = datetime.datetime.now(datetime.UTC)
    view = operator_view(records)
    assert not view.problems and view.hung == tuple(written) and len(written) == 1
    hung = written[0]
    assert (hung.pod, hung.rank, hung.generation, hung.reported_by) == ("train-2", 2, 3, "train-0")
    reported_at = job_object.parse_time(hung.reported_at)
    assert before <= reported_at <= after
    assert hung.silent_seconds >= 42.25 + pod.ABSENCE_MARGIN_S
    # what the operator compares with the pod's creation: at least a second before the absence began
    began = reported_at - datetime.timedelta(seconds=hung.silent_seconds)
    assert began <= after - datetime.timedelta(seconds=42.25 + pod.ABSENCE_MARGIN_S)
    assert absent.absent()["train-2"] >= started  # its window started again
    assert link.report_hung(absent, HANG) == []


def test_a_report_never_counts_against_a_pod_created_after_the_absence_began() -> None:
    """Whatever the clocks' fractions: `reported_at - silent_seconds` is before the second the absence began in,
    so a pod created at or after that moment (creationTimestamp rounded down) is never older than the silence."""
    absence = pod.Absence("train-1", 1, 7, since=1000.0)
    for began_fraction in (0.0, 0.0004, 0.5, 0.9999):
        for elapsed in (30.0, 30.0004, 30.5, 30.9996):
            began = datetime.datetime(2030, 1, 1, 12, 0, 0, tzinfo=datetime.UTC) + datetime.timedelta(
                seconds=began_fraction)
            wall = began + datetime.timedelta(seconds=elapsed)
            hung = pod.hung_record(absence, "train-0", now=1000.0 + elapsed, wall=wall)
            silence = job_object.parse_time(hung.reported_at) - datetime.timedelta(seconds=hung.silent_seconds)
            created = began.replace(microsecond=0)  # a replacement created as the absence began, to the second
            assert silence < created, (began_fraction, elapsed, hung)
            assert hung.silent_seconds >= elapsed


class FailingStore:
    """A record store that is down: every call raises what a store raises when it is unreachable."""

    uri = "down://"

    def __init__(self) -> None:
        self.calls = 0

    def read(self, key: str) -> None:
        self.calls += 1
        raise errors.RecordUnavailableError("the API server is unreachable", key=key)

    create = swap = delete = keys = read


def test_a_store_error_is_logged_and_the_report_is_tried_again_at_the_next_poll(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    absent = pod.AbsentMembers("train-0")
    absent.formed(membership(1, "train-0", "train-1", "train-2", "train-3"), now=0.0)
    absent.formed(membership(2, "train-0"), now=time.monotonic() - 100)
    down = FailingStore()
    link = pod.JobLink(down, str(tmp_path / "ckpts"), "train-0")  # type: ignore[arg-type]
    assert link.report_hung(absent, HANG) == []
    assert down.calls == 1  # the first error ends the round: a store that is down isn't asked three times
    assert "can't report train-1 hung" in caplog.text
    assert all(since < time.monotonic() - 99 for since in absent.absent().values())  # still due

    link.store = open_record_store(str(tmp_path / "object"))  # back up
    written = link.report_hung(absent, HANG)
    assert [h.pod for h in written] == ["train-1", "train-2", "train-3"]
    assert {h.pod for h in operator_view(link.store).hung} == {"train-1", "train-2", "train-3"}


def test_the_reports_of_one_poll_are_bounded(tmp_path: Path) -> None:
    agents = [f"train-{i}" for i in range(20)]
    absent = pod.AbsentMembers("train-0")
    absent.formed(membership(1, *agents), now=0.0)
    absent.formed(membership(2, "train-0"), now=time.monotonic() - 100)
    link = pod.JobLink(open_record_store(str(tmp_path / "object")), str(tmp_path / "ckpts"), "train-0")
    first = link.report_hung(absent, HANG, limit=8)
    second = link.report_hung(absent, HANG, limit=8)
    third = link.report_hung(absent, HANG, limit=8)
    assert (len(first), len(second), len(third)) == (8, 8, 3)
    assert {h.pod for h in first + second + third} == set(agents[1:])
    assert link.report_hung(absent, HANG) == []


# ---- a pod that stalls the forming of the next generation (issue 38, defect 10) -----------------------------


def test_the_stalled_report_waits_the_hang_timeout_but_at_most_half_the_join_timeout() -> None:
    """Exhaustive over a grid: reported only while fewer than min_nodes joined, never with hang reports off, and
    always early enough that half the join timeout is left for the replacement."""
    for hang in (None, 0, 0.0, 1, 10, 299, 300, 301, 1800):
        for join_timeout in (1.0, 20.0, 600.0, 3600.0):
            for min_nodes in (1, 2, 5):
                for joined in range(7):
                    after = pod.stalled_report_after(hang, join_timeout, joined, min_nodes)
                    if not hang or joined >= min_nodes:
                        assert after is None, (hang, join_timeout, joined, min_nodes)
                        continue
                    assert after is not None and 0 < after <= hang and after <= join_timeout / 2
                    assert after == hang or (after == join_timeout / 2 < hang)  # the cap, only when it binds


POLLS = st.lists(st.tuples(st.floats(0.0, 40.0), st.sets(st.integers(1, 4)), st.booleans()), max_size=40)


@settings(max_examples=300, deadline=None)
@given(peers=st.integers(1, 4), min_nodes=st.integers(1, 6), hang=st.sampled_from([None, 0, 5.0, 30.0, 1800.0]),
       join_timeout=st.sampled_from([10.0, 60.0, 600.0]), ended_after=st.floats(0.0, 100.0), polls=POLLS)
def test_the_sealer_reports_exactly_the_members_of_the_last_generation_that_stall_the_next(
    peers: int, min_nodes: int, hang: float | None, join_timeout: float, ended_after: float,
    polls: list[tuple[float, set[int], bool]],
) -> None:
    """The agent's rule while it seals the generation after its own (agent._forming), at random: at each poll it
    sees who joined (itself always, some of its old peers, perhaps a pod that never was a member: one that was
    Pending or pulling its image), and reports what is due (`JobLink.report_hung` restarts the window of each).
    Oracle, by replay: a peer is due iff it was a member of the generation that ended, is not joined now, fewer
    than min_nodes joined, and it has been out, since the generation ended or it was last seen joined or last
    reported, for the hang timeout capped at half the join timeout."""
    me, names = "train-0", [f"train-{i}" for i in range(1, peers + 1)]
    stranger = "train-9"  # joins now and then; never a member of a generation this agent was in
    absent = pod.AbsentMembers(me)
    absent.formed(membership(4, me, *names), now=1000.0)
    now = 1000.0 + ended_after
    absent.ended(now)
    since = dict.fromkeys(names, now)  # the oracle: when each peer's absence began (None: joined)
    for dt, joined_peers, stranger_joined in polls:
        now += dt
        joined = [me] + [n for i, n in enumerate(names, 1) if i in joined_peers] + [stranger] * stranger_joined
        for name in names:
            if name in joined:
                since[name] = None
            elif since[name] is None:
                since[name] = now
        absent.waiting(joined, now)
        after = pod.stalled_report_after(hang, join_timeout, len(joined), min_nodes)
        due = [a.agent_id for a in absent.due(now, after)]
        expected = sorted(n for n, began in since.items()
                          if began is not None and after is not None and now - began >= after)
        assert sorted(due) == expected, (now, since, after)
        if after is not None:
            assert after <= join_timeout / 2 and len(joined) < min_nodes and hang
        for agent_id in due:
            absent.reported(agent_id, now)
            since[agent_id] = now
        assert me not in due and stranger not in due
        assert all(a.generation == 4 for a in absent.due(now, 0.001))  # its last generation, as reported


class StepClock:
    """Fake time for one agent's rendezvous: each sleep first runs `script` at the current time, then moves on."""

    def __init__(self, script: Callable[[float], None]) -> None:
        self.now, self.script = 0.0, script

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.script(self.now)
        self.now += max(seconds, 0.001)


def sealed(store: Any, *agents: str, generation: int = 0) -> rendezvous.Membership:
    """A generation of `agents` sealed in `store`, as their rendezvous would leave it."""
    m = membership(generation, *agents)
    m = rendezvous.Membership("run", generation, m.members, m.sealed_by)
    store.create(rendezvous.membership_key("run", generation), rendezvous.membership_to_json(m))
    return m


def test_the_sealer_of_the_next_generation_hands_on_who_joined_at_each_poll(tmp_path: Path) -> None:
    """The real rendezvous, two nodes of min_nodes = max_nodes = 2: train-1 wedged (it never joins generation 1);
    the survivor, sealing, hands its listing to `on_forming` at each poll until the replacement joins, and then
    seals with it. Fake time: nothing here waits."""
    store = open_record_store(str(tmp_path / "object"))
    before = sealed(store, "train-0", "train-1")
    seen: list[tuple[float, tuple[str, ...]]] = []

    def replacement_joins(now: float) -> None:
        key = rendezvous.join_key("run", 1, "train-1")
        if now >= 50.0 and store.read(key) is None:
            member = rendezvous.Member("train-1", "f" * 32, "127.0.0.1", "127.0.0.1:29511", 2, 0.0)
            store.create(key, rendezvous.join_to_json("run", 1, rendezvous.Join(member)))

    clock = StepClock(replacement_joins)
    survivor = rendezvous.Rendezvous(
        store, "run", agent_id="train-0", host="127.0.0.1", heartbeat="127.0.0.1:29510", workers=2,
        config=rendezvous.RendezvousConfig(min_nodes=2, max_nodes=2, join_timeout=100.0),
        clock=clock, sleep=clock.sleep, on_forming=lambda previous, joined: seen.append((clock.now, joined)))
    formed = survivor.join(previous=before, suspects={"train-1"})
    assert formed.generation == 1 and formed.agent_ids == ("train-0", "train-1")
    assert seen and all(joined == ("train-0",) for t, joined in seen if t < 50.0)
    assert seen[-1][1] == ("train-0", "train-1")
    assert len([t for t, _ in seen if t < 50.0]) >= 10  # every poll of the wait, not once


def test_without_a_replacement_the_survivor_still_gives_up_at_its_join_timeout(tmp_path: Path) -> None:
    """The hook only reports: the wait is bounded as before (no replacement ever comes here)."""
    store = open_record_store(str(tmp_path / "object"))
    before = sealed(store, "train-0", "train-1")
    calls: list[tuple[str, ...]] = []
    clock = StepClock(lambda now: None)
    survivor = rendezvous.Rendezvous(
        store, "run", agent_id="train-0", host="127.0.0.1", heartbeat="127.0.0.1:29510", workers=2,
        config=rendezvous.RendezvousConfig(min_nodes=2, max_nodes=2, join_timeout=100.0),
        clock=clock, sleep=clock.sleep, on_forming=lambda previous, joined: calls.append(joined))
    with pytest.raises(errors.RendezvousTimeoutError):
        survivor.join(previous=before, suspects={"train-1"})
    assert calls and set(calls) == {("train-0",)} and clock.now >= 100.0
