"""How the checks compare tensors: gradient divergence and elementwise differences, written once.

NaN in the same place on both sides, or the same infinity, counts as equal; a non-finite value on one side only is an
infinite difference. DTensors are compared as this rank's local shards, so no comparison runs a collective.
"""

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_ckpt_determinism.checkpointing.equality import same_values
from lightning_ckpt_determinism.verify.gradients import local_tensor

__all__ = [
    "NOISE_MARGIN",
    "WORST_PARAMETERS",
    "elementwise_difference",
    "gradient_divergence",
    "max_abs_difference",
    "pair_difference",
    "relative_divergence",
    "same_values",
    "worst_parameters",
]

WORST_PARAMETERS = 5
"""How many of the most different parameters a report names."""

NOISE_MARGIN = 2.0
"""The noise floor over the divergence of two reference passes: one sample of the noise, which a second draw (the
checkpointed pass) exceeds about half the time, by a little."""


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
        pair_diff_sq, pair_ref_sq, pair_max = pair_difference(position, ref, other)
        diff_sq += pair_diff_sq
        ref_sq += pair_ref_sq
        max_diffs.append(pair_max)
    return relative_divergence(diff_sq, ref_sq), max_diffs


def pair_difference(position: int, ref: torch.Tensor | None, other: torch.Tensor | None) -> tuple[float, float, float]:
    """``(sum of squared differences, sum of squared finite reference values, max abs difference)`` of one pair,
    ``None`` counting as zeros.

    Raises:
        ValueError: If the pair differs in shape (naming ``position``).
    """
    if ref is None and other is None:
        return 0.0, 0.0, 0.0
    ref_t = torch.zeros_like(other) if ref is None else ref  # type: ignore[arg-type]
    other_t = torch.zeros_like(ref_t) if other is None else other
    if ref_t.shape != other_t.shape:
        raise ValueError(f"Gradient {position} differs in shape: {tuple(ref_t.shape)} and {tuple(other_t.shape)}.")
    diff = elementwise_difference(ref_t.detach().double(), other_t.detach().double())
    finite_ref = torch.nan_to_num(ref_t.detach().double(), nan=0.0, posinf=0.0, neginf=0.0)
    return float(diff.square().sum()), float(finite_ref.square().sum()), float(diff.max()) if diff.numel() else 0.0


def relative_divergence(diff_sq: float, ref_sq: float) -> float:
    """The relative L2 divergence from the two sums: ``0.0`` for no difference, ``inf`` over a zero reference.

    Example::

        >>> relative_divergence(1.0, 4.0)
        0.5
    """
    if diff_sq == 0.0:
        return 0.0
    if ref_sq == 0.0 or math.isinf(diff_sq):
        return math.inf
    return math.sqrt(diff_sq / ref_sq)


def worst_parameters(per_parameter: Mapping[str, float]) -> list[tuple[str, float]]:
    """The parameters that differ, worst first, at most :data:`WORST_PARAMETERS` of them.

    Example::

        >>> worst_parameters({"a": 0.0, "b": 2.0, "c": 1.0})
        [('b', 2.0), ('c', 1.0)]
    """
    differing = sorted(((name, diff) for name, diff in per_parameter.items() if diff > 0.0), key=lambda item: -item[1])
    return differing[:WORST_PARAMETERS]


def elementwise_difference(ref: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``|ref - other|``, with NaN in both or the same infinity counting as equal and a lone non-finite as ``inf``.

    Example::

        >>> elementwise_difference(torch.tensor([1.0, float("nan")]), torch.tensor([1.5, float("nan")]))
        tensor([0.5000, 0.0000])
    """
    diff = (ref - other).abs()
    agree = (ref.isnan() & other.isnan()) | (ref.isinf() & (ref == other))
    disagree = ~agree & ~(ref.isfinite() & other.isfinite())
    return diff.masked_fill(agree, 0.0).masked_fill(disagree, math.inf)


def max_abs_difference(expected: Any, actual: Any) -> float:
    """The largest absolute difference of two tensors (or two Python scalars); ``inf`` for a tensor against none.

    Example::

        >>> max_abs_difference(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))
        0.5
    """
    if not isinstance(expected, torch.Tensor):
        if expected == actual or (expected != expected and actual != actual):
            return 0.0
        return float(abs(expected - actual))
    if not isinstance(actual, torch.Tensor):
        return math.inf
    expected, actual = local_tensor(expected), local_tensor(actual)
    if torch.equal(expected, actual):
        return 0.0
    diff = elementwise_difference(_comparable(expected), _comparable(actual))
    return float(diff.max()) if diff.numel() else 0.0


def _comparable(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    return tensor.to(torch.float64)
