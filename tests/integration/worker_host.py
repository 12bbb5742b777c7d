"""A worker process on its own (python worker_host.py CKPT ELASTIC_ROOT RUN_ID), started as a node agent starts
one: its control channel is the socket in SNEPPX_CONTROL_FD, so a test can play the agent (assign, abort, exit).
Its train_fn meets the other ranks at a barrier and returns; collectives wait up to 10 minutes, so only an abort
ends a generation whose peers never come within a test's timeout."""

from __future__ import annotations

import sys
from typing import Any

from SneppX_ALG.elastic import worker


def train(ctx: Any) -> None:
    ctx.group.barrier()


if __name__ == "__main__":
    checkpoint_dir, elastic_root, run_id = sys.argv[1:4]
    sys.exit(worker.main(train, worker.WorkerSettings(checkpoint_dir=checkpoint_dir, elastic_root=elastic_root,
                                                      run_id=run_id, collective_timeout=600.0)))
