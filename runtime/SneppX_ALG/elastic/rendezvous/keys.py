"""The rendezvous records' key names (`rdzv/<run>/g<generation>/...`, the list in the package docstring), and the
generation a key belongs to.

Separate because everything else builds on them and they on nothing: the machine, `reopen_run`, the agent and the
launcher (which read `finished`) and the tests name records without touching their values.
"""

from __future__ import annotations

GENERATION_DIGITS = 9  # g000000007: listings sort like numbers up to a billion generations
MAX_GENERATION = 10**GENERATION_DIGITS - 1


def generation_prefix(run_id: str, generation: int) -> str:
    return f"rdzv/{run_id}/g{generation:0{GENERATION_DIGITS}d}/"


def join_prefix(run_id: str, generation: int) -> str:
    return generation_prefix(run_id, generation) + "join/"


def join_key(run_id: str, generation: int, agent_id: str) -> str:
    return join_prefix(run_id, generation) + agent_id


def membership_key(run_id: str, generation: int) -> str:
    return generation_prefix(run_id, generation) + "membership"


def lease_key(run_id: str, generation: int) -> str:
    return generation_prefix(run_id, generation) + "alive"


def sealer_key(run_id: str, generation: int) -> str:
    return generation_prefix(run_id, generation) + "sealer"


def finished_key(run_id: str) -> str:
    return f"rdzv/{run_id}/finished"


def floor_key(run_id: str) -> str:
    return f"rdzv/{run_id}/floor"


def generation_of(run_id: str, key: str) -> int | None:
    """The generation a record key of the run belongs to (None: a key of the whole run, or another run's)."""
    head = f"rdzv/{run_id}/g"
    digits = key[len(head):len(head) + GENERATION_DIGITS]
    if not key.startswith(head) or len(digits) != GENERATION_DIGITS or not digits.isdigit():
        return None
    return int(digits) if key[len(head) + GENERATION_DIGITS:].startswith("/") else None
