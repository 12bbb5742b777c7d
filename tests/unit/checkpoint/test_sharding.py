"""Sharded checkpoints without processes: the box arithmetic against numpy, the resharded loader on real step
directories, and several ranks saving one step through a group whose collectives are threads of this process
(the real ProcessGroup is tested with rank processes in tests/integration/test_sharded_checkpoint.py)."""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import pathlib
import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from SneppX_ALG import CheckpointCoordinator, CheckpointWriter, _native, errors, storage, validate_checkpoint
from SneppX_ALG.checkpoint import chunks, file, reshard, signing
from SneppX_ALG.checkpoint import manifest as manifest_codec
from SneppX_ALG.coordinator import Group, Shard

# ---- boxes against numpy -------------------------------------------------------------------------------------


@st.composite
def grid(draw: Any, max_rank: int = 3) -> tuple[tuple[int, ...], list[chunks.Box]]:
    """A tensor shape and a tiling of it: a grid with random cuts in every dimension."""
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=0, max_size=max_rank)))
    cuts = [sorted(set(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=3))) - {n}) for n in shape]
    edges = [[0, *c, n] for c, n in zip(cuts, shape)]
    boxes = []
    for index in np.ndindex(*[len(e) - 1 for e in edges]):
        offset = tuple(edges[d][i] for d, i in enumerate(index))
        size = tuple(edges[d][i + 1] - edges[d][i] for d, i in enumerate(index))
        boxes.append(chunks.Box(offset, size))
    return shape, boxes


@st.composite
def box_in(draw: Any, shape: tuple[int, ...]) -> chunks.Box:
    lo = [draw(st.integers(0, n - 1)) for n in shape]
    return chunks.Box(tuple(lo), tuple(draw(st.integers(1, n - o)) for o, n in zip(lo, shape)))


@given(data=st.data(), itemsize=st.sampled_from([1, 2, 4, 8]), block=st.sampled_from([1, 3, 8, 64, 4096]))
@settings(max_examples=300, deadline=None)
def test_any_box_is_reassembled_from_the_byte_runs_of_the_chunks_it_meets(data: Any, itemsize: int,
                                                                         block: int) -> None:
    shape, saved = data.draw(grid())
    tensor = np.arange(math.prod(shape), dtype=f"u{itemsize}").reshape(shape)
    need = data.draw(box_in(shape))
    out = np.zeros(need.shape, tensor.dtype)
    covered = 0
    for chunk in saved:
        part = chunks.intersect(chunk, need)
        if part is None:
            continue
        stored = tensor[chunk.slices()].tobytes()  # a chunk is stored in its own C order
        runs = chunks.byte_runs(chunk, part, itemsize)
        got = b"".join(stored[start:stop] for start, stop in runs.tolist())
        assert got == tensor[part.slices()].tobytes(), "the runs are the part, in the part's C order"
        assert len(runs) <= max(1, math.prod(part.shape[:-1]) if part.shape else 1)
        blocks = chunks.touched_blocks(runs, block)
        for start, stop in runs.tolist():  # every byte needed lies in a block that is read
            assert any(b0 * block <= start and stop <= b1 * block for b0, b1 in blocks.tolist())
        for (a0, a1), (b0, _) in zip(blocks.tolist(), blocks.tolist()[1:]):
            assert a1 < b0, "block ranges are ascending and coalesced"
        read = sum(min(b1 * block, len(stored)) - b0 * block for b0, b1 in blocks.tolist())
        assert len(got) <= read <= len(got) + 2 * block * len(runs)
        out[part.slices(need.offset)] = np.frombuffer(got, tensor.dtype).reshape(part.shape)
        covered += part.volume
    assert covered == need.volume
    assert np.array_equal(out, tensor[need.slices()])


@given(data=st.data())
@settings(max_examples=200, deadline=None)
def test_a_tiling_is_accepted_and_a_hole_or_an_overlap_is_named(data: Any) -> None:
    shape, boxes = data.draw(grid())
    assert chunks.tiling_problem(shape, boxes) is None
    if math.prod(shape) > 1 and len(boxes) > 1:
        victim = data.draw(st.integers(0, len(boxes) - 1))
        assert "elements" in chunks.tiling_problem(shape, boxes[:victim] + boxes[victim + 1:])
        other = boxes[(victim + 1) % len(boxes)]
        swapped = boxes[:victim] + [chunks.Box(other.offset, boxes[victim].shape)] + boxes[victim + 1:]
        if chunks.inside(shape, swapped[victim]) and swapped[victim] != boxes[victim]:
            assert chunks.tiling_problem(shape, swapped) is not None


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                     | st.text(), lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner,
                                                                                              max_size=4),
                     max_leaves=12)


@given(content=st.dictionaries(st.text(), _JSON, max_size=8), checksum=st.text())
@settings(max_examples=300, deadline=None)
def test_a_manifest_is_encoded_once_for_its_checksum_and_its_canonical_bytes(content: dict[str, Any],
                                                                             checksum: str) -> None:
    """The decoder's one encoding gives exactly the two canonical encodings it stands for (any keys, escapes and
    non-ASCII included), so a restore checks the same bytes as before, at half the cost."""
    content.pop(manifest_codec.CHECKSUM, None)
    without, whole = manifest_codec._canonical_with(content, checksum)
    assert without == manifest_codec._canonical(content)
    assert whole == manifest_codec._canonical({**content, manifest_codec.CHECKSUM: checksum})


@given(crcs=st.lists(st.integers(0, 0xFFFFFFFF), max_size=40))
def test_block_checksums_are_read_back_as_written(crcs: list[int]) -> None:
    assert manifest_codec.block_crcs({"blocks": "".join(f"{c:08x}" for c in crcs)}) == crcs


def test_boxes_outside_or_of_another_rank_are_refused() -> None:
    assert "outside" in chunks.tiling_problem((4, 4), [chunks.Box((2, 0), (4, 4))])
    assert "rank" in chunks.tiling_problem((4, 4), [chunks.Box((0,), (16,))])
    assert chunks.tiling_problem((), [chunks.Box((), ())]) is None
    assert chunks.tiling_problem((), [chunks.Box((), ()), chunks.Box((), ())]) is not None


# ---- a group of ranks as threads -------------------------------------------------------------------------------


class ThreadGroup:
    """One rank of `world` threads of this process: coordinator.Group's two collectives over shared memory."""

    def __init__(self, shared: dict[str, Any], rank: int, world: int, generation: int = 4):
        self.shared, self.rank, self.world_size, self.generation = shared, rank, world, generation

    @classmethod
    def make(cls, world: int) -> list[ThreadGroup]:
        shared = {"barrier": threading.Barrier(world, timeout=60), "slots": [None] * world}
        return [cls(shared, r, world) for r in range(world)]

    def allgather(self, array: np.ndarray, timeout: float | None = None) -> np.ndarray:
        self.shared["slots"][self.rank] = array[self.rank].copy()
        self.shared["barrier"].wait()
        for r in range(self.world_size):
            array[r] = self.shared["slots"][r]
        self.shared["barrier"].wait()
        return array

    def broadcast(self, array: np.ndarray, root: int = 0, timeout: float | None = None) -> np.ndarray:
        if self.rank == root:
            self.shared["slots"][root] = array.copy()
        self.shared["barrier"].wait()
        array[...] = self.shared["slots"][root]
        self.shared["barrier"].wait()
        return array


def on_ranks(world: int, body: Any) -> list[Any]:
    """body(rank, group) on `world` threads at once; every result, or the exception each raised."""
    groups = ThreadGroup.make(world)

    def call(rank: int) -> Any:
        try:
            return body(rank, groups[rank])
        except Exception as e:  # noqa: BLE001 - the test looks at each rank's outcome
            return e

    with concurrent.futures.ThreadPoolExecutor(world) as pool:
        return list(pool.map(call, range(world)))


GLOBAL = np.arange(12 * 10, dtype=np.float32).reshape(12, 10) / 7
BIAS = np.linspace(0, 1, 33)


def column_shard(rank: int, world: int) -> Shard:
    """Rank's columns of GLOBAL: chunks that are not one byte range of the tensor."""
    lo, hi = _native.shard_range(GLOBAL.shape[1], world, rank)
    return Shard(GLOBAL[:, lo:hi].copy(), GLOBAL.shape, (0, lo))


def row_target(rank: int, world: int) -> Shard:
    lo, hi = _native.shard_range(GLOBAL.shape[0], world, rank)
    return Shard(np.zeros((hi - lo, GLOBAL.shape[1]), np.float32), GLOBAL.shape, (lo, 0))


def save_by_columns(root: pathlib.Path, world: int, step: int = 5, **kwargs: Any) -> None:
    def body(rank: int, group: Group) -> None:
        with CheckpointCoordinator(root, group=group, checksum_block_bytes=4096, **kwargs) as coord:
            coord.save({"w": column_shard(rank, world), "bias": BIAS, "lr": 0.5}, step=step,
                       training_state={"rank": rank})

    assert on_ranks(world, body) == [None] * world


def test_a_step_saved_by_columns_on_3_ranks_loads_by_rows_on_2_whole_on_1_and_validates(tmp_path) -> None:
    save_by_columns(tmp_path, 3)
    step = tmp_path / "step-000000005"
    manifest = json.loads((step / "manifest.json").read_bytes())
    assert manifest["world_size"] == 3 and manifest["generation"] == 4 and manifest["training_state"] == {"rank": 0}
    assert sorted(os.listdir(step)) == ["manifest.json", "shard-00000.snpx", "shard-00001.snpx", "shard-00002.snpx"]
    [bias] = [t for t in manifest["tensors"] if t["path"] == ["bias"]]
    assert len(bias["chunks"]) == 1, "a replicated tensor is written once"
    assert validate_checkpoint(step) == (True, [])

    def load(rank: int, group: Group) -> tuple[Shard, dict[str, Any], Any]:
        target = {"w": row_target(rank, 2), "bias": np.zeros_like(BIAS), "lr": None}
        with CheckpointCoordinator(tmp_path, group=group) as coord:
            info = coord.restore(target)
        return target["w"], target, info

    for rank, (shard, target, info) in enumerate(on_ranks(2, load)):
        lo, hi = _native.shard_range(12, 2, rank)
        assert np.array_equal(shard.data, GLOBAL[lo:hi]) and np.array_equal(target["bias"], BIAS)
        assert target["lr"] == 0.5 and info.step == 5 and info.read.needed == shard.data.nbytes + BIAS.nbytes
    whole: dict[str, Any] = {}
    CheckpointCoordinator(tmp_path).restore(whole)  # no Shards: everything, read whole (and scattered)
    assert np.array_equal(whole["w"], GLOBAL) and np.array_equal(whole["bias"], BIAS) and whole["lr"] == 0.5


def test_ranks_that_do_not_hold_the_same_replicated_tensors_commit_nothing(tmp_path) -> None:
    def body(rank: int, group: Group) -> None:
        state = {"w": column_shard(rank, 2), "bias": BIAS if rank == 0 else BIAS[:5]}
        with CheckpointCoordinator(tmp_path, group=group) as coord:
            coord.save(state, step=1)

    outcomes = on_ranks(2, body)
    assert isinstance(outcomes[0], errors.ShardingMismatchError) and "replicated" in str(outcomes[0])
    assert isinstance(outcomes[1], errors.ShardedCheckpointError) and list(outcomes[1].failures) == [0]
    assert os.listdir(tmp_path) == []


def test_ranks_that_cut_their_blocks_differently_commit_nothing(tmp_path, monkeypatch) -> None:
    # Every rank takes the block size from the size of the whole state, so they agree; one whose state differs
    # (here: told so) would write chunks the manifest's one block size does not describe.
    from SneppX_ALG.coordinator import engine
    chosen = engine.Engine.block_bytes_for
    monkeypatch.setattr(engine.Engine, "block_bytes_for",
                        lambda self, specs: 8192 if self.group.rank == 1 else chosen(self, specs))

    def body(rank: int, group: Group) -> None:
        with CheckpointCoordinator(tmp_path, group=group) as coord:
            coord.save({"w": column_shard(rank, 2), "bias": BIAS}, step=1)

    outcomes = on_ranks(2, body)
    assert isinstance(outcomes[0], errors.ShardingMismatchError) and "blocks" in str(outcomes[0])
    assert isinstance(outcomes[1], errors.ShardedCheckpointError) and list(outcomes[1].failures) == [0]
    assert os.listdir(tmp_path) == []


def test_shards_that_leave_a_hole_commit_nothing(tmp_path) -> None:
    def body(rank: int, group: Group) -> None:
        shard = column_shard(rank, 3)
        with CheckpointCoordinator(tmp_path, group=group) as coord:
            coord.save({"w": shard} if rank != 1 else {}, step=1)

    outcomes = on_ranks(3, body)
    assert isinstance(outcomes[0], errors.ShardingMismatchError) and "exactly once" in str(outcomes[0])
    assert all(isinstance(o, errors.ShardedCheckpointError) for o in outcomes[1:])
    assert os.listdir(tmp_path) == []


def test_a_save_that_fails_on_one_rank_is_raised_there_at_once_and_everywhere_else_next(tmp_path) -> None:
    def body(rank: int, group: Group) -> Any:
        coord = CheckpointCoordinator(tmp_path, group=group)
        state = {"w": column_shard(rank, 2), "bad": object() if rank == 1 else 1}
        try:
            coord.save(state, step=1)
        except errors.UnsupportedTensorError:
            coord.close()  # raised already: not again
            return "raised by save()"
        try:
            coord.close()
        except errors.ShardedCheckpointError as e:
            return e.failures
        return None

    rank0, rank1 = on_ranks(2, body)
    assert rank1 == "raised by save()"
    assert list(rank0) == [1] and rank0[1].startswith("UnsupportedTensorError")
    assert os.listdir(tmp_path) == []


# ---- the resharded loader on a step directory -------------------------------------------------------------------


def saved_step(root: pathlib.Path, **kwargs: Any) -> pathlib.Path:
    with CheckpointCoordinator(root, checksum_block_bytes=4096, staging_bytes=1 << 16, **kwargs) as coord:
        coord.save({"w": GLOBAL, "big": np.arange(40_000, dtype=np.int64)}, step=1)
    return root / storage.step_name(1)


def load(step_dir: pathlib.Path, needs: list[reshard.Need], keys: Any = None,
         ) -> tuple[list[str], list[np.ndarray] | None, reshard.ReadStats]:
    stats = reshard.ReadStats()
    reader = storage.LocalStorage(str(step_dir.parent)).read_step(1)
    with reader as files:
        _, problems, arrays = reshard.load(files, 1, needs, keys, stats)
    return problems, arrays, stats


def test_a_box_is_read_in_whole_blocks_and_nothing_else(tmp_path) -> None:
    step = saved_step(tmp_path)
    problems, arrays, stats = load(step, [reshard.Need(("big",), chunks.Box((10_000,), (5_000,)))])
    assert problems == [] and np.array_equal(arrays[0], np.arange(10_000, 15_000))
    # 40,000 bytes from byte 80,000: blocks 19..39 of 4 KiB (the 64 KiB staging buffers cut the tensor into
    # chunks of 8,192 elements, so the box meets two of them, each read from its own first touched block)
    assert stats.needed == 40_000 and 40_000 <= stats.data <= 40_000 + 2 * 4096 * stats.cut
    assert stats.cut == 2


def test_a_flipped_byte_in_a_block_that_is_read_is_a_problem_and_one_that_is_not_read_is_not_looked_at(
        tmp_path) -> None:
    step = saved_step(tmp_path)
    manifest = json.loads((step / "manifest.json").read_bytes())
    [big] = [t for t in manifest["tensors"] if t["path"] == ["big"]]
    shard = step / "shard-00000.snpx"
    from SneppX_ALG.checkpoint import file
    with file.CheckpointReader(shard) as reader:
        offset = reader.entry(big["chunks"][0]["entry"]).offset
    raw = bytearray(shard.read_bytes())
    raw[offset + 5] ^= 1  # element 0 of "big"
    shard.write_bytes(bytes(raw))
    problems, arrays, _ = load(step, [reshard.Need(("big",), chunks.Box((0,), (10,)))])
    assert arrays is None and "ChecksumMismatchError" in problems[0] and "block 0" in problems[0]
    problems, arrays, _ = load(step, [reshard.Need(("big",), chunks.Box((5_000,), (10,)))])
    assert problems == [] and list(arrays[0]) == list(range(5_000, 5_010))


@pytest.mark.parametrize("need, message", [
    (reshard.Need(("nope",)), "has no tensor nope"),
    (reshard.Need(("w",), None, "float64"), "saved as float32"),
    (reshard.Need(("w",), None, None, (12, 11)), "shape"),
    (reshard.Need(("w",), chunks.Box((10, 0), (3, 10))), "not inside"),
])
def test_a_target_that_does_not_fit_the_step_is_a_mismatch_not_a_verdict(tmp_path, need, message) -> None:
    step = saved_step(tmp_path)
    with pytest.raises(errors.ShardingMismatchError, match=message):
        load(step, [need])


def test_a_signed_step_is_loaded_in_part_with_every_block_checked_against_its_digest(tmp_path) -> None:
    private, public = signing.generate_keypair()
    keys = {signing.key_id(public): public}
    step = saved_step(tmp_path, signing_key=private, trusted_keys=[public])
    need = reshard.Need(("big",), chunks.Box((100,), (20_000,)))
    problems, arrays, _ = load(step, [need], keys)
    assert problems == [] and np.array_equal(arrays[0], np.arange(100, 20_100))
    # a block changed with its CRC32C kept (a deliberate change, which only the digest catches)
    manifest = json.loads((step / "manifest.json").read_bytes())
    [big] = [t for t in manifest["tensors"] if t["path"] == ["big"]]
    chunk = big["chunks"][0]
    from SneppX_ALG.checkpoint import file
    with file.CheckpointReader(step / "shard-00000.snpx") as reader:
        offset = reader.entry(chunk["entry"]).offset
    raw = bytearray((step / "shard-00000.snpx").read_bytes())
    block = bytes(raw[offset + 4096:offset + 8192])
    forged = forge_same_crc(block, 800)
    raw[offset + 4096:offset + 8192] = forged
    (step / "shard-00000.snpx").write_bytes(bytes(raw))
    assert _native.crc32c(forged) == _native.crc32c(block) and forged != block
    problems, arrays, _ = load(step, [need], keys)
    assert arrays is None and "DigestMismatchError" in problems[0] and "block 1" in problems[0]
    problems, _, _ = load(step, [need])  # without keys the CRCs match: the signature is what catches it
    assert problems == []


def forge_same_crc(data: bytes, at: int) -> bytes:
    """`data` with byte `at` changed and the 4 bytes after it solved so the CRC32C stays the same (CRC is
    affine over GF(2): 32 unknown bits, 32 equations)."""
    changed = bytearray(data)
    changed[at] ^= 0xFF
    target = _native.crc32c(data)
    base = bytearray(changed)
    base[at + 1:at + 5] = bytes(4)
    columns = []
    for bit in range(32):
        probe = bytearray(base)
        probe[at + 1 + bit // 8] ^= 1 << (bit % 8)
        columns.append(_native.crc32c(bytes(probe)) ^ _native.crc32c(bytes(base)))
    want = target ^ _native.crc32c(bytes(base))
    # solve sum(x_i * columns_i) == want over GF(2) by elimination
    rows = [(columns[i], 1 << i) for i in range(32)]
    solution, basis = 0, []
    for value, mask in rows:
        for b_value, b_mask in basis:
            if value ^ b_value < value:
                value, mask = value ^ b_value, mask ^ b_mask
        if value:
            basis.append((value, mask))
    for b_value, b_mask in sorted(basis, key=lambda vm: -vm[0]):
        if want ^ b_value < want:
            want, solution = want ^ b_value, solution ^ b_mask
    assert want == 0, "the CRC could not be kept"
    for bit in range(32):
        if solution >> bit & 1:
            base[at + 1 + bit // 8] ^= 1 << (bit % 8)
    return bytes(base)


def test_a_step_from_before_block_checksums_is_read_whole_and_cut(tmp_path) -> None:
    """A version 2 step (flat pieces, no block checksums): a Shard target still gets its box."""
    step = tmp_path / storage.step_name(1)
    step.mkdir()
    with CheckpointWriter(step / "shard-00000.snpx") as writer:
        entry = writer.write("w", GLOBAL)
    manifest = {"format": manifest_codec.MANIFEST_FORMAT, "version": 2, "step": 1, "kind": "mapping",
                "shards": ["shard-00000.snpx"], "values": [], "training_state": None, "world_size": 1,
                "tensors": [{"path": ["w"], "dtype": "float32", "shape": [12, 10], "nbytes": GLOBAL.nbytes,
                             "pieces": [{"shard": 0, "entry": "w", "start": 0, "nbytes": GLOBAL.nbytes,
                                         "crc32c": entry.crc32c}]}]}
    (step / "manifest.json").write_bytes(manifest_codec.encode_manifest(manifest))
    target = {"w": Shard(np.zeros((4, 10), np.float32), (12, 10), (8, 0))}
    info = CheckpointCoordinator(tmp_path).restore(target)
    assert info.step == 1 and np.array_equal(target["w"].data, GLOBAL[8:])
    assert info.read.data == GLOBAL.nbytes and info.read.needed == 4 * 10 * 4


def test_after_rank_0_reads_back_a_broken_chain_the_next_save_is_full_on_every_rank(tmp_path) -> None:
    """A referenced block of rank 1's file rots; only rank 0 reads the new step back (CommittedStepInvalidError):
    the next save must be full on rank 1 too, or it references the rotted block again (issue 39, defect 4)."""
    world = 2
    start = threading.Barrier(world, timeout=60)

    def state(rank: int, step: int) -> dict[str, Any]:
        frozen = np.arange(4 << 18, dtype=np.float32).reshape(8, -1) + rank  # 4 MiB, never changes
        hot = np.full((4, 1024), step, np.float32)
        return {"frozen": Shard(frozen, (8 * world, frozen.shape[1]), (8 * rank, 0)),
                "hot": Shard(hot, (4 * world, 1024), (4 * rank, 0))}

    def body(rank: int, group: Group) -> list[Any]:
        outcomes: list[Any] = []
        with CheckpointCoordinator(tmp_path, group=group, async_save=False, device="cpu", max_to_keep=1,
                                   incremental=True) as coord:
            for step in (1, 2, 3, 4):
                if step == 3:
                    start.wait()
                    if rank == 1:  # rots a block of rank 1's file that every later save references
                        shard = tmp_path / "step-000000001" / "shard-00001.snpx"
                        blob = bytearray(shard.read_bytes())
                        with file.CheckpointReader(str(shard), verify=False) as reader:
                            frozen = next(e for e in reader.table.tensors if e.name.startswith("frozen"))
                            blob[frozen.offset] ^= 1
                        shard.write_bytes(bytes(blob))
                    start.wait()
                try:
                    coord.save(state(rank, step), step=step)
                    outcomes.append(None)
                except errors.SneppXError as e:
                    outcomes.append(type(e).__name__)
        return outcomes

    results = on_ranks(world, body)
    assert results[0] == [None, None, "CommittedStepInvalidError", None], results
    assert results[1] == [None, None, None, None], results
    manifest = json.loads((tmp_path / "step-000000004" / "manifest.json").read_bytes())
    assert manifest["version"] == 3  # nothing referenced, on either rank
    with CheckpointCoordinator(tmp_path, read_only=True, device="cpu") as coord:
        assert coord.validate(4) == [] and coord.latest().step == 4
