"""One rank's snapshot (`Snapshot`): the layout of its buffer (Shards first, then the slot for their description,
then the replicated arrays, each tensor 64-byte aligned), how the state is copied into it (`capture`, host arrays
and CUDA tensors), its CRCs (`seal`, `problems`), and the form its unique part travels in (`wire_view`,
`from_wire`).

Separate because it is the format every other part of the package reads and writes: the keeper moves these
buffers, the plan compares their descriptions, the restore reads their boxes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from typing import Any

import numpy as np

from SneppX_ALG import _native, errors
from SneppX_ALG.checkpoint import chunks, format
from SneppX_ALG.coordinator import state as state_lib

PIECE = 4 << 20  # bytes per CRC32C


@dataclasses.dataclass(eq=False)  # one snapshot is one object: lists of them are searched by identity
class Snapshot:
    """One rank's state at one step: `meta` describes `payload` (tensors at byte offsets, their CRCs)."""

    meta: dict[str, Any]
    payload: np.ndarray  # uint8

    @property
    def key(self) -> tuple[str, int, int]:
        """(run instance, generation, step): the ranks of one generation snapshot the same steps."""
        return self.meta["instance"], self.meta["generation"], self.meta["step"]

    @property
    def source(self) -> int:
        return int(self.meta["rank"])

    @property
    def unique_end(self) -> int:
        """Where the unique part's bytes (the Shards, first) end: its description's slot starts there."""
        return int(self.meta["unique_end"])

    def problems(self) -> list[str]:
        """What does not match its CRCs (empty: every byte checked and good)."""
        ranges = [(t["at"] + i * PIECE, min(PIECE, t["nbytes"] - i * PIECE))
                  for t in self.meta["tensors"] for i in range(len(t["crcs"]))]
        expected = [c for t in self.meta["tensors"] for c in t["crcs"]]
        if not ranges:
            return []
        got = _native.crc32c_ranges(self.payload, ranges)
        return [f"rank {self.source}'s snapshot of step {self.meta['step']}: bytes {at}..{at + n} fail their CRC32C"
                for (at, n), want, have in zip(ranges, expected, got, strict=True) if want != have]

    def unique(self) -> Snapshot:
        """What a peer keeps of it: the Shards (a view, no copy), without plain values or training state."""
        return Snapshot(_unique_meta(self.meta), self.payload[:self.unique_end])


# What a snapshot is of: the state a restore fills, or other state kept beside it (ctx.snapshot of, say, an
# average of the parameters: laid out exactly like them, and never to be restored into them).
STATE, OTHER = "state", "other"


def capture(obj: Any, step: int, *, instance: str, generation: int, rank: int, world: int,
            into: Callable[[int], np.ndarray], training_state: Any = None,
            admit: Callable[[int, int], None] | None = None,
            copier: Callable[[int], Any] | None = None, role: str = STATE) -> Snapshot:
    """Copies `obj` (what `ctx.save` takes) into a buffer from `into(nbytes)`: host arrays with a memcpy, their
    CRCs later (`seal`, off the training thread); CUDA tensors through `copier(device)`'s pinned staging, after
    the work queued on their producer's stream, hashed as they land. `admit(state bytes, unique bytes)` is asked
    first, before anything is allocated (it raises to refuse). `copier(device)`: a copy engine per device (the
    Keeper keeps them; by default one per call). `role`: STATE for the object a restore fills, OTHER for state
    kept beside it (part of what it `holds`, so a snapshot of one is never restored into the other)."""
    copier = copier or functools.cache(_native.Copier)
    kind, leaves, values = state_lib.flatten_state(obj)
    for path, value in values:
        state_lib.check_json_safe(value, "/".join(path))
    ordered = sorted(leaves, key=lambda leaf: leaf[2] is None)  # Shards first: the unique part is a prefix
    meta: dict[str, Any] = {"instance": instance, "generation": generation, "step": int(step), "rank": rank,
                            "world": world, "kind": kind, "tensors": [], "unique_end": 0, "slot": 0,
                            "holds": "0" * 8, "agreed": False}  # filled in later, sized in the slot now
    at = 0
    for path, leaf, shard in ordered:
        if shard is None and not meta["slot"]:  # the Shards end here: the slot for their description
            at = _reserve_slot(meta, at)
        on_device = isinstance(leaf, state_lib.DeviceArray)
        array = leaf if on_device else np.asarray(leaf)  # not ascontiguousarray: it makes a 0-d array 1-d
        shape, nbytes = tuple(array.shape), int(np.prod(array.shape, dtype=np.int64)) * array.dtype.itemsize
        meta["tensors"].append({"path": list(path), "dtype": _dtype_name(array.dtype), "local": list(shape),
                                "shape": list(shard.global_shape) if shard else list(shape),
                                "offset": list(shard.global_offset) if shard else None, "at": at,
                                "nbytes": nbytes, "crcs": []})
        at += _aligned(nbytes)  # each tensor starts 64-byte aligned
    if not meta["slot"]:
        at = _reserve_slot(meta, at)
    if admit is not None:
        admit(at, meta["unique_end"])
    payload = into(at)
    ordered_streams: set[tuple[int, int]] = set()
    for t, (_, leaf, _) in zip(meta["tensors"], ordered, strict=True):
        if isinstance(leaf, state_lib.DeviceArray):
            t["crcs"] = _copy_from_device(leaf, payload[t["at"]:t["at"] + t["nbytes"]], copier(leaf.device),
                                          ordered_streams)
            continue
        view = payload[t["at"]:t["at"] + t["nbytes"]].view(format.numpy_dtype(t["dtype"]))
        np.copyto(view.reshape(t["local"]), np.asarray(leaf), casting="no")
    meta["values"] = [{"path": list(p), "value": v} for p, v in values]
    meta["training_state"] = training_state
    meta["holds"] = layout([(t["path"], t["dtype"], t["shape"]) for t in meta["tensors"] if t["offset"] is None],
                           [p for p, _ in values], role)
    return Snapshot(meta, payload)


def layout(tensors: list[tuple[Any, str, Any]], values: list[Any], role: str = STATE) -> str:
    """What a snapshot holds, as a restore target is compared with it: a digest of its role, its replicated
    tensors' paths, dtypes and shapes and its plain values' paths: the same on every rank and at every world size
    (the values themselves change). Not its Shards: which pieces a rank holds depends on its rank and the world
    size (ZeRO's optimizer pieces), and `apply` checks every target Shard's path, dtype, global shape and
    coverage against the parts before it writes anything."""
    text = json.dumps([sorted([list(p), d, list(s)] for p, d, s in tensors), sorted(list(p) for p in values), role])
    return f"{_native.crc32c(np.frombuffer(text.encode(), np.uint8)):08x}"


def layout_of(obj: Any) -> str:
    """`layout` of the object a restore fills (what `capture` would record of it, as STATE)."""
    _, leaves, values = state_lib.flatten_state(obj)
    return layout([(path, _dtype_name(np.dtype(leaf.dtype)), leaf.shape) for path, leaf, shard in leaves
                   if shard is None], [path for path, _ in values], STATE)


_dtype_name = functools.lru_cache(maxsize=64)(format.dtype_name)  # numpy's dtype.name is slow, and asked per leaf


def _copy_from_device(leaf: state_lib.DeviceArray, into: np.ndarray, copier: Any,
                      ordered_streams: set[tuple[int, int]]) -> list[int]:
    """A CUDA tensor's bytes into host memory, PIECE by PIECE, and their CRCs: the copy engine hashes each piece
    as it lands. Ordered after the producer's stream (once per stream a snapshot), which may still be writing."""
    if leaf.stream is not None and (leaf.device, leaf.stream) not in ordered_streams:
        copier.wait_stream(leaf.stream)
        ordered_streams.add((leaf.device, leaf.stream))
    crcs = []
    for at in range(0, max(1, len(into)), PIECE):
        n = min(PIECE, len(into) - at)
        crcs.append(int(copier.copy(into[at:at + n], leaf.pointer + at, n, kind=_native.COPY_D2H) or 0) if n else 0)
    return crcs


_MAX_CRC = 0xFFFFFFFF  # the widest a CRC is written in JSON: the slot is sized with it
_LENGTH = 8  # bytes of the description's length, at the end of the slot


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


def _unique_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """The description of the unique part: its Shards; no plain values or training state (every rank's own
    snapshot has those)."""
    return {**meta, "tensors": [t for t in meta["tensors"] if t["offset"] is not None], "values": [],
            "training_state": None}


def _reserve_slot(meta: dict[str, Any], at: int) -> int:
    """Marks the unique part's end at `at` and reserves room after it for its description, as long as it can be
    once the CRCs are known: the part then travels from the snapshot's own buffer (`wire_view`)."""
    widest = [{**t, "crcs": [_MAX_CRC] * max(1, -(-t["nbytes"] // PIECE))} for t in meta["tensors"]]
    text = json.dumps({**_unique_meta({**meta, "tensors": widest}), "unique_end": at, "slot": 1 << 62},
                      separators=(",", ":"))
    meta["unique_end"], meta["slot"] = at, _aligned(len(text) + _LENGTH)
    return at + meta["slot"]


def wire_view(snapshot: Snapshot) -> np.ndarray:
    """What travels of a sealed snapshot, a view of its own buffer: [unique part][its description, padded with
    spaces][the description's length, 8 bytes]. The unique part stays at offset 0, aligned, in the buffer that
    receives it."""
    start, slot = snapshot.unique_end, snapshot.meta["slot"]
    text = json.dumps(_unique_meta(snapshot.meta), separators=(",", ":")).encode()
    if len(text) > slot - _LENGTH:
        raise errors.SnapshotError(f"a snapshot's description ({len(text)} bytes) outgrew its slot ({slot})")
    wire = snapshot.payload[:start + slot]
    wire[start:start + slot - _LENGTH] = np.frombuffer(text.ljust(slot - _LENGTH), np.uint8)  # JSON allows spaces
    wire[-_LENGTH:] = np.frombuffer((slot - _LENGTH).to_bytes(_LENGTH, "little"), np.uint8)
    return wire


def seal(snapshot: Snapshot) -> None:
    """Fills in the CRCs of the host arrays (the background thread's first job; a CUDA tensor's came with its
    copy)."""
    ranges, owners = [], []
    for t in snapshot.meta["tensors"]:
        if t["crcs"]:
            continue
        pieces = max(1, -(-t["nbytes"] // PIECE))
        for i in range(pieces):
            ranges.append((t["at"] + i * PIECE, max(0, min(PIECE, t["nbytes"] - i * PIECE))))
            owners.append(t)
    crcs = _native.crc32c_ranges(snapshot.payload, ranges) if ranges else []
    for t, crc in zip(owners, crcs, strict=True):
        t["crcs"].append(int(crc))


def replicated_digest(snapshot: Snapshot) -> int:
    """One CRC32C over the CRCs of the replicated arrays: equal on every rank whose replicas agree."""
    crcs = [c for t in snapshot.meta["tensors"] if t["offset"] is None for c in t["crcs"]]
    return _native.crc32c(np.asarray(crcs, dtype=np.uint32)) if crcs else 0


def from_wire(wire: np.ndarray) -> Snapshot:
    """A part as it arrived (`wire_view`'s layout); its payload a view of `wire`."""
    meta_len = int.from_bytes(wire[-8:].tobytes(), "little")
    end = len(wire) - 8 - meta_len
    return Snapshot(json.loads(wire[end:-8].tobytes()), wire[:end])


# -- what a recovery sends: only the boxes each new rank's targets need --

Wanted = list[dict[str, Any]] | None  # [{"path": [..], "box": [offset, shape] | None (whole)}]; None: everything


def wanted_boxes(obj: Any) -> Wanted:
    """What a restore into `obj` needs of each tensor, as JSON (it is allgathered): each target's box of its
    tensor (a plain array: the whole, of whatever shape the snapshot has, so a restore still compares shapes).
    None for a target without Shards, which is filled whole from everything."""
    targets = state_lib.restore_targets(obj)
    if targets is None:
        return None
    return [{"path": list(need.path),
             "box": None if need.box is None else [list(need.box.offset), list(need.box.shape)]}
            for need in targets.needs]


@dataclasses.dataclass(frozen=True)
class Cut:
    """The boxes of one part one new rank needs: (the part's tensor, the box it holds, the box cut), and whether
    it brings the part's plain values and training state (the whole part's, which also gives the replicated
    arrays)."""

    part: Snapshot
    boxes: list[tuple[dict[str, Any], chunks.Box, chunks.Box]]
    whole: bool


def cut(part: Snapshot, wanted: Wanted, *, whole: bool) -> Cut:
    """The boxes of `part` a rank wanting `wanted` needs: of its Shards, where they meet the wanted boxes; of its
    replicated arrays only when it is the `whole` part (every other rank's are the same, and a copy has none)."""
    boxes = []
    for t in part.meta["tensors"]:
        if t["offset"] is None and not whole:
            continue
        have = chunks.Box(tuple(t["offset"] or [0] * len(t["shape"])), tuple(t["local"]))
        if wanted is None:
            boxes.append((t, have, have))
            continue
        for w in wanted:
            if w["path"] != t["path"]:
                continue
            want = chunks.Box.whole(tuple(t["shape"])) if w["box"] is None else chunks.Box(*map(tuple, w["box"]))
            common = chunks.intersect(have, want) if have.volume else None
            if common is not None:
                boxes.append((t, have, common))
            elif not want.volume and whole:  # an empty box (a shard of no rows) meets no part's, but apply
                boxes.append((t, have, chunks.Box(have.offset, (0,) * len(have.shape))))  # needs shape, dtype
    return Cut(part, boxes, whole)


def _piece_meta(c: Cut, at: int, crcs: list[list[int]] | None) -> tuple[dict[str, Any], int]:
    """The description of a cut as a snapshot of its own, its tensors laid out from `at` (`crcs`: each box's, or
    the widest a CRC is written, to size the description before they are known)."""
    tensors = []
    for i, (t, _, box) in enumerate(c.boxes):
        nbytes = box.volume * format.numpy_dtype(t["dtype"]).itemsize
        widest = [_MAX_CRC] * max(1, -(-nbytes // PIECE))
        tensors.append({"path": t["path"], "dtype": t["dtype"], "local": list(box.shape), "shape": t["shape"],
                        "offset": None if t["offset"] is None else list(box.offset), "at": at, "nbytes": nbytes,
                        "crcs": widest if crcs is None else crcs[i]})
        at += _aligned(nbytes)
    meta = {**{k: c.part.meta[k] for k in ("instance", "generation", "step", "rank", "world", "kind")},
            "tensors": tensors, "values": c.part.meta["values"] if c.whole else [],
            "training_state": c.part.meta.get("training_state") if c.whole else None, "unique_end": 0, "slot": 0}
    return meta, at


def bundle_bytes(cuts: list[Cut]) -> int:
    """The size of `bundle(cuts)`, known before a byte is copied: every rank learns what it will receive."""
    if not cuts:
        return 0
    metas, at = [], 0
    for c in cuts:
        meta, at = _piece_meta(c, at, None)
        metas.append(meta)
    return at + len(json.dumps(metas, separators=(",", ":"))) + _LENGTH


def bundle(cuts: list[Cut], into: np.ndarray) -> np.ndarray:
    """The boxes of `cuts` copied into `into` (bundle_bytes long), their CRCs, and their descriptions padded to
    the size bundle_bytes counted: [boxes][descriptions][their length, 8 bytes]; `unbundle` reads it. The parts
    were checked against their CRCs when listed; each box gets CRCs of its own, checked where it arrives."""
    if not cuts:
        return into[:0]
    metas, at = [], 0
    for c in cuts:
        meta, end = _piece_meta(c, at, None)
        for (t, have, box), placed in zip(c.boxes, meta["tensors"], strict=True):
            dtype = format.numpy_dtype(t["dtype"])
            source = c.part.payload[t["at"]:t["at"] + t["nbytes"]].view(dtype).reshape(t["local"])
            out = into[placed["at"]:placed["at"] + placed["nbytes"]].view(dtype).reshape(box.shape)
            np.copyto(out, source[box.slices(have.offset)])
            ranges = [(placed["at"] + i * PIECE, max(0, min(PIECE, placed["nbytes"] - i * PIECE)))
                      for i in range(len(placed["crcs"]))]
            placed["crcs"] = [int(x) for x in _native.crc32c_ranges(into, ranges)]
        metas.append(meta)
        at = end
    text = json.dumps(metas, separators=(",", ":")).encode()
    slot = len(into) - at - _LENGTH
    if len(text) > slot:
        raise errors.SnapshotError(f"a recovery bundle's description ({len(text)} bytes) outgrew its slot ({slot})")
    into[at:at + slot] = np.frombuffer(text.ljust(slot), np.uint8)
    into[-_LENGTH:] = np.frombuffer(slot.to_bytes(_LENGTH, "little"), np.uint8)
    return into


def unbundle(wire: np.ndarray) -> list[Snapshot]:
    """The pieces of a bundle, one per part it brings, each a view of `wire` (`problems()` checks their CRCs)."""
    if not len(wire):
        return []
    meta_len = int.from_bytes(wire[-_LENGTH:].tobytes(), "little")
    end = len(wire) - _LENGTH - meta_len
    return [Snapshot(meta, wire[:end]) for meta in json.loads(wire[end:-_LENGTH].tobytes())]
