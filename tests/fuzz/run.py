"""Runs one fuzz target of targets.py under atheris, libFuzzer's engine for Python:

    python tests/fuzz/run.py TARGET [libFuzzer flags] [NEW_INPUTS_DIR SEED_DIR...]

SneppX's Python code (SneppX_ALG, sneppx_operator) is instrumented for coverage. Each input must end in a
result or in one of the target's typed refusals, within libFuzzer's `-timeout`, and allocate at most
the target's memory_fixed + memory_factor x its size (tracemalloc's peak, numpy's buffers included): anything
else is a crash that libFuzzer saves (`-artifact_prefix`) for triage (docs/TESTING.md, "Fuzzing").
"""

from __future__ import annotations

import os
import sys
import tracemalloc

import atheris

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
with atheris.instrument_imports(include=["SneppX_ALG", "sneppx_operator", "targets", "spec_shapes"]):
    import spec_shapes  # noqa: F401 - instrumented here, imported by the job_spec target
    import targets


class OverMemoryBound(AssertionError):
    """An input made the code allocate more than its size allows."""


def main(argv: list[str]) -> None:
    name, flags = argv[1], argv[2:]
    target = targets.TARGETS[name]
    # Warm up on the seeds first: modules imported and caches filled on first use are not an input's cost.
    seeds = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", target.corpus)
    for seed in sorted(os.listdir(seeds)) if os.path.isdir(seeds) else []:
        with open(os.path.join(seeds, seed), "rb") as f:
            try:
                target.check(f.read())
            except Exception:  # noqa: BLE001, S110 - the fuzzing below judges every input, these included
                pass
    tracemalloc.start()

    def one_input(data: bytes) -> None:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        try:
            target.check(data)
        except target.raises:
            pass
        peak = tracemalloc.get_traced_memory()[1] - base
        limit = target.memory_fixed + target.memory_factor * len(data)
        if peak > limit:
            raise OverMemoryBound(f"{name}: {peak} bytes allocated for a {len(data)}-byte input (limit {limit})")

    if not any(flag.startswith("-max_len=") for flag in flags):
        flags.append(f"-max_len={target.max_len}")
    atheris.Setup([argv[0], *flags], one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
