"""Eight launchers started up to 10 s apart, one node each, as on eight machines (tests/integration/formation.py):
no false suspicion, and every generation holds every member of the one before, until the last holds all eight.
`bench elastic -- --formations 20` runs it 20 times and reports the rate (docs/BENCHMARKS.md)."""

from __future__ import annotations

from pathlib import Path

from formation import run_formation


def test_eight_staggered_launchers_form_generations_without_false_suspicions(tmp_path: Path) -> None:
    formation = run_formation(tmp_path, agents=8, spread=10.0)
    assert formation.codes == {f"node-{i}": 0 for i in range(8)}, formation.failures
    assert formation.suspicions == [] and formation.failures == [], formation.failures
    assert formation.shrank == [], formation.generations
    assert formation.final_world == 8
    assert set(formation.generations[max(formation.generations)]) == {f"node-{i}" for i in range(8)}
