"""The operator's settings, command line and module layering (no cluster needed)."""

from __future__ import annotations

import ast
import pathlib

import kopf
import pytest

from SneppX_ALG import errors
from sneppx_operator import __main__ as entry
from sneppx_operator import config

REPO = pathlib.Path(__file__).resolve().parents[2]
OPERATOR = REPO / "operator" / "sneppx_operator"
RUNTIME = REPO / "runtime" / "SneppX_ALG"


def test_settings_set_finalizer_annotations_and_standalone() -> None:
    settings = kopf.OperatorSettings()
    config.apply(settings)
    assert settings.persistence.finalizer == "sneppx.io/finalizer"
    assert isinstance(settings.persistence.progress_storage, kopf.AnnotationsProgressStorage)
    assert settings.persistence.progress_storage.prefix == "sneppx.io"
    assert isinstance(settings.persistence.diffbase_storage, kopf.AnnotationsDiffBaseStorage)
    assert settings.persistence.diffbase_storage.prefix == "sneppx.io"
    assert settings.peering.standalone is True


def test_explicit_peering_is_left_on() -> None:
    settings = kopf.OperatorSettings()
    settings.peering.mandatory = True
    config.apply(settings)
    assert settings.peering.standalone is False


@pytest.mark.parametrize(("raw", "expected"), [("", 10.0), ("2.5", 2.5), ("0.1", 0.1), ("3600", 3600.0)])
def test_resync_interval_from_environment(raw: str, expected: float) -> None:
    assert config.resync_seconds({config.RESYNC_ENV: raw} if raw else {}) == expected


@pytest.mark.parametrize("raw", ["abc", "0", "-1", "7200", "nan"])
def test_bad_resync_interval_is_a_typed_error(raw: str) -> None:
    with pytest.raises(errors.OperatorConfigError, match="SNEPPX_RESYNC_SECONDS"):
        config.resync_seconds({config.RESYNC_ENV: raw})


def test_retry_delay_doubles_from_the_resync_interval_and_is_capped() -> None:
    environ = {config.RESYNC_ENV: "10"}
    assert [config.retry_delay(retry, environ) for retry in range(7)] == [10, 20, 40, 80, 160, 300, 300]
    assert config.retry_delay(10_000, environ) == config.MAX_RETRY_DELAY_SECONDS


def test_command_line_defaults_to_all_namespaces_without_peering() -> None:
    args = entry.parse_args([])
    assert args.namespace == [] and args.peering is None and args.liveness is None
    args = entry.parse_args(["-n", "a", "--namespace", "b", "--peering", "p"])
    assert args.namespace == ["a", "b"] and args.peering == "p"


def _imports(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _top(names: set[str]) -> set[str]:
    return {name.split(".")[0] for name in names}


def test_runtime_never_imports_the_operator() -> None:
    for path in RUNTIME.rglob("*.py"):
        assert "sneppx_operator" not in _top(_imports(path)), f"{path} imports the operator"


def test_only_k8s_module_calls_the_kubernetes_client() -> None:
    users = {p.name for p in OPERATOR.glob("*.py") if "kubernetes" in _top(_imports(p))}
    assert users == {"k8s.py"}


def test_builders_and_reconcile_are_pure() -> None:
    for name in ("builders.py", "reconcile.py", "restricted.py"):
        top = _top(_imports(OPERATOR / name))
        assert not top & {"kopf", "kubernetes", "os", "socket", "subprocess", "requests", "secrets"}, name
        modules = _imports(OPERATOR / name)
        assert "sneppx_operator.k8s" not in modules and "sneppx_operator.handlers" not in modules, name
