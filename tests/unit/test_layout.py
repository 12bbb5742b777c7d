"""The runtime's layering rules that import-linter (`.importlinter`, run by `make test`) can't check itself."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

RUNTIME = pathlib.Path(__file__).resolve().parents[2] / "runtime" / "SneppX_ALG"


def imported_modules(path: pathlib.Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_only_native_lib_imports_the_compiled_library() -> None:
    # The cffi library is a compiled module, absent from import-linter's graph of .py sources.
    importers = sorted(str(p.relative_to(RUNTIME)) for p in RUNTIME.rglob("*.py")
                       if "SneppX_ALG._sneppx_native" in imported_modules(p))
    assert importers == ["_native/_lib.py"]


def test_every_runtime_module_says_why_it_exists() -> None:
    missing = sorted(str(p.relative_to(RUNTIME)) for p in RUNTIME.rglob("*.py")
                     if ast.get_docstring(ast.parse(p.read_text())) is None)
    assert missing == []


def test_the_operator_and_the_package_root_load_no_numpy() -> None:
    """SneppX_ALG re-exports its API lazily (PEP 562): the operator, which needs the contract and the errors, and a
    bare `import SneppX_ALG` load neither numpy nor the model."""
    code = ("import sys, SneppX_ALG, sneppx_operator.__main__, sneppx_operator.handlers, sneppx_operator.reconcile; "
            "print(sorted(m for m in ('numpy', 'SneppX_ALG.model', 'SneppX_ALG.coordinator') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout


def test_every_public_name_resolves_from_the_package_root() -> None:
    import SneppX_ALG

    assert sorted(SneppX_ALG._EXPORTS) == SneppX_ALG.__all__
    for name in SneppX_ALG.__all__:
        assert getattr(SneppX_ALG, name).__name__ == name
    with pytest.raises(AttributeError):
        SneppX_ALG.NotAName  # noqa: B018 - the lookup is the test
