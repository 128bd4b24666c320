"""Recompute contexts that can be entered any number of times: host-RNG replay and buffer protection.

torch enters a region's recompute context each time the region is recomputed: twice under a gradient penalty
(``autograd.grad(..., create_graph=True)`` and then a backward through it) or with ``retain_graph=True``. A
:class:`Reenterable` enters fresh contexts from factories at each entry, so every recomputation starts from the same
state: the same host RNG, the same buffer values.
"""

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack
from typing import Any

import torch
from torch import nn

from lightning_ckpt_determinism.checkpointing.modules import buffer_slots
from lightning_ckpt_determinism.checkpointing.rng import HostRNGState, capture_host_rng, restore_host_rng

__all__ = ["ContextFactory", "HostRNGReplay", "Reenterable", "protected_buffers", "same_context"]

ContextFactory = Callable[[], AbstractContextManager[Any]]
"""Makes a fresh context each time it is called."""


class Reenterable:
    """A context that can be entered any number of times, one entry after another.

    Args:
        factories: Called in order at each entry; their contexts are exited in reverse order.

    Example::

        >>> entered = []
        >>> both = Reenterable([lambda: contextlib.nullcontext(entered.append(1))])
        >>> with both:
        ...     pass
        >>> with both:
        ...     pass
        >>> entered
        [1, 1]
    """

    def __init__(self, factories: list[ContextFactory]) -> None:
        self._factories = factories
        self._entered: list[ExitStack] = []

    def __enter__(self) -> None:
        with ExitStack() as stack:
            for factory in self._factories:
                stack.enter_context(factory())
            self._entered.append(stack.pop_all())

    def __exit__(self, *exc_info: Any) -> bool:
        return bool(self._entered.pop().__exit__(*exc_info))


def same_context(context: AbstractContextManager[Any]) -> AbstractContextManager[Any]:
    """A factory's result for a context that is itself re-enterable, such as a dispatch mode."""
    return context


class HostRNGReplay:
    """Capture Python's and NumPy's RNG at the forward; replay it during each recomputation, then put the live state
    back.

    Example::

        >>> import random
        >>> replay = HostRNGReplay()
        >>> with replay.capture():
        ...     drawn = random.random()
        >>> with replay.replay():
        ...     random.random() == drawn
        True
    """

    def __init__(self) -> None:
        self._state: HostRNGState | None = None

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        self._state = capture_host_rng()
        yield

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        if self._state is None:
            raise RuntimeError("lightning_ckpt_determinism: recomputation ran before the forward it replays.")
        live = capture_host_rng()
        restore_host_rng(self._state)
        try:
            yield
        finally:
            restore_host_rng(live)


@contextlib.contextmanager
def protected_buffers(module: nn.Module) -> Iterator[None]:
    """Let recomputation update copies of the region's buffers, never the buffers themselves.

    Args:
        module: The region.

    Example::

        >>> norm = torch.nn.BatchNorm1d(2)
        >>> with protected_buffers(norm):
        ...     _ = norm(torch.randn(4, 2))
        >>> int(norm.num_batches_tracked)
        0
    """
    originals = list(buffer_slots(module).values())
    try:
        with torch.no_grad():
            for owner, name, buffer in originals:
                owner._buffers[name] = buffer.clone()
        yield
    finally:
        for owner, name, buffer in originals:
            owner._buffers[name] = buffer
