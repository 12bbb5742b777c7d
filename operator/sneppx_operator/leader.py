"""Leader election on a coordination.k8s.io/v1 Lease: of the operator's replicas, exactly one acts.

Why our own and not kopf's peering: kopf's peering is a priority freeze, not an election (a killed replica's
record freezes its successor until it expires, and frozen operators have stayed frozen). This is the
algorithm of client-go's leaderelection, which controller-runtime operators use, with its timings:

- A candidate reads the Lease every `retry_period`. It takes the Lease (a compare-and-swap on its
  resourceVersion) when the record has not changed for `lease_duration` *as this candidate observed it* (its
  own monotonic clock from when it last saw the record change: no two machines' clocks are ever compared), or
  at once when its holder released it. A missing Lease (deleted, or never made) is not taken: a candidate
  that finds none makes an empty one (no holder) and takes it like any other record, once it stood still for
  `lease_duration`, since the last holder may still be acting on its last renewal. An absence can't be watched
  standing still (the Lease may come and go between two reads) but a record can: its resourceVersion is never
  reused. Only a leader whose renewal still stands re-makes a missing Lease as its own at once (nobody else
  can have taken over since that renewal). Where client-go creates a missing Lease at once, a deleted Lease
  made two leaders for up to the renew deadline.
- A replica stops acting the moment it reads a record that names anyone else, or no record at all: its
  renewal no longer stands, whatever time is left on it.
- The leader renews every `retry_period`. It may act only until `renew_deadline` after the start of its last
  successful renewal (`Elector.holds()`); every write the operator makes checks that first (k8s.py), so a
  leader that was paused, partitioned or starved stops writing `lease_duration - renew_deadline` seconds
  before anyone else may take over, and a paused leader that wakes up after a takeover writes nothing: its
  clock has moved on. A write already past that check when the leader froze is still harmless: the job's
  status is written only under the resourceVersion it was planned from, pods are created under fixed names and
  deleted under their uid.
- A leader that stops (SIGTERM, a rolling update) stops acting first, then releases the Lease (holder ""), so
  its successor takes over within a retry period instead of a lease duration.

Followers watch and index like the leader (warm caches, a takeover acts at once) but write nothing.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import kubernetes
from kubernetes.client import ApiException

log = logging.getLogger(__name__)

LEASE_DURATION_S = 15.0
RENEW_DEADLINE_S = 10.0
RETRY_PERIOD_S = 2.0


class Record(NamedTuple):
    """A Lease as a candidate sees it; any change of it restarts the candidate's wait."""

    holder: str
    renew_time: Any
    resource_version: str
    duration: float | None  # the record's leaseDurationSeconds


ABSENT = Record("", None, "", None)  # no Lease there


def may_take(record: Record, identity: str, *, unchanged_for: float, lease_duration: float) -> bool:
    """Whether a candidate may write itself into the Lease `record`, seen unchanged for `unchanged_for` seconds
    on its own clock: its own record (a renewal), a release (no holder, renewed: the releaser stopped acting
    before it wrote it), and any other record once it stood still for its duration (an empty Lease made by a
    candidate that found none, or by anyone else, included)."""
    if record.holder == identity:
        return True
    if not record.holder and record.renew_time is not None:
        return True
    return unchanged_for >= (record.duration or lease_duration)


class NotLeaderError(RuntimeError):
    """A write was about to be made by a replica that does not hold the leader Lease (or no longer may act on
    it): the write is not sent."""


def default_identity() -> str:
    """The pod's name (the chart sets POD_NAME), else the host name, plus a random suffix: a restarted
    process is a new candidate, never mistaken for the one before it."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class Elector:
    """Campaigns for the Lease `namespace/name` in a thread of its own; `holds()` says whether to act now."""

    def __init__(
        self,
        namespace: str,
        name: str,
        *,
        identity: str | None = None,
        lease_duration: float = LEASE_DURATION_S,
        renew_deadline: float = RENEW_DEADLINE_S,
        retry_period: float = RETRY_PERIOD_S,
        api_client: Any = None,
        lease_api: Any = None,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[bool], None] | None = None,
        labels: Mapping[str, str] | None = None,
        owner_deployment: str | None = None,
    ):
        """`lease_api`: a CoordinationV1Api (default: one on `api_client`, else on the operator's credentials);
        `clock`: monotonic seconds (tests pass a fake one); `labels`: of a Lease this replica creates;
        `owner_deployment`: the operator's Deployment (in the Lease's namespace), which a Lease this replica
        creates names as its owner, so the garbage collector deletes it with the Deployment."""
        if not retry_period < renew_deadline < lease_duration:
            raise ValueError("leader election needs retry period < renew deadline < lease duration")
        self.namespace, self.name = namespace, name
        self.identity = identity or default_identity()
        self.lease_duration, self.renew_deadline, self.retry_period = lease_duration, renew_deadline, retry_period
        self._api_client, self._lease_api, self._clock = api_client, lease_api, clock
        self._on_change = on_change
        self._labels, self._owner_deployment = dict(labels or {}), owner_deployment
        self._lock = threading.Lock()
        self._valid_until = 0.0  # monotonic: may act while now < this
        self._observed: Record | None = None  # the record last seen
        self._observed_at = 0.0
        self._leading = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what the operator asks --

    def holds(self) -> bool:
        with self._lock:
            return self._clock() < self._valid_until

    def check(self) -> None:
        if not self.holds():
            raise NotLeaderError(f"{self.identity} does not hold the leader lease {self.namespace}/{self.name}")

    # -- the campaign --

    def start(self) -> Elector:
        self._thread = threading.Thread(target=self._run, name="leader-election", daemon=True)
        self._thread.start()
        return self

    def resign(self) -> None:
        """Stop acting now (holds() is False from here on); the Lease is released by stop()."""
        self._lose()
        self._stop.set()

    def stop(self) -> None:
        """Stop acting, stop campaigning, and release the Lease if this replica held it."""
        self.resign()
        if self._thread is not None:
            self._thread.join(timeout=self.retry_period + 10)
        self._release()  # only if the Lease still names this replica
        self._set_leading(False)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.campaign_round()
            self._stop.wait(self.retry_period)

    def campaign_round(self) -> None:
        """One round of the campaign thread (every `retry_period`): renew or try to take the Lease, and tell
        `on_change` when this replica starts or stops acting."""
        try:
            self.try_acquire_or_renew()
        except Exception:  # the API unreachable or answering oddly: not leader this round
            log.warning("leader election: can't reach the Lease %s/%s", self.namespace, self.name, exc_info=True)
        self._set_leading(self.holds())

    def _set_leading(self, leading: bool) -> None:
        if leading == self._leading:
            return
        self._leading = leading
        log.warning("leader election: %s %s the Lease %s/%s", self.identity,
                    "acquired" if leading else "lost", self.namespace, self.name)
        if self._on_change is not None:
            self._on_change(leading)

    def _client(self) -> Any:
        if self._api_client is not None:
            return self._api_client
        from sneppx_operator import k8s  # the operator's credentials, loaded at startup

        return k8s.api_client()

    def _coordination(self) -> Any:
        if self._lease_api is not None:
            return self._lease_api
        return kubernetes.client.CoordinationV1Api(self._client())

    def _owner_references(self, timeout: float) -> list[Any] | None:
        if self._owner_deployment is None:
            return None
        deployment: Any = kubernetes.client.AppsV1Api(self._client()).read_namespaced_deployment(
            self._owner_deployment, self.namespace, _request_timeout=timeout
        )
        return [kubernetes.client.V1OwnerReference(
            api_version="apps/v1", kind="Deployment", name=self._owner_deployment, uid=str(deployment.metadata.uid),
        )]

    def try_acquire_or_renew(self) -> bool:
        """One round: True when this replica holds the Lease afterwards (and `holds()` until the deadline)."""
        api = self._coordination()
        started = self._clock()
        timeout = max(1.0, min(self.retry_period * 2, self.renew_deadline / 2))
        try:
            lease = api.read_namespaced_lease(self.name, self.namespace, _request_timeout=timeout)
        except ApiException as exc:
            if exc.status != 404:
                raise
            lease = None
        record = ABSENT if lease is None else Record(
            lease.spec.holder_identity or "", lease.spec.renew_time, str(lease.metadata.resource_version),
            float(lease.spec.lease_duration_seconds) if lease.spec.lease_duration_seconds else None,
        )
        standing = self.holds()  # this replica's last renewal, before what was just read
        if record != self._observed:
            self._observed, self._observed_at = record, self._clock()
        if record.holder != self.identity:
            self._lose()  # another holder, or no Lease: this replica's last renewal no longer stands
        if lease is None:
            return self._create(api, started, timeout, holding=standing)
        if not may_take(record, self.identity, unchanged_for=self._clock() - self._observed_at,
                        lease_duration=self.lease_duration):
            return False
        spec = lease.spec
        now = _now()
        taking_over = record.holder != self.identity
        lease.spec = kubernetes.client.V1LeaseSpec(
            holder_identity=self.identity,
            lease_duration_seconds=int(self.lease_duration),
            acquire_time=now if taking_over or spec.acquire_time is None else spec.acquire_time,
            renew_time=now,
            lease_transitions=(spec.lease_transitions or 0) + (1 if taking_over else 0),  # as client-go counts
        )
        try:  # the resourceVersion read above is the precondition: two candidates can't both win
            api.replace_namespaced_lease(self.name, self.namespace, lease, _request_timeout=timeout)
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        self._renewed(started)
        return True

    def _lose(self) -> None:
        with self._lock:
            self._valid_until = 0.0

    def _create(self, api: Any, started: float, timeout: float, *, holding: bool) -> bool:
        """Make the missing Lease: as this replica's own when `holding` (its renewal still stands), else empty, to
        be taken once it stood still for a lease duration. True when this replica holds it afterwards."""
        now = _now()
        spec = kubernetes.client.V1LeaseSpec(lease_duration_seconds=int(self.lease_duration))
        if holding:
            spec = kubernetes.client.V1LeaseSpec(
                holder_identity=self.identity, lease_duration_seconds=int(self.lease_duration),
                acquire_time=now, renew_time=now, lease_transitions=0,
            )
        body = kubernetes.client.V1Lease(
            metadata=kubernetes.client.V1ObjectMeta(
                name=self.name, namespace=self.namespace, labels=self._labels or None,
                owner_references=self._owner_references(timeout),
            ),
            spec=spec,
        )
        try:
            api.create_namespaced_lease(self.namespace, body, _request_timeout=timeout)
        except ApiException as exc:
            if exc.status == 409:  # another candidate made it first
                return False
            raise
        if not holding:
            return False
        self._renewed(started)
        return True

    def _renewed(self, started: float) -> None:
        with self._lock:
            if not self._stop.is_set():
                # From the start of the request: the API server may have applied it at any time after that.
                self._valid_until = started + self.renew_deadline

    def _release(self) -> None:
        try:
            api = self._coordination()
            lease = api.read_namespaced_lease(self.name, self.namespace, _request_timeout=5)
            if lease.spec.holder_identity != self.identity:
                return
            lease.spec.holder_identity = ""
            lease.spec.lease_duration_seconds = 1
            lease.spec.renew_time = _now()
            api.replace_namespaced_lease(self.name, self.namespace, lease, _request_timeout=5)
            log.warning("leader election: %s released the Lease %s/%s", self.identity, self.namespace, self.name)
        except Exception:  # released or not, the successor takes over once the Lease expires
            log.warning("leader election: could not release the Lease", exc_info=True)
