"""Per-region attribution: compare what each checkpointed region recomputes with what its forward produced, and why.

While a check's checkpointed pass runs, every checkpointed region is observed through the hook
:mod:`~lightning_ckpt_determinism.wrapping` offers (``_observing``): in the original forward a dispatch mode
records each aten op with a copy of its outputs and a fingerprint of its inputs; during recomputation, inside
backward, a second dispatch mode compares each recomputed op with the recorded one as soon as it runs, then lets
the copy go. Recomputation stops early (once every saved tensor is back) and detaches its inputs, so the two op
sequences are aligned on what both ran: ``aten.detach`` is left out of both, and comparison stops where
recomputation stopped. Views and ops that return uninitialised memory (``empty_like`` ...) are compared by shape
only, and ops that update the region's own buffers are left to the buffer check.

How the cause of a region's first difference is decided, from evidence gathered in the pass:

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
``recompute_error``, with the error's first line. torch checks the version counters of a region's saved inputs before
it enters the region's recompute context, so an input modified in place after the forward is found by comparing the
versions the observer recorded at the forward with the inputs' versions when the pass failed. A region whose
recomputation reproduced every compared value but changed one of its buffers (compared at the end of the pass with
their values after the region's last forward) gets ``buffer_mutation``, with the names of those buffers.

Data-dependent ops (``topk``, ``nonzero``, ``bincount``, ``.item()`` ..., the rule of
:mod:`~lightning_ckpt_determinism._data_dependent`) are listed per region with whether ``keep_data_dependent`` kept
their outputs. When one of them recomputed other outputs than its forward's (routing flipped), the cause stays that
of the first op that differed (a drifting router is ``nondeterministic_kernel``, a metadata error ``shape_change``)
and the hint adds what keeps the routing.

A region recomputed more than once in a pass (a gradient penalty, a backward with ``retain_graph=True``) is compared
op by op at its first recomputation; the later ones replay the same state, are counted in
``RegionReport.recomputations`` and are not compared, so they are never reported as a difference by themselves.
"""

import contextlib
import logging
import math
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from types import MappingProxyType
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.checkpoint import CheckpointError, _StopRecomputationError

from lightning_ckpt_determinism._data_dependent import KeptOutputs, is_data_dependent
from lightning_ckpt_determinism._grads import local_tensor
from lightning_ckpt_determinism.rng import HostRNGState, capture_host_rng, restore_host_rng
from lightning_ckpt_determinism.wrapping import _buffer_slots, _observing, checkpointed_modules

__all__ = ["CAUSE_HINTS", "RegionReport"]

_log = logging.getLogger(__name__)

CAUSE_HINTS: Mapping[str, str] = MappingProxyType(
    {
        "rng_not_preserved": (
            "A random op draws other numbers in recomputation: set `preserve_rng_state=True` in the"
            " `CheckpointingConfig`, and draw from torch's default generators (a generator of your own is not"
            " replayed)."
        ),
        "host_rng": (
            "The forward reads Python's `random` or NumPy's global RNG: set `preserve_host_rng=True` in the"
            " `CheckpointingConfig`, or draw from torch's RNG instead."
        ),
        "buffer_mutation": (
            "Recomputation updates the region's buffers a second time (BatchNorm statistics, counters): set"
            " `protect_buffers=True` in the `CheckpointingConfig`."
        ),
        "shape_change": (
            "A shape in the region depends on something that changed between forward and recomputation: make it a"
            " function of the region's inputs only, or leave this module out of checkpointing."
        ),
        "python_state": (
            "The forward reads state that changed before recomputation (a Python counter or flag, or a buffer the"
            " forward itself updates, such as a step count): compute it outside the checkpointed module and pass it"
            " in, or change it only outside forward."
        ),
        "nondeterministic_kernel": (
            "A kernel returned other values for the same inputs: call `torch.use_deterministic_algorithms(True)`,"
            " or check with `calibrate_noise=True` so that differences within the noise floor are tolerated."
        ),
        "recompute_error": (
            "Recomputing the region raised an error its forward did not (see `error`): make the region's code"
            " depend only on its inputs, or leave this module out of checkpointing."
        ),
        "compiler_recompute": (
            "The compiled step diverges and the same step run eagerly does not: the compiler's own recomputation"
            " differs from its forward. Known triggers: `torch._functorch.config.activation_memory_budget` below 1"
            " (random ops redrawn, pytorch#190717), inductor's `fallback_random` with `reorder_for_peak_memory`"
            " (dropout masks reordered), and reductions compiled differently for the recomputation. Fixes: set the"
            " budget to 1.0, mark the random ops `CheckpointPolicy.MUST_SAVE` in a selective-checkpointing policy,"
            " or, against the budget's redraws, `torch._inductor.config.fallback_random = True` without"
            " `reorder_for_peak_memory`."
        ),
    }
)
"""The catalogue of causes: each ``RegionReport.cause`` key and the hint reports give for it.

Example::

    >>> sorted(CAUSE_HINTS)[:2]
    ['buffer_mutation', 'host_rng']
"""

_ROUTING_HINT = (
    " The routing changed too: the data-dependent op {op} recomputed other outputs than its forward's; set"
    " `keep_data_dependent: true` in the `CheckpointingConfig` to keep such outputs from the forward."
)
_ROUTING_TOO_LARGE_HINT = (
    " The routing changed too: the data-dependent op {op} recomputed other outputs than its forward's, and"
    " `keep_data_dependent` recomputes it because its floating outputs are larger than the region's largest input;"
    " make them smaller (route on fewer values) or compute them outside the checkpointed module."
)

_ROUTING_DROPPED_HINT = (
    " The routing changed too: the data-dependent op {op} recomputed other outputs than its forward's."
    " `keep_data_dependent` is on, but this region's first checkpointed forward ran no data-dependent op, so its"
    " guard was not installed; this check saw it route and installed it for the following steps. A region that"
    " routes only after a warm-up should route from its first step to be guarded from the start."
)
_INPUT_MODIFIED_HINT = (
    "An input the region received was modified in place after the forward saved it for recomputation, by an"
    " in-place op in the region (such as `nn.ReLU(inplace=True)` on its input) or by code after it: torch found its"
    " version counter changed when it came to recompute the region. Use the out-of-place op (`inplace=False`), or"
    " modify a copy (`x = x.clone()` first)."
)

# Collectives and their waits: their outputs are filled by another process (asynchronously, until `wait`), and their
# arguments hold process groups. Never recorded nor compared: a collective's result is compared where it is consumed.
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional"})
_UNINITIALISED = frozenset({"empty", "empty_like", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided"})
_BITS_BY_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_Kind = Literal["values", "shape", "structure"]


@dataclass
class RegionReport:
    """What one checkpointed region's recomputation did, compared with its original forward.

    Attributes:
        name: The region's module name, relative to the module the check ran on.
        ops_compared: How many recomputed ops were matched with the forward's and compared (values, or shapes for
            views and uninitialised memory), over every call of the region in the step.
        max_abs_diff: Largest absolute difference of any recomputed tensor from the forward's (``inf`` when a
            shape or the sequence of ops changed).
        first_divergent_op: The first op that differed, as ``(aten name, position among the region's ops from
            0)``; ``None`` when none did.
        diverged: Whether the difference counts against the verdict: always when ``cause`` is set, except that a
            ``"nondeterministic_kernel"`` only counts when the gradients diverge beyond the tolerance and the
            noise floor.
        cause: A key of :data:`CAUSE_HINTS` when recomputation did not reproduce the forward; ``None`` when it
            reproduced every compared value and buffer exactly.
        hint: What to change, for people: :data:`CAUSE_HINTS` of ``cause`` followed by what was found (the
            buffers changed), or, for an input modified in place after the forward, a hint of its own; ``None``
            when ``cause`` is.
        buffer_mutations: The names of the buffers of the region that recomputation changed.
        error: With ``cause`` ``"recompute_error"`` (or an error that decided another cause), the first line of the
            exception raised while the region was recomputed, as ``"Type: message"``; ``None`` otherwise.
        recomputations: How many times the region was recomputed in the pass, over all its calls. More
            recomputations than calls come from a gradient penalty or ``retain_graph=True``; only the first
            recomputation of each call is compared.
        data_dependent_ops: The data-dependent ops the region's forward ran (aten name), each with whether
            ``keep_data_dependent`` (or ``save_ops``) kept its outputs from the forward at every call; ``False``
            when they were recomputed (the option is off, or their floating outputs exceed the size rule).

    Example::

        >>> region = RegionReport(name="model.blocks.1", ops_compared=7)
        >>> region.diverged, region.cause
        (False, None)
    """

    name: str
    ops_compared: int = 0
    max_abs_diff: float = 0.0
    first_divergent_op: tuple[str, int] | None = None
    diverged: bool = False
    cause: str | None = None
    hint: str | None = None
    buffer_mutations: list[str] = field(default_factory=list)
    error: str | None = None
    recomputations: int = 0
    data_dependent_ops: dict[str, bool] = field(default_factory=dict)


@dataclass(frozen=True)
class _Fingerprint:
    """A tensor input, identified by metadata and two integer sums of its bit pattern (one weighted by position)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    sums: torch.Tensor | None

    def same_as(self, other: object) -> bool:
        if not isinstance(other, _Fingerprint) or self.sums is None or other.sums is None:
            return False
        if (self.shape, self.dtype) != (other.shape, other.dtype) or self.sums.device != other.sums.device:
            return False
        return torch.equal(self.sums, other.sums)


@dataclass
class _Op:
    """One op of a region's forward: its input fingerprints, and its outputs (copies of tensors, Python scalars as
    they are, ``None`` where not compared by value) with their metadata."""

    func: torch._ops.OpOverload
    inputs: list[Any]
    outputs: list[Any]
    metadata: list[Any]
    data_dependent: bool = False


@dataclass(frozen=True)
class _Divergence:
    index: int
    op: str
    kind: _Kind
    random: bool
    same_inputs: bool


@dataclass
class _Call:
    """One call of a checkpointed region: its recorded forward and how its recomputation compared."""

    region: str
    module: nn.Module
    ops: list[_Op] = field(default_factory=list)
    buffer_ids: frozenset[int] = frozenset()
    host_rng_before: HostRNGState | None = None
    host_rng_read: bool = False
    buffers_after_forward: list[tuple[str, nn.Module, str, torch.Tensor]] = field(default_factory=list)
    input_versions: list[tuple[weakref.ref[torch.Tensor], int]] = field(default_factory=list)
    cursor: int = 0
    compared: int = 0
    max_abs_diff: float = 0.0
    divergence: _Divergence | None = None
    recomputations: int = 0
    error: BaseException | None = None
    input_modified: bool = False
    kept: KeptOutputs | None = None
    routing_changed: str | None = None
    abandoned: str | None = None
    uncomparable: set[str] = field(default_factory=set)

    @contextlib.contextmanager
    def contained(self, stage: str) -> Iterator[None]:
        """Keep a failure of the observer's own bookkeeping out of the pass it observes.

        The observer runs inside the region's forward and, in backward, inside its recomputation: an exception of
        its own would abort this rank's backward while the other ranks wait for it in their next collective. The
        call is no longer observed instead (nothing more of it is compared), and the failure is logged.
        """
        try:
            yield
        except Exception as err:
            self.abandoned = f"{type(err).__name__}: {err}"
            self.release()
            _log.warning(
                "lightning_ckpt_determinism: attribution stopped observing region `%s` while %s its op %d (%s); the"
                " region's ops from there on are not compared.",
                self.region,
                stage,
                self.cursor,
                self.abandoned,
            )

    def signature(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
        """The op's arguments as they are compared: tensors by fingerprint (of this rank's shard of a DTensor)."""
        return [_fingerprint(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in _flatten([args, kwargs])]

    def same_inputs(self, recorded: list[Any], seen: list[Any]) -> bool:
        """Whether an op got the inputs it had in the forward; an argument that cannot be compared counts as equal
        (its type is noted)."""
        if len(recorded) != len(seen):
            return False
        for expected, actual in zip(recorded, seen, strict=True):
            if isinstance(expected, _Fingerprint):
                if not expected.same_as(actual):
                    return False
            elif (
                isinstance(actual, _Fingerprint)
                or type(expected) is not type(actual)
                or not self._equal_arguments(expected, actual)
            ):
                return False
        return True

    def _equal_arguments(self, expected: Any, actual: Any) -> bool:
        try:
            return bool(expected == actual)
        except Exception:  # an opaque object (a process group, a script object) without a usable `==`
            self.uncomparable.add(type(expected).__qualname__)
            return True

    def record(self, func: torch._ops.OpOverload, inputs: list[Any], args: Any, kwargs: Any, out: Any) -> None:
        outputs = _flatten(out)
        compare_values = func.overloadpacket.__name__ not in _UNINITIALISED and not self._writes_buffer(
            func, args, kwargs
        )
        views = _returns_views(func, len(outputs))
        self.ops.append(
            _Op(
                func=func,
                inputs=inputs,
                outputs=[
                    _recorded(value) if compare_values and not view else None
                    for value, view in zip(outputs, views, strict=True)
                ],
                metadata=[_metadata(value) for value in outputs],
                data_dependent=is_data_dependent(func, args),
            )
        )

    def compare(self, func: torch._ops.OpOverload, inputs: list[Any] | None, out: Any) -> None:
        index = self.cursor
        self.cursor += 1
        if self.divergence is not None and self.divergence.kind == "structure":
            return
        if index >= len(self.ops) or self.ops[index].func != func:
            name = str(self.ops[index].func) if index < len(self.ops) else str(func)
            self._diverge(index, name, "structure", random=False, same_inputs=False, diff=math.inf)
            self.release()
            return
        recorded = self.ops[index]
        self.compared += 1
        outputs = _flatten(out)
        kind: _Kind | None = None
        diff = 0.0
        if [_metadata(value) for value in outputs] != recorded.metadata:
            kind, diff = "shape", math.inf
        else:
            for expected, actual in zip(recorded.outputs, outputs, strict=True):
                if expected is not None:
                    diff = max(diff, _max_abs_difference(expected, actual))
            if diff > 0.0:
                kind = "values"
        same_inputs = kind is not None and inputs is not None and self.same_inputs(recorded.inputs, inputs)
        recorded.outputs, recorded.inputs = [], []
        if kind is None:
            return
        if recorded.data_dependent and self.routing_changed is None:
            self.routing_changed = str(func)
        self._diverge(index, str(func), kind, random=_is_random(func), same_inputs=same_inputs, diff=diff)

    def release(self) -> None:
        """Drop the recorded copies: they are needed only until this call's recomputation compared them."""
        for op in self.ops:
            op.outputs = []
            op.inputs = []

    def snapshot_buffers(self) -> None:
        with torch.no_grad():
            self.buffers_after_forward = [
                (name, owner, key, local_tensor(buffer).clone())
                for name, (owner, key, buffer) in _buffer_slots(self.module).items()
            ]

    def inputs_modified(self) -> bool:
        """Whether an input saved at the forward has been modified in place since (its version counter moved)."""
        for ref, version in self.input_versions:
            tensor = ref()
            if tensor is not None and tensor._version != version:
                return True
        return False

    def mutated_buffers(self) -> list[str]:
        mutated = []
        for name, owner, key, value in self.buffers_after_forward:
            current = owner._buffers.get(key)
            if current is None or not _same_values(value, current):
                mutated.append(name)
        return mutated

    def _diverge(self, index: int, op: str, kind: _Kind, *, random: bool, same_inputs: bool, diff: float) -> None:
        self.max_abs_diff = max(self.max_abs_diff, diff)
        if self.divergence is None:
            self.divergence = _Divergence(index, op, kind, random, same_inputs)

    def _writes_buffer(self, func: torch._ops.OpOverload, args: Any, kwargs: Any) -> bool:
        return any(id(tensor) in self.buffer_ids for tensor in _written_tensors(func, args, kwargs))


class _ForwardRecorder(TorchDispatchMode):
    def __init__(self, call: _Call) -> None:
        super().__init__()
        self.call = call

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        call = self.call
        if not _observed(func) or call.abandoned is not None:
            return func(*args, **kwargs)
        inputs: list[Any] = []
        # The recording's own ops must reach no mode below (selective checkpointing would cache them).
        with _disable_current_modes(), call.contained("recording"):
            inputs = call.signature(args, kwargs)
        out = func(*args, **kwargs)
        if call.abandoned is None:
            with _disable_current_modes(), call.contained("recording"):
                call.record(func, inputs, args, kwargs, out)
        return out


class _RecomputeComparer(TorchDispatchMode):
    def __init__(self, call: _Call) -> None:
        super().__init__()
        self.call = call

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        call = self.call
        if not _observed(func) or call.abandoned is not None:
            return func(*args, **kwargs)
        inputs = None
        if call.divergence is None:
            with _disable_current_modes(), call.contained("comparing"):
                inputs = call.signature(args, kwargs)
        out = func(*args, **kwargs)
        if call.abandoned is None:
            with _disable_current_modes(), call.contained("comparing"):
                call.compare(func, inputs, out)
        return out


def _observed(func: Any) -> bool:
    """Whether the observer records and compares ``func``: not ``aten.detach`` (recomputation detaches its inputs,
    the forward does not), and no collective (see :data:`_COLLECTIVE_NAMESPACES`)."""
    if func is torch.ops.aten.detach.default:
        return False
    return getattr(func, "namespace", None) not in _COLLECTIVE_NAMESPACES


class _Attribution:
    """Observes every checkpointed region of one pass; plugged in through ``wrapping._observing``."""

    def __init__(self, module: nn.Module, replay_host_rng: frozenset[str] | None = None) -> None:
        """Observe every region, or, given ``replay_host_rng``, only those regions, replaying their host RNG."""
        self.names = list(checkpointed_modules(module))
        self._name_of = {id(sub): name for name, sub in checkpointed_modules(module).items()}
        self._replay_host_rng = replay_host_rng
        self.calls: list[_Call] = []
        self._last_recomputed: _Call | None = None
        self._mutated: dict[str, list[str]] = {}

    def contexts(
        self, region: str, module: nn.Module, inputs: tuple[Any, ...], kept: KeptOutputs
    ) -> tuple[
        Callable[[], contextlib.AbstractContextManager[Any]], Callable[[], contextlib.AbstractContextManager[Any]]
    ]:
        call = _Call(region=self._name_of.get(id(module), region), module=module, kept=kept)
        if self._replay_host_rng is not None and call.region not in self._replay_host_rng:
            return contextlib.nullcontext, contextlib.nullcontext
        call.input_versions = [
            (weakref.ref(value), value._version) for value in inputs if isinstance(value, torch.Tensor)
        ]
        return partial(self._forward, call), partial(self._recompute, call)

    def observing(self) -> contextlib.AbstractContextManager[None]:
        return _observing(self)

    def finish(self, error: BaseException | None) -> None:
        """Close the pass: blame ``error`` on the region it came from; drop every recorded copy."""
        if error is not None and not any(call.error for call in self.calls):
            # torch raises these from its unpack hook, outside the region's recompute context: its CheckpointError
            # right after the region's recomputation, its version-counter error before recomputing a region whose
            # saved input was modified in place.
            modified = [call for call in self.calls if call.inputs_modified()]
            for call in modified:
                call.error, call.input_modified = error, True
            if not modified and isinstance(error, CheckpointError) and self._last_recomputed is not None:
                self._last_recomputed.error = error
        # Compared before the engine puts the buffers back: their values after each module's last forward call.
        last: dict[int, _Call] = {id(call.module): call for call in self.calls}
        for call in last.values():
            if call.recomputations:
                self._mutated.setdefault(call.region, []).extend(
                    f"{call.region}.{name}" for name in call.mutated_buffers()
                )
        uncomparable = sorted({name for call in self.calls for name in call.uncomparable})
        if uncomparable:
            _log.info(
                "lightning_ckpt_determinism: attribution compared arguments of types %s as equal: they have no usable"
                " `==`.",
                uncomparable,
            )
        for call in self.calls:
            call.release()
            call.buffers_after_forward = []
            call.input_versions = []

    def host_rng_suspects(self) -> frozenset[str]:
        """Regions whose difference is not yet explained and that read host RNG in their forward."""
        return frozenset(
            call.region
            for call in self.calls
            if call.host_rng_read and call.divergence is not None and _evidence_cause(call.divergence) is None
        )

    def diverging_regions(self) -> frozenset[str]:
        return frozenset(call.region for call in self.calls if call.divergence is not None or call.error)

    def reports(
        self, *, gradients_diverged: bool, host_rng_explained: frozenset[str]
    ) -> tuple[list[RegionReport], list[str]]:
        """One :class:`RegionReport` per checkpointed region, in module order, and the mutated buffers' names."""
        reports = []
        for name in self.names:
            calls = [call for call in self.calls if call.region == name]
            report = RegionReport(
                name=name,
                ops_compared=sum(call.compared for call in calls),
                max_abs_diff=max((call.max_abs_diff for call in calls), default=0.0),
                buffer_mutations=list(self._mutated.get(name, [])),
                recomputations=sum(call.recomputations for call in calls),
                data_dependent_ops=_data_dependent_ops(calls),
            )
            for call in calls:
                cause = _cause(call, host_rng_explained=name in host_rng_explained)
                if cause is not None:
                    report.cause = cause
                    report.hint = _INPUT_MODIFIED_HINT if call.input_modified else CAUSE_HINTS[cause]
                    report.hint += _routing_hint(call)
                    if call.error is not None:
                        report.error = _first_line(call.error)
                    if call.divergence is not None:
                        report.first_divergent_op = (call.divergence.op, call.divergence.index)
                    else:
                        report.max_abs_diff = math.inf
                    break
            if report.cause is None and report.buffer_mutations:
                report.cause = "buffer_mutation"
                report.hint = f"{CAUSE_HINTS['buffer_mutation']} Changed: {', '.join(report.buffer_mutations)}."
            if report.cause is not None:
                report.diverged = report.cause != "nondeterministic_kernel" or gradients_diverged
            reports.append(report)
        return reports, [buffer for name in self.names for buffer in self._mutated.get(name, [])]

    @contextlib.contextmanager
    def _forward(self, call: _Call) -> Iterator[None]:
        self.calls.append(call)
        call.buffer_ids = frozenset(id(buffer) for buffer in call.module.buffers())
        before = call.host_rng_before = capture_host_rng()
        try:
            with _ForwardRecorder(call):
                yield
        except BaseException as err:
            call.error = err
            raise
        finally:
            call.host_rng_read = not _same_host_rng(before, capture_host_rng())
            call.snapshot_buffers()

    @contextlib.contextmanager
    def _recompute(self, call: _Call) -> Iterator[None]:
        """Entered at each recomputation of ``call``: the first is compared with the forward, later ones only run."""
        self._last_recomputed = call
        live = None
        if self._replay_host_rng is not None and call.host_rng_before is not None:
            live = capture_host_rng()
            restore_host_rng(call.host_rng_before)
        # The recorded copies were released after the first comparison, and a later recomputation replays the same
        # state: it runs unobserved.
        comparing = _RecomputeComparer(call) if not call.recomputations else contextlib.nullcontext()
        try:
            with comparing:
                yield
        except _StopRecomputationError:
            raise
        except BaseException as err:
            call.error = err
            raise
        finally:
            call.recomputations += 1
            call.release()
            if live is not None:
                restore_host_rng(live)


def _data_dependent_ops(calls: list[_Call]) -> dict[str, bool]:
    """Each data-dependent op the calls' forwards ran, with whether every call kept its outputs."""
    ops: dict[str, bool] = {}
    for call in calls:
        for op, kept in call.kept.seen if call.kept is not None else []:
            ops[op] = ops.get(op, True) and kept
    return ops


def _routing_hint(call: _Call) -> str:
    """What keeps the routing, when a data-dependent op recomputed other outputs than its forward's."""
    if call.routing_changed is None:
        return ""
    if call.kept is not None and call.kept.keep:
        return _ROUTING_TOO_LARGE_HINT.format(op=call.routing_changed)
    if call.kept is not None and call.kept.dropped:
        return _ROUTING_DROPPED_HINT.format(op=call.routing_changed)
    return _ROUTING_HINT.format(op=call.routing_changed)


def _evidence_cause(divergence: _Divergence) -> str | None:
    """The cause the differing op itself proves, or ``None`` when host RNG and Python state remain."""
    if divergence.kind == "structure":
        return None
    if divergence.random:
        return "rng_not_preserved"
    if divergence.kind == "shape":
        return "shape_change"
    if divergence.same_inputs:
        return "nondeterministic_kernel"
    return None


def _cause(call: _Call, *, host_rng_explained: bool) -> str | None:
    if call.divergence is None:
        if call.error is None:
            return None
        # torch's metadata mismatch; its other CheckpointError, a different number of saved tensors, comes from
        # control flow that changed, as do errors raised by the region's own code.
        if not isinstance(call.error, CheckpointError):
            return "recompute_error"
        return "shape_change" if "different metadata" in str(call.error) else "python_state"
    found = _evidence_cause(call.divergence)
    if found is not None:
        return found
    return "host_rng" if host_rng_explained and call.host_rng_read else "python_state"


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _is_random(func: torch._ops.OpOverload) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _flatten(item)]
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in _flatten(item)]
    return [value]


def _fingerprint(tensor: torch.Tensor) -> _Fingerprint:
    tensor = local_tensor(tensor)
    shape, dtype = tuple(tensor.shape), tensor.dtype
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.device.type == "meta":
        return _Fingerprint(shape, dtype, None)
    data = tensor.detach()
    if data.numel() == 0:
        return _Fingerprint(shape, dtype, torch.zeros(3, dtype=torch.int64, device=data.device))
    if data.is_complex():
        data = torch.view_as_real(data)
    bits = data.view(torch.uint8) if data.dtype == torch.bool else data.view(_BITS_BY_SIZE[data.element_size()])
    # Sums of the bit patterns by row and by column of the last dimension, each weighted by position: exact
    # integers that tell apart any change of value and nearly any reordering, without a copy of the tensor.
    table = bits.reshape(-1, bits.shape[-1]) if bits.dim() > 1 else bits.reshape(1, -1)
    rows, columns = table.sum(dim=1), table.sum(dim=0)
    return _Fingerprint(
        shape,
        dtype,
        torch.stack([rows.sum(), (rows * _positions(rows)).sum(), (columns * _positions(columns)).sum()]),
    )


def _positions(sums: torch.Tensor) -> torch.Tensor:
    return torch.arange(1, sums.numel() + 1, device=sums.device, dtype=torch.int64)


def _metadata(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = local_tensor(value)
        return (tuple(value.shape), value.dtype)
    return type(value).__name__


def _recorded(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return local_tensor(value).detach().clone()
    # Python scalars (``aten._local_scalar_dense``, behind ``.item()``) are compared as they are.
    return value if isinstance(value, (bool, int, float, complex)) else None


def _returns_views(func: torch._ops.OpOverload, count: int) -> list[bool]:
    returns = func._schema.returns
    flags = [ret.alias_info is not None and not ret.alias_info.is_write for ret in returns]
    if len(flags) == count:
        return flags
    # One list return (``split``, ``unbind``) flattens into several tensors.
    return [any(flags)] * count


def _written_tensors(func: torch._ops.OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
    written: list[torch.Tensor] = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        written.extend(leaf for leaf in _flatten(value) if isinstance(leaf, torch.Tensor))
    return written


def _elementwise_difference(ref: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``|ref - other|``, with NaN in both or the same infinity counting as equal and a lone non-finite as ``inf``."""
    diff = (ref - other).abs()
    agree = (ref.isnan() & other.isnan()) | (ref.isinf() & (ref == other))
    disagree = ~agree & ~(ref.isfinite() & other.isfinite())
    return diff.masked_fill(agree, 0.0).masked_fill(disagree, math.inf)


def _comparable(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    return tensor.to(torch.float64)


def _max_abs_difference(expected: Any, actual: Any) -> float:
    if not isinstance(expected, torch.Tensor):
        if expected == actual or (expected != expected and actual != actual):
            return 0.0
        return float(abs(expected - actual))
    if not isinstance(actual, torch.Tensor):
        return math.inf
    expected, actual = local_tensor(expected), local_tensor(actual)
    if torch.equal(expected, actual):
        return 0.0
    diff = _elementwise_difference(_comparable(expected), _comparable(actual))
    return float(diff.max()) if diff.numel() else 0.0


def _same_values(expected: torch.Tensor, actual: torch.Tensor) -> bool:
    expected, actual = local_tensor(expected), local_tensor(actual)
    if expected.shape != actual.shape or expected.dtype != actual.dtype:
        return False
    return _max_abs_difference(expected, actual) == 0.0


def _same_host_rng(before: HostRNGState, after: HostRNGState) -> bool:
    numpy_same = before.numpy[0] == after.numpy[0] and all(
        np.array_equal(a, b) for a, b in zip(before.numpy[1:], after.numpy[1:], strict=True)
    )
    return bool(before.python == after.python and numpy_same)
