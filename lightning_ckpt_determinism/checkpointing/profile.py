"""What a region's first checkpointed forward shows about it, learned once and kept by the region's wrapper.

A :class:`FirstForwardProbe` watches a region's first eager checkpointed forward and gives its
:class:`RegionProfile`:

- **Saved tensors filled late.** An op packs every tensor it saves before it runs: ``rrelu_with_noise`` packs its
  ``noise`` and fills it only afterwards, in place, without bumping a version counter. A saved tensor is filled late
  when an op that declares it writes its argument (``Tensor(a!)`` in its schema) writes that tensor's storage after
  it was packed, or when its values at the forward's end differ from a copy taken when it was packed (for a kernel
  that writes without declaring it). The schema is the reliable witness: an uninitialised ``noise`` may hold, by
  the allocator's reuse, the very values the op then writes. The sentinel reads those positions at the forward's
  end, and the region's recomputation runs to its end (torch's early stop off, as for the first call itself), so
  that it fills them again before they are unpacked.
- **Opaque workspaces.** The outputs of the ops in :data:`OPAQUE_WORKSPACES` are found among the saved tensors: bytes
  a kernel keeps for its own backward and leaves partly unwritten, which differ between identical forwards while the
  gradients do not. The sentinel leaves them out.
- **State the forward changes.** The buffers (compared by value: BatchNorm updates its running statistics without a
  version bump) and the plain Python attributes (:data:`~lightning_ckpt_determinism.checkpointing.modules.SCALARS`)
  of the region's modules whose values the forward changed, which recomputation replays
  (:class:`~lightning_ckpt_determinism.checkpointing.contexts.ForwardState`), and the ``torch.Generator`` objects
  the region's modules hold.

Watching costs one copy of the region's saved tensors and one host read, at the first call only. The probe's own ops
run below every dispatch mode, so that a selective-checkpointing cache never takes them for the model's; so it reads
a wrapper tensor subclass (a quantized weight) through its inner tensors
(:func:`~lightning_ckpt_determinism.checkpointing.modules.plain_parts`), which hold its values, and leaves out one
whose values it cannot reach.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from lightning_ckpt_determinism._torch_compat import (
    TorchDispatchMode,
    current_graph_task_id,
    no_python_dispatch,
    own_buffers,
    written_tensors,
)
from lightning_ckpt_determinism.checkpointing.equality import same_item, same_values
from lightning_ckpt_determinism.checkpointing.modules import (
    buffer_slots,
    generator_slots,
    plain_parts,
    scalar_attributes,
    storage_pointer,
)

__all__ = ["OPAQUE_WORKSPACES", "FirstForwardProbe", "RegionProfile"]

_MISSING = object()

OPAQUE_WORKSPACES: Mapping[str, tuple[int, ...]] = MappingProxyType(
    {
        # oneDNN's LSTM/GRU layer on the CPU (`nn.LSTM`, `nn.GRU`): its uint8 workspace, of which about 65k of 90k bytes
        # differ between two identical forwards while the gradients are bit-identical (verified, torch 2.13).
        "aten.mkldnn_rnn_layer": (3,),
        # cuDNN's RNN: its reserve space. Unverified: listed by analogy until a CUDA run confirms it (`.ci/gpu`).
        "aten._cudnn_rnn": (3,),
        # MIOpen's RNN (ROCm): its reserve space. Unverified, by analogy with cuDNN.
        "aten.miopen_rnn": (3,),
    }
)
"""Ops whose outputs at these positions are opaque workspaces: by op packet name, the output positions. A saved tensor
that is one of them is not compared by the sentinel (it counts as not compared)."""


@dataclass(frozen=True, eq=False)
class RegionProfile:
    """What a region's first checkpointed forward showed.

    Attributes:
        saved: How many tensors the forward saved for backward.
        filled_late: Positions among them whose values changed after they were saved (read at the forward's end).
        workspaces: Positions that are opaque workspaces (see :data:`OPAQUE_WORKSPACES`), never compared.
        buffers: Names (relative to the region) of the buffers the forward changed, replayed in recomputation; the
            wrapper adds those it sees changed later.
        attributes: The plain Python attributes the forward changed, as ``(module, name)``, replayed in recomputation.
        generators: The ``torch.Generator`` objects the region's modules hold, as ``(dotted name, generator)``.

    Example::

        >>> RegionProfile(saved=3).filled_late
        frozenset()
    """

    saved: int
    filled_late: frozenset[int] = frozenset()
    workspaces: frozenset[int] = frozenset()
    buffers: frozenset[str] = frozenset()
    attributes: tuple[tuple[nn.Module, str], ...] = ()
    generators: tuple[tuple[str, torch.Generator], ...] = ()


class FirstForwardProbe:
    """Watches one region call's forward (the region's first) and gives its :class:`RegionProfile`.

    Enter it around the forward, with the saved-tensor extractor handing it each saved tensor
    (:class:`~lightning_ckpt_determinism.checkpointing.saved.InRegionCall`); :attr:`profile` is set when the forward
    returns, and stays ``None`` when it raised.

    Args:
        module: The region.

    Example::

        >>> from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.RReLU())
        >>> _ = apply_activation_checkpointing(model, CheckpointingConfig(names=["1"]))
        >>> model(torch.randn(2, 4)).sum().backward()  # the region's first call is probed
        >>> sorted(model[1].forward.profile.filled_late)  # `rrelu_with_noise` fills its `noise` after saving it
        [0]
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.profile: RegionProfile | None = None
        self._task = current_graph_task_id()
        self._packed: list[tuple[torch.Tensor, _Snapshot | None, int]] = []
        # Packs and ops in the order they happen: a write to a packed tensor's storage by a later op fills it late.
        self.events = 0
        self._finder = _FirstCallMode(self)
        self._buffers: dict[str, tuple[nn.Module, str, torch.Tensor, _Snapshot | None]] = {}
        self._attributes: dict[tuple[nn.Module, str], Any] = {}

    def __enter__(self) -> "FirstForwardProbe":
        self._buffers = {
            name: (owner, key, buffer, _snapshot(buffer))
            for name, (owner, key, buffer) in buffer_slots(self.module).items()
        }
        self._attributes = scalar_attributes(self.module)
        self._finder.__enter__()
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        self._finder.__exit__(exc_type, *exc_info)
        if exc_type is None:
            with no_python_dispatch(), torch.no_grad():
                self.profile = self._learned()
        self._packed, self._buffers, self._attributes = [], {}, {}

    def packed(self, tensor: torch.Tensor) -> None:
        """Hold a tensor the forward saves, with a copy of its value now (the extractor's hook)."""
        if current_graph_task_id() != self._task:  # a backward run inside the forward compares its own tensors
            return
        self.events += 1
        self._packed.append((tensor, _snapshot(tensor), self.events))

    def _learned(self) -> RegionProfile:
        workspaces = frozenset(
            position
            for position, (tensor, _, _) in enumerate(self._packed)
            if storage_pointer(tensor) in self._finder.storages
        )
        # Parameters and buffers are state, not activations: BatchNorm saves its running statistics and its kernel
        # then updates them, but its backward in training never reads them (and the sentinel leaves state out).
        state = {storage_pointer(tensor) for tensor in (*self.module.parameters(), *self.module.buffers())}
        filled_late = frozenset(
            position
            for position, (tensor, copy, packed_at) in enumerate(self._packed)
            if position not in workspaces
            and storage_pointer(tensor) not in state
            and (
                self._finder.written_after(storage_pointer(tensor), packed_at) or (copy is not None and not _kept(copy))
            )
        )
        buffers = frozenset(
            name
            for name, (owner, key, buffer, value) in self._buffers.items()
            if own_buffers(owner).get(key) is not buffer or (value is not None and not _kept(value))
        )
        attributes = tuple(
            (owner, name)
            for (owner, name), value in self._attributes.items()
            if not same_item(vars(owner).get(name, _MISSING), value)
        )
        return RegionProfile(
            saved=len(self._packed),
            filled_late=filled_late,
            workspaces=workspaces,
            buffers=buffers,
            attributes=attributes,
            generators=tuple(generator_slots(self.module)),
        )


_Snapshot = tuple[tuple[torch.Tensor, torch.Tensor], ...]
"""Each plain part of a tensor (:func:`~lightning_ckpt_determinism.checkpointing.modules.plain_parts`) with a copy
of its value when it was taken."""


def _snapshot(tensor: torch.Tensor) -> _Snapshot | None:
    """``tensor``'s parts with copies of their values now; ``None`` where a part has no values to copy (another
    layout, meta) or the tensor's values are out of reach."""
    parts = plain_parts(tensor)
    if parts is None or any(part.layout != torch.strided or part.is_meta for part in parts):
        return None
    with no_python_dispatch(), torch.no_grad():
        return tuple((part, part.detach().clone()) for part in parts)


def _kept(snapshot: _Snapshot) -> bool:
    """Whether every part of a snapshot still holds the value copied."""
    return all(same_values(part, copy) for part, copy in snapshot)


class _FirstCallMode(TorchDispatchMode):
    """Notes, for the probe of a first call, the storages every op writes (by its schema) with when it ran, and the
    storage of every output of the ops in :data:`OPAQUE_WORKSPACES`."""

    def __init__(self, probe: FirstForwardProbe) -> None:
        super().__init__()
        self.probe = probe
        self.storages: set[int] = set()
        self._writes: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.probe.events += 1
        for tensor in written_tensors(func, args, kwargs):
            storage = storage_pointer(tensor)
            if storage is not None:
                self._writes[storage] = self.probe.events
        positions = OPAQUE_WORKSPACES.get(str(func.overloadpacket))
        if positions is not None and isinstance(out, (tuple, list)):
            for position in positions:
                storage = storage_pointer(out[position]) if position < len(out) else None
                if storage is not None and type(out[position]) is torch.Tensor:
                    self.storages.add(storage)
        return out

    def written_after(self, storage: int | None, event: int) -> bool:
        """Whether an op wrote ``storage`` after ``event``."""
        return storage is not None and self._writes.get(storage, 0) > event
