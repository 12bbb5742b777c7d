"""Small JSON records written by compare-and-swap, under a job's store: the one primitive the rendezvous needs.

The Protocol, the key rules and the value codec are `contract.record`'s (pure, shared with the operator); this
package holds the stores that implement it:

    local.py   a directory (disk, PVC, NFS): immutable version files hard-linked into place
    s3.py      an S3 prefix: conditional PUTs (If-None-Match, If-Match on the ETag)
    kube.py    a job's rendezvous ConfigMap, in operator mode (`contract.job_object` lays it out)

`open_record_store(root)` picks one from the same roots `storage.open_storage` takes; kube.py is opened by the pod
bootstrap (`KubernetesRecordStore.from_environment`), whose client is an optional dependency.
"""

from __future__ import annotations

from typing import Any

from SneppX_ALG import _fs
from SneppX_ALG.contract.record import Record, RecordStore
from SneppX_ALG.records.local import LocalRecordStore
from SneppX_ALG.records.s3 import S3RecordStore

__all__ = ["LocalRecordStore", "Record", "RecordStore", "S3RecordStore", "open_record_store"]


def open_record_store(root: str, *, s3_client: Any = None) -> RecordStore:
    """The compare-and-swap records under the same roots `open_storage` takes (`s3://bucket/prefix`,
    `file:///absolute/path`, a local directory)."""
    if root.startswith("s3://"):
        return S3RecordStore(root, client=s3_client)
    return LocalRecordStore(_fs.local_root(root))
