"""tests/tools/build.sh run twice at once (two checkouts' `make test`, or a test that builds while another does):
the second waits for the first and finds the binary. Real processes, a copy of the script and of the pinned
go.mod files, and a stand-in `go` on PATH that writes a file where `-o` says, once the test lets it; no network."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import time
from collections.abc import Callable

HERE = pathlib.Path(__file__).resolve().parent

# The stand-in: records each run, then waits for the test's go-ahead (or fails when told to), then "links".
FAKE_GO = r"""#!/usr/bin/env bash
set -eu
n=$(mktemp "$FAKE_GO_STATE/started.XXXXXX")
while [ ! -e "$FAKE_GO_STATE/release" ]; do sleep 0.05; done
[ ! -e "$FAKE_GO_STATE/fail" ] || exit 1
out=""
while [ $# -gt 0 ]; do
  if [ "$1" = "-o" ]; then out=$2; shift; fi
  shift
done
printf 'binary from %s\n' "$n" > "$out"
chmod +x "$out"
"""


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 60) -> None:
    """Poll until predicate() holds; the timeout is a failure bound only."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.05)


def blocked_on_a_lock(session: int) -> bool:
    """Whether a process of this session waits for a flock (a `->` line of /proc/locks names the waiter)."""
    for line in pathlib.Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if len(fields) > 5 and fields[1] == "->" and fields[2] == "FLOCK":
            try:
                if os.getpgid(int(fields[5])) == session:
                    return True
            except ProcessLookupError:
                continue
    return False


def setup(tmp_path: pathlib.Path) -> tuple[pathlib.Path, dict[str, str], pathlib.Path]:
    tools = tmp_path / "tools"
    for go_mod in HERE.glob("*/go.mod"):
        (tools / go_mod.parent.name).mkdir(parents=True)
        shutil.copy(go_mod, tools / go_mod.parent.name / "go.mod")
    shutil.copy(HERE / "build.sh", tools / "build.sh")
    fake_bin = tmp_path / "fake-bin"
    fake_bin.mkdir()
    (fake_bin / "go").write_text(FAKE_GO)
    (fake_bin / "go").chmod(0o755)
    state = tmp_path / "state"
    state.mkdir()
    env = {
        **os.environ,
        "PATH": f"{fake_bin}:{os.environ['PATH']}",
        "SNEPPX_CACHE": str(tmp_path / "cache"),
        "FAKE_GO_STATE": str(state),
    }
    return tools / "build.sh", env, state


def start_build(script: pathlib.Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["bash", str(script), "versitygw"], env=env, text=True, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )


def started(state: pathlib.Path) -> int:
    return len(list(state.glob("started.*")))


def test_a_second_build_at_the_same_time_waits_for_the_first_and_finds_its_binary(tmp_path: pathlib.Path) -> None:
    script, env, state = setup(tmp_path)
    first = start_build(script, env)
    second = None
    try:
        wait_until(lambda: started(state) == 1 or first.poll() is not None, "the first build's go to start")
        assert first.poll() is None, first.communicate()
        second = start_build(script, env)
        # Either event shows where the second build went: into go itself, or to wait on the first one's lock.
        wait_until(
            lambda: started(state) > 1 or blocked_on_a_lock(second.pid) or second.poll() is not None,
            "the second build to reach go or wait for the first",
        )
        (state / "release").touch()
        outputs = [build.communicate(timeout=60) for build in (first, second)]
    finally:
        for build in (first, second):
            if build is not None and build.poll() is None:
                build.kill()
    cache = tmp_path / "cache" / "bin"
    assert [first.returncode, second.returncode] == [0, 0], outputs
    assert started(state) == 1, "the second build ran go instead of waiting for the first"
    assert [out.strip().splitlines()[-1] for out, _ in outputs] == [str(cache)] * 2
    binary = cache / "versitygw"
    assert os.access(binary, os.X_OK) and binary.read_text().startswith("binary from")
    assert not list(cache.glob("*.tmp*")), "a temporary build output was left behind"


def test_a_failed_build_leaves_nothing_behind_and_the_next_one_builds(tmp_path: pathlib.Path) -> None:
    script, env, state = setup(tmp_path)
    (state / "release").touch()
    (state / "fail").touch()
    failed = subprocess.run(["bash", str(script), "versitygw"], env=env, capture_output=True, text=True, check=False)
    assert failed.returncode != 0
    cache = tmp_path / "cache" / "bin"
    left = [p.name for p in cache.iterdir() if not p.name.endswith(".lock")]
    assert left == [], "a failed build left a binary or its temporary output"
    (state / "fail").unlink()
    built = subprocess.run(["bash", str(script), "versitygw"], env=env, capture_output=True, text=True, check=False)
    assert built.returncode == 0, built.stderr
    assert os.access(cache / "versitygw", os.X_OK)
