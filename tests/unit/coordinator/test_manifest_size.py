"""How large a state's manifest gets (issue 39, defect 5): the rule that grows pieces and checksum blocks with the
state, and the worst-case manifest size built from the real encoder, without allocating the state. The figures
docs/FORMAT.md states ("How large a state fits") are checked here."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from SneppX_ALG import storage
from SneppX_ALG.checkpoint import chunks
from SneppX_ALG.checkpoint import manifest as manifest_codec
from SneppX_ALG.coordinator import increments, plan

MiB, GiB, TiB = 1 << 20, 1 << 30, 1 << 40
# docs/FORMAT.md, "How large a state fits": with incremental="auto", every chunk referencing an earlier step
# (the largest a chunk gets), a state of this size makes a manifest of at most WELL_UNDER, and this is the largest
# that fits at all.
DOCUMENTED_STATE = 8 * TiB
WELL_UNDER = 64 * MiB
DOCUMENTED_LARGEST = 60 * TiB


def worst_chunk(state_bytes: int, block_bytes: int, piece_bytes: int) -> dict:
    """A chunk as plan.chunk_record makes it, every field at its widest for this state: a piece at the end of one
    float32 tensor of the whole state, with a block CRC32C and a BLAKE3 per block, referencing an earlier step."""
    count = state_bytes // 4
    spec = plan.TensorSpec(("model", "layers", "weight"), "float32", (count,), 4)
    pieces = -(-state_bytes // piece_bytes)
    start = (pieces - 1) * piece_bytes // 4
    piece = plan.Piece(0, f"model/layers/weight@{pieces - 1}", start * 4, piece_bytes,
                       chunks.Box((start,), (piece_bytes // 4,)), 0, 0)
    blocks = manifest_codec.block_count(piece_bytes, block_bytes)
    return plan.chunk_record(spec, piece, 99999, 0xFFFFFFFF, "f" * 8 * blocks, "f" * 64 * blocks,
                             (999_999_999, "shard-99999.snpx"))


def manifest_bytes(state_bytes: int, block_bytes: int, piece_bytes: int) -> int:
    """The manifest size of an incremental step of one tensor of `state_bytes`, by the real encoder: a manifest
    of one and of two worst-case chunks gives the cost of each further chunk."""
    chunk = worst_chunk(state_bytes, block_bytes, piece_bytes)

    def encoded(n: int) -> int:
        tensor = {"path": ["model", "layers", "weight"], "dtype": "float32", "shape": [state_bytes // 4],
                  "nbytes": state_bytes, "chunks": [chunk] * n}
        return len(manifest_codec.encode_manifest(plan.build_manifest(
            999_999_999, [tensor], [], "mapping", None, ["shard-00000.snpx"], block_bytes=block_bytes, chain=999)))

    one = encoded(1)
    return one + (-(-state_bytes // piece_bytes) - 1) * (encoded(2) - one)


def auto_manifest_bytes(state_bytes: int) -> int:
    block = increments.block_bytes_for(state_bytes)
    return manifest_bytes(state_bytes, block, increments.piece_bytes_for(block))


@given(st.integers(min_value=0, max_value=1 << 50))
def test_blocks_grow_with_the_state_in_powers_of_two_and_cut_it_into_at_most_max_pieces(state_bytes: int) -> None:
    block = increments.block_bytes_for(state_bytes)
    piece = increments.piece_bytes_for(block)
    assert manifest_codec.MIN_BLOCK_BYTES <= block <= manifest_codec.MAX_BLOCK_BYTES and block & (block - 1) == 0
    if state_bytes <= increments.MAX_PIECES * increments.REUSE_BYTES:  # unchanged for states up to 128 GiB
        assert (block, piece) == (manifest_codec.BLOCK_BYTES, increments.REUSE_BYTES)
    else:
        assert piece == block  # one block per piece: one BLAKE3 per piece
        if block < manifest_codec.MAX_BLOCK_BYTES:
            assert math.ceil(state_bytes / piece) <= increments.MAX_PIECES
            assert math.ceil(state_bytes / (piece // 2)) > increments.MAX_PIECES  # the smallest that does
    assert increments.block_bytes_for(state_bytes + 1) >= block


def test_the_documented_state_sizes_fit_under_what_readers_accept() -> None:
    assert auto_manifest_bytes(DOCUMENTED_STATE) <= WELL_UNDER
    assert auto_manifest_bytes(DOCUMENTED_LARGEST) <= storage.MAX_MANIFEST_BYTES
    assert auto_manifest_bytes(DOCUMENTED_LARGEST + 4 * TiB) > storage.MAX_MANIFEST_BYTES  # and not much more
    # Before the rule (1 MiB pieces of 256 KiB blocks whatever the size), about 0.55 TiB fitted.
    assert manifest_bytes(TiB, manifest_codec.BLOCK_BYTES, increments.REUSE_BYTES) > storage.MAX_MANIFEST_BYTES
    for size in (GiB, 100 * GiB, 128 * GiB, 129 * GiB, TiB, 4 * TiB, DOCUMENTED_STATE):
        assert auto_manifest_bytes(size) <= WELL_UNDER, size
