"""How the checks compare tensors: gradient divergence and elementwise differences, written once.

NaN in the same place on both sides, or the same infinity, counts as equal; a non-finite value on one side only is an
infinite difference. DTensors are compared as this rank's local shards, so no comparison runs a collective.

Sparse tensors (COO, CSR, CSC, BSR, BSC: an ``nn.Embedding(sparse=True)`` gives a COO gradient) are compared coalesced
in float64, on the union of the elements either side specifies: the figures are those of their dense forms, and no
dense copy is made (a table's gradient is sparse because its dense form is large). A sparse tensor against a strided
one is compared densified. Any other layout (nested, MKL-DNN) cannot be compared: :func:`comparable` says so, and the
checks report it as a finding rather than raise. A wrapper tensor subclass (the gradient of a weight held as one)
is compared through its inner tensors, pair by pair, since its own ops may read only some of them.
"""

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_ckpt_determinism.checkpointing.equality import same_values
from lightning_ckpt_determinism.checkpointing.modules import plain_parts
from lightning_ckpt_determinism.verify.gradients import local_tensor

__all__ = [
    "NOISE_MARGIN",
    "all_finite",
    "comparable",
    "exactly_equal",
    "gradient_divergence",
    "max_abs_difference",
    "pair_difference",
    "relative_divergence",
    "same_values",
    "uncomparable_gradients",
    "worst_parameters",
]

WORST_PARAMETERS = 5
"""How many of the most different parameters a report names."""

NOISE_MARGIN = 2.0
"""The noise floor over the divergence of two reference passes: one sample of the noise, which a second draw (the
checkpointed pass) exceeds about half the time, by a little."""

_SPARSE = frozenset({torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc})


def comparable(tensor: torch.Tensor | None) -> bool:
    """Whether the checks can compare ``tensor``: ``None`` (a zero gradient), a strided tensor or a sparse one in any
    of torch's sparse layouts; not a nested tensor nor one in another layout (MKL-DNN).

    Args:
        tensor: A gradient (this rank's shard of a DTensor).

    Example::

        >>> comparable(torch.ones(2)), comparable(torch.ones(2).to_sparse())
        (True, True)
        >>> comparable(torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]))
        False
    """
    return tensor is None or (tensor.layout is torch.strided and not tensor.is_nested) or tensor.layout in _SPARSE


def uncomparable_gradients(
    names: Sequence[str], first: Sequence[torch.Tensor | None], second: Sequence[torch.Tensor | None]
) -> list[str]:
    """``"name (layout)"`` for each pair of gradients of which one is not :func:`comparable`.

    Args:
        names: The parameters' names.
        first: One pass's gradients, in the order of ``names``.
        second: The other pass's, alike.

    Example::

        >>> nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
        >>> uncomparable_gradients(["a", "b"], [torch.ones(2), nested], [None, None])
        ['b (nested torch.strided)']
    """
    found = []
    for name, *pair in zip(names, first, second, strict=True):
        for grad in pair:
            if grad is not None and not comparable(grad):
                found.append(f"{name} ({'nested ' if grad.is_nested else ''}{grad.layout})")
                break
    return found


def exactly_equal(first: torch.Tensor, second: torch.Tensor) -> bool:
    """``torch.equal`` in every layout :func:`comparable` accepts: sparse tensors by the indices and values of their
    coalesced forms. ``False`` for a sparse tensor against a strided one, or coalesced forms that specify other
    elements (an explicit zero on one side only): the figures of :func:`pair_difference` then say what differs.

    Args:
        first: One tensor.
        second: The other, of the same shape.

    Example::

        >>> exactly_equal(torch.tensor([0.0, 2.0]).to_sparse(), torch.tensor([0.0, 2.0]).to_sparse())
        True
    """
    parts = _paired_parts(first, second)
    if parts is not None:
        return all(exactly_equal(one, other) for one, other in parts)
    if first.layout in _SPARSE and second.layout in _SPARSE:
        first, second = _coalesced(first), _coalesced(second)
        return (
            first.shape == second.shape
            and torch.equal(first.indices(), second.indices())
            and torch.equal(first.values(), second.values())
        )
    return first.layout is second.layout is torch.strided and torch.equal(first, second)


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element of ``tensor`` is finite; a sparse tensor's once coalesced, as its dense form holds them.

    Example::

        >>> all_finite(torch.tensor([1.0, float("inf")]).to_sparse())
        False
    """
    parts = _inner_parts(tensor)
    if parts is not None:
        return all(all_finite(part) for part in parts)
    values = _coalesced(tensor).values() if tensor.layout in _SPARSE else tensor
    return bool(torch.isfinite(values).all())


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

        >>> import torch
        >>> from lightning_ckpt_determinism import gradient_divergence
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
    ``None`` counting as zeros; infinite differences for a pair that is not :func:`comparable` (the checks name it).

    Raises:
        ValueError: If the pair differs in shape (naming ``position``).

    Example::

        >>> pair_difference(0, torch.tensor([0.0, 3.0, 0.0]).to_sparse(), torch.tensor([0.0, 3.0, 4.0]).to_sparse())
        (16.0, 9.0, 4.0)
    """
    if ref is None and other is None:
        return 0.0, 0.0, 0.0
    if not (comparable(ref) and comparable(other)):
        return math.inf, 0.0, math.inf
    ref_t = torch.zeros_like(other) if ref is None else ref  # type: ignore[arg-type]
    other_t = torch.zeros_like(ref_t) if other is None else other
    if ref_t.shape != other_t.shape:
        raise ValueError(f"Gradient {position} differs in shape: {tuple(ref_t.shape)} and {tuple(other_t.shape)}.")
    parts = _paired_parts(ref_t, other_t)
    if parts is not None:
        figures = [pair_difference(position, one, other) for one, other in parts]
        return sum(f[0] for f in figures), sum(f[1] for f in figures), max(f[2] for f in figures)
    ref_values, other_values = (_comparable(values) for values in _aligned(ref_t, other_t))
    diff = elementwise_difference(ref_values, other_values)
    finite_ref = torch.nan_to_num(ref_values, nan=0.0, posinf=0.0, neginf=0.0)
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
    if exactly_equal(expected, actual):
        return 0.0
    expected, actual = _aligned(expected, actual)
    diff = elementwise_difference(_comparable(expected), _comparable(actual))
    return float(diff.max()) if diff.numel() else 0.0


def _inner_parts(tensor: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """A wrapper subclass's inner tensors, when it has several (see
    :func:`~lightning_ckpt_determinism.checkpointing.modules.plain_parts`); ``None`` for a plain tensor and for a
    subclass whose values are out of reach, which is compared through its own ops. A subclass's own ops need not read
    every inner tensor: ``torch.equal`` on torch's ``TwoTensor`` reads its first one only."""
    if type(tensor) is torch.Tensor:
        return None
    parts = plain_parts(tensor)
    return parts if parts is not None and len(parts) > 1 else None


def _paired_parts(first: torch.Tensor, second: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The inner tensors of two wrapper subclasses of one kind, pair by pair (see :func:`_inner_parts`)."""
    if type(first) is not type(second):
        return None
    ones, others = _inner_parts(first), _inner_parts(second)
    if ones is None or others is None or len(ones) != len(others):
        return None
    return list(zip(ones, others, strict=True))


def _comparable(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor.resolve_conj())
    return tensor.to(torch.float64)


def _widened(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(torch.complex128 if tensor.is_complex() else torch.float64)


def _coalesced(tensor: torch.Tensor) -> torch.Tensor:
    """A sparse tensor in coalesced COO form: each element specified once (a copy; ``tensor`` is left as it is)."""
    return (tensor if tensor.layout is torch.sparse_coo else tensor.to_sparse_coo()).coalesce()


def _aligned(ref: torch.Tensor, other: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The elements of two tensors of one shape, in one order: strided ones as they are; two sparse ones as their
    values at the union of the elements either specifies (zero where one does not), so that the figures are those of
    their dense forms without a dense copy; a sparse one against a strided one, or sparse ones split into sparse and
    dense dimensions differently, densified."""
    if ref.layout not in _SPARSE and other.layout not in _SPARSE:
        return ref.detach(), other.detach()
    # Widened first: an uncoalesced gradient (an embedding's, a row per lookup) sums its repeated rows in float64, so
    # that the figures do not hang on the order of a sum rounded at the gradient's own precision.
    ref, other = _widened(ref.detach()), _widened(other.detach())
    if ref.layout not in _SPARSE or other.layout not in _SPARSE:
        return ref.to_dense(), other.to_dense()
    ref, other = _coalesced(ref), _coalesced(other)
    if ref.sparse_dim() != other.sparse_dim():
        return ref.to_dense(), other.to_dense()
    # `sparse_mask` gathers each side's values at the union's indices (in the union's order) rather than computing
    # them, so NaN and infinities reach `elementwise_difference` as the gradients hold them.
    union = (ref + other).coalesce()
    return ref.sparse_mask(union).values(), other.sparse_mask(union).values()
