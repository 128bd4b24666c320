"""Snapshots of what a training step changes besides the gradients, so a check can put it back exactly.

A :class:`StepState` holds every random stream (torch CPU, the accelerator devices in use, Python, NumPy, and the
``torch.Generator``, NumPy ``Generator`` and ``RandomState`` and Python ``random.Random`` objects the modules hold),
the values of a module's buffers and of the plain tensors its modules hold as attributes (neither parameters nor
buffers), the states of the torchmetrics metrics inside it, its training flags, grad mode, and the plain Python state
of the module and its submodules: attributes holding numbers, strings, ``None`` or containers (lists, dicts, sets,
deques, tuples; each container reached through them, such as the lists of a dict of lists, is copied shallowly and
restored in place, so references held elsewhere see the restored contents). It never touches ``nn.Module``
internals (``_parameters``, ``_buffers``, ``_modules``, hook dicts, ``training``: anything ``nn.Module.__init__``
sets), tensor subclasses, modules or other objects, nor FSDP's bookkeeping: FSDP1's wrapper modules are skipped
whole, and the attributes FSDP2's ``fully_shard`` sets on a module (its composable-API state, ``_fsdp_*`` flags) are
left alone, as are the sharded and unsharded parameters FSDP swaps inside ``_parameters``.
Metrics are found inside the module tree and in the plain containers of its attributes (``self.metrics = {"mse":
MeanSquaredError()}``).
"""

import random
from collections import deque
from collections.abc import Collection, Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from lightning_ckpt_determinism._library_compat import METRIC_BOOKKEEPING, metric_state_names
from lightning_ckpt_determinism._torch_compat import own_buffers
from lightning_ckpt_determinism.checkpointing.equality import same_item, same_values
from lightning_ckpt_determinism.checkpointing.modules import SCALARS, buffer_slots, is_framework_attribute
from lightning_ckpt_determinism.checkpointing.rng import capture_rng, restore_rng

__all__ = ["StepState"]

_CONTAINERS = (list, dict, set, tuple, deque)
_MISSING = object()


class StepState:
    """Everything a step may change besides gradients and parameters, captured now; :meth:`restore` puts it back.

    Args:
        module: The model whose buffers, metrics, training flags and Python attributes are captured.
        exclude_attributes: Attribute names never captured nor restored on any module (a framework's own
            bookkeeping on the root module, for example).
        parameters: Names of parameters whose values to capture too: those the step writes in place (an
            ``nn.Embedding`` with ``max_norm`` renormalises its weight in forward).

    Example::

        >>> model = torch.nn.BatchNorm1d(2)
        >>> model.steps = 0
        >>> state = StepState(model)
        >>> _ = model(torch.randn(4, 2))
        >>> model.steps += 1
        >>> state.restore()
        >>> int(model.num_batches_tracked), model.steps
        (0, 0)
    """

    def __init__(
        self, module: nn.Module, exclude_attributes: Iterable[str] = (), parameters: Iterable[str] = ()
    ) -> None:
        devices = {t.device for t in module.parameters()} | {t.device for t in module.buffers()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            devices.add(torch.device("cuda", torch.cuda.current_device()))
        self._rng = capture_rng(devices)
        self._buffers = _BufferSnapshot(module)
        self._metrics = _MetricSnapshot(module)
        self._python = _PythonState(module, frozenset(exclude_attributes))
        self._generators = _GeneratorSnapshot(self._python.generators)
        self._tensors = _TensorAttributes(self._python.tensors)
        named = dict(module.named_parameters())
        self._parameters = _TensorAttributes([(module, name, named[name]) for name in parameters if name in named])
        self._training = {sub: sub.training for sub in module.modules()}
        self._grad_enabled = torch.is_grad_enabled()

    def differing_buffers(self) -> list[str]:
        """The names of the buffers whose values now differ from the captured ones (one comparison each).

        Example::

            >>> model = torch.nn.BatchNorm1d(2)
            >>> state = StepState(model)
            >>> _ = model(torch.randn(4, 2))
            >>> state.differing_buffers()
            ['running_mean', 'running_var', 'num_batches_tracked']
        """
        return self._buffers.differing()

    def differing_attributes(
        self, within: Collection[nn.Module] | None = None, ignore: Collection[str] = ()
    ) -> list[str]:
        """The dotted names of the plain attributes whose values now differ from the captured ones (a scalar
        rebound, a container's contents changed, an attribute created or deleted), on the modules ``within`` (every
        module when ``None``).

        Args:
            within: The modules to look at (those inside checkpointed regions, whose code recomputation reruns).
            ignore: Attribute names not compared (they are still captured and restored).

        Example::

            >>> model = torch.nn.Linear(2, 2)
            >>> model.seen = []
            >>> state = StepState(model)
            >>> model.seen.append(1)
            >>> state.differing_attributes()
            ['seen']
        """
        found = self._python.differing(None if within is None else {id(sub) for sub in within})
        return [name for name in found if name.rsplit(".", 1)[-1] not in ignore]

    def restore(self) -> None:
        """Put everything captured back; can be called any number of times."""
        restore_rng(self._rng)
        self._generators.restore()
        self._tensors.restore()
        self._parameters.restore(rebind=False)
        self._buffers.restore()
        self._metrics.restore()
        self._python.restore()
        for sub, mode in self._training.items():
            sub.training = mode
        torch.set_grad_enabled(self._grad_enabled)


class _BufferSnapshot:
    """The buffer objects of a module and copies of their values."""

    def __init__(self, module: nn.Module) -> None:
        with torch.no_grad():
            self._entries = [
                (name, owner, key, buffer, buffer.clone())
                for name, (owner, key, buffer) in buffer_slots(module).items()
            ]

    def differing(self) -> list[str]:
        differing = []
        for name, owner, key, _, value in self._entries:
            current = own_buffers(owner).get(key)
            if current is None or not same_values(value, current):
                differing.append(name)
        return differing

    def restore(self) -> None:
        with torch.no_grad():
            # Always copied: kernels such as batch_norm update running statistics without bumping `_version`.
            for _, owner, key, buffer, value in self._entries:
                own_buffers(owner)[key] = buffer
                buffer.copy_(value)


class _TensorAttributes:
    """Tensors held as plain attributes (not parameters, not buffers: ``self.running_loss = torch.zeros(())``), as
    objects and values: a step that updates one in place or rebinds it is put back. Also the parameters a step is
    known to write in place (``parameters`` of :class:`StepState`), whose values alone are put back."""

    def __init__(self, held: list[tuple[nn.Module, str, torch.Tensor]]) -> None:
        with torch.no_grad():
            self._entries = [(owner, name, tensor, tensor.detach().clone()) for owner, name, tensor in held]

    def restore(self, *, rebind: bool = True) -> None:
        with torch.no_grad():
            for owner, name, tensor, value in self._entries:
                if rebind:
                    vars(owner)[name] = tensor
                tensor.copy_(value)


class _GeneratorSnapshot:
    """The states of the random generators a module and its submodules hold, as attributes or in plain containers
    (found by :class:`_PythonState`'s walk of the attributes)."""

    def __init__(self, generators: list[Any]) -> None:
        self._entries = [(generator, _generator_state(generator)) for generator in generators]

    def restore(self) -> None:
        for generator, state in self._entries:
            if isinstance(generator, np.random.Generator):
                generator.bit_generator.state = state
            elif isinstance(generator, random.Random):
                generator.setstate(state)
            else:  # torch.Generator, np.random.RandomState
                generator.set_state(state)


def _generator_state(generator: Any) -> Any:
    if isinstance(generator, np.random.Generator):
        return generator.bit_generator.state
    if isinstance(generator, random.Random):
        return generator.getstate()
    return generator.get_state()  # torch.Generator, np.random.RandomState


_GENERATORS = (torch.Generator, np.random.Generator, np.random.RandomState, random.Random)


def _items(container: Any) -> list[Any]:
    return list(container.values()) if isinstance(container, dict) else list(container)


class _MetricSnapshot:
    """States of the torchmetrics metrics of a module, so a loss closure that updates them changes nothing."""

    def __init__(self, module: nn.Module) -> None:
        self._entries = [
            (
                metric,
                {name: _copy_state(getattr(metric, name)) for name in metric_state_names(metric)},
                dict(metric.__dict__),
            )
            for metric in _metrics(module)
        ]

    def restore(self) -> None:
        for metric, states, attributes in self._entries:
            for key in METRIC_BOOKKEEPING:
                if key in attributes:
                    setattr(metric, key, attributes[key])
            for name, value in states.items():
                setattr(metric, name, _copy_state(value))


def _copy_state(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return [_copy_state(item) for item in value]
    return value


def _metrics(module: nn.Module) -> list[Any]:
    """The torchmetrics metrics of a module: its submodules, and those held in plain containers of its attributes."""
    from torchmetrics import Metric

    found = {id(sub): sub for sub in module.modules() if isinstance(sub, Metric)}
    for sub in module.modules():
        # nn.Module's own dicts (`_modules`, `_parameters`, hooks) hold no metric the walk of submodules missed.
        for name, value in vars(sub).items():
            if is_framework_attribute(name):
                continue
            for container, _ in _contents(value):
                items = container.values() if isinstance(container, dict) else container
                found.update((id(item), item) for item in items if isinstance(item, Metric))
    return list(found.values())


class _PythonState:
    """The plain attributes of a module and its submodules (metrics excepted: :class:`_MetricSnapshot` has them)."""

    def __init__(self, module: nn.Module, exclude: frozenset[str]) -> None:
        from torchmetrics import Metric

        self._exclude = exclude
        self._entries: list[tuple[str, nn.Module, dict[str, tuple[Any, Any]]]] = []
        # The random generators held as attributes or in their plain containers, and the tensors held as attributes,
        # found on the way.
        found: dict[int, Any] = {}
        self.tensors: list[tuple[nn.Module, str, torch.Tensor]] = []
        for prefix, sub in module.named_modules():
            if isinstance(sub, Metric) or _is_fsdp1_wrapper(sub):
                continue
            captured = {}
            for name, value in vars(sub).items():
                if not self._captures(name):
                    continue
                if isinstance(value, _GENERATORS):
                    found[id(value)] = value
                elif type(value) is torch.Tensor:
                    self.tensors.append((sub, name, value))
                elif _is_plain(value):
                    contents = _contents(value)
                    captured[name] = (value, contents)
                    found.update(
                        (id(item), item)
                        for _, copy in contents
                        for item in _items(copy)
                        if isinstance(item, _GENERATORS)
                    )
            self._entries.append((prefix, sub, captured))
        self.generators = list(found.values())

    def _captures(self, name: str) -> bool:
        return name not in self._exclude and not is_framework_attribute(name)

    def _created(self, sub: nn.Module, captured: dict[str, tuple[Any, Any]]) -> list[str]:
        """Plain attributes the step created: they did not exist at capture."""
        return [
            name
            for name, value in vars(sub).items()
            if name not in captured and _is_plain(value) and self._captures(name)
        ]

    def differing(self, within: set[int] | None) -> list[str]:
        differing = []
        for prefix, sub, captured in self._entries:
            if within is not None and id(sub) not in within:
                continue
            attributes = vars(sub)
            names = [
                name for name, (value, contents) in captured.items() if _changed(attributes, name, value, contents)
            ]
            for name in sorted(names + self._created(sub, captured)):
                differing.append(f"{prefix}.{name}" if prefix else name)
        return differing

    def restore(self) -> None:
        for _, sub, captured in self._entries:
            attributes = vars(sub)
            # Plain attributes the step created did not exist at capture: they go, as they were not there.
            for name in self._created(sub, captured):
                del attributes[name]
            for name, (original, contents) in captured.items():
                for container, copy in contents:
                    _refill(container, copy)
                attributes[name] = original


def _is_fsdp1_wrapper(module: nn.Module) -> bool:
    """An FSDP1 ``FullyShardedDataParallel`` unit: all its own attributes are FSDP's; the module it wraps is a child."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(module, FullyShardedDataParallel)


def _is_plain(value: object) -> bool:
    return isinstance(value, SCALARS) or (isinstance(value, _CONTAINERS) and not isinstance(value, nn.Module))


def _changed(attributes: dict[str, Any], name: str, value: Any, contents: list[tuple[Any, Any]]) -> bool:
    """Whether an attribute captured as ``value`` (with copies of the ``contents`` of its containers) changed."""
    current = attributes.get(name, _MISSING)
    if current is not value and not same_item(current, value):
        return True
    return any(not _same_contents(container, copy) for container, copy in contents)


def _same_contents(container: Any, copy: Any) -> bool:
    """Whether a container holds what ``copy`` (its shallow copy at capture) held."""
    if isinstance(container, dict):
        return container.keys() == copy.keys() and all(same_item(container[key], copy[key]) for key in container)
    if isinstance(container, set):
        return set(container) == set(copy)
    items = list(container)
    return len(items) == len(copy) and all(same_item(a, b) for a, b in zip(items, copy, strict=True))


def _contents(value: Any) -> list[tuple[Any, Any]]:
    """Each container reachable from ``value`` through containers (``value`` included), with a shallow copy of it.

    A step that appends to a list inside a dict (``self.outputs["train"].append(...)``) changes the inner list,
    not the dict: restoring the outer container alone would leave the inner one changed.
    """
    found: list[tuple[Any, Any]] = []
    seen: set[int] = set()
    pending = [value]
    while pending:
        item = pending.pop()
        if not isinstance(item, _CONTAINERS) or isinstance(item, nn.Module) or id(item) in seen:
            continue
        seen.add(id(item))
        items = list(item.values()) if isinstance(item, dict) else list(item)
        found.append((item, dict(item) if isinstance(item, dict) else items))
        pending.extend(items)
    return found


def _refill(original: Any, copy: Any) -> None:
    """Give a mutable container its captured contents back, in place."""
    if isinstance(original, dict):
        original.clear()
        original.update(copy)
    elif isinstance(original, list):
        original[:] = copy
    elif isinstance(original, deque):
        original.clear()
        original.extend(copy)
    elif isinstance(original, set):
        original.clear()
        original.update(copy)
