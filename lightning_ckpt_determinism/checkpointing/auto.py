"""``classes: auto``: a model's transformer layers, found without naming their class.

transformers' decoder and encoder layers (5.x) subclass ``GradientCheckpointingLayer``, the layers its own
``gradient_checkpointing_enable()`` checkpoints: where a model has them, they are the choice. Elsewhere the choice is
the repeated blocks of the largest ``nn.ModuleList`` whose modules are all of one class (the ``blocks`` or ``layers``
of a hand-written transformer or CNN), as torchtune and torchtitan checkpoint each transformer block.
"""

from dataclasses import dataclass

from torch import nn

from lightning_ckpt_determinism.checkpointing.modules import named_modules

__all__ = ["auto_layers"]

# Matched by name through the class's bases, so that the choice needs no transformers import.
_TRANSFORMERS_LAYER = "GradientCheckpointingLayer"


@dataclass(frozen=True)
class AutoChoice:
    """What ``classes: auto`` chose in a model.

    Attributes:
        names: The chosen modules' names, in module order (empty when the model has no layers to choose).
        reason: What they are, as the setup line says it.
    """

    names: tuple[str, ...]
    reason: str


def auto_layers(module: nn.Module) -> AutoChoice:
    """The layers ``classes: auto`` checkpoints in ``module``: its transformers ``GradientCheckpointingLayer``
    subclasses (the outermost ones), or else the modules of its largest ``nn.ModuleList`` of one class (the first
    of equal size).

    Args:
        module: The root module; names are relative to it.

    Example::

        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ModuleList(torch.nn.Tanh() for _ in range(3)))
        >>> auto_layers(model)
        AutoChoice(names=('1.0', '1.1', '1.2'), reason='the 3 Tanh of the ModuleList `1`')
    """
    named = [(name, sub) for name, sub in named_modules(module) if name]
    layers: list[str] = []
    for name, sub in named:
        is_layer = any(base.__name__ == _TRANSFORMERS_LAYER for base in type(sub).__mro__)
        if is_layer and not any(name.startswith(outer + ".") for outer in layers):
            layers.append(name)
    if layers:
        classes = sorted({type(sub).__name__ for name, sub in named if name in layers})
        return AutoChoice(tuple(layers), f"transformers' {_TRANSFORMERS_LAYER} ({', '.join(classes)})")
    best: tuple[str, nn.ModuleList] | None = None
    for name, sub in named:
        if not isinstance(sub, nn.ModuleList) or len(sub) < 2 or len({type(child) for child in sub}) > 1:
            continue
        if best is None or len(sub) > len(best[1]):
            best = (name, sub)
    if best is None:
        return AutoChoice((), "no GradientCheckpointingLayer and no ModuleList of one class")
    name, blocks = best
    # The block under its name: the module an FSDP1 unit wraps, not the unit.
    kind = type(dict(named)[f"{name}.0"]).__name__
    return AutoChoice(
        tuple(f"{name}.{index}" for index in range(len(blocks))), f"the {len(blocks)} {kind} of the ModuleList `{name}`"
    )
