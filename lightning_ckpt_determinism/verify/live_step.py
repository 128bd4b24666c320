"""Check a live training step: its own checkpointed gradients against one reference pass with checkpointing off.

The engine knows nothing of Lightning. The caller captures a :class:`~lightning_ckpt_determinism.verify.state.StepState`
when the step starts (every random stream, buffers, metrics, plain Python attributes), lets the real step run
checkpointed, and after that step's backward calls :func:`check_live_step` with a closure that runs the reference
pass (forward and backward, with checkpointing off, the gradients landing in ``.grad``). The check sets the live
gradients aside, puts the captured state back, runs the reference, compares, and puts the live gradients and the
state after the step back, whatever is raised: training then continues as if no check had run.

Gradients are compared on what this rank holds (whole, replicated or sharded: DTensor gradients are compared shard
by shard) and the sums are reduced over ranks through the ``all_reduce`` callable the caller gives, so the verdict
is the same on every rank. A fast path compares every gradient with ``torch.equal`` (a sparse one by the indices and
values of its coalesced form) and reduces one small vector; only when something differs are the float64 norms
computed. A gradient in a layout the check cannot compare (nested, MKL-DNN) is a finding on every rank, never an
exception.
"""

import math
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from lightning_ckpt_determinism.verify import core
from lightning_ckpt_determinism.verify.compare import (
    all_finite,
    comparable,
    exactly_equal,
    pair_difference,
    relative_divergence,
    uncomparable_gradients,
)
from lightning_ckpt_determinism.verify.gradients import counted_here, set_gradient, take_gradients
from lightning_ckpt_determinism.verify.reports import RecomputationReport, uncomparable_layouts
from lightning_ckpt_determinism.verify.state import StepState

__all__ = ["OTHER_RANKS_STATE", "AllReduce", "GradientComparison", "check_live_step", "compare_gradients"]

OTHER_RANKS_STATE = ("buffers of another rank", "attributes of another rank")
"""What a rank's report names as the buffers (attributes) that changed where only another rank's did: the counts
are reduced over ranks, the names are each rank's own."""

AllReduce = Callable[[torch.Tensor, Literal["sum", "max", "min"]], torch.Tensor]
"""``all_reduce(tensor, op)``: the tensor reduced over every rank with ``op``; the identity on one process."""


def _local_only(tensor: torch.Tensor, op: Literal["sum", "max", "min"]) -> torch.Tensor:
    return tensor


@dataclass
class GradientComparison:
    """Live against reference gradients, over every rank.

    Attributes:
        grad_divergence: Relative L2 divergence over all parameters and ranks (``inf`` when not comparable).
        max_abs_diff: Largest absolute difference of any gradient element on any rank.
        per_parameter: Largest absolute difference per parameter name, over ranks.
        error: Why the gradients could not be compared (no gradient anywhere, or the reference gave none where the
            live step did); ``None`` when they were.
        skipped: The live gradients were not finite on some rank and ``skip_non_finite`` was asked: nothing was
            compared (a GradScaler skips such steps).
        buffers_changed: The most buffers any rank said changed (``buffers_changed`` of :func:`compare_gradients`).
        attributes_changed: The most attributes any rank said changed (``attributes_changed``).
        host_rng_changed: Whether any rank said its host random streams changed (``host_rng_changed``).
        torch_rng_changed: Whether any rank said torch's RNG changed (``torch_rng_changed``).
    """

    grad_divergence: float
    max_abs_diff: float
    per_parameter: dict[str, float]
    error: str | None = None
    skipped: bool = False
    buffers_changed: int = 0
    attributes_changed: int = 0
    host_rng_changed: bool = False
    torch_rng_changed: bool = False


def compare_gradients(
    names: list[str],
    live: list[torch.Tensor | None],
    reference: list[torch.Tensor | None],
    *,
    all_reduce: AllReduce = _local_only,
    counted: list[bool] | None = None,
    skip_non_finite: bool = False,
    device: torch.device | str = "cpu",
    buffers_changed: int = 0,
    attributes_changed: int = 0,
    host_rng_changed: bool = False,
    torch_rng_changed: bool = False,
) -> GradientComparison:
    """Compare two sets of gradients held by this rank, with every sum and maximum reduced over ranks.

    Every rank must call it at once with the same ``names`` (one collective on clean checks, three otherwise).

    Args:
        names: Parameter names, in the order of the gradients.
        live: This rank's live gradients (shards of sharded ones).
        reference: This rank's reference gradients, in the same order.
        all_reduce: Reduces a float64 tensor over ranks (``"sum"`` or ``"max"``).
        counted: For each gradient, whether this rank's values count in the global sums (a replicated shard counts on
            one rank only); all count when ``None``.
        skip_non_finite: Report ``skipped`` when a live gradient holds inf or NaN on any rank.
        device: Where the reduced tensors live (the device the collective backend needs).
        buffers_changed: How many of this rank's buffers differ between the live step and the reference, reduced
            (the most over ranks) in the same collective.
        attributes_changed: How many of this rank's plain attributes differ likewise, reduced alike.
        host_rng_changed: Whether this rank's host random streams ended the two passes in other states, reduced
            alike.
        torch_rng_changed: Whether this rank's torch RNG ended them in other states, reduced alike.

    Returns:
        The :class:`GradientComparison`.

    Example::

        >>> compare_gradients(["w"], [torch.tensor([3.0, 4.5])], [torch.tensor([3.0, 4.0])]).grad_divergence
        0.1
    """
    counted = [True] * len(names) if counted is None else counted
    unequal = 0
    missing = []
    odd_layouts = uncomparable_gradients(names, live, reference)
    elements = 0
    non_finite = False
    for name, live_grad, ref_grad, counts in zip(names, live, reference, counted, strict=True):
        if live_grad is None and ref_grad is None:
            continue
        if counts:
            elements += (live_grad if live_grad is not None else ref_grad).numel()  # type: ignore[union-attr]
        if not (comparable(live_grad) and comparable(ref_grad)):
            continue
        if ref_grad is None:
            missing.append(name)
        elif live_grad is None or not exactly_equal(live_grad, ref_grad):
            unequal += 1
        if skip_non_finite and live_grad is not None and not all_finite(live_grad):
            non_finite = True
    states = float(buffers_changed > 0 or attributes_changed > 0 or host_rng_changed or torch_rng_changed)
    flags = [unequal, len(missing), elements, float(non_finite), states, len(odd_layouts)]
    reduced = all_reduce(torch.tensor(flags, dtype=torch.float64, device=device), "sum").tolist()
    unequal_anywhere, missing_anywhere, elements_anywhere, non_finite_anywhere, states_anywhere, odd_anywhere = reduced
    # The counts themselves are needed only where some rank saw one: never read on a clean check.
    buffers, attributes, host_rng, torch_rng = buffers_changed, attributes_changed, host_rng_changed, torch_rng_changed
    if states_anywhere > 0:
        seen = [float(buffers), float(attributes), float(host_rng), float(torch_rng)]
        most = all_reduce(torch.tensor(seen, device=device), "max").tolist()
        buffers, attributes, host_rng, torch_rng = int(most[0]), int(most[1]), most[2] > 0, most[3] > 0
    zeros = dict.fromkeys(names, 0.0)
    if skip_non_finite and non_finite_anywhere > 0:
        return GradientComparison(0.0, 0.0, zeros, skipped=True)
    error = core.uncomparable(
        missing,
        missing_anywhere=missing_anywhere > 0,
        gradients_anywhere=elements_anywhere > 0,
        live="the live step",
        nowhere="in the live step or the reference pass",
    )
    if error is None and odd_anywhere > 0:
        error = uncomparable_layouts(odd_layouts)
    if error is not None:
        return GradientComparison(
            math.inf,
            math.inf,
            {},
            error=error,
            buffers_changed=buffers,
            attributes_changed=attributes,
            host_rng_changed=host_rng,
            torch_rng_changed=torch_rng,
        )
    if unequal_anywhere == 0:
        return GradientComparison(
            0.0,
            0.0,
            zeros,
            buffers_changed=buffers,
            attributes_changed=attributes,
            host_rng_changed=host_rng,
            torch_rng_changed=torch_rng,
        )
    sums = [0.0, 0.0]
    maxima = []
    for position, (live_grad, ref_grad, counts) in enumerate(zip(live, reference, counted, strict=True)):
        diff_sq, ref_sq, max_diff = pair_difference(position, ref_grad, live_grad)
        if counts:
            sums[0] += diff_sq
            sums[1] += ref_sq
        maxima.append(max_diff)
    total = all_reduce(torch.tensor(sums, dtype=torch.float64, device=device), "sum").tolist()
    per_parameter = all_reduce(torch.tensor(maxima, dtype=torch.float64, device=device), "max").tolist()
    return GradientComparison(
        relative_divergence(total[0], total[1]),
        max(per_parameter, default=0.0),
        dict(zip(names, per_parameter, strict=True)),
        buffers_changed=buffers,
        attributes_changed=attributes,
        host_rng_changed=host_rng,
        torch_rng_changed=torch_rng,
    )


def check_live_step(
    module: nn.Module,
    reference: Callable[[], float],
    entry_state: StepState,
    *,
    parameters: list[tuple[str, torch.Tensor]] | None = None,
    all_reduce: AllReduce = _local_only,
    tolerance: float = 0.0,
    clone_gradients: bool = False,
    gradients_before: list[torch.Tensor | None] | None = None,
    calibrate_noise: bool = False,
    skip_non_finite: bool = False,
    live_loss: float = float("nan"),
    recomputed_in_forward: bool = False,
    read_otherwise: Sequence[str] = (),
    exclude_attributes: Iterable[str] = (),
    internal_attributes: Iterable[str] = (),
    written_parameters: Iterable[str] | None = None,
    written_before_backward: Collection[str] = (),
    backward_drew_host_rng: bool = False,
    backward_drew_torch_rng: bool = False,
    device: torch.device | str = "cpu",
) -> RecomputationReport | None:
    """Compare the gradients the live (checkpointed) step left in ``.grad`` with one reference pass.

    Call it right after the live step's backward, on every rank at once. It captures the state after the step, sets
    the live gradients aside, puts ``entry_state`` back, gives the parameters ``gradients_before`` (what they held
    before the live backward, for accumulation the user does by hand), runs ``reference`` (which must run the forward
    with checkpointing off and the backward, accumulating into ``.grad`` as the live step did: through the same DDP
    or FSDP hooks), compares, and puts the live gradients and the state after the step back, whatever is raised.
    It also compares each buffer after the reference with the same buffer after the live step (one ``torch.equal``
    each): a difference is a divergence of cause ``"buffer_mutation"``, with the buffers' names in
    ``buffer_mutations``, even where the gradients agree. The plain Python attributes of the modules inside
    checkpointed regions are compared alike (``"attribute_mutation"``, ``attribute_mutations``): recomputation that
    repeats a forward's side effect (a list appended to) shows there; the host's random streams moved by the live
    backward (``backward_drew_host_rng``) are ``"host_rng"``. Gradients that diverge after a reference whose
    loss already differs from ``live_loss`` are cause ``"outside_state"``: the forward differed before anything was
    recomputed (with ``calibrate_noise``, only when both reference passes agree on the loss; never where the live
    step recomputed a region before its loss, ``recomputed_in_forward``).

    Args:
        module: The model: the state after the step is captured from it.
        reference: Runs the reference forward and backward; returns its loss.
        entry_state: The state captured when the live step started.
        parameters: The tensors whose gradients are compared, by name; by default the module's parameters that
            require grad.
        all_reduce: Reduces a float64 tensor over ranks; the identity on one process.
        tolerance: Largest ``grad_divergence`` that still counts as equal.
        clone_gradients: Set copies of the live gradients aside instead of the tensors themselves (DDP with
            ``gradient_as_bucket_view=True``, whose buckets the reference backward writes into).
        gradients_before: The gradients the parameters held before the live backward, or ``None`` for none.
        calibrate_noise: Run the reference twice; the noise floor is twice their divergence, and the verdict needs a
            divergence above it.
        skip_non_finite: Return ``None`` when the live gradients hold inf or NaN on any rank (a GradScaler skips
            that step).
        live_loss: The live step's loss, reported as ``checkpointed_loss``.
        recomputed_in_forward: The live step recomputed a region before its loss was computed (a gradient penalty):
            a loss that differs is then no sign of ``"outside_state"``.
        read_otherwise: The buffers the live step's recomputations got with other values than their forwards read
            (see :func:`~lightning_ckpt_determinism.checkpointing.wrapper.buffers_read_otherwise`): where the
            gradients diverged, they are its ``"buffer_mutation"``.
        exclude_attributes: Attribute names never compared on any module (they are still put back), as in
            :func:`~lightning_ckpt_determinism.check_recomputation`: values that legitimately differ.
        internal_attributes: Attribute names the state after the step never captures nor restores (a framework's
            own bookkeeping; see :class:`StepState`).
        written_parameters: Parameters the step writes in place (captured in ``entry_state`` too): their values
            after the step are put back after the reference pass, which writes them again. ``None`` (the default):
            every parameter's value after the step is copied, and put back where the reference wrote it. A parameter
            written in place that ``entry_state`` or these have no copy of is reported in ``not_restored``.
        written_before_backward: Buffers and region attributes, by dotted name, that something the reference does
            not run wrote between the live step's forward and its backward (a Lightning hook): not compared.
        backward_drew_host_rng: The host's random streams moved during the live step's backward, measured by the
            caller from its start to its end, where only the regions' recomputation runs the user's code (a
            reference pass has nothing to recompute, so its backward never moves them): cause ``"host_rng"``.
        backward_drew_torch_rng: torch's RNG moved during the live step's backward, measured alike: a region's
            recomputation drew from it unreplayed (``preserve_rng_state`` off), cause ``"rng_not_preserved"``.
        device: Where the reduced tensors live.

    Returns:
        The :class:`~lightning_ckpt_determinism.RecomputationReport`, or ``None`` when skipped.

    Example::

        >>> from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing
        >>> from lightning_ckpt_determinism import checkpointing_disabled
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 1))
        >>> _ = apply_activation_checkpointing(model, CheckpointingConfig(names=["0", "1"]))
        >>> entry = StepState(model)
        >>> model(torch.ones(2, 4)).sum().backward()  # the live, checkpointed step
        >>> def reference():
        ...     with checkpointing_disabled():
        ...         loss = model(torch.ones(2, 4)).sum()
        ...     loss.backward()
        ...     return float(loss)
        >>> check_live_step(model, reference, entry).grad_divergence
        0.0
    """
    named = parameters if parameters is not None else [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    names = [name for name, _ in named]
    params = [param for _, param in named]
    # Written by the live step without a copy at its start: the reference cannot start from their values.
    not_restored = entry_state.unrestored_parameters()
    with core.CheckScope(
        module,
        params,
        clone_gradients=clone_gradients,
        internal_attributes=internal_attributes,
        written_parameters=written_parameters,
    ) as after_step:
        live = after_step.gradients
        counted = [counted_here(param) for param in params]
        reference_loss, first = _reference_gradients(params, reference, entry_state, gradients_before, clone_gradients)
        # The buffers after the reference (every region plain) against those after the live step: a recomputation
        # that updates them a second time (BatchNorm without `protect_buffers`) changes no gradient but shows here.
        outside = frozenset(written_before_backward)
        changed = [name for name in after_step.state.differing_buffers() if name not in outside]
        attributes = after_step.state.differing_attributes(core.region_modules(module), frozenset(exclude_attributes))
        attributes = [name for name in attributes if name not in outside]
        calibration = core.Calibration()
        if calibrate_noise:
            calibration = core.calibrate(
                reference_loss,
                first,
                lambda: _reference_gradients(params, reference, entry_state, gradients_before, clone_gradients),
                lambda once, again: (
                    compare_gradients(
                        names, again, once, all_reduce=all_reduce, counted=counted, device=device
                    ).grad_divergence
                ),
            )
        noise_floor = calibration.noise_floor
        comparison = compare_gradients(
            names,
            live,
            first,
            all_reduce=all_reduce,
            counted=counted,
            skip_non_finite=skip_non_finite,
            device=device,
            buffers_changed=len(changed),
            attributes_changed=len(attributes),
            # A region that drew from the host's streams again in its recomputation (a NumPy seed and draw in
            # forward) left them otherwise than the same step without checkpointing, with exact values.
            host_rng_changed=backward_drew_host_rng,
            torch_rng_changed=backward_drew_torch_rng,
        )
        not_restored += [name for name in after_step.unrestored() if name not in not_restored]
    if comparison.skipped:
        return None
    evidence = core.StepEvidence(
        gradients_diverged=core.gradients_diverge(
            comparison.grad_divergence, tolerance, noise_floor, error=comparison.error
        ),
        reference_loss=reference_loss,
        checkpointed_loss=live_loss,
        recomputed_in_forward=recomputed_in_forward,
        read_otherwise=read_otherwise,
        calibration=calibration,
        not_restored=not_restored,
        # The counts are the most over ranks; the names this rank's own.
        step_buffers=(changed or [OTHER_RANKS_STATE[0]]) if comparison.buffers_changed else [],
        step_attributes=(attributes or [OTHER_RANKS_STATE[1]]) if comparison.attributes_changed else [],
        step_host_rng=comparison.host_rng_changed,
        step_torch_rng=comparison.torch_rng_changed,
    )
    return core.step_report(
        evidence,
        grad_divergence=comparison.grad_divergence,
        max_abs_diff=comparison.max_abs_diff,
        per_parameter=comparison.per_parameter,
        error=comparison.error,
        tolerance=tolerance,
        buffer_mutations=changed,
        attribute_mutations=attributes,
    )


def _reference_gradients(
    params: list[torch.Tensor],
    reference: Callable[[], float],
    entry_state: StepState,
    gradients_before: list[torch.Tensor | None] | None,
    keep_copies: bool,
) -> tuple[float, list[torch.Tensor | None]]:
    """Run the reference from the captured state and return its gradients (copies where the storage is reused)."""
    entry_state.restore()
    with torch.no_grad():
        for position, param in enumerate(params):
            before = None if gradients_before is None else gradients_before[position]
            set_gradient(param, None if before is None else before.clone())
    loss = reference()
    return loss, take_gradients(params, clone=keep_copies)
