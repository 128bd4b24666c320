"""An internal module's ``__all__`` lists only what other modules import from it: other modules of the package, the
tests, the benchmarks, the examples or the docs' scripts. The root's ``__all__`` (and the Lightning layer's, which it
re-exports) is the public surface, held to the API page by tests/test_docs.py."""

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from tests.helpers import REPO

PACKAGE = "lightning_ckpt_determinism"
PUBLIC = {PACKAGE, f"{PACKAGE}.lightning"}


def _name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _exports() -> dict[str, list[str]]:
    found = {}
    for path in (REPO / PACKAGE).rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(target, "id", "") == "__all__" for target in node.targets):
                found[_name(path)] = [element.value for element in node.value.elts]  # type: ignore[attr-defined]
    return found


def _uses(path: Path, modules: set[str]) -> Iterator[tuple[str, str]]:
    """``(module, name)`` for each name ``path`` takes from one of ``modules``: imported, read from the module as an
    attribute, or named in a dotted string."""
    me, text = _name(path), path.read_text()
    tree = ast.parse(text)
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = me if path.name == "__init__.py" else me.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            for alias in node.names:
                if base != me:
                    yield base, alias.name
                if f"{base}.{alias.name}" in modules:
                    aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
        elif isinstance(node, ast.Import):
            aliases.update((alias.asname or alias.name, alias.name) for alias in node.names if alias.name in modules)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            yield aliases[node.value.id], node.attr
    for dotted in re.findall(rf"{PACKAGE}(?:\.\w+)+", text):
        yield tuple(dotted.rsplit(".", 1))  # type: ignore[misc]


def test_every_name_an_internal_module_exports_is_imported_elsewhere() -> None:
    exports = _exports()
    used: dict[str, set[str]] = {module: set() for module in exports}
    for folder in (PACKAGE, "tests", "benchmarks", "examples", "docs"):
        for path in (REPO / folder).rglob("*.py"):
            for module, name in _uses(path, set(exports)):
                used.get(module, set()).add(name)
    unused = {module: sorted(set(names) - used[module]) for module, names in exports.items() if module not in PUBLIC}
    assert {module: names for module, names in unused.items() if names} == {}
    # The walk sees each kind of use: a from-import, a module's attribute, a dotted string.
    assert {"DigestTier", "EXACT"} <= used[f"{PACKAGE}.verify.digest"]
    assert "determinism_checks" in used[f"{PACKAGE}._torch_compat"]
