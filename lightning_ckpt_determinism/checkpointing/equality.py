"""Whether state kept its value: tensors by shape, dtype and elements, anything else by identity or ``==``.

The probe of a region's first call and the checks read it alike: NaN in the same place on both sides, or the same
infinity, counts as equal. DTensors are compared as this rank's local shards, so no comparison runs a collective.
"""

from typing import Any

import torch

from lightning_ckpt_determinism.checkpointing.modules import local_tensor

__all__ = ["same_item", "same_values"]


def same_values(expected: torch.Tensor, actual: torch.Tensor) -> bool:
    """Whether two tensors have the same shape, dtype and values (NaN equal to NaN).

    Args:
        expected: One tensor (a DTensor is read as this rank's shard).
        actual: The other.

    Example::

        >>> same_values(torch.tensor([float("nan")]), torch.tensor([float("nan")]))
        True
    """
    expected, actual = local_tensor(expected), local_tensor(actual)
    if expected.shape != actual.shape or expected.dtype != actual.dtype:
        return False
    if torch.equal(expected, actual):
        return True
    if not (expected.is_floating_point() or expected.is_complex()):
        return False
    if expected.is_complex():
        expected, actual = torch.view_as_real(expected.detach()), torch.view_as_real(actual.detach())
    return bool(((expected == actual) | (expected.isnan() & actual.isnan())).all())


def same_item(first: Any, second: Any) -> bool:
    """Identity, or equal values: tensors by :func:`same_values`, anything else of one type by a usable ``==``.

    Args:
        first: One value (an attribute, a container's item).
        second: The other.

    Example::

        >>> same_item(1, 1), same_item(1, 1.0), same_item(torch.ones(2), torch.ones(2))
        (True, False, True)
    """
    if first is second:
        return True
    if isinstance(first, torch.Tensor) or isinstance(second, torch.Tensor):
        return isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor) and same_values(first, second)
    try:
        return type(first) is type(second) and bool(first == second)
    except Exception:  # a value whose `==` is not a truth value
        return False
