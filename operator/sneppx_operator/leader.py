"""Leader election on a coordination.k8s.io/v1 Lease: of the operator's replicas, exactly one acts.

Why our own and not kopf's peering: kopf's peering is a priority freeze, not an election (a killed replica's
record freezes its successor until it expires, and frozen operators have stayed frozen). This is the
algorithm of client-go's leaderelection, which controller-runtime operators use, with its timings:

- A candidate reads the Lease every `retry_period`. It takes the Lease (a compare-and-swap on its
  resourceVersion) when nobody holds it, or when the record has not changed for `lease_duration` *as this
  candidate observed it* (its own monotonic clock from when it last saw the record change: no two machines'
  clocks are ever compared).
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
from collections.abc import Callable
from typing import Any

import kubernetes
from kubernetes.client import ApiException

log = logging.getLogger(__name__)

LEASE_DURATION_S = 15.0
RENEW_DEADLINE_S = 10.0
RETRY_PERIOD_S = 2.0


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
        on_change: Callable[[bool], None] | None = None,
    ):
        if not retry_period < renew_deadline < lease_duration:
            raise ValueError("leader election needs retry period < renew deadline < lease duration")
        self.namespace, self.name = namespace, name
        self.identity = identity or default_identity()
        self.lease_duration, self.renew_deadline, self.retry_period = lease_duration, renew_deadline, retry_period
        self._api_client = api_client
        self._on_change = on_change
        self._lock = threading.Lock()
        self._valid_until = 0.0  # monotonic: may act while now < this
        self._observed: tuple[Any, ...] | None = None  # the record last seen: (holder, renew time, rv)
        self._observed_at = 0.0
        self._leading = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what the operator asks --

    def holds(self) -> bool:
        with self._lock:
            return time.monotonic() < self._valid_until

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
        with self._lock:
            self._valid_until = 0.0
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
            try:
                self.try_acquire_or_renew()
            except Exception:  # the API unreachable or answering oddly: not leader this round
                log.warning("leader election: can't reach the Lease %s/%s", self.namespace, self.name, exc_info=True)
            self._set_leading(self.holds())
            self._stop.wait(self.retry_period)

    def _set_leading(self, leading: bool) -> None:
        if leading == self._leading:
            return
        self._leading = leading
        log.warning("leader election: %s %s the Lease %s/%s", self.identity,
                    "acquired" if leading else "lost", self.namespace, self.name)
        if self._on_change is not None:
            self._on_change(leading)

    def _coordination(self) -> Any:
        client = self._api_client
        if client is None:
            from sneppx_operator import k8s  # the operator's credentials, loaded at startup

            client = k8s.api_client()
        return kubernetes.client.CoordinationV1Api(client)

    def try_acquire_or_renew(self) -> bool:
        """One round: True when this replica holds the Lease afterwards (and `holds()` until the deadline)."""
        api = self._coordination()
        started = time.monotonic()
        timeout = max(1.0, min(self.retry_period * 2, self.renew_deadline / 2))
        try:
            lease = api.read_namespaced_lease(self.name, self.namespace, _request_timeout=timeout)
        except ApiException as exc:
            if exc.status != 404:
                raise
            return self._create(api, started, timeout)
        spec = lease.spec
        record = (spec.holder_identity or "", spec.renew_time, lease.metadata.resource_version)
        if record != self._observed:
            self._observed, self._observed_at = record, time.monotonic()
        holder = record[0]
        duration = float(spec.lease_duration_seconds or self.lease_duration)
        if holder and holder != self.identity and time.monotonic() < self._observed_at + duration:
            return False  # someone else's, and not expired as this candidate saw it
        now = _now()
        taking_over = holder != self.identity
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

    def _create(self, api: Any, started: float, timeout: float) -> bool:
        now = _now()
        body = kubernetes.client.V1Lease(
            metadata=kubernetes.client.V1ObjectMeta(name=self.name, namespace=self.namespace),
            spec=kubernetes.client.V1LeaseSpec(
                holder_identity=self.identity, lease_duration_seconds=int(self.lease_duration),
                acquire_time=now, renew_time=now, lease_transitions=0,
            ),
        )
        try:
            api.create_namespaced_lease(self.namespace, body, _request_timeout=timeout)
        except ApiException as exc:
            if exc.status == 409:  # another candidate created it first
                return False
            raise
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
