"""Capture and restore every random stream a training step can draw from."""

import contextlib
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from lightning_ckpt_determinism.checkpointing.equality import same_item

__all__ = [
    "HOST_GENERATORS",
    "HostRNGState",
    "capture_host_rng",
    "capture_rng",
    "generator_state",
    "has_state",
    "held_host_generators",
    "replaying_host_rng",
    "restore_host_rng",
    "restore_rng",
    "same_host_rng",
    "same_torch_rng",
    "set_generator_state",
]


HOST_GENERATORS = (np.random.Generator, np.random.RandomState, random.Random)
"""The host's random generators a module may hold as attributes (``self.rng = np.random.default_rng(0)``)."""


@dataclass(frozen=True)
class HostRNGState:
    """The state of the host's random streams outside torch: Python's ``random`` and NumPy's global RNG, and the
    host generators given at capture (those a region's modules hold), each with its state."""

    python: Any
    numpy: Any
    held: tuple[tuple[Any, Any], ...] = ()


def held_host_generators(modules: Iterable[nn.Module], inputs: Iterable[Any] = ()) -> list[Any]:
    """The host generators with a state (:data:`HOST_GENERATORS`, ``random.SystemRandom`` aside) ``modules`` hold as
    attributes or in lists, tuples and dicts of up to 64 items they hold, and those among ``inputs`` (or in such a
    container among them), each once.

    Args:
        modules: The modules (a region's, as ``module.modules()`` gives them).
        inputs: A call's arguments.

    Example::

        >>> layer = torch.nn.Linear(2, 2)
        >>> layer.rngs = [np.random.default_rng(0), random.SystemRandom(), torch.Generator()]
        >>> [type(found).__name__ for found in held_host_generators(layer.modules(), (random.Random(1),))]
        ['Generator', 'Random']
    """
    found: dict[int, Any] = {}
    values = [*(value for module in modules for value in vars(module).values()), *inputs]
    for value in values:
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
        for item in (value, *(items if len(items) <= _CONTAINER_ITEMS else ())):
            if isinstance(item, HOST_GENERATORS) and has_state(item):  # torch's: `preserve_rng_state`'s to replay
                found.setdefault(id(item), item)
    return list(found.values())


_CONTAINER_ITEMS = 64


def has_state(value: object) -> bool:
    """Whether ``value`` is a random generator with a state to capture: a ``torch.Generator`` or one of
    :data:`HOST_GENERATORS`, but ``random.SystemRandom`` (the system's entropy, which has none).

    Args:
        value: Any object.

    Example::

        >>> has_state(random.Random(0)), has_state(random.SystemRandom()), has_state(torch.Generator())
        (True, False, True)
    """
    return isinstance(value, (torch.Generator, *HOST_GENERATORS)) and not isinstance(value, random.SystemRandom)


def generator_state(generator: Any) -> Any:
    """The state of a random generator: a ``torch.Generator``, or one of :data:`HOST_GENERATORS`.

    Args:
        generator: The generator.

    Example::

        >>> rng = random.Random(0)
        >>> state = generator_state(rng)
        >>> drawn = rng.random()
        >>> set_generator_state(rng, state)
        >>> rng.random() == drawn
        True
    """
    if isinstance(generator, np.random.Generator):
        return generator.bit_generator.state
    if isinstance(generator, random.Random):
        return generator.getstate()
    return generator.get_state()  # torch.Generator, np.random.RandomState


def set_generator_state(generator: Any, state: Any) -> None:
    """Give a random generator a state :func:`generator_state` read.

    Args:
        generator: The generator.
        state: Its state.
    """
    if isinstance(generator, np.random.Generator):
        generator.bit_generator.state = state
    elif isinstance(generator, random.Random):
        generator.setstate(state)
    else:  # torch.Generator, np.random.RandomState
        generator.set_state(state)


@dataclass(frozen=True)
class RNGState:
    """A snapshot of torch's CPU RNG, the RNG of each accelerator device in use, and the host streams."""

    torch_cpu: torch.Tensor
    host: HostRNGState
    devices: dict[torch.device, torch.Tensor] = field(default_factory=dict)


def capture_host_rng(held: Iterable[Any] = ()) -> HostRNGState:
    """Snapshot Python's ``random`` and NumPy's global RNG, and the host generators ``held``.

    Args:
        held: Host generators a region's modules hold (:func:`held_host_generators`).

    Example::

        >>> state = capture_host_rng()
        >>> a = random.random()
        >>> restore_host_rng(state)
        >>> a == random.random()
        True
    """
    return HostRNGState(
        python=random.getstate(),
        numpy=np.random.get_state(),
        held=tuple((generator, generator_state(generator)) for generator in held),
    )


def restore_host_rng(state: HostRNGState) -> None:
    """Put Python's ``random`` and NumPy's global RNG back to ``state``.

    Args:
        state: A snapshot from :func:`capture_host_rng`.
    """
    random.setstate(state.python)
    np.random.set_state(state.numpy)
    for generator, held in state.held:
        set_generator_state(generator, held)


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
    live = capture_host_rng(generator for generator, _ in state.held)
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
    held_same = len(before.held) == len(after.held) and all(
        one is other and same_item(first, second)
        for (one, first), (other, second) in zip(before.held, after.held, strict=True)
    )
    return bool(before.python == after.python and same_item(before.numpy, after.numpy) and held_same)


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
