"""Snapshots of what a training step changes besides the gradients, so a check can put it back exactly.

A :class:`StepState` holds every random stream (torch CPU, the accelerator devices in use, Python, NumPy, and the
``torch.Generator``, NumPy ``Generator`` and ``RandomState`` and Python ``random.Random`` objects the modules hold),
the values of a module's buffers, of the parameters a step writes in place, and of the plain tensors its modules hold
as attributes (neither parameters nor buffers), the states of the torchmetrics metrics inside it, its training flags,
grad mode, and the plain Python state of the module and its submodules: attributes holding numbers, strings,
``None`` or containers (lists, dicts, sets, deques, tuples; each container reached through them, such as the lists of
a dict of lists, is copied shallowly and restored in place, so references held elsewhere see the restored contents),
NumPy arrays (copied, restored in place), and objects of the user's own classes (``self.tracker = Tracker()``): one
level deep, the object's own attributes are captured as a module's are (its ``__dict__`` copied shallowly and
restored in place, with the containers, arrays and tensors it holds), while objects it holds in turn are kept by
reference. Every attribute of these kinds is bound again to the object it held, and one of these kinds that did not
exist at capture (a generator or a tracker created lazily) is removed.

It never touches ``nn.Module`` internals (``_parameters``, ``_buffers``, ``_modules``, hook dicts, ``training``:
anything ``nn.Module.__init__`` sets), tensor subclasses, modules, callables (functions, bound methods, the package's
own region wrappers), objects without a ``__dict__``, nor FSDP's bookkeeping: FSDP1's wrapper modules are skipped
whole, and the attributes FSDP2's ``fully_shard`` sets on a module (its composable-API state, ``_fsdp_*`` flags) are
left alone, as are the sharded and unsharded parameters FSDP swaps inside ``_parameters`` and the views of its flat
parameters FSDP1 sets as plain attributes inside its forward.
Metrics are found inside the module tree and in the plain containers of its attributes (``self.metrics = {"mse":
MeanSquaredError()}``).

Parameters are copied only where asked (``parameters`` of :class:`StepState`: the names a step is known to write, or
``None`` for every one); the version counter of every parameter is read at capture, so that a parameter written in
place without a copy is named (:meth:`StepState.unrestored_parameters`) instead of silently left changed. A write
that bumps no version counter (through ``.data``) is not seen.
"""

import contextlib
import types
from collections import deque
from collections.abc import Collection, Iterable
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.utils.hooks import RemovableHandle

from lightning_ckpt_determinism._library_compat import METRIC_BOOKKEEPING, metric_state_names
from lightning_ckpt_determinism._torch_compat import (
    buffer_version_counter,
    is_fsdp1_parameter_view,
    own_buffers,
    own_parameters,
)
from lightning_ckpt_determinism.checkpointing.equality import (
    object_state,
    own_dict,
    same_item,
    same_values,
    slot_values,
    slots_of,
)
from lightning_ckpt_determinism.checkpointing.module_hooks import HookSnapshot
from lightning_ckpt_determinism.checkpointing.modules import (
    SCALARS,
    buffer_keys,
    buffer_slots,
    buffer_written,
    is_framework_attribute,
    is_fsdp1_unit,
    is_wrapper_subclass,
    parameter_version,
    region_name,
    same_inner_tensors,
    state_copy,
    write_values,
)
from lightning_ckpt_determinism.checkpointing.rng import (
    HOST_GENERATORS,
    HostRNGState,
    capture_host_rng,
    capture_rng,
    generator_state,
    has_state,
    restore_rng,
    same_host_rng,
    same_torch_rng,
    set_generator_state,
)
from lightning_ckpt_determinism.verify.digest import INTEGER_OF_SIZE

__all__ = ["StateMark", "StepState", "named_metrics"]

_CONTAINERS = (list, dict, set, tuple, deque)
_MISSING = object()


class StateMark:
    """What a step may write that a check compares, captured now, to name what changed since: the buffers (their
    objects and version counters, no copy of their values), the plain Python attributes, and the state of Python's
    ``random`` and NumPy's global RNG. Nothing is put back (see :class:`StepState`).

    Args:
        module: The model whose buffers and Python attributes are captured.
        internal_attributes: Attribute names never captured on any module (see :class:`StepState`).

    Example::

        >>> model = torch.nn.Linear(2, 2)
        >>> mark = StateMark(model)
        >>> model.flag = True
        >>> mark.differing_attributes(), mark.differing_buffers(), mark.host_rng_moved()
        (['flag'], [], False)
    """

    def __init__(self, module: nn.Module, internal_attributes: Iterable[str] = ()) -> None:
        self._buffers = self._buffers_of(module)
        self._python = _PythonState(module, frozenset(internal_attributes))
        self._host = self._host_rng()

    def _buffers_of(self, module: nn.Module) -> "_BufferVersions | _BufferSnapshot":
        """What :meth:`differing_buffers` compares with: the buffers' versions here, their values in a
        :class:`StepState`."""
        return _BufferVersions(module)

    def _host_rng(self) -> HostRNGState:
        """The host's random streams as :meth:`host_rng_moved` compares them (a :class:`StepState` has them already)."""
        return capture_host_rng()

    def differing_buffers(self) -> list[str]:
        """The names of the buffers written since capture: replaced, or their version counter moved (a
        :class:`StepState` compares their values instead: a kernel such as ``batch_norm``'s updates its running
        statistics without a version bump). Named as users write them, without the ``_orig_mod`` of a compiled
        module (:func:`~lightning_ckpt_determinism.checkpointing.modules.region_name`).

        Example::

            >>> model = torch.nn.BatchNorm1d(2)
            >>> mark = StateMark(model)
            >>> _ = model.running_mean.add_(1.0)
            >>> mark.differing_buffers()
            ['running_mean']
        """
        return [region_name(name) for name in self._buffers.differing()]

    def differing_attributes(
        self, within: Collection[nn.Module] | None = None, ignore: Collection[str] = ()
    ) -> list[str]:
        """The dotted names of the plain attributes whose values now differ from the captured ones (a scalar
        rebound, a container's contents changed, an attribute created or deleted), on the modules ``within`` (every
        module when ``None``), named as users write them (see :meth:`differing_buffers`).

        Args:
            within: The modules to look at (those inside checkpointed regions, whose code recomputation reruns).
            ignore: Attribute names not compared (they are still captured and restored).

        Example::

            >>> model = torch.nn.Linear(2, 2)
            >>> model.seen = []
            >>> state = StateMark(model)
            >>> model.seen.append(1)
            >>> state.differing_attributes()
            ['seen']
        """
        found = self._python.differing(None if within is None else {id(sub) for sub in within})
        return [region_name(name) for name in found if name.rsplit(".", 1)[-1] not in ignore]

    def host_rng_moved(self) -> bool:
        """Whether Python's ``random`` or NumPy's global RNG now holds another state than at capture (something drew
        from it, or seeded it).

        Example::

            >>> import random
            >>> state = StateMark(torch.nn.Linear(2, 2))
            >>> moved = (state.host_rng_moved(), random.random(), state.host_rng_moved())
            >>> moved[0], moved[2]
            (False, True)
        """
        return not same_host_rng(self._host, capture_host_rng())


class StepState(StateMark):
    """Everything a step may change besides gradients, captured now; :meth:`restore` puts it back.

    Args:
        module: The model whose buffers, metrics, training flags and Python attributes are captured.
        internal_attributes: Attribute names never captured nor restored on any module (a framework's own
            bookkeeping on the root module, for example). Not ``exclude_attributes``, which everywhere names
            attributes a check never compares (and still puts back).
        parameters: Names of parameters whose values to capture too: those the step writes in place (an
            ``nn.Embedding`` with ``max_norm`` renormalises its weight in forward, a forward that decays or clamps a
            parameter under ``no_grad``); ``None`` for every parameter, each put back only where its version counter
            moved. Costs one copy of the parameters named.

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
        self, module: nn.Module, internal_attributes: Iterable[str] = (), parameters: Iterable[str] | None = ()
    ) -> None:
        devices = {t.device for t in module.parameters()} | {t.device for t in module.buffers()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            devices.add(torch.device("cuda", torch.cuda.current_device()))
        self._rng = capture_rng(devices)
        self._values = _BufferSnapshot(module)
        super().__init__(module, internal_attributes)
        self._metrics = _MetricSnapshot(module)
        self._generators = _GeneratorSnapshot(self._python.generators)
        self._tensors = _TensorAttributes(self._python.tensors)
        self._parameters = _ParameterSnapshot(module, parameters)
        self._registered = _RegisteredParameters(module)
        self._training = {sub: sub.training for sub in module.modules()}
        # A hook the step registers once, behind an attribute it creates, comes back with that attribute.
        self._hooks = HookSnapshot([vars(sub) for sub in module.modules()])
        self._grad_enabled = torch.is_grad_enabled()

    def _buffers_of(self, module: nn.Module) -> "_BufferVersions | _BufferSnapshot":
        return self._values

    def _host_rng(self) -> HostRNGState:
        return self._rng.host

    def torch_rng_moved(self) -> bool:
        """Whether torch's CPU RNG, or that of an accelerator device captured, now holds another state than at
        capture (something drew from it, or seeded it).

        Example::

            >>> state = StepState(torch.nn.Linear(2, 2))
            >>> moved = (state.torch_rng_moved(), torch.rand(1), state.torch_rng_moved())
            >>> moved[0], moved[2]
            (False, True)
        """
        return not same_torch_rng(self._rng, capture_rng(self._rng.devices))

    def unrestored_parameters(self) -> list[str]:
        """The names of the parameters written in place since capture (their version counter moved) of which no copy
        was taken: :meth:`restore` cannot put them back.

        Example::

            >>> model = torch.nn.Linear(2, 2)
            >>> state = StepState(model, parameters=["bias"])
            >>> with torch.no_grad():
            ...     _ = model.weight.mul_(0.5), model.bias.mul_(0.5)
            >>> state.unrestored_parameters()
            ['weight']
        """
        return self._parameters.unrestored()

    def initialised(self) -> list[str]:
        """The names of the parameters and buffers of lazy modules (``nn.LazyLinear``, ``nn.LazyBatchNorm1d`` ...)
        that had no values at capture and have now: a forward since initialised them, which no rerun of the step could
        undo.

        Example::

            >>> model = torch.nn.Sequential(torch.nn.LazyLinear(2), torch.nn.LazyBatchNorm1d(affine=False))
            >>> state = StepState(model)
            >>> _ = model(torch.ones(2, 3))
            >>> state.initialised()
            ['0.weight', '0.bias', '1.running_mean', '1.running_var']
        """
        return self._parameters.initialised() + self._values.initialised()

    def restore(self) -> None:
        """Put everything captured back; can be called any number of times. A tensor that still holds its captured
        bits is not written, so its version counter stays (a graph kept for a second backward checks it)."""
        restore_rng(self._rng)
        self._generators.restore()
        self._tensors.restore()
        self._registered.restore()
        self._parameters.restore()
        self._values.restore()
        self._metrics.restore()
        self._hooks.restore()
        self._python.restore()
        for sub, mode in self._training.items():
            sub.training = mode
        torch.set_grad_enabled(self._grad_enabled)


class _BufferVersions:
    """The buffer objects of a module and their version counters: what :class:`StateMark` compares, without copies."""

    def __init__(self, module: nn.Module) -> None:
        self._entries = [
            (name, owner, key, buffer, buffer_version_counter(buffer))
            for name, (owner, key, buffer) in buffer_slots(module).items()
            if not is_lazy(buffer)
        ]

    def differing(self) -> list[str]:
        return [
            name for name, owner, key, buffer, version in self._entries if buffer_written(owner, key, buffer, version)
        ]


class _RegisteredParameters:
    """The parameters each module registered, by key: a step that moves one (``torch.nn.utils.prune`` registers
    ``weight_orig`` in place of ``weight``) gets the captured ones back, the others removed. Modules whose keys are
    those captured are left alone (FSDP2 swaps sharded and unsharded parameters under the same keys)."""

    def __init__(self, module: nn.Module) -> None:
        self._entries = [(sub, dict(own_parameters(sub))) for sub in module.modules() if not is_fsdp1_unit(sub)]

    def restore(self) -> None:
        for sub, captured in self._entries:
            registered = own_parameters(sub)
            if registered.keys() != captured.keys():
                registered.clear()  # in the captured order too: `named_parameters` and the state dict keep theirs
                registered.update(captured)


class _BufferSnapshot:
    """The buffer objects of a module and copies of their values, the buffers registered as ``None`` (a buffer
    sized at the first forward: one the step creates is removed again), and the keys each module registered (a
    buffer the step registers, in a first forward, is unregistered again)."""

    def __init__(self, module: nn.Module) -> None:
        slots = buffer_slots(module)
        # A lazy module's buffers (`nn.LazyBatchNorm1d`) have no values to copy until its first forward.
        self._lazy = [(name, buffer) for name, (_, _, buffer) in slots.items() if is_lazy(buffer)]
        with torch.no_grad():
            self._entries = [
                (name, owner, key, buffer, state_copy(buffer))
                for name, (owner, key, buffer) in slots.items()
                if not is_lazy(buffer)
            ]
        self._empty = [
            (name, owner, key) for name, owner, key in buffer_keys(module) if own_buffers(owner)[key] is None
        ]
        self._registered = [(owner, set(own_buffers(owner))) for owner in module.modules()]

    def initialised(self) -> list[str]:
        """The buffers that were a lazy module's without values at capture and have values now."""
        return [name for name, buffer in self._lazy if not is_lazy(buffer)]

    def differing(self) -> list[str]:
        differing = []
        for name, owner, key, _, value in self._entries:
            current = own_buffers(owner).get(key)
            if current is None or not same_values(value, current):
                differing.append(name)
        differing.extend(name for name, owner, key in self._empty if own_buffers(owner).get(key) is not None)
        return differing

    def restore(self) -> None:
        with torch.no_grad():
            # Compared, not trusted to `_version`: kernels such as batch_norm update running statistics without
            # bumping it.
            for _, owner, key, buffer, value in self._entries:
                own_buffers(owner)[key] = buffer
                _put_back(buffer, value)
        for _, owner, key in self._empty:
            own_buffers(owner)[key] = None
        for owner, keys in self._registered:
            registered = own_buffers(owner)
            for key in [key for key in registered if key not in keys]:
                del registered[key]


class _TensorAttributes:
    """Tensors held as plain attributes (not parameters, not buffers: ``self.running_loss = torch.zeros(())``) of a
    module or of an object it holds, or inside the containers they hold (``self.stats["loss_sum"]``), as objects and
    values: a step that updates one in place or rebinds an attribute is put back (a container gets its tensors back
    with its contents)."""

    def __init__(self, held: list[tuple[object | None, str, torch.Tensor]]) -> None:
        with torch.no_grad():
            self._entries = [(owner, name, tensor, tensor.detach().clone()) for owner, name, tensor in held]

    def restore(self) -> None:
        with torch.no_grad():
            for owner, name, tensor, value in self._entries:
                if owner is not None:
                    _rebind(owner, name, tensor)
                _put_back(tensor, value)


class _ParameterSnapshot:
    """The version counter of every parameter, and copies of the values of those named (every one for ``None``).

    Named parameters are always put back (they are known to be written); with ``None``, a parameter is put back only
    where its version counter moved, so that the others keep their versions (autograd and the sentinel read them), or
    where its values differ for a wrapper subclass (a quantized weight): its own ``__torch_dispatch__`` can write its
    inner tensors (a scale history updated at every use) below the dispatch keys that move version counters.
    """

    def __init__(self, module: nn.Module, names: Iterable[str] | None) -> None:
        named = dict(module.named_parameters())
        self._always = names is not None
        # A lazy module's parameters have no values to copy until its first forward initialises them.
        self._lazy = [name for name, param in named.items() if is_lazy(param)]
        copied = named if names is None else {name: named[name] for name in names if name in named}
        copied = {name: param for name, param in copied.items() if not is_lazy(param)}
        self._versions = {name: (param, parameter_version(param)) for name, param in named.items()}
        # A step that freezes or unfreezes parameters (`requires_grad_`) is rerun from the flags it started with.
        self._requires_grad = [(param, param.requires_grad) for param in named.values()]
        with torch.no_grad():
            self._copies = {name: state_copy(param) for name, param in copied.items()}

    def initialised(self) -> list[str]:
        """The parameters that were a lazy module's without values at capture and have values now."""
        return [name for name in self._lazy if not is_lazy(self._versions[name][0])]

    def unrestored(self) -> list[str]:
        return [
            name
            for name, (param, version) in self._versions.items()
            if name not in self._copies and parameter_version(param) != version
        ]

    def restore(self) -> None:
        for param, flag in self._requires_grad:
            if param.requires_grad != flag:
                param.requires_grad_(flag)
        with torch.no_grad():
            for name, value in self._copies.items():
                param, version = self._versions[name]
                if self._always or parameter_version(param) != version or is_wrapper_subclass(param):
                    _put_back(param, value)  # a copy of the same bits is left as it is


def _put_back(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Give ``tensor`` its captured ``value`` in place, unless it holds it bit for bit already: a write bumps the
    version counter, and a graph kept for a second backward (``retain_graph=True``) that saved the tensor would then
    refuse to run; an inference tensor (made under ``torch.inference_mode``, by ``trainer.validate`` before the fit)
    is written inside inference mode, the only place it can be. A tensor the step resized (a per-channel observer's
    statistics, sized at their first update) takes a copy of ``value`` as its data."""
    if _same_bits(tensor, value):
        return
    with torch.inference_mode() if tensor.is_inference() else contextlib.nullcontext():
        if tensor.shape != value.shape:
            tensor.data = value.clone()
        elif type(tensor) is torch.Tensor or type(tensor) is nn.Parameter:
            tensor.copy_(value)
        else:  # a wrapper subclass (a quantized weight) may implement no `copy_`: through its inner tensors
            write_values(tensor, value)


def _same_bits(tensor: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether two plain strided tensors, or two wrapper subclasses' inner tensors (a quantized weight's), hold the
    same bits (``-0.0`` is not ``0.0``, a NaN is its own payload); ``False`` for anything else, which is then
    written."""
    inner = same_inner_tensors(tensor, value, _same_bits)
    if inner is not None:
        return inner
    if type(tensor) is not torch.Tensor or type(value) is not torch.Tensor or tensor.layout != torch.strided:
        return False
    if (tensor.shape, tensor.dtype, tensor.device) != (value.shape, value.dtype, value.device) or tensor.is_quantized:
        return False
    if tensor.is_complex():
        tensor, value = torch.view_as_real(tensor), torch.view_as_real(value)
    bits = INTEGER_OF_SIZE.get(tensor.element_size())
    return bits is not None and torch.equal(tensor.detach().view(bits), value.detach().view(bits))


class _GeneratorSnapshot:
    """The states of the random generators a module and its submodules hold, as attributes or in plain containers
    (found by :class:`_PythonState`'s walk of the attributes)."""

    def __init__(self, generators: list[Any]) -> None:
        self._entries = [(generator, generator_state(generator)) for generator in generators]

    def restore(self) -> None:
        for generator, state in self._entries:
            set_generator_state(generator, state)


_GENERATORS = (torch.Generator, *HOST_GENERATORS)


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
            # A metric's own counters besides its states (`Running`'s place in its window, `_num_vals_seen`).
            now = vars(metric)
            for key, value in attributes.items():
                if isinstance(value, SCALARS) and (key not in now or now[key] != value):
                    setattr(metric, key, value)
            for name, value in states.items():
                setattr(metric, name, _copy_state(value))


def _copy_state(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return [_copy_state(item) for item in value]
    return value


def named_metrics(module: nn.Module) -> list[tuple[str, Any]]:
    """The torchmetrics metrics among ``module`` and its submodules, and those held in plain containers of their
    attributes, by name as the code reaches them: a region's, whose states its forward may update (recomputation then
    updates them again).

    Args:
        module: The module.

    Example::

        >>> from torchmetrics import MeanMetric, SumMetric
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), MeanMetric())
        >>> model.extra = {"rows": [SumMetric()]}
        >>> [name for name, _ in named_metrics(model)]
        ['1', "extra['rows'][0]"]
    """
    from torchmetrics import Metric

    found = {id(sub): (name, sub) for name, sub in module.named_modules() if isinstance(sub, Metric)}
    for prefix, sub in module.named_modules():
        # nn.Module's own dicts (`_modules`, `_parameters`, hooks) hold no metric the walk of submodules missed.
        for attribute, value in vars(sub).items():
            if is_framework_attribute(attribute) or isinstance(value, nn.Module):
                continue
            for place, metric in _placed(value, f"{prefix}.{attribute}" if prefix else attribute):
                found.setdefault(id(metric), (place, metric))
    return list(found.values())


def _placed(value: Any, name: str) -> list[tuple[str, Any]]:
    """The torchmetrics metrics reachable from ``value`` through plain containers of at most ``_HELD_ITEMS`` items (a
    longer one, as a list of every step's loss, is not searched), each with the expression that reaches it from
    ``name`` (``metrics['rows']``, ``metrics[0]``; a set's items are named by the set)."""
    from torchmetrics import Metric

    found: list[tuple[str, Any]] = []
    seen: set[int] = set()
    pending: list[tuple[tuple[Any, ...], Any]] = [((), value)]
    while pending:
        path, item = pending.pop()
        if isinstance(item, Metric):
            found.append((name + "".join(map(_subscript, path)), item))
        if not isinstance(item, _CONTAINERS) or isinstance(item, nn.Module) or id(item) in seen:
            continue
        seen.add(id(item))
        if len(item) > _HELD_ITEMS:
            continue
        if isinstance(item, dict):
            pending.extend(((*path, (key,)), inner) for key, inner in item.items())
        elif isinstance(item, set):
            pending.extend((path, inner) for inner in item)
        else:
            pending.extend(((*path, (index,)), inner) for index, inner in enumerate(item))
    return found


def _subscript(step: tuple[Any]) -> str:
    """``[key]`` as the code writes it, for a step of a path to a metric; a key whose ``repr`` fails, by its type."""
    try:
        return f"[{step[0]!r}]"
    except Exception:
        return f"[<{type(step[0]).__name__}>]"


def _metrics(module: nn.Module) -> list[Any]:
    """The torchmetrics metrics of a module: its submodules, and those held in plain containers of its attributes."""
    return [metric for _, metric in named_metrics(module)]


class _PythonState:
    """The plain attributes of a module and its submodules (metrics excepted: :class:`_MetricSnapshot` has them), and
    the objects of the user's own classes they hold, directly or in a short container, one level deep."""

    def __init__(self, module: nn.Module, exclude: frozenset[str]) -> None:
        from torchmetrics import Metric

        self._exclude = exclude
        self._entries: list[tuple[str, nn.Module, dict[str, tuple[Any, Any]]]] = []
        # The random generators held as attributes or in their plain containers, and the tensors held as attributes,
        # found on the way.
        self._found: dict[int, Any] = {}
        # The tensors held as attributes, with their owners, and those inside containers, without (``None``).
        self.tensors: list[tuple[object | None, str, torch.Tensor]] = []
        self._noted: set[int] = set()
        # An object several modules hold (transformers' `config` on every layer) is copied once.
        self._objects: dict[int, list[tuple[Any, Any]]] = {}
        # Objects held in containers (see `_listed`), and the copies made for them, which are restored, never compared.
        self._listed_objects: dict[int, list[tuple[Any, Any]]] = {}
        self._restore_only: set[int] = set()
        for prefix, sub in module.named_modules():
            if isinstance(sub, Metric) or is_fsdp1_unit(sub):
                continue
            captured = {
                name: (value, self._capture(sub, name, value))
                for name, value in vars(sub).items()
                if self._captures(name) and _is_state(value)
            }
            self._entries.append((prefix, sub, captured))
        self.generators = list(self._found.values())

    def _capture(self, owner: object, name: str, value: Any) -> list[tuple[Any, Any]]:
        """The containers and arrays ``value`` (held as ``owner.name``) reaches, with copies; tensors and generators
        are noted on the way."""
        if isinstance(value, _GENERATORS):
            if has_state(value):  # `random.SystemRandom` has none to put back
                self._found[id(value)] = value
            return []
        if type(value) is torch.Tensor:
            self.tensors.append((owner, name, value))
            self._noted.add(id(value))
            return []
        if isinstance(value, np.ndarray):
            return [(value, value.copy())]
        if _is_object(value):
            if id(value) in self._objects:
                return self._objects[id(value)]
            own = _attributes(value)
            # One level: the object's tensors and arrays by value, the objects it holds by reference.
            held = [(value, key, item) for key, item in own.items() if type(item) is torch.Tensor]
            self.tensors.extend(held)
            self._noted.update(id(item) for _, _, item in held)
            contents = self._objects[id(value)] = self._held(_object_contents(value, own), objects=False)
            return contents
        return self._held(_contents(value), objects=True)

    def _listed(self, value: Any) -> list[tuple[Any, Any]]:
        """An object of the user's own kind a short container holds (a list of memories, one a block), for the restore
        alone: its attributes' dict and its short containers, with copies, and its small tensors by value. Its
        attributes are not compared (:meth:`differing`): records rebound at every pass are no finding."""
        if id(value) in self._listed_objects:
            return self._listed_objects[id(value)]
        self._listed_objects[id(value)] = []  # an object that holds itself, through a container, is captured once
        own = _attributes(value)
        held = [
            (value, key, item)
            for key, item in own.items()
            if _held_by_value(item, len(own)) and type(item) is torch.Tensor and id(item) not in self._noted
        ]
        self.tensors.extend(held)
        self._noted.update(id(item) for _, _, item in held)
        contents = self._held(_object_contents(value, own, limit=_HELD_ITEMS), objects=False)
        self._restore_only.update(id(pair) for pair in contents)
        self._listed_objects[id(value)] = contents
        return contents

    def _held(self, containers: list[tuple[Any, Any]], *, objects: bool) -> list[tuple[Any, Any]]:
        """``containers`` (with their copies) and the small arrays they hold, with copies; their small tensors and
        their generators are noted on the way (see :func:`_held_by_value`). Where ``objects``, the objects of the
        user's own kind a short container holds are captured for the restore (see :meth:`_listed`)."""
        arrays: dict[int, tuple[Any, Any]] = {}
        listed: list[tuple[Any, Any]] = []
        for _, copy in containers:
            items = _items(copy)
            for item in items:
                if isinstance(item, _GENERATORS):
                    if has_state(item):
                        self._found[id(item)] = item
                elif objects and len(items) <= _HELD_ITEMS and _is_object(item):
                    listed.extend(self._listed(item))
                elif not _held_by_value(item, len(items)) or id(item) in self._noted:
                    continue
                elif isinstance(item, np.ndarray):
                    arrays.setdefault(id(item), (item, item.copy()))
                else:
                    self._noted.add(id(item))
                    self.tensors.append((None, "", item))
        return containers + list(arrays.values()) + listed

    def _captures(self, name: str) -> bool:
        return name not in self._exclude and not is_framework_attribute(name)

    def _created(self, sub: nn.Module, captured: dict[str, tuple[Any, Any]]) -> list[str]:
        """Attributes of a captured kind the step created: they did not exist at capture."""
        return [
            name
            for name, value in vars(sub).items()
            if name not in captured and _is_state(value) and self._captures(name)
        ]

    def differing(self, within: set[int] | None) -> list[str]:
        differing = []
        # An object several modules hold (a mask cache every layer shares) is one attribute, named where first held.
        named_objects: set[int] = set()
        for prefix, sub, captured in self._entries:
            if within is not None and id(sub) not in within:
                continue
            attributes = vars(sub)
            names = []
            for name, (value, contents) in captured.items():
                compared = [pair for pair in contents if id(pair) not in self._restore_only]
                if not _changed(attributes, name, value, compared):
                    continue
                if _is_object(value) and attributes.get(name) is value:
                    if id(value) in named_objects:
                        continue
                    named_objects.add(id(value))
                names.append(name)
            for name in sorted(names + self._created(sub, captured)):
                differing.append(f"{prefix}.{name}" if prefix else name)
        return differing

    def restore(self) -> None:
        for _, sub, captured in self._entries:
            attributes = vars(sub)
            # Attributes the step created did not exist at capture: they go, as they were not there (a generator
            # created lazily is created afresh by the next step, as it would have been).
            for name in self._created(sub, captured):
                del attributes[name]
            for name, (original, contents) in captured.items():
                for container, copy in contents:
                    _refill(container, copy)
                attributes[name] = original


# What a container holds that a check puts back by value: a tensor or an array of at most this many bytes (a running
# sum, a count, a small statistic) in a container of at most this many items. A larger one (a dataset, a cache) or a
# long list (every step's loss, appended) is kept by reference: copying it at each check would cost its size in
# memory and time, and a step rarely writes it in place.
_HELD_BYTES = 256
_HELD_ITEMS = 64


def _held_by_value(item: object, siblings: int) -> bool:
    """Whether a check puts ``item``, held in a container of ``siblings`` items, back by value."""
    if siblings > _HELD_ITEMS:
        return False
    if isinstance(item, np.ndarray):
        return item.nbytes <= _HELD_BYTES
    return (
        type(item) is torch.Tensor
        and not is_fsdp1_parameter_view(item)
        and item.untyped_storage().nbytes() <= _HELD_BYTES
    )


def _is_plain(value: object) -> bool:
    return isinstance(value, SCALARS) or (isinstance(value, _CONTAINERS) and not isinstance(value, nn.Module))


def _is_object(value: object) -> bool:
    """An object of the user's own kind (``self.tracker = Tracker()``): it keeps its state in a ``__dict__`` and is
    neither callable (functions, modules, the package's region wrappers, classes) nor a tensor, array or generator,
    nor a container that keeps its state in its items alone (a subclass of ``dict`` or ``list`` with an empty
    ``__dict__``, as ``Counter``, ``OrderedDict`` and Lightning's ``AttributeDict`` are; one with attributes of its
    own, as transformers' ``ModelOutput``, is an object)."""
    if callable(value) or isinstance(value, (types.ModuleType, torch.Tensor, np.ndarray, *_GENERATORS)):
        return False
    own = own_dict(value)
    if own is None:  # no `__dict__`: one keeping all its state in slots (`@dataclass(slots=True)`) is an object
        return bool(slots_of(type(value)))
    return bool(own) or not isinstance(value, _CONTAINERS)


def _is_state(value: object) -> bool:
    """Whether an attribute's value is of a kind the state captures. A view of an FSDP1 flat parameter is not: FSDP1
    sets the original parameters as such views inside its forward (where a step's state is captured) and registers
    them again after; putting a view back would hide the parameter from the module."""
    return (
        _is_plain(value)
        or (type(value) is torch.Tensor and not is_fsdp1_parameter_view(value))
        or isinstance(value, (np.ndarray, *_GENERATORS))
        or _is_object(value)
    )


def _changed(attributes: dict[str, Any], name: str, value: Any, contents: list[tuple[Any, Any]]) -> bool:
    """Whether an attribute captured as ``value`` (with copies of the ``contents`` it reaches) changed."""
    current = attributes.get(name, _MISSING)
    if current is not value and not _same_attribute(current, value):
        return True
    return any(not _same_contents(container, copy) for container, copy in contents)


def _same_attribute(current: Any, value: Any) -> bool:
    """Equal values for an attribute bound to another object: generators by their states, objects by their own
    attributes (a generator or an object created afresh by each pass is the same state)."""
    if type(current) is not type(value):
        return False
    if isinstance(value, _GENERATORS):
        return has_state(value) and same_item(generator_state(current), generator_state(value))
    if isinstance(value, RemovableHandle):
        return same_item(current, value)  # by the hooks it was registered into, not by its id
    if _is_object(value):
        return _same_contents(_attributes(current), _attributes(value))
    return same_item(current, value)


def _same_contents(container: Any, copy: Any) -> bool:
    """Whether a container or array holds what ``copy`` (its copy at capture, shallow for a container) held."""
    if isinstance(container, np.ndarray):
        return same_item(container, copy)
    if isinstance(container, _Slots):
        container = container.read()
    if isinstance(container, dict):
        return container.keys() == copy.keys() and all(same_item(container[key], copy[key]) for key in container)
    if isinstance(container, set):
        return set(container) == set(copy)
    items = list(container)
    return len(items) == len(copy) and all(same_item(a, b) for a, b in zip(items, copy, strict=True))


def _contents(value: Any, limit: int | None = None) -> list[tuple[Any, Any]]:
    """Each container reachable from ``value`` through containers (``value`` included), with a shallow copy of it;
    with a ``limit``, only those of at most that many items (a longer one is neither copied nor searched).

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
        if limit is not None and len(item) > limit:
            continue
        items = list(item.values()) if isinstance(item, dict) else list(item)
        found.append((item, dict(item) if isinstance(item, dict) else items))
        pending.extend(items)
    return found


class _Slots:
    """The slots of an object of the user's own kind (see
    :func:`~lightning_ckpt_determinism.checkpointing.equality.slots_of`), read and written as its ``__dict__`` is, in
    :func:`_same_contents` and :func:`_refill`: through each slot's own descriptor (no property, ``__getattr__`` or
    ``__setattr__`` of the class is asked; a frozen dataclass refuses its ``__setattr__``), a slot not set absent."""

    __slots__ = ("members", "owner")

    def __init__(self, owner: object) -> None:
        self.owner = owner
        self.members = slots_of(type(owner)) or ()

    def read(self) -> dict[str, Any]:
        return slot_values(self.owner, self.members)

    def write(self, values: dict[str, Any]) -> None:
        for name, member in self.members:
            if name in values:
                member.__set__(self.owner, values[name])
            else:
                with contextlib.suppress(AttributeError):  # not set at capture, nor now
                    member.__delete__(self.owner)


def _attributes(value: object) -> dict[str, Any]:
    """The attributes of an object of the user's own kind: its live ``__dict__`` where that holds all its state, else
    a new dict of its ``__dict__``'s items and its set slots (an object keeping state that neither shows: its
    ``__dict__`` alone)."""
    state = object_state(value)
    if state is not None:
        return state
    own = own_dict(value)
    return {} if own is None else own


def _object_contents(value: object, own: dict[str, Any], limit: int | None = None) -> list[tuple[Any, Any]]:
    """:func:`_contents` of an object's attributes ``own`` (:func:`_attributes`); for an object with slots, that dict
    is a new one, and its slots and its live ``__dict__`` stand for it."""
    contents = _contents(own, limit=limit)
    if not slots_of(type(value)):
        return contents
    held = [pair for pair in contents if pair[0] is not own]
    slots = _Slots(value)
    live = own_dict(value)
    return [(slots, slots.read()), *([] if live is None else [(live, dict(live))]), *held]


def _rebind(owner: object, name: str, value: Any) -> None:
    """Set an attribute back without the owner's ``__setattr__``: its slot, or in its ``__dict__``."""
    for slot, member in slots_of(type(owner)) or ():
        if slot == name:
            member.__set__(owner, value)
            return
    own = own_dict(owner)
    if own is not None:
        own[name] = value


def _refill(original: Any, copy: Any) -> None:
    """Give a mutable container or an array its captured contents back, in place, through the base class's own
    methods: a subclass may refuse its ``update`` (transformers' ``ModelOutput``) or count in its ``__setitem__``."""
    if isinstance(original, np.ndarray):
        np.copyto(original, copy)
    elif isinstance(original, _Slots):
        original.write(copy)
    elif isinstance(original, dict):
        dict.clear(original)
        dict.update(original, copy)
    elif isinstance(original, list):
        list.__setitem__(original, slice(None), copy)
    elif isinstance(original, deque):
        deque.clear(original)
        deque.extend(original, copy)
    elif isinstance(original, set):
        set.clear(original)
        set.update(original, copy)
