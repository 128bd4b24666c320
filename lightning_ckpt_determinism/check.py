"""Check that recomputation reproduces the forward: one step's gradients with and without checkpointing.

The engine knows nothing of Lightning. It forks every random stream, runs a reference pass with checkpointing
switched off and a checkpointed pass from the same random state, compares the gradients (obtained with
``torch.autograd.grad``, so no ``.grad`` is touched), and puts back every random stream, buffer, grad mode and
training flag it found, whatever is raised.
"""

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_ckpt_determinism.rng import capture_rng, restore_rng
from lightning_ckpt_determinism.wrapping import checkpointed_modules, checkpointing_disabled

__all__ = ["RecomputationReport", "check_recomputation", "gradient_divergence"]

_WORST_PARAMETERS = 5


@dataclass
class RecomputationReport:
    """What one recomputation check found.

    Attributes:
        grad_divergence: Relative L2 divergence of the gradients: the norm of the difference over all parameters
            divided by the norm of the reference gradients; ``0.0`` when identical, ``inf`` when the
            checkpointed pass failed or produced a non-finite value the reference did not.
        max_abs_diff: Largest absolute difference of any gradient element.
        diverged: Whether ``grad_divergence`` exceeds the tolerance, or the checkpointed pass raised.
        tolerance: The tolerance the verdict used.
        per_parameter: Largest absolute gradient difference for each parameter, by parameter name.
        worst_parameters: The parameters with the largest differences, worst first (at most five, only those
            that differ).
        error: The exception raised during the checkpointed pass (e.g. torch's ``CheckpointError`` when a
            recomputed tensor's shape differs), as ``"Type: message"``; ``None`` when it ran.
        checked_regions: Names of the checkpointed modules the check exercised.
        reference_loss: The loss of the reference pass.
        checkpointed_loss: The loss of the checkpointed pass (``nan`` when it raised before computing one).

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


def _elementwise_difference(ref: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    diff = (ref - other).abs()
    agree = (ref.isnan() & other.isnan()) | (ref.isinf() & (ref == other))
    disagree = ~agree & ~(ref.isfinite() & other.isfinite())
    return diff.masked_fill(agree, 0.0).masked_fill(disagree, math.inf)


def check_recomputation(
    module: nn.Module, closure: Callable[[], torch.Tensor], *, tolerance: float = 0.0
) -> RecomputationReport:
    """Run one step twice, without and with checkpointing, and compare the gradients.

    From one random state S the reference pass runs ``closure`` under :func:`checkpointing_disabled` and takes
    gradients with ``torch.autograd.grad``; S and the module's buffers are restored; the checkpointed pass runs
    the same way, recomputing inside its backward. Afterwards torch's CPU and accelerator RNG, Python's
    ``random`` and NumPy are back at S, and buffers, torchmetrics states, grad mode and training flags are as
    they were: training continues as if no check had run. ``.grad`` is never touched.

    An exception raised by the checkpointed pass (torch's ``CheckpointError`` when a recomputed shape differs,
    for example) is reported as a divergence; one raised by the reference pass is re-raised, since it is not
    about recomputation. Python state a module changes in forward (a counter) is not restored.

    The check holds one extra set of gradients while it runs, and costs two forward and backward passes.

    Args:
        module: The model; its parameters that require grad are compared.
        closure: Computes and returns a scalar loss from ``module``.
        tolerance: Largest ``grad_divergence`` (relative L2) that still counts as equal.

    Returns:
        The :class:`RecomputationReport`.

    Raises:
        ValueError: If ``tolerance`` is negative or ``module`` has no parameter that requires grad.

    Example::

        >>> import torch
        >>> from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 1))
        >>> _ = apply_activation_checkpointing(model, CheckpointingConfig(names=["0", "1"]))
        >>> report = check_recomputation(model, lambda: model(torch.ones(2, 4)).sum())
        >>> report.grad_divergence
        0.0
    """
    if not tolerance >= 0.0:
        raise ValueError(f"`tolerance` must be a non-negative float, got {tolerance!r}.")
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError(f"`module` ({type(module).__name__}) has no parameter that requires grad to compare.")
    names = [name for name, _ in named]
    params = [p for _, p in named]
    regions = list(checkpointed_modules(module))
    with _restored_state(module) as restore_between_passes:
        reference_loss, reference = _gradients(closure, params, disable_checkpointing=True)
        restore_between_passes()
        try:
            checkpointed_loss, recomputed = _gradients(closure, params, disable_checkpointing=False)
        except Exception as err:  # any failure of recomputation is the finding, not a crash
            return RecomputationReport(
                grad_divergence=math.inf,
                max_abs_diff=math.inf,
                diverged=True,
                tolerance=tolerance,
                error=f"{type(err).__name__}: {err}",
                checked_regions=regions,
                reference_loss=reference_loss,
            )
    divergence, max_diffs = gradient_divergence(reference, recomputed)
    per_parameter = dict(zip(names, max_diffs, strict=True))
    worst = sorted(((n, d) for n, d in per_parameter.items() if d > 0.0), key=lambda item: -item[1])
    return RecomputationReport(
        grad_divergence=divergence,
        max_abs_diff=max(max_diffs, default=0.0),
        diverged=divergence > tolerance,
        tolerance=tolerance,
        per_parameter=per_parameter,
        worst_parameters=worst[:_WORST_PARAMETERS],
        checked_regions=regions,
        reference_loss=reference_loss,
        checkpointed_loss=checkpointed_loss,
    )


def _gradients(
    closure: Callable[[], torch.Tensor], params: list[nn.Parameter], *, disable_checkpointing: bool
) -> tuple[float, list[torch.Tensor | None]]:
    context = checkpointing_disabled() if disable_checkpointing else contextlib.nullcontext()
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
        self._entries: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for owner in module.modules():
                for name, buffer in owner._buffers.items():
                    if buffer is not None:
                        self._entries.append((owner, name, buffer, buffer.clone()))

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
