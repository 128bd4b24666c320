"""Check that recomputation reproduces the forward: one step's gradients with and without checkpointing.

The engine knows nothing of Lightning. From one captured state it runs a reference pass with checkpointing switched
off (twice to measure the noise floor) and a checkpointed pass, compares the gradients, optionally attributes
differences to regions and ops (:mod:`~lightning_ckpt_determinism.verify.attribution`), and puts back every random
stream, buffer, grad mode and training flag it found, whatever is raised. On a compiled model both passes run
compiled, the reference with the compiler's own recomputation off too
(:mod:`~lightning_ckpt_determinism.verify.compiled`). :class:`_Passes` runs the named passes, each from the captured
state; :func:`_verdict` turns their gradients into figures; :func:`check_recomputation` decides which passes run.
"""

import contextlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from functools import partial
from typing import Literal

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from lightning_ckpt_determinism._library_compat import compiled_by_lightning
from lightning_ckpt_determinism._torch_compat import version_counter
from lightning_ckpt_determinism.checkpointing.modules import buffer_slots, region_name
from lightning_ckpt_determinism.checkpointing.wrapper import (
    buffers_read_otherwise,
    checkpointed_modules,
    recomputations,
    recomputations_by_region,
    replays_torch_rng,
    tracing_noted,
)
from lightning_ckpt_determinism.config import check_bool, check_choice, check_non_negative_float
from lightning_ckpt_determinism.errors import CheckpointingConfigError, CheckpointingTypeError
from lightning_ckpt_determinism.verify.attribution import Attribution
from lightning_ckpt_determinism.verify.attribution.observer import BufferPlace
from lightning_ckpt_determinism.verify.cause import Cause
from lightning_ckpt_determinism.verify.compare import gradient_divergence, uncomparable_gradients
from lightning_ckpt_determinism.verify.compiled import eager_semantics, is_compiled, reference_pass
from lightning_ckpt_determinism.verify.core import (
    Calibration,
    CheckScope,
    StepEvidence,
    calibrate,
    gradients_diverge,
    read_otherwise_since,
    region_modules,
    step_report,
    uncomparable,
)
from lightning_ckpt_determinism.verify.gradients import take_gradients
from lightning_ckpt_determinism.verify.reports import (
    HOST_RNG_STREAM_HINT,
    TORCH_RNG_STREAM_HINT,
    RecomputationReport,
    RegionReport,
    attribute_hint,
    describe_error,
    uncomparable_layouts,
)
from lightning_ckpt_determinism.verify.state import StepState

__all__ = ["NothingRecomputed", "PassFailed", "SkippedPass", "check_recomputation", "raised_in_autograd"]

_Gradients = list[torch.Tensor | None]


class SkippedPass(Exception):
    """Raised by a ``closure`` of :func:`check_recomputation` whose step skips the pass under way (a Lightning
    ``training_step`` that returned None): no gradients can be compared, and the check raises it from whichever pass
    it came, a checkpointed one too, rather than reporting a failure of recomputation."""


class PassFailed(Exception):
    """Raised by :func:`check_recomputation` on every rank when the checkpointed pass raised outside autograd's
    backward on any (the ``closure``'s own code, run again, not a recomputation), or, given ``agree``, when the
    reference pass raised on any: no gradients can be compared, and the failure is not about recomputation. It holds
    that error as its ``__cause__`` on the rank that raised it; every rank raises alike, so none waits in a
    collective of the check."""


class NothingRecomputed(ValueError):
    """Raised by :func:`check_recomputation` on every rank when its checkpointed pass recomputed no region on any: the
    ``closure`` calls none of them with gradients enabled (or under
    :func:`~lightning_ckpt_determinism.checkpointing.checkpointing_disabled`), or they save nothing for backward, so
    both passes ran the same computation and their equal gradients would prove nothing."""


def check_recomputation(
    module: nn.Module,
    closure: Callable[[], torch.Tensor],
    *,
    tolerance: float = 0.0,
    attribution: bool = False,
    calibrate_noise: bool = False,
    gradients: Literal["autograd", "backward"] = "autograd",
    agree: Callable[[bool], bool] | None = None,
    exclude_attributes: Iterable[str] = (),
    written_parameters: Iterable[str] | None = None,
) -> RecomputationReport:
    """Run one step twice, without and with checkpointing, and compare the gradients.

    From one state S the reference pass runs ``closure`` under
    :func:`~lightning_ckpt_determinism.checkpointing.checkpointing_disabled` and takes gradients;
    S is restored; the checkpointed pass runs the same way, recomputing inside its backward. S is every random
    stream (torch's CPU and accelerator RNG, Python's ``random``, NumPy, the generators the modules hold), the
    buffers, the parameters the forward writes in place, torchmetrics states, training flags, grad mode and the
    modules' plain Python attributes (counters, flags, lists, NumPy arrays, tensors, the objects of the user's own
    classes they hold, one level deep; attributes the passes create are removed: see
    :class:`~lightning_ckpt_determinism.verify.state.StepState`). Afterwards all of it is back at S. What the check
    could not put back is named in ``not_restored``. The regions keep what the checkpointed pass taught them about
    their calls, as a training step would have (a buffer a forward was first seen to change is replayed from then on):
    a step that would have been the first to teach it is exact after a check (the monitor checks a step after it ran,
    so its training is the same with it as without).

    When ``module`` or a submodule is compiled (``torch.compile`` or ``Module.compile()``), both passes run
    compiled; the reference pass runs with ``torch._functorch.config.activation_memory_budget`` at 1.0 at every
    call, so that it has none of the compiler's own recomputation, and the check catches the compiler's
    recomputation bugs (pytorch#190717). Attribution then reruns the step eagerly under
    ``torch.compiler.set_stance("force_eager")``; a compiled divergence that the eager step does not show gets
    ``cause`` ``"compiler_recompute"``, and one more checkpointed pass, compiled again through a scan of its backward
    graphs (a recompile, once per compiled part), names the regions whose recomputation draws a random op afresh
    instead of replaying its forward's draw: those regions get the cause, with a hint naming the op. Inductor and
    the ``aot_autograd`` backends (``aot_eager`` ...) are scanned; with another backend no region is named.

    After the checkpointed pass every buffer is compared with its value after the reference pass (one
    ``torch.equal`` each), as the live step's check compares them: a buffer that recomputation updated a second time
    (BatchNorm with ``protect_buffers=False``) is named in ``buffer_mutations`` even where the gradients are exact.
    Without attribution it makes the step diverge with cause ``"buffer_mutation"``; with attribution, the region
    report that places it names it instead, and the step diverges only where one is not placed.

    An exception raised by the checkpointed pass in autograd's backward, where regions are recomputed (torch's
    ``CheckpointError`` when a recomputed shape differs, for example), is reported as a divergence; one raised by the
    reference pass is re-raised (with ``agree``, every rank raises :class:`PassFailed` instead), and one raised by the
    checkpointed pass before its backward (the closure's own code failing when run again) raises :class:`PassFailed`,
    since neither is about recomputation. A check that finds nothing
    to compare (no gradient reached any parameter, or the reference pass gave none where the checkpointed pass did) does
    not pass: its ``error`` says why, with ``diverged`` set and ``grad_divergence`` infinite.

    The check holds one extra set of gradients while it runs, and costs two forward and backward passes.
    ``calibrate_noise`` adds a third (a second reference pass). ``attribution`` observes every op of the
    checkpointed regions in the checkpointed pass: it holds a copy of each op's outputs from the region's forward
    until the region is recomputed in backward (about the regions' activations once more, which is what the
    reference pass holds anyway) plus small fingerprints of op inputs, and the Python-level observation makes that
    pass several times slower. When a region differs in a way only host RNG could explain, one more checkpointed
    pass replays host RNG for it to confirm. Nothing of this outlives the call. How causes are decided is
    described in :mod:`lightning_ckpt_determinism.verify.attribution.region_cause`.

    Args:
        module: The model; its parameters that require grad are compared.
        closure: Computes and returns a scalar loss from ``module``.
        tolerance: Largest ``grad_divergence`` (relative L2) that still counts as equal.
        attribution: Compare, op by op, every tensor each checkpointed region recomputes with the one its forward
            produced, and fill ``regions`` with where and why they differ (a region whose recomputation changed its
            buffers names them in its report).
        calibrate_noise: Run the reference pass twice and take twice their divergence as the noise floor: the
            verdict then asks for a divergence above both ``tolerance`` and the noise floor, so that
            non-deterministic kernels (GPU atomics) are not reported as recomputation bugs. Python state that a
            module changes in forward also makes the two reference passes differ, and so raises the floor.
        gradients: How gradients are taken. ``"autograd"``: ``torch.autograd.grad``, so ``.grad`` is never
            touched. ``"backward"``: ``loss.backward()``, with the ``.grad`` the parameters held set aside during
            the check and put back after; needed where ``autograd.grad`` cannot work, such as FSDP2's sharded
            (DTensor) parameters, which get their gradients from FSDP's reduce-scatter, or reentrant checkpointing
            elsewhere in the model. A sharded gradient is compared as this rank's shard.
        agree: For a check run on every rank at once: reduces a decision this rank took (``True`` on any rank makes
            it ``True`` on all) so that every rank runs the same passes, since a forward may hold collectives (FSDP's
            all-gathers, SyncBatchNorm). Attribution decides two extra passes from what it found: the host-RNG
            confirmation and, on a compiled model, the graph scan. ``None`` on one process.
        exclude_attributes: Attribute names never compared on any module (they are still put back after the check):
            values that legitimately differ from pass to pass, such as a timestamp. The plain attributes of the
            modules inside checkpointed regions are compared after both passes (``attribute_mutations``).
        written_parameters: Names of parameters ``closure`` writes in place (an ``nn.Embedding`` with ``max_norm``
            renormalises its weight in forward, a forward that decays or clamps a parameter under ``no_grad``):
            their values are captured with the state and put back before each pass and after the check. ``None``
            (the default): every parameter's value is captured, and put back where the passes wrote it; the check
            then holds one copy of the parameters while it runs. Naming them saves that copy; a parameter written
            that is not named is reported in ``not_restored``.

    Returns:
        The :class:`RecomputationReport`.

    Raises:
        CheckpointingConfigError: If ``tolerance`` is negative, ``gradients`` unknown or a switch not a bool (a
            ``ValueError``), or if ``module`` has no region checkpointed by this package (its answer would say
            nothing).
        CheckpointingTypeError: If ``module`` is not a module or ``closure`` not callable (given in the other order).
        PassFailed: If the checkpointed pass raised before its backward (on any rank, with ``agree``), or, with
            ``agree``, if the reference pass raised on any rank.
        NothingRecomputed: If the checkpointed pass recomputed no region (on any rank, with ``agree``) and
            found gradients to compare; a compiled model (one whose steps Lightning compiles, or whose regions a
            compiled function traced) recomputes inside its graphs, uncounted, and is checked whatever it recomputed.
        ValueError: If ``module`` has no parameter that requires grad, or one a lazy module has not initialised yet.

    Example::

        >>> import torch
        >>> from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 1))
        >>> _ = apply_activation_checkpointing(model, CheckpointingConfig(names=["0", "1"]))
        >>> report = check_recomputation(model, lambda: model(torch.ones(2, 4)).sum(), attribution=True)
        >>> report.grad_divergence
        0.0
        >>> [(region.name, region.diverged) for region in report.regions]
        [('0', False), ('1', False)]
    """
    if not isinstance(module, nn.Module) or not callable(closure):
        raise CheckpointingTypeError(
            f"`check_recomputation` takes the model, then the closure computing its loss: got"
            f" ({type(module).__name__}, {type(closure).__name__})."
        )
    tolerance = check_non_negative_float("tolerance", tolerance)
    attribution = check_bool("attribution", attribution)
    calibrate_noise = check_bool("calibrate_noise", calibrate_noise)
    check_choice("gradients", gradients, ("autograd", "backward"))
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError(f"`module` ({type(module).__name__}) has no parameter that requires grad to compare.")
    lazy = [name for name, p in named if is_lazy(p)]
    if lazy:
        raise ValueError(
            f"`module` ({type(module).__name__}) has parameters its lazy modules have not initialised yet"
            f" ({', '.join(lazy[:3])}{' ...' if len(lazy) > 3 else ''}): run one forward of the model before checking"
            " it (the check must not initialise them, which would change training)."
        )
    regions = list(checkpointed_modules(module))
    if not regions:
        raise CheckpointingConfigError(_no_region_message(module))
    names = [region_name(name) for name, _ in named]
    params = [p for _, p in named]
    use_backward = gradients == "backward"
    if written_parameters is not None:
        written_parameters = tuple(written_parameters)
    captured = frozenset(dict(module.named_parameters()) if written_parameters is None else written_parameters)
    with CheckScope(module, params, set_gradients_aside=use_backward, written_parameters=written_parameters) as scope:
        passes = _Passes(
            scope,
            module,
            closure,
            params,
            use_backward=use_backward,
            agree=agree,
            exclude_attributes=frozenset(exclude_attributes),
        )
        report = _compare(
            passes,
            names,
            tolerance,
            attribution=attribution,
            calibrate_noise=calibrate_noise,
            captured=captured,
        )
    checked = regions if passes.recomputation_uncounted else report.checked_regions
    return replace(report, checked_regions=checked, compiled=passes.compiled)


def _no_region_message(module: nn.Module) -> str:
    others = sorted(
        {
            f"transformers' gradient checkpointing (on `{type(sub).__name__}`)"
            for sub in module.modules()
            if getattr(sub, "gradient_checkpointing", False) is True
        }
    )
    elsewhere = f" It has {', '.join(others)}, which this check cannot see into." if others else ""
    return (
        f"`check_recomputation` found no region of this package in {type(module).__name__}: nothing it compares is"
        f" recomputed, so it would report a meaningless 0.{elsewhere} Apply checkpointing first with"
        " `apply_activation_checkpointing(module, CheckpointingConfig(classes=[...]))`, or train with one of the"
        " package's strategies."
    )


def _compare(
    passes: "_Passes",
    names: list[str],
    tolerance: float,
    *,
    attribution: bool,
    calibrate_noise: bool,
    captured: frozenset[str],
) -> RecomputationReport:
    """The passes a check runs, in order, and the report they give (``captured``: the parameters written in place
    whose values the check puts back before each pass)."""
    reference_loss, reference = passes.reference()
    calibration = Calibration()
    if calibrate_noise:
        calibration = calibrate(
            reference_loss, reference, passes.reference, lambda once, again: gradient_divergence(once, again)[0]
        )
    noise_floor = calibration.noise_floor
    observer = Attribution(passes.module) if attribution else None
    # The observer sees eager dispatch only: a compiled model is observed in the same step rerun eagerly.
    checkpointed = passes.checkpointed(None if passes.compiled else observer)
    recomputed = passes.recomputed_regions
    changed_buffers = passes.changed_buffers()
    attributes = passes.changed_attributes()
    host_rng = passes.changed_host_rng()
    torch_rng = passes.changed_torch_rng()
    not_restored = passes.scope.unrestored()
    eager_diverged = (
        passes.compiled and observer is not None and passes.diverges_eagerly(observer, tolerance, noise_floor)
    )
    explained = passes.host_rng_explained(observer.host_rng_suspects() if observer is not None else frozenset())
    verdict = _verdict(names, reference, checkpointed, tolerance, noise_floor)
    # Decided alike on every rank: a rank that recomputed, failed in backward or found nothing to compare reports so.
    if not passes.recomputation_uncounted and not passes.agreed(
        bool(recomputed) or checkpointed.error is not None or verdict.error is not None
    ):
        raise NothingRecomputed(
            "`check_recomputation`'s checkpointed pass recomputed no checkpointed region, so it would compare a"
            " step with itself: make `closure` call the checkpointed modules with gradients enabled (not under"
            " `checkpointing_disabled()` or `torch.no_grad()`), on inputs or parameters that require grad, and"
            " without saved-tensor hooks (`save_on_cpu`) entered inside them, which take their saved tensors from"
            " checkpointing."
        )
    regions, buffers = (
        ([], [])
        if observer is None
        else observer.reports(
            gradients_diverged=verdict.diverged,
            host_rng_explained=explained,
            ended_otherwise=_buffer_places(passes.module, changed_buffers) if passes.buffers_compared else None,
        )
    )
    cause = None
    if passes.compiled:
        # Eager findings: compile replays RNG and updates buffers itself, so they count where the compiled step
        # diverged as well.
        regions = [replace(region, diverged=region.diverged and verdict.diverged) for region in regions]
        compiler_only = observer is not None and verdict.diverged and not eager_diverged
        compiler_only = compiler_only and not any(region.diverged for region in regions)
        cause, regions = passes.compiled_cause(compiler_only, reference, checkpointed.gradients, regions)
    regions = _with_attributes(regions, attributes)
    if host_rng and observer is not None:
        regions = _with_host_rng(regions, observer.host_rng_readers())
    if torch_rng:
        regions = _with_torch_rng(regions)
    evidence = StepEvidence(
        gradients_diverged=verdict.diverged,
        reference_loss=reference_loss,
        checkpointed_loss=checkpointed.loss,
        recomputed_in_forward=checkpointed.recomputed_in_forward,
        read_otherwise=checkpointed.read_otherwise,
        calibration=calibration,
        not_restored=not_restored,
        regions=regions,
        step_cause=cause,
        forward_writes=observer.parameters_written_in_forward() - captured if observer is not None else frozenset(),
        # Buffers and attributes that ended the passes differently are the step's state change, as in the live
        # engine; the region reports, with attribution, say where.
        step_attributes=attributes,
        step_buffers=changed_buffers,
        step_host_rng=host_rng,
        step_torch_rng=torch_rng,
    )
    report = step_report(
        evidence,
        grad_divergence=verdict.divergence,
        max_abs_diff=max(verdict.max_diffs, default=0.0),
        per_parameter=verdict.per_parameter,
        error=verdict.error,
        tolerance=tolerance,
        buffer_mutations=buffers or changed_buffers,
        attribute_mutations=attributes,
    )
    return replace(report, checked_regions=recomputed)


def _with_attributes(regions: list[RegionReport], attributes: list[str]) -> list[RegionReport]:
    """``regions``, each with the changed attributes of its modules; a region without another cause gets
    ``attribute_mutation``."""
    named = []
    for region in regions:
        own = [name for name in attributes if name.startswith(f"{region.name}.") or not region.name]
        if own and region.cause is None:
            region = replace(region, diverged=True, cause=Cause.ATTRIBUTE_MUTATION, hint=attribute_hint(own))
        named.append(replace(region, attribute_mutations=own) if own else region)
    return named


def _with_torch_rng(regions: list[RegionReport]) -> list[RegionReport]:
    """``regions``, those whose recomputation drew other numbers from torch's RNG (``rng_not_preserved``, the
    gradients exact) given the hint that says the step left the stream otherwise."""
    return [
        replace(region, diverged=True, hint=TORCH_RNG_STREAM_HINT)
        if region.cause == Cause.RNG_NOT_PRESERVED and not region.diverged
        else region
        for region in regions
    ]


def _with_host_rng(regions: list[RegionReport], readers: frozenset[str]) -> list[RegionReport]:
    """``regions``, those that read the host's random streams and have no other cause given ``host_rng``: the check
    found the streams left otherwise by the checked pass, with exact values."""
    return [
        replace(region, diverged=True, cause=Cause.HOST_RNG, hint=HOST_RNG_STREAM_HINT)
        if region.name in readers and region.cause is None
        else region
        for region in regions
    ]


@dataclass(frozen=True)
class _Outcome:
    """What one checkpointed pass gave: its loss and gradients, or the error it raised (``nan`` and ``None``),
    whether it recomputed a region before its loss was computed, and the buffers its recomputations got with other
    values than their forwards read (see :func:`buffers_read_otherwise`)."""

    loss: float
    gradients: _Gradients | None
    error: Exception | None
    recomputed_in_forward: bool = False
    read_otherwise: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Verdict:
    divergence: float
    max_diffs: list[float]
    per_parameter: dict[str, float]
    error: str | None
    diverged: bool


def _verdict(
    names: list[str], reference: _Gradients, checkpointed: _Outcome, tolerance: float, noise_floor: float
) -> _Verdict:
    """The figures of a check from its gradients: an error or an uncomparable pair is a finding, never ``0.0``."""
    finding = describe_error(checkpointed.error) if checkpointed.error is not None else None
    if checkpointed.gradients is not None:
        finding = _uncomparable(names, reference, checkpointed.gradients)
    if finding is not None or checkpointed.gradients is None:
        return _Verdict(math.inf, [math.inf], {}, finding, diverged=True)
    divergence, max_diffs = gradient_divergence(reference, checkpointed.gradients)
    per_parameter = dict(zip(names, max_diffs, strict=True))
    return _Verdict(divergence, max_diffs, per_parameter, None, gradients_diverge(divergence, tolerance, noise_floor))


def _uncomparable(names: list[str], reference: _Gradients, recomputed: _Gradients) -> str | None:
    missing = [
        name for name, ref, other in zip(names, reference, recomputed, strict=True) if ref is None and other is not None
    ]
    odd_layouts = uncomparable_gradients(names, reference, recomputed)
    finding = uncomparable(
        missing,
        missing_anywhere=bool(missing),
        gradients_anywhere=any(grad is not None for grad in (*reference, *recomputed)),
        live="the checkpointed pass",
        nowhere="in either pass; make the loss depend on the module's parameters",
    )
    return finding if finding is not None or not odd_layouts else uncomparable_layouts(odd_layouts)


class _Passes:
    """The passes of one check, each run from the state ``scope`` captured (the scope puts it back after the
    check). Decisions that start or skip a pass are reduced over ranks with ``agree`` first, so every rank runs the
    same passes and their collectives.
    """

    def __init__(
        self,
        scope: CheckScope,
        module: nn.Module,
        closure: Callable[[], torch.Tensor],
        params: list[nn.Parameter],
        *,
        use_backward: bool,
        agree: Callable[[bool], bool] | None,
        exclude_attributes: frozenset[str] = frozenset(),
    ) -> None:
        self.module = module
        self.scope = scope
        self._exclude = exclude_attributes
        self._after_reference: StepState | None = None
        self.compiled = is_compiled(module)
        self._take = partial(_gradients, self._counted(closure), params, use_backward=use_backward, model=module)
        self._agreed = agree if agree is not None else bool
        self._several_ranks = agree is not None
        self._ran = False
        # Whether the last pass recomputed a region before its closure returned the loss (a gradient penalty).
        self._recomputed_in_forward = False
        # The regions the last checkpointed pass recomputed (eager recomputations; a compiled region's are uncounted),
        # and whether a compiled function ran a region in it.
        self.recomputed_regions: list[str] = []
        self._traced = False

    @property
    def recomputation_uncounted(self) -> bool:
        """Whether the regions may recompute inside compiled graphs, where no recomputation is counted: a compiled
        model, one whose steps Lightning compiles, or one a compiled function (a closure, a `loss_fn`) ran in the
        last checkpointed pass."""
        return self.compiled or compiled_by_lightning(self.module) or self._traced

    def agreed(self, decision: bool) -> bool:
        """``decision`` reduced over ranks (``True`` on any makes it ``True`` on all); itself on one process."""
        return self._agreed(decision)

    def _counted(self, closure: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """``closure``, noting whether it recomputed a region before it returned."""

        def counted() -> torch.Tensor:
            self._recomputed_in_forward = False  # a pass that raises recomputed nothing the loss depends on
            before = recomputations(self.module)
            loss = closure()
            self._recomputed_in_forward = recomputations(self.module) > before
            return loss

        return counted

    def reference(self) -> tuple[float, _Gradients]:
        """A reference pass: checkpointing off, the compiler's own recomputation off too. An error it raises is
        re-raised on one process; with ``agree``, every rank raises :class:`PassFailed` where any rank's failed, so
        that none waits for the others in a collective of the checkpointed pass."""
        self._restore()
        try:
            taken = self._take(disable_checkpointing=True)
        except SkippedPass:
            raise
        except Exception as err:
            if self._several_ranks and self._agreed(True):
                raise PassFailed(describe_error(err)) from err
            raise
        if self._several_ranks and self._agreed(False):
            raise PassFailed("the check's reference pass failed on another rank")
        if self._after_reference is None:
            self._after_reference = StepState(self.module)
        return taken

    @property
    def buffers_compared(self) -> bool:
        """Whether :meth:`changed_buffers` compares (a reference pass ran and its buffers were captured)."""
        return self._after_reference is not None

    def changed_buffers(self) -> list[str]:
        """The buffers that now differ from their values after the first reference pass, as the live engine
        compares them (call it right after a checkpointed pass): recomputation that updates a buffer a second time
        (BatchNorm without ``protect_buffers``) changes no gradient but shows here."""
        if self._after_reference is None:
            return []
        return self._after_reference.differing_buffers()

    def changed_attributes(self) -> list[str]:
        """The plain attributes of the modules inside regions that now differ from their values after the first
        reference pass (call it right after a checkpointed pass)."""
        if self._after_reference is None:
            return []
        return self._after_reference.differing_attributes(region_modules(self.module), self._exclude)

    def changed_torch_rng(self) -> bool:
        """Whether torch's RNG now holds another state than after the first reference pass (call it right after a
        checkpointed pass): a region that drew from it again in its recomputation, unreplayed. Asked only where some
        region does not replay it (``preserve_rng_state`` off); a compiled model is never said to: the compiler draws
        its random ops' seeds by its own rules, and never recomputes them."""
        if self._after_reference is None or self.compiled or replays_torch_rng(self.module):
            return False  # with every region replaying it, what moved it is outside recomputation
        return self._after_reference.torch_rng_moved()

    def changed_host_rng(self) -> bool:
        """Whether Python's ``random`` or NumPy's global RNG now holds another state than after the first reference
        pass (call it right after a checkpointed pass): a region that drew from it again in its recomputation."""
        return self._after_reference is not None and self._after_reference.host_rng_moved()

    def checkpointed(self, observer: Attribution | None = None) -> _Outcome:
        """A checkpointed pass, observed when ``observer`` is given; an error it raises is its outcome."""
        self._restore()
        observing = observer.observing() if observer is not None else contextlib.nullcontext()
        error: Exception | None = None
        before = buffers_read_otherwise(self.module)
        counts = recomputations_by_region(self.module)
        try:
            with observing, tracing_noted(self.module) as traced:
                loss, grads = self._take(disable_checkpointing=False)
        except SkippedPass:
            raise
        except Exception as err:  # any failure of recomputation is the finding, not a crash
            error = err
        if observer is not None:
            observer.finish(error)
        outside = error if error is not None and not raised_in_autograd(error) else None
        if self._agreed(outside is not None):
            said = describe_error(outside) if outside is not None else "the checkpointed pass failed on another rank"
            raise PassFailed(said) from outside
        read_otherwise = read_otherwise_since(self.module, before)
        self._traced = any(traced)
        self.recomputed_regions = [
            name for name, count in recomputations_by_region(self.module).items() if count > counts.get(name, 0)
        ]
        if error is not None:
            return _Outcome(math.nan, None, error, self._recomputed_in_forward, read_otherwise)
        return _Outcome(loss, grads, None, self._recomputed_in_forward, read_otherwise)

    def diverges_eagerly(self, observer: Attribution, tolerance: float, noise_floor: float) -> bool:
        """The same step, both passes, rerun eagerly with ``observer``: whether it diverges too."""
        with eager_semantics():
            _, reference = self.reference()
            outcome = self.checkpointed(observer)
        if outcome.error is not None or outcome.gradients is None:
            return True
        return gradients_diverge(gradient_divergence(reference, outcome.gradients)[0], tolerance, noise_floor)

    def host_rng_explained(self, suspects: frozenset[str]) -> frozenset[str]:
        """The suspects whose recomputation matches its forward once their host RNG is replayed: one more pass,
        run on every rank when any has a suspect (a rank without one replays nothing, for the others' collectives)."""
        if not self._agreed(bool(suspects)):
            return frozenset()
        replaying = Attribution(self.module, replay_host_rng=suspects)
        with eager_semantics() if self.compiled else contextlib.nullcontext():
            self.checkpointed(replaying)
        return suspects - replaying.diverging_regions()

    def compiled_cause(
        self, compiler_only: bool, reference: _Gradients, recomputed: _Gradients | None, regions: list[RegionReport]
    ) -> tuple[Cause | None, list[RegionReport]]:
        """A compiled divergence the eager step does not show: the compiler's recomputation when it repeats from the
        same state, kernels that differ run to run when it does not; the regions the graph scan names then."""
        if not self._agreed(compiler_only):
            return None, regions
        # A compiler's recomputation bug repeats from the same state; compiled kernels that differ from run to run
        # (inductor's accumulations) do not: both passes once more tell the two apart.
        _, again_reference = self.reference()
        again = self.checkpointed()
        repeats = _same(reference, again_reference) and _same(recomputed, again.gradients)
        cause = (Cause.COMPILER_RECOMPUTE if repeats else Cause.NONDETERMINISTIC_KERNEL) if compiler_only else None
        if self._agreed(compiler_only and repeats):
            # Where this rank's divergence is not the compiler's, the pass runs for the others' collectives only.
            regions = self._name_redrawing_regions(regions, mark=cause == Cause.COMPILER_RECOMPUTE)
        return cause, regions

    def _name_redrawing_regions(self, regions: list[RegionReport], *, mark: bool) -> list[RegionReport]:
        """``regions``, those whose compiled backward graphs redraw a random op marked when ``mark``: the checkpointed
        pass once more, compiled through the graph scan (a recompile, once per compiled part; none where the audit
        installed the scan)."""
        from lightning_ckpt_determinism.verify.compiled.graph_scan import scanned

        with scanned(self.module) as scan:
            self.checkpointed()
        redraws = scan.regions(checkpointed_modules(self.module)) if mark else {}
        named = []
        for region in regions:
            if region.name in redraws:
                found = "; ".join(redraw.describe() for redraw in redraws[region.name])
                hint = f"{Cause.COMPILER_RECOMPUTE.hint} In its compiled backward graph, {found}."
                region = replace(region, diverged=True, cause=Cause.COMPILER_RECOMPUTE, hint=hint)
            named.append(region)
        return named

    def _restore(self) -> None:
        # The first pass starts from the state as it was captured; each later one from that state put back.
        if self._ran:
            self.scope.restore()
        self._ran = True


def _same(first: _Gradients | None, second: _Gradients | None) -> bool:
    return first is not None and second is not None and gradient_divergence(first, second)[0] == 0.0


def _autograd_gradients(loss: torch.Tensor, params: list[nn.Parameter]) -> _Gradients:
    """``torch.autograd.grad`` of ``loss`` for ``params``, ``None`` for those that no longer require grad when it is
    taken (the pass froze them); torch's refusal under reentrant checkpointing as one line with the fix."""
    wanted = [param for param in params if param.requires_grad]
    try:
        taken = iter(torch.autograd.grad(loss, wanted, allow_unused=True) if wanted else ())
    except RuntimeError as err:
        if "use_reentrant=True" not in str(err):
            raise
        raise ValueError(
            "lightning_ckpt_determinism: the model runs reentrant checkpointing (`use_reentrant=True`; transformers'"
            " `gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': True})`, for instance),"
            " whose gradients `torch.autograd.grad` cannot take: call `check_recomputation(...,"
            ' gradients="backward")`, or switch it to `use_reentrant=False`.'
        ) from err
    return [next(taken) if param.requires_grad else None for param in params]


def _gradients(
    closure: Callable[[], torch.Tensor],
    params: list[nn.Parameter],
    *,
    disable_checkpointing: bool,
    use_backward: bool,
    model: nn.Module | None = None,
) -> tuple[float, _Gradients]:
    context = reference_pass(model=model) if disable_checkpointing else contextlib.nullcontext()
    with context, torch.enable_grad():
        held = [(param.grad, None if param.grad is None else version_counter(param.grad)) for param in params]
        loss = closure()
        wrote = [
            param
            for param, (grad, version) in zip(params, held, strict=True)
            if param.grad is not grad or (grad is not None and version_counter(grad) != version)
        ]
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(
                "lightning_ckpt_determinism: the check's closure must return a scalar loss tensor, got"
                f" {type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}."
            )
        if not loss.requires_grad:
            raise ValueError(
                "lightning_ckpt_determinism: the check's loss does not require grad; compute it from the module's"
                " parameters with grad enabled."
            )
        try:
            if not use_backward:
                return float(loss.detach()), _autograd_gradients(loss, params)
            try:
                loss.backward()
            finally:
                # Taken even when backward raises: the next pass must start from no gradient.
                grads = take_gradients(params)
        except RuntimeError as error:
            if not wrote or _FREED_GRAPH not in str(error):
                raise
            for param, (grad, _) in zip(params, held, strict=True):
                if grad is None:  # what the closure's own backward left, gone (one it added to stays added)
                    param.grad = None
            raise ValueError(_ran_backward_message(len(wrote))) from error
    return float(loss.detach()), grads


# What torch says where a backward reaches a graph an earlier backward freed.
_FREED_GRAPH = "backward through the graph a second time"


def _ran_backward_message(written: int) -> str:
    return (
        "lightning_ckpt_determinism: the check's closure ran a backward itself (it wrote the `.grad` of"
        f" {written} parameter{'s' if written != 1 else ''}), and its loss's graph was freed before the check could"
        " take the gradients: give a closure that returns the loss without calling `backward()` (for an LBFGS-style"
        " closure that zeroes the gradients, runs backward and returns the loss, pass `lambda: <that loss>`)."
    )


def raised_in_autograd(error: BaseException) -> bool:
    """Whether ``error`` was raised inside autograd's backward (``backward()`` or ``autograd.grad``, also one a
    closure runs in its forward, as a gradient penalty does), where checkpointed regions are recomputed; not in a
    checkpointed region's forward, which runs inside torch's checkpoint too.

    Args:
        error: The error, with its traceback.

    Example::

        >>> raised_in_autograd(ValueError("not in a backward"))
        False
    """
    trace = error.__traceback__
    while trace is not None:
        code = trace.tb_frame.f_code
        if code.co_name == "_engine_run_backward":
            return True
        trace = trace.tb_next
    return False


def _buffer_places(module: nn.Module, names: Iterable[str]) -> set[BufferPlace]:
    """Where the buffers of ``module`` named ``names`` (as users write them, see
    :func:`~lightning_ckpt_determinism.checkpointing.modules.region_name`) are held (see
    :data:`~lightning_ckpt_determinism.verify.attribution.observer.BufferPlace`)."""
    slots = {region_name(name): slot for name, slot in buffer_slots(module).items()}
    return {(id(slots[name][0]), slots[name][1]) for name in names if name in slots}
