"""The states of DDP's communication hooks, copied and put back around a check's reference pass.

A stateful hook (PowerSGD's error feedback, iteration count and warm-start factors) advances at every backward that
goes through DDP's reducer, the reference pass's too. The reference starts from the state the live step started from,
so that it compresses as the live step did, and the state the live step left is put back after it, so that training
goes on as without the check.
"""

import copy
from typing import Any

import torch
from torch import nn

from lightning_ckpt_determinism._torch_compat import comm_hook_states

__all__ = ["CommHookStates"]


class CommHookStates:
    """The fields of every communication hook state registered on ``module``, copied now; :meth:`restore` sets copies
    of them on the same state objects (the hooks hold those objects), any number of times.

    Process groups are left out (never copied nor set), and so is a field that cannot be copied.

    Args:
        module: The DDP module (any other, or ``None``, holds no hook and costs nothing).

    Example::

        >>> states = CommHookStates(torch.nn.Linear(2, 2))  # not a DDP module: no hook, nothing copied
        >>> states.restore()
    """

    def __init__(self, module: nn.Module | None) -> None:
        states = comm_hook_states(module) if module is not None else []
        self._copies = [(state, _fields(state)) for state in states]

    def restore(self) -> None:
        for state, fields in self._copies:
            _set(state, fields)


def _names(state: object) -> list[str]:
    """The fields of ``state``: its ``__dict__`` and the ``__slots__`` of its classes."""
    slots: list[str] = []
    for cls in type(state).__mro__:
        declared = getattr(cls, "__slots__", ())
        slots.extend([declared] if isinstance(declared, str) else declared)
    return [*getattr(state, "__dict__", {}), *(name for name in slots if name not in ("__dict__", "__weakref__"))]


def _fields(state: object) -> dict[str, Any]:
    fields = {}
    for name in _names(state):
        if not hasattr(state, name):
            continue
        value = getattr(state, name)
        if isinstance(value, getattr(torch.distributed, "ProcessGroup", ())):
            continue
        try:
            fields[name] = copy.deepcopy(value)
        except Exception:  # a lock, a handle: left as it is, as without this copy
            continue
    return fields


def _set(state: object, fields: dict[str, Any]) -> None:
    for name, value in fields.items():
        setattr(state, name, copy.deepcopy(value))
