"""Every error SneppX raises, under one base class.

Callers catch `SneppXError` for "anything from SneppX" or a subclass for one
kind of failure. Each class says what failed; messages say where and what a
person can do about it. Grouped by the layer that raises them, lowest first
(the operator's own errors are in sneppx_operator/errors.py).

One concept, the one exception hierarchy, which is why it stays whole at some 525 lines of declarations:
its classes derive from each other across the layers (CheckpointExistsError from StorageError,
StaleGenerationError from both CollectiveError and RendezvousError), a caller who catches by it reads the
whole tree here, and it is the bottom layer that every module (and the operator) imports.
"""

from __future__ import annotations


class SneppXError(Exception):
    """Base class of every SneppX error."""


# ===== storage: where the bytes live ========================================================================


# --- storage: the bytes could not be written or read -------------------------


class StorageError(SneppXError):
    """An I/O operation failed; nothing was committed by the failing call."""

    def __init__(self, message: str, *, path: str | None = None, errno: int | None = None):
        super().__init__(message)
        self.path = path
        self.errno = errno


class DiskFullError(StorageError):
    """The device ran out of space (ENOSPC)."""


class DurabilityError(StorageError):
    """fsync (or another flush) failed: the data may not be on disk, so the write failed."""


class CheckpointNotFoundError(StorageError, FileNotFoundError):
    """No checkpoint exists at the given path."""


# --- several processes on one checkpoint root: writers, readers, commits ------


class CommitUnknownError(StorageError):
    """A commit's outcome could not be learned: the conditional PUT of the step's marker (or manifest) got no
    clear answer and reading it back failed too. The step may or may not be committed; nothing was deleted
    (cleanup removes the parts later if no marker appears)."""


class ReadOnlyCoordinatorError(SneppXError, RuntimeError):
    """save() on a CheckpointCoordinator opened with read_only=True (a reader: an evaluator, a tool)."""


# --- records: small JSON records in the shared store, written by compare-and-swap ---------


class RecordError(SneppXError):
    """A record of the shared store (rendezvous, leases) could not be written or read. `.key` names it."""

    def __init__(self, message: str, *, key: str | None = None):
        super().__init__(message)
        self.key = key


class RecordConflictError(RecordError):
    """The write's condition did not hold: another writer changed the record first. Read it again."""


class RecordExistsError(RecordConflictError):
    """Create-if-absent found the key taken."""


class RecordCorruptError(RecordError):
    """What the store holds under the key is not a record SneppX wrote (not bounded UTF-8 JSON, bad layout)."""


class RecordValueError(RecordError, ValueError):
    """The caller's key or value can't be stored: a key outside the store's root, a value too large or not
    plain JSON."""


class RecordStoreError(RecordError):
    """The store failed or refused the call (permissions, a missing bucket, an I/O error)."""


class RecordUnavailableError(RecordStoreError):
    """The store could not be reached in time (timeout, connection, 5xx, throttling). Transient: a read may be
    retried as is; a write's outcome is unknown, so read the key before writing again."""


# ===== checkpoint: what the bytes are =======================================================================


# --- format: the bytes are not a valid SNPX checkpoint ------------------------


class CheckpointFormatError(SneppXError):
    """The file is not a valid SNPX checkpoint. `.path` names it when known."""

    def __init__(self, message: str, *, path: str | None = None):
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path
        self.reason = message


class BadMagicError(CheckpointFormatError):
    """The file does not start with the SNPX magic bytes."""


class UnsafeFormatError(BadMagicError):
    """The file is a format whose loading could run code (a pickle); it is refused."""


class UnsupportedVersionError(CheckpointFormatError):
    """The file was written by a newer, incompatible version of the format."""


class TruncatedCheckpointError(CheckpointFormatError):
    """The file is shorter than its header says."""


class CorruptHeaderError(CheckpointFormatError):
    """The fixed header fails its CRC or holds impossible values."""


class CorruptTableError(CheckpointFormatError):
    """The tensor table fails its CRC or does not follow the spec."""


class LimitExceededError(CorruptTableError):
    """A length, count, rank or size is beyond the format's hard limits."""


class LayoutError(CorruptTableError):
    """Tensor byte ranges overlap, leave holes, or run past the data section."""


class ChecksumMismatchError(CheckpointFormatError):
    """Bytes on disk do not match their CRC32C: silent corruption."""


class NonZeroPaddingError(CheckpointFormatError):
    """Padding that the spec requires to be zero is not."""


# --- signatures: who made the checkpoint, and is every byte as signed ---------


class SignatureError(CheckpointFormatError):
    """The checkpoint's signature does not prove that a trusted key made exactly these bytes."""


class MissingSignatureError(SignatureError):
    """The checkpoint (or manifest) carries no signature, and one is required."""


class UntrustedKeyError(SignatureError):
    """The signature was made by a key that is not among the trusted keys."""


class BadSignatureError(SignatureError):
    """The signature does not verify: the signed table or manifest changed, or the block is forged."""


class DigestMismatchError(SignatureError):
    """Bytes do not match the cryptographic digest that the signature covers (or have none)."""


class KeyFormatError(SneppXError, ValueError):
    """A key file or key value is not an Ed25519 key in a form SneppX reads."""


# --- file handles: a checkpoint reader or writer used after it is done ----------


class CheckpointClosedError(SneppXError, ValueError):
    """A CheckpointReader was used after close(), or a CheckpointWriter after commit() or abort().

    A writer is single-use: once committed or aborted it never touches its path again; make a new one.
    """


# --- interop: other formats and frameworks, tools over a checkpoint root -------


class ForeignCheckpointError(CheckpointFormatError):
    """A checkpoint in another format (a safetensors file or sharded index) can't be read as it is: the file is
    malformed, or the index names files or tensors its shards don't hold."""


# --- updates: installing signed checkpoints -----------------------------------


class UpdateRejectedError(SneppXError):
    """An update is authentic but its signed version or dates forbid installing it."""


class RollbackRefusedError(UpdateRejectedError):
    """The update's version is not newer than one already installed (rollback or replay)."""


class ExpiredUpdateError(UpdateRejectedError):
    """The update's signed expiry time has passed."""


class TensorNotFoundError(SneppXError, KeyError):
    """The checkpoint has no tensor of that name."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class UnsupportedTensorError(SneppXError, TypeError):
    """The object can't be written as a tensor (dtype, memory layout or device)."""


# --- the checkpoint store: unreadable steps, untrusted signers, timelines -------


class CheckpointUnreadableError(StorageError):
    """A committed step could not be read (an I/O error such as EIO, EMFILE or ESTALE: not a verdict on its
    bytes), even after bounded retries. Nothing was skipped or rolled back past; `.step` names the step."""

    def __init__(self, message: str, *, step: int | None = None, path: str | None = None,
                 errno: int | None = None):
        super().__init__(message, path=path, errno=errno)
        self.step = step


class SigningKeyNotTrustedError(SneppXError, ValueError):
    """A coordinator's signing_key is not among its own trusted_keys (or it has trusted_keys and saves
    unsigned): every step it saved would fail its own validation."""


class CommittedStepInvalidError(StorageError):
    """A step this coordinator committed does not validate when read back: storage did not keep what was
    written. Retention kept the newest step that does validate."""


class ReferencedStepGoneError(StorageError):
    """An incremental save references a step (or a file of it) that is gone or no longer on the timeline (a gc,
    or another writer, deleted it since): nothing was committed, and this coordinator's next save is full."""


class ManifestTooLargeError(StorageError):
    """A step's manifest would be larger than readers accept (storage.MAX_MANIFEST_BYTES): nothing was
    committed. Fewer, larger chunks (a larger checksum_block_bytes, incremental=False) make it smaller."""


class FenceRecordError(CheckpointFormatError):
    """The root's fence record (docs/FORMAT.md, "Timelines and fencing") is not one SneppX wrote: which steps
    are abandoned can't be known, so no step is returned as the latest."""


# ===== coordinator: saving and restoring steps ==============================================================


# --- async checkpointing: coordinator, manifests, copy engine -----------------


class CheckpointExistsError(StorageError):
    """A valid committed checkpoint already exists for that step; it is never overwritten."""


class ManifestError(CheckpointFormatError):
    """A step's manifest.json is missing, not JSON, or does not match its shard files."""


class CoordinatorClosedError(SneppXError, RuntimeError):
    """The CheckpointCoordinator was closed; make a new one."""


class AcceleratorUnavailableError(SneppXError):
    """No usable GPU: the CUDA runtime library is missing or reports no device. CPU paths still work."""


class CudaError(SneppXError):
    """A CUDA runtime call failed (`.cuda_error` holds the cudaError_t)."""

    def __init__(self, message: str, *, cuda_error: int = 0):
        super().__init__(message)
        self.cuda_error = cuda_error


# --- sharded checkpoints: steps saved by several ranks, loaded at any world size ---------------------------


class ShardedCheckpointError(SneppXError):
    """A save or restore of a group of ranks failed on one or more of them. Every rank raises it (or, on the
    rank where the failure happened, the original error), so the whole group learns the same outcome;
    `.failures` maps each rank that failed to what went wrong (torch.distributed.checkpoint's
    CheckpointException)."""

    def __init__(self, message: str, *, failures: dict[int, str] | None = None):
        super().__init__(message)
        self.failures = dict(failures or {})


class ShardingMismatchError(SneppXError, ValueError):
    """What was saved or asked for doesn't fit together: ranks whose shards of a tensor don't cover it exactly
    once, ranks that declare different replicated tensors, or a restore target that the step lacks or whose
    dtype or global shape differs from the saved tensor's. Nothing is committed or loaded."""


# --- peer-memory snapshots: the state of recent steps in host memory, a copy on the next node -----------------


class SnapshotError(SneppXError):
    """A peer-memory snapshot could not be taken (elastic/snapshot/)."""


class SnapshotMemoryError(SnapshotError, MemoryError):
    """Snapshots would need more host memory than `snapshot_memory_limit` allows: `.needed` and `.limit` in
    bytes. Raised by `ctx.snapshot()` (at every snapshot: the layout changes with the world size) before its buffer
    is allocated or a copy is sent."""

    def __init__(self, message: str, *, needed: int, limit: int):
        super().__init__(message)
        self.needed, self.limit = needed, limit


class ReplicaDivergenceError(SnapshotError):
    """Data-parallel ranks that must hold identical replicated tensors do not (a bad core or memory bit):
    `.ranks` are the ones that differ from the majority, `.step` the step. Nothing of that step is kept; the
    generation ends and the job rolls back to the newest snapshot on which they agreed."""

    def __init__(self, message: str, *, step: int, ranks: list[int]):
        super().__init__(message)
        self.step, self.ranks = step, list(ranks)


# ===== elastic: training that survives failures =============================================================


# --- elastic: heartbeats, quorum, restarts, rollback, the node lifecycle -------


class HeartbeatError(SneppXError):
    """The heartbeat monitor can't run as configured."""


class HeartbeatKeyError(HeartbeatError, ValueError):
    """No usable heartbeat key: none given, unreadable, not hex, or shorter than 16 bytes. The message names
    the environment variable to set (SNEPPX_HEARTBEAT_KEY_FILE or SNEPPX_HEARTBEAT_KEY)."""


class HeartbeatConfigError(HeartbeatError, ValueError):
    """A peer or bind address that can't be used (malformed, unresolvable, IPv6, a duplicate)."""


class HeartbeatSocketError(HeartbeatError, OSError):
    """The heartbeat socket can't be opened or bound (the address is in use or not on this host)."""


class QuorumTimeoutError(SneppXError, TimeoutError):
    """Too few members were healthy when the wait ended. `.missing` names the members not healthy,
    `.healthy` those that were, `.needed` how many healthy members a quorum takes."""

    def __init__(self, message: str, *, missing: list[str], healthy: list[str], needed: int):
        super().__init__(message)
        self.missing = missing
        self.healthy = healthy
        self.needed = needed


class RestartBudgetExhaustedError(SneppXError):
    """More failures than max_restarts allows; `.history` holds every failure (time, reason, delay)."""

    def __init__(self, message: str, *, history: list[object]):
        super().__init__(message)
        self.history = history


class RollbackLimitError(SneppXError):
    """No committed checkpoint within the rollback depth validates; `.skipped` lists each step rolled back
    past and why."""

    def __init__(self, message: str, *, skipped: list[object]):
        super().__init__(message)
        self.skipped = skipped


class LifecycleError(SneppXError, RuntimeError):
    """An event that the node's lifecycle does not allow in its current state (e.g. `reconfigured` while
    running): `.state` and `.event` name them."""

    def __init__(self, message: str, *, state: str, event: str):
        super().__init__(message)
        self.state = state
        self.event = event


# --- collectives: the ranks of one membership generation computing together ----


class CollectiveError(SneppXError):
    """A collective operation failed. The process group is unusable after it: the next generation builds a new
    one. `.rank` and `.generation` say whose group; `.peer` the rank blamed, when one is (else None)."""

    def __init__(self, message: str, *, rank: int | None = None, generation: int | None = None,
                 peer: int | None = None):
        super().__init__(message)
        self.rank = rank
        self.generation = generation
        self.peer = peer


class PeerLostError(CollectiveError, ConnectionError):
    """A peer died or left during a collective: its connection closed or reset, its process exited (shared memory),
    or another rank reported it. `.peer` names it."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective (or the group's setup) passed its deadline: a peer is hung, stopped or unreachable."""


class CollectiveAbortedError(CollectiveError):
    """The group was aborted (`abort()`, e.g. from the heartbeat's thread), or failed in an earlier call."""


class CommProtocolError(CollectiveError):
    """A peer sent bytes that are not the protocol, or the ranks called different collectives."""


class CommAuthError(CollectiveError):
    """A peer failed the job-key challenge: it does not hold this job's key."""


class NcclError(CollectiveError):
    """An NCCL call failed (`.nccl_error` holds the ncclResult_t); the communicator was aborted."""

    def __init__(self, message: str, *, nccl_error: int = 0, **kwargs: int | None):
        super().__init__(message, **kwargs)
        self.nccl_error = nccl_error


class StoreError(SneppXError):
    """The rendezvous store could not be read or written."""


class StoreKeyExistsError(StoreError):
    """A create-only store key was already set (by another process, or an earlier attempt)."""


class StoreTimeoutError(StoreError, TimeoutError):
    """A store key was not set before the deadline (a peer never published it)."""


# --- rendezvous: membership generations agreed through the shared store ---------------------


class RendezvousError(SneppXError):
    """The rendezvous could not form a generation, or a record in it is not valid."""


class RendezvousTimeoutError(RendezvousError, TimeoutError):
    """`join_timeout` passed before a generation this agent belongs to was sealed. Carries the generation it
    waited at and the agents that had joined it."""

    def __init__(self, message: str, *, generation: int, joined: tuple[str, ...] = (), min_nodes: int = 0):
        super().__init__(message)
        self.generation = generation
        self.joined = joined
        self.min_nodes = min_nodes


class RendezvousClosedError(RendezvousError):
    """The run was marked finished in the store; no new generation will form."""


class StaleGenerationError(CollectiveError, RendezvousError):
    """This membership generation is over, or a peer belongs to another one. From the rendezvous
    (`check_fence`): a newer generation exists (sealed, or joined by a member of this one), so this one must not
    commit a checkpoint. From a collective: a message or connection came from another generation than this
    group's. Either way the cure is the next generation; `.generation` is the stale one (the group's, for a
    collective). One class for both, so `except StaleGenerationError` means the same wherever it is caught."""


class InvalidRendezvousRecordError(RendezvousError):
    """A join or membership record in the store is not one SneppX wrote (garbage, hostile or from an
    incompatible version). Join records like this are ignored; a membership like this voids its generation."""

    def __init__(self, message: str, *, key: str | None = None):
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key


# --- the ElasticTrainer: a run of agents and workers that survives failures -------------------------------


class ElasticRunError(SneppXError):
    """An ElasticTrainer run ended without finishing train_fn: `.reason` says why (as the agent that ended it
    wrote it), `.history` lists the failures each agent recorded (time, reason, attempt, delay)."""

    def __init__(self, message: str, *, reason: str = "", history: list[object] | None = None):
        super().__init__(message)
        self.reason = reason
        self.history = list(history or [])


class ElasticLaunchError(SneppXError):
    """run() can't start worker processes the way it was called (e.g. from an interactive session: workers
    re-run the script that called run(), so there must be one)."""


class MembershipChangingError(SneppXError):
    """Raised by `ctx.save()` after its step committed when agents wait to join: train_fn stops at this
    checkpoint boundary and the ElasticTrainer resumes it in the bigger generation. Let it propagate."""

    def __init__(self, message: str, *, step: int):
        super().__init__(message)
        self.step = step


# ===== model: the reference model ===========================================================================


# --- model: the reference Transformer and its training state ------------------


class ModelConfigError(SneppXError, ValueError):
    """A model or optimizer configuration is invalid, or a checkpoint's config is not a model config."""


class ConfigMismatchError(ModelConfigError):
    """A checkpoint holds a different architecture than the model loading it (see Transformer.from_checkpoint)."""


class ModelInputError(SneppXError, ValueError):
    """Token ids the model can't take: wrong dtype or rank, too long, or outside the vocabulary."""


class TrainingStateError(SneppXError):
    """Optimizer, data-position or RNG state is missing or does not fit the trainer resuming from it."""
