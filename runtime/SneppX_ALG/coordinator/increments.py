"""Incremental saves: the chain of steps a save may reference, and the rule for referencing a piece.

Why a module of its own: which piece of an earlier step a save may point at instead of writing it again is a
pure rule over manifest chunks (the same dtype, global shape, box, length and checksums), apart from the writer
thread that applies it (coordinator/engine.py) and the manager that chooses the mode (`incremental=`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from SneppX_ALG.checkpoint import manifest as manifest_codec

# An incremental save cuts every array into pieces of at most this many bytes (four checksum blocks at the default
# block size), each written or referenced whole: smaller finds more unchanged bytes in sparse updates, and costs a
# table entry and a manifest chunk (~450 bytes with its block digests) per piece. docs/BENCHMARKS.md,
# "Incremental checkpoints".
REUSE_BYTES = 1 << 20
# Where the state is large, pieces and checksum blocks grow with it (in powers of two, one block per piece) so that
# a state is cut into at most about this many pieces: its manifest then stays far below the 256 MiB readers accept
# (docs/FORMAT.md, "How large a state fits"). States up to MAX_PIECES MiB (128 GiB) keep 1 MiB pieces of 256 KiB
# blocks.
MAX_PIECES = 1 << 17
AUTO = "auto"
# "auto" stops comparing for the rest of a chain after a save that found less than this share of its bytes
# unchanged (hashing then costs more than it saves); the chain's next full save compares again.
AUTO_MIN_REUSE = 0.125


def block_bytes_for(state_bytes: int) -> int:
    """The checksum block size of a save of a state of `state_bytes` (every rank's tensors, whole: the same number on
    every rank of a group) when the coordinator was given none: the default up to MAX_PIECES pieces of REUSE_BYTES,
    then the power of two that cuts the state into at most MAX_PIECES blocks (at most MAX_BLOCK_BYTES)."""
    if state_bytes <= MAX_PIECES * REUSE_BYTES:
        return manifest_codec.BLOCK_BYTES
    wanted = -(-state_bytes // MAX_PIECES)
    return min(1 << (wanted - 1).bit_length(), manifest_codec.MAX_BLOCK_BYTES)


def piece_bytes_for(block_bytes: int) -> int:
    """The largest piece an incremental save writes or references whole: REUSE_BYTES, or one block when blocks are
    larger."""
    return max(REUSE_BYTES, block_bytes)


@dataclasses.dataclass(frozen=True)
class Chain:
    """What this rank's next save may reference: the newest step it committed (`step`, in which this rank's file
    was `shard`), how many incremental saves since the last full one (`length`: 0 after a full one), and each
    piece it recorded there by entry name: (dtype, global shape, its manifest chunk, with BLAKE3 per block), and
    the checksum block size of those chunks."""

    step: int
    shard: str
    length: int
    records: dict[str, tuple[str, tuple[int, ...], dict[str, Any]]]
    comparing: bool = True
    block_bytes: int = manifest_codec.BLOCK_BYTES

    def steps(self) -> list[int]:
        """The steps whose files a save referencing this chain may name: the chain's step and those it uses."""
        found = {self.step} | {ref[0] for _, _, chunk in self.records.values()
                               if (ref := manifest_codec.reference(chunk)) is not None}
        return sorted(found)


def reusable(base: Chain, entry: str, dtype: str, global_shape: tuple[int, ...], record: dict[str, Any],
             keys: tuple[str, ...] = ("crc32c", "blocks", "digests"), *,
             block_bytes: int = manifest_codec.BLOCK_BYTES) -> dict[str, Any] | None:
    """The base's chunk that holds the bytes of a piece (`record`: its box, length and checksums), as this save's
    chunk referencing it, or None: the base has the same entry with the same dtype, global shape, box and length,
    and the same `keys` (a piece just hashed: its block CRC32Cs and BLAKE3s; a piece found equal byte for byte
    to what the base saved: its CRC32C), and blocks of the same size (`block_bytes`, this save's): the reference
    keeps the base's block checksums, which a manifest with other blocks would not take (a state that grew past
    a size where blocks grow: its next save references nothing)."""
    if base.block_bytes != block_bytes:
        return None
    known = base.records.get(entry)
    if known is None or known[0] != dtype or known[1] != global_shape or known[2].get("digests") is None:
        return None
    old = known[2]
    if any(old.get(k) != record.get(k) for k in ("offset", "shape", "nbytes", *keys)):
        return None
    return {**old, "shard": record["shard"], "from": list(manifest_codec.reference(old) or (base.step, base.shard))}
