"""Every private API of torch, Lightning, torchmetrics and jsonargparse the package uses sits in its compat modules
(`_torch_compat.py`, `_library_compat.py`): an AST walk over every other module finds none."""

import ast
from pathlib import Path

import torch
from torch import nn

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_ckpt_determinism"
COMPAT = {PACKAGE / "_torch_compat.py", PACKAGE / "_library_compat.py"}
LIBRARIES = ("torch", "lightning", "torchmetrics", "jsonargparse", "transformers")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _torch_private_attributes() -> frozenset[str]:
    """The private attribute names of the torch objects the package handles: tensors, modules, op overloads."""
    objects: list[object] = [torch.ones(1), nn.Linear(1, 1), torch.ops.aten.add.Tensor, torch.Generator()]
    return frozenset(name for obj in objects for name in dir(obj) if _private(name)) | {"_orig_mod", "_local_tensor"}


TORCH_PRIVATE = _torch_private_attributes()


def _offences(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
            parts = node.module.split(".")
            names = [alias.name for alias in node.names]
            if any(_private(part) for part in parts) or any(_private(name) for name in names):
                found.append(f"{where}: from {node.module} import {', '.join(names)}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in LIBRARIES and any(_private(p) for p in alias.name.split(".")):
                    found.append(f"{where}: import {alias.name}")
        elif isinstance(node, ast.Call) and _is_reflection(node):
            found.append(f"{where}: {node.func.id}(..., {node.args[1].value!r})")  # type: ignore[attr-defined]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            receiver = node.value
            own = isinstance(receiver, ast.Name) and receiver.id in ("self", "cls")
            rooted_in_library = _root(receiver) in LIBRARIES
            if rooted_in_library or _is_super(receiver) or (not own and node.attr in TORCH_PRIVATE):
                found.append(f"{where}: .{node.attr}")
    return found


def _is_reflection(node: ast.Call) -> bool:
    """``getattr``, ``hasattr`` or ``setattr`` of a private name, on anything but the object itself."""
    reflection = isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr", "setattr")
    if not reflection or len(node.args) < 2:
        return False
    target, name = node.args[0], node.args[1]
    own = isinstance(target, ast.Name) and target.id in ("self", "cls")
    return not own and isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value)


def _is_super(node: ast.expr) -> bool:
    """``super()``: a private name reached through it is a base class's, and the package's classes that call one
    derive from a library's (a strategy's ``super()._setup_model(model)``)."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def test_no_module_outside_the_compat_modules_uses_a_private_api() -> None:
    offences = [offence for path in sorted(PACKAGE.rglob("*.py")) if path not in COMPAT for offence in _offences(path)]
    assert offences == [], "\n".join(offences)


def test_the_walk_finds_each_kind_of_private_use(tmp_path: Path) -> None:
    source = tmp_path / "sample.py"
    source.write_text(
        "import torch._dynamo\n"
        "from torch._C import _get_tracing_state\n"
        "from lightning.pytorch.trainer import _private\n"
        "x = tensor._version + torch._C._current_graph_task_id()\n"
        "y = owner._buffers\n"
        "z = self._buffers\n"
        "w = getattr(module, '_orig_mod', None)\n"
        "v = super()._setup_model(model)\n"
        "u = super().__init__()\n"
    )
    offences = sorted(offence.split(":", 1)[1] for offence in _offences(source, tmp_path))
    assert offences == [
        "1: import torch._dynamo",
        "2: from torch._C import _get_tracing_state",
        "3: from lightning.pytorch.trainer import _private",
        "4: ._C",
        "4: ._current_graph_task_id",
        "4: ._version",
        "5: ._buffers",
        "7: getattr(..., '_orig_mod')",
        "8: ._setup_model",
    ]
