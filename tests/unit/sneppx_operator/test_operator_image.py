"""The Dockerfile, read without building it (tests/image builds and runs it, where buildah can be had):
multi-stage, compiler only in the build stage, a numeric non-root user, and every path it copies exists
and gets past .dockerignore."""

from __future__ import annotations

import fnmatch
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[3]
DOCKERFILE = (REPO / "Dockerfile").read_text()


def stages() -> list[str]:
    return re.split(r"^FROM\s", DOCKERFILE, flags=re.MULTILINE)[1:]


def instructions(stage: str, name: str) -> list[str]:
    joined = re.sub(r"\\\n", " ", stage)
    return [line.split(None, 1)[1] for line in joined.splitlines() if line.startswith(f"{name} ")]


def test_build_and_runtime_stages_are_separate() -> None:
    build, runtime = stages()
    assert " AS build" in build.splitlines()[0]
    assert "gcc" in " ".join(instructions(build, "RUN")), "the build stage compiles the native core"
    assert "pip wheel" in " ".join(instructions(build, "RUN"))
    assert "gcc" not in runtime, "no compiler in the runtime image"
    assert "--no-index" in " ".join(instructions(runtime, "RUN")), (
        "the runtime installs only the built wheels"
    )


def test_runtime_runs_as_a_numeric_non_root_user() -> None:
    (user,) = instructions(stages()[-1], "USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) > 0 and gid.isdigit() and int(gid) > 0
    chart_values = (REPO / "charts" / "sneppx-operator" / "values.yaml").read_text()
    assert f"runAsUser: {uid}" in chart_values, "the chart must run as the image's user"


def test_default_command_runs_the_operator() -> None:
    (cmd,) = instructions(stages()[-1], "CMD")
    assert cmd == '["python", "-m", "sneppx_operator"]'


def _ignored(path: str, patterns: list[str]) -> bool:
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(path, f"{pattern}/*"):
            ignored = not negate
    return ignored


def test_copied_sources_exist_and_pass_dockerignore() -> None:
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copied = [src for copy in instructions(stages()[0], "COPY") for src in copy.split()[:-1]]
    assert {"pyproject.toml", "setup.py", "native/", "runtime/", "operator/"} <= set(copied)
    for source in copied:
        assert (REPO / source).exists(), f"Dockerfile copies {source}, which does not exist"
        assert not _ignored(source.rstrip("/"), patterns), f".dockerignore drops {source}"
    native_sources = [str(p.relative_to(REPO)) for p in (REPO / "native" / "src").glob("*.c")]
    assert native_sources and not any(_ignored(p, patterns) for p in native_sources)
    assert _ignored("runtime/SneppX_ALG/_sneppx_native.abi3.so", patterns), (
        "a host-built .so must not leak in"
    )
    assert _ignored(".venv/bin/python", patterns)
