"""Attacks on signed checkpoints and on SignedUpdateManager: each one rejected with the typed error of the
check that caught it, and the installed version unchanged.

Two kinds of attacker: one who changes bytes (caught by CRC32C, layout and padding checks, like an accident),
and one with a hex editor who also recomputes every CRC32C (caught only by the signature and the digests).
The hostile files are made in each test from a fresh key pair, so no private key is committed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import tracemalloc

import numpy as np
import pytest

from SneppX_ALG import _native, checkpoint, errors
from SneppX_ALG.checkpoint import format, signing, updates, verify

NOW = 1_800_000_000.0  # 2027-01-15, a fixed clock


def make_update(path: pathlib.Path, key, version: str = "2", *, expires: str | None = None, seed: int = 0,
                metadata: dict[str, str] | None = None) -> pathlib.Path:
    meta = {updates.VERSION_KEY: version, **(metadata or {})}
    if expires:
        meta[updates.EXPIRES_KEY] = expires
    rng = np.random.default_rng(seed)
    with checkpoint.CheckpointWriter(path, metadata=meta, config={"layers": 2}, signing_key=key) as w:
        w.write("embed", rng.standard_normal((5, 20)).astype(np.float32))
        w.write("bias", rng.standard_normal(7).astype(np.float64))
    return path


@pytest.fixture
def trusted():
    return signing.generate_keypair()


@pytest.fixture
def manager(tmp_path: pathlib.Path, trusted) -> updates.SignedUpdateManager:
    m = updates.SignedUpdateManager([trusted[1]], tmp_path / "installed", clock=lambda: NOW)
    m.install_update(make_update(tmp_path / "v1.snpx", trusted[0], "1", seed=1))
    return m


def assert_refused(manager: updates.SignedUpdateManager, path: pathlib.Path, error: type, match: str,
                   **kwargs) -> None:
    """install_update raises exactly `error`, the message names the check, and nothing changed."""
    before = manager.current()
    files = sorted(os.listdir(os.path.join(manager.install_dir, updates.VERSIONS_DIR)))
    with pytest.raises(errors.SneppXError) as caught:
        manager.install_update(path, **kwargs)
    assert type(caught.value) is error, f"expected {error.__name__}, got {caught.value!r}"
    assert match.lower() in str(caught.value).lower(), str(caught.value)
    if isinstance(caught.value, errors.CheckpointFormatError):  # names the update, not an internal copy
        assert caught.value.path == str(path), caught.value.path
    assert manager.current() == before and before is not None and before.version == "1"
    assert sorted(os.listdir(os.path.join(manager.install_dir, updates.VERSIONS_DIR))) == files
    assert verify.verify_checkpoint(before.path, manager.trusted_keys) == (True, [])


# --- what an attacker with a hex editor does -----------------------------------------------------------


def parts(path: pathlib.Path) -> tuple[format.Header, format.Table, bytes, bytes, bytes]:
    """(header, table, data section incl. header block, table bytes, signature block)."""
    with checkpoint.CheckpointReader(path, verify=False) as r:
        data = bytes(r._mmap[:r.header.table_offset])
        return r.header, r.table, data, r.table_bytes, r.signature_block


def reassemble(path: pathlib.Path, data: bytes, table_bytes: bytes, block: bytes) -> None:
    """Writes a file from parts with every CRC32C recomputed and a consistent header."""
    table_offset = len(data)
    header = format.Header(
        file_size=table_offset + len(table_bytes) + len(block), table_offset=table_offset,
        table_length=len(table_bytes), table_crc32c=_native.crc32c(table_bytes), signature_length=len(block),
        signature_crc32c=_native.crc32c(block) if block else 0)
    path.write_bytes(format.encode_header(header) + data[format.HEADER_SIZE:] + table_bytes + block)


def edit_table(path: pathlib.Path, out: pathlib.Path, change) -> None:
    _, table, data, _, block = parts(path)
    doc = {"tensors": [t.to_json() for t in table.tensors], "metadata": dict(table.metadata),
           "config": table.config}
    change(doc)
    table_bytes = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    reassemble(out, data, table_bytes, block)


def forge_crc32c(buf: bytearray, window: int, target: int) -> None:
    """Rewrites buf[window:window+4] so that crc32c(buf) == target.

    CRC32C is affine over GF(2), so the 4 window bytes that give any CRC solve a 32x32 linear system:
    the reason a CRC proves nothing against an attacker.
    """
    def crc_with(value: int) -> int:
        buf[window:window + 4] = value.to_bytes(4, "little")
        return _native.crc32c(bytes(buf))

    base = crc_with(0)
    basis: dict[int, tuple[int, int]] = {}  # pivot bit -> (crc difference, window bits that make it)
    for bit in range(32):
        vec, combo = crc_with(1 << bit) ^ base, 1 << bit
        for pivot in range(31, -1, -1):
            if vec >> pivot & 1:
                if pivot not in basis:
                    basis[pivot] = (vec, combo)
                    break
                vec, combo = vec ^ basis[pivot][0], combo ^ basis[pivot][1]
    want, window_value = target ^ base, 0
    for pivot in range(31, -1, -1):
        if want >> pivot & 1:
            want ^= basis[pivot][0]
            window_value ^= basis[pivot][1]
    crc_with(window_value)


def change_data_keeping_crc(path: pathlib.Path, out: pathlib.Path) -> None:
    """Changes a weight of tensor 0 and 4 more of its bytes so that its CRC32C still matches."""
    _, table, data, table_bytes, block = parts(path)
    entry = table.tensors[0]
    original = data[entry.offset:entry.offset + entry.length]
    tensor = bytearray(original)
    tensor[0] ^= 0x40
    forge_crc32c(tensor, len(tensor) - 4, _native.crc32c(original))
    assert _native.crc32c(bytes(tensor)) == entry.crc32c and bytes(tensor) != original
    data = data[:entry.offset] + bytes(tensor) + data[entry.offset + entry.length:]
    reassemble(out, data, table_bytes, block)


# --- any single byte changed -------------------------------------------------------------------------------


def regions(path: pathlib.Path) -> dict[str, range]:
    header, table, _, _, _ = parts(path)
    out = {"header": range(64), "header padding": range(64, format.DATA_OFFSET)}
    for t in table.tensors:
        out[f"data of {t.name}"] = range(t.offset, t.offset + t.length)
        out[f"padding after {t.name}"] = range(t.offset + t.length, format.align_up(t.offset + t.length))
    out["table"] = range(header.table_offset, header.table_offset + header.table_length)
    out["signature"] = range(header.table_offset + header.table_length, header.file_size)
    return out


EXPECTED_BY_REGION = {
    "header": (errors.BadMagicError, errors.UnsupportedVersionError, errors.CorruptHeaderError),
    "header padding": (errors.NonZeroPaddingError,),
    "data": (errors.ChecksumMismatchError,),
    "padding": (errors.NonZeroPaddingError,),
    "table": (errors.CorruptTableError,),
    "signature": (errors.ChecksumMismatchError,),
}


def test_every_single_byte_change_is_rejected_by_the_check_for_its_region(tmp_path: pathlib.Path, trusted) -> None:
    path = make_update(tmp_path / "v2.snpx", trusted[0])
    keys = signing.trusted_key_set([trusted[1]])
    size = path.stat().st_size
    fd = os.open(path, os.O_RDWR)
    try:
        for region, positions in regions(path).items():
            allowed = EXPECTED_BY_REGION[region.split(" of ")[0].split(" after ")[0]]
            for pos in positions:
                original = os.pread(fd, 1, pos)
                os.pwrite(fd, bytes([original[0] ^ 0xA5]), pos)
                try:
                    verify.check_checkpoint(path, keys)
                except errors.CheckpointFormatError as e:
                    assert isinstance(e, allowed), f"byte {pos} ({region}): {e!r}"
                else:
                    pytest.fail(f"changing byte {pos} of {size} ({region}) went unnoticed")
                finally:
                    os.pwrite(fd, original, pos)
    finally:
        os.close(fd)
    assert verify.verify_checkpoint(path, keys) == (True, [])


@pytest.mark.parametrize("region, error, match", [
    ("header", errors.CorruptHeaderError, "header CRC32C"),
    ("header padding", errors.NonZeroPaddingError, "header padding"),
    ("data of embed", errors.ChecksumMismatchError, "CRC32C"),
    ("padding after bias", errors.NonZeroPaddingError, "padding after tensor 'bias'"),
    ("table", errors.CorruptTableError, "table CRC32C"),
    ("signature", errors.ChecksumMismatchError, "signature block"),
])
def test_install_refuses_a_changed_byte_in_each_region(tmp_path: pathlib.Path, trusted, manager, region: str,
                                                       error: type, match: str) -> None:
    path = make_update(tmp_path / "v2.snpx", trusted[0])
    raw = bytearray(path.read_bytes())
    rng = regions(path)[region]
    raw[rng[len(rng) // 2] if region != "header" else 40] ^= 0x01
    path.write_bytes(raw)
    assert_refused(manager, path, error, match)


# --- the attacker recomputes every CRC32C ------------------------------------------------------------------


def test_bumped_signed_version_breaks_the_signature(tmp_path: pathlib.Path, trusted, manager) -> None:
    old = make_update(tmp_path / "v0.snpx", trusted[0], "0")
    forged = tmp_path / "forged.snpx"
    edit_table(old, forged, lambda doc: doc["metadata"].update({updates.VERSION_KEY: "99"}))
    assert checkpoint.validate_checkpoint(forged) == (True, [])  # every CRC is right...
    assert_refused(manager, forged, errors.BadSignatureError, "signature")  # ...the signature is not


def test_changed_config_breaks_the_signature(tmp_path: pathlib.Path, trusted, manager) -> None:
    forged = tmp_path / "forged.snpx"
    edit_table(make_update(tmp_path / "v2.snpx", trusted[0]), forged, lambda doc: doc.update(config={"layers": 3}))
    assert_refused(manager, forged, errors.BadSignatureError, "does not verify")


def test_changed_weights_with_recomputed_crc_and_digest_break_the_signature(tmp_path: pathlib.Path, trusted,
                                                                            manager) -> None:
    path = make_update(tmp_path / "v2.snpx", trusted[0])
    _, table, data, _, block = parts(path)
    entry = table.tensors[1]
    new = bytearray(data[entry.offset:entry.offset + entry.length])
    new[3] ^= 0xFF
    data = data[:entry.offset] + bytes(new) + data[entry.offset + entry.length:]

    def fix(doc):
        doc["tensors"][1]["crc32c"] = _native.crc32c(bytes(new))
        doc["tensors"][1]["digest"] = signing.digest_of(bytes(new))

    forged = tmp_path / "forged.snpx"
    reassemble(forged, data, format.encode_table(table), block)
    edit_table(forged, forged, fix)
    assert checkpoint.validate_checkpoint(forged) == (True, [])
    assert_refused(manager, forged, errors.BadSignatureError, "signature")


def test_crc_preserving_weight_change_is_caught_by_the_digest(tmp_path: pathlib.Path, trusted, manager) -> None:
    forged = tmp_path / "forged.snpx"
    change_data_keeping_crc(make_update(tmp_path / "v2.snpx", trusted[0]), forged)
    assert checkpoint.validate_checkpoint(forged) == (True, [])  # CRC32C alone is fooled
    ok, problems = checkpoint.validate_checkpoint(forged, trusted_keys=[trusted[1]])
    assert not ok and "does not match its signed blake3 digest" in problems[0]
    assert_refused(manager, forged, errors.DigestMismatchError, "digest")


def test_flipped_signature_byte_with_fixed_crc_is_a_bad_signature(tmp_path: pathlib.Path, trusted, manager) -> None:
    path = make_update(tmp_path / "v2.snpx", trusted[0])
    _, _, data, table_bytes, block = parts(path)
    forged_block = bytearray(block)
    forged_block[-10] ^= 0x01
    reassemble(path, data, table_bytes, bytes(forged_block))
    assert_refused(manager, path, errors.BadSignatureError, "does not verify")


def test_key_id_swapped_to_an_unknown_key_is_untrusted(tmp_path: pathlib.Path, trusted, manager) -> None:
    path = make_update(tmp_path / "v2.snpx", trusted[0])
    _, _, data, table_bytes, block = parts(path)
    entry = signing.decode_block(block)[0]
    reassemble(path, data, table_bytes, signing.encode_block([signing.SignatureEntry(1, b"\x07" * 32,
                                                                                     entry.signature)]))
    assert_refused(manager, path, errors.UntrustedKeyError, "not among the 1 trusted")


def test_stripped_signature_is_missing(tmp_path: pathlib.Path, trusted, manager) -> None:
    path = make_update(tmp_path / "v2.snpx", trusted[0])
    _, _, data, table_bytes, _ = parts(path)
    reassemble(path, data, table_bytes, b"")
    assert_refused(manager, path, errors.MissingSignatureError, "not signed")


def test_malformed_signature_block_with_fixed_crc_is_a_bad_signature(tmp_path: pathlib.Path, trusted,
                                                                     manager) -> None:
    path = make_update(tmp_path / "v2.snpx", trusted[0])
    _, _, data, table_bytes, block = parts(path)
    reassemble(path, data, table_bytes, block + b"\x00" * 104)
    assert_refused(manager, path, errors.BadSignatureError, "signature block")


def test_trusted_signature_over_a_table_without_digests_is_refused(tmp_path: pathlib.Path, trusted,
                                                                   manager) -> None:
    """A table signed by some other tool without digests would leave the data bytes unsigned."""
    path = make_update(tmp_path / "v2.snpx", trusted[0])
    _, table, data, _, _ = parts(path)
    stripped = format.Table(tuple(dataclasses.replace(t, digest=None) for t in table.tensors),
                            table.metadata, table.config)
    table_bytes = format.encode_table(stripped)
    reassemble(path, data, table_bytes, signing._sign(signing.TABLE_DOMAIN, table_bytes, trusted[0]))
    assert_refused(manager, path, errors.DigestMismatchError, "carries no digest")


# --- a table too costly to parse: the signature is checked over its raw bytes first -------------------------


def forged_block(kind: str, trusted) -> bytes:
    if kind == "unsigned":
        return b""
    kid = signing.key_id(trusted[1] if kind == "trusted key id, forged signature" else signing.generate_keypair()[1])
    return signing.encode_block([signing.SignatureEntry(signing.ALG_ED25519, kid, bytes(64))])


@pytest.mark.parametrize("kind, error, match", [
    ("trusted key id, forged signature", errors.BadSignatureError, "does not verify"),
    ("untrusted key", errors.UntrustedKeyError, "not among"),
    ("unsigned", errors.MissingSignatureError, "not signed"),
])
def test_a_huge_forged_table_is_refused_before_it_is_parsed(tmp_path: pathlib.Path, trusted, manager, monkeypatch,
                                                            kind: str, error: type, match: str) -> None:
    """16 MiB of `{}` entries cost 362 MiB and 8 s to parse before the signature was looked at. The order of
    the checks is asserted (the table is never parsed); the memory bound is a backstop with a wide margin:
    reading the table costs about twice its size, parsing it more than twenty times."""
    entries = (16 << 20) // 3
    table = b'{"tensors":[' + b",".join([b"{}"] * entries) + b'],"metadata":{},"config":null}'
    path = tmp_path / "huge.snpx"
    reassemble(path, bytes(format.DATA_OFFSET), table, forged_block(kind, trusted))
    parsed: list[str | None] = []
    real_decode = format.decode_table

    def spy(raw: bytes, header: format.Header, *, path: str | None = None) -> format.Table:
        parsed.append(path)
        return real_decode(raw, header, path=path)

    monkeypatch.setattr(format, "decode_table", spy)
    tracemalloc.start()
    try:
        assert_refused(manager, path, error, match)
        with pytest.raises(error):
            verify.check_checkpoint(path, manager.trusted_keys)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert str(path) not in parsed, "the forged table was parsed before its signature was checked"
    assert peak < 4 * len(table), f"peak {peak >> 20} MiB for a {len(table) >> 20} MiB table"


# --- who signed, and which checkpoint ---------------------------------------------------------------------


def test_signature_from_an_untrusted_key(tmp_path: pathlib.Path, manager) -> None:
    stranger, _ = signing.generate_keypair()
    assert_refused(manager, make_update(tmp_path / "v2.snpx", stranger), errors.UntrustedKeyError, "trusted key")


def test_valid_signature_moved_from_another_checkpoint(tmp_path: pathlib.Path, trusted, manager) -> None:
    """Mix and match: a genuine signature block by the trusted key, taken from a different checkpoint."""
    genuine = make_update(tmp_path / "genuine.snpx", trusted[0], "3", seed=3)
    target = make_update(tmp_path / "target.snpx", trusted[0], "4", seed=4)
    _, _, _, _, genuine_block = parts(genuine)
    _, _, data, table_bytes, _ = parts(target)
    reassemble(target, data, table_bytes, genuine_block)
    assert_refused(manager, target, errors.BadSignatureError, "belongs to another checkpoint")


def test_genuine_table_and_signature_over_other_weights(tmp_path: pathlib.Path, trusted, manager) -> None:
    """Mix and match the other way: keep a signed table, swap in another checkpoint's data section."""
    a = make_update(tmp_path / "a.snpx", trusted[0], "3", seed=3)
    b = make_update(tmp_path / "b.snpx", trusted[0], "3", seed=4)
    _, _, _, table_bytes, block = parts(a)
    _, _, other_data, _, _ = parts(b)
    reassemble(a, other_data, table_bytes, block)
    assert_refused(manager, a, errors.ChecksumMismatchError, "CRC32C")


def test_manifest_signature_is_not_a_table_signature(tmp_path: pathlib.Path, trusted, manager) -> None:
    """Domain separation: the same key's signature over the same bytes as a manifest doesn't verify as a table."""
    path = make_update(tmp_path / "v2.snpx", trusted[0])
    _, _, data, table_bytes, _ = parts(path)
    reassemble(path, data, table_bytes, signing._sign(signing.MANIFEST_DOMAIN, table_bytes, trusted[0]))
    assert_refused(manager, path, errors.BadSignatureError, "does not verify")


# --- versions and dates -----------------------------------------------------------------------------------


def test_replayed_older_version(tmp_path: pathlib.Path, trusted, manager) -> None:
    assert_refused(manager, make_update(tmp_path / "v0.snpx", trusted[0], "0.9"), errors.RollbackRefusedError,
                   "not newer")


def test_replayed_same_version(tmp_path: pathlib.Path, trusted, manager) -> None:
    assert_refused(manager, make_update(tmp_path / "again.snpx", trusted[0], "1.0", seed=7),
                   errors.RollbackRefusedError, "replay")


def test_expired_update(tmp_path: pathlib.Path, trusted, manager) -> None:
    path = make_update(tmp_path / "v2.snpx", trusted[0], expires="2027-01-14T23:59:59Z")
    assert_refused(manager, path, errors.ExpiredUpdateError, "expired")
    assert_refused(manager, path, errors.ExpiredUpdateError, "expired", force=True)


# --- truncated, appended, unsigned ------------------------------------------------------------------------


@pytest.mark.parametrize("keep", ["all but one byte", "into the table", "into the data", "header only", "nothing"])
def test_truncated_update(tmp_path: pathlib.Path, trusted, manager, keep: str) -> None:
    path = make_update(tmp_path / "v2.snpx", trusted[0])
    header, *_ = parts(path)
    size = {"all but one byte": header.file_size - 1, "into the table": header.table_offset + 5,
            "into the data": format.DATA_OFFSET + 100, "header only": 64, "nothing": 0}[keep]
    os.truncate(path, size)
    assert_refused(manager, path, errors.TruncatedCheckpointError, "truncated" if size > 64 else "bytes")


@pytest.mark.parametrize("extra", [b"\x00", b"#!/bin/sh\nrm -rf /\n", bytes(4096)])
def test_bytes_appended_to_an_update(tmp_path: pathlib.Path, trusted, manager, extra: bytes) -> None:
    path = make_update(tmp_path / "v2.snpx", trusted[0])
    with open(path, "ab") as f:
        f.write(extra)
    assert_refused(manager, path, errors.CorruptHeaderError, "trailing bytes")


def test_unsigned_update_when_a_signature_is_required(tmp_path: pathlib.Path, manager) -> None:
    path = tmp_path / "unsigned.snpx"
    with checkpoint.CheckpointWriter(path, metadata={updates.VERSION_KEY: "2"}) as w:
        w.write("embed", np.zeros(10, np.float32))
    assert checkpoint.validate_checkpoint(path) == (True, [])
    assert_refused(manager, path, errors.MissingSignatureError, "not signed")


def test_not_a_checkpoint_at_all(tmp_path: pathlib.Path, manager) -> None:
    path = tmp_path / "model.pkl"
    path.write_bytes(b"\x80\x04\x95" + b"\x00" * 100)
    assert_refused(manager, path, errors.UnsafeFormatError, "pickle")
    assert_refused(manager, tmp_path / "missing.snpx", errors.CheckpointNotFoundError, "not found")
