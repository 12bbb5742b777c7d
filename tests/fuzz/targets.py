"""The fuzz targets: one per boundary where SneppX reads bytes someone else wrote (docs/TESTING.md, "Fuzzing").

Each target takes the fuzzer's bytes and calls the code a user's process would run on them. What it may raise is
listed with it (`raises`): the boundary's typed refusal. Anything else, a hang past the per-input time limit, or
memory past `memory_factor` x the input's size (plus a fixed allowance) is a finding: run.py checks all three.

Checksums and MACs stop a coverage-guided fuzzer cold (one flipped bit, and every input dies at the check), so
where a boundary has one the first input byte chooses: odd, the harness recomputes it over the mutated bytes (the
fuzzer explores what lies behind it); even, the bytes go in as they are (the check itself is fuzzed). Signed
updates are re-signed with the harness's own trusted key the same way.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ed25519

from SneppX_ALG import _fs, _native, errors, storage
from SneppX_ALG.checkpoint import convert, file, format, signing, updates, validate
from SneppX_ALG.checkpoint import manifest as manifest_codec
from SneppX_ALG.contract import job_object, record
from SneppX_ALG.elastic import control, rendezvous, wire
from sneppx_operator.errors import JobSpecError


@dataclass(frozen=True)
class Target:
    check: Callable[[bytes], None]
    raises: tuple[type[BaseException], ...]
    memory_factor: int = 32  # bytes of Python memory per input byte at most, plus memory_fixed
    max_len: int = 4096
    memory_fixed: int = 4 << 20  # interpreter noise, caches filled on first use, a file's 4 KiB header block
    corpus: str = ""  # the seed folder under corpus/, when not the target's own name


TARGETS: dict[str, Target] = {}


def target(*raises: type[BaseException], memory_factor: int = 32, max_len: int = 4096,
           memory_fixed: int = 4 << 20, corpus: str = "") -> Callable[..., Any]:
    def register(check: Callable[[bytes], None]) -> Callable[[bytes], None]:
        TARGETS[check.__name__] = Target(check, raises, memory_factor, max_len, memory_fixed,
                                         corpus or check.__name__)
        return check
    return register


_WORKDIR = tempfile.mkdtemp(prefix="sneppx-fuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
# Fixed keys, so that the committed seeds (make_corpus.py) verify: a signed update's, and the heartbeat MAC's.
HARNESS_KEY = ed25519.Ed25519PrivateKey.from_private_bytes(b"sneppx-fuzz-harness-signing-key!")
HB_KEY = bytes(range(32))
HB_JOB_TAG = bytes(range(0xA0, 0xB0))  # the C target's monitors' job (native/fuzz_heartbeat.c)


def _as_file(data: bytes, name: str = "input.snpx") -> str:
    path = os.path.join(_WORKDIR, name)
    with open(path, "wb") as f:
        f.write(data)
    return path


def fix_checksums(data: bytes, *, resign: bool = False) -> bytes:
    """An SNPX file's header CRC, table CRC and signature block CRC recomputed over the mutated bytes (and with
    `resign`, the table signed again by the harness's key), where the header's fields leave room for them."""
    if len(data) < format.HEADER_SIZE or not data.startswith(format.MAGIC):
        return data
    fields = list(format._HEADER.unpack_from(data))
    table_offset, table_length, sig_length = fields[5], fields[6], fields[8]
    out = bytearray(data)
    table_end = table_offset + table_length
    if table_length and table_end <= len(out):
        table = bytes(out[table_offset:table_end])
        fields[7] = _native.crc32c(table)
        if resign:
            block = signing.signature_block(table, HARNESS_KEY)
            out[table_end:table_end + sig_length] = block
            fields[8], sig_length = len(block), len(block)
            fields[4] = len(out)
        if sig_length and table_end + sig_length <= len(out):
            fields[10] = _native.crc32c(bytes(out[table_end:table_end + sig_length]))
    header = format._HEADER.pack(*fields)
    out[:format.HEADER_SIZE] = header[:60] + struct.pack("<I", _native.crc32c(header[:60]))
    return bytes(out)


def _snpx(data: bytes, *, resign: bool = False) -> bytes:
    """The input, its first byte choosing whether its checksums are fixed (odd) or kept (even)."""
    if not data:
        return data
    return fix_checksums(data[1:], resign=resign) if data[0] & 1 else data[1:]


# ---- checkpoint files -------------------------------------------------------------------------------------------


@target(errors.CheckpointFormatError, max_len=1 << 16, corpus="snpx")
def snpx_parse(data: bytes) -> None:
    """The header and table decoders on a file's bytes in memory."""
    raw = _snpx(data)
    header = format.decode_header(raw[:format.HEADER_SIZE], actual_size=len(raw))
    table = raw[header.table_offset:header.table_offset + header.table_length]
    decoded = format.decode_table(table, header)
    format.encode_table(decoded)  # what was read can be written again


@target(max_len=1 << 16, corpus="snpx")
def snpx_validate(data: bytes) -> None:
    """validate_checkpoint never raises for a bad file: it reports."""
    ok, problems = validate.validate_checkpoint(_as_file(_snpx(data)))
    assert isinstance(ok, bool) and ok == (not problems) and all(isinstance(p, str) for p in problems)


@target(errors.CheckpointFormatError, max_len=1 << 16, corpus="snpx")
def snpx_read(data: bytes) -> None:
    """CheckpointReader (verifying CRCs) reading every tensor."""
    with file.CheckpointReader(_as_file(_snpx(data))) as reader:
        for name in reader.names():
            reader.read(name)


@target(errors.CheckpointFormatError, errors.UpdateRejectedError, max_len=1 << 16)
def signed_update(data: bytes) -> None:
    """SignedUpdateManager.install_update on a file: odd first byte, signed again by the trusted key (so the
    fuzzer reaches the digests and the version policy behind the signature)."""
    raw = _snpx(data, resign=True)
    manager = updates.SignedUpdateManager([HARNESS_KEY.public_key()], os.path.join(_WORKDIR, "installed"))
    manager.install_update(_as_file(raw, "update.snpx"), force=True)


@target(errors.SneppXError, max_len=1 << 16)
def safetensors_convert(data: bytes) -> None:
    """convert.to_snpx on a safetensors file (its 8-byte length, JSON header and data)."""
    src = _as_file(data, "input.safetensors")
    dst = os.path.join(_WORKDIR, "converted.snpx")
    try:
        convert.to_snpx(src, dst)
    finally:
        _fs.unlink_quietly(dst)


# ---- a coordinator step: manifest and commit marker ------------------------------------------------------------


@target(errors.ManifestError, max_len=1 << 16)
def step_manifest(data: bytes) -> None:
    """A step's manifest.json: odd first byte, its checksum recomputed and its bytes made canonical again when
    it parses (so the fuzzer explores the schema checks, which come first, and what follows the checksum)."""
    raw = data[1:]
    if data[:1] and data[0] & 1:
        try:
            doc = json.loads(raw)
            if isinstance(doc, dict):
                raw = manifest_codec.encode_manifest(doc)
        except (ValueError, RecursionError, TypeError, errors.ManifestError):
            pass
    manifest_codec.decode_manifest(raw, step=7, where="fuzz/manifest.json")


@target(max_len=1 << 14)
def commit_marker(data: bytes) -> None:
    """A COMMITTED marker against a manifest: the first two bytes split the input between them. Never raises."""
    split = int.from_bytes(data[:2].ljust(2, b"\0"), "little") % (len(data) + 1)
    marker, manifest = data[2:2 + split], data[2 + split:]
    problem = storage.marker_problem(marker, manifest, 7)
    assert problem is None or isinstance(problem, str)


# ---- the runtime's wire formats --------------------------------------------------------------------------------


@target(ValueError, max_len=2048)
def heartbeat_datagram(data: bytes) -> None:
    """wire.decode, the Python reading of a heartbeat datagram (the C one is native/fuzz_heartbeat.c): odd first
    byte, the MAC is recomputed so the fields behind it are reached."""
    raw = data[1:]
    if data[:1] and data[0] & 1 and len(raw) >= wire.MAC_BYTES:
        raw = raw[:-wire.MAC_BYTES] + wire.mac(HB_KEY, raw[:-wire.MAC_BYTES])
    wire.decode(raw, HB_KEY)


@target(control.ChannelClosed, max_len=1 << 17)
def control_channel(data: bytes) -> None:
    """What an agent reads from a worker's end of the control socket, in one or more pieces."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        channel = control.Channel(ours)
        theirs.sendall(data)
        theirs.shutdown(socket.SHUT_WR)
        while True:
            for message in channel.receive(timeout=5):
                assert isinstance(message, dict) and isinstance(message["kind"], str)


@target(errors.SneppXError, max_len=1 << 16)
def rendezvous_record(data: bytes) -> None:
    """A record's bytes as the rendezvous and the operator read them (directory, S3 and ConfigMap stores all
    hand record.decode the same bytes): decoded, then read as a join, a membership and the operator's
    control, report and hung records, each refusing with its typed error."""
    value = record.decode("fuzz/key", data)
    parsers: list[Callable[[], Any]] = [
        lambda: rendezvous.parse_join(value, key="k", run_id="run", generation=3, agent_id="a-0"),
        lambda: rendezvous.parse_membership(value, key="k", run_id="run", generation=3),
        lambda: job_object.parse_control(value),
        lambda: job_object.parse_report(value),
        lambda: job_object.parse_hung(value, job_object.hung_key("pod-0")),
    ]
    for parse in parsers:
        try:
            parse()
        except errors.SneppXError:
            pass


@target(max_len=1 << 16)
def configmap_view(data: bytes) -> None:
    """The operator's reading of the job object's `data` (a ConfigMap's string map, as JSON): never raises."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        return
    if isinstance(body, dict) and all(isinstance(v, str) for v in body.values()):
        view = job_object.read_view(body)
        assert all(isinstance(p, str) for p in view.problems)


# ---- the operator: a job's spec ----------------------------------------------------------------------------------


@target(JobSpecError, memory_factor=0, max_len=1024, memory_fixed=64 << 20)
def job_spec(data: bytes) -> None:
    """A schema-shaped ElasticTrainingJob spec (every value the CRD's openAPIV3Schema admits, chosen by the
    input: the API server refuses the rest) through the operator's planning, as a first pass would run it. Its
    memory is bounded by the schema, not the input: maxNodes is at most 1,024, and a first pass builds a pod
    body (~14 KB) for each."""
    from spec_shapes import plan_first_pass, spec_from_bytes

    plan_first_pass(spec_from_bytes(data), now=datetime.datetime(2026, 12, 5, tzinfo=datetime.UTC))
