"""What each checkpointed region keeps for backward, with and without checkpointing, and what its recomputation costs.

An :class:`ActivationMeter` watches the eager forwards of a model's checkpointed regions inside
:meth:`ActivationMeter.measuring` and gives one :class:`RegionFigures` per region:

- **Plain bytes**: what the region would keep for backward without checkpointing, on this rank (a DTensor counts its
  local shard). Every tensor a checkpointed forward
  saves reaches the package's ``determinism_check`` extractor (:mod:`~lightning_ckpt_determinism.checkpointing.saved`)
  exactly as autograd would save it without checkpointing; the meter adds up the bytes of their distinct storages,
  leaving out the model's parameters and buffers (state, not activations). A view keeps its whole storage alive, so
  the whole storage counts.
- **Checkpointed bytes**: what the region keeps when checkpointed: the distinct storages of its tensor inputs (torch
  holds them for the recomputation), plus the outputs of the ops ``save_ops`` names and the data-dependent outputs
  ``keep_data_dependent`` keeps by its size rule (:mod:`~lightning_ckpt_determinism.checkpointing.routing`).
- **Forward FLOPs**: what one recomputation costs, counted by ``torch.utils.flop_counter.FlopCounterMode``. FLOPs
  rather than time, because a count is the same on every rank and every run, so that all ranks and reruns plan alike,
  and one forward timed per region on a busy device is noise. Its blind spot: it counts matrix products,
  convolutions and CUDA's fused attention only; elementwise ops, norms, softmax and attention on the CPU count 0, so a
  region made only of those looks free to recompute.

A region called several times in the step adds up its calls. The meter registers on each region as its saved-tensor
observer and hands every tensor on to the observer registered there before (the monitor's sentinel), so both see the
step. Compiled regions are not seen: the compiler recomputes them itself and calls no extractor.
"""

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_ckpt_determinism._torch_compat import TorchDispatchMode, tree_leaves
from lightning_ckpt_determinism.checkpointing.modules import local_tensor, storage_pointer
from lightning_ckpt_determinism.checkpointing.routing import fits_size_rule, input_limit, is_data_dependent
from lightning_ckpt_determinism.checkpointing.saved import Extractor, SavedTensorObserver, kept_by_torch
from lightning_ckpt_determinism.checkpointing.wrapper import observing_saved_tensors
from lightning_ckpt_determinism.config import resolve_ops

__all__ = ["ActivationMeter", "RegionFigures"]


@dataclass(frozen=True)
class RegionFigures:
    """What one candidate region keeps and costs in the measured step (all its calls added up).

    Attributes:
        name: The region's name.
        plain_bytes: Activation bytes it keeps for backward without checkpointing.
        checkpointed_bytes: Bytes it keeps when checkpointed: its inputs and what ``save_ops`` and
            ``keep_data_dependent`` keep.
        flops: Its forward FLOPs, which checkpointing spends again in backward.
        calls: How many times it ran; a region that did not run has only zeros.

    Example::

        >>> RegionFigures("blocks.0", plain_bytes=4096, checkpointed_bytes=1024, flops=10**6, calls=1).saving
        3072
    """

    name: str
    plain_bytes: int
    checkpointed_bytes: int
    flops: int
    calls: int

    @property
    def saving(self) -> int:
        """The bytes checkpointing the region saves (negative when it would keep more)."""
        return self.plain_bytes - self.checkpointed_bytes


class _Tally:
    """One region's running totals."""

    __slots__ = ("calls", "checkpointed", "flops", "pending", "plain")

    def __init__(self) -> None:
        self.plain = self.checkpointed = self.flops = self.calls = 0
        # The inputs of the call about to run (from the forward pre-hook): their bytes and the size rule's limit.
        self.pending: tuple[int, Any] = (0, 0)


class ActivationMeter:
    """Measures each of ``regions`` (checkpointed regions of ``model``) in the forwards run inside :meth:`measuring`.

    Args:
        model: The model; its parameters and buffers are never counted as activations.
        regions: The checkpointed regions to measure, by name.
        save_ops: The config's ``save_ops``, whose outputs a checkpointed region keeps.
        keep_data_dependent: The config's ``keep_data_dependent``.

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
    ) -> None:
        self._regions = dict(regions)
        self._state = _state_storages(model)
        self._save_ops = frozenset(resolve_ops(list(save_ops)))
        self._keep = keep_data_dependent
        self._tallies = {name: _Tally() for name in self._regions}

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
            RegionFigures(name, tally.plain, tally.checkpointed, tally.flops, tally.calls)
            for name, tally in self._tallies.items()
        ]

    def _inputs(self, name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        inputs = (*args, *kwargs.values())
        self._tallies[name].pending = (self.activation_bytes(tree_leaves(inputs)), input_limit(inputs))

    def activation_bytes(self, tensors: Sequence[Any], state: frozenset[int | None] = frozenset()) -> int:
        """The bytes of the distinct storages behind the tensors among ``tensors`` (this rank's shards of DTensors),
        the model's state and ``state`` left out.

        Args:
            tensors: Values, of which the tensors count.
            state: More storages that are state, not activations.
        """
        storages: dict[int, int] = {}
        for value in tensors:
            local = local_tensor(value) if isinstance(value, torch.Tensor) else None
            # Other tensor subclasses have no storage of their own to count.
            if local is not None and type(local) is torch.Tensor:
                pointer = storage_pointer(local)
                if pointer is not None and pointer not in self._state and pointer not in state:
                    storages[pointer] = local.untyped_storage().nbytes()
        return sum(storages.values())


class _RegionMeter:
    """The saved-tensor observer of one measured region: counts each call, then hands on to the observer before it."""

    def __init__(self, meter: ActivationMeter, name: str, inner: SavedTensorObserver | None) -> None:
        self._meter = meter
        self._tally = meter._tallies[name]
        self._inner = inner
        self._saved: list[torch.Tensor] = []

    @contextlib.contextmanager
    def region_forward(self, region: str, module: nn.Module) -> Iterator[None]:
        inputs_bytes, limit = self._tally.pending
        kept = _KeptOps(self._meter._save_ops, self._meter._keep, limit)
        flops = FlopCounterMode(display=False)
        inner = self._inner.region_forward(region, module) if self._inner is not None else contextlib.nullcontext()
        self._saved = []
        # FSDP2 gathers a region's parameters into new storages before its forward: state too, not activations.
        state = _state_storages(module)
        with inner, flops, kept:
            yield
        tally = self._tally
        tally.calls += 1
        tally.plain += self._meter.activation_bytes(self._saved, state)
        tally.checkpointed += inputs_bytes + self._meter.activation_bytes(kept.outputs)
        tally.flops += int(flops.get_total_flops())
        self._saved = []

    def region_recompute(
        self, region: str, module: nn.Module, exposed_buffers: Sequence[tuple[str, torch.Tensor]]
    ) -> contextlib.AbstractContextManager[None]:
        if self._inner is None:
            return contextlib.nullcontext()
        return self._inner.region_recompute(region, module, exposed_buffers)

    def extractor(self) -> Extractor:
        inner = self._inner.extractor() if self._inner is not None else None

        def extract(tensor: torch.Tensor, strict: bool) -> Any:
            # Held only until the forward ends, as autograd holds it anyway.
            self._saved.append(tensor)
            return inner(tensor, strict) if inner is not None else kept_by_torch(tensor, strict=strict)

        return extract


def _state_storages(module: nn.Module) -> frozenset[int | None]:
    """The storages of ``module``'s parameters and buffers as they are now (local shards of DTensors)."""
    return frozenset(storage_pointer(tensor) for tensor in (*module.parameters(), *module.buffers()))


class _KeptOps(TorchDispatchMode):
    """Notes the outputs a checkpointed region keeps from its forward: ``save_ops``, and data-dependent outputs by
    ``keep_data_dependent``'s size rule."""

    def __init__(self, save_ops: frozenset[Any], keep: bool, limit: Any) -> None:
        super().__init__()
        self._save_ops = save_ops
        self._keep = keep
        self._limit = limit
        self.outputs: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in self._save_ops or (
            self._keep and is_data_dependent(func, args) and fits_size_rule(out, self._limit)
        ):
            self.outputs.extend(tree_leaves(out))
        return out
