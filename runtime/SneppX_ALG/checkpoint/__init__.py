"""The checkpoint layer: what one checkpoint is (a SNPX file, or a step directory of shards plus a manifest),
how to write, read, sign, verify and validate it, and signed updates.

Modules, lowest first (each imports only those before it; .importlinter checks it):

    format     the SNPX file format, pure (spec: docs/FORMAT.md)
    chunks     boxes of a tensor: intersections, byte runs, checksum blocks; pure
    digests    BLAKE3 digests streamed beside a write, per checksum block, and read back from a finished file
    keys       Ed25519 keys: made, named, saved and loaded as PEM; the trusted key set
    signing    signature blocks over tables and manifests, made and checked (re-exports digests and keys)
    arrays     tensors in and out through DLPack and the array interface (bfloat16 included)
    write_mode O_DIRECT or buffered write-behind, measured once per filesystem
    writer     CheckpointWriter: one file streamed and committed atomically (or into a Sink)
    reader     CheckpointReader, read_layout, and the checks of a file's tensors
    file       where CheckpointWriter / CheckpointReader are imported from (re-exports writer and reader)
    verify     signatures and digests checked against files on disk; signing existing files
    manifest   the step manifest codec (manifest.json), pure
    scan       one pass over a shard file: every byte read once, checked as it lands (validation and restore)
    reshard    what one rank needs of a step saved at any world size, and what an incremental step references
    validate   validate_checkpoint (a file or a step directory), check_step and load_step
    tensors    named tensors of any checkpoint a tool is pointed at: SNPX file, step directory, safetensors
    updates    SignedUpdateManager: verified, monotonic, atomic installs
    convert    SNPX <-> safetensors (files, and shards with their index)
"""

from SneppX_ALG.checkpoint.file import CheckpointReader, CheckpointWriter
from SneppX_ALG.checkpoint.signing import generate_keypair
from SneppX_ALG.checkpoint.updates import SignedUpdateManager
from SneppX_ALG.checkpoint.validate import validate_checkpoint
from SneppX_ALG.checkpoint.verify import sign_checkpoint, verify_checkpoint

__all__ = [
    "CheckpointReader",
    "CheckpointWriter",
    "SignedUpdateManager",
    "generate_keypair",
    "sign_checkpoint",
    "validate_checkpoint",
    "verify_checkpoint",
]
