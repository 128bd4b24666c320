"""How attribution decides each region's cause, from the evidence its observer gathered in one pass.

1. the differing op carries ``torch.Tag.nondeterministic_seeded`` (dropout, ``rand*``, ``bernoulli`` ...):
   ``rng_not_preserved``;
2. the same op returned a tensor of another shape or dtype: ``shape_change``;
3. the op received exactly the inputs it had in the forward (tensor fingerprints and every scalar argument equal)
   and still returned other values: ``nondeterministic_kernel``, the kernel differs from itself (with
   ``calibrate_noise`` the engine also measures how much the whole reference pass differs from itself);
4. the region read Python's ``random`` or NumPy's global RNG in its forward (their state moved across it) and a
   targeted re-check, one more checkpointed pass that replays them for that region only, makes the difference go
   away: ``host_rng``;
5. otherwise (other inputs, or another sequence of ops: Python state decided them): ``python_state``.

A region whose recomputation raised without an op having differed first is blamed by the error: torch's
``CheckpointError`` about metadata (raised right after the region's recomputation) gives ``shape_change``, its other
``CheckpointError`` (another number of tensors saved: control flow changed) ``python_state``, and any other error
``recompute_error``, with the error's first line. A region whose recomputation reproduced every compared value but
changed one of its buffers gets ``buffer_mutation``, with the names of those buffers; one whose recomputation wrote
a parameter in place (``embedding_renorm_``) gets ``parameter_write``, with the parameters' names, first.

When a data-dependent op recomputed other outputs than its forward's (routing flipped), the cause stays that of the
first op that differed and the hint adds what keeps the routing.
"""

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from torch.utils.checkpoint import CheckpointError

from lightning_ckpt_determinism.verify.reports import (
    CAUSE_HINTS,
    INPUT_MODIFIED_HINT,
    ROUTING_DROPPED_HINT,
    ROUTING_HINT,
    ROUTING_TOO_LARGE_HINT,
    RegionReport,
    buffer_hint,
    first_line,
)

if TYPE_CHECKING:
    from lightning_ckpt_determinism.verify.attribution.observer import CallRecord

__all__ = ["Divergence", "DivergenceKind", "evidence_cause", "region_reports"]

DivergenceKind = Literal["values", "shape", "structure"]


@dataclass(frozen=True)
class Divergence:
    """The first op of a call whose recomputation differed from its forward.

    Attributes:
        index: Its position among the region's ops, from 0.
        op: Its aten name.
        kind: ``"values"`` (other values), ``"shape"`` (another shape or dtype), ``"structure"`` (another op, or
            more ops than the forward ran).
        random: Whether the op draws random numbers.
        same_inputs: Whether the op received exactly the inputs it had in the forward.
    """

    index: int
    op: str
    kind: DivergenceKind
    random: bool
    same_inputs: bool


def evidence_cause(divergence: Divergence) -> str | None:
    """The cause the differing op itself proves, or ``None`` when host RNG and Python state remain.

    Example::

        >>> evidence_cause(Divergence(3, "aten.native_dropout.default", "values", random=True, same_inputs=True))
        'rng_not_preserved'
    """
    if divergence.kind == "structure":
        return None
    if divergence.random:
        return "rng_not_preserved"
    if divergence.kind == "shape":
        return "shape_change"
    if divergence.same_inputs:
        return "nondeterministic_kernel"
    return None


def region_reports(
    names: Iterable[str],
    calls: list["CallRecord"],
    mutated: Mapping[str, list[str]],
    *,
    gradients_diverged: bool,
    host_rng_explained: frozenset[str],
) -> list[RegionReport]:
    """One :class:`RegionReport` per region, in the order of ``names``, each built once.

    Args:
        names: The checkpointed regions.
        calls: Every observed call of the pass.
        mutated: The buffers recomputation changed, by region.
        gradients_diverged: Whether the check's gradients diverged (a ``nondeterministic_kernel`` counts only then).
        host_rng_explained: The regions whose difference the host-RNG replay made go away.
    """
    return [
        _region_report(
            name,
            [call for call in calls if call.region == name],
            list(mutated.get(name, [])),
            gradients_diverged=gradients_diverged,
            host_rng_explained=name in host_rng_explained,
        )
        for name in names
    ]


def _region_report(
    name: str, calls: list["CallRecord"], buffers: list[str], *, gradients_diverged: bool, host_rng_explained: bool
) -> RegionReport:
    max_abs_diff = max((call.max_abs_diff for call in calls), default=0.0)
    cause = hint = error = first_op = None
    for call in calls:
        cause = _cause(call, host_rng_explained=host_rng_explained)
        if cause is not None:
            hint = (INPUT_MODIFIED_HINT if call.input_modified else CAUSE_HINTS[cause]) + _routing_hint(call)
            error = None if call.error is None else first_line(call.error)
            if call.divergence is not None:
                first_op = (call.divergence.op, call.divergence.index)
            else:
                max_abs_diff = math.inf
            break
    written = sorted({f"{name}.{param}" for call in calls for param in call.parameters_written})
    if cause is None and written:
        cause, hint = "parameter_write", f"{CAUSE_HINTS['parameter_write']} Written: {', '.join(written)}."
    elif cause is None and buffers:
        cause, hint = "buffer_mutation", buffer_hint(buffers)
    return RegionReport(
        name=name,
        ops_compared=sum(call.compared for call in calls),
        max_abs_diff=max_abs_diff,
        first_divergent_op=first_op,
        diverged=cause is not None and (cause != "nondeterministic_kernel" or gradients_diverged),
        cause=cause,
        hint=hint,
        buffer_mutations=buffers,
        error=error,
        recomputations=sum(call.recomputations for call in calls),
        data_dependent_ops=_data_dependent_ops(calls),
    )


def _cause(call: "CallRecord", *, host_rng_explained: bool) -> str | None:
    if call.divergence is None:
        if call.error is None:
            return None
        # torch's metadata mismatch; its other CheckpointError, a different number of saved tensors, comes from
        # control flow that changed, as do errors raised by the region's own code.
        if not isinstance(call.error, CheckpointError):
            return "recompute_error"
        return "shape_change" if "different metadata" in str(call.error) else "python_state"
    found = evidence_cause(call.divergence)
    if found is not None:
        return found
    return "host_rng" if host_rng_explained and call.host_rng_read else "python_state"


def _data_dependent_ops(calls: list["CallRecord"]) -> dict[str, bool]:
    """Each data-dependent op the calls' forwards ran, with whether every call kept its outputs."""
    ops: dict[str, bool] = {}
    for call in calls:
        for op, kept in call.kept.seen if call.kept is not None else []:
            ops[op] = ops.get(op, True) and kept
    return ops


def _routing_hint(call: "CallRecord") -> str:
    """What keeps the routing, when a data-dependent op recomputed other outputs than its forward's."""
    if call.routing_changed is None:
        return ""
    if call.kept is not None and call.kept.keep:
        return ROUTING_TOO_LARGE_HINT.format(op=call.routing_changed)
    if call.kept is not None and call.kept.dropped:
        return ROUTING_DROPPED_HINT.format(op=call.routing_changed)
    return ROUTING_HINT.format(op=call.routing_changed)
