"""Every Sphinx reference in the package's docstrings (``:mod:``, ``:func:``, ``:class:``, ``:meth:``, ``:attr:``,
``:data:``, ``:exc:``, ``:obj:``) names an object that exists, and one of the kind its role says. A ``~`` only
shortens what is shown; a name is looked up in the class it is written in (its attributes, including those only its
instances hold), then its module (whose namespace holds what it imports), then as a full path, then among the
builtins."""

import ast
import builtins
import dataclasses
import importlib
import importlib.util
import inspect
import re
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import lightning_ckpt_determinism

PACKAGE = Path(lightning_ckpt_determinism.__file__).parent

_ROLE = re.compile(r":(mod|func|class|meth|attr|data|exc|obj):`([^`]+)`")
_MISSING = object()
_ON_INSTANCES = object()  # an attribute instances hold, which the class does not

# What each role may name.
_KINDS: dict[str, Callable[[Any], bool]] = {
    "mod": inspect.ismodule,
    "class": inspect.isclass,
    "exc": lambda found: inspect.isclass(found) and issubclass(found, BaseException),
    "func": callable,
    "meth": lambda found: callable(found) or isinstance(found, property),
}


def module_names() -> list[str]:
    """Every module of the package, by its dotted name (found by file: nothing is imported)."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def source_of(module: str) -> str:
    """The text of one of :func:`module_names`."""
    relative = Path(*module.split("."))
    path = PACKAGE.parent / relative.with_suffix(".py")
    return (path if path.exists() else PACKAGE.parent / relative / "__init__.py").read_text()


def docstrings(tree: ast.AST, owner: str | None = None) -> Iterator[tuple[str | None, str, int]]:
    """Every docstring under ``tree`` (of the module, its classes and functions, and the strings that follow an
    assignment), with the qualified name of the class it is written in and its line."""
    body = getattr(tree, "body", [])
    for previous, node in zip([None, *body], body, strict=False):
        text = node.value.value if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) else None
        if isinstance(text, str) and (previous is None or isinstance(previous, ast.Assign | ast.AnnAssign)):
            yield owner, text, node.lineno
        if isinstance(node, ast.ClassDef):
            yield from docstrings(node, f"{owner}.{node.name}" if owner else node.name)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from docstrings(node, owner)


def references(source: str) -> Iterator[tuple[str | None, str, str, int]]:
    """``(owner class, role, target, line)`` of every reference in the docstrings of ``source``."""
    for owner, text, line in docstrings(ast.parse(source)):
        for match in _ROLE.finditer(text):
            target = match[2]
            if target.endswith(">") and "<" in target:  # :role:`shown text <target>`
                target = target[target.rindex("<") + 1 : -1]
            yield owner, match[1], target.strip().lstrip("~").lstrip("."), line


def instance_attributes(cls: type) -> set[str]:
    """What instances of ``cls`` (and its bases) hold without the class holding it: dataclass fields, slots, class
    annotations and every ``self.name = ...`` of its methods."""
    names: set[str] = set()
    for klass in inspect.getmro(cls):
        if klass is object:
            continue
        names.update(getattr(klass, "__annotations__", {}))
        slots = getattr(klass, "__slots__", ())
        names.update([slots] if isinstance(slots, str) else slots)
        if dataclasses.is_dataclass(klass):
            names.update(field.name for field in dataclasses.fields(klass))
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        for node in ast.walk(tree):
            stored = isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
            if stored and isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    return names


def lookup(path: str) -> Any:
    """The object a dotted ``path`` names (a module, then attributes), ``_ON_INSTANCES`` for an attribute only a
    class's instances hold, or ``_MISSING``."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        if "__main__" in parts[:cut]:  # importing it runs the command
            continue
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for position, part in enumerate(parts[cut:], start=cut):
            attribute = getattr(found, part, _MISSING)
            if attribute is _MISSING:
                last = position == len(parts) - 1
                held = last and inspect.isclass(found) and part in instance_attributes(found)
                return _ON_INSTANCES if held else _MISSING
            found = attribute
        return found
    return _MISSING


def resolve(module: str, owner: str | None, target: str) -> Any:
    """What ``target``, written in a docstring of ``owner`` (a class, or ``None``) in ``module``, names."""
    classes = owner.split(".") if owner else []
    scopes = [".".join([module, *classes[:depth]]) for depth in range(len(classes), -1, -1)]
    for candidate in [*(f"{scope}.{target}" for scope in scopes), target]:
        found = lookup(candidate)
        if found is not _MISSING:
            return found
    return getattr(builtins, target, _MISSING)


def unresolved(module: str, source: str) -> list[str]:
    """The references in ``source`` (the text of ``module``) that name nothing, or something of another kind."""
    found = []
    for owner, role, target, line in references(source):
        named = resolve(module, owner, target)
        if named is _MISSING:
            found.append(f"{module}:{line} :{role}:`{target}` names nothing")
        elif named is not _ON_INSTANCES and not _KINDS.get(role, lambda _: True)(named):
            found.append(f"{module}:{line} :{role}:`{target}` names a {type(named).__name__}")
    return found


@pytest.mark.parametrize("module", module_names())
def test_every_docstring_reference_names_an_object(module: str) -> None:
    assert unresolved(module, source_of(module)) == []


def test_the_package_cites_its_objects_by_reference() -> None:
    counts = [sum(1 for _ in references(source_of(module))) for module in module_names()]
    assert sum(counts) > 100


BROKEN = '''
"""See :func:`~lightning_ckpt_determinism.verify._state.StepState` and :mod:`lightning_ckpt_determinism._compile`."""

import torch


class Holder:
    """Holds :attr:`value`, read by :meth:`read`; not :meth:`write`, nor :class:`torch.NoSuchTensor`."""

    def __init__(self) -> None:
        self.value = 1

    def read(self) -> int:
        """:class:`Holder`'s :attr:`value`, see :func:`~lightning_ckpt_determinism.verify.digest.digest`."""
        return self.value


LIMIT = 3
""":data:`LIMIT` is a number, not a :class:`LIMIT`; :exc:`ValueError` is a builtin."""
'''


def test_stale_references_and_references_of_another_kind_are_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "holder_module.py"
    path.write_text(BROKEN)
    spec = importlib.util.spec_from_file_location("holder_module", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "holder_module", module)
    spec.loader.exec_module(module)
    assert unresolved("holder_module", BROKEN) == [
        "holder_module:2 :func:`lightning_ckpt_determinism.verify._state.StepState` names nothing",
        "holder_module:2 :mod:`lightning_ckpt_determinism._compile` names nothing",
        "holder_module:8 :meth:`write` names nothing",
        "holder_module:8 :class:`torch.NoSuchTensor` names nothing",
        "holder_module:19 :class:`LIMIT` names a int",
    ]
