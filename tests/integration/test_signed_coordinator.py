"""Signed multi-file checkpoints from CheckpointCoordinator: real files and real S3 servers, no mocks.

A signed step is a directory (or S3 prefix) whose manifest.json lists every shard's size and BLAKE3 digest
and whose manifest.sig signs those exact bytes. These tests change bytes the way an attacker would and check that a
coordinator with trusted keys skips the step, names the failed check, and rolls back to the last good one.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from SneppX_ALG import CheckpointCoordinator, _native, checkpoint, errors, storage
from SneppX_ALG.checkpoint import manifest as manifest_codec
from SneppX_ALG.checkpoint import signing, verify

MiB = 1 << 20
SHARD = "shard-00000.snpx"


def state_for(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"layer": {"w": rng.standard_normal((64, 33)).astype(np.float32)},
            "embed": rng.integers(0, 255, 3 * MiB, dtype=np.uint8).reshape(-1, 1024),  # several pieces
            "small": rng.standard_normal(1024).astype(np.float32),
            "lr": 0.1 * step}


def empty_state() -> dict:
    return {"layer": {"w": None}, "embed": None, "small": None, "lr": None}


def assert_is_state(got: dict, step: int) -> None:
    want = state_for(step)
    assert got["layer"]["w"].tobytes() == want["layer"]["w"].tobytes()
    assert got["embed"].tobytes() == want["embed"].tobytes()
    assert got["small"].tobytes() == want["small"].tobytes()
    assert got["lr"] == want["lr"]


@pytest.fixture(scope="module")
def keys() -> tuple:
    private, public = signing.generate_keypair()
    other, _ = signing.generate_keypair()
    return private, public, other


@pytest.fixture(autouse=True)
def _disarm_faults():
    yield
    _native.fault_arm("write", 0, "kill")  # countdown 0: disarmed


def save_steps(root: str, steps: dict[int, object], **kwargs) -> None:
    """Saves each step, signed with the key given for it (None: unsigned)."""
    for step, key in steps.items():
        with CheckpointCoordinator(root, max_to_keep=None, signing_key=key, staging_bytes=2 * MiB,
                                   **kwargs) as coord:
            coord.save(state_for(step), step=step, training_state={"step": step})


# ---- CRC-preserving change: what CRC32C can't see and a digest can --------------------------------------


def crc_neutral_flip(data: bytes, start: int) -> bytes:
    """`data` with some bits among bytes start..start+5 flipped so that its CRC32C is unchanged.

    CRC32C is affine over GF(2): flipping a bit set D changes the CRC by a fixed linear function of D. 40 bit
    positions in a 32-bit space are linearly dependent, so Gaussian elimination finds a nonzero set whose
    changes cancel out."""
    base = _native.crc32c(data)
    basis: dict[int, tuple[int, int]] = {}  # leading bit -> (CRC change, which bits make it)
    for bit in range(40):
        flipped = bytearray(data)
        flipped[start + bit // 8] ^= 1 << (bit % 8)
        change, combo = _native.crc32c(bytes(flipped)) ^ base, 1 << bit
        while change:
            top = change.bit_length() - 1
            if top not in basis:
                basis[top] = (change, combo)
                break
            change, combo = change ^ basis[top][0], combo ^ basis[top][1]
        else:  # a combination that changes nothing
            out = bytearray(data)
            for b in range(40):
                if combo >> b & 1:
                    out[start + b // 8] ^= 1 << (b % 8)
            assert out != data and _native.crc32c(bytes(out)) == base
            return bytes(out)
    raise AssertionError("40 vectors in a 32-dimensional space are always dependent")


def forge_shard_keeping_crcs(shard: pathlib.Path, tensor: str = "small") -> None:
    """Changes bytes of `tensor` in place so that every CRC32C (tensor, table, header) still holds."""
    with checkpoint.CheckpointReader(shard) as reader:
        entry = reader.entry(tensor)
        data = bytes(reader.raw(tensor))
    forged = crc_neutral_flip(data, 100)
    with open(shard, "r+b") as f:
        f.seek(entry.offset)
        f.write(forged)


# ---- tampering, applied to a committed step directory ----------------------------------------------------


def tamper_shard_byte(step_dir: pathlib.Path, keys: tuple) -> None:
    blob = bytearray((step_dir / SHARD).read_bytes())
    blob[4096 + 7] ^= 0x01
    (step_dir / SHARD).write_bytes(blob)


def tamper_manifest(step_dir: pathlib.Path, keys: tuple) -> None:
    manifest = json.loads((step_dir / "manifest.json").read_bytes())
    manifest["training_state"] = {"step": 999}  # still a well-formed manifest, pointing at the same shards
    # with its checksum made again, as anyone changing it on purpose would: the checksum is for accidents
    (step_dir / "manifest.json").write_bytes(manifest_codec.encode_manifest(manifest))


def tamper_signature(step_dir: pathlib.Path, keys: tuple) -> None:
    blob = bytearray((step_dir / "manifest.sig").read_bytes())
    blob[-1] ^= 0x01  # inside the Ed25519 signature
    (step_dir / "manifest.sig").write_bytes(blob)


def remove_signature(step_dir: pathlib.Path, keys: tuple) -> None:
    (step_dir / "manifest.sig").unlink()


def signature_from_another_step(step_dir: pathlib.Path, keys: tuple) -> None:
    shutil.copyfile(step_dir.parent / storage.step_name(1) / "manifest.sig", step_dir / "manifest.sig")


def resign_with_untrusted_key(step_dir: pathlib.Path, keys: tuple) -> None:
    verify.sign_checkpoint(step_dir, keys[2])  # replaces manifest.sig: a valid signature, wrong signer


def forge_keeping_crcs(step_dir: pathlib.Path, keys: tuple) -> None:
    forge_shard_keeping_crcs(step_dir / SHARD)


TAMPERING = {
    "shard byte": (tamper_shard_byte, "DigestMismatchError"),
    "shard, CRCs kept": (forge_keeping_crcs, "DigestMismatchError"),
    "manifest": (tamper_manifest, "BadSignatureError"),
    "manifest.sig": (tamper_signature, "BadSignatureError"),
    "manifest.sig removed": (remove_signature, "MissingSignatureError"),
    "manifest.sig of another step": (signature_from_another_step, "BadSignatureError"),
    "untrusted key": (resign_with_untrusted_key, "UntrustedKeyError"),
}


# ---- local directories -----------------------------------------------------------------------------------


def test_signed_steps_verify_and_restore(tmp_path, keys) -> None:
    private, public, _ = keys
    save_steps(str(tmp_path), {1: private, 2: private})
    step_dir = tmp_path / storage.step_name(2)
    assert sorted(p.name for p in step_dir.iterdir()) == ["manifest.json", "manifest.sig", SHARD]
    manifest = json.loads((step_dir / "manifest.json").read_bytes())
    assert manifest["files"] == {SHARD: {"size": (step_dir / SHARD).stat().st_size,
                                         "digest": signing.file_digest(step_dir / SHARD)}}
    assert verify.verify_checkpoint(step_dir, [public]) == (True, [])
    assert verify.check_checkpoint(step_dir, [public]).key_id == signing.key_id(public)

    reader = CheckpointCoordinator(tmp_path, trusted_keys=[public])
    assert reader.latest().step == 2 and reader.validate(1) == []
    got = empty_state()
    info = reader.restore(got)
    assert info.step == 2 and info.training_state == {"step": 2}
    assert_is_state(got, 2)
    assert reader.skipped == []


def test_trusted_keys_and_signing_key_load_from_pem_files(tmp_path, keys) -> None:
    private, public, _ = keys
    signing.save_private_key(tmp_path / "key.pem", private)
    signing.save_public_key(tmp_path / "key.pub", public)
    save_steps(str(tmp_path / "ckpt"), {1: str(tmp_path / "key.pem")})
    assert CheckpointCoordinator(tmp_path / "ckpt", trusted_keys=str(tmp_path / "key.pub")).latest().step == 1
    with pytest.raises(errors.KeyFormatError):
        CheckpointCoordinator(tmp_path / "ckpt", trusted_keys=[])
    with pytest.raises(errors.KeyFormatError):
        CheckpointCoordinator(tmp_path / "ckpt", signing_key=public)


@pytest.mark.parametrize("case", list(TAMPERING))
def test_a_tampered_step_is_skipped_naming_the_failed_check(tmp_path, keys, case) -> None:
    private, public, _ = keys
    tamper, failed_check = TAMPERING[case]
    save_steps(str(tmp_path), {1: private, 2: private})
    step_dir = tmp_path / storage.step_name(2)
    tamper(step_dir, keys)

    reader = CheckpointCoordinator(tmp_path, trusted_keys=[public])
    assert reader.latest().step == 1
    assert [s.step for s in reader.skipped] == [2]
    assert reader.skipped[0].problems[0].startswith(f"{failed_check}:"), reader.skipped[0].problems
    assert reader.validate(2)[0].startswith(f"{failed_check}:")

    got = empty_state()
    info = reader.restore(got)  # rolls back past the tampered step
    assert info.step == 1 and info.training_state == {"step": 1}
    assert_is_state(got, 1)
    with pytest.raises(errors.ManifestError, match=failed_check):
        reader.restore(empty_state(), step=2)

    ok, problems = verify.verify_checkpoint(step_dir, [public])
    assert not ok and problems[0].startswith(f"{failed_check}:")


@pytest.mark.parametrize("case", ["shard, CRCs kept", "manifest"])
def test_without_trusted_keys_the_same_tampering_goes_unseen(tmp_path, keys, case) -> None:
    """What the signature adds: these changes keep every CRC and the manifest well-formed."""
    private, _, _ = keys
    save_steps(str(tmp_path), {1: private, 2: private})
    TAMPERING[case][0](tmp_path / storage.step_name(2), keys)
    unsigned_reader = CheckpointCoordinator(tmp_path)
    assert unsigned_reader.latest().step == 2 and unsigned_reader.skipped == []


def test_an_unsigned_step_is_saved_without_digests_and_refused_when_keys_are_trusted(tmp_path, keys) -> None:
    """Shard digests cost a read-back of every shard, so only a signing coordinator makes them: an unsigned
    step has no "files", fails verification as unsigned, and can't be signed after the fact (a signature
    over a manifest without digests would not cover the shards)."""
    private, public, _ = keys
    save_steps(str(tmp_path), {1: private, 2: None})
    step_dir = tmp_path / storage.step_name(2)
    assert not (step_dir / "manifest.sig").exists()
    assert "files" not in json.loads((step_dir / "manifest.json").read_bytes())
    assert CheckpointCoordinator(tmp_path).latest().step == 2  # unsigned coordinators read it as before

    reader = CheckpointCoordinator(tmp_path, trusted_keys=[public])
    assert reader.latest().step == 1
    assert reader.skipped[0].problems[0].startswith("MissingSignatureError:")
    ok, problems = verify.verify_checkpoint(step_dir, [public])
    assert not ok and problems[0].startswith("MissingSignatureError:")

    with pytest.raises(errors.CorruptTableError, match='"files"'):
        verify.sign_checkpoint(step_dir, private)
    assert not (step_dir / "manifest.sig").exists()
    assert CheckpointCoordinator(tmp_path, trusted_keys=[public]).latest().step == 1


def test_sign_checkpoint_refuses_a_step_whose_shard_changed(tmp_path, keys) -> None:
    private, _, other = keys
    save_steps(str(tmp_path), {1: private})
    step_dir = tmp_path / storage.step_name(1)
    signature = (step_dir / "manifest.sig").read_bytes()
    tamper_shard_byte(step_dir, keys)
    with pytest.raises(errors.DigestMismatchError):
        verify.sign_checkpoint(step_dir, other)
    assert (step_dir / "manifest.sig").read_bytes() == signature


def test_signature_is_written_before_the_commit_rename(tmp_path, keys) -> None:
    """Renames of a signed save: shard, manifest, manifest.sig, then the step directory (the commit). A failed
    signature write leaves the step uncommitted, so no committed signed step lacks its signature."""
    private, public, _ = keys
    with CheckpointCoordinator(tmp_path, signing_key=private, staging_bytes=2 * MiB) as coord:
        coord.save(state_for(1), step=1)
        coord.wait()
        _native.fault_arm("rename", 3, "EIO")  # the third rename of the next save: manifest.sig's
        coord.save(state_for(2), step=2)
        with pytest.raises(errors.StorageError):
            coord.wait()
        assert coord.committed_steps() == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [storage.step_name(1)]
    assert CheckpointCoordinator(tmp_path, trusted_keys=[public]).latest().step == 1


def test_retention_and_rollback_with_a_signing_coordinator(tmp_path, keys) -> None:
    """A trusted-keys coordinator that rolled back past a tampered step saves that step again."""
    private, public, _ = keys
    save_steps(str(tmp_path), {1: private, 2: private})
    tamper_manifest(tmp_path / storage.step_name(2), keys)
    with CheckpointCoordinator(tmp_path, max_to_keep=2, signing_key=private, trusted_keys=[public],
                               staging_bytes=2 * MiB) as coord:
        assert coord.restore(empty_state()).step == 1
        for step in (2, 3):
            coord.save(state_for(step), step=step, training_state={"step": step})
    reader = CheckpointCoordinator(tmp_path, trusted_keys=[public])
    assert reader.committed_steps() == [2, 3]
    assert reader.validate(2) == [] and reader.latest().step == 3
    assert reader.skipped == []


# ---- the CLI ---------------------------------------------------------------------------------------------


def sneppx(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("sneppx", path=str(pathlib.Path(sys.executable).parent))
    assert exe, "the sneppx console script is installed with the package"
    return subprocess.run([exe, *args], check=False, capture_output=True, text=True, timeout=120)


def test_sneppx_verify_a_step_directory_exit_codes(tmp_path, keys) -> None:
    private, public, other = keys
    signing.save_public_key(tmp_path / "pub.pem", public)
    signing.save_public_key(tmp_path / "other.pem", other.public_key())
    (tmp_path / "junk.pem").write_text("not a key\n")
    root = tmp_path / "ckpt"
    save_steps(str(root), {1: private, 2: private})
    good, bad = root / storage.step_name(1), root / storage.step_name(2)

    result = sneppx("verify", str(good), "-k", str(tmp_path / "pub.pem"))
    assert result.returncode == 0 and result.stdout.startswith(f"OK      {good}")

    tamper_shard_byte(bad, keys)
    result = sneppx("verify", str(good), str(bad), "-k", str(tmp_path / "pub.pem"))
    assert result.returncode == 1
    assert f"INVALID {bad}" in result.stdout and "DigestMismatchError" in result.stdout

    result = sneppx("verify", str(good), "-k", str(tmp_path / "other.pem"))
    assert result.returncode == 1 and "UntrustedKeyError" in result.stdout

    assert sneppx("verify", str(good), "-k", str(tmp_path / "junk.pem")).returncode == 2


# ---- S3 (moto and the Versity S3 Gateway over HTTP on 127.0.0.1; each test runs on both) ----------------


def s3_objects(client, bucket: str) -> list[str]:
    return sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", []))


def flip_object_byte(client, bucket: str, key: str, index: int) -> None:
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[index] ^= 0x01
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))


def test_signed_steps_on_s3_verify_and_the_signature_goes_up_before_the_marker(s3_bucket, s3_env, keys,
                                                                                tmp_path) -> None:
    private, public, _ = keys
    client = s3_env.client()
    puts: list[str] = []
    client.meta.events.register("provide-client-params.s3.PutObject",
                                lambda params, **_: puts.append(params["Key"]))
    root = f"s3://{s3_bucket}/run"
    save_steps(root, {1: private}, s3_client=client)
    assert s3_objects(client, s3_bucket) == [f"run/step-000000001/{n}" for n in
                                             ("COMMITTED", "manifest.json", "manifest.sig", SHARD)]
    assert puts[-3:] == [f"run/step-000000001/{n}" for n in ("manifest.json", "manifest.sig", "COMMITTED")]

    manifest = client.get_object(Bucket=s3_bucket, Key="run/step-000000001/manifest.json")["Body"].read()
    sig = client.get_object(Bucket=s3_bucket, Key="run/step-000000001/manifest.sig")["Body"].read()
    assert signing.check_manifest_signature(manifest, sig, [public]) == signing.key_id(public)

    reader = CheckpointCoordinator(root, trusted_keys=[public], s3_client=client, staging_dir=str(tmp_path))
    got = empty_state()
    assert reader.restore(got).step == 1
    assert_is_state(got, 1)


S3_TAMPERING = {
    "shard byte": ("run/step-000000002/" + SHARD, 4096 + 7, "DigestMismatchError"),
    "manifest": ("run/step-000000002/manifest.json", None, "BadSignatureError"),
    "manifest.sig": ("run/step-000000002/manifest.sig", -1, "BadSignatureError"),
    "untrusted key": (None, None, "UntrustedKeyError"),
}


@pytest.mark.parametrize("case", list(S3_TAMPERING))
def test_a_tampered_s3_step_is_skipped_naming_the_failed_check(s3_bucket, s3_env, keys, tmp_path,
                                                                case) -> None:
    private, public, other = keys
    client = s3_env.client()
    root = f"s3://{s3_bucket}/run"
    key, index, failed_check = S3_TAMPERING[case]
    save_steps(root, {1: private, 2: other if case == "untrusted key" else private}, s3_client=client)
    if key is not None and index is not None:
        flip_object_byte(client, s3_bucket, key, index)
    elif key is not None:
        manifest = json.loads(client.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
        manifest["training_state"] = {"step": 999}
        client.put_object(Bucket=s3_bucket, Key=key, Body=json.dumps(manifest).encode())

    reader = CheckpointCoordinator(root, trusted_keys=[public], s3_client=client, staging_dir=str(tmp_path))
    assert reader.committed_steps() == [1, 2]
    assert reader.latest().step == 1
    assert [s.step for s in reader.skipped] == [2]
    assert reader.skipped[0].problems[0].startswith(f"{failed_check}:"), reader.skipped[0].problems
    got = empty_state()
    assert reader.restore(got).step == 1
    assert_is_state(got, 1)
