"""The leader election (leader.py) against a model of the Lease API and a fake clock: at no moment do two
replicas hold, whatever the order of their rounds, the clock's steps, a deleted or re-created Lease, or a
release; a leader stops acting at its renew deadline; and a replica that does not hold writes nothing.

The model is the boundary leader.py calls (CoordinationV1Api: read, create, replace with a resourceVersion
precondition); tests/k8s/test_operator_ha.py runs the same election on the real API server.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
from typing import Any

import hypothesis
import kopf
import kubernetes
import pytest
from hypothesis import strategies as st
from kubernetes.client import ApiException

from sneppx_operator import handlers, k8s, leader


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Leases:
    """One namespace's Leases as the API server keeps them: resourceVersion preconditions on replace, 409 on a
    second create, 404 once deleted."""

    def __init__(self) -> None:
        self.objects: dict[str, kubernetes.client.V1Lease] = {}
        self.versions = itertools.count(1)

    def read_namespaced_lease(self, name: str, namespace: str, **_: Any) -> kubernetes.client.V1Lease:
        if name not in self.objects:
            raise ApiException(status=404)
        return copy.deepcopy(self.objects[name])

    def create_namespaced_lease(self, namespace: str, body: kubernetes.client.V1Lease, **_: Any) -> None:
        if body.metadata.name in self.objects:
            raise ApiException(status=409)
        self._store(body)

    def replace_namespaced_lease(self, name: str, namespace: str, body: kubernetes.client.V1Lease, **_: Any) -> None:
        if name not in self.objects:
            raise ApiException(status=404)
        if body.metadata.resource_version != self.objects[name].metadata.resource_version:
            raise ApiException(status=409)
        self._store(body)

    def _store(self, body: kubernetes.client.V1Lease) -> None:
        body = copy.deepcopy(body)
        body.metadata.resource_version = str(next(self.versions))
        self.objects[body.metadata.name] = body

    def delete(self, name: str) -> None:
        self.objects.pop(name, None)

    def make_empty(self, name: str) -> None:
        """Someone else (a chart, kubectl apply) makes the Lease with no holder and no renewal."""
        if name not in self.objects:
            self._store(kubernetes.client.V1Lease(metadata=kubernetes.client.V1ObjectMeta(name=name, namespace="ns"),
                                                  spec=kubernetes.client.V1LeaseSpec()))


def elector(name: str, leases: Leases, clock: Clock) -> leader.Elector:
    return leader.Elector("ns", "lease", identity=name, lease_duration=15, renew_deadline=10, retry_period=2,
                          lease_api=leases, clock=clock)


def first_leader(a: leader.Elector, leases: Leases, clock: Clock) -> None:
    """`a` takes a Lease nobody renewed after seeing it so for a lease duration."""
    leases.make_empty("lease")
    assert not a.try_acquire_or_renew()
    clock.now += 15
    assert a.try_acquire_or_renew() and a.holds()


def test_a_leader_stops_acting_just_past_its_renew_deadline() -> None:
    leases, clock = Leases(), Clock()
    a = elector("a", leases, clock)
    first_leader(a, leases, clock)
    clock.now += 9.999
    assert a.holds(), "within the renew deadline of the renewal's start"
    clock.now += 0.002
    assert not a.holds(), "past the renew deadline (not the lease duration): a successor may take over at 15 s"
    with pytest.raises(leader.NotLeaderError):
        a.check()


def test_a_follower_neither_holds_nor_passes_the_check() -> None:
    leases, clock = Leases(), Clock()
    a, b = elector("a", leases, clock), elector("b", leases, clock)
    first_leader(a, leases, clock)
    for _ in range(20):
        clock.now += 2
        assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()
        assert a.holds() and not b.holds()
        with pytest.raises(leader.NotLeaderError):
            b.check()


def test_a_deleted_lease_makes_no_second_leader() -> None:
    """Issue 38, defect 1: a follower that found the Lease gone created it for itself at once, while the
    leader still acted on its last renewal."""
    leases, clock = Leases(), Clock()
    a, b = elector("a", leases, clock), elector("b", leases, clock)
    first_leader(a, leases, clock)
    leases.delete("lease")
    assert a.try_acquire_or_renew(), "a leader whose renewal stands re-makes it at once"
    assert not b.try_acquire_or_renew() and not b.holds()
    leases.delete("lease")
    assert not b.try_acquire_or_renew() and a.holds(), "b finds none: it makes an empty one, and waits"
    assert not a.try_acquire_or_renew() and not a.holds(), "a sees the Lease isn't its own: it stops at once"
    clock.now += 14.9
    assert not a.try_acquire_or_renew() and not b.try_acquire_or_renew()
    clock.now += 0.1
    assert a.try_acquire_or_renew() and a.holds(), "unchanged for a lease duration as a saw it: a takes it"
    assert not b.try_acquire_or_renew() and not b.holds()


def test_a_leader_stops_the_moment_it_sees_another_holder() -> None:
    leases, clock = Leases(), Clock()
    a = elector("a", leases, clock)
    first_leader(a, leases, clock)
    leases.delete("lease")  # replaced by someone who takes a missing Lease at once, as client-go does
    leases.create_namespaced_lease("ns", kubernetes.client.V1Lease(
        metadata=kubernetes.client.V1ObjectMeta(name="lease"),
        spec=kubernetes.client.V1LeaseSpec(holder_identity="rogue", lease_duration_seconds=15)))
    assert a.holds()
    assert not a.try_acquire_or_renew() and not a.holds(), "another holder seen: a stops, time left or not"


def test_a_release_is_taken_at_once_and_an_empty_lease_nobody_renewed_only_after_a_lease_duration() -> None:
    leases, clock = Leases(), Clock()
    a, b = elector("a", leases, clock), elector("b", leases, clock)
    leases.make_empty("lease")
    assert not a.try_acquire_or_renew(), "made by someone else: the last holder may still act"
    clock.now += 15
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    a.stop()
    assert not a.holds() and b.try_acquire_or_renew(), "released: the releaser stopped acting before"


# The random schedule: each step is one replica's round, a clock step, or something done to the Lease.
STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("round"), st.integers(0, 2)),
        st.tuples(st.just("tick"), st.floats(0.1, 20)),
        st.tuples(st.just("delete"), st.just(0)),
        st.tuples(st.just("make_empty"), st.just(0)),
        st.tuples(st.just("stop"), st.integers(0, 2)),
    ),
    max_size=80,
)


@hypothesis.settings(max_examples=400, deadline=None)
@hypothesis.given(STEPS)
def test_at_no_moment_do_two_replicas_hold(steps: list[tuple[str, Any]]) -> None:
    """The oracle is the invariant itself: after every step at most one replica holds (a replica that
    stopped is replaced by a new process, a new identity)."""
    leases, clock = Leases(), Clock()
    generation = itertools.count()
    replicas = [elector(f"r{i}-{next(generation)}", leases, clock) for i in range(3)]
    for what, arg in steps:
        if what == "round":
            replicas[arg].try_acquire_or_renew()
        elif what == "tick":
            clock.now += arg
        elif what == "delete":
            leases.delete("lease")
        elif what == "make_empty":
            leases.make_empty("lease")
        else:
            replicas[arg].stop()
            replicas[arg] = elector(f"r{arg}-{next(generation)}", leases, clock)
        holding = [r.identity for r in replicas if r.holds()]
        assert len(holding) <= 1, f"two leaders after {what}: {holding}"


def test_the_operator_fences_its_writes_with_the_election(monkeypatch: pytest.MonkeyPatch) -> None:
    """handlers.startup wires the election into k8s.py's fence: a replica that does not hold the Lease sends
    no write (the mutation audit wired the fence to holds(), which returns False and so never refuses)."""

    class Follower(leader.Elector):
        def start(self) -> leader.Elector:
            return self  # no campaign: this replica never holds

    def no_api(*_: Any, **__: Any) -> Any:
        raise AssertionError("a write reached the API client")

    monkeypatch.setattr(leader, "Elector", Follower)
    monkeypatch.setattr(k8s, "connect", lambda: None)
    monkeypatch.setattr(k8s, "_calls", no_api)
    monkeypatch.setattr(handlers, "ELECTION", handlers.Election("ns", "lease"))
    try:
        asyncio.run(handlers.startup(settings=kopf.OperatorSettings()))
        assert not handlers.acting()
        with pytest.raises(leader.NotLeaderError):
            k8s.create({"kind": "Pod", "metadata": {"name": "p", "namespace": "ns"}})
    finally:
        k8s.set_fence(None)
        handlers._elector = None
