"""The states of DDP's communication hooks around a check's reference pass.

A stateful hook (PowerSGD's error feedback, iteration count and warm-start factors) advances at every backward that
goes through DDP's reducer, the reference pass's too. The reference runs from copies of the state's data as the live
step started from it, so that it compresses as the live step did; after the check the state holds its live objects
again, those the live step left, so that training goes on as without the check.
"""

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from lightning_ckpt_determinism._torch_compat import comm_hook_states

__all__ = ["CommHookStates"]

_SCALARS = (type(None), bool, int, float, complex, str)


class CommHookStates:
    """The data of every communication hook state registered on a DDP module, copied now: the fields that hold
    numbers, strings, tensors (not parameters), NumPy random states, torch generators, and tuples, lists and dicts of
    these. Other fields (process groups, device meshes, modules, objects of a user's own) are never copied nor set.

    Args:
        module: The DDP module; any other, or ``None``, holds no hook and costs nothing.

    Example::

        >>> states = CommHookStates(torch.nn.Linear(2, 2))  # not a DDP module: no hook, nothing copied
        >>> with states.replaying() as start_over:
        ...     start_over()
    """

    def __init__(self, module: nn.Module | None) -> None:
        states = comm_hook_states(module) if module is not None else []
        self._copies = [(state, _data_fields(state)) for state in states]

    @contextlib.contextmanager
    def replaying(self) -> Iterator[Callable[[], None]]:
        """Inside this block, the function it gives sets fresh copies of the captured data on each state (call it
        before each reference pass); after it, each state holds the objects it held when the block started, the same
        objects (a logger holding one still reads it)."""
        live = [(state, {name: getattr(state, name) for name in fields}) for state, fields in self._copies]
        try:
            yield self._start_over
        finally:
            for state, fields in live:
                for name, value in fields.items():
                    setattr(state, name, value)

    def _start_over(self) -> None:
        for state, fields in self._copies:
            for name, value in fields.items():
                setattr(state, name, copy.deepcopy(value))


def _names(state: object) -> list[str]:
    """The fields of ``state``: its ``__dict__`` and the ``__slots__`` of its classes."""
    slots: list[str] = []
    for cls in type(state).__mro__:
        declared = getattr(cls, "__slots__", ())
        slots.extend([declared] if isinstance(declared, str) else declared)
    return [*getattr(state, "__dict__", {}), *(name for name in slots if name not in ("__dict__", "__weakref__"))]


def _data_fields(state: object) -> dict[str, Any]:
    """Copies of the fields of ``state`` that hold data (see :class:`CommHookStates`)."""
    return {
        name: copy.deepcopy(value)
        for name in _names(state)
        if hasattr(state, name) and _is_data(value := getattr(state, name))
    }


def _is_data(value: Any) -> bool:
    if isinstance(value, (*_SCALARS, np.random.RandomState, torch.Generator)):
        return True
    if isinstance(value, torch.Tensor):
        return not isinstance(value, nn.Parameter)
    if isinstance(value, dict):
        return all(isinstance(key, _SCALARS) and _is_data(item) for key, item in value.items())
    if isinstance(value, tuple | list):
        return all(map(_is_data, value))
    return False
