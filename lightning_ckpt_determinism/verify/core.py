"""What both check engines do alike: set a step's state and gradients aside, calibrate the noise, decide the
verdict and the step's cause, assemble the report, name what could not be compared.

The two-pass engine (:func:`~lightning_ckpt_determinism.check_recomputation`) and the live-step engine
(:func:`~lightning_ckpt_determinism.verify.live_step.check_live_step`) differ in which passes they run; the state they
put back, the rule that calls a divergence, the noise floor, the step's cause (:func:`step_report`), the findings of a
check that compared nothing, and how the monitor joins a live report with its attribution (:func:`with_attribution`)
are the same, and live here once. The monitor and the audit read a report's cause through :func:`step_cause` and
:func:`blame`.
"""

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

import torch
from torch import nn

from lightning_ckpt_determinism.checkpointing.wrapper import buffers_read_otherwise, checkpointed_modules
from lightning_ckpt_determinism.verify.cause import Cause
from lightning_ckpt_determinism.verify.compare import NOISE_MARGIN, worst_parameters
from lightning_ckpt_determinism.verify.gradients import GradientStash, local_tensor
from lightning_ckpt_determinism.verify.outcome import diverging
from lightning_ckpt_determinism.verify.reports import (
    COMPILED_NOISE_NOTE,
    HOST_RNG_STREAM_HINT,
    TORCH_RNG_STREAM_HINT,
    RecomputationReport,
    RegionReport,
    attribute_hint,
    buffer_hint,
    missing_reference_gradients,
    no_gradients,
    read_otherwise_hint,
)
from lightning_ckpt_determinism.verify.state import StepState

__all__ = [
    "Calibration",
    "CheckScope",
    "StepEvidence",
    "blame",
    "calibrate",
    "gradients_diverge",
    "read_otherwise_since",
    "region_modules",
    "step_cause",
    "step_report",
    "uncomparable",
    "with_attribution",
]

_G = TypeVar("_G")


class CheckScope:
    """The state a check's passes change, captured on entry, and the parameters' gradients, set aside on entry; both
    put back on exit, whatever is raised.

    The state is a :class:`~lightning_ckpt_determinism.verify.state.StepState`: random streams, buffers, torchmetrics
    states, plain Python attributes and the objects, arrays and tensors they hold, parameters written in place,
    training flags and grad mode. The gradients are set aside so that each pass
    starts from none, and given back last, so that a failure to restore the state cannot lose them. Those of the
    module's frozen parameters are set aside too: a pass run from an earlier state may find them trainable (a step
    that froze them with ``toggle_optimizer`` after it started), and what it gives them must not stay.

    Args:
        module: The model whose state is captured.
        params: The parameters whose ``.grad`` is set aside.
        set_gradients_aside: Whether to set the gradients aside at all (a check that takes gradients with
            ``torch.autograd.grad`` never touches ``.grad``).
        clone_gradients: Set copies aside instead of the gradient tensors themselves (DDP with
            ``gradient_as_bucket_view=True``, whose buckets the next backward writes into).
        internal_attributes: Attribute names the state never captures nor restores (a framework's own bookkeeping,
            see :class:`StepState`). Not ``exclude_attributes``, which everywhere names attributes never compared.
        written_parameters: Names of parameters the passes write in place: their values are captured too. ``None``
            (the default): every parameter's, each put back only where the passes wrote it (one copy of the
            parameters, this rank's shards, held while the scope is open).

    Example::

        >>> model = torch.nn.BatchNorm1d(2)
        >>> (model(torch.randn(4, 2)) ** 2).sum().backward()
        >>> with CheckScope(model, list(model.parameters())) as scope:
        ...     _ = model(torch.randn(4, 2))
        ...     model.weight.grad is None
        True
        >>> int(model.num_batches_tracked), model.weight.grad is not None
        (1, True)
    """

    def __init__(
        self,
        module: nn.Module,
        params: Sequence[torch.Tensor],
        *,
        set_gradients_aside: bool = True,
        clone_gradients: bool = False,
        internal_attributes: Iterable[str] = (),
        written_parameters: Iterable[str] | None = None,
    ) -> None:
        self._module = module
        self._params = params
        self._set_aside = set_gradients_aside
        self._clone = clone_gradients
        self._internal = tuple(internal_attributes)
        self._written = None if written_parameters is None else tuple(written_parameters)
        self._state: StepState | None = None
        self._stash: GradientStash | None = None
        self._frozen: GradientStash | None = None

    def __enter__(self) -> "CheckScope":
        self._state = StepState(self._module, self._internal, self._written)
        if self._set_aside:
            self._stash = GradientStash(self._params, clone=self._clone)
            try:
                held = {id(param) for param in self._params}
                frozen = [
                    param for param in self._module.parameters() if not param.requires_grad and id(param) not in held
                ]
                self._frozen = GradientStash(frozen, clone=self._clone)
            except BaseException:
                # `__exit__` never runs for an `__enter__` that raised: the live gradients come back here.
                self._stash.put_back()
                raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.restore()
        finally:
            try:
                if self._stash is not None:
                    self._stash.put_back()
            finally:
                if self._frozen is not None:
                    self._frozen.put_back()

    @property
    def state(self) -> StepState:
        """The state captured on entry."""
        if self._state is None:
            raise RuntimeError("lightning_ckpt_determinism: a `CheckScope` has a state only inside its `with` block.")
        return self._state

    @property
    def gradients(self) -> list[torch.Tensor | None]:
        """The gradients set aside, as this rank's tensors (shards of sharded ones), in the order of the parameters."""
        grads = self._stash.gradients if self._stash is not None else [None] * len(self._params)
        return [None if grad is None else local_tensor(grad) for grad in grads]

    def unrestored(self) -> list[str]:
        """The parameters written in place since entry that the scope has no copy of (see
        :meth:`~lightning_ckpt_determinism.verify.state.StepState.unrestored_parameters`)."""
        return self._state.unrestored_parameters() if self._state is not None else []

    def restore(self) -> None:
        """Put the captured state back (not the gradients: those come back on exit); can be called any number of
        times."""
        if self._state is not None:
            self._state.restore()


def gradients_diverge(divergence: float, tolerance: float, noise_floor: float, *, error: str | None = None) -> bool:
    """The verdict on a check's gradients: a divergence above both the tolerance and the noise floor, or a check that
    could not compare them (``error``), which never passes.

    Args:
        divergence: The relative L2 divergence of the gradients (``grad_divergence``).
        tolerance: The largest divergence that still counts as equal.
        noise_floor: What two reference passes differ by, with a margin (``0.0`` when not calibrated).
        error: Why the gradients could not be compared; ``None`` when they were.

    Example::

        >>> gradients_diverge(1e-6, 0.0, 1e-5), gradients_diverge(1e-4, 0.0, 1e-5)
        (False, True)
        >>> gradients_diverge(0.0, 0.0, 0.0, error="the check could not compare gradients: ...")
        True
    """
    return error is not None or divergence > max(tolerance, noise_floor)


def uncomparable(
    missing: Sequence[str], *, missing_anywhere: bool, gradients_anywhere: bool, live: str, nowhere: str
) -> str | None:
    """Why a check could not compare gradients, or ``None`` when it could: nothing compared is a finding, never
    ``0.0``.

    Args:
        missing: The parameters (on this rank) the reference pass gave no gradient where the other pass gave one.
        missing_anywhere: Whether any rank has such a parameter.
        gradients_anywhere: Whether any parameter received a gradient in either pass, on any rank.
        live: The pass the reference is compared with, as the finding names it (``"the live step"``).
        nowhere: Where no gradient was found, as the finding says it (``"in either pass"``).

    Example::

        >>> uncomparable([], missing_anywhere=False, gradients_anywhere=False, live="the live step", nowhere="anywhere")
        'the check could not compare gradients: no parameter received a gradient anywhere'
        >>> uncomparable([], missing_anywhere=False, gradients_anywhere=True, live="the live step", nowhere="anywhere")
    """
    if missing_anywhere:
        return missing_reference_gradients(list(missing), live)
    if not gradients_anywhere:
        return no_gradients(nowhere)
    return None


def losses_differ(first: float, second: float) -> bool:
    """Whether two finite losses differ: two passes of one step from one state that compute other losses before any
    backward differ by state outside the checkpointed regions (recomputation happens in backward).

    Args:
        first: One pass's loss.
        second: The other pass's loss (``nan`` when it raised).

    Example::

        >>> losses_differ(1.0, 1.5), losses_differ(1.0, float("nan"))
        (True, False)
    """
    return math.isfinite(first) and math.isfinite(second) and first != second


def region_modules(module: nn.Module) -> list[nn.Module]:
    """Every module inside a checkpointed region of ``module``: those whose code recomputation reruns.

    Args:
        module: The model.

    Example::

        >>> from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Tanh()))
        >>> _ = apply_activation_checkpointing(model, CheckpointingConfig(names=["1"]))
        >>> [type(sub).__name__ for sub in region_modules(model)]
        ['Sequential', 'Tanh']
    """
    return [sub for region in checkpointed_modules(module).values() for sub in region.modules()]


@dataclass(frozen=True)
class Calibration:
    """What a second reference pass of a step says about its noise.

    Attributes:
        noise_floor: :data:`~lightning_ckpt_determinism.verify.compare.NOISE_MARGIN` times the divergence of the
            two reference passes' gradients (``0.0`` when not calibrated).
        reproducible: Whether the two reference passes computed the same loss: when they did not, a loss that
            differs between the checked passes says nothing about state outside the regions.
    """

    noise_floor: float = 0.0
    reproducible: bool = True


def calibrate(
    loss: float,
    gradients: _G,
    rerun: Callable[[], tuple[float, _G]],
    divergence: Callable[[_G, _G], float],
) -> Calibration:
    """Run the reference pass once more and measure the noise floor against the first.

    Args:
        loss: The first reference pass's loss.
        gradients: Its gradients.
        rerun: Runs the reference pass again from the same state; returns its loss and gradients.
        divergence: The relative divergence of the second pass's gradients from the first's (reduced over ranks
            where the engine compares shards).

    Example::

        >>> calibrate(1.0, 2.0, lambda: (1.0, 2.5), lambda first, again: abs(again - first) / first)
        Calibration(noise_floor=0.5, reproducible=True)
    """
    again_loss, again = rerun()
    return Calibration(NOISE_MARGIN * divergence(gradients, again), reproducible=not losses_differ(loss, again_loss))


@dataclass(frozen=True)
class StepEvidence:
    """What a check's passes showed of one step: what :func:`step_report` decides the step's cause from.

    Attributes:
        gradients_diverged: The verdict on the gradients (:func:`gradients_diverge`).
        reference_loss: The reference pass's loss.
        checkpointed_loss: The checkpointed (or live) pass's loss; ``nan`` when it raised.
        recomputed_in_forward: The checkpointed pass recomputed an eager region before its loss was computed (a
            backward inside the step, as a gradient penalty runs): its loss may differ through recomputation itself.
        calibration: The noise floor and whether the reference passes agree (:func:`calibrate`).
        not_restored: Parameters written in place that the check had no copy of.
        regions: The regions' reports (attribution); empty without.
        step_cause: A cause of the whole step found already (a compiled step's: the compiler's recomputation, or
            kernels that differ run to run).
        forward_writes: Parameters a region's forward wrote that the check did not put back (attribution).
        step_buffers: Buffers that differ after the passes where no region report places them (both engines
            compare every buffer after the checked pass with its value after the reference pass; a placeholder of
            the live engine names another rank's); empty when they agree.
        step_attributes: Region attributes that differ likewise.
        step_host_rng: Python's ``random`` or NumPy's global RNG ended the checked pass in another state than the
            reference pass (a region drew from it again in its recomputation; the values it drew may have been the
            same, as after a seed), on some rank.
        step_torch_rng: torch's RNG ended the checked pass in another state than the reference pass (a region drew
            from it again in its recomputation, unreplayed), on some rank.
        read_otherwise: Buffers a region's recomputation in the checkpointed pass got with other values than its
            forward read, as the model names them (see
            :func:`~lightning_ckpt_determinism.checkpointing.wrapper.buffers_read_otherwise`).
    """

    gradients_diverged: bool
    reference_loss: float
    checkpointed_loss: float
    recomputed_in_forward: bool = False
    calibration: Calibration = Calibration()
    not_restored: Sequence[str] = ()
    regions: Sequence[RegionReport] = ()
    step_cause: Cause | None = None
    forward_writes: frozenset[str] = frozenset()
    step_buffers: Sequence[str] = ()
    step_attributes: Sequence[str] = ()
    step_host_rng: bool = False
    step_torch_rng: bool = False
    read_otherwise: Sequence[str] = ()


@dataclass(frozen=True)
class _Decision:
    cause: Cause | None
    hint: str | None
    regions: list[RegionReport] = field(default_factory=list)


def _decide(evidence: StepEvidence) -> _Decision:
    """The step's cause, its hint and the regions as the cause leaves them: the one rule of both engines."""
    regions = list(evidence.regions)
    cause = evidence.step_cause
    # A region's kernel that differs run to run also changes the forward: the forward's loss then says nothing.
    kernel = any(region.cause == Cause.NONDETERMINISTIC_KERNEL for region in regions)
    forward_differed = losses_differ(evidence.reference_loss, evidence.checkpointed_loss)
    if evidence.gradients_diverged and evidence.calibration.reproducible and not kernel and forward_differed:
        if evidence.forward_writes:
            # A region's forward wrote parameters the check did not put back: the reference pass wrote them first,
            # and the checkpointed pass started from its values. The write is the finding, not outside state.
            regions = _with_forward_writes(regions, evidence.forward_writes)
        elif (
            not evidence.not_restored
            and not _recomputed_before_loss(evidence.recomputed_in_forward, regions)
            and not _recomputed_otherwise(regions)
        ):
            # The forward itself differed, before anything was recomputed, and no parameter the check could not put
            # back explains it: what the regions saw differ is its echo.
            cause = Cause.OUTSIDE_STATE
            regions = [replace(region, diverged=False) for region in regions]
    elif cause is None and not evidence.gradients_diverged and evidence.step_buffers:
        return _Decision(Cause.BUFFER_MUTATION, buffer_hint(list(evidence.step_buffers)), regions)
    elif cause is None and not evidence.gradients_diverged and evidence.step_attributes:
        return _Decision(Cause.ATTRIBUTE_MUTATION, attribute_hint(list(evidence.step_attributes)), regions)
    elif cause is None and not evidence.gradients_diverged and evidence.step_host_rng:
        return _Decision(Cause.HOST_RNG, HOST_RNG_STREAM_HINT, regions)
    elif cause is None and not evidence.gradients_diverged and evidence.step_torch_rng:
        return _Decision(Cause.RNG_NOT_PRESERVED, TORCH_RNG_STREAM_HINT, regions)
    if cause is None and evidence.gradients_diverged and evidence.read_otherwise:
        regions, unplaced = _with_read_otherwise(regions, evidence.read_otherwise)
        if unplaced:
            return _Decision(Cause.BUFFER_MUTATION, read_otherwise_hint(unplaced), regions)
    if cause is None and evidence.gradients_diverged and evidence.step_buffers and not forward_differed:
        # The forward ran alike in both passes: buffers of no region that ended otherwise were updated again by a
        # recomputation (where the forward differed, every buffer downstream of it differs too).
        regions = _with_outside_buffers(regions, list(evidence.step_buffers))
    if cause is None:
        return _Decision(None, None, regions)
    return _Decision(cause, cause.hint + COMPILED_NOISE_NOTE * (cause == Cause.NONDETERMINISTIC_KERNEL), regions)


def read_otherwise_since(module: nn.Module, before: dict[str, int]) -> tuple[str, ...]:
    """The buffers the regions in ``module`` have recomputed with other values than their forwards read since
    ``before`` was read from :func:`~lightning_ckpt_determinism.checkpointing.wrapper.buffers_read_otherwise`.

    Args:
        module: The root module.
        before: Its counts then.

    Example::

        >>> read_otherwise_since(nn.Linear(2, 2), {})
        ()
    """
    now = buffers_read_otherwise(module)
    return tuple(name for name, count in now.items() if count > before.get(name, 0))


_READS_MOVED_STATE = frozenset({Cause.PYTHON_STATE, Cause.RNG_NOT_PRESERVED, Cause.HOST_RNG})
"""Region causes of state a forward reads that moved before its recomputation (see :func:`_recomputed_otherwise`)."""


def _recomputed_otherwise(regions: list[RegionReport]) -> bool:
    """Whether a region recomputed other values than its own forward in the same pass, at the same op, from state it
    reads that changed in between (``python_state``: a global its forward counts with; ``rng_not_preserved`` or
    ``host_rng``: a stream it draws from, such as a global ``torch.Generator``, which the check cannot restore
    either): the forward differing from the step's first run is that state's echo, not the other way round. A
    recomputation that ran other ops (a cache its forward built and its recomputation found) proves nothing of the
    kind."""
    return any(
        region.diverged and region.cause in _READS_MOVED_STATE and 0.0 < region.max_abs_diff < math.inf
        for region in regions
    )


def _recomputed_before_loss(recomputed_in_forward: bool, regions: list[RegionReport]) -> bool:
    """Whether recomputation may explain a loss that differs: a backward inside the forward (a gradient penalty)
    recomputed regions before the loss, and attribution either blamed one or did not run (then no cause is guessed;
    where every attributed region recomputed exactly, the difference is outside them after all)."""
    return recomputed_in_forward and (not regions or any(region.diverged for region in regions))


def _with_read_otherwise(regions: list[RegionReport], buffers: Sequence[str]) -> tuple[list[RegionReport], list[str]]:
    """``regions``, each whose recomputation read one of ``buffers`` otherwise than its forward given
    ``buffer_mutation`` with the hint that says so (where it has no other cause), and the buffers of no region
    reported (every one without attribution)."""
    by_region: dict[str, list[str]] = {}
    names = [region.name for region in regions]
    unplaced = []
    for buffer in buffers:
        holders = [name for name in names if _holds(name, buffer)]
        if holders:
            by_region.setdefault(max(holders, key=len), []).append(buffer)
        else:
            unplaced.append(buffer)
    named = []
    for region in regions:
        own = by_region.get(region.name)
        if own and region.cause in (None, Cause.BUFFER_MUTATION):
            region = replace(region, diverged=True, cause=Cause.BUFFER_MUTATION, hint=read_otherwise_hint(own))
        named.append(region)
    return named, unplaced


def _with_outside_buffers(regions: list[RegionReport], buffers: list[str]) -> list[RegionReport]:
    """``regions``, each found reading Python state that changed given ``buffer_mutation`` where some of ``buffers``
    (that differ after the passes, the gradients diverged too) belong to no region: a recomputation updated them
    again (the forward alone ran alike), and what that region read otherwise were their values."""
    outside = [buffer for buffer in buffers if not any(_holds(region.name, buffer) for region in regions)]
    if not outside:
        return regions
    return [
        replace(region, cause=Cause.BUFFER_MUTATION, hint=buffer_hint(outside, outside=True), buffer_mutations=outside)
        if region.cause == Cause.PYTHON_STATE
        else region
        for region in regions
    ]


def _holds(region: str, name: str) -> bool:
    """Whether region ``region`` (the root for ``""``) holds the buffer or parameter ``name``."""
    return not region or name.startswith(f"{region}.")


def _with_forward_writes(regions: list[RegionReport], written: frozenset[str]) -> list[RegionReport]:
    """``regions``, each whose forward wrote one of the ``written`` parameters and has no other cause given
    ``parameter_write``."""
    named = []
    for region in regions:
        own = sorted(name for name in written if _holds(region.name, name))
        if own and region.cause is None:
            hint = f"{Cause.PARAMETER_WRITE.hint} Written: {', '.join(own)}."
            region = replace(region, diverged=True, cause=Cause.PARAMETER_WRITE, hint=hint)
        named.append(region)
    return named


def step_report(
    evidence: StepEvidence,
    *,
    grad_divergence: float,
    max_abs_diff: float,
    per_parameter: dict[str, float],
    error: str | None,
    tolerance: float,
    buffer_mutations: list[str],
    attribute_mutations: list[str],
) -> RecomputationReport:
    """The report of one check, its cause decided from ``evidence`` by the one rule of both engines.

    The step diverged when its gradients did or step-level state differs. Its cause, in order: ``"outside_state"``
    when the gradients diverged, the reference passes agree on the loss (with ``calibrate_noise``), no region blames
    a kernel that differs run to run, the checked passes computed other losses (where they recomputed an eager
    region before them, ``recomputed_in_forward``, as a gradient penalty does: only when attribution found every
    region exact), and every parameter written in place was put back (a region's forward write the check did not
    put back is that region's ``"parameter_write"`` instead); else a cause of the whole step found already; else,
    where the gradients agree, ``"buffer_mutation"`` or ``"attribute_mutation"`` for step-level state that differs;
    else, where they diverged and a region recomputed with other values of large buffers than its forward read
    (``read_otherwise``), ``"buffer_mutation"`` naming them (on that region's report where attribution gave one).

    Args:
        evidence: What the passes showed.
        grad_divergence: The gradients' relative L2 divergence.
        max_abs_diff: Their largest absolute difference.
        per_parameter: The largest difference per parameter name.
        error: Why the gradients could not be compared; ``None`` when they were.
        tolerance: The tolerance the verdict used.
        buffer_mutations: The report's ``buffer_mutations``.
        attribute_mutations: The report's ``attribute_mutations``.

    Example::

        >>> evidence = StepEvidence(gradients_diverged=True, reference_loss=1.0, checkpointed_loss=1.5)
        >>> report = step_report(evidence, grad_divergence=0.1, max_abs_diff=0.2, per_parameter={"w": 0.2},
        ...                      error=None, tolerance=0.0, buffer_mutations=[], attribute_mutations=[])
        >>> report.diverged, report.cause, report.worst_parameters
        (True, 'outside_state', [('w', 0.2)])
    """
    decision = _decide(evidence)
    return RecomputationReport(
        grad_divergence=grad_divergence,
        max_abs_diff=max_abs_diff,
        diverged=(
            evidence.gradients_diverged
            or bool(evidence.step_buffers)
            or bool(evidence.step_attributes)
            or evidence.step_host_rng
            or evidence.step_torch_rng
            or _changed_state(decision.regions)
        ),
        tolerance=tolerance,
        per_parameter=per_parameter,
        worst_parameters=worst_parameters(per_parameter),
        error=error,
        reference_loss=evidence.reference_loss,
        checkpointed_loss=evidence.checkpointed_loss,
        noise_floor=evidence.calibration.noise_floor,
        regions=decision.regions,
        buffer_mutations=buffer_mutations,
        attribute_mutations=attribute_mutations,
        cause=decision.cause,
        hint=decision.hint,
        not_restored=list(evidence.not_restored),
    )


def _changed_state(regions: Sequence[RegionReport]) -> bool:
    """Whether a region's recomputation changed its state (a metric updated again, which the check puts back): a
    region diverged with a cause that changes state."""
    return any(
        region.diverged and region.cause is not None and Cause(region.cause).state_change is not None
        for region in regions
    )


def with_attribution(live: RecomputationReport, attributed: RecomputationReport) -> RecomputationReport:
    """A live step's report joined with the two-pass attribution of the same step: the attribution's regions, and
    its cause where it gives one. A live cause that blames the whole step is provisional (attribution may find a
    kernel that differs run to run, which changes the forward as well) and gives way to the attribution's verdict,
    unless attribution ran, found the step and every region exact and gave no cause: the live step then differed from
    its rerun outside recomputation, as the live cause says (a ``loss_fn`` returning another loss than the step's
    backward got).

    Args:
        live: The live check's report.
        attributed: The attributed two-pass check's report of the same step.

    Example::

        >>> live = RecomputationReport(0.1, 0.1, diverged=True, tolerance=0.0, cause=Cause.OUTSIDE_STATE, hint="h")
        >>> region = RegionReport("a", diverged=True)
        >>> attributed = RecomputationReport(0.1, 0.1, diverged=True, tolerance=0.0, regions=[region])
        >>> joined = with_attribution(live, attributed)
        >>> joined.cause, [region.name for region in joined.regions]
        (None, ['a'])
        >>> with_attribution(live, RecomputationReport(0.0, 0.0, diverged=False, tolerance=0.0)).cause
        'outside_state'
    """
    exact = not attributed.diverged and not any(region.diverged for region in attributed.regions)
    found_nothing = attributed.cause is None and attributed.error is None and exact
    provisional = live.cause is not None and Cause(live.cause).blames == "step" and not found_nothing
    return replace(
        live,
        diverged=live.diverged or _changed_state(attributed.regions),
        regions=attributed.regions,
        buffer_mutations=attributed.buffer_mutations or live.buffer_mutations,
        cause=attributed.cause if provisional else attributed.cause or live.cause,
        hint=attributed.hint if provisional else attributed.hint or live.hint,
        error=attributed.error,
    )


def step_cause(report: RecomputationReport) -> Cause | None:
    """The report's cause when it blames the whole step rather than a region (see :attr:`Cause.blames`).

    Args:
        report: A check's report.

    Example::

        >>> report = RecomputationReport(0.1, 0.1, diverged=True, tolerance=0.0, cause="outside_state")
        >>> step_cause(report)
        'outside_state'
    """
    cause = None if report.cause is None else Cause(report.cause)
    return cause if cause is not None and cause.blames == "step" else None


def blame(report: RecomputationReport) -> tuple[Cause | None, str | None]:
    """What a check blames, as ``(cause, region name)``: a cause of the whole step with no region; else the cause
    and name of the region that diverged most; else the report's own cause (a step-level state change) with no
    region; ``(None, None)`` when nothing is blamed.

    Args:
        report: A check's report.

    Example::

        >>> region = RegionReport("blocks.1", diverged=True, cause="host_rng", max_abs_diff=0.5)
        >>> blame(RecomputationReport(0.1, 0.1, diverged=True, tolerance=0.0, regions=[region]))
        ('host_rng', 'blocks.1')
    """
    whole = step_cause(report)
    if whole is not None:
        return whole, None
    worst = diverging(report.regions)
    if worst and worst[0].cause is not None:
        return Cause(worst[0].cause), worst[0].name
    return (None if report.cause is None else Cause(report.cause)), None
