"""How the package names and walks a model's modules: region names as configs write them, and buffers by name."""

from collections.abc import Iterator

import torch
from torch import nn

from lightning_ckpt_determinism._torch_compat import OptimizedModule

__all__ = ["buffer_slots", "named_modules", "region_name"]


def region_name(name: str) -> str:
    """A module or parameter name as users write it: without the ``_orig_mod`` a ``torch.compile`` wrapper adds.

    Args:
        name: A dotted name from ``named_modules()`` or ``named_parameters()``.

    Example::

        >>> region_name("model._orig_mod.blocks.0")
        'model.blocks.0'
    """
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def named_modules(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``module.named_modules()`` by region name, without the compile wrappers: each shares its name with the module
    it compiles, which is the one to select and report.

    Args:
        module: The root module.

    Example::

        >>> model = torch.nn.Sequential(torch.compile(torch.nn.Linear(2, 2)))
        >>> [(name, type(sub).__name__) for name, sub in named_modules(model)]
        [('', 'Sequential'), ('0', 'Linear')]
    """
    for name, sub in module.named_modules():
        if not isinstance(sub, OptimizedModule):
            yield region_name(name), sub


def buffer_slots(module: nn.Module) -> dict[str, tuple[nn.Module, str, torch.Tensor]]:
    """Each buffer of ``module`` by its name, with the module that holds it and its key there.

    Args:
        module: The root module.

    Example::

        >>> list(buffer_slots(torch.nn.BatchNorm1d(2)))
        ['running_mean', 'running_var', 'num_batches_tracked']
    """
    slots = {}
    for prefix, owner in module.named_modules():
        for key, buffer in owner._buffers.items():
            if buffer is not None:
                slots[f"{prefix}.{key}" if prefix else key] = (owner, key, buffer)
    return slots
