"""Gradients as a check reads them: set aside and put back, and read as this rank's shard of them."""

from collections.abc import Sequence
from typing import Any

import torch

from lightning_ckpt_determinism.checkpointing.modules import local_tensor

__all__ = ["GradientStash", "counted_here", "local_tensor", "set_gradient", "take_gradients"]

_DTensor: Any = None
if torch.distributed.is_available():  # a build without torch.distributed has no DTensor
    from torch.distributed.tensor import DTensor as _DTensor


def counted_here(tensor: torch.Tensor) -> bool:
    """Whether this rank's shard of ``tensor`` counts in sums over all ranks.

    A DTensor replicated along a mesh dimension holds the same values on every rank of that dimension: only the
    rank at coordinate 0 counts it, so a sum over all ranks counts each value once. Plain tensors count everywhere
    (under DDP each rank holds its own gradient, or the same all-reduced one, which scales a relative norm by
    nothing).

    Example::

        >>> counted_here(torch.ones(2))
        True
    """
    if _DTensor is None or not isinstance(tensor, _DTensor):
        return True
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:  # this rank holds no part of it
        return False
    return all(
        not placement.is_replicate() or position == 0
        for placement, position in zip(tensor.placements, coordinate, strict=True)
    )


def take_gradients(params: Sequence[torch.Tensor], *, clone: bool = False) -> list[torch.Tensor | None]:
    """The gradients a pass left in the parameters' ``.grad``, as this rank's tensors, each ``.grad`` left ``None``
    for the next pass.

    Args:
        params: The parameters.
        clone: Return copies: needed where the next backward writes into the same storage (DDP's bucket views).

    Example::

        >>> weight = torch.nn.Parameter(torch.ones(2))
        >>> (weight * 3).sum().backward()
        >>> take_gradients([weight]), weight.grad
        ([tensor([3., 3.])], None)
    """
    grads = []
    for param in params:
        grad = None if param.grad is None else local_tensor(param.grad)
        grads.append(grad.detach().clone() if clone and grad is not None else grad)
        param.grad = None
    return grads


def set_gradient(param: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Give ``param`` the gradient ``grad`` (or none), also where their shapes differ: FSDP1 keeps the unsharded
    gradient on a sharded original parameter while it accumulates without reducing (``no_sync``), set as FSDP1 sets
    it, through ``.data`` (a plain assignment refuses another shape).

    Args:
        param: The parameter.
        grad: Its gradient, or ``None``.

    Example::

        >>> weight = torch.nn.Parameter(torch.ones(2))
        >>> set_gradient(weight, torch.full((2,), 3.0))
        >>> weight.grad
        tensor([3., 3.])
    """
    if grad is None or grad.shape == param.shape:
        param.grad = grad
        return
    param.grad = torch.empty_like(param)
    param.grad.data = grad


class GradientStash:
    """The ``.grad`` of some parameters, set aside so that another backward starts from none, and put back after.

    Args:
        params: The parameters.
        clone: Keep copies rather than the gradient tensors themselves: needed where the next backward writes into
            the same storage (DDP with ``gradient_as_bucket_view=True`` writes every gradient into its buckets; given
            a gradient that is not a bucket view, it copies it into the bucket at the next backward).

    Example::

        >>> weight = torch.nn.Parameter(torch.ones(2))
        >>> (weight * 3).sum().backward()
        >>> stash = GradientStash([weight])
        >>> weight.grad is None
        True
        >>> stash.put_back()
        >>> weight.grad
        tensor([3., 3.])
    """

    def __init__(self, params: Sequence[torch.Tensor], clone: bool = False) -> None:
        self._params = params
        with torch.no_grad():
            self._grads = [
                param.grad.detach().clone() if clone and param.grad is not None else param.grad for param in params
            ]
        for param in params:
            param.grad = None

    @property
    def gradients(self) -> list[torch.Tensor | None]:
        """The gradients set aside, in the order of the parameters."""
        return list(self._grads)

    def put_back(self) -> None:
        """Give every parameter its gradient back; can be called any number of times."""
        for param, grad in zip(self._params, self._grads, strict=True):
            set_gradient(param, grad)
