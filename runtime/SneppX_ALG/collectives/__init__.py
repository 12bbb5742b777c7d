"""ProcessGroup: the ranks of one membership generation, and the collectives they run together.

Why this module: data-parallel training needs allreduce, reduce-scatter, allgather, broadcast and barrier between
processes whose membership changes from one generation to the next, and that fail fast, typed and abortable when
a peer dies or hangs. The data path is C (native/src/comm.c, a pipelined TCP ring; native/src/nccl.c on GPUs);
what is here is the rare part: finding the neighbours through a `store.Store`, connecting, and proving to each
other that both hold the job's key. The protocol is described in docs/ELASTIC.md ("Collectives").

Why a package of its own, beside `elastic` (as torch.distributed sits beside torch.distributed.elastic): the
collectives are the substrate under the data-parallel model, the peer-memory snapshots and the checkpoint group,
not part of elastic membership. They import nothing of `elastic` (the job key comes from `job_key`, shared with
the heartbeat), so `model` uses them without depending on the elastic runtime.

The package, one concept a module (each imports only those below it; `.importlinter` checks it):

    group.py    `ProcessGroup`: setup (which backend: the ring, shared memory, both, or NCCL) and the
                collectives, with the NCCL staging and the several-hosts composition (`_Hierarchical`)
    ring.py     the TCP ring's setup: the authenticated handshake and the selector loop that connects a rank
                to both neighbours
    shm.py      shared memory's setup: which ranks share a host, and the segment's name
    arrays.py   which arrays collectives take (numpy in place, device arrays by __cuda_array_interface__)
    store.py    the create-only key store through which a group's ranks find each other (`Store`,
                `RecordKeyStore` over the run's records, `Namespace`, `generation_key`)

Every name of the first four is re-exported here: callers import `SneppX_ALG.collectives`, and
`SneppX_ALG.collectives.store` for a store to pass it.
"""

from __future__ import annotations

from SneppX_ALG.collectives.group import DEFAULT_TIMEOUT, Backend, ProcessGroup, nccl_id_key
from SneppX_ALG.collectives.ring import (
    ACCEPTED,
    CHALLENGE_HEAD,
    CHALLENGE_MAGIC,
    CHUNK_MISMATCH,
    CLIENT_LABEL,
    HELLO,
    HELLO_MAGIC,
    MAC_BYTES,
    MAX_PENDING_HANDSHAKES,
    PROTOCOL_VERSION,
    RESPONSE,
    RESPONSE_MAGIC,
    SERVER_LABEL,
    STALE_GENERATION,
    UNEXPECTED_RANK,
    VERDICT,
    VERDICT_MAGIC,
    Steps,
    address_key,
    connect_ring,
)
from SneppX_ALG.collectives.shm import host_identity, shm_key, shm_name

__all__ = [
    "ACCEPTED",
    "CHALLENGE_HEAD",
    "CHALLENGE_MAGIC",
    "CHUNK_MISMATCH",
    "CLIENT_LABEL",
    "DEFAULT_TIMEOUT",
    "HELLO",
    "HELLO_MAGIC",
    "MAC_BYTES",
    "MAX_PENDING_HANDSHAKES",
    "PROTOCOL_VERSION",
    "RESPONSE",
    "RESPONSE_MAGIC",
    "SERVER_LABEL",
    "STALE_GENERATION",
    "UNEXPECTED_RANK",
    "VERDICT",
    "VERDICT_MAGIC",
    "Backend",
    "ProcessGroup",
    "Steps",
    "address_key",
    "connect_ring",
    "host_identity",
    "nccl_id_key",
    "shm_key",
    "shm_name",
]
