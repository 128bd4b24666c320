"""The sentinel: every tensor a checkpointed region saves for backward, compared after its recomputation with the
forward's, through digests, on every step.

Inside :func:`recomputation_sentinel` the sentinel is torch's ``determinism_check`` extractor for every eagerly
checkpointed region (:mod:`~lightning_ckpt_determinism.checkpointing.saved`). At the region's forward, torch hands it
each tensor it saves; the sentinel keeps a :func:`~lightning_ckpt_determinism.verify.digest.digest` of it on its
device, with its position, metadata and the op that produced it. At the region's first unpack in backward, once the
region is recomputed, torch compares each kept value with the recomputed tensor (``!=``): the sentinel compares the
metadata at once (a difference raises torch's ``CheckpointError`` as before, under ``determinism_check="default"``)
and digests the recomputed tensor for a comparison on the device, read back later (:meth:`report`, or
:meth:`RecomputationSentinel.settle` once per training step). Nothing is read back to the host inside forward or
backward.

What it compares: activations. Parameters and buffers, which torch saves by reference (``addmm`` saves
``weight.t()``) and which may change legitimately before the recomputation (BatchNorm's running statistics), are
recognised by their storage and left out; a buffer a recomputation updates a second time is attribution's to find.
What it cannot see: torch's early stop ends a recomputation once every saved tensor is back, so ops after a region's
last saved tensor are never recomputed; compiled regions are recomputed by the compiler, which calls no extractor
(they count as not compared; regions that graph-break run eagerly and are compared); with sampled digests, a change
of single elements shows only at the steps whose offset reads them.
"""

import contextlib
import logging
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_ckpt_determinism._torch_compat import current_graph_task_id, is_compiled_module
from lightning_ckpt_determinism.checkpointing.saved import observing_saved_tensors
from lightning_ckpt_determinism.checkpointing.wrapper import checkpointed_modules
from lightning_ckpt_determinism.verify.digest import SAMPLE_STRIDE, RowWeights, digest
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
    """What the extractor gives for a recomputed tensor: the tensor, weakly (torch holds it while it compares)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = weakref.ref(tensor)

    def __ne__(self, other: object) -> bool:
        # Reached when the forward ran outside the sentinel (torch kept its own metadata): metadata only.
        tensor = self.tensor()
        return tensor is None or _metadata(tensor) != other

    def __eq__(self, other: object) -> bool:
        return not self.__ne__(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        tensor = self.tensor()
        return repr(_metadata(tensor)) if tensor is not None else "<freed>"


class _Saved:
    """What torch keeps of one saved tensor at the forward, and compares with ``!=`` after the recomputation."""

    __slots__ = ("call", "device", "digest", "dtype", "position", "producer", "shape", "strict")

    def __init__(self, call: "_Call", position: int, tensor: torch.Tensor, *, strict: bool) -> None:
        local = tensor if type(tensor) is torch.Tensor else local_tensor(tensor)
        self.call = call
        self.position = position
        self.shape, self.dtype, self.device = local.shape, local.dtype, local.device
        self.strict = strict
        self.producer = f"grad_fn {tensor.grad_fn.name()}" if tensor.grad_fn is not None else "no grad_fn"
        state = _is_state(tensor, local, call.buffers)
        self.digest = None if state else digest(local, call.offset, call.weights)
        if not state:
            call.saved_bytes += local.numel() * local.element_size()

    def __ne__(self, other: object) -> bool:
        if not isinstance(other, _Recomputed):
            return {"shape": self.shape, "dtype": self.dtype, "device": self.device} != other
        recomputed = other.tensor()
        if recomputed is None:
            return False
        local = local_tensor(recomputed)
        if (local.shape, local.dtype, local.device) != (self.shape, self.dtype, self.device):
            if self.strict:
                return True  # torch raises its CheckpointError, naming the metadata
            recomputed_as = f"{tuple(local.shape)} {local.dtype} on {local.device}"
            self.call.metadata_mismatches.append(f"{self.describe()} was recomputed as {recomputed_as}")
            return False
        value = digest(local, self.call.offset, self.call.weights) if self.digest is not None else None
        if value is not None:
            self.call.pairs.append((self, value))
        return False

    def __eq__(self, other: object) -> bool:
        return not self.__ne__(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr({"shape": self.shape, "dtype": self.dtype, "device": self.device})

    def describe(self) -> str:
        return f"saved tensor {self.position} ({self.producer}, {tuple(self.shape)} {self.dtype})"


class _Call:
    """One forward of one region: its saved tensors' digests and, after the recomputation, the pairs to compare."""

    def __init__(self, region: str, buffers: frozenset[int | None], offset: int | None, weights: RowWeights) -> None:
        self.region = region
        self.buffers = buffers
        self.offset = offset
        self.weights = weights
        self.task = current_graph_task_id()
        self.saved = 0
        self.saved_bytes = 0
        self.pairs: list[tuple[_Saved, torch.Tensor]] = []
        self.metadata_mismatches: list[str] = []

    def save(self, tensor: torch.Tensor, strict: bool) -> _Saved:
        self.saved += 1
        return _Saved(self, self.saved - 1, tensor, strict=strict)

    def differs(self) -> torch.Tensor:
        """Whether any compared digest differs, on the device: one comparison for the whole call."""
        forward = torch.stack([saved.digest for saved, _ in self.pairs])  # type: ignore[misc]
        recomputed = torch.stack([value for _, value in self.pairs])
        return (forward != recomputed).any()

    def mismatching(self) -> list[_Saved]:
        """The saved tensors whose digests differ, in order (reads back one flag per tensor)."""
        return [saved for saved, value in self.pairs if not torch.equal(saved.digest, value)]  # type: ignore[arg-type]


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
        self._name_of = {id(sub): name for name, sub in regions.items()}
        self._compiled = _compiled_regions(module)
        # Buffers keep their storage (BatchNorm updates its statistics in place): known once.
        self._buffers = {name: frozenset(_storage(buffer) for buffer in sub.buffers()) for name, sub in regions.items()}
        self._totals = {name: SentinelRegion() for name in self._names}
        self._saved_bytes: dict[str, int] = {}
        self._step = 0
        self._weights = RowWeights()
        self._open: list[_Call] = []
        self._calls: list[_Call] = []
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

    @contextlib.contextmanager
    def region_forward(self, region: str, module: nn.Module) -> Iterator[None]:
        """Entered around each forward of an eagerly checkpointed region (the saved-tensor observer hook)."""
        name = self._name_of.get(id(module), region)
        if self._paused or name not in self._totals:
            yield
            return
        call = _Call(name, self._buffers[name], None if self.exact else self._step % SAMPLE_STRIDE, self._weights)
        self._open.append(call)
        try:
            yield
        finally:
            self._open.pop()
            self._saved_bytes.setdefault(name, call.saved_bytes)
            if call.saved:
                self._calls.append(call)

    def extract(self, tensor: torch.Tensor, *, strict: bool) -> Any:
        """torch's ``determinism_check`` extractor: a kept digest at a region's forward, the recomputed tensor at the
        comparison after its recomputation."""
        if self._paused:
            return _metadata(tensor) if strict else None
        if self._open and self._open[-1].task == current_graph_task_id():
            return self._open[-1].save(tensor, strict)
        return _Recomputed(tensor)

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
        """How many calls of each region differ among those compared since the last :meth:`settle`, as an integer
        tensor on ``device`` in region order; computed on the device, not read back.

        Args:
            device: Where the counts go (the device the collective backend needs).
        """
        zero = torch.zeros((), dtype=torch.int64, device=device)
        counts = dict.fromkeys(self._names, zero)
        for call in self._calls:
            found = counts[call.region] + len(call.metadata_mismatches)
            if call.pairs:
                found = found + call.differs().to(device)
            counts[call.region] = found
        return torch.stack([counts[name] for name in self._names])

    def settle(self, *, clean: bool = False) -> dict[str, SentinelRegion]:
        """Add what was compared since the last settle to the report, and return it by region.

        Args:
            clean: The caller knows that nothing differed (every rank's :meth:`pending_mismatches` was zero): no
                comparison is read back.
        """
        period = {name: SentinelRegion() for name in self._names}
        for call in self._calls:
            found = [] if clean else [saved.describe() for saved in call.mismatching()]
            found = call.metadata_mismatches + found
            region = period[call.region]
            period[call.region] = SentinelRegion(
                compared=region.compared + len(call.pairs) + len(call.metadata_mismatches),
                mismatches=region.mismatches + len(found),
                first_mismatch=region.first_mismatch or (found[0] if found else None),
            )
        self._calls = []
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
