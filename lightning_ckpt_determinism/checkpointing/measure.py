"""What each checkpointed region keeps for backward, with and without checkpointing, and what its recomputation costs.

An :class:`ActivationMeter` watches the eager forwards of a model's checkpointed regions inside
:meth:`ActivationMeter.measuring` and gives one :class:`RegionFigures` per region:

- **Plain bytes**: what the region would keep for backward without checkpointing, on this rank (a DTensor counts its
  local shard). Every tensor a checkpointed forward saves reaches the package's ``determinism_check`` extractor
  (:mod:`~lightning_ckpt_determinism.checkpointing.determinism_check`) exactly as autograd would save it without
  checkpointing; the meter adds up the bytes of their distinct storages, leaving out the model's parameters and
  buffers (state, not activations). A view keeps its whole storage alive, so the whole storage counts.
- **Checkpointed bytes**: what the region keeps when checkpointed: the distinct storages of its tensor inputs, and of
  the tensors the other objects among them hold as attributes (torch holds the inputs for the recomputation), plus
  the outputs of the ops ``save_ops`` names and the data-dependent outputs ``keep_data_dependent`` keeps by its size
  rule (:mod:`~lightning_ckpt_determinism.checkpointing.routing`).
- **Recompute FLOPs**: what one recomputation costs, by ``torch.utils.flop_counter``'s formulas. FLOPs rather than
  time, because a count is the same on every rank and every run, so that all ranks and reruns plan alike,
  and one forward timed per region on a busy device is noise. Its blind spot: it counts matrix products,
  convolutions and CUDA's fused attention only; elementwise ops, norms, softmax and attention on the CPU count 0, so a
  region made only of those looks free to recompute.
- **Recompute cost**: the sum of the cost of each op call the recomputation runs again (those torch's selective
  checkpointing sees, ``torch.utils.checkpoint.SAC_IGNORED_OPS`` left out), in the cost model of
  :mod:`~lightning_ckpt_determinism.checkpointing.cost` at the meter's ``rates``: a roofline cost per op, which counts
  the memory traffic of elementwise ops, norms and softmax, or the FLOP count alone. torch's checkpoint ends a
  recomputation once it has saved the forward's last saved tensor again (early stop): the calls after the one that
  saved it last never run again, and cost nothing (an op saves its inputs before it runs, its outputs after); nor
  do the calls whose outputs the region keeps (``save_ops``, data-dependent outputs), served from the cache.
- **Op calls** (when asked, for ``budget_granularity="op"``): each op call of a region's forward, by its position
  among the calls torch's selective checkpointing sees and its overload, with the bytes of the storages it allocates and
  its recompute cost. A call whose output aliases a tensor that exists already (its schema says so, as for views,
  in-place and ``out=`` ops, or it shares a storage with the op's arguments or the model's state), or that the region
  keeps anyway (``save_ops``, data-dependent outputs), has no bytes of its own to keep: it is listed with 0 bytes and
  cannot be chosen. A region called several times adds up each position's figures; calls that ran different op sequences
  leave it without op figures (it is then planned whole).

A region called several times in the step adds up its calls. The meter registers on each region as its saved-tensor
observer and hands every tensor on to the observer registered there before (the monitor's sentinel), so both see the
step. Compiled regions are not seen: the compiler recomputes them itself and calls no extractor.
"""

import contextlib
import types
import weakref
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import SAC_IGNORED_OPS

from lightning_ckpt_determinism._torch_compat import TorchDispatchMode, returns_alias, tree_leaves, written_tensors
from lightning_ckpt_determinism.checkpointing.cost import ROOFLINE, Rates, op_cost, op_flops
from lightning_ckpt_determinism.checkpointing.determinism_check import SavedPlan, SavedTensorObserver, kept_by_torch
from lightning_ckpt_determinism.checkpointing.framework_ops import FrameworkOps
from lightning_ckpt_determinism.checkpointing.modules import local_tensor, storage_pointer
from lightning_ckpt_determinism.checkpointing.routing import (
    fits_size_rule,
    input_limit,
    is_data_dependent,
    is_random_op,
)
from lightning_ckpt_determinism.checkpointing.wrapper import observing_saved_tensors
from lightning_ckpt_determinism.config import resolve_ops

__all__ = ["ActivationMeter", "OpFigures", "RegionFigures"]


@dataclass(frozen=True)
class OpFigures:
    """One op call of a region's forward: which call, what keeping its output costs, and what recomputing it costs.

    Attributes:
        index: Its position among the region's op calls that selective checkpointing sees.
        op: Its overload, as ``str(func)`` writes it (``"aten.mm.default"``).
        bytes: The bytes of the storages it allocates (0 for views, in-place ops and outputs kept anyway).
        cost: Its recompute cost in the meter's cost model (roofline byte-equivalents, or FLOPs); 0 where the
            recomputation does not run it again (past early stop, or its output kept anyway).
        flops: The FLOPs ``torch.utils.flop_counter`` counts for it, where the recomputation runs it again.

    Example::

        >>> OpFigures(3, "aten.mm.default", bytes=4096, cost=8192).op
        'aten.mm.default'
    """

    index: int
    op: str
    bytes: int
    cost: int
    flops: int = 0


@dataclass(frozen=True)
class RegionFigures:
    """What one candidate region keeps and costs in the measured step (all its calls added up).

    Attributes:
        name: The region's name.
        plain_bytes: Activation bytes it keeps for backward without checkpointing.
        checkpointed_bytes: Bytes it keeps when checkpointed: its inputs and what ``save_ops`` and
            ``keep_data_dependent`` keep.
        flops: The FLOPs its recomputation spends again in backward (of the op calls up to its last saved tensor).
        calls: How many times it ran; a region that did not run has only zeros.
        cost: Its recompute cost in the meter's cost model (roofline byte-equivalents, or FLOPs): of the op calls its
            recomputation runs again.
        ops: Its op calls (empty unless measured), which op granularity chooses from.

    Example::

        >>> RegionFigures("blocks.0", plain_bytes=4096, checkpointed_bytes=1024, flops=10**6, calls=1).saving
        3072
    """

    name: str
    plain_bytes: int
    checkpointed_bytes: int
    flops: int
    calls: int
    cost: int = 0
    ops: tuple[OpFigures, ...] = ()

    @property
    def saving(self) -> int:
        """The bytes checkpointing the region saves (negative when it would keep more)."""
        return self.plain_bytes - self.checkpointed_bytes


class _Tally:
    """One region's running totals."""

    __slots__ = ("calls", "checkpointed", "cost", "flops", "ops", "pending", "plain")

    def __init__(self) -> None:
        self.plain = self.checkpointed = self.flops = self.calls = self.cost = 0
        # The op calls, added up over the region's calls; None once two calls ran different sequences.
        self.ops: list[OpFigures] | None = []
        # The inputs of the call about to run (from the forward pre-hook): the tensors they hold and the size rule's
        # limit.
        self.pending: tuple[list[torch.Tensor], Any] = ([], 0)


class ActivationMeter:
    """Measures each of ``regions`` (checkpointed regions of ``model``) in the forwards run inside :meth:`measuring`.

    Args:
        model: The model; its parameters and buffers are never counted as activations.
        regions: The checkpointed regions to measure, by name.
        save_ops: The config's ``save_ops``, whose outputs a checkpointed region keeps.
        keep_data_dependent: The config's ``keep_data_dependent``.
        ops: Whether to measure each op call too (for ``budget_granularity="op"``).
        rates: The rates of the roofline cost model
            (:data:`~lightning_ckpt_determinism.checkpointing.cost.ROOFLINE` by default); ``None`` for the FLOP count.

    Example::

        >>> from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
        >>> _ = apply_activation_checkpointing(model, CheckpointingConfig(names=["1"]))
        >>> meter = ActivationMeter(model, {"1": model[1]})
        >>> with meter.measuring():
        ...     model(torch.randn(2, 4)).sum().backward()
        >>> figures = meter.figures()[0]
        >>> figures.plain_bytes, figures.checkpointed_bytes, figures.calls  # tanh keeps its output; its input is kept
        (32, 32, 1)
    """

    def __init__(
        self,
        model: nn.Module,
        regions: Mapping[str, nn.Module],
        save_ops: Sequence[str] = (),
        *,
        keep_data_dependent: bool = True,
        ops: bool = False,
        rates: Rates | None = ROOFLINE,
    ) -> None:
        self._regions = dict(regions)
        self._ops = ops
        self._rates = rates
        self._state = _state_storages(model)
        self._save_ops = frozenset(resolve_ops(list(save_ops)))
        self._keep = keep_data_dependent
        self._tallies = {name: _Tally() for name in self._regions}
        self._sharing = _sharing_parameters(self._regions)
        # The storages a region call keeps checkpointed or not (it saves them, and holds them among its inputs), with
        # an input tensor on each, weakly: another call that keeps one of them while that tensor lives (experts given
        # views of one activation) does not count it again.
        self._kept_anyway: dict[int, weakref.ref[torch.Tensor]] = {}
        # Inside `not_counting`: the forwards run count nothing.
        self.paused = False

    @contextlib.contextmanager
    def not_counting(self) -> Iterator[None]:
        """A block whose forwards count nothing, inside :meth:`measuring` (a check's own passes of the step)."""
        paused, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = paused

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        """Measure the regions' eager checkpointed forwards inside this block."""
        with contextlib.ExitStack() as stack:
            for name, module in self._regions.items():
                handle = module.register_forward_pre_hook(partial(self._inputs, name), with_kwargs=True)
                stack.callback(handle.remove)
                before = module.__dict__["forward"].saved_observer
                stack.enter_context(observing_saved_tensors(_RegionMeter(self, name, before), module))
            yield

    def figures(self) -> list[RegionFigures]:
        """The figures of each region, in the order the regions were given."""
        return [
            RegionFigures(
                name, tally.plain, tally.checkpointed, tally.flops, tally.calls, tally.cost, tuple(tally.ops or ())
            )
            for name, tally in self._tallies.items()
        ]

    def _inputs(self, name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.paused:
            return
        inputs = (*args, *kwargs.values())
        self._tallies[name].pending = (_held_tensors(inputs), input_limit(inputs))

    def activation_bytes(self, tensors: Sequence[Any], state: frozenset[int | None] = frozenset()) -> int:
        """The bytes of the distinct storages behind the tensors among ``tensors`` (this rank's shards of DTensors),
        the model's state and ``state`` left out.

        Args:
            tensors: Values, of which the tensors count.
            state: More storages that are state, not activations.
        """
        return sum(size for size, _ in self._storages(tensors, state).values())

    def _storages(
        self, tensors: Sequence[Any], state: frozenset[int | None] = frozenset()
    ) -> dict[int, tuple[int, torch.Tensor]]:
        """The distinct storages behind the tensors among ``tensors``, by pointer: their bytes and a tensor on each."""
        storages: dict[int, tuple[int, torch.Tensor]] = {}
        for value in tensors:
            local = local_tensor(value) if isinstance(value, torch.Tensor) else None
            # Other tensor subclasses have no storage of their own to count.
            if local is not None and type(local) is torch.Tensor:
                pointer = storage_pointer(local)
                if pointer is not None and pointer not in self._state and pointer not in state:
                    storages[pointer] = (local.untyped_storage().nbytes(), local)
        return storages

    def _counted_before(
        self, saved: dict[int, tuple[int, torch.Tensor]], inputs: dict[int, tuple[int, torch.Tensor]]
    ) -> int:
        """The bytes of the storages a region call keeps checkpointed or not (among both ``saved`` and ``inputs``)
        that an earlier call kept so too and that are still the same (their input tensor lives): counted once."""
        counted = 0
        for pointer in saved.keys() & inputs.keys():
            earlier = self._kept_anyway.get(pointer)
            if earlier is not None and earlier() is not None:
                counted += saved[pointer][0]
            else:
                self._kept_anyway[pointer] = weakref.ref(inputs[pointer][1])
        return counted


class _RegionMeter:
    """The saved-tensor observer of one measured region: counts each call, then hands on to the observer before it."""

    def __init__(self, meter: ActivationMeter, name: str, inner: SavedTensorObserver | None) -> None:
        self._meter = meter
        self._name = name
        self._tally = meter._tallies[name]
        self._inner = inner
        self._saved: list[torch.Tensor] = []
        # The op calls of the forward under way, while it runs: each saved tensor notes how far it had come.
        self._forward: _KeptOps | None = None

    @property
    def watching(self) -> bool:
        """Always: every call of a measured region is counted (the observer before it decides for itself)."""
        return True

    @contextlib.contextmanager
    def region_forward(self, region: str, module: nn.Module) -> Iterator[None]:
        inner = self._inner.region_forward(region, module) if self._inner is not None else contextlib.nullcontext()
        if self._meter.paused:
            with inner:
                yield
            return
        held, limit = self._tally.pending
        self._tally.pending = ([], 0)
        # FSDP2 gathers a region's parameters into new storages before its forward: state too, not activations.
        state = _state_storages(module)
        calls = _OpCalls(self._meter._state | state) if self._meter._ops else None
        # Under autocast's weight-cast cache, a call casts a weight another region cast before it (and cached) one
        # time less than its recomputation, which runs after the cache is cleared: the op calls' positions differ, and
        # a plan keeping outputs by position would meet another op in backward. Such a region is planned whole.
        positions_shift = calls is not None and self._name in self._meter._sharing and _casts_cached(module)
        kept = _KeptOps(self._meter._save_ops, self._meter._keep, limit, self._meter._rates, calls)
        self._saved = []
        self._forward = kept
        try:
            with inner, kept:
                yield
        finally:
            self._forward = None
        # A call whose recomputation runs to the region's end (an `nn.RReLU` in training, a tensor filled late) runs
        # every op call again.
        to_end = getattr(module.__dict__.get("forward"), "recomputes_to_end", False)
        rerun = len(kept.costs) if to_end else kept.rerun
        tally = self._tally
        tally.calls += 1
        meter = self._meter
        saved, inputs = meter._storages(self._saved, state), meter._storages(held)
        counted = meter._counted_before(saved, inputs)
        tally.plain += sum(size for size, _ in saved.values()) - counted
        tally.checkpointed += sum(size for size, _ in inputs.values()) + meter.activation_bytes(kept.outputs) - counted
        tally.flops += sum(kept.flops[:rerun])
        tally.cost += sum(kept.costs[:rerun])
        if positions_shift:
            tally.ops = None
        elif calls is not None:
            figures = [entry if entry.index < rerun else replace(entry, cost=0, flops=0) for entry in calls.figures]
            tally.ops = _added(tally.ops, figures) if tally.calls > 1 else figures
        self._saved = []

    def region_recompute(
        self, region: str, module: nn.Module, exposed_buffers: Sequence[tuple[str, torch.Tensor]]
    ) -> contextlib.AbstractContextManager[None]:
        if self._inner is None:
            return contextlib.nullcontext()
        return self._inner.region_recompute(region, module, exposed_buffers)

    def extractor(self) -> SavedPlan:
        inner = self._inner.extractor() if self._inner is not None else None

        def extract(tensor: torch.Tensor, position: int, strict: bool) -> Any:
            if self._forward is not None:
                # Held only until the forward ends, as autograd holds it anyway.
                self._saved.append(tensor)
                self._forward.saved_one()
            if inner is not None and position in inner.positions:
                return inner.extract(tensor, position, strict)
            return kept_by_torch(tensor, strict=strict)

        return SavedPlan(extract)


_HELD_DEPTH = 3
"""How deep :func:`_held_tensors` looks into the objects among a call's inputs (an object in an object ...)."""


def _held_tensors(inputs: tuple[Any, ...]) -> list[torch.Tensor]:
    """The tensors a call's ``inputs`` hold: their pytree leaves, and the tensors the other objects among them hold as
    attributes (in ``__dict__`` or ``__slots__``; a dataclass, an attention-bias object, an object inside one, down to
    :data:`_HELD_DEPTH` levels; modules left out). torch's checkpoint keeps the inputs as they came for the
    recomputation, and so everything they hold."""
    held: list[torch.Tensor] = []
    seen: set[int] = set()
    values, depth = list(inputs), 0
    while values and depth <= _HELD_DEPTH:
        inner: list[Any] = []
        for leaf in tree_leaves(values):
            if isinstance(leaf, torch.Tensor):
                held.append(leaf)
            elif not isinstance(leaf, _NOT_HOLDERS) and id(leaf) not in seen:
                seen.add(id(leaf))
                inner += _attribute_values(leaf)
        values, depth = inner, depth + 1
    return held


# What holds no activation of a call, however it is reached: modules (state), Python modules and classes.
_NOT_HOLDERS = (nn.Module, types.ModuleType, type)


def _attribute_values(value: object) -> list[Any]:
    """The values ``value`` holds as attributes, in its ``__dict__`` and in the ``__slots__`` of its classes; none
    where reading them raises (a ``__getattr__`` of its own)."""
    try:
        attributes = vars(value) if hasattr(value, "__dict__") else None
    except Exception:  # a `__getattr__` that raises another error than AttributeError
        return []
    found = list(attributes.values()) if isinstance(attributes, dict) else []
    for cls in type(value).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot not in ("__dict__", "__weakref__"):
                try:
                    found.append(getattr(value, slot))
                except Exception:  # a slot never set (AttributeError), or a descriptor of its own that raises
                    continue
    return found


def _sharing_parameters(regions: Mapping[str, nn.Module]) -> frozenset[str]:
    """The regions that hold a parameter another region holds too (a layer shared by two blocks)."""
    holders = Counter(id(parameter) for module in regions.values() for parameter in module.parameters())
    return frozenset(
        name for name, module in regions.items() if any(holders[id(parameter)] > 1 for parameter in module.parameters())
    )


def _casts_cached(module: nn.Module) -> bool:
    """Whether autocast runs now, with its weight-cast cache, on a device ``module``'s parameters are on."""
    devices = {parameter.device.type for parameter in module.parameters()}
    return torch.is_autocast_cache_enabled() and any(torch.is_autocast_enabled(device) for device in devices)


def _state_storages(module: nn.Module) -> frozenset[int | None]:
    """The storages of ``module``'s parameters and buffers as they are now (local shards of DTensors)."""
    return frozenset(storage_pointer(tensor) for tensor in (*module.parameters(), *module.buffers()))


def _added(before: list[OpFigures] | None, call: list[OpFigures]) -> list[OpFigures] | None:
    """Two calls' op figures added position by position; ``None`` when they ran different op sequences."""
    if before is None or [(entry.index, entry.op) for entry in before] != [(entry.index, entry.op) for entry in call]:
        return None
    return [
        OpFigures(entry.index, entry.op, entry.bytes + other.bytes, entry.cost + other.cost, entry.flops + other.flops)
        for entry, other in zip(before, call, strict=True)
    ]


class _OpCalls:
    """One forward's op calls, as selective checkpointing counts them, with the bytes each allocates and its cost."""

    def __init__(self, state: frozenset[int | None]) -> None:
        self.figures: list[OpFigures] = []
        self._state = state
        # The storage of each output that may be kept, with its call: the latest op to allocate at an address.
        self._owners: dict[int | None, int] = {}

    def note(self, func: Any, args: Any, kwargs: Any, out: Any, kept: bool, cost: int, flops: int) -> None:
        # An output written in place later in the forward cannot be kept: selective checkpointing refuses a kept
        # tensor that changed after it was kept (CPU dropout fills `empty_like`'s output with `bernoulli_`; an
        # in-place ReLU overwrites the `addmm` before it).
        for written in _storages(written_tensors(func, args, kwargs)):
            if (index := self._owners.pop(written, None)) is not None:
                self.figures[index] = replace(self.figures[index], bytes=0)
        tensors = [leaf for leaf in tree_leaves(out) if isinstance(leaf, torch.Tensor)]
        fresh = _storages(tensors)
        # An output of its own: no alias in the op's schema (views, in-place and out= ops have one), and no storage
        # shared with the op's arguments (alive now, so no address is reused) or the model's state.
        aliases = returns_alias(func)
        shared = fresh.keys() & (_storages(tree_leaves((args, kwargs))).keys() | self._state)
        whole = len(fresh) == len({*map(_storage_of, tensors)})
        # Nor a random op's: recomputation would not run it, and the random ops after it would draw other numbers.
        own = bool(tensors) and whole and not aliases and not shared and not is_random_op(func)
        size = sum(fresh.values()) if own and not kept else 0
        for storage in fresh.keys() - shared:
            if size:
                self._owners[storage] = len(self.figures)
            else:
                self._owners.pop(storage, None)
        self.figures.append(OpFigures(len(self.figures), str(func), size, cost, flops))


def _storage_of(tensor: torch.Tensor) -> int | None:
    local = local_tensor(tensor)
    return storage_pointer(local) if type(local) is torch.Tensor else None


def _storages(values: Sequence[Any]) -> dict[int | None, int]:
    """The distinct storages behind the plain tensors among ``values``, with their bytes."""
    found: dict[int | None, int] = {}
    for value in values:
        if isinstance(value, torch.Tensor):
            local = local_tensor(value)
            if type(local) is torch.Tensor and storage_pointer(local) is not None:
                found[storage_pointer(local)] = local.untyped_storage().nbytes()
    return found


class _KeptOps(TorchDispatchMode):
    """Notes the outputs a checkpointed region keeps from its forward: ``save_ops``, and data-dependent outputs by
    ``keep_data_dependent``'s size rule; adds up the op calls' recompute cost at ``rates``; and, when given
    ``calls``, notes each op call."""

    def __init__(
        self, save_ops: frozenset[Any], keep: bool, limit: Any, rates: Rates | None, calls: _OpCalls | None = None
    ) -> None:
        super().__init__()
        self._save_ops = save_ops
        self._keep = keep
        self._limit = limit
        self._rates = rates
        self._calls = calls
        self._framework = FrameworkOps()
        self.outputs: list[Any] = []
        # Each op call's recompute cost and FLOPs, by its position among those selective checkpointing sees.
        self.costs: list[int] = []
        self.flops: list[int] = []
        # How many of them had run when the forward saved its last tensor for backward (see `saved_one`).
        self.rerun = 0

    def saved_one(self) -> None:
        """The forward saved a tensor for backward: its recomputation runs at least the op calls made so far.

        torch's checkpoint stops a recomputation once it has saved its forward's last tensor again (early stop):
        the op calls after it never run again in backward, and cost nothing to checkpoint. An op saves its inputs
        before it runs (that op then is not counted: it is not recomputed) and its outputs after."""
        self.rerun = len(self.costs)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._framework.skips(func, args):  # an FSDP2 unit's own gathering inside the region
            return out
        kept = func in self._save_ops or (
            self._keep and is_data_dependent(func, args) and fits_size_rule(out, self._limit)
        )
        if kept:
            self.outputs.extend(tree_leaves(out))
        if func not in SAC_IGNORED_OPS:
            # A kept output is served from selective checkpointing's cache: its op never runs again.
            cost = 0 if kept else op_cost(func, args, kwargs, out, self._rates)
            flops = 0 if kept else op_flops(func, args, kwargs, out)
            self.costs.append(cost)
            self.flops.append(flops)
            if self._calls is not None:
                self._calls.note(func, args, kwargs, out, kept, cost, flops)
        return out
