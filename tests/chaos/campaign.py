"""A campaign of the recovery chaos harness (`make chaos SEEDS=N`): runs the schedules of N seeds one after the
other, prints each verdict, shrinks each failure to a minimal schedule, and appends every outcome as a JSON line
to WORKDIR/campaign.jsonl. `--schedule JSON` replays one schedule (the `replay:` line a failure prints).
docs/TESTING.md, "Recovery chaos", says how to read it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import chaos_harness


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20, help="how many seeds")
    parser.add_argument("--start", type=int, default=1000, help="the first seed")
    parser.add_argument("--schedule", help="replay this schedule (JSON) instead")
    parser.add_argument("--shrink", type=int, default=8, help="runs to spend shrinking each failure (0: none)")
    parser.add_argument("--workdir", help="where runs go (default a temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep passing runs' files too")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="sneppx-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    schedules = ([chaos_harness.Schedule.from_json(args.schedule)] if args.schedule else
                 [chaos_harness.generate(seed) for seed in range(args.start, args.start + args.seeds)])
    failed, started, attempt = [], time.monotonic(), 0

    def one(schedule: chaos_harness.Schedule, label: str) -> chaos_harness.Outcome:
        nonlocal attempt
        attempt += 1
        outcome = chaos_harness.run(schedule, workdir / f"{label}-{attempt}")
        with open(workdir / "campaign.jsonl", "a") as log:
            log.write(json.dumps({"label": label, "schedule": json.loads(schedule.to_json()),
                                  "passed": outcome.passed, "ended": outcome.ended, "fired": outcome.fired,
                                  "problems": outcome.problems, "seconds": round(outcome.seconds, 1),
                                  "worlds": outcome.worlds,
                                  "out": str(outcome.out)}) + "\n")
        if outcome.passed and not args.keep:
            shutil.rmtree(outcome.out.parent, ignore_errors=True)
        return outcome

    for schedule in schedules:
        outcome = one(schedule, f"seed{schedule.seed}")
        print(chaos_harness.report(outcome), flush=True)
        if outcome.passed:
            continue
        minimal = chaos_harness.shrink(schedule, lambda s: not one(s, f"shrink{s.seed}").passed, args.shrink)
        print(f"MINIMAL failing schedule of seed {schedule.seed}:\n{minimal.describe()}", flush=True)
        failed.append((schedule.seed, minimal))
    print(f"\n{len(schedules)} schedule(s), {len(failed)} failed, {time.monotonic() - started:.0f}s; runs in "
          f"{workdir}", flush=True)
    for seed, minimal in failed:
        print(f"  seed {seed}: {minimal.to_json()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
