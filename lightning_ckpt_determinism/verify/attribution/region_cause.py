"""How attribution decides each region's cause, from the evidence its observer gathered in one pass.

1. the differing op carries ``torch.Tag.nondeterministic_seeded`` (dropout, ``rand*``, ``bernoulli`` ...) and was
   asked for the same draw as in the forward (its rate, spread and size alike): ``rng_not_preserved``; asked for
   another (a rate a global changed after the forward), it goes on through the rules below, as any op;
2. the same op returned a tensor of another shape or dtype: ``shape_change``;
3. the op received exactly the inputs it had in the forward (tensor fingerprints and every scalar argument equal)
   and still returned other values: ``nondeterministic_kernel``, the kernel differs from itself (with
   ``calibrate_noise`` the engine also measures how much the whole reference pass differs from itself);
4. one of the op's inputs is a parameter of the region whose values changed since the forward (written in place
   in forward, a decay under ``no_grad``): ``parameter_write``; one is a buffer of the region whose values changed
   (InstanceNorm copies its running statistics before use, so the copy differs, not the buffer's write):
   ``buffer_mutation``;
5. the region read Python's ``random`` or NumPy's global RNG in its forward (their state moved across it) and a
   targeted re-check, one more checkpointed pass that replays them for that region only, makes the difference go
   away: ``host_rng``;
6. the recomputation changed the states of a torchmetrics metric inside the region (an update in forward, made
   again): ``metric_update``;
7. otherwise (other inputs, or another sequence of ops: Python state decided them): ``python_state``.

A region whose recomputation raised without an op having differed first is blamed by the error: torch's
``CheckpointError`` about metadata (raised right after the region's recomputation) gives ``shape_change``, its other
``CheckpointError`` (another number of tensors saved: control flow changed) ``python_state``, and any other error
``recompute_error``, with the error's first line. A region whose recomputation reproduced every compared value but
changed one of its buffers gets ``buffer_mutation``, with the names of those buffers; one whose recomputation wrote
a parameter in place with other values gets ``parameter_write``, with the parameters' names, first (a write that
leaves every value as it was, such as a second ``embedding_renorm_`` over rows already within ``max_norm``, is none);
one whose recomputation updated a metric gets ``metric_update``, with the metrics' names.

A region whose compared ops all matched while a tensor it saved differed (a ``"saved"`` divergence: a tensor no op
made, read by the op where torch stopped the recomputation) goes through rules 5 to 7, at that op, the tensor named in
the hint; before rule 6, a call that ran with other tensors in place of its parameters (``functional_call``) gets
``parameter_write``.

When a data-dependent op recomputed other outputs than its forward's (routing flipped), the cause stays that of the
first op that differed and the hint adds what keeps the routing.

The rules read only the :class:`~lightning_ckpt_determinism.verify.attribution.evidence.CallEvidence` the observer
produced: a new cause is a member of :class:`~lightning_ckpt_determinism.verify.cause.Cause` and one rule here.
"""

import math
from collections.abc import Iterable, Mapping, Sequence

from lightning_ckpt_determinism._torch_compat import KEPT_OUTPUT_MUTATED
from lightning_ckpt_determinism.checkpointing.wrapper import KEPT_OUTPUT_WRITTEN_HINT
from lightning_ckpt_determinism.verify.attribution.evidence import CallEvidence, Divergence, RecomputeFailure
from lightning_ckpt_determinism.verify.cause import Cause
from lightning_ckpt_determinism.verify.reports import (
    INPUT_CHANGED_HINT,
    INPUT_MODIFIED_HINT,
    ROUTING_DROPPED_HINT,
    ROUTING_HINT,
    ROUTING_TOO_LARGE_HINT,
    SAVED_DIFFERS_HINT,
    SUBSTITUTED_PARAMETERS_HINT,
    UNREPLAYED_GENERATOR_HINT,
    UNSEEN_WRITE_HINT,
    RegionReport,
    buffer_hint,
)

__all__ = ["evidence_cause", "region_reports"]


def evidence_cause(divergence: Divergence) -> Cause | None:
    """The cause the differing op itself proves, or ``None`` when host RNG and Python state remain.

    Args:
        divergence: The first op of a call that differed.

    Example::

        >>> evidence_cause(Divergence(3, "aten.native_dropout.default", "values", random=True, same_inputs=True))
        'rng_not_preserved'
    """
    if divergence.kind == "structure":
        return None
    if divergence.random and not divergence.draw_changed:
        return Cause.RNG_NOT_PRESERVED
    if divergence.kind == "shape":
        return Cause.SHAPE_CHANGE
    if divergence.same_inputs:
        return Cause.NONDETERMINISTIC_KERNEL
    if divergence.parameter_input:
        return Cause.PARAMETER_WRITE
    if divergence.buffer_input:
        return Cause.BUFFER_MUTATION
    return None


def failure_cause(failure: RecomputeFailure) -> Cause:
    """The cause of a recomputation that failed before any of its ops differed.

    torch's metadata mismatch is a shape that changed; its other ``CheckpointError``, a different number of saved
    tensors, comes from control flow that changed, as do errors raised by the region's own code.

    Args:
        failure: How the recomputation failed.

    Example::

        >>> failure_cause("metadata"), failure_cause("checkpoint"), failure_cause("error")
        ('shape_change', 'python_state', 'recompute_error')
    """
    if failure == "error":
        return Cause.RECOMPUTE_ERROR
    return Cause.SHAPE_CHANGE if failure == "metadata" else Cause.PYTHON_STATE


def call_cause(call: CallEvidence, *, host_rng_explained: bool) -> Cause | None:
    """The cause one call of a region proves: its first differing op's, else its failure's; ``None`` for a call
    that recomputed what its forward produced.

    Args:
        call: What the observer found in the call.
        host_rng_explained: Whether replaying the region's host RNG made its difference go away.

    Example::

        >>> differed = Divergence(2, "aten.add.Tensor", "values", random=False, same_inputs=False)
        >>> call = CallEvidence("blocks.1", divergence=differed, host_rng_read=True)
        >>> call_cause(call, host_rng_explained=True), call_cause(call, host_rng_explained=False)
        ('host_rng', 'python_state')
        >>> metered = CallEvidence("blocks.1", divergence=differed, metrics_updated=("mean",))
        >>> call_cause(metered, host_rng_explained=False)
        'metric_update'
    """
    if call.divergence is None:
        return None if call.failure is None else failure_cause(call.failure)
    found = evidence_cause(call.divergence)
    if found is not None:
        return found
    if host_rng_explained and call.host_rng_read:
        return Cause.HOST_RNG
    if call.divergence.kind == "saved" and call.parameters_substituted:
        # Weights `functional_call` passed in are such tensors: the recomputation reads the module's own.
        return Cause.PARAMETER_WRITE
    return Cause.METRIC_UPDATE if call.metrics_updated else Cause.PYTHON_STATE


def region_reports(
    names: Iterable[str],
    calls: Sequence[CallEvidence],
    mutated: Mapping[str, list[str]],
    *,
    gradients_diverged: bool,
    host_rng_explained: frozenset[str],
) -> list[RegionReport]:
    """One :class:`RegionReport` per region, in the order of ``names``, each built once.

    Args:
        names: The checkpointed regions.
        calls: The evidence of every observed call of the pass.
        mutated: The buffers recomputation changed, by region.
        gradients_diverged: Whether the check's gradients diverged: a cause of values (an op that differed, a
            recomputation that failed) counts only then; a cause that changed state (buffers, parameters,
            metrics) counts whatever the gradients.
        host_rng_explained: The regions whose difference the host-RNG replay made go away.

    Example::

        >>> [report.cause for report in region_reports(["a"], [], {"a": ["a.count"]}, gradients_diverged=False,
        ...                                             host_rng_explained=frozenset())]
        ['buffer_mutation']
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
    name: str, calls: list[CallEvidence], buffers: list[str], *, gradients_diverged: bool, host_rng_explained: bool
) -> RegionReport:
    max_abs_diff = max((call.max_abs_diff for call in calls), default=0.0)
    cause = hint = error = first_op = first_call = None
    written = _names(name, (param for call in calls for param in call.parameters_written))
    metrics = _names(name, (metric for call in calls for metric in call.metrics_updated))
    for position, call in enumerate(calls):
        cause = call_cause(call, host_rng_explained=host_rng_explained)
        if cause is not None:
            first_call = position
            hint = INPUT_MODIFIED_HINT if call.input_modified else _hint(cause, call, buffers, metrics)
            hint += _routing_hint(call)
            error = call.error
            divergence = call.divergence
            if divergence is None:
                max_abs_diff = math.inf
            elif divergence.op is not None:
                first_op = (divergence.op, divergence.index)
            if divergence is not None and divergence.saved is not None:
                hint += f" {SAVED_DIFFERS_HINT.format(saved=divergence.saved)}"
            break
    if cause is None and written:
        cause, hint = Cause.PARAMETER_WRITE, f"{Cause.PARAMETER_WRITE.hint} Written: {', '.join(written)}."
    elif cause is None and buffers:
        cause, hint = Cause.BUFFER_MUTATION, _buffers_hint(buffers, calls)
    elif cause is None and metrics:
        cause, hint = Cause.METRIC_UPDATE, _metric_hint(metrics)
    return RegionReport(
        name=name,
        ops_compared=sum(call.compared for call in calls),
        max_abs_diff=max_abs_diff,
        first_divergent_op=first_op,
        diverged=cause is not None and (gradients_diverged or cause.state_change is not None),
        cause=cause,
        hint=hint,
        buffer_mutations=buffers,
        error=error,
        recomputations=sum(call.recomputations for call in calls),
        data_dependent_ops=_data_dependent_ops(calls),
        calls=len(calls),
        first_divergent_call=first_call,
    )


def _names(region: str, names: Iterable[str]) -> list[str]:
    """``names`` (relative to ``region``) as the model names them, sorted, each once."""
    return sorted({f"{region}.{name}" if region else name for name in names})


def _buffers_hint(buffers: list[str], calls: Sequence[CallEvidence]) -> str:
    """The hint of a ``buffer_mutation`` that changed ``buffers`` (as the model names them): where the region puts its
    buffers back, one whose writes it could not see (it left them exposed to recomputation) is written a way it
    cannot see; one it put back was written by something else run in backward (a nested checkpoint)."""
    protected = any(call.protects_buffers for call in calls)
    exposed = {name for call in calls for name in _names(call.region, call.exposed_buffers)}
    if protected and set(buffers) <= exposed:
        return f"{UNSEEN_WRITE_HINT} Changed: {', '.join(buffers)}."
    return buffer_hint(buffers, protected=protected)


def _metric_hint(metrics: list[str]) -> str:
    return f"{Cause.METRIC_UPDATE.hint} Updated: {', '.join(metrics)}." if metrics else Cause.METRIC_UPDATE.hint


def _hint(cause: Cause, call: CallEvidence, buffers: list[str], metrics: list[str]) -> str:
    """The hint of a cause a call proved, naming the state behind it where the call knows it."""
    if cause == Cause.PYTHON_STATE and call.divergence is not None and call.divergence.region_input:
        return INPUT_CHANGED_HINT
    if cause == Cause.BUFFER_MUTATION and buffers:
        return _buffers_hint(buffers, [call])
    if cause == Cause.BUFFER_MUTATION and call.protects_buffers:
        # A recomputation that read a buffer otherwise, changing none: the region put back what it knew to.
        return UNSEEN_WRITE_HINT
    if cause == Cause.METRIC_UPDATE:
        return _metric_hint(metrics)
    if cause == Cause.PARAMETER_WRITE and call.parameters_substituted:
        return (
            f"{SUBSTITUTED_PARAMETERS_HINT} Substituted: {', '.join(_names(call.region, call.parameters_substituted))}."
        )
    if cause == Cause.PARAMETER_WRITE:
        written = _names(call.region, (*call.parameters_written_in_forward, *call.parameters_written))
        return f"{cause.hint} Written: {', '.join(written)}." if written else cause.hint
    if cause == Cause.RECOMPUTE_ERROR and call.error is not None and KEPT_OUTPUT_MUTATED in call.error:
        return KEPT_OUTPUT_WRITTEN_HINT
    if cause == Cause.RNG_NOT_PRESERVED and call.replays_rng and call.divergence and call.divergence.generator:
        # A generator no module of the region holds is not replayed; one drawing from a replayed generator differs
        # for another reason and keeps the cause's hint.
        return UNREPLAYED_GENERATOR_HINT
    return cause.hint


def _data_dependent_ops(calls: list[CallEvidence]) -> dict[str, bool]:
    """Each data-dependent op the calls' forwards ran, with whether every call kept its outputs."""
    ops: dict[str, bool] = {}
    for call in calls:
        for op, kept in call.data_dependent_ops:
            ops[op] = ops.get(op, True) and kept
    return ops


def _routing_hint(call: CallEvidence) -> str:
    """What keeps the routing, when a data-dependent op recomputed other outputs than its forward's."""
    if call.routing_changed is None:
        return ""
    if call.keep_data_dependent == "on":
        return ROUTING_TOO_LARGE_HINT.format(op=call.routing_changed)
    if call.keep_data_dependent == "unguarded":
        return ROUTING_DROPPED_HINT.format(op=call.routing_changed)
    return ROUTING_HINT.format(op=call.routing_changed)
