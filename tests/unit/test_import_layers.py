"""The layer rules of issue 13, read statically from the source (no module is imported).

Every `import` counts, also those inside functions: a lazy import still ties the two modules
together and a cycle through one fails only on some code paths. Imports under `if TYPE_CHECKING:`
never run, so they count for the layer rules but not for cycles.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "tidepool"
MAX_MODULE_LINES = 500


@dataclass(frozen=True)
class Import:
    """One import statement of one module."""

    target: str
    """The imported module's dotted name (a tidepool submodule where `from x import y` names one)."""
    line: int
    """Line of the statement in the importing module."""
    type_only: bool
    """Under `if TYPE_CHECKING:`: never runs."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((SRC / PACKAGE).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _ImportCollector(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, known: set[str]) -> None:
        self.package = module if is_package else module.rpartition(".")[0]
        self.known = known
        self.imports: list[Import] = []
        self._type_only = 0

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            self._type_only += 1
            for child in node.body:
                self.visit(child)
            self._type_only -= 1
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def _add(self, target: str, line: int) -> None:
        self.imports.append(Import(target, line, self._type_only > 0))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")
            base = base[: len(base) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        for alias in node.names:
            submodule = f"{module}.{alias.name}"
            # `from tidepool.models import bert` imports the module bert, not the package.
            self._add(submodule if submodule in self.known else module, node.lineno)


def _import_graph() -> dict[str, list[Import]]:
    modules = _modules()
    known = set(modules)
    graph: dict[str, list[Import]] = {}
    for name, path in modules.items():
        collector = _ImportCollector(name, path.name == "__init__.py", known)
        collector.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        graph[name] = collector.imports
    return graph


GRAPH = _import_graph()


def _cycles(graph: dict[str, list[Import]], type_only: bool = False) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), over runtime imports
    (and those under `if TYPE_CHECKING:` too with `type_only`)."""
    edges = {
        module: sorted(
            {i.target for i in imports if i.target in graph and (type_only or not i.type_only)}
        )
        for module, imports in graph.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in edges[module]:
            if target not in index:
                connect(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            connect(module)
    return sorted(components)


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _violations(importer: str, forbidden: tuple[str, ...]) -> list[str]:
    """`module:line -> target` for every import from a module under `importer` into `forbidden`."""
    found = {
        f"{module}:{i.line} -> {i.target}"
        for module, imports in GRAPH.items()
        if _within(module, importer)
        for i in imports
        if any(_within(i.target, f) for f in forbidden)
    }
    return sorted(found)


def _layer(importer: str, *forbidden: str):  # noqa: ANN202
    return pytest.param(importer, forbidden, id=importer)


# What runs requests: nothing below the worker may see a request, a schedule or an entry point.
_ABOVE_MODELS = (
    "tidepool.request",
    "tidepool.core",
    "tidepool.worker",
    "tidepool.engine",
    "tidepool.entrypoints",
)


def test_the_walker_sees_lazy_and_relative_imports() -> None:
    """Guard: a walker that found nothing would pass every rule below."""
    tree = ast.parse(
        "from . import envs\nfrom .models.loader import x\n"
        "def f():\n    import torch\n    from tidepool.models import bert\n"
        "if TYPE_CHECKING:\n    from tidepool.engine import engine_core\n"
    )
    collector = _ImportCollector("tidepool.config", False, set(_modules()))
    collector.visit(tree)
    assert [(i.target, i.type_only) for i in collector.imports] == [
        ("tidepool.envs", False),
        ("tidepool.models.loader", False),
        ("torch", False),
        ("tidepool.models.bert", False),
        ("tidepool.engine.engine_core", True),
    ]
    assert len(GRAPH) > 40 and sum(len(v) for v in GRAPH.values()) > 200
    assert _cycles({"a": [Import("b", 1, False)], "b": [Import("a", 1, False)]}) == [["a", "b"]]
    typed = {"a": [Import("b", 1, True)], "b": [Import("a", 1, False)]}
    assert _cycles(typed) == [] and _cycles(typed, type_only=True) == [["a", "b"]]


def test_no_import_cycles() -> None:
    assert _cycles(GRAPH) == []


def test_no_type_checking_cycles() -> None:
    """A cycle that exists only for the type checker still ties the modules' designs together
    (each needs the other to be read)."""
    assert _cycles(GRAPH, type_only=True) == []


def test_no_cycles_among_model_loading() -> None:
    """config, the resolver, the registry and the transformers backend import downwards only."""
    loading = (
        "tidepool.models",
        "tidepool.checkpoint",
        "tidepool.model_loader",
        "tidepool.transformers_backend",
        "tidepool.quantization",
        "tidepool.kernels",
        "tidepool.output_heads",
    )
    models = {m for m in GRAPH if any(_within(m, p) for p in loading) or m == "tidepool.config"}
    assert [c for c in _cycles(GRAPH) if set(c) & models] == []


@pytest.mark.parametrize(
    ("importer", "forbidden"),
    [
        _layer(
            "tidepool.config",
            "tidepool.models",
            "tidepool.worker",
            "tidepool.engine",
            "tidepool.entrypoints",
        ),
        _layer(
            "tidepool.core",
            "torch",
            "tidepool.outputs",
        ),
        # models/ holds architectures only: loading, the Hugging Face paths and int8 sit above it.
        _layer(
            "tidepool.models",
            *_ABOVE_MODELS,
            "tidepool.checkpoint",
            "tidepool.model_loader",
            "tidepool.transformers_backend",
            "tidepool.quantization",
            "tidepool.output_heads",
        ),
        _layer(
            "tidepool.attention",
            *_ABOVE_MODELS,
            "tidepool.models",
            "tidepool.checkpoint",
            "tidepool.model_loader",
            "tidepool.transformers_backend",
            "tidepool.quantization",
        ),
        # Reading a checkpoint (a folder, the cache, the Hub) knows nothing of models or tensors' use.
        _layer(
            "tidepool.checkpoint",
            *_ABOVE_MODELS,
            "tidepool.models",
            "tidepool.attention",
            "tidepool.model_loader",
            "tidepool.transformers_backend",
            "tidepool.quantization",
        ),
        _layer(
            "tidepool.transformers_backend",
            *_ABOVE_MODELS,
            "tidepool.model_loader",
            "tidepool.quantization",
        ),
        _layer(
            "tidepool.quantization",
            *_ABOVE_MODELS,
            "tidepool.checkpoint",
            "tidepool.model_loader",
            "tidepool.transformers_backend",
        ),
        _layer("tidepool.model_loader", *_ABOVE_MODELS),
        # Images as the engine sees them: below the request (which carries their features), the
        # worker (which encodes them) and the engine (whose input processor makes them).
        _layer(
            "tidepool.multimodal",
            *_ABOVE_MODELS,
            "tidepool.models",
            "tidepool.model_loader",
            "tidepool.transformers_backend",
            "tidepool.quantization",
            "tidepool.checkpoint",
        ),
        # One object per output head: below the pooler, the resolver and the refusals that read
        # it; above the models whose protocols it names.
        _layer(
            "tidepool.output_heads",
            *_ABOVE_MODELS,
            "tidepool.checkpoint",
            "tidepool.model_loader",
            "tidepool.transformers_backend",
            "tidepool.quantization",
        ),
        _layer(
            "tidepool.engine",
            "tidepool.entrypoints",
        ),
        _layer("tidepool.worker", "tidepool.engine", "tidepool.entrypoints"),
        # entry points (the CLI) run jobs; jobs (the Ray runner) use ray/'s Predictor; both reach
        # the offline LLM through ray/pooling.py's OfflineLLM, never through entrypoints/.
        _layer("tidepool.jobs", "tidepool.entrypoints"),
        _layer("tidepool.ray", "tidepool.jobs", "tidepool.entrypoints"),
        _layer("tidepool.outputs", "tidepool.core"),
    ],
)
def test_layer_rules(importer: str, forbidden: tuple[str, ...]) -> None:
    assert _violations(importer, forbidden) == []


def test_no_module_over_500_lines() -> None:
    long = {
        name: n
        for name, path in _modules().items()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_kernels_is_a_leaf() -> None:
    """The CPU-feature module and the kernels' build reach no tidepool module but envs."""
    assert _violations("tidepool.kernels", (PACKAGE,)) == _violations(
        "tidepool.kernels", ("tidepool.envs", "tidepool.kernels")
    )


def test_config_is_a_leaf() -> None:
    """config.py reaches no tidepool module but the leaves envs and devices, which reach none."""
    leaves = ("tidepool.envs", "tidepool.devices")
    assert _violations("tidepool.config", (PACKAGE,)) == _violations("tidepool.config", leaves)
    for leaf in leaves:
        assert _violations(leaf, (PACKAGE,)) == []


def test_only_the_engine_steps_the_core() -> None:
    """No `<...engine...>.step()` / `<...core...>.step()` call outside engine/: the driver
    (engine/llm_engine.py) is the one loop that steps EngineCore and routes its outputs."""
    for name, path in _modules().items():
        if _within(name, "tidepool.engine"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            receiver = ast.unparse(node.func.value).lower()
            if node.func.attr == "step" and ("engine" in receiver or "core" in receiver):
                raise AssertionError(f"{name}:{node.lineno} steps the core")


def _private_methods() -> set[str]:
    """Names of the `_private` methods tidepool's classes define."""
    names = set()
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                names.update(
                    item.name
                    for item in node.body
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                    and item.name.startswith("_")
                    and not item.name.endswith("__")
                )
    return names


class _PrivateCalls(ast.NodeVisitor):
    """`obj._name(...)` where `_name` is one of tidepool's private methods and `obj` is not
    `self`, `cls`, `super()` or the enclosing class by name (torch's own `_ops` are not ours)."""

    def __init__(self, private: set[str]) -> None:
        self.private = private
        self.classes: list[str] = []
        self.found: list[tuple[int, str]] = []

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes.append(node.name)
        self.generic_visit(node)
        self.classes.pop()

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in self.private:
            receiver = func.value
            own = {"self", "cls", *self.classes}
            is_super = isinstance(receiver, ast.Call) and ast.unparse(receiver.func) == "super"
            if not (isinstance(receiver, ast.Name) and receiver.id in own) and not is_super:
                self.found.append((node.lineno, ast.unparse(func)))
        self.generic_visit(node)


def test_the_private_call_walker_sees_calls_on_other_objects() -> None:
    calls = _PrivateCalls({"_run", "_make"})
    calls.visit(
        ast.parse(
            "class A:\n    def f(self, other):\n        self._run(); A._make(); other._run()\n"
            "def g(serving):\n    serving.engine._run(); serving._other()\n"
        )
    )
    assert calls.found == [(3, "other._run"), (5, "serving.engine._run")]


def test_no_module_calls_another_objects_private_methods() -> None:
    """A class's `_private` methods are its own: a module that needs one needs a public one."""
    private = _private_methods()
    found = []
    for name, path in _modules().items():
        calls = _PrivateCalls(private)
        calls.visit(ast.parse(path.read_text(encoding="utf-8")))
        found += [f"{name}:{line} {call}" for line, call in calls.found]
    assert found == []
