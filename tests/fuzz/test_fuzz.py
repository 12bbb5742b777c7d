"""Every fuzz target runs a fixed budget in `make test` (SNEPPX_FUZZ_SECONDS each, 4 by default) from its
committed seeds, and must find nothing: a crash, a sanitizer report, an exception other than its typed refusal,
an input slower than the time limit, or memory past its bound fails the test, with the input saved and the
command that replays it. `make fuzz` runs the same targets for as long as asked, keeping what they learn in
$SNEPPX_FUZZ_KEEP (docs/TESTING.md, "Fuzzing")."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from targets import TARGETS

SECONDS = float(os.environ.get("SNEPPX_FUZZ_SECONDS", "4"))
KEEP = os.environ.get("SNEPPX_FUZZ_KEEP")  # a folder for the inputs that grew coverage; else the test's tmp
PER_INPUT_TIMEOUT = 10  # seconds: libFuzzer calls a slower input a crash
RSS_LIMIT_MB = 2048
NATIVE = ["json_scan", "heartbeat", "comm"]  # tests/fuzz/native/fuzz_<name>.c, under ASan and UBSan


def libfuzzer_flags(artifacts: pathlib.Path) -> list[str]:
    return [f"-max_total_time={max(1, round(SECONDS))}", f"-timeout={PER_INPUT_TIMEOUT}",
            f"-rss_limit_mb={RSS_LIMIT_MB}", f"-artifact_prefix={artifacts}/", "-print_final_stats=1"]


def run_fuzzer(command: list[str], name: str, tmp_path: pathlib.Path, seeds: pathlib.Path, replay: str) -> None:
    new_inputs = pathlib.Path(KEEP, name) if KEEP else tmp_path / "new"
    artifacts = tmp_path / "artifacts"
    new_inputs.mkdir(parents=True, exist_ok=True)
    artifacts.mkdir()
    done = subprocess.run([*command, *libfuzzer_flags(artifacts), str(new_inputs), str(seeds)],
                          capture_output=True, text=True, timeout=SECONDS + 600, check=False, cwd=ROOT)
    found = sorted(artifacts.iterdir())
    if KEEP:  # the run's log (libFuzzer's final stats: executions, coverage) and any finding, for triage
        pathlib.Path(KEEP, f"{name}.log").write_text(done.stderr[-20000:])
        for path in found:
            shutil.copy(path, pathlib.Path(KEEP) / f"{name}-{path.name}")
    assert done.returncode == 0 and not found, (
        f"{name} found something: {[p.name for p in found]}; replay: {replay} {found[0] if found else ''}\n"
        f"{done.stderr[-6000:]}")


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_python_target_finds_nothing(name: str, tmp_path: pathlib.Path) -> None:
    command = [sys.executable, str(HERE / "run.py"), name, f"-dict={HERE / 'json.dict'}"]
    run_fuzzer(command, name, tmp_path, HERE / "corpus" / TARGETS[name].corpus,
               f"python tests/fuzz/run.py {name}")


@pytest.fixture(scope="module")
def native_fuzzers(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    if shutil.which("clang") is None:
        pytest.skip("clang is not installed (apt-get install clang; .ci/run installs it): the C targets need "
                    "libFuzzer and the sanitizers")
    out = tmp_path_factory.mktemp("fuzz-build")
    subprocess.run(["bash", str(HERE / "native" / "build.sh"), str(out)], check=True, timeout=600, cwd=ROOT)
    return out


@pytest.mark.parametrize("name", NATIVE)
def test_native_target_finds_nothing(name: str, native_fuzzers: pathlib.Path, tmp_path: pathlib.Path) -> None:
    binary = native_fuzzers / f"fuzz_{name}"
    run_fuzzer([str(binary)], f"c_{name}", tmp_path, HERE / "corpus" / f"c_{name}",
               f"bash tests/fuzz/native/build.sh && build/fuzz/fuzz_{name}")
