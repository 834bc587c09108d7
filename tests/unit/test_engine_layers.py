"""Layer rules of the engine side, read from the source (imports inside functions included):
`core/` imports no torch and no tidepool.outputs, `engine/` never imports entry points, and only
`engine/` steps the EngineCore."""

from __future__ import annotations

import ast
from pathlib import Path

import tidepool

PACKAGE = Path(tidepool.__file__).parent


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _modules(folder: str) -> list[Path]:
    paths = sorted((PACKAGE / folder).glob("*.py"))
    assert paths, folder
    return paths


def test_core_imports_no_torch_and_no_outputs() -> None:
    for path in _modules("core"):
        bad = {n for n in _imports(path) if n.split(".")[0] == "torch" or n == "tidepool.outputs"}
        assert not bad, (path.name, bad)


def test_engine_never_imports_entrypoints() -> None:
    for path in _modules("engine"):
        bad = {n for n in _imports(path) if n.startswith("tidepool.entrypoints")}
        assert not bad, (path.name, bad)


def test_only_the_engine_steps_the_core() -> None:
    """No `<...engine...>.step()` / `<...core...>.step()` call outside engine/."""
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "engine":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            receiver = ast.unparse(node.func.value).lower()
            if node.func.attr == "step" and ("engine" in receiver or "core" in receiver):
                raise AssertionError(f"{path.relative_to(PACKAGE)}:{node.lineno} steps the core")
