"""The operator's fallback for each spec field the API server defaults is the CRD's own `default:` (defaults.py)."""

from __future__ import annotations

import ast
import pathlib
from typing import Any

import pytest
import yaml

from sneppx_operator import defaults

REPO = pathlib.Path(__file__).resolve().parents[3]
OPERATOR = REPO / "operator" / "sneppx_operator"
CRDS = [REPO / "crds" / "sneppx.io_elastictrainingjobs.yaml",
        REPO / "charts" / "sneppx-operator" / "crds" / "sneppx.io_elastictrainingjobs.yaml"]


def crd_defaults(path: pathlib.Path) -> dict[str, Any]:
    """Every scalar `default:` under each version's spec, by dotted path (object defaults are checked against
    their fields' defaults)."""
    found: dict[str, Any] = {}

    def walk(schema: dict[str, Any], prefix: str) -> None:
        for name, sub in (schema.get("properties") or {}).items():
            field = f"{prefix}{name}"
            default = sub.get("default")
            if isinstance(default, dict):
                for key, value in default.items():  # an object's default must agree with its fields' own
                    assert sub["properties"][key].get("default", value) == value, f"{field}.{key}"
            elif default is not None:
                found[field] = default
            walk(sub, field + ".")

    for version in yaml.safe_load(path.read_text())["spec"]["versions"]:
        walk(version["schema"]["openAPIV3Schema"]["properties"]["spec"], "")
    return found


@pytest.mark.parametrize("crd", CRDS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_default_the_operator_uses_is_the_crds(crd: pathlib.Path) -> None:
    in_crd = crd_defaults(crd)
    assert {k: (type(v), v) for k, v in defaults.DEFAULTS.items()} == {k: (type(v), v) for k, v in in_crd.items()}


def test_no_operator_module_writes_a_default_of_its_own() -> None:
    """`.get("saveEveryNSteps", 1000)` anywhere but defaults.py would be a second copy, free to drift."""
    fields = {path.rsplit(".", 1)[-1] for path in defaults.DEFAULTS}
    copies = []
    for path in sorted(OPERATOR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    and len(node.args) == 2 and isinstance(node.args[0], ast.Constant)
                    and node.args[0].value in fields):
                copies.append(f"{path.relative_to(OPERATOR)}:{node.lineno} {ast.unparse(node)}")
    assert copies == []


def test_a_field_present_wins_and_an_absent_one_takes_its_default() -> None:
    assert defaults.field({"maxToKeep": 7}, "checkpoint.maxToKeep") == 7
    assert defaults.field({}, "checkpoint.maxToKeep") == 3
    assert defaults.field({}, "failurePolicy.restartDelay.initialSeconds") == 10
    with pytest.raises(KeyError):
        defaults.field({}, "checkpoint.notAField")
