"""A stand-in for a rank's agent, run by the pod runner as a pod's process (tests/k8s/pod_runner.py).

It behaves like a rank as far as the operator can tell: it runs until told to stop, exits with a given code,
and (as its pod's ServiceAccount, through records/kube.py, the store the real agent uses) writes the records
an agent writes into the job's rendezvous object: rank 0's report, a peer reported hung. It also follows the
operator's control record and leaves a trace of what it saw in its log (PAUSED / RESUMED).

    python rank_standin.py [--exit-code N --after S --rank R] [--report-step STEP] [--report-hung POD --after S]
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import time

from SneppX_ALG import errors
from SneppX_ALG.contract import job_object
from SneppX_ALG.records import kube


def _now() -> str:
    return job_object.timestamp(datetime.datetime.now(datetime.UTC))


def _put(store: kube.KubernetesRecordStore, key: str, value: dict[str, object]) -> None:
    """Create or compare-and-swap a record, as the agent does."""
    while True:
        try:
            current = store.read(key)
            if current is None:
                store.create(key, value)
            else:
                store.swap(key, value, current.version)
            return
        except (errors.RecordConflictError, errors.RecordUnavailableError):
            time.sleep(0.1)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--exit-code", type=int, default=None)
    parser.add_argument("--after", type=float, default=0.5)
    parser.add_argument("--rank", type=int, default=None, help="only this rank exits / reports (default: all)")
    parser.add_argument("--report-step", type=int, default=None, help="rank 0 reports this last valid step")
    parser.add_argument("--report-hung", default=None, help="rank 0 reports this pod hung")
    args = parser.parse_args()

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    rank = int(os.environ["RANK"])
    mine = args.rank is None or args.rank == rank
    store = kube.KubernetesRecordStore.from_environment()
    print(f"rank {rank} of {os.environ['WORLD_SIZE']} (generation {os.environ['SNEPPX_GENERATION']})", flush=True)
    if rank == 0 and args.report_step is not None:
        checkpoint = {"step": args.report_step, "location": f"file:///ckpt/step-{args.report_step:09d}",
                      "time": _now()}
        members = [os.environ["SNEPPX_POD_NAME"]]
        _put(store, job_object.REPORT_KEY, {
            "version": 1, "kind": "report", "generation": int(os.environ["SNEPPX_GENERATION"]),
            "world_size": int(os.environ["WORLD_SIZE"]), "members": members,
            "last_valid_checkpoint": checkpoint, "resumed_from": None, "reported_at": _now()})
        print("REPORTED", flush=True)
    started = time.monotonic()
    hung_sent = False
    paused = False
    while not stop:
        if mine and args.exit_code is not None and time.monotonic() - started >= args.after:
            print(f"EXITING {args.exit_code}", flush=True)
            return args.exit_code
        if rank == 0 and args.report_hung and not hung_sent and time.monotonic() - started >= args.after:
            pod = args.report_hung
            _put(store, job_object.hung_key(pod), job_object.hung_to_json(job_object.HungRank(
                # An absence that begins as it is reported: later than the peer pod's creation, so about that pod.
                pod, int(pod.rsplit("-", 1)[1]), 0, os.environ["SNEPPX_POD_NAME"], 0.0, _now())))
            hung_sent = True
            print(f"REPORTED HUNG {pod}", flush=True)
        try:
            control = store.read(job_object.CONTROL_KEY)
        except errors.RecordError:
            control = None
        now_paused = bool(control and control.value.get("paused"))
        if now_paused != paused:
            paused = now_paused
            print("PAUSED" if paused else "RESUMED", flush=True)
        time.sleep(0.2)
    print("SIGTERM", flush=True)
    return 143


if __name__ == "__main__":
    sys.exit(main())
