"""What attribution's observer found in one call of a region: the frozen evidence the cause rules read.

The observer (:mod:`~lightning_ckpt_determinism.verify.attribution.observer`) produces it; the rules
(:mod:`~lightning_ckpt_determinism.verify.attribution.region_cause`) decide a cause from it alone, so neither imports
the other's internals.
"""

from dataclasses import dataclass
from typing import Literal

__all__ = ["CallEvidence", "Divergence", "DivergenceKind", "KeepDataDependent", "RecomputeFailure"]

DivergenceKind = Literal["values", "shape", "structure", "saved"]

RecomputeFailure = Literal["metadata", "checkpoint", "error"]
"""How a region's recomputation failed: torch's ``CheckpointError`` about metadata (a recomputed tensor of another
shape or dtype), its other ``CheckpointError`` (another number of tensors saved), or any other error."""

KeepDataDependent = Literal["on", "unguarded", "off"]
"""``keep_data_dependent`` for a call: on, on without the region's guard (its first forward ran no data-dependent
op), or off."""


@dataclass(frozen=True)
class Divergence:
    """The first op of a call whose recomputation differed from its forward.

    Attributes:
        index: Its position among the region's ops, from 0.
        op: Its aten name; ``None`` for a ``"saved"`` difference found after the region's last op.
        kind: ``"values"`` (other values), ``"shape"`` (another shape or dtype), ``"structure"`` (another op, or
            more ops than the forward ran), ``"saved"`` (every op compared matched, but a tensor the region saved
            differed: the op at ``index``, where torch's early stop ended the recomputation after saving its inputs,
            read it; a tensor no op made, such as ``torch.from_numpy`` of a fresh NumPy draw).
        random: Whether the op draws random numbers.
        same_inputs: Whether the op received exactly the inputs it had in the forward.
        buffer_input: Whether one of the region's buffers, among the op's inputs, held other values than in the
            forward (running statistics the forward updated, read again by recomputation).
        parameter_input: Whether one of the region's parameters, among the op's inputs, held other values than in the
            forward (a parameter written in place since).
        saved: For a ``"saved"`` difference, the tensor that differed, as the sentinel describes it.
        region_input: Whether one of the region's own inputs, among the op's inputs, held other values than in the
            forward: what recomputation started from was not what the forward received (saved-tensor hooks around
            the region that give back other values than they were given, a write through ``.data``).
        generator: Whether the op was given a ``torch.Generator`` to draw from that no module of the region holds
            (one the region does not replay).
        draw_changed: Whether a random op was asked for another draw than in the forward: one of its arguments other
            than tensors and generators (a dropout rate, a spread, a size) differs, so Python state decided it.

    Example::

        >>> Divergence(3, "aten.native_dropout.default", "values", random=True, same_inputs=True).op
        'aten.native_dropout.default'
    """

    index: int
    op: str | None
    kind: DivergenceKind
    random: bool
    same_inputs: bool
    buffer_input: bool = False
    parameter_input: bool = False
    saved: str | None = None
    region_input: bool = False
    generator: bool = False
    draw_changed: bool = False


@dataclass(frozen=True)
class CallEvidence:
    """What one observed call of a region showed, once its pass ended.

    Attributes:
        region: The region's name.
        compared: How many recomputed ops were compared with the forward's.
        max_abs_diff: The largest difference of a compared op's outputs.
        recomputations: How many times the call was recomputed.
        divergence: The first op that differed; ``None`` when none did.
        failure: How its recomputation failed; ``None`` when it did not.
        error: The first line of that failure's error, as ``"Type: message"``.
        input_modified: Whether an input it saved was modified in place after its forward (torch's version-counter
            error).
        host_rng_read: Whether its forward read Python's or NumPy's global RNG.
        routing_changed: The data-dependent op whose recomputation returned other outputs than its forward's.
        keep_data_dependent: Whether ``keep_data_dependent`` kept such outputs, see :data:`KeepDataDependent`.
        data_dependent_ops: Each data-dependent op its forward ran, with whether its outputs were kept.
        parameters_written: The parameters (relative to the region) its recomputation wrote in place, changing
            their values.
        parameters_written_in_forward: The parameters (relative to the region) its forward wrote in place, changing
            their values.
        metrics_updated: The torchmetrics metrics inside the region (relative to it) whose states its recomputation
            changed.
        protects_buffers: Whether the region puts its buffers back around each recomputation (``protect_buffers``).
        replays_rng: Whether the region replays torch's generators in recomputation (``preserve_rng_state``).
        parameters_substituted: The parameters (relative to the region) its forward found held by other tensors than
            its recomputation did (``torch.func.functional_call``).
        exposed_buffers: The buffers (relative to the region) whose live values its recomputations could change: none
            it puts back (see :class:`~lightning_ckpt_determinism.checkpointing.wrapper.RegionCall`).

    Example::

        >>> CallEvidence("blocks.1", compared=7).divergence is None
        True
    """

    region: str
    compared: int = 0
    max_abs_diff: float = 0.0
    recomputations: int = 0
    divergence: Divergence | None = None
    failure: RecomputeFailure | None = None
    error: str | None = None
    input_modified: bool = False
    host_rng_read: bool = False
    routing_changed: str | None = None
    keep_data_dependent: KeepDataDependent = "off"
    data_dependent_ops: tuple[tuple[str, bool], ...] = ()
    parameters_written: tuple[str, ...] = ()
    parameters_written_in_forward: tuple[str, ...] = ()
    metrics_updated: tuple[str, ...] = ()
    protects_buffers: bool = False
    replays_rng: bool = False
    parameters_substituted: tuple[str, ...] = ()
    exposed_buffers: frozenset[str] = frozenset()
