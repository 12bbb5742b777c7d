"""SignedUpdateManager against real files: installs, version policy, rollback, and SIGKILL mid-install.

The kill sweep runs each install in a real child process whose native fault hook (SNEPPX_FAULT) sends it
SIGKILL at the N-th I/O site (write, fsync, rename, directory fsync), for seeded N across the whole
install; the parent then checks that the old or the new version is installed, never a mix.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from SneppX_ALG import _native, checkpoint, errors
from SneppX_ALG.checkpoint import format, signing, updates, verify

NOW = 1_800_000_000.0  # a fixed clock: 2027-01-15


def make_update(path: pathlib.Path, key, version: str | None, *, expires: str | None = None, seed: int = 0,
                size: int = 5000) -> pathlib.Path:
    metadata = {} if version is None else {updates.VERSION_KEY: version}
    if expires is not None:
        metadata[updates.EXPIRES_KEY] = expires
    rng = np.random.default_rng(seed)
    with checkpoint.CheckpointWriter(path, metadata=metadata, config={"seed": seed}, signing_key=key) as w:
        w.write("embed", rng.standard_normal((size // 50, 50)).astype(np.float32))
        w.write("bias", rng.standard_normal(17).astype(np.float64))
    return path


@pytest.fixture
def keys():
    return signing.generate_keypair()


@pytest.fixture
def manager(tmp_path: pathlib.Path, keys) -> updates.SignedUpdateManager:
    return updates.SignedUpdateManager([keys[1]], tmp_path / "installed", clock=lambda: NOW)


def installed_files(manager: updates.SignedUpdateManager) -> list[str]:
    return sorted(os.listdir(os.path.join(manager.install_dir, updates.VERSIONS_DIR)))


def test_install_current_and_previous(tmp_path: pathlib.Path, keys, manager) -> None:
    assert manager.current() is None
    v1 = make_update(tmp_path / "v1.snpx", keys[0], "1", seed=1)
    assert manager.install_update(v1) == "1"
    first = manager.current()
    assert first is not None and first.version == "1" and first.key_id == signing.key_id_hex(keys[1])
    assert first.path != str(v1) and pathlib.Path(first.path).read_bytes() == v1.read_bytes()
    assert not os.access(first.path, os.W_OK) or os.geteuid() == 0
    assert oct(os.stat(first.path).st_mode & 0o777) == "0o444"
    v2 = make_update(tmp_path / "v2.snpx", keys[0], "1.10", seed=2)
    assert manager.install_update(v2) == "1.10"
    assert manager.current().version == "1.10" and manager.previous() == first
    v3 = make_update(tmp_path / "v3.snpx", keys[0], "2", seed=3)
    manager.install_update(v3)
    # only current and previous are kept
    assert len(installed_files(manager)) == 2
    assert manager.previous().version == "1.10"


def test_installed_copy_is_independent_of_the_source(tmp_path: pathlib.Path, keys, manager) -> None:
    v1 = make_update(tmp_path / "v1.snpx", keys[0], "1")
    manager.install_update(v1)
    v1.write_bytes(b"overwritten after install")
    assert verify.verify_checkpoint(manager.current().path, [keys[1]]) == (True, [])


def test_rollback_then_replay_of_the_rolled_back_version_needs_force(tmp_path: pathlib.Path, keys, manager) -> None:
    v1 = make_update(tmp_path / "v1.snpx", keys[0], "1", seed=1)
    v2 = make_update(tmp_path / "v2.snpx", keys[0], "2", seed=2)
    manager.install_update(v1)
    manager.install_update(v2)
    back = manager.rollback()
    assert back.version == "1" and manager.current() == back and manager.previous() is None
    with pytest.raises(errors.UpdateRejectedError, match="no previous version"):
        manager.rollback()
    with pytest.raises(errors.RollbackRefusedError, match="not newer than version 2"):
        manager.install_update(v2)
    assert manager.current().version == "1"
    assert manager.install_update(v2, force=True) == "2"
    assert manager.current().version == "2" and manager.previous().version == "1"


def test_rollback_reverifies_the_previous_file(tmp_path: pathlib.Path, keys, manager) -> None:
    manager.install_update(make_update(tmp_path / "v1.snpx", keys[0], "1", seed=1))
    manager.install_update(make_update(tmp_path / "v2.snpx", keys[0], "2", seed=2))
    previous = pathlib.Path(manager.previous().path)
    os.chmod(previous, 0o644)
    raw = bytearray(previous.read_bytes())
    raw[4096] ^= 0xFF
    previous.write_bytes(raw)
    with pytest.raises(errors.ChecksumMismatchError):
        manager.rollback()
    assert manager.current().version == "2"


def test_force_installs_an_older_version_but_never_an_expired_one(tmp_path: pathlib.Path, keys, manager) -> None:
    manager.install_update(make_update(tmp_path / "v5.snpx", keys[0], "5"))
    old = make_update(tmp_path / "v3.snpx", keys[0], "3", seed=3)
    assert manager.install_update(old, force=True) == "3"
    with pytest.raises(errors.RollbackRefusedError):  # high-water mark stays 5
        manager.install_update(make_update(tmp_path / "v4.snpx", keys[0], "4", seed=4))
    expired = make_update(tmp_path / "v9.snpx", keys[0], "9", expires="2027-01-01T00:00:00Z", seed=9)
    with pytest.raises(errors.ExpiredUpdateError, match="expired at 2027-01-01"):
        manager.install_update(expired, force=True)
    assert manager.current().version == "3"


def test_expiry_in_the_future_installs_and_can_be_required(tmp_path: pathlib.Path, keys) -> None:
    strict = updates.SignedUpdateManager([keys[1]], tmp_path / "strict", require_expiry=True, clock=lambda: NOW)
    with pytest.raises(errors.UpdateRejectedError, match="no signed expiry"):
        strict.install_update(make_update(tmp_path / "v1.snpx", keys[0], "1"))
    ok = make_update(tmp_path / "v2.snpx", keys[0], "2", expires="2027-02-01T00:00:00+00:00")
    assert strict.install_update(ok) == "2"
    naive = make_update(tmp_path / "v3.snpx", keys[0], "3", expires="2027-02-01T00:00:00")
    with pytest.raises(errors.UpdateRejectedError, match="with a zone"):
        strict.install_update(naive)
    assert strict.current().version == "2"


@pytest.mark.parametrize("version", [None, "", "v2", "1..2", "-1", "1.2.", "1e3"])
def test_missing_or_malformed_signed_version_is_refused(tmp_path: pathlib.Path, keys, manager, version) -> None:
    with pytest.raises(errors.UpdateRejectedError, match="version"):
        manager.install_update(make_update(tmp_path / "bad.snpx", keys[0], version))
    assert manager.current() is None
    assert installed_files(manager) == []


def test_version_order_is_numeric() -> None:
    assert updates.parse_version("1.10") > updates.parse_version("1.9")
    assert updates.parse_version("2.0.0") == updates.parse_version("2")
    assert updates.parse_version("10") > updates.parse_version("9.99")


def test_directory_updates_are_refused_with_a_typed_error(tmp_path: pathlib.Path, manager) -> None:
    (tmp_path / "d").mkdir()
    with pytest.raises(errors.CheckpointFormatError, match="not a directory"):
        manager.install_update(tmp_path / "d")


def test_manager_needs_a_trusted_key(tmp_path: pathlib.Path) -> None:
    with pytest.raises(errors.KeyFormatError):
        updates.SignedUpdateManager([], tmp_path / "x")


def test_concurrent_installs_are_serialised(tmp_path: pathlib.Path, keys, manager) -> None:
    """Two installers at once (separate flock descriptions): the newer version ends up current either way."""
    v2 = make_update(tmp_path / "v2.snpx", keys[0], "2", seed=2, size=2 << 20)
    v3 = make_update(tmp_path / "v3.snpx", keys[0], "3", seed=3, size=2 << 20)
    outcomes: dict[str, object] = {}

    def install(path: pathlib.Path) -> None:
        try:
            outcomes[path.name] = manager.install_update(path)
        except errors.RollbackRefusedError as e:
            outcomes[path.name] = e

    threads = [threading.Thread(target=install, args=(p,)) for p in (v2, v3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes["v3.snpx"] == "3"
    assert outcomes["v2.snpx"] == "2" or isinstance(outcomes["v2.snpx"], errors.RollbackRefusedError)
    assert manager.current().version == "3"
    assert verify.verify_checkpoint(manager.current().path, [keys[1]]) == (True, [])
    assert len(installed_files(manager)) == (2 if outcomes["v2.snpx"] == "2" else 1)


def test_corrupt_state_file_is_a_typed_error(tmp_path: pathlib.Path, keys, manager) -> None:
    manager.install_update(make_update(tmp_path / "v1.snpx", keys[0], "1"))
    state = pathlib.Path(manager.install_dir, updates.STATE_NAME)
    doc = json.loads(state.read_text())
    doc["current"]["path"] = "../../etc/passwd"
    state.write_text(json.dumps(doc))
    with pytest.raises(errors.StorageError, match="outside versions"):
        manager.current()


# --- a hostile or changing update file --------------------------------------------------------------------


class StagedCopyWatch:
    """Watches the native writer that install_update copies an update into (files under versions/ only), and
    lets a test act as another writer of the source at a chosen point of the copy."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, versions: str) -> None:
        self.opened: list[str] = []
        self.before_append: list = []  # f(start, end) before the bytes [start, end) of the copy are written
        self.after_append: list = []
        watch, real = self, _native.NativeFile

        class Watched(real):  # type: ignore[misc, valid-type]
            def __init__(self, path: str, **kwargs) -> None:
                super().__init__(path, **kwargs)
                self.watched = os.path.dirname(path) == versions
                if self.watched:
                    watch.opened.append(path)

            def append(self, data) -> int:
                start, end = self.size, self.size + memoryview(data).nbytes
                for hook in watch.before_append if self.watched else ():
                    hook(start, end)
                crc = super().append(data)
                for hook in watch.after_append if self.watched else ():
                    hook(start, end)
                return crc

        monkeypatch.setattr(_native, "NativeFile", Watched)


@pytest.fixture
def copy_watch(manager: updates.SignedUpdateManager, monkeypatch: pytest.MonkeyPatch) -> StagedCopyWatch:
    return StagedCopyWatch(monkeypatch, os.path.join(manager.install_dir, updates.VERSIONS_DIR))


def test_a_source_changed_during_the_copy_is_refused_because_the_copy_is_what_is_verified(
        tmp_path: pathlib.Path, keys, manager, copy_watch: StagedCopyWatch) -> None:
    """Another writer flips a weight byte of the source just before the copy reads it and puts it back just
    after: the source verifies again by the end, the staged copy holds the flipped byte. Verifying the source
    instead of the copy would install corrupt weights."""
    manager.install_update(make_update(tmp_path / "v1.snpx", keys[0], "1", seed=1))
    update = make_update(tmp_path / "v2.snpx", keys[0], "2", seed=2, size=5 << 20)  # 20 MiB: several pieces
    with checkpoint.CheckpointReader(update) as r:
        embed = r.entry("embed")
    target = embed.offset + embed.length - 1000  # read by a later piece than the first
    original = update.read_bytes()[target]
    changed: list[str] = []

    def flip(start: int, end: int) -> None:
        if not changed:
            with open(update, "r+b") as f:
                f.seek(target)
                f.write(bytes([original ^ 0x01]))
            changed.append("flipped")

    def restore(start: int, end: int) -> None:
        if changed == ["flipped"] and start <= target < end:
            with open(update, "r+b") as f:
                f.seek(target)
                f.write(bytes([original]))
            changed.append("restored")

    copy_watch.before_append.append(flip)
    copy_watch.after_append.append(restore)
    with pytest.raises(errors.ChecksumMismatchError, match="'embed'") as caught:
        manager.install_update(update)
    assert changed == ["flipped", "restored"] and caught.value.path == str(update)
    assert verify.verify_checkpoint(update, [keys[1]]) == (True, [])  # the source is fine again...
    assert manager.current().version == "1"  # ...and what was copied was refused
    assert len(copy_watch.opened) == 2  # v1's copy and v2's
    assert installed_files(manager) == [os.path.basename(manager.current().path)]  # v2's copy is gone


@pytest.mark.parametrize("update", ["unsigned", "untrusted key", "forged version", "replayed version",
                                    "expired"])
def test_a_refused_update_is_never_copied(tmp_path: pathlib.Path, keys, manager, copy_watch: StagedCopyWatch,
                                          update: str) -> None:
    """The cheap checks (signature over the table, then version and expiry) run on the source before any byte
    of it is copied: a forged or replayed multi-GB file costs one read of its table."""
    manager.install_update(make_update(tmp_path / "v5.snpx", keys[0], "5", seed=5))
    assert len(copy_watch.opened) == 1
    path = tmp_path / "bad.snpx"
    if update == "unsigned":
        make_update(path, None, "6")
    elif update == "untrusted key":
        make_update(path, signing.generate_keypair()[0], "6")
    elif update == "forged version":
        make_update(path, keys[0], "6")
        raw = path.read_bytes().replace(b'"sneppx.version":"6"', b'"sneppx.version":"7"')
        with checkpoint.CheckpointReader(path, verify=False) as r:
            header = r.header
        table = raw[header.table_offset:header.table_offset + header.table_length]
        fixed = dataclasses.replace(header, table_crc32c=_native.crc32c(table))
        path.write_bytes(format.encode_header(fixed) + raw[format.HEADER_SIZE:])  # every CRC right again
        assert checkpoint.validate_checkpoint(path) == (True, [])
    elif update == "replayed version":
        make_update(path, keys[0], "4")
    else:
        make_update(path, keys[0], "6", expires="2027-01-01T00:00:00Z")
    with pytest.raises((errors.SignatureError, errors.UpdateRejectedError)):
        manager.install_update(path)
    assert copy_watch.opened[1:] == [], "the update was copied before it was refused"
    assert manager.current().version == "5"


def test_a_fifo_is_refused_without_blocking_while_the_install_lock_is_held(tmp_path: pathlib.Path, keys,
                                                                          manager) -> None:
    fifo = tmp_path / "update.snpx"
    os.mkfifo(fifo)
    outcome: list[BaseException] = []

    def install() -> None:
        try:
            manager.install_update(fifo)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            outcome.append(e)

    thread = threading.Thread(target=install, daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive():  # blocked in open() holding the lock: let it go, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10)
        pytest.fail("install_update waited for a writer on a FIFO while holding the install lock")
    assert isinstance(outcome[0], errors.CheckpointFormatError) and "FIFO" in str(outcome[0]), outcome
    assert outcome[0].path == str(fifo)
    # the lock was released: the next install goes through
    assert manager.install_update(make_update(tmp_path / "v1.snpx", keys[0], "1")) == "1"


TRUNCATING_CHILD = textwrap.dedent("""
    import os, subprocess, sys
    from SneppX_ALG import _native, errors
    from SneppX_ALG.checkpoint import updates
    pub, install_dir, source = sys.argv[1:4]
    versions = os.path.join(install_dir, updates.VERSIONS_DIR)
    real = _native.NativeFile

    class TruncatedBeforeTheFirstCopy(real):
        def append(self, data):
            if os.path.dirname(self.path) == versions and self.size == 0:
                # another process truncates the source after the checks, as the copy starts
                subprocess.run([sys.executable, "-c", "import os, sys; os.truncate(sys.argv[1], 4096)", source],
                               check=True)
            return super().append(data)

    _native.NativeFile = TruncatedBeforeTheFirstCopy
    manager = updates.SignedUpdateManager([pub], install_dir, clock=lambda: 1_800_000_000.0)
    try:
        manager.install_update(source)
    except errors.SneppXError as e:
        print(type(e).__name__, e)
""")


def test_an_update_truncated_during_the_copy_is_a_typed_error_not_a_sigbus(tmp_path: pathlib.Path, keys) -> None:
    """The installer runs in a child process: a copy through a memory map dies with SIGBUS here."""
    pub = tmp_path / "trusted.pub"
    signing.save_public_key(pub, keys[1])
    install_dir = tmp_path / "installed"
    updates.SignedUpdateManager([pub], install_dir).install_update(make_update(tmp_path / "v1.snpx", keys[0], "1"))
    v2 = make_update(tmp_path / "v2.snpx", keys[0], "2", seed=2, size=3 << 20)  # 12 MiB: more than one piece
    result = subprocess.run([sys.executable, "-c", TRUNCATING_CHILD, str(pub), str(install_dir), str(v2)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, f"the installer died with {result.returncode}: {result.stderr[-2000:]}"
    assert result.stdout.startswith("TruncatedCheckpointError") and "while it was copied" in result.stdout
    assert v2.stat().st_size == 4096  # it really was truncated
    manager = updates.SignedUpdateManager([pub], install_dir)
    assert manager.current().version == "1"
    assert installed_files(manager) == [os.path.basename(manager.current().path)]  # no staged copy left


# --- SIGKILL at seeded points of an install --------------------------------------------------------------

CHILD = textwrap.dedent("""
    import sys
    from SneppX_ALG import _native
    from SneppX_ALG.checkpoint import updates
    manager = updates.SignedUpdateManager([sys.argv[1]], sys.argv[2], clock=lambda: 1_800_000_000.0)
    before = _native.fault_sites_passed()
    if sys.argv[4] == "rollback":
        manager.rollback()
    else:
        manager.install_update(sys.argv[3])
    print(_native.fault_sites_passed() - before)
""")


def run_child(pub: pathlib.Path, install_dir: pathlib.Path, update: pathlib.Path, action: str,
              fault: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "SNEPPX_FAULT"}
    if fault:
        env["SNEPPX_FAULT"] = fault
    return subprocess.run([sys.executable, "-c", CHILD, str(pub), str(install_dir), str(update), action],
                          env=env, capture_output=True, text=True, check=False, timeout=120)


@pytest.mark.parametrize("action, min_sites", [("install", 8), ("rollback", 3)])
def test_sigkill_at_any_io_site_leaves_old_or_new_never_a_mix(tmp_path: pathlib.Path, keys, action: str,
                                                              min_sites: int) -> None:
    pub = tmp_path / "trusted.pub"
    signing.save_public_key(pub, keys[1])
    # 9 MiB so the staging copy spans several native write buffers (each one an I/O site)
    v1 = make_update(tmp_path / "v1.snpx", keys[0], "1", seed=1, size=9 << 20)
    v2 = make_update(tmp_path / "v2.snpx", keys[0], "2", seed=2, size=9 << 20)
    base = tmp_path / "base"
    base_manager = updates.SignedUpdateManager([pub], base)
    base_manager.install_update(v1)
    if action == "rollback":
        base_manager.install_update(v2)
    old, new = base_manager.current().version, ("1" if action == "rollback" else "2")

    def fresh_copy(name: str) -> pathlib.Path:
        target = tmp_path / name
        shutil.copytree(base, target, symlinks=True)
        return target

    clean_dir = fresh_copy("clean")
    clean = run_child(pub, clean_dir, v2, action, None)
    assert clean.returncode == 0, clean.stderr
    sites = int(clean.stdout.strip())
    assert sites >= min_sites, f"{action} passed only {sites} I/O sites"
    assert updates.SignedUpdateManager([pub], clean_dir).current().version == new
    shutil.rmtree(clean_dir)

    points = sorted({1, sites, *random.Random(1234).sample(range(1, sites + 1), min(sites, 10))})
    outcomes = []
    for n in points:
        install_dir = fresh_copy(f"kill-{n}")
        result = run_child(pub, install_dir, v2, action, f"write,fsync,rename,dirsync:{n}:kill")
        assert result.returncode == -signal.SIGKILL, f"site {n}/{sites}: child was not killed: {result.stderr}"
        manager = updates.SignedUpdateManager([pub], install_dir)
        now = manager.current()
        assert now is not None and now.version in (old, new), f"site {n}/{sites}: {now}"
        # whatever is installed verifies completely: never a half-written file
        assert verify.verify_checkpoint(now.path, [pub]) == (True, []), f"site {n}/{sites}"
        outcomes.append(now.version)
        # the next run cleans up what the killed one left and completes
        if now.version == old:
            manager.rollback() if action == "rollback" else manager.install_update(v2)
        assert manager.current().version == new
        leftovers = [n for d in (install_dir, install_dir / updates.VERSIONS_DIR) for n in os.listdir(d)
                     if n.startswith(".tmp-") or updates._is_state_tmp(n)]
        assert leftovers == [], f"site {n}: {leftovers}"
        assert len(os.listdir(install_dir / updates.VERSIONS_DIR)) <= 2
        shutil.rmtree(install_dir)
    # early kills keep the old version, a kill at the last site (after the commit rename) has the new one
    assert outcomes[0] == old and outcomes[-1] == new, outcomes
