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

import torch
from torch import nn

from lightning_ckpt_determinism._compile import eager_semantics, is_compiled, reference_pass
from lightning_ckpt_determinism.attribution import CAUSE_HINTS, RegionReport, _Attribution, _elementwise_difference
from lightning_ckpt_determinism.rng import capture_rng, restore_rng
from lightning_ckpt_determinism.wrapping import _buffer_slots, checkpointed_modules

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
        cause: ``"compiler_recompute"`` when the compiled step diverged and the same step run eagerly did not (found
            with ``attribution``): the compiler's recomputation differs, in a region no eager comparison can name;
            ``None`` otherwise.
        hint: :data:`~lightning_ckpt_determinism.attribution.CAUSE_HINTS` of ``cause``; ``None`` when it is.

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
        if ref is None and other is None:
            max_diffs.append(0.0)
            continue
        ref_t = torch.zeros_like(other) if ref is None else ref  # type: ignore[arg-type]
        other_t = torch.zeros_like(ref_t) if other is None else other
        if ref_t.shape != other_t.shape:
            raise ValueError(f"Gradient {position} differs in shape: {tuple(ref_t.shape)} and {tuple(other_t.shape)}.")
        diff = _elementwise_difference(ref_t.detach().double(), other_t.detach().double())
        finite_ref = torch.nan_to_num(ref_t.detach().double(), nan=0.0, posinf=0.0, neginf=0.0)
        diff_sq += float(diff.square().sum())
        ref_sq += float(finite_ref.square().sum())
        max_diffs.append(float(diff.max()) if diff.numel() else 0.0)
    if diff_sq == 0.0:
        return 0.0, max_diffs
    if ref_sq == 0.0 or math.isinf(diff_sq):
        return math.inf, max_diffs
    return math.sqrt(diff_sq / ref_sq), max_diffs


def check_recomputation(
    module: nn.Module,
    closure: Callable[[], torch.Tensor],
    *,
    tolerance: float = 0.0,
    attribution: bool = False,
    calibrate_noise: bool = False,
) -> RecomputationReport:
    """Run one step twice, without and with checkpointing, and compare the gradients.

    From one random state S the reference pass runs ``closure`` under :func:`checkpointing_disabled` and takes
    gradients with ``torch.autograd.grad``; S and the module's buffers are restored; the checkpointed pass runs
    the same way, recomputing inside its backward. Afterwards torch's CPU and accelerator RNG, Python's
    ``random`` and NumPy are back at S, and buffers, torchmetrics states, grad mode and training flags are as
    they were: training continues as if no check had run. ``.grad`` is never touched.

    When ``module`` or a submodule is compiled (``torch.compile`` or ``Module.compile()``), both passes run
    compiled; the reference pass runs with ``torch._functorch.config.activation_memory_budget`` at 1.0 at every
    call, so that it has none of the compiler's own recomputation, and the check catches the compiler's
    recomputation bugs (pytorch#190717). Attribution then reruns the step eagerly under
    ``torch.compiler.set_stance("force_eager")``; a compiled divergence that the eager step does not show gets
    ``cause`` ``"compiler_recompute"``.

    An exception raised by the checkpointed pass (torch's ``CheckpointError`` when a recomputed shape differs,
    for example) is reported as a divergence; one raised by the reference pass is re-raised, since it is not
    about recomputation. Python state a module changes in forward (a counter) is not restored.

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
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError(f"`module` ({type(module).__name__}) has no parameter that requires grad to compare.")
    names = [name for name, _ in named]
    params = [p for _, p in named]
    regions = list(checkpointed_modules(module))
    compiled = is_compiled(module)
    observer = _Attribution(module) if attribution else None
    with _restored_state(module) as restore_between_passes:
        reference_loss, reference = _gradients(closure, params, disable_checkpointing=True)
        noise_floor = 0.0
        if calibrate_noise:
            restore_between_passes()
            _, second_reference = _gradients(closure, params, disable_checkpointing=True)
            noise_floor = _NOISE_MARGIN * gradient_divergence(reference, second_reference)[0]
        restore_between_passes()
        checkpointed_loss, recomputed, error = _checkpointed_pass(closure, params, None if compiled else observer)
        eager_diverged = False
        if compiled and observer is not None:
            # The observer sees eager dispatch only: the same step, both passes, rerun eagerly.
            restore_between_passes()
            with eager_semantics():
                _, eager_reference = _gradients(closure, params, disable_checkpointing=True)
                restore_between_passes()
                _, eager_recomputed, eager_error = _checkpointed_pass(closure, params, observer)
            eager_diverged = eager_error is not None or eager_recomputed is None
            if not eager_diverged:
                eager_diverged = gradient_divergence(eager_reference, eager_recomputed)[0] > max(tolerance, noise_floor)  # type: ignore[arg-type]
        explained: frozenset[str] = frozenset()
        if observer is not None and observer.host_rng_suspects():
            restore_between_passes()
            with eager_semantics() if compiled else contextlib.nullcontext():
                explained = _host_rng_explains(module, closure, params, observer.host_rng_suspects())
    if error is not None or recomputed is None:
        divergence, max_diffs = math.inf, [math.inf]
        per_parameter: dict[str, float] = {}
    else:
        divergence, max_diffs = gradient_divergence(reference, recomputed)
        per_parameter = dict(zip(names, max_diffs, strict=True))
    diverged = error is not None or divergence > max(tolerance, noise_floor)
    region_reports, buffer_mutations = (
        observer.reports(gradients_diverged=diverged, host_rng_explained=explained) if observer else ([], [])
    )
    cause = None
    if compiled:
        for region in region_reports:
            # Eager findings: compile replays RNG and updates buffers itself, so they count where the compiled step
            # diverged as well.
            region.diverged = region.diverged and diverged
        if observer is not None and diverged and not eager_diverged and not any(r.diverged for r in region_reports):
            cause = "compiler_recompute"
    worst = sorted(((n, d) for n, d in per_parameter.items() if d > 0.0), key=lambda item: -item[1])
    return RecomputationReport(
        grad_divergence=divergence,
        max_abs_diff=max(max_diffs, default=0.0),
        diverged=diverged,
        tolerance=tolerance,
        per_parameter=per_parameter,
        worst_parameters=worst[:_WORST_PARAMETERS],
        error=None if error is None else f"{type(error).__name__}: {error}",
        checked_regions=regions,
        reference_loss=reference_loss,
        checkpointed_loss=checkpointed_loss,
        noise_floor=noise_floor,
        regions=region_reports,
        buffer_mutations=buffer_mutations,
        compiled=compiled,
        cause=cause,
        hint=None if cause is None else CAUSE_HINTS[cause],
    )


def _checkpointed_pass(
    closure: Callable[[], torch.Tensor], params: list[nn.Parameter], observer: _Attribution | None
) -> tuple[float, list[torch.Tensor | None] | None, Exception | None]:
    """The checkpointed pass, observed when ``observer`` is given: ``(loss, gradients, error)``."""
    observing = observer.observing() if observer is not None else contextlib.nullcontext()
    error: Exception | None = None
    try:
        with observing:
            loss, grads = _gradients(closure, params, disable_checkpointing=False)
    except Exception as err:  # any failure of recomputation is the finding, not a crash
        error = err
    if observer is not None:
        observer.finish(error)
    if error is not None:
        return math.nan, None, error
    return loss, grads, None


def _host_rng_explains(
    module: nn.Module, closure: Callable[[], torch.Tensor], params: list[nn.Parameter], suspects: frozenset[str]
) -> frozenset[str]:
    """The suspects whose recomputation matches its forward once their host RNG is replayed."""
    replaying = _Attribution(module, replay_host_rng=suspects)
    _checkpointed_pass(closure, params, replaying)
    return suspects - replaying.diverging_regions()


def _gradients(
    closure: Callable[[], torch.Tensor], params: list[nn.Parameter], *, disable_checkpointing: bool
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
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    return float(loss.detach()), list(grads)


@contextlib.contextmanager
def _restored_state(module: nn.Module) -> Iterator[Callable[[], None]]:
    """Snapshot what a step may change; yield a function that puts it back; put it back on exit, always."""
    devices = {t.device for t in module.parameters()} | {t.device for t in module.buffers()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices.add(torch.device("cuda", torch.cuda.current_device()))
    rng = capture_rng(devices)
    buffers = _BufferSnapshot(module)
    metrics = _MetricSnapshot(module)
    training = {sub: sub.training for sub in module.modules()}
    grad_enabled = torch.is_grad_enabled()

    def restore() -> None:
        restore_rng(rng)
        buffers.restore()
        metrics.restore()
        for sub, mode in training.items():
            sub.training = mode
        torch.set_grad_enabled(grad_enabled)

    try:
        yield restore
    finally:
        restore()


class _BufferSnapshot:
    """The buffer objects of a module and copies of their values."""

    def __init__(self, module: nn.Module) -> None:
        with torch.no_grad():
            self._entries = [
                (owner, key, buffer, buffer.clone()) for owner, key, buffer in _buffer_slots(module).values()
            ]

    def restore(self) -> None:
        with torch.no_grad():
            # Always copied: kernels such as batch_norm update running statistics without bumping `_version`.
            for owner, name, buffer, value in self._entries:
                owner._buffers[name] = buffer
                buffer.copy_(value)


class _MetricSnapshot:
    """States of the torchmetrics metrics inside a module, so a loss closure that updates them changes nothing."""

    def __init__(self, module: nn.Module) -> None:
        from torchmetrics import Metric

        self._entries = [
            (metric, {name: _copy_state(getattr(metric, name)) for name in metric._defaults}, dict(metric.__dict__))
            for metric in module.modules()
            if isinstance(metric, Metric)
        ]

    def restore(self) -> None:
        for metric, states, attributes in self._entries:
            for key in ("_update_count", "_computed", "_forward_cache", "_is_synced", "_cache"):
                if key in attributes:
                    setattr(metric, key, attributes[key])
            for name, value in states.items():
                setattr(metric, name, _copy_state(value))


def _copy_state(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return [_copy_state(item) for item in value]
    return value
