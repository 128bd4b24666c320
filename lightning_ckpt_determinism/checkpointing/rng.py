"""Capture and restore every random stream a training step can draw from."""

import contextlib
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = [
    "HostRNGState",
    "capture_host_rng",
    "capture_rng",
    "replaying_host_rng",
    "restore_host_rng",
    "restore_rng",
    "same_host_rng",
    "same_torch_rng",
]


@dataclass(frozen=True)
class HostRNGState:
    """The state of the host's random streams outside torch: Python's ``random`` and NumPy's global RNG."""

    python: Any
    numpy: Any


@dataclass(frozen=True)
class RNGState:
    """A snapshot of torch's CPU RNG, the RNG of each accelerator device in use, and the host streams."""

    torch_cpu: torch.Tensor
    host: HostRNGState
    devices: dict[torch.device, torch.Tensor] = field(default_factory=dict)


def capture_host_rng() -> HostRNGState:
    """Snapshot Python's ``random`` and NumPy's global RNG.

    Example::

        >>> state = capture_host_rng()
        >>> a = random.random()
        >>> restore_host_rng(state)
        >>> a == random.random()
        True
    """
    return HostRNGState(python=random.getstate(), numpy=np.random.get_state())


def restore_host_rng(state: HostRNGState) -> None:
    """Put Python's ``random`` and NumPy's global RNG back to ``state``.

    Args:
        state: A snapshot from :func:`capture_host_rng`.
    """
    random.setstate(state.python)
    np.random.set_state(state.numpy)


@contextlib.contextmanager
def replaying_host_rng(state: HostRNGState) -> Iterator[None]:
    """Run the block with the host's random streams at ``state``, then put the live ones back: the one host-RNG
    replay, for a region's recomputation and for attribution's.

    Args:
        state: A snapshot from :func:`capture_host_rng`.

    Example::

        >>> state = capture_host_rng()
        >>> drawn = random.random()
        >>> with replaying_host_rng(state):
        ...     random.random() == drawn
        True
        >>> live = capture_host_rng()
        >>> with replaying_host_rng(state):
        ...     _ = random.random()
        >>> same_host_rng(live, capture_host_rng())
        True
    """
    live = capture_host_rng()
    restore_host_rng(state)
    try:
        yield
    finally:
        restore_host_rng(live)


def same_host_rng(before: HostRNGState, after: HostRNGState) -> bool:
    """Whether two snapshots of the host's random streams are equal (nothing drew from them in between).

    Args:
        before: A snapshot from :func:`capture_host_rng`.
        after: Another.

    Example::

        >>> before = capture_host_rng()
        >>> same_host_rng(before, capture_host_rng()), (random.random(), same_host_rng(before, capture_host_rng()))[1]
        (True, False)
    """
    numpy_same = before.numpy[0] == after.numpy[0] and all(
        np.array_equal(a, b) for a, b in zip(before.numpy[1:], after.numpy[1:], strict=True)
    )
    return bool(before.python == after.python and numpy_same)


def same_torch_rng(before: RNGState, after: RNGState) -> bool:
    """Whether two snapshots hold torch's CPU RNG, and the RNG of each accelerator device ``before`` holds, in the
    same states (nothing drew from them in between); the host streams are :func:`same_host_rng`'s.

    Args:
        before: A snapshot from :func:`capture_rng`.
        after: A later one, of the same devices.

    Example::

        >>> before = capture_rng()
        >>> same_torch_rng(before, capture_rng()), (torch.rand(1), same_torch_rng(before, capture_rng()))[1]
        (True, False)
    """
    return torch.equal(before.torch_cpu, after.torch_cpu) and all(
        device in after.devices and torch.equal(state, after.devices[device])
        for device, state in before.devices.items()
    )


def capture_rng(devices: Iterable[torch.device] = ()) -> RNGState:
    """Snapshot torch's CPU RNG, the RNG of each accelerator device given, Python's ``random`` and NumPy.

    Args:
        devices: Accelerator devices whose generator state to capture; CPU devices are ignored (the CPU
            generator is always captured). Devices of a backend that has not been initialised are skipped, so
            capturing never initialises CUDA.

    Example::

        >>> state = capture_rng()
        >>> a = torch.rand(1)
        >>> restore_rng(state)
        >>> torch.equal(a, torch.rand(1))
        True
    """
    device_states: dict[torch.device, torch.Tensor] = {}
    for device in _accelerator_devices(devices):
        device_states[device] = torch.get_device_module(device.type).get_rng_state(device)
    return RNGState(torch_cpu=torch.get_rng_state(), host=capture_host_rng(), devices=device_states)


def restore_rng(state: RNGState) -> None:
    """Put every stream captured in ``state`` back where it was.

    Args:
        state: A snapshot from :func:`capture_rng`.
    """
    torch.set_rng_state(state.torch_cpu)
    for device, device_state in state.devices.items():
        torch.get_device_module(device.type).set_rng_state(device_state, device)
    restore_host_rng(state.host)


def _accelerator_devices(devices: Iterable[torch.device]) -> list[torch.device]:
    unique: list[torch.device] = []
    for device in devices:
        device = torch.device(device)
        if device.type in ("cpu", "meta"):
            continue
        device_module = torch.get_device_module(device.type)
        if not getattr(device_module, "is_initialized", lambda: True)():
            continue
        if device.index is None:
            device = torch.device(device.type, device_module.current_device())
        if device not in unique:
            unique.append(device)
    return unique
