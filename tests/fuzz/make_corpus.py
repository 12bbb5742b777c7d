"""Writes the seed corpora (tests/fuzz/corpus/<target>/): real, small inputs for every target, made by SneppX's own
writers, plus the hostile files of tests/attacks that are small. Run it again after a format change:

    python tests/fuzz/make_corpus.py

Inputs of targets that recompute checksums start with the mode byte (targets.py): 1 (fixed) for the real
files, 0 (as they are) for the hostile ones. The three SNPX file targets share one folder. The files are committed;
their total stays under 1 MB.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import struct
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import targets

from SneppX_ALG import checkpoint, storage
from SneppX_ALG.checkpoint import updates
from SneppX_ALG.contract import job_object
from SneppX_ALG.coordinator import CheckpointCoordinator
from SneppX_ALG.elastic import rendezvous, wire

HERE = pathlib.Path(__file__).resolve().parent
CORPUS = HERE / "corpus"
ATTACKS = HERE.parent / "attacks"
MAX_SEED = 16 << 10


def put(target: str, name: str, data: bytes) -> None:
    folder = CORPUS / target
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data)


def snpx_files(work: pathlib.Path) -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    plain = work / "plain.snpx"
    with checkpoint.CheckpointWriter(plain, metadata={"note": "seed"}, config={"layers": 2, "dims": [4, 8]}) as w:
        w.write("embed", rng.standard_normal((4, 8)).astype(np.float32))
        w.write("bias", np.arange(3, dtype=np.int64))
        w.write("shard", np.ones(2, np.float16), global_shape=(6,), global_offset=(2,))
        w.write("empty", np.zeros(0, np.uint8))
    signed = work / "signed.snpx"
    with checkpoint.CheckpointWriter(signed, metadata={updates.VERSION_KEY: "2.1"}, config=None,
                                     signing_key=targets.HARNESS_KEY) as w:
        w.write("w", rng.standard_normal(5).astype(np.float32))
    return {"plain": plain.read_bytes(), "signed": signed.read_bytes()}


def incremental_manifest(root: pathlib.Path) -> bytes:
    """Step 7 of a chain (manifest version 4): "w" unchanged since step 6, referenced there."""
    with CheckpointCoordinator(str(root), async_save=False, incremental=True) as coordinator:
        for step in (6, 7):
            coordinator.save({"w": np.arange(6, dtype=np.float32).reshape(2, 3), "t": np.full(3, step)}, step)
    return (root / storage.step_name(7) / storage.MANIFEST).read_bytes()


def main() -> None:
    shutil.rmtree(CORPUS, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        files = snpx_files(work)
        hostile = {p.stem: p.read_bytes() for p in sorted(ATTACKS.glob("*.snpx")) if p.stat().st_size <= MAX_SEED}
        for name, data in files.items():  # shared by snpx_parse, snpx_validate and snpx_read
            put("snpx", name, b"\x01" + data)
        for name, data in hostile.items():  # as they are: the fuzzer flips the mode byte itself
            put("snpx", f"attack-{name}", b"\x00" + data)
        put("signed_update", "signed", b"\x00" + files["signed"])
        put("signed_update", "resigned", b"\x01" + files["plain"])

        # a safetensors file: 8-byte header length, JSON header, data
        header = json.dumps({"__metadata__": {"format": "pt"},
                             "w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
                             "b": {"dtype": "BF16", "shape": [3], "data_offsets": [16, 22]}}).encode()
        put("safetensors_convert", "two", struct.pack("<Q", len(header)) + header + bytes(range(22)))

        # a coordinator step: manifest.json and its COMMITTED record
        root = work / "ckpt"
        with CheckpointCoordinator(str(root), async_save=False) as coordinator:
            coordinator.save({"w": np.arange(6, dtype=np.float32).reshape(2, 3), "lr": 0.5}, 7,
                             training_state={"data_position": 12, "rng": [1, 2]})
        step = next(p for p in root.iterdir() if storage.parse_step_name(p.name) is not None)
        manifest = (step / storage.MANIFEST).read_bytes()
        put("step_manifest", "step", b"\x01" + manifest)
        marker = storage.commit_record(7, "writer-1", manifest)
        put("commit_marker", "record", len(marker).to_bytes(2, "little") + marker + manifest)
        put("step_manifest", "incremental", b"\x01" + incremental_manifest(work / "chain"))

        # heartbeat datagrams, MAC fixed by the harness; the C target's monitors (native/fuzz_heartbeat.c) know
        # members 127.0.0.1:9, :13 and :17, and bit 1 of the mode byte picks its gossip-mode monitor
        loopback = 0x7F000001
        for kind, entries in ((1, ()), (2, ((loopback << 16 | 9, 3, 1),)),
                              (3, ((loopback << 16 | 9, 1, 2), (loopback << 16 | 17, 2, 3)))):
            datagram = wire.Datagram(kind, targets.HB_JOB_TAG, 7, 2, 11, target=loopback << 16 | 9,
                                     entries=entries)
            raw = wire.encode(datagram, targets.HB_KEY)
            put("heartbeat_datagram", f"type{kind}", b"\x01" + raw)
            put("c_heartbeat", f"type{kind}-direct", b"\x01" + raw)
            put("c_heartbeat", f"type{kind}-gossip", b"\x03" + raw)

        # the ring's frames as rank 0 of 3 receives them in native/fuzz_comm.c (12 floats, 8-byte frames: 4 steps
        # of 2 frames), then a notice naming rank 2, and one on the right-hand socket (mode bit 0)
        frame = struct.Struct("<IBBHQQII")
        frames = b"".join(frame.pack(0x31435853, 1, 0, 0, 5, 1, step, 8) + bytes(8)
                          for step in range(4) for _ in range(2))
        notice = frame.pack(0x31435853, 0x7F, 15, 0, 5, 1, 2, 0)
        put("c_comm", "frames", b"\x00" + frames)
        put("c_comm", "notice-left", b"\x00" + frames[:80] + notice)
        put("c_comm", "notice-right", b"\x01" + notice)

        lines = [{"kind": "ready", "rank": 0, "pid": 123}, {"kind": "step", "step": 5, "loss": 1.5},
                 {"kind": "failed", "error": "PeerLostError", "detail": "x" * 40}]
        put("control_channel", "lines", b"".join(json.dumps(m).encode() + b"\n" for m in lines))

        member = rendezvous.Member("a-0", "inc-1", "10.0.0.1", "10.0.0.1:7000", 2, 12.5)
        records = {
            "join": rendezvous.join_to_json("run", 3, rendezvous.Join(member, frozenset({"a-1"})), renewals=1),
            "membership": rendezvous.membership_to_json(rendezvous.Membership("run", 3, (member,), "a-0")),
            "control": job_object.control_to_json(job_object.Control(False, "", 1, 4, 2, 300)),
            "hung": job_object.hung_to_json(job_object.HungRank("pod-0", 1, 2, "pod-1", 31.5,
                                                                "2026-12-05T00:00:00Z")),
        }
        for name, value in records.items():
            put("rendezvous_record", name, json.dumps(value, sort_keys=True).encode())
        put("c_json_scan", "manifest", manifest)
        put("c_json_scan", "record", json.dumps(records["membership"]).encode())
        view = {job_object.data_key(job_object.CONTROL_KEY): json.dumps(records["control"]),
                job_object.data_key(job_object.hung_key("pod-0")): json.dumps(records["hung"])}
        put("configmap_view", "view", json.dumps(view).encode())
        # the operator's spec target reads its choices from bytes: all zeros is the first finding's input (a
        # storage with neither pvc nor s3 crashed the first pass with KeyError), the others spread the choices
        rng = np.random.default_rng(1)
        put("job_spec", "zeros", bytes(64))
        for i in range(4):
            put("job_spec", f"random-{i}", rng.integers(0, 256, 96, dtype=np.uint8).tobytes())
    total = sum(p.stat().st_size for p in CORPUS.rglob("*") if p.is_file())
    print(f"wrote {sum(1 for p in CORPUS.rglob('*') if p.is_file())} seeds, {total} bytes, under {CORPUS}")


if __name__ == "__main__":
    main()
