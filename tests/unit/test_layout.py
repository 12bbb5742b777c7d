"""The runtime's layering rules that import-linter (`.importlinter`, run by `make test`) can't check itself."""

from __future__ import annotations

import ast
import pathlib

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


def test_only_native_imports_the_compiled_library() -> None:
    # The cffi library is a compiled module, absent from import-linter's graph of .py sources.
    importers = sorted(str(p.relative_to(RUNTIME)) for p in RUNTIME.rglob("*.py")
                       if "SneppX_ALG._sneppx_native" in imported_modules(p))
    assert importers == ["_native.py"]


def test_every_runtime_module_says_why_it_exists() -> None:
    missing = sorted(str(p.relative_to(RUNTIME)) for p in RUNTIME.rglob("*.py")
                     if ast.get_docstring(ast.parse(p.read_text())) is None)
    assert missing == []
