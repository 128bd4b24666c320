"""No module of the package imports itself back through others: every ``import`` counts, at module level, under
``TYPE_CHECKING`` or inside a function."""

import ast
from collections.abc import Iterator
from pathlib import Path

import lightning_ckpt_determinism

PACKAGE = Path(lightning_ckpt_determinism.__file__).parent


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imported(name: str, path: Path, modules: dict[str, Path]) -> Iterator[str]:
    """The package's modules ``name`` imports: ``from a import b`` is ``a.b`` when that is a module, else ``a``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            module = (f"{base}.{node.module}" if node.module else base) if node.level else node.module or ""
            yield from (
                f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module for alias in node.names
            )


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: {target for target in _imported(name, path, modules) if target in modules and target != name}
        for name, path in modules.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_every_kind_of_import() -> None:
    graph = _import_graph()
    # The root names the Lightning layer under `TYPE_CHECKING` only; the engine imports the graph scan in a function.
    assert "lightning_ckpt_determinism.lightning.monitor" in graph["lightning_ckpt_determinism"]
    assert (
        "lightning_ckpt_determinism.verify.compiled.graph_scan" in graph["lightning_ckpt_determinism.verify.two_pass"]
    )
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_of_the_package_imports_itself_back() -> None:
    assert _cycles(_import_graph()) == []
