"""Buffers a region's forward registers (``register_buffer`` at its first call, a buffer sized by its input)."""

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from lightning_ckpt_determinism._torch_compat import own_buffers

__all__ = ["RegisteredBuffer", "buffer_count", "buffers_left_out", "registered_since"]

RegisteredBuffer = tuple[dict[str, torch.Tensor | None], str]
"""A buffer registered since a region's plan was made: its module's buffer dict and its key there."""


def buffer_count(attributes: Iterable[dict[str, Any]]) -> int:
    """How many buffers the modules whose ``vars`` are ``attributes`` hold (``None`` ones included): a cheap sign,
    read at each call, that a forward registered one.

    Args:
        attributes: The modules' ``vars``.

    Example::

        >>> buffer_count(map(vars, torch.nn.BatchNorm1d(2).modules()))
        3
    """
    return sum(len(own["_buffers"]) for own in attributes)


def registered_since(
    modules: Sequence[nn.Module], known: Iterable[tuple[str, nn.Module, str]]
) -> list[RegisteredBuffer]:
    """The buffers of ``modules`` that are not among the ``known`` slots (name, module, key) of the region's plan.

    Args:
        modules: The region's modules.
        known: The buffers the region's plan was made with.

    Example::

        >>> layer = torch.nn.Linear(2, 2)
        >>> layer.register_buffer("seen", torch.zeros(()))
        >>> [key for _, key in registered_since([layer], [])]
        ['seen']
    """
    slots = {(id(owner), key) for _, owner, key in known}
    return [
        (own_buffers(module), key)
        for module in modules
        for key in own_buffers(module)
        if (id(module), key) not in slots
    ]


@contextlib.contextmanager
def buffers_left_out(registered: Sequence[RegisteredBuffer]) -> Iterator[None]:
    """Leave out, inside this block, the buffers a forward registered, and put the live ones back after it: the
    recomputation of that forward starts, as it did, without them (it registers them again, and they do not take a
    second update), as it starts without the hooks and attributes the forward created.

    Args:
        registered: The buffers the forward registered.

    Example::

        >>> layer = torch.nn.Linear(2, 2)
        >>> layer.register_buffer("seen", torch.ones(()))
        >>> with buffers_left_out(registered_since([layer], [])):
        ...     hasattr(layer, "seen")
        False
        >>> float(layer.seen)
        1.0
    """
    held = [(own, key, own.pop(key)) for own, key in registered if key in own]
    try:
        yield
    finally:
        for own, key, value in held:
            own[key] = value
