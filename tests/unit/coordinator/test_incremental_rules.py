"""The pure rules of incremental steps: what a version 4 manifest may reference, what retention must keep, how a
save is cut so that unchanged pieces can be referenced, and when a piece counts as unchanged."""

from __future__ import annotations

import copy
import json
import pathlib
from typing import Any

import numpy as np
import pytest

from SneppX_ALG import CheckpointCoordinator, _native, errors, storage
from SneppX_ALG.checkpoint import manifest as manifest_codec
from SneppX_ALG.coordinator import engine, plan, retention


@pytest.fixture(scope="module")
def incremental_manifest(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A real version 4 manifest: step 2 of a root where one of two tensors did not change."""
    root = tmp_path_factory.mktemp("root")
    with CheckpointCoordinator(str(root), async_save=False, device="cpu", incremental=True) as c:
        for step in (1, 2):
            c.save({"same": np.arange(4096, dtype=np.float32), "new": np.full(64, step, np.float32)}, step=step)
    raw = (pathlib.Path(root) / storage.step_name(2) / storage.MANIFEST).read_bytes()
    return manifest_codec.decode_manifest(raw, step=2, where="test")


def reencoded(manifest: dict[str, Any]) -> bytes:
    """The manifest's bytes with a valid checksum: what a writer with a bug, or an attacker, would produce."""
    raw = json.dumps({**manifest, "checksum": manifest_codec.manifest_checksum(manifest)}, sort_keys=True,
                     separators=(",", ":")).encode()
    return raw


def referencing_chunk(m: dict[str, Any]) -> dict[str, Any]:
    return next(c for t in m["tensors"] for c in t["chunks"] if "from" in c)


def test_the_real_manifest_decodes_with_its_reference(incremental_manifest: dict[str, Any]) -> None:
    m = incremental_manifest
    assert m["version"] == 4 and m["uses"] == [1] and m["chain"] == 1
    chunk = referencing_chunk(m)
    assert chunk["from"] == [1, "shard-00000.snpx"] and manifest_codec.reference(chunk) == (1, "shard-00000.snpx")
    assert manifest_codec.decode_manifest(reencoded(m), step=2, where="t")["uses"] == [1]


@pytest.mark.parametrize(("change", "why"), [
    (lambda m: referencing_chunk(m).__setitem__("from", [2, "shard-00000.snpx"]), "earlier step"),
    (lambda m: referencing_chunk(m).__setitem__("from", [1, "../shard-00000.snpx"]), "plain file name"),
    (lambda m: referencing_chunk(m).__setitem__("from", [1, "manifest.json"]), "plain file name"),
    (lambda m: referencing_chunk(m).__setitem__("from", [True, "shard-00000.snpx"]), "earlier step"),
    (lambda m: referencing_chunk(m).pop("digests"), "block digests"),
    (lambda m: m.__setitem__("uses", [0, 1]), "'uses' says"),
    (lambda m: m.__setitem__("uses", []), "'uses' must list"),
    (lambda m: m.pop("chain"), "'chain'"),
    (lambda m: m.__setitem__("version", 3), "malformed"),  # a reference in a version 3 manifest
])
def test_a_reference_the_rules_refuse_is_a_manifest_error(incremental_manifest: dict[str, Any], change: Any,
                                                          why: str) -> None:
    m = copy.deepcopy(incremental_manifest)
    change(m)
    with pytest.raises(errors.ManifestError, match=why):
        manifest_codec.decode_manifest(reencoded(m), step=2, where="t")


def test_retention_keeps_the_closure_of_what_kept_steps_reference() -> None:
    uses = {10: [], 11: [10], 12: [10, 11], 20: [], 21: [20], 30: [12]}
    assert retention.referenced([21], uses.__getitem__) == {20}
    assert retention.referenced([30], uses.__getitem__) == {12, 11, 10}  # 12 is kept whole: what it uses too
    assert retention.referenced([10, 20], uses.__getitem__) == set()


def test_an_incremental_save_cuts_every_array_into_units_the_same_way_every_time() -> None:
    specs = [plan.TensorSpec(("a",), "float32", (3000, 256), 4), plan.TensorSpec(("b",), "float32", (10,), 4),
             plan.TensorSpec(("c",), "float32", (700, 256), 4)]
    first = plan.plan_pieces(specs, 8 << 20, 1 << 20)
    pieces = [p for b in first for p in b]
    assert max(p.nbytes for p in pieces) <= 1 << 20
    assert [p.entry for p in pieces if p.tensor == 0] == ["a@0", "a@1", "a@2"]
    assert first == plan.plan_pieces(specs, 8 << 20, 1 << 20)
    whole = [p for b in plan.plan_pieces(specs, 8 << 20) for p in b]  # not incremental: one piece a tensor
    assert [p.entry for p in whole] == ["a", "b", "c"]


def test_a_piece_is_referenced_only_when_every_checksum_and_its_place_match() -> None:
    record = {"shard": 0, "entry": "w@1", "offset": [256, 0], "shape": [256, 256], "nbytes": 262144,
              "crc32c": 7, "blocks": "00000007", "digests": "ab" * 32}
    base = engine.Chain(4, "shard-00001.snpx", 1, {"w@1": ("float32", (1024, 256), dict(record))})
    assert engine.reusable(base, "w@1", "float32", (1024, 256), record) == {**record, "from": [4, "shard-00001.snpx"]}
    origin = engine.Chain(4, "shard-00001.snpx", 1, {"w@1": ("float32", (1024, 256),
                                                             {**record, "from": [2, "shard-00000.snpx"]})})
    assert engine.reusable(origin, "w@1", "float32", (1024, 256), record)["from"] == [2, "shard-00000.snpx"]
    # found equal byte for byte to what the base saved (the snapshot's compare): its box and CRC32C must match, and
    # the chunk takes the base's block checksums
    placed = {k: record[k] for k in ("shard", "offset", "shape", "nbytes", "crc32c")}
    assert engine.reusable(base, "w@1", "float32", (1024, 256), placed, ("crc32c",)) == {
        **record, "from": [4, "shard-00001.snpx"]}
    assert engine.reusable(base, "w@1", "float32", (1024, 256), {**placed, "crc32c": 8}, ("crc32c",)) is None
    assert engine.reusable(base, "w@1", "float32", (1024, 256), {**placed, "nbytes": 4}, ("crc32c",)) is None
    for key, value in (("crc32c", 8), ("digests", "cd" * 32), ("offset", [0, 0]), ("blocks", "00000008")):
        assert engine.reusable(base, "w@1", "float32", (1024, 256), {**record, key: value}) is None, key
    assert engine.reusable(base, "w@1", "int32", (1024, 256), record) is None  # same bytes, another dtype
    assert engine.reusable(base, "w@1", "float32", (2048, 256), record) is None  # another global tensor
    assert engine.reusable(base, "w@0", "float32", (1024, 256), record) is None
    assert engine.reusable(base, "w@1", "float32", (1024, 256), {**record, "digests": None}) is None
    # blocks of another size (the state grew past 128 GiB): the base's block checksums would not fit this manifest
    assert engine.reusable(base, "w@1", "float32", (1024, 256), placed, ("crc32c",), block_bytes=1 << 20) is None
    assert engine.reusable(base, "w@1", "float32", (1024, 256), record, block_bytes=1 << 20) is None


def test_a_staging_slot_holds_what_a_committed_save_staged_only_until_another_save_takes_it() -> None:
    pool = engine.StagingPool(_native.Copier(-1), 4096, 2)
    first, second, third = object(), object(), object()
    staged = engine.Held(1, {"w": (0, 64, 7)})
    assert pool.acquire(first, slot=0) == (0, None)
    pool.release(0)
    pool.settle(0, first, staged)  # the first save committed after the writer gave its buffer back
    assert pool.acquire(second, slot=0) == (0, staged)  # what the second save compares with, then overwrites
    pool.release(0)
    pool.settle(0, first, engine.Held(9, {"w": (0, 64, 7)}))  # late news of an older save: the slot is not its
    assert pool.acquire(third, slot=0) == (0, None)  # nothing known: the second save never committed
    pool.release(0)
    pool.settle(0, third, staged)
    pool.forget()  # a restore: another chain
    assert pool.acquire(first, slot=0) == (0, None)
    assert pool.acquire(first) == (1, None)  # any slot: the one left
    pool.release(0)
    pool.release(1)
    pool.clear()
    assert pool.allocated_bytes == 0
