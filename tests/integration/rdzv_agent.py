"""A node agent's rendezvous, alone in its own process, for tests/integration/test_rendezvous.py.

    python tests/integration/rdzv_agent.py ROOT RUN_ID AGENT_ID OUT [options]

Joins run RUN_ID in the record store at ROOT (a directory or s3://bucket/prefix; S3 settings come from the
AWS environment variables), then, with --stay S, stays a member for S seconds the way an agent would:
polls every 0.1 s (node 0 renews the generation's lease) and joins the next generation as soon as the
running one is superseded, or when late joiners have waited --boundary-every seconds (standing in for the
next checkpoint boundary) and the world is below --max (scale-up). Every membership
it was part of, or the typed error that ended it, goes to OUT as JSON (written whole, then renamed).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

from SneppX_ALG import errors
from SneppX_ALG.elastic import rendezvous
from SneppX_ALG.records import open_record_store


def describe(membership: rendezvous.Membership, agent_id: str) -> dict[str, Any]:
    return {"generation": membership.generation, "members": list(membership.agent_ids),
            "incarnations": [m.incarnation for m in membership.members], "sealed_by": membership.sealed_by,
            "node_rank": membership.node_rank(agent_id), "rank_offset": membership.rank_offset(agent_id),
            "world_size": membership.world_size}


def write(path: str, result: dict[str, Any]) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    for name in ("root", "run_id", "agent_id", "out"):
        parser.add_argument(name)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--min", type=int, default=1)
    parser.add_argument("--max", type=int, default=1)
    parser.add_argument("--last-call", type=float, default=10.0)
    parser.add_argument("--join-timeout", type=float, default=60.0)
    parser.add_argument("--seal-grace", type=float, default=3.0)
    parser.add_argument("--lease-timeout", type=float, default=30.0)
    parser.add_argument("--stay", type=float, default=0.0)
    parser.add_argument("--boundary-every", type=float, default=0.0,
                        help="scale up only this long after late joiners appeared (a checkpoint interval)")
    parser.add_argument("--runs", type=int, default=1, help="join runs RUN_ID-0 .. RUN_ID-(n-1) one after another")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"{args.agent_id} %(message)s")
    config = rendezvous.RendezvousConfig(min_nodes=args.min, max_nodes=args.max, last_call=args.last_call,
                                         join_timeout=args.join_timeout, seal_grace=args.seal_grace,
                                         lease_timeout=args.lease_timeout)
    store = open_record_store(args.root)
    run_ids = [args.run_id] if args.runs == 1 else [f"{args.run_id}-{i}" for i in range(args.runs)]
    result: dict[str, Any] = {"agent_id": args.agent_id, "pid": os.getpid(), "memberships": [], "error": None}
    try:
        for run_id in run_ids:
            rdzv = rendezvous.Rendezvous(store, run_id, agent_id=args.agent_id, host="127.0.0.1",
                                         heartbeat="127.0.0.1:29500", workers=args.workers, config=config)
            result["incarnation"] = rdzv.incarnation
            membership = rdzv.join()
            result["memberships"].append({"run_id": run_id, **describe(membership, args.agent_id)})
            write(args.out, result)
            until = time.monotonic() + args.stay
            waiting_since: float | None = None
            while time.monotonic() < until:
                time.sleep(0.1)
                upcoming = rdzv.poll(membership)
                grow = bool(upcoming.waiting) and len(membership.members) < args.max
                waiting_since = (waiting_since or time.monotonic()) if grow else None
                at_boundary = waiting_since is not None and time.monotonic() - waiting_since >= args.boundary_every
                if upcoming.superseded or at_boundary:
                    membership = rdzv.join(previous=membership)
                    waiting_since = None
                    result["memberships"].append({"run_id": run_id, **describe(membership, args.agent_id)})
                    write(args.out, result)
    except errors.SneppXError as e:
        result["error"] = {"type": type(e).__name__, "message": str(e),
                           "generation": getattr(e, "generation", None), "joined": list(getattr(e, "joined", ()))}
    write(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
