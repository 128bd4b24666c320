"""Check that recomputation reproduces the forward: one step's gradients with and without checkpointing.

The engine knows nothing of Lightning. It forks every random stream, runs a reference pass with checkpointing
switched off (twice to measure the noise floor) and a checkpointed pass from the same random state, compares the
gradients (obtained with ``torch.autograd.grad``, so no ``.grad`` is touched), optionally attributes differences to
regions and ops (:mod:`~lightning_ckpt_determinism.attribution`), and puts back every random stream, buffer, grad
mode and training flag it found, whatever is raised. On a compiled model both passes run compiled, the reference
with the compiler's own recomputation off too (:mod:`~lightning_ckpt_determinism._compile`).
"""

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import torch
from torch import nn

from lightning_ckpt_determinism._compile import eager_semantics, is_compiled, reference_pass
from lightning_ckpt_determinism._grads import GradientStash, local_tensor
from lightning_ckpt_determinism._graph_scan import scanned
from lightning_ckpt_determinism._state import StepState
from lightning_ckpt_determinism.attribution import CAUSE_HINTS, RegionReport, _Attribution, _elementwise_difference
from lightning_ckpt_determinism.wrapping import _region_name, checkpointed_modules

__all__ = ["RecomputationReport", "check_recomputation", "gradient_divergence"]

_WORST_PARAMETERS = 5
# One sample of the noise: a second draw (the checkpointed pass) exceeds it about half the time, by a little, so
# the floor is set at twice the divergence of the two reference passes.
_NOISE_MARGIN = 2.0


@dataclass
class RecomputationReport:
    """What one recomputation check found.

    Attributes:
        grad_divergence: Relative L2 divergence of the gradients: the norm of the difference over all parameters
            divided by the norm of the reference gradients; ``0.0`` when identical, ``inf`` when the
            checkpointed pass failed or produced a non-finite value the reference did not.
        max_abs_diff: Largest absolute difference of any gradient element.
        diverged: Whether ``grad_divergence`` exceeds both the tolerance and the noise floor, or the checkpointed
            pass raised. Buffer mutations, which change no gradient, show in ``regions`` and ``buffer_mutations``.
        tolerance: The tolerance the verdict used.
        per_parameter: Largest absolute gradient difference for each parameter, by parameter name.
        worst_parameters: The parameters with the largest differences, worst first (at most five, only those
            that differ).
        error: The exception raised during the checkpointed pass (e.g. torch's ``CheckpointError`` when a
            recomputed tensor's shape differs), as ``"Type: message"``; ``None`` when it ran.
        checked_regions: Names of the checkpointed modules the check exercised.
        reference_loss: The loss of the reference pass.
        checkpointed_loss: The loss of the checkpointed pass (``nan`` when it raised before computing one).
        noise_floor: With ``calibrate_noise``, twice the ``grad_divergence`` between two reference passes: what
            non-deterministic kernels alone produce, with a margin; ``0.0`` otherwise.
        regions: With ``attribution``, one :class:`RegionReport` per checkpointed region in module order: where
            recomputation differed from the forward, at which op, and why; empty otherwise.
        buffer_mutations: With ``attribution``, the names of the buffers recomputation changed (relative to the
            checked module), whether or not that changed a gradient.
        compiled: Whether the module is compiled. Both passes then ran compiled, and ``regions`` come from the same
            step rerun eagerly (eager semantics): a region's ``diverged`` counts only when the compiled gradients
            diverged too, since compile replays RNG and updates buffers by itself.
        cause: When the compiled step diverged and the same step run eagerly did not (found with ``attribution``):
            ``"compiler_recompute"`` when the divergence repeats from the same state (the compiler's recomputation
            differs, where no eager comparison can see it; the regions whose compiled backward graphs redraw a random
            op instead of replaying the forward's draw get this cause in ``regions`` too), or
            ``"nondeterministic_kernel"`` when the compiled passes differ from themselves run to run. ``None``
            otherwise.
        hint: :data:`~lightning_ckpt_determinism.attribution.CAUSE_HINTS` of ``cause`` (with a note on compiled
            kernels for ``"nondeterministic_kernel"``); ``None`` when ``cause`` is.

    Example::

        >>> report = RecomputationReport(grad_divergence=0.0, max_abs_diff=0.0, diverged=False, tolerance=0.0)
        >>> report.diverged
        False
    """

    grad_divergence: float
    max_abs_diff: float
    diverged: bool
    tolerance: float
    per_parameter: dict[str, float] = field(default_factory=dict)
    worst_parameters: list[tuple[str, float]] = field(default_factory=list)
    error: str | None = None
    checked_regions: list[str] = field(default_factory=list)
    reference_loss: float = math.nan
    checkpointed_loss: float = math.nan
    noise_floor: float = 0.0
    regions: list[RegionReport] = field(default_factory=list)
    buffer_mutations: list[str] = field(default_factory=list)
    compiled: bool = False
    cause: str | None = None
    hint: str | None = None


def gradient_divergence(
    reference: Sequence[torch.Tensor | None], recomputed: Sequence[torch.Tensor | None]
) -> tuple[float, list[float]]:
    """Relative L2 divergence of two gradient sets and the largest absolute difference of each pair.

    ``None`` counts as a zero gradient. NaN in the same place in both, or the same infinity, counts as equal; a
    non-finite value in one only counts as an infinite difference.

    Args:
        reference: Gradients of the reference pass.
        recomputed: Gradients of the pass to compare, in the same order.

    Returns:
        ``(divergence, max_abs_diff_per_tensor)``: the norm of all differences over the norm of the reference
        (``0.0`` when identical, ``inf`` when the reference is zero and the other is not), and one float per pair.

    Raises:
        ValueError: If the sequences differ in length or a pair differs in shape.

    Example::

        >>> gradient_divergence([torch.tensor([3.0, 4.0])], [torch.tensor([3.0, 4.5])])
        (0.1, [0.5])
    """
    if len(reference) != len(recomputed):
        raise ValueError(f"Expected as many gradients on both sides, got {len(reference)} and {len(recomputed)}.")
    diff_sq = 0.0
    ref_sq = 0.0
    max_diffs: list[float] = []
    for position, (ref, other) in enumerate(zip(reference, recomputed, strict=True)):
        pair_diff_sq, pair_ref_sq, pair_max = _pair_difference(position, ref, other)
        diff_sq += pair_diff_sq
        ref_sq += pair_ref_sq
        max_diffs.append(pair_max)
    return _relative(diff_sq, ref_sq), max_diffs


def _pair_difference(position: int, ref: torch.Tensor | None, other: torch.Tensor | None) -> tuple[float, float, float]:
    """``(sum of squared differences, sum of squared finite reference values, max abs difference)`` of one pair,
    ``None`` counting as zeros."""
    if ref is None and other is None:
        return 0.0, 0.0, 0.0
    ref_t = torch.zeros_like(other) if ref is None else ref  # type: ignore[arg-type]
    other_t = torch.zeros_like(ref_t) if other is None else other
    if ref_t.shape != other_t.shape:
        raise ValueError(f"Gradient {position} differs in shape: {tuple(ref_t.shape)} and {tuple(other_t.shape)}.")
    diff = _elementwise_difference(ref_t.detach().double(), other_t.detach().double())
    finite_ref = torch.nan_to_num(ref_t.detach().double(), nan=0.0, posinf=0.0, neginf=0.0)
    return float(diff.square().sum()), float(finite_ref.square().sum()), float(diff.max()) if diff.numel() else 0.0


def _relative(diff_sq: float, ref_sq: float) -> float:
    """The relative L2 divergence from the two sums: ``0.0`` for no difference, ``inf`` over a zero reference."""
    if diff_sq == 0.0:
        return 0.0
    if ref_sq == 0.0 or math.isinf(diff_sq):
        return math.inf
    return math.sqrt(diff_sq / ref_sq)


def check_recomputation(
    module: nn.Module,
    closure: Callable[[], torch.Tensor],
    *,
    tolerance: float = 0.0,
    attribution: bool = False,
    calibrate_noise: bool = False,
    gradients: Literal["autograd", "backward"] = "autograd",
    agree: Callable[[bool], bool] | None = None,
) -> RecomputationReport:
    """Run one step twice, without and with checkpointing, and compare the gradients.

    From one state S the reference pass runs ``closure`` under :func:`checkpointing_disabled` and takes gradients;
    S is restored; the checkpointed pass runs the same way, recomputing inside its backward. S is every random
    stream (torch's CPU and accelerator RNG, Python's ``random``, NumPy), the buffers, torchmetrics states, training
    flags, grad mode and the modules' plain Python attributes (counters, flags, lists: see
    :class:`~lightning_ckpt_determinism._state.StepState`). Afterwards all of it is back at S: training continues as
    if no check had run.

    When ``module`` or a submodule is compiled (``torch.compile`` or ``Module.compile()``), both passes run
    compiled; the reference pass runs with ``torch._functorch.config.activation_memory_budget`` at 1.0 at every
    call, so that it has none of the compiler's own recomputation, and the check catches the compiler's
    recomputation bugs (pytorch#190717). Attribution then reruns the step eagerly under
    ``torch.compiler.set_stance("force_eager")``; a compiled divergence that the eager step does not show gets
    ``cause`` ``"compiler_recompute"``, and one more checkpointed pass, compiled again through a scan of its backward
    graphs (a recompile, once per compiled part), names the regions whose recomputation draws a random op afresh
    instead of replaying its forward's draw: those regions get the cause, with a hint naming the op. Inductor and
    the ``aot_autograd`` backends (``aot_eager`` ...) are scanned; with another backend no region is named.

    An exception raised by the checkpointed pass (torch's ``CheckpointError`` when a recomputed shape differs,
    for example) is reported as a divergence; one raised by the reference pass is re-raised, since it is not
    about recomputation. A check that finds nothing to compare (no gradient reached any parameter, or the
    reference pass gave none where the checkpointed pass did) does not pass: its ``error`` says why, with
    ``diverged`` set and ``grad_divergence`` infinite.

    The check holds one extra set of gradients while it runs, and costs two forward and backward passes.
    ``calibrate_noise`` adds a third (a second reference pass). ``attribution`` observes every op of the
    checkpointed regions in the checkpointed pass: it holds a copy of each op's outputs from the region's forward
    until the region is recomputed in backward (about the regions' activations once more, which is what the
    reference pass holds anyway) plus small fingerprints of op inputs, and the Python-level observation makes that
    pass several times slower. When a region differs in a way only host RNG could explain, one more checkpointed
    pass replays host RNG for it to confirm. Nothing of this outlives the call. How causes are decided is
    described in :mod:`lightning_ckpt_determinism.attribution`.

    Args:
        module: The model; its parameters that require grad are compared.
        closure: Computes and returns a scalar loss from ``module``.
        tolerance: Largest ``grad_divergence`` (relative L2) that still counts as equal.
        attribution: Compare, op by op, every tensor each checkpointed region recomputes with the one its forward
            produced, and fill ``regions`` and ``buffer_mutations`` with where and why they differ.
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

    Returns:
        The :class:`RecomputationReport`.

    Raises:
        ValueError: If ``tolerance`` is negative or ``module`` has no parameter that requires grad.

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
    if not tolerance >= 0.0:
        raise ValueError(f"`tolerance` must be a non-negative float, got {tolerance!r}.")
    if gradients not in ("autograd", "backward"):
        raise ValueError(f"`gradients` can be autograd, backward, got {gradients!r}.")
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError(f"`module` ({type(module).__name__}) has no parameter that requires grad to compare.")
    names = [_region_name(name) for name, _ in named]
    params = [p for _, p in named]
    regions = list(checkpointed_modules(module))
    compiled = is_compiled(module)
    observer = _Attribution(module) if attribution else None
    take = partial(_gradients, closure, params, use_backward=gradients == "backward")
    agreed = agree if agree is not None else bool
    stash = GradientStash(params) if gradients == "backward" else None
    try:
        with _restored_state(module) as restore_between_passes:
            reference_loss, reference = take(disable_checkpointing=True)
            noise_floor = 0.0
            if calibrate_noise:
                restore_between_passes()
                _, second_reference = take(disable_checkpointing=True)
                noise_floor = _NOISE_MARGIN * gradient_divergence(reference, second_reference)[0]
            restore_between_passes()
            checkpointed_loss, recomputed, error = _checkpointed_pass(take, None if compiled else observer)
            eager_diverged = False
            if compiled and observer is not None:
                # The observer sees eager dispatch only: the same step, both passes, rerun eagerly.
                restore_between_passes()
                with eager_semantics():
                    _, eager_reference = take(disable_checkpointing=True)
                    restore_between_passes()
                    _, eager_recomputed, eager_error = _checkpointed_pass(take, observer)
                eager_diverged = eager_error is not None or eager_recomputed is None
                if not eager_diverged:
                    eager_divergence = gradient_divergence(eager_reference, eager_recomputed)[0]  # type: ignore[arg-type]
                    eager_diverged = eager_divergence > max(tolerance, noise_floor)
            explained: frozenset[str] = frozenset()
            suspects = observer.host_rng_suspects() if observer is not None else frozenset()
            if agreed(bool(suspects)):
                # Where this rank has no suspect the pass replays nothing: it runs for the others' collectives.
                restore_between_passes()
                with eager_semantics() if compiled else contextlib.nullcontext():
                    explained = _host_rng_explains(module, take, suspects)
            finding = error if error is not None else _uncomparable(names, reference, recomputed)
            if finding is not None or recomputed is None:
                divergence, max_diffs = math.inf, [math.inf]
                per_parameter: dict[str, float] = {}
            else:
                divergence, max_diffs = gradient_divergence(reference, recomputed)
                per_parameter = dict(zip(names, max_diffs, strict=True))
            diverged = finding is not None or divergence > max(tolerance, noise_floor)
            region_reports, buffer_mutations = (
                observer.reports(gradients_diverged=diverged, host_rng_explained=explained) if observer else ([], [])
            )
            cause = None
            if compiled:
                for region in region_reports:
                    # Eager findings: compile replays RNG and updates buffers itself, so they count where the
                    # compiled step diverged as well.
                    region.diverged = region.diverged and diverged
            compiler_only = (
                compiled
                and observer is not None
                and diverged
                and not eager_diverged
                and not any(r.diverged for r in region_reports)
            )
            if compiled and agreed(compiler_only):
                # A compiler's recomputation bug repeats from the same state; compiled kernels that differ from run
                # to run (inductor's accumulations) do not: both passes once more tell the two apart.
                restore_between_passes()
                _, again_reference = take(disable_checkpointing=True)
                restore_between_passes()
                _, again_recomputed, _ = _checkpointed_pass(take, None)
                repeats = _same_gradients(reference, again_reference) and _same_gradients(recomputed, again_recomputed)
                if compiler_only:
                    cause = "compiler_recompute" if repeats else "nondeterministic_kernel"
                if agreed(compiler_only and repeats):
                    restore_between_passes()
                    _name_redrawing_regions(module, take, region_reports if cause == "compiler_recompute" else [])
    finally:
        if stash is not None:
            stash.put_back()
    worst = sorted(((n, d) for n, d in per_parameter.items() if d > 0.0), key=lambda item: -item[1])
    return RecomputationReport(
        grad_divergence=divergence,
        max_abs_diff=max(max_diffs, default=0.0),
        diverged=diverged,
        tolerance=tolerance,
        per_parameter=per_parameter,
        worst_parameters=worst[:_WORST_PARAMETERS],
        error=None if finding is None else _describe(finding),
        checked_regions=regions,
        reference_loss=reference_loss,
        checkpointed_loss=checkpointed_loss,
        noise_floor=noise_floor,
        regions=region_reports,
        buffer_mutations=buffer_mutations,
        compiled=compiled,
        cause=cause,
        hint=None
        if cause is None
        else CAUSE_HINTS[cause] + _COMPILED_NOISE_NOTE * (cause == "nondeterministic_kernel"),
    )


def _checkpointed_pass(
    take: Callable[..., tuple[float, list[torch.Tensor | None]]], observer: _Attribution | None
) -> tuple[float, list[torch.Tensor | None] | None, Exception | None]:
    """The checkpointed pass, observed when ``observer`` is given: ``(loss, gradients, error)``."""
    observing = observer.observing() if observer is not None else contextlib.nullcontext()
    error: Exception | None = None
    try:
        with observing:
            loss, grads = take(disable_checkpointing=False)
    except Exception as err:  # any failure of recomputation is the finding, not a crash
        error = err
    if observer is not None:
        observer.finish(error)
    if error is not None:
        return math.nan, None, error
    return loss, grads, None


def _name_redrawing_regions(
    module: nn.Module, take: Callable[..., tuple[float, list[torch.Tensor | None]]], regions: list[RegionReport]
) -> None:
    """Mark the regions whose compiled backward graphs redraw a random op: the checkpointed pass once more, compiled
    through the graph scan (a recompile, once per compiled part; none where the audit installed the scan)."""
    with scanned(module) as scan:
        _checkpointed_pass(take, None)
    redraws = scan.regions(checkpointed_modules(module))
    for region in regions:
        if region.name in redraws:
            found = "; ".join(redraw.describe() for redraw in redraws[region.name])
            region.diverged, region.cause = True, "compiler_recompute"
            region.hint = f"{CAUSE_HINTS['compiler_recompute']} In its compiled backward graph, {found}."


def _host_rng_explains(
    module: nn.Module, take: Callable[..., tuple[float, list[torch.Tensor | None]]], suspects: frozenset[str]
) -> frozenset[str]:
    """The suspects whose recomputation matches its forward once their host RNG is replayed."""
    replaying = _Attribution(module, replay_host_rng=suspects)
    _checkpointed_pass(take, replaying)
    return suspects - replaying.diverging_regions()


_COMPILED_NOISE_NOTE = (
    " The compiled step differs from itself run to run (its kernels, such as inductor's accumulations, are not"
    " bitwise reproducible), while the same step run eagerly is exact: check compiled models with a `tolerance`, or"
    " with `calibrate_noise=True`."
)


def _same_gradients(first: list[torch.Tensor | None] | None, second: list[torch.Tensor | None] | None) -> bool:
    return first is not None and second is not None and gradient_divergence(first, second)[0] == 0.0


class _UncomparableGradients(Exception):
    """The check could not compare gradients, so it did not pass."""


def _uncomparable(
    names: list[str], reference: list[torch.Tensor | None], recomputed: list[torch.Tensor | None] | None
) -> _UncomparableGradients | None:
    if recomputed is None:
        return None
    if all(grad is None for grad in (*reference, *recomputed)):
        return _UncomparableGradients(
            "the check could not compare gradients: no parameter received a gradient in either pass; make the loss"
            " depend on the module's parameters"
        )
    missing = [
        name for name, ref, other in zip(names, reference, recomputed, strict=True) if ref is None and other is not None
    ]
    if missing:
        return _UncomparableGradients(
            f"the check could not compare gradients: the reference pass gave no gradient for {missing[:3]}"
            f"{' ...' if len(missing) > 3 else ''} where the checkpointed pass did"
        )
    return None


def _describe(error: Exception) -> str:
    return str(error) if isinstance(error, _UncomparableGradients) else f"{type(error).__name__}: {error}"


def _gradients(
    closure: Callable[[], torch.Tensor],
    params: list[nn.Parameter],
    *,
    disable_checkpointing: bool,
    use_backward: bool,
) -> tuple[float, list[torch.Tensor | None]]:
    context = reference_pass() if disable_checkpointing else contextlib.nullcontext()
    with context, torch.enable_grad():
        loss = closure()
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
        if not use_backward:
            return float(loss.detach()), list(torch.autograd.grad(loss, params, allow_unused=True))
        try:
            loss.backward()
            grads = [None if p.grad is None else local_tensor(p.grad) for p in params]
        finally:
            for param in params:
                param.grad = None
    return float(loss.detach()), grads


@contextlib.contextmanager
def _restored_state(module: nn.Module) -> Iterator[Callable[[], None]]:
    """Snapshot what a step may change; yield a function that puts it back; put it back on exit, always."""
    state = StepState(module)
    try:
        yield state.restore
    finally:
        state.restore()
