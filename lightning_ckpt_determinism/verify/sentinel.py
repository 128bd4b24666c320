"""The sentinel: every tensor a checkpointed region saves for backward, compared after its recomputation with the
forward's, through digests, on every step.

Inside :func:`recomputation_sentinel` the sentinel is torch's ``determinism_check`` extractor for every eagerly
checkpointed region (:mod:`~lightning_ckpt_determinism.checkpointing.saved`). At the region's forward, torch hands
it each tensor it saves, before the op that saves it has run. The sentinel digests each on its device (a row and a
column reduction, in :mod:`~lightning_ckpt_determinism.verify.digest`) once its value is final: at once where the
region's profile (:mod:`~lightning_ckpt_determinism.checkpointing.profile`) says the op that saved it leaves it as
it was, at the forward's end where the profile says it is filled late (``rrelu_with_noise``'s ``noise``), and at the
forward's end for every tensor of a call the region learns from (its first, and the first of each kind of call: see
the profile's description). A call that saves another number of tensors than its profile (another code path) keeps
what it digested as it went only where the profile of that path says the value was final (all of it counts as not
compared on a path the region has no profile of yet). It keeps each
tensor's position, metadata and the op that produced it. At the region's first unpack in backward, once the region
is recomputed to the end, torch compares each kept value with the recomputed tensor (``!=``): the sentinel compares
the metadata at once (a difference raises torch's ``CheckpointError`` as before, under ``determinism_check=
"default"``) and digests the recomputed tensor. Around each recomputation it also watches the region's state: a
parameter whose version counter moves (recomputation writes it in place) and a buffer whose values change where no
recompute context puts them back (without ``protect_buffers``, BatchNorm updates its statistics a second time) are
mismatches, with their cause. A parameter written in place since the region's forward started (its version counter
moved: the forward writes it) is digested before and after each recomputation from then on, and counts only when
its values changed: an ``Embedding`` with ``max_norm`` renormalises its weight again in recomputation, which changes
nothing once its rows are within ``max_norm``. The tensor states of the torchmetrics metrics inside a region are
digested alike: a metric updated in forward is updated again by recomputation. The comparisons stay on the device,
read back later (:meth:`RecomputationSentinel.report`, or :meth:`RecomputationSentinel.settle` once per training step,
after one comparison for the whole step). Nothing is read back to the host inside forward or backward, and the
sentinel's own ops run below every dispatch mode, so that a selective-checkpointing cache or a mode of the user's never
takes them for the model's.

What it compares: activations. Parameters and buffers, which torch saves by reference (``addmm`` saves
``weight.t()``) and which may change legitimately before the recomputation (BatchNorm's running statistics), are
recognised by their storage and left out of the saved tensors (their writes are watched as above). Opaque
workspaces (an RNN layer's, see :data:`~lightning_ckpt_determinism.checkpointing.profile.OPAQUE_WORKSPACES`),
saved tensors no op wrote (eval-mode ``rrelu_with_noise``'s ``noise``), tensors without bits to read and any tensor
the sentinel fails to read are left out and counted as not compared; a failure of its own is logged once and never
reaches training. What it cannot see: compiled regions are recomputed by the compiler, which calls no extractor
(they count as not compared; regions that graph-break run eagerly and are compared); Python values a wrapper tensor
subclass keeps beside its inner tensors (it reads a DTensor's shard, and a wrapper subclass such as a quantized
weight through the inner tensors of its ``__tensor_flatten__``; one with neither is left out, said once per region);
writes to parameters that bump no version counter; with sampled digests, a change of single elements shows only at
the steps whose offset reads them.
"""

import contextlib
import logging
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, get_args

import torch
from torch import nn

from lightning_ckpt_determinism._library_compat import metric_state_names
from lightning_ckpt_determinism._text import describe_saved
from lightning_ckpt_determinism._torch_compat import (
    is_compiled_module,
    no_python_dispatch,
    own_parameters,
    version_counter,
    view_base,
)
from lightning_ckpt_determinism.checkpointing.modules import plain_parts, storage_pointer
from lightning_ckpt_determinism.checkpointing.profile import RegionProfile
from lightning_ckpt_determinism.checkpointing.saved import Extractor, Recomputed
from lightning_ckpt_determinism.checkpointing.wrapper import checkpointed_modules, observing_saved_tensors
from lightning_ckpt_determinism.config import choice_message
from lightning_ckpt_determinism.verify.cause import Cause
from lightning_ckpt_determinism.verify.digest import EXACT, DigestMode, DigestPlans, DigestTier, Sums, readable
from lightning_ckpt_determinism.verify.gradients import local_tensor
from lightning_ckpt_determinism.verify.light import SavedLayout
from lightning_ckpt_determinism.verify.state import named_metrics

__all__ = [
    "RecomputationSentinel",
    "SentinelMode",
    "SentinelRegion",
    "SentinelReport",
    "SentinelStep",
    "recomputation_sentinel",
]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SentinelRegion:
    """What the sentinel found in one checkpointed region.

    Attributes:
        compared: Saved tensors whose recomputation was compared with the forward's.
        mismatches: Those whose recomputation differed, plus the parameters recomputation wrote in place and the
            buffers and metric states whose values it changed.
        first_mismatch: The first that differed: its position among the region's saved tensors, the op that
            produced it, its shape and dtype (and what differed, for metadata), or the parameter or buffer and what
            recomputation did to it; ``None`` when none did.
        not_compared: Saved tensors (activations) left out: opaque workspaces, tensors without bits to read, and any
            the sentinel failed to read.
        cause: The cause of ``first_mismatch`` when the sentinel knows it (``"parameter_write"``,
            ``"buffer_mutation"``, ``"metric_update"``); ``None`` for a saved tensor, whose cause a full check names.

    Example::

        >>> SentinelRegion().compared
        0
    """

    compared: int = 0
    mismatches: int = 0
    first_mismatch: str | None = None
    not_compared: int = 0
    cause: Cause | None = None


@dataclass(frozen=True)
class SentinelReport:
    """What the sentinel found since its block was entered.

    Attributes:
        compared: Saved tensors whose recomputation was compared, over every region.
        mismatches: Mismatches over every region (see :class:`SentinelRegion`).
        regions: One :class:`SentinelRegion` per checkpointed region, by name relative to the module, every region
            present.
        compiled: The regions inside compiled modules, recomputed by the compiler (not compared unless they
            graph-break).
        not_compared: Saved tensors left out, over every region.

    Example::

        >>> SentinelReport(0, 0, {}).mismatches
        0
    """

    compared: int
    mismatches: int
    regions: dict[str, SentinelRegion]
    compiled: list[str] = field(default_factory=list)
    not_compared: int = 0


class _Saved:
    """What torch keeps of one saved tensor at the forward, and compares with ``!=`` after the recomputation.

    ``slot`` is its place among the call's digests: ``None`` for a parameter, a buffer or a tensor left out. ``mode``
    is what its digests read (the light tier's rotating tensor reads another window than the call's others).
    """

    __slots__ = ("broken", "call", "device", "dtype", "mode", "position", "producer", "shape", "slot", "strict")

    cause = None

    def __init__(self, call: "_Call", position: int, *, strict: bool) -> None:
        self.call = call
        self.position = position
        self.strict = strict
        self.slot: int | None = None
        self.shape: torch.Size | None = None
        self.dtype: torch.dtype | None = None
        self.device: torch.device | None = None
        self.mode = call.mode
        self.producer = ""
        # The sentinel failed to keep it: never compared, and never a reason for torch to raise.
        self.broken = False

    def __ne__(self, other: object) -> bool:
        if self.broken:
            return False
        if isinstance(other, Recomputed):
            tensor = other()
            return tensor is not None and self.call.recomputed(self, tensor)
        # The recomputation ran outside the sentinel (torch's metadata, or nothing under "none").
        return self.strict and self.metadata() != other

    def __eq__(self, other: object) -> bool:
        return not self.__ne__(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self.metadata())

    def metadata(self) -> dict[str, Any]:
        return {"shape": self.shape, "dtype": self.dtype, "device": self.device}

    def describe(self) -> str:
        return describe_saved(self.position, self.producer or None, self.shape, self.dtype)


@dataclass(frozen=True)
class _StateChange:
    """A parameter or buffer a recomputation changed, as a mismatch describes it."""

    description: str
    cause: Cause | None

    def describe(self) -> str:
        return self.description


class _Call:
    """One forward of one region: its saved tensors' digests and, after each recomputation, the digests to compare.

    Which saved tensors it digests: every one, or under the light tier the targets of the region's
    :class:`~lightning_ckpt_determinism.verify.light.SavedLayout` (``targets``); a call of a region without a layout
    yet looks at every saved tensor, learns the layout at its forward's end and digests that step's targets. Each
    digested tensor is digested once its value is final (see the module's description); the forward's digests are
    stacked into one vector when the region's forward ends, the recomputation's at the comparison of the last of
    them. The others are given back as torch's own extractor would keep them.
    """

    def __init__(
        self,
        sentinel: "RecomputationSentinel",
        region: str,
        buffers: frozenset[int | None],
        profile: RegionProfile | None,
        layout: SavedLayout | None,
    ) -> None:
        self.sentinel = sentinel
        self.region = region
        self.buffers = buffers
        self.profile = profile
        self.mode = sentinel.mode
        self.layout = layout
        self.targets = None if layout is None else layout.targets(self.mode)
        # Light without a layout: the layout is learned from this call, at its forward's end.
        self.learning = layout is None and self.mode.tier == "light"
        self._seen: list[tuple[int, bool]] = []
        self.packs = 0
        self.saved: list[_Saved] = []
        self.slotted: list[_Saved] = []
        self.saved_bytes = 0
        self.not_compared = 0 if layout is None else layout.left_out
        self.forward: torch.Tensor | None = None
        self.comparisons: list[tuple[list[int], torch.Tensor]] = []
        self.metadata_mismatches: list[str] = []
        # Each digested tensor's row and column sums (a subclass's digest), weighted into digests together.
        self._digests: list[Sums | torch.Tensor] = []
        self._held: list[tuple[_Saved, torch.Tensor]] = []
        self._recomputed: list[tuple[int, Sums | torch.Tensor]] = []

    def save(self, tensor: torch.Tensor, strict: bool) -> Any:
        """Keep ``tensor``'s metadata, and its digest once its value is final; a tensor the light tier does not digest
        at this call gets what torch's own extractor keeps, at the cost of a count and a lookup."""
        position = self.packs
        self.packs = position + 1
        targets = self.targets
        if targets is not None and position not in targets:
            return {"shape": tensor.shape, "dtype": tensor.dtype, "device": tensor.device} if strict else None
        saved = _Saved(self, position, strict=strict)
        self.saved.append(saved)
        try:
            local = tensor if type(tensor) is torch.Tensor else local_tensor(tensor)
            saved.shape, saved.dtype, saved.device = local.shape, local.dtype, local.device
            saved.producer = tensor.grad_fn.name() if tensor.grad_fn is not None else ""
            if _is_state(tensor, local, self.buffers):
                return saved
            if self.targets is not None:
                saved.mode = self.targets[position]
            self.saved_bytes += local.numel() * local.element_size() if type(local) is torch.Tensor else _bytes(local)
            profile = self.profile
            if profile is not None and position in profile.left_out:
                self.not_compared += 1
            elif self.learning and profile is not None:
                self._roll(saved, local)
            elif profile is None or position in profile.filled_late:
                self._held.append((saved, local))  # read when the forward ends, once the op saving it has run
            else:
                self._take(saved, local)
        except Exception as err:  # the sentinel's own failure stops it observing this tensor, never the step
            self._leave_out(saved, err)
        return saved

    def _roll(self, saved: _Saved, local: torch.Tensor) -> None:
        """A learning call notes each comparable activation and holds only the last one and the last floating-point
        one (the targets it digests), so that learning holds no more memory than two tensors."""
        if not readable(local):
            self._unreadable(local)
            return
        floating = local.dtype.is_floating_point
        self._seen.append((saved.position, floating))
        kept = [] if floating else [entry for entry in self._held if entry[1].dtype.is_floating_point]
        self._held = [*kept, (saved, local)]

    def _take(self, saved: _Saved, local: torch.Tensor) -> None:
        found = self._digest(local, saved)
        if found is None:
            self._unreadable(local)
            return
        saved.slot = len(self._digests)
        self._digests.append(found)
        self.slotted.append(saved)

    def _digest(self, local: torch.Tensor, saved: _Saved) -> Sums | torch.Tensor | None:
        """``local``'s row and column sums in ``saved``'s mode (a subclass's digest), weighted with the call's others
        once they are all taken; ``None`` for a tensor without bits to read (or unreadable)."""
        plans = self.sentinel.plans
        try:
            with no_python_dispatch():  # a dispatch mode of the region (selective checkpointing) must not see it
                if type(local) is not torch.Tensor:  # a subclass: its inner tensors
                    return plans.digest_of(local, saved.mode)
                matrix = plans.read(local, saved.mode)
                return None if matrix is None else plans.sums(matrix)
        except Exception as err:
            self.sentinel.failed(self.region, saved.describe(), err)
            return None

    def _unreadable(self, local: torch.Tensor) -> None:
        """A saved activation without bits to read: counted as not compared (a tensor subclass, said once)."""
        self.not_compared += 1
        if type(local) is not torch.Tensor:
            self.sentinel.unreadable(self.region, local)

    def _leave_out(self, saved: _Saved, err: Exception) -> None:
        saved.broken, saved.slot = True, None
        self.not_compared += 1
        self.sentinel.failed(self.region, f"saved tensor {saved.position}", err)

    def forward_done(self, *, digest: bool, profile: RegionProfile | None) -> None:
        """The region's forward ended: digest the tensors held until now and stack the digests into one vector (or
        drop them, when it raised; a call that took another path than the profile it started with keeps only what
        was final when digested, the rest counted as not compared); a call that learned its region's layout, or
        saved another number of tensors than it, tells the sentinel.

        Args:
            digest: Whether the forward returned.
            profile: The profile of the path the call took (learned during this forward when it is a learning
                call; ``None`` for a path the region does not know).
        """
        if digest and self.profile is not None and (profile is None or profile.saved != self.profile.saved):
            self._another_path(profile)
        if digest:
            left_out = profile.left_out if profile is not None else frozenset()
            held = [(saved, local) for saved, local in self._held if saved.position not in left_out]
            self.not_compared += len(self._held) - len(held)
            if self.learning:
                held = self._learn(held)
            elif self.layout is not None and self.packs != self.layout.saved:
                self.sentinel.learned(self.region, None)  # another code path: its layout is learned again
            for saved, local in held:
                self._take(saved, local)
            if self._digests:
                try:
                    with no_python_dispatch():
                        self.forward = self.sentinel.plans.combined(self._digests)
                except Exception as err:
                    self.sentinel.failed(self.region, "the forward's digests", err)
                    self.not_compared += len(self.slotted)
                    self.slotted = []
        self._digests, self._held = [], []

    def _another_path(self, profile: RegionProfile | None) -> None:
        """The call took another path than the one its profile was learned on: of what it digested as it went, only
        the tensors its own path's profile says were final when saved are kept (none, on a path without one)."""
        early = frozenset(range(self.packs)) if profile is None else profile.filled_late | profile.left_out
        digested = zip(self.slotted, self._digests, strict=True)
        kept = [(saved, found) for saved, found in digested if saved.position not in early]
        for saved in self.slotted:
            saved.slot = None
        self.not_compared += len(self.slotted) - len(kept)
        self.slotted, self._digests = [saved for saved, _ in kept], [found for _, found in kept]
        for slot, saved in enumerate(self.slotted):
            saved.slot = slot
        if profile is None:
            self.not_compared += len(self._held)
            self._held = []

    def _learn(self, held: list[tuple[_Saved, torch.Tensor]]) -> list[tuple[_Saved, torch.Tensor]]:
        """Learn the region's layout from this call, and keep the held activations its targets name.

        The region's first call (no profile yet) held every activation, read off here; a later one noted them as
        they came and held only the last and the last floating-point one.
        """
        seen = self._seen
        if self.profile is None:
            comparable = []
            for saved, local in held:
                if readable(local):
                    comparable.append((saved, local))
                else:
                    self._unreadable(local)
            seen = [(saved.position, local.dtype.is_floating_point) for saved, local in comparable]
            held = comparable
        layout = SavedLayout(
            saved=self.packs,
            compared=tuple(position for position, _ in seen),
            floating=tuple(position for position, floating in seen if floating),
            left_out=self.not_compared,
        )
        self.sentinel.learned(self.region, layout)
        targets = layout.targets(self.mode)
        for saved, _ in held:
            saved.mode = targets.get(saved.position, self.mode)
        return [(saved, local) for saved, local in held if saved.position in targets]

    def recomputed(self, saved: _Saved, tensor: torch.Tensor) -> bool:
        """torch compares ``saved`` with its recomputation: the metadata and the digest now, the comparison of the
        digests (stacked at the call's last tensor) at the step's end."""
        self.sentinel.comparing(self)
        local = tensor if type(tensor) is torch.Tensor else local_tensor(tensor)
        if (local.shape, local.dtype, local.device) != (saved.shape, saved.dtype, saved.device):
            if saved.strict:
                return True  # torch raises its CheckpointError, naming the metadata
            recomputed_as = f"{tuple(local.shape)} {local.dtype} on {local.device}"
            self.metadata_mismatches.append(f"{saved.describe()} was recomputed as {recomputed_as}")
        elif saved.slot is not None and self.forward is not None:
            found = self._digest(local, saved)
            if found is None:
                self.not_compared += 1
            else:
                self._recomputed.append((saved.slot, found))
        if saved is self.saved[-1]:
            self.recomputation_done()
        return False

    def recomputation_done(self) -> None:
        """Weight this recomputation's sums into its digests (also reached later, when the last tensor's holder was
        freed)."""
        if self._recomputed:
            slots = [slot for slot, _ in self._recomputed]
            found = [digest for _, digest in self._recomputed]
            try:
                with no_python_dispatch():
                    self.comparisons.append((slots, self.sentinel.plans.combined(found)))
            except Exception as err:
                self.sentinel.failed(self.region, "the recomputation's digests", err)
                self.not_compared += len(slots)
        self._recomputed = []
        self.sentinel.compared(self)

    def pairs(self) -> Iterator[tuple[list[Any], torch.Tensor, torch.Tensor]]:
        """Each recomputation's saved tensors, with the forward's digests of them and the recomputed ones."""
        forward = self.forward
        if forward is None:  # nothing digested, so no slots
            return
        for slots, recomputed in self.comparisons:
            items: list[Any] = [self.slotted[slot] for slot in slots]
            every = len(slots) == len(forward) and slots == list(range(len(slots)))
            yield items, forward if every else forward[torch.tensor(slots, device=forward.device)], recomputed


class _StateWatch:
    """One recomputation of a region, watched for what it changes: the version counters of the region's parameters,
    the digests of the parameters its forward writes in place (a write counts only where it changed values), of the
    buffers no recompute context puts back, and of the tensor states of the torchmetrics metrics inside it."""

    def __init__(
        self,
        sentinel: "RecomputationSentinel",
        region: str,
        versions: list[tuple[str, torch.Tensor, int]],
        exposed: Sequence[tuple[str, torch.Tensor]],
        forward_written: frozenset[str],
        metrics: Sequence[tuple[str, Any, str]] = (),
    ) -> None:
        self.sentinel = sentinel
        self.region = region
        self.versions = versions
        self.parameters = (
            [(name, local_tensor(param)) for name, param, _ in versions if name in forward_written and readable(param)]
            if forward_written
            else []
        )
        self.buffers = [(name, local_tensor(buffer)) for name, buffer in exposed if readable(buffer)]
        self.metrics = [(name, metric, state) for name, metric, state in metrics if readable(getattr(metric, state))]
        self.parameters_before = self._digests(self.parameters)
        self.before = self._digests(self.buffers)
        self.metrics_before = self._digests(self._metric_values())

    def _metric_values(self) -> list[tuple[str, torch.Tensor]]:
        # Read through the metric at each digest: an update may bind a new tensor (`self.total = self.total + x`).
        return [(name, local_tensor(getattr(metric, state))) for name, metric, state in self.metrics]

    def _digests(self, tensors: list[tuple[str, torch.Tensor]]) -> torch.Tensor | None:
        if not tensors:
            return None
        with no_python_dispatch(), torch.no_grad():
            plans = self.sentinel.plans
            return torch.stack([plans.digest_of(tensor, EXACT) for _, tensor in tensors])  # type: ignore[misc]

    def done(self) -> None:
        digested = {name for name, _ in self.parameters}
        written = [
            name for name, param, version in self.versions if version_counter(param) != version and name not in digested
        ]
        if written:
            self.sentinel.changed(self.region, [self._parameter_change(name) for name in written])
        if self.parameters_before is not None:
            after = self._digests(self.parameters)
            items = [self._parameter_change(name) for name, _ in self.parameters]
            self.sentinel.state_compared(self.region, items, self.parameters_before, after)  # type: ignore[arg-type]
        if self.before is not None:
            after = self._digests(self.buffers)
            items = [
                _StateChange(f"buffer `{self.region}.{name}` changed by recomputation", Cause.BUFFER_MUTATION)
                for name, _ in self.buffers
            ]
            self.sentinel.state_compared(self.region, items, self.before, after)  # type: ignore[arg-type]
        if self.metrics_before is not None:
            after = self._digests(self._metric_values())
            items = [
                _StateChange(f"metric `{self.region}.{name}` ({state}) updated by recomputation", Cause.METRIC_UPDATE)
                for name, _, state in self.metrics
            ]
            self.sentinel.state_compared(self.region, items, self.metrics_before, after)  # type: ignore[arg-type]

    def _parameter_change(self, name: str) -> "_StateChange":
        return _StateChange(
            f"parameter `{self.region}.{name}` written in place by recomputation", Cause.PARAMETER_WRITE
        )


def _versions(parameters: Sequence[tuple[str, dict[str, Any], str]]) -> list[tuple[str, torch.Tensor, int]]:
    """Each parameter with its version counter now, read through its owner's own parameters: FSDP2 swaps the parameter
    objects in and out."""
    return [
        (name, param, version_counter(param))
        for name, owned, attribute in parameters
        if (param := owned.get(attribute)) is not None
    ]


def _metric_states(module: nn.Module) -> list[tuple[str, Any, str]]:
    """Each tensor state of the torchmetrics metrics inside ``module``, as ``(metric name, metric, state)``: a metric
    its forward updates, recomputation updates a second time."""
    return [
        (name, metric, state)
        for name, metric in named_metrics(module)
        for state in metric_state_names(metric)
        if isinstance(getattr(metric, state), torch.Tensor)
    ]


def _parameter_places(module: nn.Module) -> list[tuple[str, dict[str, Any], str]]:
    """Each parameter of ``module`` as ``(name, its owner's own parameters, attribute)``: the dict's ``attribute`` is
    the parameter (the dict stays the owner's when FSDP2 swaps its entries)."""
    places = []
    for name, _ in module.named_parameters():
        path, _, attribute = name.rpartition(".")
        places.append((name, own_parameters(module.get_submodule(path) if path else module), attribute))
    return places


def _is_state(tensor: torch.Tensor, local: torch.Tensor, buffers: frozenset[int | None]) -> bool:
    """Whether a saved tensor is a parameter or a buffer, or a view of one (``addmm`` saves ``weight.t()``).

    A parameter is known by the tensor it views (FSDP2 swaps in unsharded parameters at each forward, so their
    storage moves); a buffer by its storage, which stays.
    """
    base = view_base(tensor)
    if base is None:
        base = tensor
    if isinstance(base, nn.Parameter):
        return True
    if not buffers:
        return False
    pointer = storage_pointer(local)
    return pointer is not None and pointer in buffers


def _bytes(tensor: torch.Tensor) -> int:
    """The bytes a tensor subclass holds: its inner tensors' (see :func:`plain_parts`), or as its metadata says."""
    parts = plain_parts(tensor)
    if parts is None:
        return tensor.numel() * tensor.element_size()
    return sum(part.numel() * part.element_size() for part in parts)


def _profile(module: nn.Module) -> RegionProfile | None:
    """The profile the region's wrapper learned, or ``None`` before its first checkpointed forward."""
    return getattr(module.__dict__.get("forward"), "profile", None)


_Entry = tuple[str, list[Any]]

SentinelMode = DigestTier
"""What the sentinel digests: a few saved tensors per region call with a window of each row (``"light"``), every
saved tensor with a window of each row (``"sampled"``), or every element of every saved tensor (``"exact"``): the
digests' tiers (:data:`~lightning_ckpt_determinism.verify.digest.DigestTier`)."""


class SentinelStep:
    """What one step compared, kept on the device until it is read (:meth:`RecomputationSentinel.read`): the step
    of a mismatch is known when it is read, however much later.

    Attributes:
        compared: Saved tensors compared (known on the host, without reading the device).

    Example::

        >>> sentinel = RecomputationSentinel(torch.nn.Linear(2, 2))
        >>> step = sentinel.end_step()
        >>> step.compared, step.mismatch_counts("cpu").tolist()
        (0, [])
    """

    def __init__(self, sentinel: "RecomputationSentinel") -> None:
        self._sentinel = sentinel
        self.calls: list[_Call] = []
        self.state_pairs: list[tuple[str, list[Any], torch.Tensor, torch.Tensor]] = []
        self.changes: list[tuple[str, _StateChange]] = []
        self.read: dict[str, SentinelRegion] | None = None
        self._flags: tuple[list[_Entry], torch.Tensor | None] | None = None

    @property
    def compared(self) -> int:
        """Saved tensors compared in this step (known on the host)."""
        compared = sum(len(slots) for call in self.calls for slots, _ in call.comparisons if call.forward is not None)
        return compared + sum(len(call.metadata_mismatches) for call in self.calls)

    def updated(self) -> None:
        """Something was added to the step (comparisons made after :meth:`flags` are compared again)."""
        self._flags = None

    def mismatch_counts(self, device: torch.device | str) -> torch.Tensor:
        """How many mismatches each region had in this step, as an integer tensor on ``device`` in region order;
        computed on the device, not read back.

        Args:
            device: Where the counts go (the device the collective backend needs).
        """
        names = self._sentinel.regions
        layout, flags = self.flags()
        counts = torch.zeros(len(names), dtype=torch.int64, device=device)
        index = {name: position for position, name in enumerate(names)}
        if flags is not None:
            regions = [index[region] for region, items in layout for _ in items]
            owners = torch.tensor(regions, dtype=torch.int64, device=flags.device)
            with no_python_dispatch():
                found = torch.zeros(len(names), dtype=torch.int64, device=flags.device).index_add_(0, owners, flags)
            counts = found.to(device)
        known = [0] * len(names)
        for call in self.calls:
            known[index[call.region]] += len(call.metadata_mismatches)
        for region, _ in self.changes:
            known[index[region]] += 1
        if any(known):
            counts = counts + torch.tensor(known, dtype=torch.int64, device=device)
        return counts

    def flags(self) -> tuple[list[_Entry], torch.Tensor | None]:
        """Every comparison of the step, in order, and whether each differed (an int64 vector, on the device;
        ``None`` when nothing was compared): one comparison for all of them."""
        if self._flags is None:
            layout: list[_Entry] = []
            forward, recomputed = [], []
            for call in self.calls:
                for items, before, after in call.pairs():
                    layout.append((call.region, items))
                    forward.append(before)
                    recomputed.append(after)
            for region, items, before, after in self.state_pairs:
                layout.append((region, items))
                forward.append(before)
                recomputed.append(after)
            flags = None
            if forward:
                with no_python_dispatch():
                    flags = (torch.cat(forward) != torch.cat(recomputed)).to(torch.int64)
            self._flags = (layout, flags)
        return self._flags

    def regions(self, *, clean: bool) -> dict[str, SentinelRegion]:
        """What the step found by region, reading the comparisons back unless ``clean``."""
        layout, flags = self.flags()
        names = self._sentinel.regions
        differed = [] if clean or flags is None else flags.tolist()
        found: dict[str, list[Any]] = {name: [] for name in names}
        compared = dict.fromkeys(names, 0)
        not_compared = dict.fromkeys(names, 0)
        at = 0
        for owner, items in layout:
            compared[owner] += sum(isinstance(item, _Saved) for item in items)
            for item, flag in zip(items, differed[at : at + len(items)], strict=False):
                if flag:
                    found[owner].append(item)
            at += len(items)
        for call in self.calls:
            compared[call.region] += len(call.metadata_mismatches)
            not_compared[call.region] += call.not_compared
            found[call.region].extend(_StateChange(text, None) for text in call.metadata_mismatches)
        for owner, change in self.changes:
            found[owner].append(change)
        return {
            name: SentinelRegion(
                compared=compared[name],
                mismatches=len(found[name]),
                first_mismatch=found[name][0].describe() if found[name] else None,
                not_compared=not_compared[name],
                cause=found[name][0].cause if found[name] else None,
            )
            for name in names
        }


class RecomputationSentinel:
    """The sentinel of one module's checkpointed regions: see :func:`recomputation_sentinel`.

    Args:
        module: The model; regions are named relative to it.
        mode: What to digest (:data:`SentinelMode`).
        exact: Deprecated: ``True`` means ``mode="exact"``, ``False`` means ``mode="sampled"``.

    Raises:
        ValueError: If ``mode`` is not one of :data:`SentinelMode`.
    """

    def __init__(self, module: nn.Module, *, mode: SentinelMode = "light", exact: bool | None = None) -> None:
        self.tier: SentinelMode = _tier(mode, exact, stacklevel=3)
        regions = checkpointed_modules(module)
        self._names = list(regions)
        self._name_of = {id(sub): name for name, sub in regions.items()}
        self._compiled = _compiled_regions(module)
        # Buffers keep their storage (BatchNorm updates its statistics in place, and recomputation gets the buffers
        # themselves): known once.
        self._buffers = {
            name: frozenset(storage_pointer(buffer) for buffer in sub.buffers()) for name, sub in regions.items()
        }
        # Where each region's parameters live (their owner module and attribute), found once.
        self._parameters = {name: _parameter_places(sub) for name, sub in regions.items()}
        # The tensor states of the torchmetrics metrics inside each region, found once.
        self._metrics = {name: _metric_states(sub) for name, sub in regions.items()}
        # Each region's parameter versions when its latest forward started, and the parameters seen written in place
        # since a forward started (by that forward, as a rule): those are digested around its recomputations.
        self._forward_versions: dict[str, dict[str, int]] = {}
        self._forward_written: dict[str, frozenset[str]] = {name: frozenset() for name in regions}
        self._totals = {name: SentinelRegion() for name in self._names}
        self._saved_bytes: dict[str, int] = {}
        self._layouts: dict[str, SavedLayout] = {}
        # What every digest of a step reads, made once per step: a call's reads at its forward and at its
        # recomputation take it from the call, so the two read the same words.
        self.mode = DigestMode(self.tier)
        self.plans = DigestPlans()
        self._open: list[_Call] = []
        self._step = SentinelStep(self)
        self._unread: list[SentinelStep] = []
        self._recomputing: _Call | None = None
        self._paused = 0
        self._failures: set[tuple[str, str]] = set()

    @property
    def regions(self) -> list[str]:
        """The checkpointed regions, in module order."""
        return list(self._names)

    @property
    def compiled(self) -> list[str]:
        """The regions inside compiled modules, which the compiler recomputes out of the sentinel's sight."""
        return list(self._compiled)

    @property
    def saved_bytes(self) -> dict[str, int]:
        """The bytes each region saved for backward at its first observed forward (parameters and buffers left out):
        what the region holds when it runs without checkpointing."""
        return dict(self._saved_bytes)

    @property
    def offset(self) -> int:
        """The window sampled digests read this step (see :meth:`next_step`)."""
        return self.mode.offset

    @contextlib.contextmanager
    def region_forward(self, region: str, module: nn.Module) -> Iterator[None]:
        """Entered around each forward of an eagerly checkpointed region (the saved-tensor observer hook)."""
        name = self._name_of.get(id(module))
        if self._paused or name is None:
            yield
            return
        layout = self._layouts.get(name) if self.mode.tier == "light" else None
        call = _Call(self, name, self._buffers[name], _profile(module), layout)
        self._forward_versions[name] = {
            parameter: version_counter(param)
            for parameter, owned, attribute in self._parameters[name]
            if (param := owned.get(attribute)) is not None
        }
        self._open.append(call)
        finished = False
        try:
            yield
            finished = True
        finally:
            self._open.pop()
            if call.saved:
                call.forward_done(digest=finished, profile=_profile(module))
                if finished:
                    self._saved_bytes.setdefault(name, call.saved_bytes)
                    self._step.calls.append(call)
                    self._step.updated()

    @contextlib.contextmanager
    def region_recompute(
        self, region: str, module: nn.Module, exposed_buffers: Sequence[tuple[str, torch.Tensor]]
    ) -> Iterator[None]:
        """Entered around each recomputation of an eagerly checkpointed region (the saved-tensor observer hook):
        what it writes to the region's parameters and to ``exposed_buffers`` is a mismatch."""
        name = self._name_of.get(id(module))
        watch = None
        if not self._paused and name is not None:
            try:
                versions = _versions(self._parameters[name])
                since = self._forward_versions.get(name, {})
                written = {parameter for parameter, _, version in versions if since.get(parameter, version) != version}
                if not written <= self._forward_written[name]:
                    self._forward_written[name] |= written
                watch = _StateWatch(
                    self, name, versions, exposed_buffers, self._forward_written[name], self._metrics[name]
                )
            except Exception as err:
                self.failed(name, "its parameters and buffers", err)
        try:
            yield
        finally:
            if watch is not None:
                try:
                    watch.done()
                except Exception as err:
                    self.failed(watch.region, "its parameters and buffers", err)

    def extractor(self) -> Extractor | None:
        """What handles each tensor the region call starting now saves (the saved-tensor observer hook): that call's
        :meth:`_Call.save`, or ``None`` (torch's own metadata) while paused."""
        if self._paused or not self._open:
            return None
        return self._open[-1].save

    def learned(self, region: str, layout: SavedLayout | None) -> None:
        """A call learned ``region``'s layout (``None``: a call did not match it, and the next call learns it)."""
        if layout is None:
            self._layouts.pop(region, None)
        else:
            self._layouts[region] = layout

    def unreadable(self, region: str, tensor: torch.Tensor) -> None:
        """``region`` saves a tensor subclass whose values the sentinel cannot read: left out (said once per region
        and type)."""
        kind = type(tensor).__qualname__
        if (region, kind) not in self._failures:
            self._failures.add((region, kind))
            _log.warning(
                "lightning_ckpt_determinism: region `%s` saves a `%s`, a tensor subclass whose values the sentinel"
                " cannot read (no storage of its own and no `__tensor_flatten__` naming inner tensors, or inner"
                " tensors without bits to read); such tensors are left out and count as not compared. Training is"
                " not affected.",
                region,
                kind,
            )

    def failed(self, region: str, what: str, err: Exception) -> None:
        """The sentinel could not read ``what`` of ``region``: it is left out (said once per region and tensor)."""
        if (region, what) not in self._failures:
            self._failures.add((region, what))
            _log.warning(
                "lightning_ckpt_determinism: the sentinel could not read %s of region `%s` (%s: %s); it is left out and"
                " counts as not compared. Training is not affected.",
                what,
                region,
                type(err).__name__,
                err,
            )

    def changed(self, region: str, changes: list[_StateChange]) -> None:
        """A recomputation of ``region`` changed these parameters (known on the host)."""
        self._step.changes.extend((region, change) for change in changes)
        self._step.updated()

    def state_compared(self, region: str, items: list[Any], before: torch.Tensor, after: torch.Tensor) -> None:
        """A recomputation of ``region`` left these buffers' digests ``after`` (compared on the device)."""
        self._step.state_pairs.append((region, items, before, after))
        self._step.updated()

    def comparing(self, call: _Call) -> None:
        """torch compares ``call``'s recomputation now: one left unfinished (its last holder freed) is digested."""
        if self._recomputing is not None and self._recomputing is not call:
            self._recomputing.recomputation_done()
        self._recomputing = call

    def compared(self, call: _Call) -> None:
        """``call``'s recomputation is digested."""
        if self._recomputing is call:
            self._recomputing = None
        self._step.updated()

    def next_step(self, tier: SentinelMode | None = None) -> None:
        """Move the windows on, so that every element (and, in the light tier, every saved tensor) comes round.

        Args:
            tier: What the next step digests, if not the sentinel's own tier (the monitor escalates a step to
                ``"exact"`` after a finding).
        """
        self.mode = DigestMode(tier or self.tier, self.mode.offset + 1)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Digest nothing inside this block (a check's own passes rerun the step, not the training)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def end_step(self) -> SentinelStep:
        """Close the comparisons made since the last call into one :class:`SentinelStep`, unread (nothing is read
        back from the device): the monitor calls it at every training batch's end.

        Example::

            >>> sentinel = RecomputationSentinel(torch.nn.Linear(2, 2))
            >>> sentinel.read(sentinel.end_step())
            {}
        """
        if self._recomputing is not None:
            self._recomputing.recomputation_done()
        step, self._step = self._step, SentinelStep(self)
        self._unread.append(step)
        return step

    def read(self, step: SentinelStep, *, clean: bool = False) -> dict[str, SentinelRegion]:
        """What ``step`` found by region, added to the report (once: a step read again gives the same).

        Args:
            step: A step from :meth:`end_step`.
            clean: The caller knows that nothing differed (every rank's :meth:`SentinelStep.mismatch_counts` was
                zero): no comparison is read back.
        """
        if step.read is not None:
            return step.read
        found = step.read = step.regions(clean=clean)
        self._unread = [other for other in self._unread if other is not step]
        self._totals = _added(self._totals, found)
        return found

    def settle(self) -> dict[str, SentinelRegion]:
        """Close and read what was compared since the last :meth:`end_step`, and return it by region."""
        return self.read(self.end_step())

    def report(self) -> SentinelReport:
        """Everything compared since the block was entered (works after it exited too), the steps not read yet and
        the step under way included; it marks nothing read.

        Example::

            >>> from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing
            >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Dropout(0.5))
            >>> _ = apply_activation_checkpointing(model, CheckpointingConfig(names=["1", "2"]))
            >>> with recomputation_sentinel(model, mode="exact") as sentinel:
            ...     model(torch.ones(2, 4)).sum().backward()
            >>> sentinel.report().compared, sentinel.report().mismatches
            (2, 0)
        """
        if self._recomputing is not None:
            self._recomputing.recomputation_done()
        regions = self._totals
        for step in [*self._unread, self._step]:
            regions = _added(regions, step.regions(clean=False))
        compared = sum(region.compared for region in regions.values())
        mismatches = sum(region.mismatches for region in regions.values())
        not_compared = sum(region.not_compared for region in regions.values())
        return SentinelReport(compared, mismatches, dict(regions), list(self._compiled), not_compared)


def _added(totals: dict[str, SentinelRegion], found: dict[str, SentinelRegion]) -> dict[str, SentinelRegion]:
    """``totals`` with ``found`` added, region by region (the first mismatch and its cause kept from the earliest)."""
    added = {}
    for name, total in totals.items():
        region = found[name]
        first = total.first_mismatch is None and region.first_mismatch is not None
        added[name] = SentinelRegion(
            total.compared + region.compared,
            total.mismatches + region.mismatches,
            region.first_mismatch if first else total.first_mismatch,
            total.not_compared + region.not_compared,
            region.cause if first else total.cause,
        )
    return added


def _tier(mode: str, exact: bool | None, *, stacklevel: int) -> SentinelMode:
    """The tier ``mode`` names, or the one the deprecated ``exact`` names (with a warning pointing ``stacklevel``
    frames up)."""
    if exact is not None:
        warnings.warn(
            '`exact=` is deprecated and will be removed in the next release: pass `mode="exact"` (for `exact=True`)'
            ' or `mode="sampled"` (for `exact=False`).',
            FutureWarning,
            stacklevel=stacklevel,
        )
        return "exact" if exact else "sampled"
    if mode not in get_args(SentinelMode):
        raise ValueError(choice_message("mode", mode, get_args(SentinelMode)))
    return mode  # type: ignore[return-value]


def _compiled_regions(module: nn.Module) -> list[str]:
    """The checkpointed regions inside a compiled module (``torch.compile`` or ``Module.compile()``)."""
    inside = {id(sub) for compiled in module.modules() if is_compiled_module(compiled) for sub in compiled.modules()}
    return [name for name, sub in checkpointed_modules(module).items() if id(sub) in inside]


@contextlib.contextmanager
def recomputation_sentinel(
    module: nn.Module, *, mode: SentinelMode = "light", exact: bool | None = None
) -> Iterator[RecomputationSentinel]:
    """Compare what each checkpointed region of ``module`` saves, after its recomputation, with the forward's.

    Inside the block, each eager checkpointed forward keeps digests of the activations it saves for backward, and
    each recomputation is digested and compared on the device (see the module's description). Nothing is digested
    outside the block, and the sentinel's report counts what was compared inside it. It changes no value the model
    computes: gradients and random streams are exactly those without it.

    Args:
        module: The model whose checkpointed regions to watch.
        mode: What to digest. ``"light"`` (the default): per region call, the last saved tensor, the last
            floating-point one and one more whose position rotates with :meth:`RecomputationSentinel.next_step`,
            each through a window of about one element in 16 of each row, the window moving on with the steps
            (every saved tensor is compared within as many steps as the region saves tensors).
            ``"sampled"``: every saved tensor, through that window. ``"exact"``: every element of every saved
            tensor.
        exact: Deprecated: ``True`` means ``mode="exact"``, ``False`` means ``mode="sampled"``.

    Yields:
        The :class:`RecomputationSentinel`; its :meth:`~RecomputationSentinel.report` gives what it found.

    Raises:
        ValueError: If ``mode`` is not one of :data:`SentinelMode`.

    Example::

        >>> import numpy as np
        >>> from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing
        >>> class Noisy(torch.nn.Module):
        ...     def forward(self, x):
        ...         return torch.tanh(x * float(np.random.rand()))  # tanh saves its output: it differs
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 32), Noisy())
        >>> _ = apply_activation_checkpointing(model, CheckpointingConfig(classes=["Noisy"]))
        >>> with recomputation_sentinel(model) as sentinel:
        ...     model(torch.ones(2, 4)).sum().backward()
        >>> sentinel.report().regions["1"].mismatches
        1
    """
    # A generator's caller is two frames up: contextlib's `__enter__`, then the `with`.
    sentinel = RecomputationSentinel(module, mode=_tier(mode, exact, stacklevel=4))
    if sentinel.compiled:
        _log.info(
            "lightning_ckpt_determinism: the sentinel does not see inside compiled checkpointed regions (%s): the"
            " compiler recomputes them; they count as not compared, and regions that graph-break run eagerly and are"
            " compared.",
            ", ".join(sentinel.compiled),
        )
    with observing_saved_tensors(sentinel, module):
        yield sentinel
