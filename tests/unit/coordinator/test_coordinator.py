"""The coordinator's pure decisions: buffer sizing, splitting and packing, retention, manifests, state trees."""

from __future__ import annotations

import collections
import gc
import json
import os
import weakref

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from SneppX_ALG import CheckpointWriter, _native, coordinator, errors
from SneppX_ALG.checkpoint import chunks, validate
from SneppX_ALG.checkpoint import manifest as manifest_codec
from SneppX_ALG.coordinator import plan, retention, state, timeline

MiB = 1 << 20


def spec(name: str, shape: tuple[int, ...], itemsize: int = 4) -> plan.TensorSpec:
    dtype = {1: "uint8", 2: "float16", 4: "float32", 8: "float64"}[itemsize]
    return plan.TensorSpec((name,), dtype, shape, itemsize)


# ---- buffer sizing, splitting, packing ------------------------------------------------------------------------


def test_buffers_are_at_most_half_the_staging_area_so_there_are_always_two() -> None:
    assert plan.choose_buffer_bytes(10 << 30, 1 << 30) == 64 * MiB
    assert plan.choose_buffer_bytes(10 << 30, 64 * MiB) == 32 * MiB
    assert plan.choose_buffer_bytes(100, 1 << 30) == MiB  # small states: 1 MiB, not 64
    assert plan.choose_buffer_bytes(40 * MiB, 1 << 30) == 10 * MiB  # a quarter: copy/write overlap
    for state_bytes in (1, 5 * MiB, 3 << 30):
        for staging in (8192, 3 * MiB, 1 << 30):
            size = plan.choose_buffer_bytes(state_bytes, staging)
            assert size % 4096 == 0 and 2 * size <= max(staging, 8192)


shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)


@given(shape=shapes, itemsize=st.sampled_from([1, 2, 4, 8]), limit=st.integers(64, 2000),
       first=st.one_of(st.none(), st.integers(0, 2000)))
@settings(deadline=None)
def test_split_pieces_tile_the_tensor_exactly_fit_the_limit_and_are_contiguous_boxes(shape, itemsize, limit,
                                                                                     first) -> None:
    s = spec("t", shape, itemsize)
    pieces = chunks.split_box(shape, itemsize, limit, first)
    # the unit a piece is a multiple of: a slice along the first dimension whose slices fit the limit
    unit = next((int(np.prod(shape[k + 1:])) * itemsize for k in range(len(shape))
                 if int(np.prod(shape[k + 1:])) * itemsize <= limit), itemsize)
    position = 0
    for i, (start, nbytes, box) in enumerate(pieces):
        assert start == position
        assert nbytes <= limit
        if i == 0 and first is not None and len(pieces) > 1 and first >= unit:
            assert nbytes <= first, "the first piece must fit in what is left of the buffer"
        assert box.volume * itemsize == nbytes and chunks.inside(shape, box)
        assert chunks.is_contiguous(shape, box), "a piece is one byte range of the tensor"
        if box.volume and shape:
            assert int(np.ravel_multi_index(box.offset, shape)) * itemsize == start
        position += nbytes
    assert position == s.nbytes
    assert chunks.tiling_problem(shape, [box for _, _, box in pieces]) is None


def test_large_tensors_split_into_row_blocks_when_a_row_fits() -> None:
    pieces = chunks.split_box((10, 256), 4, 3 * 1024)  # a row is 1 KiB
    assert [p[2].shape for p in pieces] == [(3, 256), (3, 256), (3, 256), (1, 256)]
    assert [p[2].offset for p in pieces] == [(0, 0), (3, 0), (6, 0), (9, 0)]
    split = chunks.split_box((1, 1000), 4, 1024)  # one row larger than the limit: blocks along the row
    assert [p[2].shape for p in split] == [(1, 256), (1, 256), (1, 256), (1, 232)]
    assert [p[2].offset for p in split] == [(0, 0), (0, 256), (0, 512), (0, 768)]


@given(sizes=st.lists(st.tuples(st.integers(0, 5000), st.sampled_from([1, 4, 8])), min_size=1, max_size=12),
       buffer=st.integers(64, 4096))
@settings(max_examples=200, deadline=None)
def test_packing_never_overlaps_or_overflows_a_buffer_and_names_are_unique(sizes, buffer) -> None:
    buffer = buffer // 64 * 64
    specs = [spec(f"t{i}", (n,), itemsize) for i, (n, itemsize) in enumerate(sizes)]
    buffers = plan.plan_pieces(specs, buffer)
    names = [p.entry for b in buffers for p in b]
    assert len(names) == len(set(names))
    for index, pieces in enumerate(buffers):
        end = 0
        for p in pieces:
            assert p.buffer == index and p.offset >= end and p.offset % 64 == 0
            assert p.offset + p.nbytes <= buffer
            end = p.offset + p.nbytes
    for i, s in enumerate(specs):
        assert sum(p.nbytes for b in buffers for p in b if p.tensor == i) == s.nbytes


def test_a_large_tensor_first_fills_what_is_left_of_a_buffer() -> None:
    specs = [spec("small", (48,)), spec("big", (100, 4))]  # 192 bytes, then 1600 bytes in 16-byte rows
    buffers = plan.plan_pieces(specs, 1024)
    assert [[(p.entry, p.offset, p.nbytes) for p in b] for b in buffers] == [
        [("small", 0, 192), ("big@0", 192, 832)], [("big@1", 0, 768)]]
    assert buffers[0][1].box.offset == (0, 0) and buffers[1][0].box.offset == (52, 0)


def test_piece_names_never_collide_with_real_tensor_names() -> None:
    specs = [spec("a", (1000,)), spec("a@0", (4,)), spec("a@1", (4,))]
    pieces = [p for b in plan.plan_pieces(specs, 1024) for p in b]
    names = [p.entry for p in pieces]
    assert len(names) == len(set(names))
    assert [p.entry for p in pieces if p.tensor == 1] == ["a@0"], "a whole tensor keeps its own name"
    assert "a@0~" in names


def test_paths_that_join_to_the_same_name_still_get_distinct_entries() -> None:
    specs = [plan.TensorSpec(("a/b",), "uint8", (4,), 1), plan.TensorSpec(("a", "b"), "uint8", (4,), 1)]
    assert [p.entry for b in plan.plan_pieces(specs, 1024) for p in b] == ["a/b", "a/b~"]


# ---- when to save, what to delete ------------------------------------------------------------------------------


def test_should_save_on_multiples_not_saved_yet() -> None:
    assert retention.is_save_step(1000, 1000, None)
    assert not retention.is_save_step(1000, 1000, 1000)
    assert not retention.is_save_step(999, 1000, None)
    assert not retention.is_save_step(1000, None, None) and not retention.is_save_step(1000, 0, None)


def test_retention_keeps_the_newest_and_every_nth() -> None:
    committed = [100, 200, 300, 400, 500]
    assert retention.steps_to_delete(committed, new_step=600, max_to_keep=2) == [100, 200, 300, 400]
    assert retention.steps_to_delete(committed, new_step=600, max_to_keep=2, keep_every_n_steps=200) == [100, 300]
    assert retention.steps_to_delete(committed, new_step=600, max_to_keep=None) == []
    assert retention.steps_to_delete(committed, new_step=600, max_to_keep=3, protected=frozenset({100})) == [200, 300]


@given(committed=st.sets(st.integers(0, 60), max_size=20), new=st.integers(0, 60), keep=st.integers(1, 6),
       every=st.one_of(st.none(), st.integers(1, 20)), protected=st.sets(st.integers(0, 60), max_size=3))
def test_retention_never_deletes_the_new_step_a_newer_one_or_a_protected_one(committed, new, keep, every,
                                                                             protected) -> None:
    doomed = retention.steps_to_delete(sorted(committed), new_step=new, max_to_keep=keep,
                                         keep_every_n_steps=every, protected=frozenset(protected))
    assert new not in doomed and all(s < new for s in doomed) and not set(doomed) & protected
    assert set(doomed) <= committed
    survivors = (committed | {new}) - set(doomed)
    assert len(survivors) >= min(keep, len(committed | {new}))
    if every:
        assert not any(s % every == 0 for s in doomed)


# ---- manifests ----------------------------------------------------------------------------------------------------


def good_manifest(step: int = 7) -> dict:
    specs = [spec("w", (4, 4))]
    pieces = [p for b in plan.plan_pieces(specs, 4096) for p in b]
    crc = _native.crc32c(bytes(64))
    records = {p.entry: plan.chunk_record(specs[0], p, 0, crc, f"{crc:08x}", None) for p in pieces}
    tensors = plan.merge_parts([plan.rank_part(specs, pieces, records)])
    return plan.build_manifest(step, tensors, [(("n",), 3)], "mapping", {"pos": 1}, ["shard-00000.snpx"])


def half_chunk(offset: list[int]) -> dict:
    """A chunk of 2 x 4 float32 (zeros) of the good manifest's 4 x 4 tensor."""
    crc = _native.crc32c(bytes(32))
    return {"shard": 0, "entry": f"w{offset[0]}", "offset": offset, "shape": [2, 4], "nbytes": 32, "crc32c": crc,
            "blocks": f"{crc:08x}"}


def legacy_manifest(step: int = 7, version: int = 2) -> dict:
    """What versions 1 and 2 wrote: flat byte-range pieces, no block checksums."""
    return {"format": manifest_codec.MANIFEST_FORMAT, "version": version, "step": step, "world_size": 1,
            "kind": "mapping", "shards": ["shard-00000.snpx"], "values": [], "training_state": None,
            "tensors": [{"path": ["w"], "dtype": "float32", "shape": [4, 4], "nbytes": 64,
                         "pieces": [{"shard": 0, "entry": "w", "start": 0, "nbytes": 64, "crc32c": 5}]}]}


def test_manifest_round_trips_through_json() -> None:
    m = good_manifest()
    assert manifest_codec.decode_manifest(manifest_codec.encode_manifest(m), step=7, where="m") == m


@pytest.mark.parametrize("mutate, message", [
    (lambda m: m.update(step=8), "directory says 7"),
    (lambda m: m.update(version=99), "not supported"),
    (lambda m: m.update(format="other"), "not a SneppX manifest"),
    (lambda m: m.update(shards=["../../etc/passwd"]), "plain file names"),
    (lambda m: m["tensors"][0].update(nbytes=65), "malformed"),
    (lambda m: m["tensors"][0]["chunks"][0].update(offset=[1, 0]), "outside"),
    (lambda m: m["tensors"][0]["chunks"][0].update(shape=[2, 4], nbytes=32), "hold 8 elements of 16"),
    (lambda m: m["tensors"][0].update(chunks=[half_chunk([0, 0]), half_chunk([1, 0])]), "overlap"),
    (lambda m: m["tensors"][0]["chunks"][0].update(nbytes=32), "malformed"),
    (lambda m: m["tensors"][0]["chunks"][0].update(shard=1), "malformed"),
    (lambda m: m["tensors"][0]["chunks"][0].update(blocks="00000000"), "make up its CRC32C"),
    (lambda m: m["tensors"][0]["chunks"][0].update(blocks=""), "block checksums"),
    (lambda m: m.update(block_bytes=1000), "block_bytes"),
    (lambda m: m.update(world_size=2), "world_size"),
    (lambda m: m["tensors"][0].update(dtype="object"), "malformed"),
])
def test_bad_manifests_are_typed_errors_saying_what_is_wrong(mutate, message) -> None:
    m = good_manifest()
    mutate(m)
    with pytest.raises(errors.ManifestError, match=message):
        manifest_codec.decode_manifest(json.dumps(m).encode(), step=7, where="m")


@pytest.mark.parametrize("raw", [b"", b"{", b"[]", b'{"format": NaN}', "\u00ff".encode("latin-1")])
def test_garbage_manifests_are_manifest_errors(raw: bytes) -> None:
    with pytest.raises(errors.ManifestError):
        manifest_codec.decode_manifest(raw, step=1, where="m")


def test_every_byte_of_a_manifest_is_covered_by_its_checksum() -> None:
    """Flip each bit of an encoded manifest in turn: every result is refused (no JSON, a bad field, a checksum
    mismatch, or bytes that are not the canonical encoding), never decoded into something else."""
    m = good_manifest()
    raw = manifest_codec.encode_manifest(m)
    assert json.loads(raw)["checksum"] == manifest_codec.manifest_checksum(m)
    for index in range(len(raw)):
        for bit in range(8):
            flipped = bytearray(raw)
            flipped[index] ^= 1 << bit
            with pytest.raises(errors.ManifestError):
                manifest_codec.decode_manifest(bytes(flipped), step=7, where="m")


def test_a_manifest_changed_in_meaning_but_not_form_fails_its_checksum() -> None:
    doc = json.loads(manifest_codec.encode_manifest(good_manifest()))
    doc["training_state"] = {"pos": 2}
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()  # canonical, old checksum
    with pytest.raises(errors.ManifestError, match="checksum mismatch"):
        manifest_codec.decode_manifest(raw, step=7, where="m")
    doc["training_state"] = {"pos": 1}
    spaced = json.dumps(doc, sort_keys=True).encode()  # the same document, other bytes
    with pytest.raises(errors.ManifestError, match="canonical"):
        manifest_codec.decode_manifest(spaced, step=7, where="m")
    del doc["checksum"]
    with pytest.raises(errors.ManifestError, match="no checksum"):
        manifest_codec.decode_manifest(json.dumps(doc).encode(), step=7, where="m")


def test_version_1_manifests_written_before_the_checksum_still_decode() -> None:
    m = legacy_manifest(version=1)
    raw = json.dumps(m).encode()
    assert manifest_codec.decode_manifest(raw, step=7, where="m") == m


@pytest.mark.parametrize("mutate, message", [
    (lambda m: m["tensors"][0]["pieces"][0].update(start=4), "not contiguous"),
    (lambda m: m["tensors"][0]["pieces"][0].update(nbytes=32), "cover 32 of 64"),
    (lambda m: m["tensors"][0]["pieces"][0].update(shard=1), "not contiguous"),
])
def test_version_2_manifests_with_flat_pieces_are_still_checked(mutate, message) -> None:
    m = legacy_manifest()
    assert manifest_codec.decode_manifest(manifest_codec.encode_manifest(m), step=7, where="m") == m
    mutate(m)
    with pytest.raises(errors.ManifestError, match=message):
        manifest_codec.decode_manifest(manifest_codec.encode_manifest(m), step=7, where="m")


# ---- state trees ---------------------------------------------------------------------------------------------------


class HasStateDict:
    def __init__(self) -> None:
        self.w = np.ones(3)

    def state_dict(self) -> dict:
        return {"w": self.w, "count": 2}

    def load_state_dict(self, state: dict) -> None:
        self.w = state["w"]


def test_state_dict_objects_and_nested_mappings_flatten_with_paths() -> None:
    kind, tensors, values = state.flatten_state(HasStateDict())
    assert kind == "state_dict" and [p for p, _, _ in tensors] == [("w",)] and values == [(("count",), 2)]
    kind, tensors, values = state.flatten_state({"opt": {"m": np.zeros(2), "t": np.float32(3)}, "lr": 0.1})
    assert kind == "mapping"
    assert [p for p, _, _ in tensors] == [("opt", "m"), ("opt", "t")] and values == [(("lr",), 0.1)]


@pytest.mark.parametrize("bad", [{1: np.zeros(1)}, {"": np.zeros(1)}, [np.zeros(1)],
                                 {"x": object()}])
def test_states_that_cannot_be_named_or_stored_are_refused(bad) -> None:
    with pytest.raises(errors.UnsupportedTensorError):
        state.flatten_state(bad)


def test_restoring_a_mapping_writes_into_matching_arrays_in_place() -> None:
    live = np.zeros(3)
    target = {"w": live, "other": np.zeros(2, np.int32), "nested": {"v": np.zeros(1)}}
    state.load_into_mapping(target, {"w": np.arange(3.0), "other": np.arange(5), "nested": {"v": np.ones(1)}})
    assert target["w"] is live and list(live) == [0, 1, 2]
    assert list(target["other"]) == [0, 1, 2, 3, 4]  # shape differs: replaced
    assert target["nested"]["v"][0] == 1


# ---- CUDA tensors seen through __cuda_array_interface__ ---------------------------------------------------


class FakeCudaTensor:
    """What torch or cupy expose for a device tensor (the pointer is never read by _leaf)."""

    def __init__(self, shape: tuple[int, ...], typestr: str, strides: tuple[int, ...] | None):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "strides": strides,
                                         "data": (0x7F0000000000, False), "version": 3}


@given(shape=st.lists(st.integers(0, 5), max_size=4).map(tuple), itemsize=st.sampled_from([1, 2, 4, 8]))
def test_contiguity_is_decided_like_numpy_without_allocating(shape, itemsize) -> None:
    base = np.empty(shape, dtype=f"u{itemsize}")
    assert state.is_c_contiguous(shape, base.strides, itemsize)
    if base.ndim >= 2 and base.size and shape[0] > 1 and shape[-1] > 1:
        transposed = base.swapaxes(0, -1)
        assert state.is_c_contiguous(transposed.shape, transposed.strides, itemsize) is False


def test_a_gpu_sized_tensor_is_checked_for_contiguity_without_a_host_allocation() -> None:
    """64 TiB of float32: np.empty(shape) to learn its strides was a MemoryError (or a huge allocation)."""
    shape = (1 << 22, 1 << 22)
    leaf = state.leaf_of(FakeCudaTensor(shape, "<f4", (4 << 22, 4)))
    assert isinstance(leaf, state.DeviceArray) and leaf.shape == shape
    assert state.leaf_of(FakeCudaTensor(shape, "<f4", None)).shape == shape  # None: C-contiguous
    with pytest.raises(errors.UnsupportedTensorError, match="contiguous"):
        state.leaf_of(FakeCudaTensor(shape, "<f4", (4, 4 << 22)))


@pytest.mark.parametrize("stream, expected", [(None, None), (1, 1), (2, 2), (0x5555AAAA0000, 0x5555AAAA0000)])
def test_the_producer_stream_is_read_from_the_cuda_array_interface(stream, expected) -> None:
    tensor = FakeCudaTensor((4,), "<f4", None)
    if stream is not None:
        tensor.__cuda_array_interface__["stream"] = stream
    assert state.leaf_of(tensor).stream == expected
    tensor.__cuda_array_interface__.pop("stream", None)
    assert state.leaf_of(tensor).stream is None  # absent: no ordering asked for (interface versions < 3)


@pytest.mark.parametrize("stream", [0, -1, "1", 1.0, True])
def test_a_stream_the_interface_disallows_or_that_is_no_handle_is_refused(stream) -> None:
    tensor = FakeCudaTensor((4,), "<f4", None)
    tensor.__cuda_array_interface__["stream"] = stream
    with pytest.raises(errors.UnsupportedTensorError, match="stream"):
        state.leaf_of(tensor)


class HostBackedCudaTensor:
    """A stand-in for a device tensor that owns its memory: when it is freed, so are its bytes (as a CUDA
    caching allocator would hand them to the next tensor). Its "device memory" is a host array."""

    def __init__(self, values: np.ndarray, stream: int | None):
        self.memory = np.ascontiguousarray(values)
        self.__cuda_array_interface__ = {"shape": values.shape, "typestr": values.dtype.str, "strides": None,
                                         "data": (self.memory.ctypes.data, False), "version": 3,
                                         "stream": stream}


class FreshTensorsModel:
    """state_dict() builds new tensors each call (e.g. .contiguous() or a cast): its result is their only owner."""

    def __init__(self) -> None:
        self.produced: list[weakref.ref] = []

    def state_dict(self) -> dict:
        tensors = collections.OrderedDict(  # as torch's state_dict() returns
            a=HostBackedCudaTensor(np.arange(1000, dtype=np.float32), stream=7),
            b=collections.OrderedDict(c=HostBackedCudaTensor(np.full(300, 3, dtype=np.int64), stream=9)))
        self.produced += [weakref.ref(tensors), weakref.ref(tensors["a"]), weakref.ref(tensors["b"]["c"])]
        return tensors


def test_device_leaves_keep_their_tensor_and_the_state_dict_result_alive() -> None:
    model = FreshTensorsModel()
    _, leaves, _ = state.flatten_state(model)
    gc.collect()
    assert all(ref() is not None for ref in model.produced), "a tensor or the state_dict() result was freed"
    del leaves
    gc.collect()
    assert all(ref() is None for ref in model.produced)  # and nothing is kept longer than the leaves


class FakeGpuCopier:
    """The copy engine's boundary on a machine without a GPU: D2H copies read host memory at the "device"
    pointer; records the order of calls and whether every source tensor was alive at each copy."""

    device = 0

    def __init__(self, model: FreshTensorsModel):
        self.host = _native.Copier(-1)
        self.model = model
        self.calls: list[tuple[str, object]] = []

    def alloc(self, nbytes: int) -> object:
        return self.host.alloc(nbytes)

    def view(self, buffer: object, nbytes: int) -> memoryview:
        return self.host.view(buffer, nbytes)

    def wait_stream(self, stream: int) -> None:
        self.calls.append(("wait", stream))

    def copy(self, dst: object, src: object, nbytes: int | None = None, *, crc: int | None = 0,
             kind: int = _native.COPY_H2H) -> int | None:
        if kind == _native.COPY_D2H:
            gc.collect()
            self.calls.append(("copy", all(ref() is not None for ref in self.model.produced)))
        return self.host.copy(dst, src, nbytes, crc=crc)


def test_a_gpu_snapshot_waits_for_the_producer_stream_and_holds_its_sources_until_the_copy(tmp_path) -> None:
    model = FreshTensorsModel()
    coord = coordinator.CheckpointCoordinator(tmp_path, device="cpu", staging_bytes=1 * MiB)
    copier = coord._copier = FakeGpuCopier(model)
    coord.save(model, step=1)
    coord.close()
    kinds = [kind for kind, _ in copier.calls]
    assert kinds.index("wait") < kinds.index("copy")
    assert [value for kind, value in copier.calls if kind == "wait"] == [7, 9]  # each stream once, in order
    assert all(alive for kind, alive in copier.calls if kind == "copy")
    got = {"a": None, "b": {"c": None}}
    coordinator.CheckpointCoordinator(tmp_path).restore(got)
    assert got["a"].tobytes() == np.arange(1000, dtype=np.float32).tobytes()
    assert list(got["b"]["c"]) == [3] * 300


# ---- set-aside steps and the fence record -------------------------------------------------------------------


def test_set_aside_steps_beyond_max_to_keep_are_removed_newest_kept() -> None:
    aside = [(4, ".invalid-step-000000004-aa"), (9, ".abandoned-step-000000009-bb"),
             (7, ".abandoned-step-000000007-cc")]
    assert retention.set_aside_to_delete(aside, max_to_keep=2) == [".invalid-step-000000004-aa"]
    assert retention.set_aside_to_delete(aside, max_to_keep=None) == []
    assert retention.set_aside_to_delete(aside, max_to_keep=5) == []


def test_a_fence_abandons_exactly_the_steps_newer_than_the_restored_one() -> None:
    fence = timeline.fence_after(2000, [1000, 2000, 3000, 4000], invalid={4000, 1000})
    assert fence == timeline.Fence(2000, (3000, 4000), (4000,))
    assert timeline.fence_after(4000, [1000, 4000]) is None
    assert timeline.decode_fence(timeline.encode_fence(fence), where="x") == fence


@pytest.mark.parametrize("raw", [b"", b"[]", b'{"format": "sneppx.fence", "version": 2}',
                                 b'{"format":"sneppx.fence","version":1,"restored":5,"abandoned":[3],"invalid":[]}',
                                 b'{"format":"sneppx.fence","version":1,"restored":5,"abandoned":[6],"invalid":[7]}',
                                 b'{"format":"sneppx.fence","version":1,"restored":5,"abandoned":[true],"invalid":[]}'])
def test_a_fence_record_that_is_not_one_is_a_typed_error(raw: bytes) -> None:
    with pytest.raises(errors.FenceRecordError):
        timeline.decode_fence(raw, where="root/FENCE")


# ---- restore: shard files are closed on every path ----------------------------------------------------------


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_shard_that_fails_to_open_closes_the_readers_opened_before_it(tmp_path) -> None:
    """The first shard reads fine, the second is corrupt: the load reports it, and no descriptor of either
    stays open (restore reads each shard through one descriptor, closed whatever happens)."""
    with CheckpointWriter(tmp_path / "good.snpx") as w:
        w.write("a", np.arange(10, dtype=np.int64))
    (tmp_path / "bad.snpx").write_bytes(b"SNPX" + bytes(100))
    manifest = {"format": manifest_codec.MANIFEST_FORMAT, "version": 2, "step": 1,
                "shards": ["good.snpx", "bad.snpx"], "values": [],
                "tensors": [{"path": ["a"], "dtype": "int64", "shape": [10], "nbytes": 80,
                             "pieces": [{"shard": 0, "entry": "a", "start": 0, "nbytes": 80,
                                         "crc32c": _native.crc32c(np.arange(10, dtype=np.int64))}]}]}
    (tmp_path / "manifest.json").write_bytes(manifest_codec.encode_manifest(manifest))
    before = open_fds()
    _, problems, arrays = validate.load_step(str(tmp_path), 1)
    assert arrays is None and len(problems) == 1 and "bad.snpx" in problems[0]
    assert open_fds() == before
    del manifest["shards"][1]
    (tmp_path / "manifest.json").write_bytes(manifest_codec.encode_manifest(manifest))
    _, problems, arrays = validate.load_step(str(tmp_path), 1)
    assert problems == [] and list(arrays[0]) == list(range(10)) and arrays[0].flags.writeable
    assert open_fds() == before
