"""Peer-memory snapshots: each rank's training state at a recent step kept in host memory, with a copy on
another node, so a failure costs the steps since the last snapshot (none, with one every step) instead of up to a
checkpoint interval.

Why memory, and a peer: a durable save of a large state is expensive, so checkpoints are minutes apart; a copy
into host memory is a memcpy, and a copy on the next node survives the loss of this one (Gemini, SOSP'23; NVIDIA
resiliency extension's local checkpoints). A snapshot is not a checkpoint: it never reaches storage, and when no
complete one survives the job restores the newest durable checkpoint as before.

What a snapshot is: one rank's tensors (its `Shard`s first, then a slot for the description of its unique part,
then the replicated arrays) copied into a buffer reused from step to step, a CRC32C per `PIECE` bytes of each
tensor, and a small JSON description (paths, dtypes, boxes, plain values). Only the unique part travels to the
peer, straight from that buffer: a rank's Shards, which is about 1/N of the state per rank with ZeRO-1 data
parallelism. The replicated arrays and plain values survive in every rank's own snapshot (equal on every rank:
the digests compared at each snapshot say so), so any one survivor's restores them.

Per snapshot of step s (the generation's `snapshot` group, a TCP ring of its own, docs/ELASTIC.md):
1. the training thread copies the state into a free buffer: the only part it waits for;
2. a background thread computes the CRCs; one allgather of (bytes to send, a CRC of the replicated arrays) tells
   every rank what it will receive, checks every rank's memory bound with the sizes as they are, and catches
   replicas that disagree (silent data corruption) before anything is sent; then the unique bytes and their
   description travel around the ring, each part as far as its farthest holder, each rank forwarding what it
   does not keep. Each part is placed on its own (`copy_holders`; the first snapshot of a generation allgathers
   where each rank is: its agent, or its Kubernetes node in a pod): `replicas` copies on ranks of other nodes,
   other nodes first, the load even; a part with fewer copies off its node than asked is reported
   (`snapshot_unprotected`). The snapshot group's ring visits the nodes in turn (`ring_order`), so with as many
   workers on every node each part crosses the network once;
3. a barrier: every rank holds its copies, the step is complete, and older snapshots go.
One is in flight at a time: the next snapshot waits for it. The memory bound (`snapshot_memory_limit`) is checked
at every snapshot, before its buffer is allocated (the layout changes with the world size), and again with every
rank's sizes before any copy arrives.

Recovery (`recover`, every rank of the new generation, before train_fn resumes): each rank checks every CRC of
what it holds and lists it (with whether its allgather agreed, its replicated digest, the layout of the object it
holds); the lists and the divergence verdicts are allgathered; `choose`, one pure arbiter, picks memory or storage
from checked inputs only (snapshot parts, committed steps checked byte by byte, verdicts that bind both) and says
why; for memory, for each old rank the lowest new rank that holds its part sends each new rank only the boxes
that rank's targets need (`wanted_boxes`, `cut`, `bundle`: its new shards' boxes, and the whole part's replicated
arrays), after every rank's recovery memory is checked against the bound; each rank checks the CRCs of what
arrived, and `apply` every target's shape, dtype and coverage before it copies the boxes in, resharding to the
new world size (all or nothing).

The package, one concept a module (each imports only those below it; `.importlinter` checks it):

    keeper.py    `Keeper`: a worker's snapshots across generations; taking one (the background thread, the
                 ring) and `recover`
    restore.py   `apply`: the chosen parts copied into the target's boxes, resharded to the new world size
    plan.py      the pure decisions every rank makes alike: the ring's order, who keeps each part's copies, divergent
                 replicas, the restore arbiter (`choose`)
    memory.py    how much host memory snapshots need, and how much the process may use
    image.py     one snapshot: `Snapshot`, `capture` into a buffer, its CRCs (`seal`), its wire form, and the
                 boxes of it a recovery sends (`cut`, `bundle`)

Every name is re-exported here: callers import `SneppX_ALG.elastic.snapshot` and nothing below it.
"""

from __future__ import annotations

from SneppX_ALG.elastic.snapshot.image import (
    OTHER,
    PIECE,
    STATE,
    Cut,
    Snapshot,
    bundle,
    bundle_bytes,
    capture,
    cut,
    from_wire,
    layout,
    layout_of,
    replicated_digest,
    seal,
    unbundle,
    wanted_boxes,
    wire_view,
)
from SneppX_ALG.elastic.snapshot.keeper import MAX_FREE_BUFFERS, Keeper, Recovered, allgather_json
from SneppX_ALG.elastic.snapshot.memory import (
    CGROUP_LIMITS,
    DEFAULT_MEMORY_FRACTION,
    host_memory,
    needed_by_rank,
    needed_bytes,
    recovery_by_rank,
)
from SneppX_ALG.elastic.snapshot.plan import (
    Decision,
    Divergence,
    Durable,
    Held,
    binds,
    choose,
    copy_distance,
    copy_holders,
    divergent,
    ring_order,
)
from SneppX_ALG.elastic.snapshot.restore import apply

__all__ = [
    "CGROUP_LIMITS",
    "DEFAULT_MEMORY_FRACTION",
    "MAX_FREE_BUFFERS",
    "OTHER",
    "PIECE",
    "STATE",
    "Cut",
    "Decision",
    "Divergence",
    "Durable",
    "Held",
    "Keeper",
    "Recovered",
    "Snapshot",
    "allgather_json",
    "apply",
    "binds",
    "bundle",
    "bundle_bytes",
    "capture",
    "choose",
    "copy_distance",
    "copy_holders",
    "cut",
    "divergent",
    "from_wire",
    "host_memory",
    "layout",
    "layout_of",
    "needed_by_rank",
    "needed_bytes",
    "recovery_by_rank",
    "replicated_digest",
    "ring_order",
    "seal",
    "unbundle",
    "wanted_boxes",
    "wire_view",
]
