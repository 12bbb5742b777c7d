"""The operator's settings, command line and module layering (no cluster needed)."""

from __future__ import annotations

import ast
import pathlib

import kopf
import pytest

from SneppX_ALG.contract.env import ENV_RESYNC_SECONDS
from sneppx_operator import __main__ as entry
from sneppx_operator import config
from sneppx_operator.errors import OperatorConfigError

REPO = pathlib.Path(__file__).resolve().parents[3]
OPERATOR = REPO / "operator" / "sneppx_operator"
RUNTIME = REPO / "runtime" / "SneppX_ALG"


def test_settings_add_no_finalizer_post_no_events_and_run_standalone() -> None:
    settings = kopf.OperatorSettings()
    default_finalizer = settings.persistence.finalizer
    config.apply(settings)
    assert settings.persistence.finalizer == default_finalizer != "sneppx.io/finalizer", (
        "kopf must not recognise (and so write) the finalizer older operators put on jobs: the leader removes it"
    )
    assert settings.posting.enabled is False, "kopf's own event posts would bypass the leader's fence"
    assert isinstance(settings.persistence.progress_storage, kopf.AnnotationsProgressStorage)
    assert settings.persistence.progress_storage.prefix == "sneppx.io"
    assert isinstance(settings.persistence.diffbase_storage, kopf.AnnotationsDiffBaseStorage)
    assert settings.persistence.diffbase_storage.prefix == "sneppx.io"
    assert settings.peering.standalone is True


@pytest.mark.parametrize(("raw", "expected"), [("", 10.0), ("2.5", 2.5), ("0.1", 0.1), ("3600", 3600.0)])
def test_resync_interval_from_environment(raw: str, expected: float) -> None:
    assert config.resync_seconds({ENV_RESYNC_SECONDS: raw} if raw else {}) == expected


@pytest.mark.parametrize("raw", ["abc", "0", "-1", "7200", "nan"])
def test_bad_resync_interval_is_a_typed_error(raw: str) -> None:
    with pytest.raises(OperatorConfigError, match="SNEPPX_RESYNC_SECONDS"):
        config.resync_seconds({ENV_RESYNC_SECONDS: raw})


def test_retry_delay_doubles_from_the_resync_interval_and_is_capped() -> None:
    environ = {ENV_RESYNC_SECONDS: "10"}
    assert [config.retry_delay(retry, environ) for retry in range(7)] == [10, 20, 40, 80, 160, 300, 300]
    assert config.retry_delay(10_000, environ) == config.MAX_RETRY_DELAY_SECONDS


def test_command_line_defaults_to_all_namespaces_without_an_election() -> None:
    args = entry.parse_args([])
    assert args.namespace == [] and not args.leader_elect and args.liveness is None
    args = entry.parse_args(["-n", "a", "--namespace", "b", "--leader-elect", "--leader-election-id", "x"])
    assert args.namespace == ["a", "b"] and args.leader_elect and args.leader_election_id == "x"
    assert (args.lease_duration, args.renew_deadline, args.retry_period) == (15.0, 10.0, 2.0), (
        "controller-runtime's timings"
    )


def test_leader_election_timings_must_nest() -> None:
    with pytest.raises(SystemExit, match="retry-period < --renew-deadline < --lease-duration"):
        entry.main(["--leader-elect", "--leader-election-namespace", "ns", "--renew-deadline", "20"])


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


def test_only_k8s_and_the_election_call_the_kubernetes_client() -> None:
    """Every write of a job goes through k8s.py (and its fence); the election's Lease calls are the one thing
    that must not be fenced by the election itself."""
    users = {p.name for p in OPERATOR.rglob("*.py") if "kubernetes" in _top(_imports(p))}
    assert users == {"k8s.py", "leader.py"}


def test_builders_and_reconcile_are_pure() -> None:
    reconcile = [str(p.relative_to(OPERATOR)) for p in sorted((OPERATOR / "reconcile").glob("*.py"))]
    assert reconcile, "the reconcile package is where this test looks for it"
    for name in ("builders.py", *reconcile, "restricted.py"):
        top = _top(_imports(OPERATOR / name))
        assert not top & {"kopf", "kubernetes", "os", "socket", "subprocess", "requests", "secrets"}, name
        modules = _imports(OPERATOR / name)
        assert "sneppx_operator.k8s" not in modules and "sneppx_operator.handlers" not in modules, name


def test_lease_labels_and_owner_from_the_command_line() -> None:
    args = entry.parse_args(["--lease-label", "a=b", "--lease-label=c/d=e=f", "--lease-owner-deployment", "op"])
    assert dict(args.lease_label) == {"a": "b", "c/d": "e=f"} and args.lease_owner_deployment == "op"
    assert entry.parse_args([]).lease_owner_deployment is None
    with pytest.raises(SystemExit):
        entry.parse_args(["--lease-label", "no-equals-sign"])
