"""`RendezvousConfig`: the rendezvous's sizes and times, checked once when made.

Separate because the launcher builds it into every agent's settings without running a rendezvous; the state
machine reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from SneppX_ALG.contract import record
from SneppX_ALG.elastic.rendezvous.codec import MAX_NODES


@dataclass(frozen=True)
class RendezvousConfig:
    """Sizes and times of the rendezvous (seconds). Every agent of a run uses the same: whoever seals
    applies its own, and the others judge its silence by their `seal_grace`."""

    min_nodes: int = 1
    max_nodes: int = 1
    last_call: float = 10.0  # after min_nodes joined, how long to wait for more (torchrun: 30 s)
    join_timeout: float = 600.0  # how long join() waits for a generation that includes this agent
    seal_grace: float = 3.0  # silence of the sealer's record after which the next agent in line takes over
    lease_timeout: float = 30.0  # silence of a running generation's `alive` record that means it is gone
    poll_interval: float = 0.05  # first wait between reads of the membership; grows 1.5x per poll ...
    poll_max: float = 1.0  # ... up to this, or to max_nodes / job_poll_rate if longer:
    job_poll_rate: float = 50.0  # reads per second all waiting agents of a job make together, at most

    @property
    def poll_cap(self) -> float:
        """The longest wait between two polls of one agent. It grows with the job so that N waiting agents
        don't load the store (or the bill) N times as much: a store busy answering polls seals late."""
        return max(self.poll_max, self.max_nodes / self.job_poll_rate)

    def __post_init__(self) -> None:
        if not 1 <= self.min_nodes <= self.max_nodes <= MAX_NODES:
            raise ValueError(f"need 1 <= min_nodes <= max_nodes <= {MAX_NODES}, got min_nodes={self.min_nodes}, "
                             f"max_nodes={self.max_nodes}")
        times = {"last_call": self.last_call, "join_timeout": self.join_timeout, "seal_grace": self.seal_grace,
                 "lease_timeout": self.lease_timeout, "poll_max": self.poll_max}
        for name, value in times.items():
            if not record.is_finite_number(value) or value < 0:
                raise ValueError(f"{name} must be a finite number of seconds >= 0, not {value!r}")
        if not record.is_finite_number(self.poll_interval) or not 0 < self.poll_interval <= self.poll_max:
            raise ValueError(f"need 0 < poll_interval <= poll_max, got {self.poll_interval}, {self.poll_max}")
        if not record.is_finite_number(self.job_poll_rate) or self.job_poll_rate <= 0:
            raise ValueError(f"job_poll_rate must be a positive number, not {self.job_poll_rate!r}")
