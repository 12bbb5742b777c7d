"""Interop: SNPX <-> safetensors (files and sharded checkpoints), and tensors in and out through DLPack.

The safetensors side is always read and written by the safetensors package itself, so "round trip" here means:
what the package wrote, converted to SNPX and back, is what the package reads again, byte for byte.
"""

from __future__ import annotations

import json
import os
import pathlib
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors
from safetensors.numpy import save_file

from SneppX_ALG import CheckpointCoordinator, CheckpointReader, CheckpointWriter, errors, validate_checkpoint
from SneppX_ALG.checkpoint import arrays, convert, tensors

BF16 = np.dtype(ml_dtypes.bfloat16)


def sample() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "embed.weight": rng.standard_normal((64, 48)).astype(BF16),
        "layers.0.w": rng.standard_normal((48, 48)).astype(np.float32),
        "layers.0.b": rng.standard_normal(48).astype(np.float16),
        "layers.1.w": rng.standard_normal((48, 48)).astype(np.float64),
        "positions": np.arange(-5, 95, dtype=np.int64),
        "counts": np.arange(9, dtype=np.uint32),
        "mask": rng.random(33) > 0.5,
        "phase": (rng.standard_normal(5) + 1j).astype(np.complex64),
        "scalar": np.array(3, dtype=np.int8),
        "empty": np.zeros((0, 4), np.float32),
    }


def header_and_data(path: pathlib.Path) -> tuple[dict[str, object], bytes]:
    """A safetensors file as (its header JSON, parsed; its data section's bytes): what "the same file" means,
    since the package orders __metadata__ keys differently from one run to the next."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def assert_same_tensors(path: str | pathlib.Path, expected: dict[str, np.ndarray]) -> None:
    with safetensors.safe_open(str(path), framework="numpy") as f:
        assert sorted(f.keys()) == sorted(expected)
        for name, want in expected.items():
            got = f.get_tensor(name)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert got.tobytes() == want.tobytes(), name


# ---- safetensors <-> SNPX ----------------------------------------------------------------------------------


def test_safetensors_to_snpx_and_back_keeps_every_bit_and_the_metadata(tmp_path: pathlib.Path) -> None:
    original = sample()
    save_file(original, tmp_path / "model.safetensors", metadata={"format": "pt", "note": "ünïcode"})
    convert.to_snpx(tmp_path / "model.safetensors", tmp_path / "model.snpx")
    assert validate_checkpoint(tmp_path / "model.snpx") == (True, [])
    with CheckpointReader(tmp_path / "model.snpx") as r:
        assert r.metadata == {"format": "pt", "note": "ünïcode"} and r.config is None
        assert r.entry("embed.weight").dtype == "bfloat16"
        for name, want in original.items():
            got = r.read(name)
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), name
    convert.to_safetensors(tmp_path / "model.snpx", tmp_path / "back.safetensors")
    assert header_and_data(tmp_path / "back.safetensors") == header_and_data(tmp_path / "model.safetensors")


def test_snpx_to_safetensors_and_back_keeps_config_metadata_and_shard_placement(tmp_path: pathlib.Path) -> None:
    src = tmp_path / "a.snpx"
    part = np.arange(12, dtype=np.float32).reshape(3, 4)
    with CheckpointWriter(src, metadata={"run": "r1"}, config={"dim": 4, "layers": [1, 2]}) as w:
        w.write("w", part, global_shape=(6, 4), global_offset=(3, 0))
        w.write("h", np.ones(5, BF16))
    convert.to_safetensors(src, tmp_path / "a.safetensors")
    with safetensors.safe_open(str(tmp_path / "a.safetensors"), framework="numpy") as f:
        meta = f.metadata()
    assert meta["run"] == "r1" and json.loads(meta[convert.CONFIG_KEY]) == {"dim": 4, "layers": [1, 2]}
    convert.to_snpx(tmp_path / "a.safetensors", tmp_path / "b.snpx")
    with CheckpointReader(src) as a, CheckpointReader(tmp_path / "b.snpx") as b:
        assert b.metadata == a.metadata and b.config == a.config
        assert b.entry("w").global_shape == (6, 4) and b.entry("w").global_offset == (3, 0)
        for name in a.names():
            assert b.read(name).tobytes() == a.read(name).tobytes() and b.entry(name).dtype == a.entry(name).dtype


def test_sharded_checkpoint_round_trips_shards_index_and_tensors(tmp_path: pathlib.Path) -> None:
    original = sample()
    with CheckpointWriter(tmp_path / "m.snpx", metadata={"format": "pt"}) as w:
        for name, array in original.items():
            w.write(name, array)
    written = convert.to_safetensors(tmp_path / "m.snpx", tmp_path / "hf", max_shard_bytes=10_000)
    names = sorted(os.listdir(tmp_path / "hf"))
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(os.path.basename(p) for p in written) == names
    index = json.loads((tmp_path / "hf" / convert.INDEX_NAME).read_text())
    assert index["metadata"] == {"total_size": sum(a.nbytes for a in original.values())}
    assert set(index["weight_map"]) == set(original) and set(index["weight_map"].values()) == set(shards)
    for shard in shards:  # every shard within the bound unless one tensor alone is larger
        held = [original[n] for n, s in index["weight_map"].items() if s == shard]
        assert sum(a.nbytes for a in held) <= 10_000 or len(held) == 1
        assert_same_tensors(tmp_path / "hf" / shard,
                            {n: original[n] for n, s in index["weight_map"].items() if s == shard})

    convert.to_snpx(tmp_path / "hf", tmp_path / "joined.snpx")  # the directory, found by its index
    assert validate_checkpoint(tmp_path / "joined.snpx") == (True, [])
    convert.to_safetensors(tmp_path / "joined.snpx", tmp_path / "hf2")
    assert sorted(os.listdir(tmp_path / "hf2")) == names
    assert (tmp_path / "hf2" / convert.INDEX_NAME).read_bytes() == (tmp_path / "hf" / convert.INDEX_NAME).read_bytes()
    for shard in shards:
        assert header_and_data(tmp_path / "hf2" / shard) == header_and_data(tmp_path / "hf" / shard)


def test_shards_with_their_own_metadata_come_back_with_it(tmp_path: pathlib.Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"a": np.ones(3, np.float32)}, hf / "one.safetensors", metadata={"format": "pt"})
    save_file({"b": np.zeros(2, BF16)}, hf / "two.safetensors", metadata={"format": "pt", "extra": "x"})
    index = {"metadata": {"total_size": 16, "producer": "hand"},
             "weight_map": {"a": "one.safetensors", "b": "two.safetensors"}}
    (hf / "weights.safetensors.index.json").write_text(json.dumps(index))
    convert.to_snpx(hf / "weights.safetensors.index.json", tmp_path / "w.snpx")
    convert.to_safetensors(tmp_path / "w.snpx", tmp_path / "out")
    assert json.loads((tmp_path / "out" / convert.INDEX_NAME).read_text()) == index
    for shard in ("one.safetensors", "two.safetensors"):
        assert header_and_data(tmp_path / "out" / shard) == header_and_data(hf / shard)


def test_a_step_directory_converts_with_tensors_joined_from_their_pieces(tmp_path: pathlib.Path) -> None:
    state = {"big": np.arange(300_000, dtype=np.float32).reshape(600, 500), "bf": np.ones((7, 3), BF16),
             "lr": 0.5}
    with CheckpointCoordinator(tmp_path / "root", async_save=False, staging_bytes=256 << 10, device="cpu") as c:
        c.save(state, step=100, training_state={"epoch": 2})
    step = tmp_path / "root" / "step-000000100"
    with tensors.open_tensors(step) as t:
        assert isinstance(t, tensors.StepTensors)
        assert len(t._tensors["big"]["chunks"]) > 1  # the case under test: a tensor stored in pieces
    convert.to_safetensors(step, tmp_path / "s.safetensors")
    assert_same_tensors(tmp_path / "s.safetensors", {"big": state["big"], "bf": state["bf"]})
    convert.to_snpx(step, tmp_path / "s.snpx")
    with CheckpointReader(tmp_path / "s.snpx") as r:
        assert r.config == {"step": 100, "training_state": {"epoch": 2}, "values": {"lr": 0.5}}
        np.testing.assert_array_equal(r.read("big"), state["big"])


def test_dtypes_the_other_format_lacks_are_refused_by_name_and_nothing_is_written(tmp_path: pathlib.Path) -> None:
    save_file({"ok": np.ones(2, np.float32), "q": np.ones(4, ml_dtypes.float8_e4m3fn)}, tmp_path / "f8.safetensors")
    with pytest.raises(errors.UnsupportedTensorError, match=r"'q' is F8_E4M3.*cast it"):
        convert.to_snpx(tmp_path / "f8.safetensors", tmp_path / "f8.snpx")
    with CheckpointWriter(tmp_path / "c.snpx") as w:
        w.write("z", np.ones(3, np.complex128))
    with pytest.raises(errors.UnsupportedTensorError, match=r"'z' is complex128.*safetensors does not store"):
        convert.to_safetensors(tmp_path / "c.snpx", tmp_path / "c.safetensors")
    assert sorted(os.listdir(tmp_path)) == ["c.snpx", "f8.safetensors"]


def test_hostile_or_broken_safetensors_inputs_get_typed_errors(tmp_path: pathlib.Path) -> None:
    save_file({"a": np.ones(3, np.float32)}, tmp_path / "one.safetensors")
    escape = tmp_path / "escape.safetensors.index.json"
    escape.write_text(json.dumps({"weight_map": {"a": "../one.safetensors"}}))
    with pytest.raises(errors.ForeignCheckpointError, match="weight_map"):
        convert.to_snpx(escape, tmp_path / "x.snpx")
    liar = tmp_path / "liar.safetensors.index.json"
    liar.write_text(json.dumps({"weight_map": {"a": "one.safetensors", "ghost": "one.safetensors"}}))
    with pytest.raises(errors.ForeignCheckpointError, match="no shard holds"):
        convert.to_snpx(liar, tmp_path / "x.snpx")
    raw = (tmp_path / "one.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(raw[:-4])
    with pytest.raises(errors.ForeignCheckpointError):
        convert.to_snpx(tmp_path / "cut.safetensors", tmp_path / "x.snpx")
    missing = tmp_path / "missing.safetensors.index.json"
    missing.write_text(json.dumps({"weight_map": {"a": "nowhere.safetensors"}}))
    with pytest.raises(errors.CheckpointNotFoundError):
        convert.to_snpx(missing, tmp_path / "x.snpx")
    assert not (tmp_path / "x.snpx").exists()


# ---- DLPack and the array interface ------------------------------------------------------------------------


class DLPackOnly:
    """A framework tensor that speaks DLPack and nothing else (no buffer, no array interface)."""

    def __init__(self, producer: object, device: tuple[int, int] = (1, 0)):
        self._producer, self._device = producer, device

    def __dlpack__(self, **kwargs: object) -> object:
        return self._producer.__dlpack__(**kwargs)  # type: ignore[attr-defined]

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._device


class ArrayInterfaceOnly:
    def __init__(self, a: np.ndarray):
        self._a = a
        self.__array_interface__ = a.__array_interface__


def written(tmp_path: pathlib.Path, **tensors_: object) -> pathlib.Path:
    path = tmp_path / "t.snpx"
    with CheckpointWriter(path) as w:
        for name, value in tensors_.items():
            w.write(name, value)
    return path


def test_read_as_hands_over_a_writable_copy_on_write_mapping_that_never_changes_the_file(
        tmp_path: pathlib.Path) -> None:
    values = np.arange(2048, dtype=np.float32)
    path = written(tmp_path, a=values)
    before = path.read_bytes()
    with CheckpointReader(path) as r:
        mapped = r.read("a", as_=lambda t: t)
        a = np.asarray(mapped)
        assert a.flags.writeable and not a.flags.owndata and isinstance(a.base, memoryview) is False
        assert np.shares_memory(a, mapped.array)
        a[:] = -1  # a framework writing to what it was handed
        np.testing.assert_array_equal(r.read("a"), values)  # other reads and the file are untouched
        np.testing.assert_array_equal(np.asarray(r.read("a", as_=lambda t: t)), values)
    assert path.read_bytes() == before and validate_checkpoint(path) == (True, [])


def test_bfloat16_goes_out_and_back_in_through_dlpack_without_a_copy(tmp_path: pathlib.Path) -> None:
    values = np.linspace(-4, 4, 4096).astype(BF16).reshape(64, 64)
    path = written(tmp_path, h=values)
    with CheckpointReader(path) as r:
        mapped = r.read("h", as_=lambda t: t)
    capsule = mapped.__dlpack__()
    dtype = arrays._dl_dtype(capsule)
    assert (dtype.code, dtype.bits, dtype.lanes) == (4, 16, 1)  # DLPack's bfloat16, not uint16
    back = arrays.as_array(DLPackOnly(mapped))  # a consumer of our capsule, relabelling it for numpy
    assert back.dtype == BF16 and back.tobytes() == values.tobytes()
    assert back.ctypes.data == mapped.array.ctypes.data


def test_writer_and_coordinator_take_dlpack_and_array_interface_tensors(tmp_path: pathlib.Path) -> None:
    source = np.arange(24, dtype=np.int16).reshape(4, 6)
    assert arrays.as_array(DLPackOnly(source)).ctypes.data == source.ctypes.data  # zero-copy in
    assert arrays.as_array(ArrayInterfaceOnly(source)).ctypes.data == source.ctypes.data
    path = written(tmp_path, d=DLPackOnly(source), i=ArrayInterfaceOnly(source.T))
    with CheckpointReader(path) as r:
        np.testing.assert_array_equal(r.read("d"), source)
        np.testing.assert_array_equal(r.read("i"), source.T)
    state = {"d": DLPackOnly(np.ones(5, np.float16)), "i": ArrayInterfaceOnly(np.arange(3.0))}
    with CheckpointCoordinator(tmp_path / "root", async_save=False, device="cpu") as c:
        c.save(state, step=1)
        held = np.zeros(5, np.float16)
        framework_tensor = DLPackOnly(held)
        target = {"d": framework_tensor, "i": ArrayInterfaceOnly(np.zeros(3))}
        c.restore(target)  # loaded into the tensors the state holds, in place
    assert target["d"] is framework_tensor and held.tobytes() == np.ones(5, np.float16).tobytes()
    np.testing.assert_array_equal(target["i"]._a, np.arange(3.0))


def test_read_into_out_fills_a_host_tensor_in_place(tmp_path: pathlib.Path) -> None:
    path = written(tmp_path, a=np.arange(6, dtype=np.float32).reshape(2, 3))
    out = np.zeros((2, 3), np.float32)
    with CheckpointReader(path) as r:
        assert r.read("a", out=DLPackOnly(out)) is not None
        np.testing.assert_array_equal(out, np.arange(6).reshape(2, 3))
        with pytest.raises(errors.UnsupportedTensorError, match="same dtype and shape"):
            r.read("a", out=np.zeros(6, np.float32))
        frozen = np.zeros((2, 3), np.float32)
        frozen.flags.writeable = False
        with pytest.raises(errors.UnsupportedTensorError, match="read-only.*as_="):
            r.read("a", out=frozen)


def test_what_the_writer_cannot_take_says_what_to_do(tmp_path: pathlib.Path) -> None:
    with CheckpointWriter(tmp_path / "x.snpx") as w:
        with pytest.raises(errors.UnsupportedTensorError, match=r"CUDA GPU.*\.cpu\(\).*CheckpointCoordinator"):
            w.write("gpu", DLPackOnly(np.ones(2), device=(2, 0)))
        with pytest.raises(errors.UnsupportedTensorError, match="can't be stored.*cast"):
            w.write("f8", np.ones(2, ml_dtypes.float8_e5m2))
        with pytest.raises(errors.UnsupportedTensorError, match="__dlpack__"):
            w.write("text", "not a tensor")
        with pytest.raises(errors.UnsupportedTensorError, match="structured"):
            w.write("rec", np.zeros(2, dtype=[("a", "i4"), ("b", "f4")]))


# ---- a real framework: jax on the CPU (extra `interop-test`) ------------------------------------------------


def test_jax_arrays_go_in_and_come_out_without_a_copy(tmp_path: pathlib.Path) -> None:
    jax = pytest.importorskip("jax", reason="jax is not installed: pip install -e '.[interop-test]' "
                                            "(a 124 MB download, kept out of the test extra)")
    jnp = jax.numpy
    weights = jnp.arange(4096, dtype=jnp.float32).reshape(64, 64)
    half = (jnp.arange(4096, dtype=jnp.float32) / 7).astype(jnp.bfloat16)
    assert arrays.as_array(weights).ctypes.data == weights.unsafe_buffer_pointer()  # zero-copy in
    assert arrays.as_array(half).ctypes.data == half.unsafe_buffer_pointer()  # bfloat16 too
    path = written(tmp_path, w=weights, h=half)
    with CheckpointReader(path) as r:
        mapped, w = r.read("w", as_=lambda t: (t, jax.dlpack.from_dlpack(t)))
        assert w.unsafe_buffer_pointer() == mapped.array.ctypes.data  # zero-copy out
        mapped, h = r.read("h", as_=lambda t: (t, jax.dlpack.from_dlpack(t)))
        assert h.dtype == jnp.bfloat16 and h.unsafe_buffer_pointer() == mapped.array.ctypes.data
    assert bool((w == weights).all()) and bool((h == half).all())
    with CheckpointCoordinator(tmp_path / "root", async_save=False, device="cpu") as c:
        c.save({"w": weights, "h": half}, step=3)
        restored: dict[str, object] = {"w": weights, "h": half}
        c.restore(restored)  # jax arrays are immutable: replaced by the loaded arrays
    assert np.asarray(restored["h"]).tobytes() == np.asarray(half).tobytes()
