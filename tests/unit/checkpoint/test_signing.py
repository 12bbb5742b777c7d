"""checkpoint/signing.py (with digests.py and keys.py) and verify.py: digests, keys, the signature block, signed writes, sign_checkpoint, manifests and the CLI."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import pathlib
import stat
import subprocess
import sys

import blake3
import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import given, settings
from hypothesis import strategies as st

from SneppX_ALG import _native, checkpoint, cli, errors
from SneppX_ALG.checkpoint import digests, format, signing, verify


def write_checkpoint(path: pathlib.Path, key=None, metadata=None, tensors=None) -> pathlib.Path:
    tensors = tensors if tensors is not None else {
        "w": np.arange(3000, dtype=np.float32).reshape(30, 100), "b": np.ones(7, np.int64)}
    with checkpoint.CheckpointWriter(path, metadata=metadata or {"run": "a"}, config={"dim": 4},
                                     signing_key=key) as w:
        for name, value in tensors.items():
            w.write(name, value)
    return path


# --- digests ---------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(data=st.binary(max_size=5000), cuts=st.lists(st.integers(0, 5000), max_size=6))
def test_streaming_digest_equals_one_shot_hash_for_any_split(data: bytes, cuts: list[int]) -> None:
    bounds = sorted({0, len(data), *(min(c, len(data)) for c in cuts)})
    for name, reference in (("blake3", blake3.blake3), ("sha256", hashlib.sha256)):
        d = signing.new_digest(name)
        for a, b in itertools.pairwise(bounds):
            d.update(data[a:b])
        assert d.name == name
        assert d.hexdigest() == reference(data).hexdigest()


def test_large_updates_go_through_the_worker_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(digests, "_INLINE_BYTES", 16)
    rng = np.random.default_rng(1)
    pieces = [rng.integers(0, 256, n, dtype=np.uint8) for n in (5, 100, 3000, 17, 70000, 1, 9000, 20000, 300)]
    d = signing.new_digest()
    for p in pieces:
        d.update(p)
    assert d.hexdigest() == blake3.blake3(b"".join(p.tobytes() for p in pieces)).hexdigest()


def test_digests_work_in_a_forked_child_after_the_parent_used_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(digests, "_INLINE_BYTES", 16)
    data = bytes(range(256)) * 1000
    assert signing.digest_of(data) == "blake3:" + blake3.blake3(data).hexdigest()  # starts the worker
    pid = os.fork()
    if pid == 0:  # child: exit code 0 only if the digest is right
        os._exit(0 if signing.digest_of(data) == "blake3:" + blake3.blake3(data).hexdigest() else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_digest_accepts_typed_arrays_as_their_bytes() -> None:
    a = np.arange(10, dtype=np.float64)
    assert signing.digest_of(a) == "blake3:" + blake3.blake3(a.tobytes()).hexdigest()


@pytest.mark.parametrize("bad", ["", "blake3", "blake3:XYZ", "BLAKE3:" + "0" * 64, "md5:" + "0" * 32,
                                 "blake3:" + "0" * 63, "sha256:" + "0" * 66, None])
def test_parse_digest_rejects_malformed_and_unknown(bad) -> None:
    with pytest.raises(errors.DigestMismatchError):
        signing.parse_digest(bad)


def test_unknown_digest_algorithm_is_refused() -> None:
    with pytest.raises(ValueError, match="unsupported digest"):
        signing.new_digest("md5")


def test_file_digest_matches_bytes(tmp_path: pathlib.Path) -> None:
    (tmp_path / "f").write_bytes(b"hello" * 1000)
    (tmp_path / "e").write_bytes(b"")
    assert signing.file_digest(tmp_path / "f") == "blake3:" + blake3.blake3(b"hello" * 1000).hexdigest()
    assert signing.file_digest(tmp_path / "e", "sha256") == "sha256:" + hashlib.sha256(b"").hexdigest()
    # more than the ring of read buffers holds, and the writer's variant (page cache dropped) agrees
    big = np.random.default_rng(5).integers(0, 256, 3 * digests._READBACK_PIECE + 123, np.uint8).tobytes()
    (tmp_path / "big").write_bytes(big)
    assert signing.file_digest(tmp_path / "big") == "blake3:" + blake3.blake3(big).hexdigest()
    assert signing.readback_digest(tmp_path / "big") == signing.file_digest(tmp_path / "big")


# --- keys ------------------------------------------------------------------------------------------------


def test_key_id_is_sha256_of_raw_public_key() -> None:
    priv, pub = signing.generate_keypair()
    raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert signing.key_id(pub) == signing.key_id(priv) == hashlib.sha256(raw).digest()
    assert signing.key_id_hex(pub) == hashlib.sha256(raw).hexdigest()


def test_keys_round_trip_through_pem_with_and_without_password(tmp_path: pathlib.Path) -> None:
    priv, pub = signing.generate_keypair()
    signing.save_private_key(tmp_path / "k.pem", priv)
    signing.save_private_key(tmp_path / "kp.pem", priv, password=b"pw")
    signing.save_public_key(tmp_path / "k.pub", pub)
    assert stat.S_IMODE(os.stat(tmp_path / "k.pem").st_mode) == 0o600
    assert b"ENCRYPTED" in (tmp_path / "kp.pem").read_bytes()
    for loaded in (signing.load_private_key(tmp_path / "k.pem"),
                   signing.load_private_key(tmp_path / "kp.pem", password=b"pw")):
        assert signing.key_id(loaded) == signing.key_id(pub)
    assert signing.key_id(signing.load_public_key(tmp_path / "k.pub")) == signing.key_id(pub)
    # a private key file also yields its public half when used as a trusted key
    assert signing.key_id(signing.load_public_key(tmp_path / "k.pem")) == signing.key_id(pub)
    with pytest.raises(errors.KeyFormatError):
        signing.load_private_key(tmp_path / "kp.pem", password=b"wrong")


def test_saving_a_key_never_overwrites(tmp_path: pathlib.Path) -> None:
    priv, _ = signing.generate_keypair()
    (tmp_path / "k.pem").write_bytes(b"precious")
    with pytest.raises(errors.StorageError, match="refusing to overwrite"):
        signing.save_private_key(tmp_path / "k.pem", priv)
    assert (tmp_path / "k.pem").read_bytes() == b"precious"


def test_non_ed25519_and_garbage_keys_are_refused(tmp_path: pathlib.Path) -> None:
    ec_key = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "ec.pem").write_bytes(ec_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    (tmp_path / "ec.pub").write_bytes(ec_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    (tmp_path / "junk").write_bytes(b"not a key")
    with pytest.raises(errors.KeyFormatError, match="not an Ed25519"):
        signing.load_private_key(tmp_path / "ec.pem")
    with pytest.raises(errors.KeyFormatError, match="not an Ed25519"):
        signing.load_public_key(tmp_path / "ec.pub")
    with pytest.raises(errors.KeyFormatError):
        signing.load_public_key(tmp_path / "junk")
    with pytest.raises(errors.KeyFormatError, match="not found"):
        signing.load_public_key(tmp_path / "missing")
    with pytest.raises(errors.KeyFormatError):
        signing.trusted_key_set([42])


def test_trusted_key_set_accepts_every_documented_form(tmp_path: pathlib.Path) -> None:
    keys = [signing.generate_keypair() for _ in range(5)]
    signing.save_public_key(tmp_path / "p.pem", keys[2][1])
    raw = keys[3][1].public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    pem = keys[4][1].public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    got = signing.trusted_key_set([keys[0][1], keys[1][0], str(tmp_path / "p.pem"), raw, pem])
    assert set(got) == {signing.key_id(k[1]) for k in keys}
    assert set(signing.trusted_key_set(keys[0][1])) == {signing.key_id(keys[0][1])}
    assert signing.trusted_key_set(None) == {}


# --- the signature block ---------------------------------------------------------------------------------


def test_block_round_trips_and_has_the_documented_size() -> None:
    entries = [signing.SignatureEntry(1, bytes([i]) * 32, bytes([i + 1]) * 64) for i in range(3)]
    raw = signing.encode_block(entries)
    assert len(raw) == 16 + 104 * 3
    assert raw[:8] == b"SNPX-SIG"
    assert signing.decode_block(raw) == entries


def _block(count: int = 1) -> bytearray:
    return bytearray(signing.encode_block(
        [signing.SignatureEntry(1, bytes([i]) * 32, b"s" * 64) for i in range(count)]))


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b[:10], "shorter than"),
    (lambda b: b"XNPX" + b[4:], "bad magic"),
    (lambda b: b[:8] + b"\x02\x00" + b[10:], "version 2"),
    (lambda b: b[:10] + b"\x00\x00" + b[12:], "malformed"),
    (lambda b: b[:10] + b"\x11\x00" + b[12:], "malformed"),
    (lambda b: b[:12] + b"\x01" + b[13:], "malformed"),
    (lambda b: b + b"\x00", "expected 120"),
    (lambda b: b[:-1], "expected 120"),
    (lambda b: b[:16] + b"\x02" + b[17:], "unknown algorithm"),
    (lambda b: b[:18] + b"\x01" + b[19:], "reserved"),
])
def test_malformed_blocks_are_bad_signatures(mutate, message: str) -> None:
    with pytest.raises(errors.BadSignatureError, match=message):
        signing.decode_block(bytes(mutate(_block())))


def test_block_naming_one_key_twice_is_refused() -> None:
    entry = signing.SignatureEntry(1, b"k" * 32, b"s" * 64)
    with pytest.raises(errors.BadSignatureError, match="same key twice"):
        signing.decode_block(signing.encode_block([entry, entry]))


def test_check_signature_decisions() -> None:
    priv, pub = signing.generate_keypair()
    other_priv, other_pub = signing.generate_keypair()
    body = b'{"tensors":[]}'
    block = signing._sign(signing.TABLE_DOMAIN, body, priv)
    assert signing.check_signature(signing.TABLE_DOMAIN, body, block, [pub]) == signing.key_id(pub)
    with pytest.raises(errors.MissingSignatureError):
        signing.check_signature(signing.TABLE_DOMAIN, body, b"", [pub])
    with pytest.raises(errors.UntrustedKeyError, match="not among the 1 trusted"):
        signing.check_signature(signing.TABLE_DOMAIN, body, block, [other_pub])
    with pytest.raises(errors.UntrustedKeyError, match="no trusted keys"):
        signing.check_signature(signing.TABLE_DOMAIN, body, block, [])
    with pytest.raises(errors.BadSignatureError, match="does not verify"):
        signing.check_signature(signing.TABLE_DOMAIN, body + b" ", block, [pub])
    # domain separation: a table signature is not a manifest signature over the same bytes
    with pytest.raises(errors.BadSignatureError):
        signing.check_signature(signing.MANIFEST_DOMAIN, body, block, [pub])
    # two signers: an untrusted extra signature is ignored, a bad trusted one is not
    two = signing.encode_block(signing.decode_block(block) + signing.decode_block(
        signing._sign(signing.TABLE_DOMAIN, body, other_priv)))
    assert signing.check_signature(signing.TABLE_DOMAIN, body, two, [pub]) == signing.key_id(pub)
    forged = signing.encode_block(signing.decode_block(block) + [
        signing.SignatureEntry(1, signing.key_id(other_pub), b"\x00" * 64)])
    with pytest.raises(errors.BadSignatureError):
        signing.check_signature(signing.TABLE_DOMAIN, body, forged, [pub, other_pub])


def test_signature_block_refuses_a_table_without_digests() -> None:
    priv, _ = signing.generate_keypair()
    table = json.dumps({"tensors": [{"name": "w"}], "metadata": {}, "config": None}).encode()
    with pytest.raises(errors.DigestMismatchError, match="carries no digest"):
        signing.signature_block(table, priv)


# --- signed files ----------------------------------------------------------------------------------------


def test_signed_write_verifies_and_every_tensor_has_a_digest(tmp_path: pathlib.Path) -> None:
    priv, pub = signing.generate_keypair()
    path = write_checkpoint(tmp_path / "s.snpx", priv)
    with checkpoint.CheckpointReader(path) as r:
        for entry in r.table.tensors:
            assert entry.digest == "blake3:" + blake3.blake3(r.raw(entry.name)).hexdigest()
        assert signing.decode_block(r.signature_block)[0].key_id == signing.key_id(pub)
    assert verify.verify_checkpoint(path, [pub]) == (True, [])
    assert checkpoint.validate_checkpoint(path, trusted_keys=[pub]) == (True, [])
    verified = verify.check_checkpoint(path, pub)
    assert verified.metadata == {"run": "a"} and verified.config == {"dim": 4}


def test_verify_reports_each_failed_check_by_name(tmp_path: pathlib.Path) -> None:
    priv, pub = signing.generate_keypair()
    _, other = signing.generate_keypair()
    signed = write_checkpoint(tmp_path / "s.snpx", priv)
    unsigned = write_checkpoint(tmp_path / "u.snpx")
    ok, problems = verify.verify_checkpoint(signed, [other])
    assert not ok and problems[0].startswith("UntrustedKeyError")
    ok, problems = verify.verify_checkpoint(unsigned, [pub])
    assert not ok and problems[0].startswith("MissingSignatureError")
    ok, problems = verify.verify_checkpoint(tmp_path / "missing.snpx", [pub])
    assert not ok and problems[0].startswith("CheckpointNotFoundError")
    ok, problems = checkpoint.validate_checkpoint(unsigned, trusted_keys=[pub])
    assert not ok and "MissingSignatureError" in problems[0]


def test_validate_with_trusted_keys_checks_the_signature_before_any_data(tmp_path: pathlib.Path) -> None:
    priv, pub = signing.generate_keypair()
    _, other = signing.generate_keypair()
    path = write_checkpoint(tmp_path / "s.snpx", priv)
    with checkpoint.CheckpointReader(path) as r:
        offset = r.entry("w").offset
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 1
    path.write_bytes(raw)
    # corrupt data and an untrusted signer: the signature is what is reported (docs/FORMAT.md "Verifying")
    ok, problems = checkpoint.validate_checkpoint(path, trusted_keys=[other])
    assert not ok and problems[0].startswith("UntrustedKeyError") and len(problems) == 1
    ok, problems = checkpoint.validate_checkpoint(path, trusted_keys=[pub])
    assert not ok and problems[0].startswith("ChecksumMismatchError") and "'w'" in problems[0]
    seen: list[tuple[int, int]] = []
    path.write_bytes(write_checkpoint(tmp_path / "t.snpx", priv).read_bytes())
    assert checkpoint.validate_checkpoint(path, trusted_keys=[pub], progress=lambda *a: seen.append(a)) == (True, [])
    assert len(seen) == 2 and seen[0][0] < seen[1][0] <= seen[1][1]  # once per tensor, growing


def test_validate_checks_a_signed_coordinator_step_with_trusted_keys(tmp_path: pathlib.Path) -> None:
    from SneppX_ALG import CheckpointCoordinator, storage

    priv, pub = signing.generate_keypair()
    _, other = signing.generate_keypair()
    with CheckpointCoordinator(tmp_path, max_to_keep=None, signing_key=priv) as coord:
        coord.save({"w": np.arange(100, dtype=np.float32)}, step=3)
    step_dir = tmp_path / storage.step_name(3)
    assert checkpoint.validate_checkpoint(step_dir, trusted_keys=[pub]) == (True, [])
    ok, problems = checkpoint.validate_checkpoint(step_dir, trusted_keys=[other])
    assert not ok and problems[0].startswith("UntrustedKeyError")


def test_signing_keeps_a_bfloat16_tensor_exactly(tmp_path: pathlib.Path) -> None:
    priv, pub = signing.generate_keypair()
    path = write_checkpoint(tmp_path / "u.snpx", tensors={"h": np.arange(40, dtype=np.uint16).reshape(5, 8)})
    with checkpoint.CheckpointReader(path) as r:
        header, table = r.header, r.table
    entry = dataclasses.replace(table.tensors[0], dtype="bfloat16")
    _rewrite_table(path, header, format.Table((entry,), table.metadata, table.config))
    verify.sign_checkpoint(path, priv)
    assert verify.verify_checkpoint(path, [pub]) == (True, [])
    with checkpoint.CheckpointReader(path) as r:
        assert (r.entry("h").dtype, r.entry("h").shape) == ("bfloat16", (5, 8))
        assert bytes(r.raw("h")) == np.arange(40, dtype="<u2").tobytes()


def test_sign_existing_checkpoint_keeps_data_and_layout(tmp_path: pathlib.Path) -> None:
    priv, pub = signing.generate_keypair()
    path = tmp_path / "u.snpx"
    with checkpoint.CheckpointWriter(path, metadata={"step": "5"}, config=[1, 2]) as w:
        w.write("shard", np.arange(12, dtype=np.int16).reshape(3, 4), global_shape=(6, 4), global_offset=(3, 0))
        w.write("empty", np.zeros((0, 3), np.float32))
        w.write("big", np.arange(300000, dtype=np.float64))
    with checkpoint.CheckpointReader(path) as r:
        before_table, before_data = r.table, bytes(r._mmap[:r.header.table_offset])[4096:]
    assert verify.sign_checkpoint(path, priv) == signing.key_id(pub)
    assert verify.verify_checkpoint(path, [pub]) == (True, [])
    with checkpoint.CheckpointReader(path) as r:
        assert bytes(r._mmap[:r.header.table_offset])[4096:] == before_data
        assert r.metadata == before_table.metadata and r.config == before_table.config
        for old, new in zip(before_table.tensors, r.table.tensors, strict=True):
            assert (old.name, old.dtype, old.shape, old.offset, old.length, old.crc32c, old.global_shape,
                    old.global_offset) == (new.name, new.dtype, new.shape, new.offset, new.length, new.crc32c,
                                           new.global_shape, new.global_offset)
            assert new.digest is not None
    assert sorted(os.listdir(tmp_path)) == ["u.snpx"]  # no temporary file left


def test_resigning_replaces_the_signer(tmp_path: pathlib.Path) -> None:
    a, a_pub = signing.generate_keypair()
    b, b_pub = signing.generate_keypair()
    path = write_checkpoint(tmp_path / "s.snpx", a)
    verify.sign_checkpoint(path, b)
    assert verify.verify_checkpoint(path, [b_pub]) == (True, [])
    assert not verify.verify_checkpoint(path, [a_pub])[0]


def test_signing_refuses_corrupt_data_and_leaves_the_file(tmp_path: pathlib.Path) -> None:
    priv, _ = signing.generate_keypair()
    path = write_checkpoint(tmp_path / "u.snpx")
    raw = bytearray(path.read_bytes())
    raw[4096 + 10] ^= 1
    path.write_bytes(raw)
    with pytest.raises(errors.ChecksumMismatchError, match="refusing to sign"):
        verify.sign_checkpoint(path, priv)
    assert path.read_bytes() == raw
    assert sorted(os.listdir(tmp_path)) == ["u.snpx"]


def test_signing_refuses_a_table_digest_that_does_not_match(tmp_path: pathlib.Path) -> None:
    priv, _ = signing.generate_keypair()
    path = write_checkpoint(tmp_path / "s.snpx", priv)
    with checkpoint.CheckpointReader(path) as r:
        header, table = r.header, r.table
    entries = list(table.tensors)
    entries[0] = dataclasses.replace(entries[0], digest="blake3:" + "0" * 64)
    _rewrite_table(path, header, format.Table(tuple(entries), table.metadata, table.config))
    with pytest.raises(errors.DigestMismatchError, match="already in its table"):
        verify.sign_checkpoint(path, priv)


def _rewrite_table(path: pathlib.Path, header: format.Header, table: format.Table) -> None:
    """Replaces table (and drops the signature), fixing every CRC: what an attacker with a hex editor does."""
    raw = path.read_bytes()[:header.table_offset]
    table_bytes = format.encode_table(table)
    new_header = format.Header(file_size=header.table_offset + len(table_bytes), table_offset=header.table_offset,
                               table_length=len(table_bytes), table_crc32c=_native.crc32c(table_bytes))
    path.write_bytes(format.encode_header(new_header) + raw[64:] + table_bytes)


def test_sign_needs_an_ed25519_private_key(tmp_path: pathlib.Path) -> None:
    _, pub = signing.generate_keypair()
    path = write_checkpoint(tmp_path / "u.snpx")
    with pytest.raises(errors.KeyFormatError):
        verify.sign_checkpoint(path, pub)


# --- multi-file checkpoints ------------------------------------------------------------------------------


def make_directory(root: pathlib.Path) -> pathlib.Path:
    root.mkdir()
    (root / "shards").mkdir()
    files = {"shards/rank0.snpx": b"a" * 5000, "shards/rank1.snpx": b"b" * 7000, "state.json": b"{}"}
    for name, data in files.items():
        (root / name).write_bytes(data)
    manifest = {"step": 10, "metadata": {"sneppx.version": "3"},
                "files": {n: {"size": len(d), "digest": signing.file_digest(root / n)} for n, d in files.items()}}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def test_signed_directory_verifies_and_detects_changed_files(tmp_path: pathlib.Path) -> None:
    priv, pub = signing.generate_keypair()
    root = make_directory(tmp_path / "step-10")
    with pytest.raises(errors.MissingSignatureError):
        verify.check_checkpoint(root, [pub])
    assert verify.sign_checkpoint(root, priv) == signing.key_id(pub)
    verified = verify.check_checkpoint(root, [pub])
    assert verified.metadata == {"sneppx.version": "3"}
    assert verify.verify_checkpoint(root, [pub]) == (True, [])
    (root / "shards/rank1.snpx").write_bytes(b"b" * 6999 + b"c")
    with pytest.raises(errors.DigestMismatchError, match="rank1"):
        verify.check_checkpoint(root, [pub])
    (root / "shards/rank1.snpx").write_bytes(b"b" * 6000)
    with pytest.raises(errors.TruncatedCheckpointError):
        verify.check_checkpoint(root, [pub])
    (root / "shards/rank1.snpx").unlink()
    with pytest.raises(errors.TruncatedCheckpointError, match="missing"):
        verify.check_checkpoint(root, [pub])


def test_changed_manifest_breaks_the_detached_signature(tmp_path: pathlib.Path) -> None:
    priv, pub = signing.generate_keypair()
    root = make_directory(tmp_path / "step-10")
    verify.sign_manifest(root, priv)
    doc = json.loads((root / "manifest.json").read_text())
    doc["metadata"]["sneppx.version"] = "4"
    (root / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(errors.BadSignatureError, match="manifest changed"):
        verify.check_checkpoint(root, [pub])


@pytest.mark.parametrize("name", ["../escape", "/abs", "a/../../b", "", "manifest.sig", "a\\b"])
def test_manifest_with_unsafe_paths_is_refused(tmp_path: pathlib.Path, name: str) -> None:
    priv, _ = signing.generate_keypair()
    root = tmp_path / "d"
    root.mkdir()
    (root / "manifest.json").write_text(json.dumps({"files": {name: {"size": 0, "digest": signing.digest_of(b"")}}}))
    with pytest.raises(errors.CorruptTableError, match="unsafe or reserved"):
        verify.sign_manifest(root, priv)


def test_manifest_symlink_escaping_the_directory_is_refused(tmp_path: pathlib.Path) -> None:
    priv, _ = signing.generate_keypair()
    (tmp_path / "outside").write_bytes(b"x")
    root = tmp_path / "d"
    root.mkdir()
    (root / "link").symlink_to(tmp_path / "outside")
    (root / "manifest.json").write_text(json.dumps(
        {"files": {"link": {"size": 1, "digest": signing.digest_of(b"x")}}}))
    with pytest.raises(errors.CorruptTableError, match="outside the checkpoint"):
        verify.sign_manifest(root, priv)


# --- command line ----------------------------------------------------------------------------------------


def run_cli(argv: list[str]) -> int:
    return cli.main(argv)


def test_cli_keygen_sign_verify_exit_codes(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    key = str(tmp_path / "k.pem")
    assert run_cli(["keygen", key]) == 0
    assert run_cli(["keygen", key]) == 2  # never overwrites a key
    assert run_cli(["keygen", str(tmp_path / "other.pem")]) == 0
    path = str(write_checkpoint(tmp_path / "c.snpx"))
    assert run_cli(["verify", path, "-k", key + ".pub"]) == 1
    assert "MissingSignatureError" in capsys.readouterr().out
    assert run_cli(["sign", path, "--key", key]) == 0
    assert run_cli(["verify", path, "-k", key + ".pub"]) == 0
    assert run_cli(["verify", path, "-k", str(tmp_path / "other.pem.pub")]) == 1
    assert "UntrustedKeyError" in capsys.readouterr().out
    assert run_cli(["verify", path, "-k", str(tmp_path / "nope.pub")]) == 2
    assert run_cli(["sign", path, "--key", str(tmp_path / "nope.pem")]) == 2
    assert run_cli(["sign", str(tmp_path / "missing.snpx"), "--key", key]) == 1


def test_cli_verify_in_a_fresh_process(tmp_path: pathlib.Path) -> None:
    priv, pub = signing.generate_keypair()
    signing.save_public_key(tmp_path / "k.pub", pub)
    path = write_checkpoint(tmp_path / "c.snpx", priv)
    command = [sys.executable, "-m", "SneppX_ALG.cli", "verify", str(path), "-k", str(tmp_path / "k.pub")]
    good = subprocess.run(command, capture_output=True, text=True, check=False, timeout=60)
    assert good.returncode == 0 and good.stdout.startswith("OK"), good.stderr
    with open(path, "ab") as f:
        f.write(b"x")
    bad = subprocess.run(command, capture_output=True, text=True, check=False, timeout=60)
    assert bad.returncode == 1 and "trailing bytes" in bad.stdout
