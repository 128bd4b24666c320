"""The sentinel of one module's checkpointed regions: the saved-tensor observer the regions call, which opens a
:class:`~lightning_ckpt_determinism.verify.sentinel.calls.RegionCall` for each forward, watches each recomputation's
state, and closes each step (see the package's description)."""

import contextlib
import logging
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, get_args

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from lightning_ckpt_determinism._torch_compat import is_compiled_module, is_fsdp1_parameter_view
from lightning_ckpt_determinism.checkpointing.determinism_check import SavedPlan
from lightning_ckpt_determinism.checkpointing.modules import holds_fsdp_units, storage_pointer
from lightning_ckpt_determinism.checkpointing.profile import RegionProfile
from lightning_ckpt_determinism.checkpointing.wrapper import checkpointed_modules
from lightning_ckpt_determinism.config import choice_message
from lightning_ckpt_determinism.verify.digest import DigestMode, DigestPlans, DigestTier
from lightning_ckpt_determinism.verify.sentinel.calls import RegionCall
from lightning_ckpt_determinism.verify.sentinel.light_layout import SavedLayout
from lightning_ckpt_determinism.verify.sentinel.report import SentinelRegion, SentinelReport, StateChange, added
from lightning_ckpt_determinism.verify.sentinel.state import (
    RegionParameters,
    StateWatch,
    changed,
    metric_states,
)
from lightning_ckpt_determinism.verify.sentinel.step import SentinelStep

__all__ = ["RecomputationSentinel", "SentinelMode", "tier_of"]

_log = logging.getLogger("lightning_ckpt_determinism.verify.sentinel")

# How many calls in a row must learn one layout before a region whose calls took other paths than their layout's
# keeps a layout again under the light tier (see `RecomputationSentinel._learned`).
_STEADY_CALLS = 16

SentinelMode = DigestTier
"""What the sentinel digests: a few saved tensors per region call with a window of each row (``"light"``), every
saved tensor with a window of each row (``"sampled"``), or every element of every saved tensor (``"exact"``): the
digests' tiers (:data:`~lightning_ckpt_determinism.verify.digest.DigestTier`)."""


class RecomputationSentinel:
    """The sentinel of one module's checkpointed regions: see
    :func:`~lightning_ckpt_determinism.verify.sentinel.recomputation_sentinel`.

    Args:
        module: The model; regions are named relative to it.
        mode: What to digest (:data:`SentinelMode`).
        exact: Deprecated: ``True`` means ``mode="exact"``, ``False`` means ``mode="sampled"``.

    Raises:
        ValueError: If ``mode`` is not one of :data:`SentinelMode`.

    Example::

        >>> import torch
        >>> from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing
        >>> from lightning_ckpt_determinism import recomputation_sentinel
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        >>> _ = apply_activation_checkpointing(model, CheckpointingConfig(names=["1"]))
        >>> with recomputation_sentinel(model, mode="exact") as sentinel:
        ...     model(torch.randn(2, 4)).sum().backward()
        >>> isinstance(sentinel, RecomputationSentinel), sentinel.report().mismatches
        (True, 0)
    """

    def __init__(self, module: nn.Module, *, mode: SentinelMode = "light", exact: bool | None = None) -> None:
        self.tier: SentinelMode = tier_of(mode, exact, stacklevel=3)
        regions = checkpointed_modules(module)
        self._names = list(regions)
        self._name_of = {id(sub): name for name, sub in regions.items()}
        self._compiled = compiled_regions(module)
        # Buffers keep their storage within a step (BatchNorm updates its statistics in place, and recomputation gets
        # the buffers themselves): found again at each region's first call of a step (between steps, `model.to(dtype)`
        # or `load_state_dict(assign=True)` gives them new tensors), and, for a region with a lazy module's buffers (no
        # storage until its first forward gives them one), at each call until it has none. The regions whose buffers
        # this step found:
        self._buffers: dict[str, frozenset[int | None]] = {}
        self._buffers_found: set[str] = set()
        # Where each region's parameters live (their owner module and attribute), found once.
        self._parameters: dict[str, RegionParameters] = {}
        # The tensor states of the torchmetrics metrics inside each region, found once.
        self._metrics: dict[str, list[tuple[str, Any, str]]] = {}
        # How many times each region's wrapper had read its modules again when the three above were found: found
        # again when it moves (a submodule added or swapped in after wrapping).
        self._modules_read: dict[str, int] = {}
        # Each region's parameter versions when its latest forward started, and the parameters seen written in place
        # since a forward started (by that forward, as a rule): those are digested around its recomputations.
        self._forward_versions: dict[str, tuple[int, ...]] = {}
        self._forward_written: dict[str, frozenset[str]] = {}
        # The parameters' versions at each region's latest recomputation, for the calls it compares (see
        # `RegionCall.parameters_written`). FSDP gathers parameters into the same tensors again for recomputation,
        # which moves their versions with their values unchanged: under it, none are named.
        self._versions_at_recompute: dict[str, tuple[int, ...]] = {}
        self._gathers_parameters = holds_fsdp_units(module)
        self._totals = {name: SentinelRegion() for name in self._names}
        self._saved_bytes: dict[str, int] = {}
        self._layouts: dict[str, SavedLayout] = {}
        for name, sub in regions.items():
            self._find_state(name, sub)
        # Under the light tier, the regions whose calls take other code paths than the layout they start with (a
        # LayerDrop, a branch): each of their calls learns its own targets as it goes, until enough calls in a row
        # learned one layout (by name, how many so far).
        self._varying: dict[str, int] = {}
        # What every digest of a step reads, made once per step: a call's reads at its forward and at its
        # recomputation take it from the call, so the two read the same words.
        self.mode = DigestMode(self.tier)
        self.plans = DigestPlans()
        self._open: list[RegionCall] = []
        # How many calls of each region started while watched (see `RegionCall.ordinal`).
        self._started: dict[str, int] = {}
        # The ordinal of each region's first call since its last recomputation or the last step's end (see
        # `RegionCall.position`).
        self._pass_start: dict[str, int] = {}
        self._step = SentinelStep(self)
        self._unread: list[SentinelStep] = []
        self._recomputing: RegionCall | None = None
        self._paused = 0
        self._failures: set[tuple[str, str]] = set()
        self._failure: Exception | None = None

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

    @property
    def watching(self) -> bool:
        """Whether it reads the region calls starting now: not while paused (the saved-tensor observer hook)."""
        return not self._paused

    @property
    def failure(self) -> Exception | None:
        """The failure of its own that stopped the sentinel, or ``None``: an error in its hooks inside a forward or
        a backward is caught there, never raised into the training step, and the sentinel observes nothing after it
        (:meth:`end_step` raises it).

        Example::

            >>> RecomputationSentinel(torch.nn.Linear(2, 2)).failure is None
            True
        """
        return self._failure

    def _stop(self, err: Exception) -> None:
        """A failure of the sentinel's own code in a hook: it observes nothing from now on, and says why at the
        step's end (:meth:`end_step`)."""
        if self._failure is None:
            self._failure = err
            self._paused += 1  # never lifted: every hook sees the sentinel paused
            self._open = []
            self._recomputing = None

    @contextlib.contextmanager
    def region_forward(self, region: str, module: nn.Module) -> Iterator[None]:
        """Entered around each forward of an eagerly checkpointed region (the saved-tensor observer hook)."""
        name = self._name_of.get(id(module))
        if self._paused or name is None:
            yield
            return
        ordinal = self._started[name] = self._started.get(name, -1) + 1
        call: RegionCall | None = None
        try:
            profile = region_profile(module)
            # A call the region probes (its path unknown or unsure) learns its own targets too, as the first call.
            steady = self.mode.tier == "light" and name not in self._varying and profile is not None
            layout = self._layouts.get(name) if steady else None
            if region_modules_read(module) != self._modules_read[name]:
                self._find_state(name, module)  # it holds other modules than when they were found
            if name not in self._buffers_found:
                self._buffers[name] = _buffer_storages(module)
                if not any(map(is_lazy, module.buffers())):
                    self._buffers_found.add(name)
            call = RegionCall(self, name, self._buffers[name], profile, layout)
            call.ordinal = ordinal
            call.position = ordinal - self._pass_start.get(name, 0)
            versions = self._forward_versions[name] = self._parameters[name].now()[1]
            call.forward_versions = versions
        except Exception as err:  # the sentinel's own failure stops it, never the step
            self._stop(err)
        if call is None:
            yield
            return
        self._open.append(call)
        finished = False
        try:
            yield
            finished = True
        finally:
            if self._open and self._open[-1] is call:
                self._open.pop()
                self._forward_done(call, module, finished=finished)

    def _find_state(self, name: str, module: nn.Module) -> None:
        """Find the buffers, parameters and metrics of region ``name`` (``module``), as its modules are now; what its
        forwards wrote and the layout its saved tensors took are learned again."""
        self._modules_read[name] = region_modules_read(module)
        self._buffers_found.discard(name)  # found at its next call
        self._parameters[name] = RegionParameters(module)
        self._metrics[name] = metric_states(module)
        self._forward_written[name] = frozenset()
        self._layouts.pop(name, None)

    def _forward_done(self, call: RegionCall, module: nn.Module, *, finished: bool) -> None:
        """Close ``call`` once its forward returned (``finished``) or raised, and add it to the step. A call that saved
        nothing it handles is closed only where it took another path than its light tier's targets were placed on
        (their positions never reached): its targets count as left out on a new path."""
        try:
            profile, packs, known = region_profile(module), region_saved(module), call.profile
            if not call.saved and (
                call.targets is None
                or known is None
                or (profile is not None and profile.path == known.path)
                or packs == 0  # nothing saved, nothing to recompute (a frozen block's call)
            ):
                return
            call.forward_done(digest=finished, profile=profile, packs=packs)
            if finished:
                self._saved_bytes.setdefault(call.region, call.saved_bytes)
                self._joined(call)
        except Exception as err:
            self._stop(err)

    @contextlib.contextmanager
    def region_recompute(
        self, region: str, module: nn.Module, exposed_buffers: Sequence[tuple[str, torch.Tensor]]
    ) -> Iterator[None]:
        """Entered around each recomputation of an eagerly checkpointed region (the saved-tensor observer hook):
        what it writes to the region's parameters and to ``exposed_buffers`` is a mismatch."""
        name = self._name_of.get(id(module))
        watch = None
        if not self._paused and name is not None:
            self._pass_start[name] = self._started.get(name, -1) + 1
            try:
                parameters = self._parameters[name]
                now = parameters.now()
                since = self._forward_versions.get(name, now[1])
                written = {parameters.names[at] for at in changed(since, now[1])}
                self._versions_at_recompute[name] = now[1]
                if written and any(is_fsdp1_parameter_view(held) for held in now[0] if held is not None):
                    self._gathers_parameters = True  # an FSDP1 unit around the model the sentinel watches
                if not written <= self._forward_written[name]:
                    self._forward_written[name] |= written
                watch = StateWatch(
                    self, name, parameters, now, exposed_buffers, self._forward_written[name], self._metrics[name]
                )
            except Exception as err:
                self._failed(name, "its parameters and buffers", err)
        try:
            yield
        finally:
            if watch is not None:
                try:
                    watch.done()
                except Exception as err:
                    self._failed(watch.region, "its parameters and buffers", err)

    def extractor(self) -> SavedPlan | None:
        """What handles the tensors the region call starting now saves (the saved-tensor observer hook): that call's
        :meth:`RegionCall.plan`, or ``None`` (torch's own metadata) while paused."""
        if self._paused or not self._open:
            return None
        return self._open[-1].plan()

    def _learned(self, region: str, layout: SavedLayout | None) -> None:
        """A call learned ``region``'s layout, or (``None``) took another code path than the layout it started with.

        The light tier fixes a call's targets from its region's layout when the call starts, so a call on another path
        would digest that path's positions, not its own last activations: after one such call, each of the region's
        calls learns its own targets as it goes (:meth:`RegionCall.plan` handles every tensor and holds its last
        ones), until :data:`_STEADY_CALLS` calls in a row learned the same layout.
        """
        if layout is None:
            self._layouts.pop(region, None)
            self._varying[region] = 0
            return
        steady = self._varying.get(region)
        if steady is not None:
            steady = steady + 1 if layout == self._layouts.get(region) else 0
            if steady + 1 >= _STEADY_CALLS:
                del self._varying[region]
            else:
                self._varying[region] = steady
        self._layouts[region] = layout

    def _unreadable(self, region: str, tensor: torch.Tensor) -> None:
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

    def _failed(self, region: str, what: str, err: Exception) -> None:
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

    def _changed(self, region: str, changes: list[StateChange]) -> None:
        """A recomputation of ``region`` changed these parameters (known on the host)."""
        self._step.changes.extend((region, change) for change in changes)
        self._step.updated()

    def _state_compared(self, region: str, items: list[Any], before: torch.Tensor, after: torch.Tensor) -> None:
        """A recomputation of ``region`` left these buffers' digests ``after`` (compared on the device)."""
        self._step.state_pairs.append((region, items, before, after))
        self._step.updated()

    def _joined(self, call: RegionCall) -> None:
        """``call`` is counted in the step under way."""
        call.step = self._step
        self._step.calls.append(call)
        self._step.updated()

    def _comparing(self, call: RegionCall) -> RegionCall:
        """torch compares ``call``'s recomputation now: one left unfinished (its last holder freed) is digested. A
        call whose step has ended (its graph kept and run backward again, or run backward after the step) continues
        in the step under way, which counts what it compares: the call that compares is returned."""
        if call.step is not None and call.step is not self._step:  # `None`: a backward inside its own forward
            call = call.continued()
            self._joined(call)
        if self._recomputing is not call:
            if self._recomputing is not None:
                self._recomputing.recomputation_done()
            # Versions only move on: the latest recomputation's count holds every earlier one's.
            call.parameters_written = self._written_since_forward(call)
            self._recomputing = call
        return call

    def _written_since_forward(self, call: RegionCall) -> tuple[str, ...]:
        """The parameters of ``call``'s region whose versions moved between its forward and this recomputation."""
        now = self._versions_at_recompute.get(call.region)
        if now is None or call.forward_versions is None or self._gathers_parameters:
            return ()
        if len(now) != len(call.forward_versions):  # the region's modules changed since (its parameters found again)
            return ()
        names = self._parameters[call.region].names
        return tuple(names[at] for at in changed(call.forward_versions, now))

    def _compared(self, call: RegionCall) -> None:
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
        self._buffers_found.clear()

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
        back from the device): the monitor calls it at every training batch's end. A region call recomputed after
        its step closed (a graph kept with ``retain_graph=True`` and run backward again) is counted in the step
        under way.

        Raises:
            Exception: The sentinel's own :attr:`failure`, if one stopped it.

        Example::

            >>> sentinel = RecomputationSentinel(torch.nn.Linear(2, 2))
            >>> sentinel.read(sentinel.end_step())
            {}
        """
        if self._failure is not None:
            raise self._failure
        if self._recomputing is not None:
            self._recomputing.recomputation_done()
        step, self._step = self._step, SentinelStep(self)
        self._unread.append(step)
        # A step's calls never backpropagated (a GAN's detached generator call) are no part of the next step's pass.
        self._pass_start = {name: started + 1 for name, started in self._started.items()}
        return step

    def read(self, step: SentinelStep, *, clean: bool = False) -> dict[str, SentinelRegion]:
        """What ``step`` found by region, added to the report (once: a step read again gives the same).

        Args:
            step: A step from :meth:`end_step`.
            clean: The caller knows that nothing differed (every rank's :meth:`SentinelStep.mismatch_counts` was
                zero): no comparison is read back.

        Raises:
            Exception: A failure of the sentinel's own reading the step: it stops (see :attr:`failure`).
        """
        if step.read is not None:
            return step.read
        try:
            found = step.read = step.regions(clean=clean)
        except Exception as err:
            self._stop(err)
            raise
        self._unread = [other for other in self._unread if other is not step]
        self._totals = added(self._totals, found)
        return found

    def settle(self) -> dict[str, SentinelRegion]:
        """Close and read what was compared since the last :meth:`end_step`, and return it by region."""
        return self.read(self.end_step())

    def first_saved_mismatches(self) -> dict[str, tuple[int, str]]:
        """Per region, the first saved tensor whose recomputation differed in the step under way (the sentinel's
        first if no step ended): its call's place among the calls of its region this sentinel saw start (from 0,
        those that saved nothing included, in the order they started) and its description. Regions where none
        differed are left out.

        Example::

            >>> import numpy as np
            >>> from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing
            >>> class Noisy(torch.nn.Module):
            ...     def forward(self, x):
            ...         return torch.tanh(x * float(np.random.rand()))
            >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), Noisy())
            >>> _ = apply_activation_checkpointing(model, CheckpointingConfig(classes=["Noisy"]))
            >>> sentinel = RecomputationSentinel(model, mode="exact")
            >>> from lightning_ckpt_determinism.checkpointing.wrapper import observing_saved_tensors
            >>> with observing_saved_tensors(sentinel, model):
            ...     model(torch.ones(2, 4)).sum().backward()
            >>> sentinel.first_saved_mismatches()["1"][0]
            0
        """
        if self._recomputing is not None:
            self._recomputing.recomputation_done()
        return self._step.first_saved_mismatches()

    def report(self) -> SentinelReport:
        """Everything compared since the block was entered (works after it exited too), the steps not read yet and
        the step under way included; it marks nothing read.

        Example::

            >>> from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing
            >>> from lightning_ckpt_determinism.verify.sentinel import recomputation_sentinel
            >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Dropout(0.5))
            >>> _ = apply_activation_checkpointing(model, CheckpointingConfig(names=["1", "2"]))
            >>> with recomputation_sentinel(model, mode="exact") as sentinel:
            ...     model(torch.ones(2, 4)).sum().backward()
            >>> sentinel.report().compared, sentinel.report().mismatches
            (2, 0)
        """
        regions = self._totals
        try:
            if self._recomputing is not None:
                self._recomputing.recomputation_done()
            for step in [*self._unread, self._step]:
                regions = added(regions, step.regions(clean=False))
        except Exception as err:  # what was read before stays; the sentinel stops
            self._stop(err)
        compared = sum(region.compared for region in regions.values())
        mismatches = sum(region.mismatches for region in regions.values())
        not_compared = sum(region.not_compared for region in regions.values())
        on_new_paths = sum(region.on_new_paths for region in regions.values())
        return SentinelReport(compared, mismatches, dict(regions), list(self._compiled), not_compared, on_new_paths)


def tier_of(mode: str, exact: bool | None, *, stacklevel: int) -> SentinelMode:
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


def compiled_regions(module: nn.Module) -> list[str]:
    """The checkpointed regions inside a compiled module (``torch.compile`` or ``Module.compile()``)."""
    inside = {id(sub) for compiled in module.modules() if is_compiled_module(compiled) for sub in compiled.modules()}
    return [name for name, sub in checkpointed_modules(module).items() if id(sub) in inside]


def region_profile(module: nn.Module) -> RegionProfile | None:
    """The profile the region's wrapper learned, or ``None`` before its first checkpointed forward."""
    return getattr(module.__dict__.get("forward"), "profile", None)


def region_modules_read(module: nn.Module) -> int:
    """How many times the region's wrapper read its modules again (see ``CheckpointedForward.modules_read``)."""
    return int(getattr(module.__dict__.get("forward"), "modules_read", 0))


def region_saved(module: nn.Module) -> int:
    """How many tensors the region's latest eager forward saved, as its wrapper counted them."""
    return int(getattr(module.__dict__.get("forward"), "saved", 0))


def _buffer_storages(module: nn.Module) -> frozenset[int | None]:
    """Where ``module``'s buffers live, those of lazy modules not initialised yet left out."""
    return frozenset(storage_pointer(buffer) for buffer in module.buffers() if not is_lazy(buffer))
