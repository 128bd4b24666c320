"""The sentinel: every tensor a checkpointed region saves for backward, compared after its recomputation with the
forward's, through digests, on every step.

Inside :func:`recomputation_sentinel` the sentinel is torch's ``determinism_check`` extractor for every eagerly
checkpointed region (:mod:`~lightning_ckpt_determinism.checkpointing.saved`). At the region's forward, torch hands
it each tensor it saves; the sentinel digests the tensor on its device at once (a reduction and a dot product, while
the tensor is fresh, in :mod:`~lightning_ckpt_determinism.verify.digest`) and keeps its position, metadata and the
op that produced it. At the region's first unpack in backward, once the region is recomputed, torch compares each
kept value with the recomputed tensor (``!=``): the sentinel compares the metadata at once (a difference raises
torch's ``CheckpointError`` as before, under ``determinism_check="default"``) and digests the recomputed tensor. The
comparison stays on the device, read back later (:meth:`report`, or :meth:`RecomputationSentinel.settle` once per
training step, after one comparison for the whole step). Nothing is read back to the host inside forward or
backward, and the sentinel's own ops run below every dispatch mode, so that a selective-checkpointing cache or a
mode of the user's never takes them for the model's.

What it compares: activations. Parameters and buffers, which torch saves by reference (``addmm`` saves
``weight.t()``) and which may change legitimately before the recomputation (BatchNorm's running statistics), are
recognised by their storage and left out; a buffer a recomputation updates a second time is attribution's to find.
What it cannot see: torch's early stop ends a recomputation once every saved tensor is back, so ops after a region's
last saved tensor are never recomputed; compiled regions are recomputed by the compiler, which calls no extractor
(they count as not compared; regions that graph-break run eagerly and are compared); tensor subclasses other than
DTensor (whose shard it reads), which it leaves out; with sampled digests, a change of single elements shows only
at the steps whose offset reads them.
"""

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_ckpt_determinism._torch_compat import current_graph_task_id, is_compiled_module, no_python_dispatch
from lightning_ckpt_determinism.checkpointing.saved import observing_saved_tensors
from lightning_ckpt_determinism.checkpointing.wrapper import checkpointed_modules
from lightning_ckpt_determinism.verify.digest import DigestPlans
from lightning_ckpt_determinism.verify.gradients import local_tensor

__all__ = ["RecomputationSentinel", "SentinelRegion", "SentinelReport", "recomputation_sentinel"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SentinelRegion:
    """What the sentinel found in one checkpointed region.

    Attributes:
        compared: Saved tensors whose recomputation was compared with the forward's.
        mismatches: Those whose recomputation differed.
        first_mismatch: The first that differed: its position among the region's saved tensors, the op that
            produced it, its shape and dtype (and what differed, for metadata); ``None`` when none did.

    Example::

        >>> SentinelRegion().compared
        0
    """

    compared: int = 0
    mismatches: int = 0
    first_mismatch: str | None = None


@dataclass(frozen=True)
class SentinelReport:
    """What the sentinel found since its block was entered.

    Attributes:
        compared: Saved tensors whose recomputation was compared, over every region.
        mismatches: Those whose recomputation differed.
        regions: One :class:`SentinelRegion` per checkpointed region, by name relative to the module, every region
            present.
        compiled: The regions inside compiled modules, recomputed by the compiler (not compared unless they
            graph-break).

    Example::

        >>> SentinelReport(0, 0, {}).mismatches
        0
    """

    compared: int
    mismatches: int
    regions: dict[str, SentinelRegion]
    compiled: list[str] = field(default_factory=list)


class _Recomputed:
    """What the extractor gives for a recomputed tensor: the tensor, for the comparison torch runs at once."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __ne__(self, other: object) -> bool:
        # Reached when the forward ran outside the sentinel: torch kept its own metadata, or nothing ("none").
        return other is not None and _metadata(self.tensor) != other

    def __eq__(self, other: object) -> bool:
        return not self.__ne__(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(_metadata(self.tensor))


class _Saved:
    """What torch keeps of one saved tensor at the forward, and compares with ``!=`` after the recomputation.

    ``slot`` is its place among the call's digests: ``None`` for a parameter, a buffer or a tensor without bits.
    """

    __slots__ = ("call", "device", "dtype", "position", "producer", "shape", "slot", "strict")

    def __init__(self, call: "_Call", position: int, *, strict: bool) -> None:
        self.call = call
        self.position = position
        self.strict = strict
        self.slot: int | None = None
        self.shape: torch.Size | None = None
        self.dtype: torch.dtype | None = None
        self.device: torch.device | None = None
        self.producer = ""

    def __ne__(self, other: object) -> bool:
        if isinstance(other, _Recomputed):
            return self.call.recomputed(self, other.tensor)
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
        shape = tuple(self.shape) if self.shape is not None else None
        return f"saved tensor {self.position} ({self.producer}, {shape} {self.dtype})"


class _Call:
    """One forward of one region: its saved tensors' digests and, after each recomputation, the digests to compare.

    Each saved tensor is digested as torch hands it over, while it is fresh; the forward's digests are stacked into
    one vector when the region's forward ends, the recomputation's at the comparison of the last of them.
    """

    def __init__(self, sentinel: "RecomputationSentinel", region: str, buffers: frozenset[int | None]) -> None:
        self.sentinel = sentinel
        self.region = region
        self.buffers = buffers
        self.offset = None if sentinel.exact else sentinel.offset
        self.task = current_graph_task_id()
        self.saved: list[_Saved] = []
        self.saved_bytes = 0
        self.forward: torch.Tensor | None = None
        self.comparisons: list[tuple[list[int], torch.Tensor]] = []
        self.metadata_mismatches: list[str] = []
        self._digests: list[torch.Tensor] = []
        self._recomputed: list[tuple[int, torch.Tensor]] = []

    def save(self, tensor: torch.Tensor, strict: bool) -> _Saved:
        """Keep ``tensor``'s metadata and its digest, taken while the tensor is fresh."""
        saved = _Saved(self, len(self.saved), strict=strict)
        self.saved.append(saved)
        local = tensor if type(tensor) is torch.Tensor else local_tensor(tensor)
        saved.shape, saved.dtype, saved.device = local.shape, local.dtype, local.device
        saved.producer = f"grad_fn {tensor.grad_fn.name()}" if tensor.grad_fn is not None else "no grad_fn"
        if type(local) is torch.Tensor and not _is_state(tensor, local, self.buffers):
            found = self._digest(local)
            if found is not None:
                saved.slot = len(self._digests)
                self._digests.append(found)
                self.saved_bytes += local.numel() * local.element_size()
        return saved

    def _digest(self, local: torch.Tensor) -> torch.Tensor | None:
        """``local``'s digest at this call's offset, or ``None`` for a tensor without bits to read."""
        plans = self.sentinel.plans
        with no_python_dispatch():  # a dispatch mode of the region (selective checkpointing) must not see it
            matrix = plans.read(local, self.offset)
            return None if matrix is None else plans.digest(matrix)

    def forward_done(self, *, digest: bool) -> None:
        """The region's forward ended: stack its digests into one vector (or drop them, when it raised)."""
        if digest and self._digests:
            self.forward = torch.stack(self._digests)
        self._digests = []

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
        elif saved.slot is not None and (found := self._digest(local)) is not None:
            self._recomputed.append((saved.slot, found))
        if saved.position == len(self.saved) - 1:
            self.recomputation_done()
        return False

    def recomputation_done(self) -> None:
        """Stack this recomputation's digests (also reached later, when the last tensor's holder was freed)."""
        if self._recomputed:
            slots = [slot for slot, _ in self._recomputed]
            self.comparisons.append((slots, torch.stack([found for _, found in self._recomputed])))
        self._recomputed = []
        self.sentinel.compared(self)

    def pairs(self) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor]]:
        """Each recomputation's slots, with the forward's digests there and the recomputed ones."""
        forward = self.forward
        if forward is None:  # nothing digested, so no slots
            return
        for slots, recomputed in self.comparisons:
            every = len(slots) == len(forward) and slots == list(range(len(slots)))
            yield slots, forward if every else forward[torch.tensor(slots, device=forward.device)], recomputed


def _is_state(tensor: torch.Tensor, local: torch.Tensor, buffers: frozenset[int | None]) -> bool:
    """Whether a saved tensor is a parameter or a buffer, or a view of one (``addmm`` saves ``weight.t()``).

    A parameter is known by the tensor it views (FSDP2 swaps in unsharded parameters at each forward, so their
    storage moves); a buffer by its storage, which stays.
    """
    base = tensor._base if tensor._base is not None else tensor
    return isinstance(base, nn.Parameter) or (bool(buffers) and _storage(local) in buffers)


def _storage(tensor: torch.Tensor) -> int | None:
    try:
        return local_tensor(tensor).untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without a storage of its own
        return None


def _metadata(tensor: torch.Tensor) -> dict[str, Any]:
    return {"shape": tensor.shape, "dtype": tensor.dtype, "device": tensor.device}


class RecomputationSentinel:
    """The sentinel of one module's checkpointed regions: see :func:`recomputation_sentinel`.

    Args:
        module: The model; regions are named relative to it.
        exact: Digest every element; ``False`` reads a strided sample that rotates with :meth:`next_step`.
    """

    def __init__(self, module: nn.Module, *, exact: bool = False) -> None:
        self.exact = exact
        regions = checkpointed_modules(module)
        self._names = list(regions)
        self._index = {name: position for position, name in enumerate(self._names)}
        self._name_of = {id(sub): name for name, sub in regions.items()}
        self._compiled = _compiled_regions(module)
        # Buffers keep their storage (BatchNorm updates its statistics in place): known once.
        self._buffers = {name: frozenset(_storage(buffer) for buffer in sub.buffers()) for name, sub in regions.items()}
        self._totals = {name: SentinelRegion() for name in self._names}
        self._saved_bytes: dict[str, int] = {}
        self._step = 0
        self.plans = DigestPlans()
        self._open: list[_Call] = []
        self._calls: list[_Call] = []
        self._recomputing: _Call | None = None
        self._flags: tuple[list[tuple[_Call, list[int]]], torch.Tensor | None] | None = None
        self._paused = 0

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
        return self._step

    @contextlib.contextmanager
    def region_forward(self, region: str, module: nn.Module) -> Iterator[None]:
        """Entered around each forward of an eagerly checkpointed region (the saved-tensor observer hook)."""
        name = self._name_of.get(id(module), region)
        if self._paused or name not in self._totals:
            yield
            return
        call = _Call(self, name, self._buffers[name])
        self._open.append(call)
        finished = False
        try:
            yield
            finished = True
        finally:
            self._open.pop()
            if call.saved:
                call.forward_done(digest=finished)
                if finished:
                    self._saved_bytes.setdefault(name, call.saved_bytes)
                    self._calls.append(call)

    def extract(self, tensor: torch.Tensor, *, strict: bool) -> Any:
        """torch's ``determinism_check`` extractor: a kept value at a region's forward (digested when the forward
        ends), the recomputed tensor at the comparison after its recomputation."""
        if self._paused:
            return _metadata(tensor) if strict else None
        task = current_graph_task_id()
        if self._open and self._open[-1].task == task:
            return self._open[-1].save(tensor, strict)
        if task == -1:  # a forward the sentinel does not watch: what torch would keep
            return _metadata(tensor) if strict else None
        return _Recomputed(tensor)

    def comparing(self, call: _Call) -> None:
        """torch compares ``call``'s recomputation now: one left unfinished (its last holder freed) is digested."""
        if self._recomputing is not None and self._recomputing is not call:
            self._recomputing.recomputation_done()
        self._recomputing = call

    def compared(self, call: _Call) -> None:
        """``call``'s recomputation is digested."""
        if self._recomputing is call:
            self._recomputing = None
        self._flags = None

    def next_step(self) -> None:
        """Move the sampled digests' offset on, so that every element is read within ``SAMPLE_STRIDE`` steps."""
        self._step += 1

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Digest nothing inside this block (a check's own passes rerun the step, not the training)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def pending_mismatches(self, device: torch.device | str) -> torch.Tensor:
        """How many saved tensors of each region differ among those compared since the last :meth:`settle`, as an
        integer tensor on ``device`` in region order; computed on the device, not read back.

        Args:
            device: Where the counts go (the device the collective backend needs).
        """
        layout, flags = self._mismatch_flags()
        counts = torch.zeros(len(self._names), dtype=torch.int64, device=device)
        if flags is not None:
            regions = [self._index[call.region] for call, slots in layout for _ in slots]
            owners = torch.tensor(regions, dtype=torch.int64, device=flags.device)
            found = torch.zeros(len(self._names), dtype=torch.int64, device=flags.device).index_add_(0, owners, flags)
            counts = found.to(device)
        metadata = [0] * len(self._names)
        for call in self._calls:
            metadata[self._index[call.region]] += len(call.metadata_mismatches)
        if any(metadata):
            counts = counts + torch.tensor(metadata, dtype=torch.int64, device=device)
        return counts

    def _mismatch_flags(self) -> tuple[list[tuple[_Call, list[int]]], torch.Tensor | None]:
        """Every comparison since the last settle, in order, and whether each differed (an int64 vector, on the
        device; ``None`` when nothing was compared): one comparison for all of them."""
        if self._recomputing is not None:
            self._recomputing.recomputation_done()
        if self._flags is None:
            layout, forward, recomputed = [], [], []
            for call in self._calls:
                for slots, before, after in call.pairs():
                    layout.append((call, slots))
                    forward.append(before)
                    recomputed.append(after)
            flags = (torch.cat(forward) != torch.cat(recomputed)).to(torch.int64) if forward else None
            self._flags = (layout, flags)
        return self._flags

    def settle(self, *, clean: bool = False) -> dict[str, SentinelRegion]:
        """Add what was compared since the last settle to the report, and return it by region.

        Args:
            clean: The caller knows that nothing differed (every rank's :meth:`pending_mismatches` was zero): no
                comparison is read back.
        """
        layout, flags = self._mismatch_flags()
        differed = [] if clean or flags is None else flags.tolist()
        found: dict[int, list[str]] = {}
        compared: dict[int, int] = {}
        at = 0
        for call, slots in layout:
            compared[id(call)] = compared.get(id(call), 0) + len(slots)
            by_slot = {saved.slot: saved for saved in call.saved if saved.slot is not None}
            for slot, flag in zip(slots, differed[at : at + len(slots)], strict=False):
                if flag:
                    found.setdefault(id(call), []).append(by_slot[slot].describe())
            at += len(slots)
        period = {name: SentinelRegion() for name in self._names}
        for call in self._calls:
            mismatches = call.metadata_mismatches + found.get(id(call), [])
            region = period[call.region]
            period[call.region] = SentinelRegion(
                compared=region.compared + compared.get(id(call), 0) + len(call.metadata_mismatches),
                mismatches=region.mismatches + len(mismatches),
                first_mismatch=region.first_mismatch or (mismatches[0] if mismatches else None),
            )
        self._calls, self._flags = [], None
        for name, region in period.items():
            total = self._totals[name]
            self._totals[name] = SentinelRegion(
                total.compared + region.compared,
                total.mismatches + region.mismatches,
                total.first_mismatch or region.first_mismatch,
            )
        return period

    def report(self) -> SentinelReport:
        """Everything compared since the block was entered (works after it exited too).

        Example::

            >>> from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing
            >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Dropout(0.5))
            >>> _ = apply_activation_checkpointing(model, CheckpointingConfig(names=["1", "2"]))
            >>> with recomputation_sentinel(model, exact=True) as sentinel:
            ...     model(torch.ones(2, 4)).sum().backward()
            >>> sentinel.report().compared, sentinel.report().mismatches
            (2, 0)
        """
        self.settle()
        regions = dict(self._totals)
        compared = sum(region.compared for region in regions.values())
        mismatches = sum(region.mismatches for region in regions.values())
        return SentinelReport(compared, mismatches, regions, list(self._compiled))


def _compiled_regions(module: nn.Module) -> list[str]:
    """The checkpointed regions inside a compiled module (``torch.compile`` or ``Module.compile()``)."""
    inside = {id(sub) for compiled in module.modules() if is_compiled_module(compiled) for sub in compiled.modules()}
    return [name for name, sub in checkpointed_modules(module).items() if id(sub) in inside]


@contextlib.contextmanager
def recomputation_sentinel(module: nn.Module, *, exact: bool = False) -> Iterator[RecomputationSentinel]:
    """Compare every tensor each checkpointed region of ``module`` saves, after its recomputation, with the forward's.

    Inside the block, each eager checkpointed forward keeps a digest of every activation it saves for backward, and
    each recomputation is digested and compared on the device (see the module's description). Nothing is digested
    outside the block, and the sentinel's report counts what was compared inside it. It changes no value the model
    computes: gradients and random streams are exactly those without it.

    Args:
        module: The model whose checkpointed regions to watch.
        exact: Read every element; by default a strided sample (one element in 16 of each row) whose offset
            moves with :meth:`RecomputationSentinel.next_step`.

    Yields:
        The :class:`RecomputationSentinel`; its :meth:`~RecomputationSentinel.report` gives what it found.

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
    sentinel = RecomputationSentinel(module, exact=exact)
    if sentinel.compiled:
        _log.info(
            "lightning_ckpt_determinism: the sentinel does not see inside compiled checkpointed regions (%s): the"
            " compiler recomputes them; they count as not compared, and regions that graph-break run eagerly and are"
            " compared.",
            ", ".join(sentinel.compiled),
        )
    with observing_saved_tensors(sentinel):
        yield sentinel
