"""What a region's checkpointed calls show about it, learned from one call and kept by the region's wrapper for the
calls that look like it.

A :class:`FirstForwardProbe` watches one eager checkpointed forward of a region (a learning call) and gives its
:class:`RegionProfile`:

- **Saved tensors filled late.** An op packs every tensor it saves before it runs: ``rrelu_with_noise`` packs its
  ``noise`` and fills it only afterwards, in place, without bumping a version counter. A saved tensor is filled late
  when an op that declares it writes its argument (``Tensor(a!)`` in its schema) writes that tensor's storage after
  it was packed, or when its values at the forward's end differ from a copy taken when it was packed (for a kernel
  that writes without declaring it). The schema is the reliable witness: an uninitialised ``noise`` may hold, by
  the allocator's reuse, the very values the op then writes. The sentinel reads those positions at the forward's
  end, and the region's recomputation runs to its end, so that it fills them again before they are unpacked.
- **Saved tensors never written.** A declared write need not happen: in eval mode ``rrelu_with_noise`` saves its
  ``noise`` and never fills it (its backward never reads it). The probe fills every floating-point tensor an
  ``empty`` op makes with NaN (what torch's deterministic mode puts in uninitialised memory); a saved tensor still
  all NaN at the forward's end was never written, holds nothing to compare, and is left out like a workspace.
- **Opaque workspaces.** The outputs of the ops in :data:`OPAQUE_WORKSPACES` are found among the saved tensors: bytes
  a kernel keeps for its own backward and leaves partly unwritten, which differ between identical forwards while the
  gradients do not. The sentinel leaves them out.
- **State the forward changes.** The buffers (compared by value: BatchNorm updates its running statistics without a
  version bump) of the region's modules whose values the forward changed, which recomputation replays
  (:class:`~lightning_ckpt_determinism.checkpointing.contexts.ForwardState`), and the ``torch.Generator`` objects
  the region's modules hold. (The plain attributes a forward rebinds are found at every call, by the wrapper.)

**What is learned again, and when.** A profile is valid for calls like the one it was learned from. The wrapper
(:class:`~lightning_ckpt_determinism.checkpointing.wrapper.CheckpointedForward`) keys its profiles by what it can read
before a call, cheaply: the ``training`` flag of each of the region's modules and how many attributes each holds (a new
attribute, a generator created). It checks at every call that the generators it replays are still the ones the modules
hold (a generator replaced by a new one makes it forget what it learned), and at each forward's end that the call took
the path of the profile it was given: it saved as many tensors, made as many autograd nodes (the ops it recorded for
backward), and its output came from the same op (:attr:`RegionProfile.path`: two counts and a type, read once at the
forward's end, nothing per tensor). A call of a new key is probed. A call on the path of another profile of its key
takes that profile (the sentinel keeps what it digested as it went only where that path's values were final when saved);
one whose path matches no profile recomputes to its end, is not compared, and makes the next call of its key a learning
one. What the region replays only grows: a buffer a later forward changes in place is replayed from the next forward on
(that forward's own recomputation changes it no further, but starts from the value the forward left: the sentinel and
the check see it), and every profile replays it.

Watching costs one copy of the region's saved tensors and one host read, at learning calls only. The probe's own ops
run below every dispatch mode, so that a selective-checkpointing cache never takes them for the model's; so it reads
a wrapper tensor subclass (a quantized weight) through its inner tensors
(:func:`~lightning_ckpt_determinism.checkpointing.modules.plain_parts`), which hold its values, and leaves out one
whose values it cannot reach.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from lightning_ckpt_determinism._torch_compat import (
    TorchDispatchMode,
    buffer_version_counter,
    current_graph_task_id,
    no_python_dispatch,
    written_tensors,
)
from lightning_ckpt_determinism.checkpointing.equality import same_values
from lightning_ckpt_determinism.checkpointing.modules import (
    buffer_slots,
    buffer_written,
    generator_slots,
    holds_values,
    plain_parts,
    storage_pointer,
)

__all__ = ["OPAQUE_WORKSPACES", "FirstForwardProbe", "RegionProfile"]

# The ops that hand out uninitialised memory, by packet name.
_EMPTY_OPS = frozenset(
    {
        "aten.empty",
        "aten.empty_like",
        "aten.empty_permuted",
        "aten.empty_strided",
        "aten.new_empty",
        "aten.new_empty_strided",
    }
)

# The ops that fill their `noise` argument only where their `training` argument is true, by packet name.
_RRELU_OPS = frozenset({"aten.rrelu_with_noise", "aten.rrelu_with_noise_"})

OPAQUE_WORKSPACES: Mapping[str, tuple[int, ...]] = MappingProxyType(
    {
        # oneDNN's LSTM/GRU layer on the CPU (`nn.LSTM`, `nn.GRU`): its uint8 workspace, of which about 65k of 90k bytes
        # differ between two identical forwards while the gradients are bit-identical (verified, torch 2.13).
        "aten.mkldnn_rnn_layer": (3,),
        # cuDNN's RNN: its reserve space. Unverified: listed by analogy until a CUDA run confirms it (`.ci/gpu`).
        "aten._cudnn_rnn": (3,),
        # MIOpen's RNN (ROCm): its reserve space. Unverified, by analogy with cuDNN.
        "aten.miopen_rnn": (3,),
        # CTC (`nn.CTCLoss`): its `log_alpha`, allocated uninitialised and filled only up to each sample's input and
        # target lengths, the part its backward reads (verified on the CPU, torch 2.13; the CUDA kernel by analogy).
        "aten._ctc_loss": (1,),
    }
)
"""Ops whose outputs at these positions are opaque workspaces: by op packet name, the output positions. A saved tensor
that is one of them is not compared by the sentinel (it counts as not compared)."""


@dataclass(frozen=True, eq=False)
class RegionProfile:
    """What one checkpointed forward of a region showed, valid for the calls that look like it (see the module's
    description).

    Attributes:
        saved: How many tensors the forward saved for backward.
        filled_late: Positions among them whose values changed after they were saved (read at the forward's end).
        workspaces: Positions that are opaque workspaces (see :data:`OPAQUE_WORKSPACES`), never compared.
        unwritten: Positions no op wrote (a declared write that did not happen), never compared.
        mode_dependent: Of ``unwritten``, the ``noise`` of ``rrelu_with_noise``, which the op writes where its
            ``training`` argument is true: an argument no profile key sees where it is not the module's mode
            (``F.rrelu(x, training=self.noisy)``). The region's recomputation runs to its end at every call of
            the profile, so that a later call that writes it fills it before it is unpacked.
        buffers: Names (relative to the region) of the buffers the forward changed, replayed in recomputation; the
            wrapper adds those it sees changed later, and those other calls of the region changed.
        generators: The ``torch.Generator`` objects the region's modules hold, as ``(dotted name, generator)``.
        nodes: How many autograd nodes the forward made (the ops it recorded for backward).
        ends_in: The type of the autograd node the forward's output came from (the op the path ended in), ``None``
            for an output without one; with ``saved`` and ``nodes``, the path the profile is valid for (:attr:`path`).
        left_out: The positions the sentinel never compares: ``workspaces`` and ``unwritten`` together.

    Example::

        >>> RegionProfile(saved=3).filled_late
        frozenset()
        >>> sorted(RegionProfile(saved=3, workspaces=frozenset({0}), unwritten=frozenset({2})).left_out)
        [0, 2]
    """

    saved: int
    filled_late: frozenset[int] = frozenset()
    workspaces: frozenset[int] = frozenset()
    unwritten: frozenset[int] = frozenset()
    mode_dependent: frozenset[int] = frozenset()
    buffers: frozenset[str] = frozenset()
    generators: tuple[tuple[str, torch.Generator], ...] = ()
    nodes: int = 0
    ends_in: type | None = None
    # Worked out once: the sentinel asks for each tensor it digests.
    left_out: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "left_out", self.workspaces | self.unwritten)

    @property
    def path(self) -> tuple[int, int, type | None]:
        """The code path the profile was learned on: how many tensors the forward saved, how many autograd nodes it
        made, and the node its output came from. Two calls that differ in any took different paths.

        Example::

            >>> RegionProfile(saved=3, nodes=4).path
            (3, 4, None)
        """
        return self.saved, self.nodes, self.ends_in


class FirstForwardProbe:
    """Watches one region call's forward (a learning call: the region's first, or the first that looks unlike those it
    learned from) and gives its :class:`RegionProfile`.

    Enter it around the forward, with the saved-tensor extractor handing it each saved tensor
    (:class:`~lightning_ckpt_determinism.checkpointing.determinism_check.InRegionCall`); :attr:`profile` is set when
    the forward returns, and stays ``None`` when it raised.

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
        self._buffers: dict[str, tuple[nn.Module, str, torch.Tensor, _Snapshot | None, int]] = {}

    def __enter__(self) -> "FirstForwardProbe":
        self._buffers = {
            name: (owner, key, buffer, _snapshot(buffer), buffer_version_counter(buffer))
            for name, (owner, key, buffer) in buffer_slots(self.module).items()
        }
        self._finder.__enter__()
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        self._finder.__exit__(exc_type, *exc_info)
        if exc_type is None:
            with no_python_dispatch(), torch.no_grad():
                self.profile = self._learned()
        self._packed, self._buffers = [], {}

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
        unwritten = frozenset(
            position
            for position, (tensor, _, _) in enumerate(self._packed)
            if type(tensor) is torch.Tensor  # a subclass is never read with Python dispatch off
            and storage_pointer(tensor) in self._finder.uninitialised
            and holds_values(tensor)  # not freed since (FSDP2's gathered parameters, see `_kept`)
            and bool(tensor.isnan().all())
        )
        mode_dependent = frozenset(
            position for position in unwritten if storage_pointer(self._packed[position][0]) in self._finder.noise
        )
        filled_late = frozenset(
            position
            for position, (tensor, copy, packed_at) in enumerate(self._packed)
            if position not in workspaces
            and position not in unwritten
            and storage_pointer(tensor) not in state
            and (
                self._finder.written_after(storage_pointer(tensor), packed_at) or (copy is not None and not _kept(copy))
            )
        )
        # Written counts as changed whatever the values, as at later calls (`ForwardState` watches version counters):
        # an InstanceNorm with `momentum=None` writes its running statistics back unchanged.
        buffers = frozenset(
            name
            for name, (owner, key, buffer, value, version) in self._buffers.items()
            if buffer_written(owner, key, buffer, version) or (value is not None and not _kept(value))
        )
        return RegionProfile(
            saved=len(self._packed),
            filled_late=filled_late,
            workspaces=workspaces,
            unwritten=unwritten,
            mode_dependent=mode_dependent,
            buffers=buffers,
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
    """Whether every part of a snapshot still holds the value copied. A part whose storage was freed since (an FSDP2
    unit inside the region reshards its gathered parameters after its forward, and gathers them again for the
    recomputation) counts as kept: nothing filled it late."""
    return all(not holds_values(part) or same_values(part, copy) for part, copy in snapshot)


class _FirstCallMode(TorchDispatchMode):
    """Notes, for the probe of a learning call, the storages every op writes (by its schema) with when it ran, the
    storage of every output of the ops in :data:`OPAQUE_WORKSPACES`, and the floating-point tensors the ``empty`` ops
    hand out, which it fills with NaN."""

    def __init__(self, probe: FirstForwardProbe) -> None:
        super().__init__()
        self.probe = probe
        self.storages: set[int] = set()
        self.uninitialised: set[int] = set()
        # The storages given to `rrelu_with_noise` as its `noise`, whichever its `training` argument.
        self.noise: set[int] = set()
        self._writes: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # Its own reads make no autograd node (a DTensor's `to_local()` would), which the path counts.
        with torch.no_grad():
            self._note(func, args, kwargs, out)
        return out

    def _note(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        self.probe.events += 1
        for tensor in written_tensors(func, args, kwargs):
            storage = storage_pointer(tensor)
            if storage is not None:
                self._writes[storage] = self.probe.events
        name = str(func.overloadpacket)
        if name in _RRELU_OPS and len(args) > 1 and isinstance(args[1], torch.Tensor):
            storage = storage_pointer(args[1])
            if storage is not None:
                self.noise.add(storage)
        if name in _EMPTY_OPS and type(out) is torch.Tensor and out.is_floating_point() and not out.is_meta:
            # Uninitialised memory may hold anything; NaN tells, at the forward's end, whether an op wrote it.
            with no_python_dispatch(), torch.no_grad():
                out.detach().fill_(float("nan"))
            storage = storage_pointer(out)
            if storage is not None:
                self.uninitialised.add(storage)
        positions = OPAQUE_WORKSPACES.get(name)
        if positions is not None and isinstance(out, (tuple, list)):
            for position in positions:
                storage = storage_pointer(out[position]) if position < len(out) else None
                if storage is not None and type(out[position]) is torch.Tensor:
                    self.storages.add(storage)

    def written_after(self, storage: int | None, event: int) -> bool:
        """Whether an op wrote ``storage`` after ``event``."""
        return storage is not None and self._writes.get(storage, 0) > event
