"""Attribution's observer: what each checkpointed region recomputes, compared op by op with what its forward produced.

While a check's checkpointed pass runs, every checkpointed region is observed through the wrapper's observer hook
(:func:`~lightning_ckpt_determinism.checkpointing.wrapper.observing`): in the original forward a dispatch mode records
each aten op with a copy of its outputs and a fingerprint of its inputs; during recomputation, inside backward, a second
dispatch mode compares each recomputed op with the recorded one as soon as it runs, then lets the copy go. Recomputation
stops early (once every saved tensor is back) and detaches its inputs, so the two op sequences are aligned on what both
ran: ``aten.detach`` is left out of both, and comparison stops where recomputation stopped. Views, ops that return
uninitialised memory (``empty_like`` ...), ops that write some elements of such memory by index while it lives
(``index_copy_``, ``scatter_``: what they return holds leftovers elsewhere) and opaque workspaces (an RNN layer's, see
:data:`~lightning_ckpt_determinism.checkpointing.profile.OPAQUE_WORKSPACES`) are compared by shape only; casts autocast
may take from its cache (a region called again in one autocast context casts nothing) are left out of both sequences.
Ops that update the region's own buffers are left to the buffer check, and collectives are never recorded nor compared
(their outputs are filled by other processes; a collective's result is compared where it is consumed). DTensors are
compared as this rank's local shards. The observer's own failures never reach the pass it observes. An op of the forward
or of the recomputation that writes one of the region's parameters in place (a decay under ``no_grad``,
``embedding_renorm_``) is noted when it changed the parameter's values: a second renormalisation that finds every row
within ``max_norm`` writes nothing new. A differing op that read one of the region's buffers or parameters with other
values than in the forward (InstanceNorm's running statistics, which it copies before use; a parameter the forward
wrote) is noted too, and so are the torchmetrics metrics inside the region whose states a recomputation changed (a
metric updated in forward is updated again).

torch checks the version counters of a region's saved inputs before it enters the region's recompute context, so an
input modified in place after the forward is found by comparing the versions recorded at the forward with the
inputs' versions when the pass failed. A region's buffers are compared at the end of the pass with their values after
the region's last forward. A region recomputed more than once in a pass (a gradient penalty, ``retain_graph=True``)
is compared at its first recomputation; the later ones replay the same state, are counted, and are not compared.
Every tensor the regions save is compared too, by an ``exact`` sentinel (but in the regions a sentinel of the
caller's watches): torch saves an op's inputs before the op runs and may stop the recomputation there, so a tensor no
op made that differs can leave every compared op equal (see :meth:`Attribution._note_saved_differences`).
Each call ends as a :class:`~lightning_ckpt_determinism.verify.attribution.evidence.CallEvidence`; how the evidence
becomes a cause: :mod:`~lightning_ckpt_determinism.verify.attribution.region_cause`.
"""

import contextlib
import logging
import math
import weakref
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointError

from lightning_ckpt_determinism._library_compat import metric_state_names
from lightning_ckpt_determinism._torch_compat import (
    OpOverload,
    StopRecomputationError,
    TorchDispatchMode,
    buffer_version_counter,
    disable_current_modes,
    is_fsdp1_parameter_view,
    is_metadata_mismatch,
    own_buffers,
    returned_views,
    under_transform,
    writes_its_arguments,
    written_tensors,
)
from lightning_ckpt_determinism.checkpointing.contexts import ContextFactory, written_owners
from lightning_ckpt_determinism.checkpointing.equality import same_item
from lightning_ckpt_determinism.checkpointing.framework_ops import FrameworkOps
from lightning_ckpt_determinism.checkpointing.modules import (
    buffer_slots,
    generator_slots,
    plain_parts,
    state_copy,
    storage_pointer,
)
from lightning_ckpt_determinism.checkpointing.profile import OPAQUE_WORKSPACES
from lightning_ckpt_determinism.checkpointing.rng import (
    HostRNGState,
    capture_host_rng,
    capture_rng,
    held_host_generators,
    replaying_host_rng,
    restore_rng,
    same_host_rng,
    same_torch_rng,
)
from lightning_ckpt_determinism.checkpointing.routing import KeptOutputs, is_data_dependent, is_random_op
from lightning_ckpt_determinism.checkpointing.wrapper import (
    RegionCall,
    checkpointed_modules,
    observing,
    observing_saved_tensors,
)
from lightning_ckpt_determinism.verify.attribution.evidence import (
    CallEvidence,
    Divergence,
    DivergenceKind,
    KeepDataDependent,
    RecomputeFailure,
)
from lightning_ckpt_determinism.verify.attribution.region_cause import evidence_cause, region_reports
from lightning_ckpt_determinism.verify.compare import max_abs_difference, same_values
from lightning_ckpt_determinism.verify.digest import Fingerprint, fingerprint
from lightning_ckpt_determinism.verify.gradients import local_tensor
from lightning_ckpt_determinism.verify.reports import RegionReport, first_line
from lightning_ckpt_determinism.verify.sentinel.observer import RecomputationSentinel
from lightning_ckpt_determinism.verify.state import named_metrics

__all__ = ["Attribution", "BufferPlace", "CallRecord"]

_log = logging.getLogger(__name__)

BufferPlace = tuple[int, str]
"""Where a buffer is held: the ``id`` of the module that holds it and its key there (one place under every name a
module shared by several parents has)."""

COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional"})
"""The op namespaces of collectives and their waits, never recorded nor compared."""
_METADATA_QUERIES = frozenset(
    getattr(torch.ops.aten, name)
    for name in (
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
        "is_contiguous",
        "sym_is_contiguous",
        "is_non_overlapping_and_dense",
        "is_strides_like_format",
    )
    if hasattr(torch.ops.aten, name)
)
"""Queries of a tensor's metadata, which a subclass (a jagged nested tensor) sends through dispatch as often as its
code asks, in the forward and its recomputation alike or not: they compute nothing, and are never recorded."""
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "hpu", "mps")
"""The device types whose autocast state a call reads as it starts."""

_WRITES_BY_INDEX = frozenset(
    {
        "index_copy_",
        "index_put_",
        "_index_put_impl_",
        "index_fill_",
        "masked_fill_",
        "masked_scatter_",
        "scatter_",
        "put_",
    }
)
"""In-place ops that write only the elements their indices or mask select, by packet name."""

_UNINITIALISED = frozenset({"empty", "empty_like", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided"})


@dataclass
class _Op:
    """One op of a region's forward: its input fingerprints, and its outputs (copies of tensors, Python scalars as
    they are, ``None`` where not compared by value) with their metadata."""

    func: OpOverload
    inputs: list[Any]
    outputs: list[Any]
    metadata: list[Any]
    data_dependent: bool = False
    buffer_inputs: tuple[int, ...] = ()
    parameter_inputs: tuple[int, ...] = ()
    # The name of the parameter at each of `parameter_inputs`.
    parameter_names: tuple[str, ...] = ()


@dataclass
class CallRecord:
    """One call of a checkpointed region: its recorded forward and how its recomputation compared.

    Attributes:
        region: The region's name.
        module: The checkpointed module.
    """

    region: str
    module: nn.Module
    ops: list[_Op] = field(default_factory=list)
    buffer_ids: frozenset[int] = frozenset()
    buffer_storages: frozenset[int | None] = frozenset()
    parameter_storages: dict[int | None, str] = field(default_factory=dict)
    # The call's tensor arguments until its forward's first op fingerprints them (where the observer's own ops are
    # seen by no mode), their fingerprints, and the arguments each recomputation started from (the wrapper appends
    # them: `RegionCall.recomputed_from`).
    arguments: list[torch.Tensor] = field(default_factory=list)
    input_prints: list[Fingerprint] = field(default_factory=list)
    recomputed_from: list[tuple[Any, ...]] = field(default_factory=list)
    # The host generators the region's modules hold or its call was given (see `held_host_generators`).
    host_generators: list[Any] = field(default_factory=list)
    host_rng_before: HostRNGState | None = None
    host_rng_read: bool = False
    protects_buffers: bool = True
    replays_rng: bool = True
    exposed_buffers: frozenset[str] = frozenset()
    # The positions of the forward's ops that wrote a buffer of the region (their outputs are not compared), and the
    # storages of those ops' outputs in the recomputation under way.
    buffer_writers: set[int] = field(default_factory=set)
    buffer_writer_outputs: set[int | None] = field(default_factory=set)
    buffers_after_forward: list[tuple[str, nn.Module, str, torch.Tensor, torch.Tensor, int]] = field(
        default_factory=list
    )
    written_between: frozenset[str] = frozenset()
    # The storages the forward's `empty` ops handed out, with the tensors they made (a pointer counts while its tensor
    # lives): an op that writes into one (`index_copy_` filling it in pieces) returns memory partly unwritten.
    uninitialised: dict[int | None, weakref.ref[torch.Tensor]] = field(default_factory=dict)
    forward_parameters: dict[str, weakref.ref[torch.Tensor]] = field(default_factory=dict)
    parameters_substituted: tuple[str, ...] = ()
    input_versions: list[tuple[weakref.ref[torch.Tensor], int]] = field(default_factory=list)
    cursor: int = 0
    compared: int = 0
    max_abs_diff: float = 0.0
    divergence: Divergence | None = None
    recomputations: int = 0
    error: BaseException | None = None
    input_modified: bool = False
    kept: KeptOutputs | None = None
    routing_changed: str | None = None
    abandoned: str | None = None
    uncomparable: set[str] = field(default_factory=set)
    parameters_written: list[str] = field(default_factory=list)
    parameters_written_in_forward: list[str] = field(default_factory=list)
    metrics_updated: list[str] = field(default_factory=list)

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
        return [fingerprint(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in _flatten([args, kwargs])]

    def same_inputs(self, recorded: list[Any], seen: list[Any]) -> bool:
        """Whether an op got the inputs it had in the forward; an argument that cannot be compared counts as equal
        (its type is noted)."""
        if len(recorded) != len(seen):
            return False
        for expected, actual in zip(recorded, seen, strict=True):
            if isinstance(expected, Fingerprint):
                if not expected.same_as(actual):
                    return False
            elif (
                isinstance(actual, Fingerprint)
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

    def record(self, func: OpOverload, inputs: list[Any], args: Any, kwargs: Any, out: Any) -> None:
        if self.arguments:
            self.input_prints = [fingerprint(value) for value in self.arguments]
            self.arguments = []
        outputs = _flatten(out)
        writes_buffer = self._writes_buffer(func, args, kwargs)
        if writes_buffer:
            self.buffer_writers.add(len(self.ops))
        handed_out = func.overloadpacket.__name__ in _UNINITIALISED
        compare_values = not handed_out and not writes_buffer
        views = _returns_views(func, len(outputs))
        # Opaque workspaces, and outputs written into memory an `empty` op handed out: not compared by value.
        left_out = OPAQUE_WORKSPACES.get(str(func.overloadpacket), ())
        if handed_out:
            self.uninitialised.update(
                (storage_pointer(value), weakref.ref(value)) for value in outputs if isinstance(value, torch.Tensor)
            )
        elif self.uninitialised:
            left_out = (*left_out, *self._unwritten(func, outputs))
        leaves = _flatten([args, kwargs])
        parameter_inputs = self._positions(leaves, self.parameter_storages.keys())
        self.ops.append(
            _Op(
                func=func,
                inputs=inputs,
                outputs=[
                    _recorded(value) if compare_values and not view and position not in left_out else None
                    for position, (value, view) in enumerate(zip(outputs, views, strict=True))
                ],
                metadata=[_metadata(value) for value in outputs],
                data_dependent=is_data_dependent(func, args),
                buffer_inputs=self._positions(leaves, self.buffer_storages),
                parameter_inputs=parameter_inputs,
                parameter_names=self._parameters_at(leaves, parameter_inputs),
            )
        )

    def _arguments_changed(self) -> bool:
        """Whether the recomputation under way started from other values of the call's tensor arguments than its
        forward received (what torch saved came back otherwise through saved-tensor hooks, or was written through
        ``.data``)."""
        if not self.recomputed_from or not self.input_prints:
            return False
        arguments = [value for value in self.recomputed_from[-1] if isinstance(value, torch.Tensor)]
        if len(arguments) != len(self.input_prints):
            return False
        # An argument the digest cannot read (sparse, meta) has a fingerprint that matches none: not compared.
        started = (fingerprint(value) for value in arguments)
        return any(
            known.digest is not None and now.digest is not None and not known.same_as(now)
            for known, now in zip(self.input_prints, started, strict=True)
        )

    def _unwritten(self, func: OpOverload, outputs: Sequence[Any]) -> tuple[int, ...]:
        """Where among ``outputs`` an op that writes some elements by index (:data:`_WRITES_BY_INDEX`) returned memory
        an ``empty`` op of this forward handed out, still alive: the rest of it holds leftovers. Any other op that
        returns such memory wrote it (``bernoulli_``, ``fill_``): it counts as written from then on."""
        found = []
        by_index = func.overloadpacket.__name__ in _WRITES_BY_INDEX
        for position, value in enumerate(outputs):
            if not isinstance(value, torch.Tensor):
                continue
            pointer = storage_pointer(value)
            made = self.uninitialised.get(pointer)
            if made is None or made() is None:
                continue
            if by_index:
                found.append(position)
            else:
                del self.uninitialised[pointer]
        return tuple(found)

    def _parameters_at(self, leaves: Sequence[Any], positions: Sequence[int]) -> tuple[str, ...]:
        """The name of the region's parameter at each of ``positions`` among an op's arguments (``leaves``, as
        :meth:`signature` lists them; ``""`` where none)."""
        return tuple(
            self.parameter_storages.get(storage_pointer(leaves[position]), "")
            if position < len(leaves) and isinstance(leaves[position], torch.Tensor)
            else ""
            for position in positions
        )

    @staticmethod
    def _positions(leaves: Sequence[Any], storages: Collection[int | None]) -> tuple[int, ...]:
        """Where tensors on ``storages`` (the region's buffers or parameters, or views of them) are among an op's
        arguments (``leaves``, as :meth:`signature` lists them)."""
        return tuple(
            position
            for position, leaf in enumerate(leaves)
            if isinstance(leaf, torch.Tensor) and storage_pointer(leaf) in storages
        )

    def compare(self, func: OpOverload, inputs: list[Any] | None, out: Any, args: Any = (), kwargs: Any = None) -> None:
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
        if index in self.buffer_writers:
            # Its outputs are not compared: an op after it that reads them and differs read the buffers it updated.
            self.buffer_writer_outputs.update(
                storage_pointer(value) for value in outputs if isinstance(value, torch.Tensor)
            )
        kind: DivergenceKind | None = None
        diff = 0.0
        if [_metadata(value) for value in outputs] != recorded.metadata:
            kind, diff = "shape", math.inf
        else:
            for expected, actual in zip(recorded.outputs, outputs, strict=True):
                if expected is not None:
                    diff = max(diff, max_abs_difference(expected, actual))
            if diff > 0.0:
                kind = "values"
        same_inputs = kind is not None and inputs is not None and self.same_inputs(recorded.inputs, inputs)
        changed: frozenset[int] = frozenset()
        from_buffer_writer = False
        if kind is not None and inputs is not None:
            changed = _changed_inputs(recorded, inputs)
            leaves = _flatten([args, kwargs or {}])
            # An input that an op which updated the region's buffers gave it, changed (QAT's fused fake-quantize hands
            # the statistics it updated again on through its output, which is not compared).
            writers = self._positions(leaves, self.buffer_writer_outputs) if self.buffer_writer_outputs else ()
            from_buffer_writer = bool(writers) and bool(_changed_inputs(recorded, inputs, writers))
            if changed and recorded.parameter_names:
                # Another of the region's parameters where the forward had this one (a branch took another layer of
                # the same shape): the op's inputs changed, but no parameter was written.
                now = self._parameters_at(leaves, recorded.parameter_inputs)
                names = zip(recorded.parameter_inputs, recorded.parameter_names, now, strict=True)
                changed -= {position for position, before, after in names if before and after and before != after}
        if kind is None:
            recorded.outputs, recorded.inputs = [], []
            return
        if recorded.data_dependent and self.routing_changed is None:
            self.routing_changed = str(func)
        # What only the call's first difference keeps (see `_diverge`) is worked out for it alone.
        first = self.divergence is None
        random = first and (
            is_random_op(func) or (kind == "values" and same_inputs and _draws_torch_rng(func, args, kwargs))
        )
        draw_changed = random and inputs is not None and self._draw_changed(recorded.inputs, inputs)
        recorded.outputs, recorded.inputs = [], []
        self._diverge(
            index,
            str(func),
            kind,
            random=random,
            same_inputs=same_inputs,
            diff=diff,
            buffer_input=from_buffer_writer or any(position in changed for position in recorded.buffer_inputs),
            parameter_input=any(position in changed for position in recorded.parameter_inputs),
            region_input=first and not same_inputs and self._arguments_changed(),
            generator=random and self._foreign_generator(args, kwargs),
            draw_changed=draw_changed,
        )

    def _draw_changed(self, recorded: list[Any], seen: list[Any]) -> bool:
        """Whether an op's arguments other than tensors and generators (a rate, a spread, a size) differ from the
        forward's. Generators are left to :meth:`_foreign_generator`: the dispatcher hands a new object for each."""
        if len(recorded) != len(seen):
            return True
        return any(
            type(expected) is not type(actual) or not self._equal_arguments(expected, actual)
            for expected, actual in zip(recorded, seen, strict=True)
            if not isinstance(expected, Fingerprint | torch.Generator)
        )

    def _foreign_generator(self, args: Any, kwargs: Any) -> bool:
        """Whether an op was given a ``torch.Generator`` no module of the region holds as an attribute (those the
        region replays). The dispatcher hands ops a new Python object for the same generator: told by its state."""
        given = [leaf for leaf in _flatten([args, kwargs or {}]) if isinstance(leaf, torch.Generator)]
        if not given:
            return False
        held = [own for _, own in generator_slots(self.module)]
        return any(
            not any(
                generator.device == own.device and torch.equal(generator.get_state(), own.get_state()) for own in held
            )
            for generator in given
        )

    def release(self) -> None:
        """Drop the recorded copies: they are needed only until this call's recomputation compared them."""
        for op in self.ops:
            op.outputs = []
            op.inputs = []

    def evidence(self) -> CallEvidence:
        """What this call showed, for the cause rules."""
        return CallEvidence(
            region=self.region,
            compared=self.compared,
            max_abs_diff=self.max_abs_diff,
            recomputations=self.recomputations,
            divergence=self.divergence,
            failure=_failure(self.error),
            error=None if self.error is None else first_line(self.error),
            input_modified=self.input_modified,
            host_rng_read=self.host_rng_read,
            routing_changed=self.routing_changed,
            keep_data_dependent=_keep_data_dependent(self.kept),
            data_dependent_ops=tuple(self.kept.seen) if self.kept is not None else (),
            parameters_written=tuple(self.parameters_written),
            parameters_written_in_forward=tuple(self.parameters_written_in_forward),
            metrics_updated=tuple(self.metrics_updated),
            protects_buffers=self.protects_buffers,
            replays_rng=self.replays_rng,
            parameters_substituted=self.parameters_substituted,
            exposed_buffers=self.exposed_buffers,
        )

    def snapshot_buffers(self) -> None:
        with torch.no_grad():
            self.buffers_after_forward = [
                (name, owner, key, buffer, state_copy(local_tensor(buffer)), buffer_version_counter(buffer))
                for name, (owner, key, buffer) in buffer_slots(self.module).items()
            ]

    def note_written_between(self) -> None:
        """Note the buffers written since the forward ended, as its first recomputation starts, where the region puts
        its buffers back around a recomputation: by the region's caller or a module sharing them, not by the
        recomputation, so none of them is a mutation of its. With one, every buffer of its module counts
        (:func:`~lightning_ckpt_determinism.checkpointing.contexts.written_owners`). Without ``protect_buffers`` the
        recomputation's own writes stay, and cannot be told from those: every difference counts."""
        if not self.protects_buffers:
            return
        entries = self.buffers_after_forward
        owners = written_owners((owner, key, buffer, version) for _, owner, key, buffer, _, version in entries)
        self.written_between = frozenset(name for name, owner, *_ in entries if id(owner) in owners)

    def note_forward_parameters(self) -> None:
        """Note the tensors the region's modules hold as parameters as its forward starts (other tensors than their
        own inside ``torch.func.functional_call``)."""
        self.forward_parameters = {name: weakref.ref(param) for name, param in self.module.named_parameters()}

    def note_substituted(self) -> None:
        """Note the parameters held by other tensors as the first recomputation starts than as the forward started:
        the forward ran with tensors substituted for them (``torch.func.functional_call``), the recomputation with
        the module's own. FSDP1's views of its flat parameter, made again at each gathering, are left out."""
        self.parameters_substituted = tuple(
            name
            for name, param in self.module.named_parameters()
            if (held := self.forward_parameters.get(name)) is not None
            and held() is not param
            and not is_fsdp1_parameter_view(param)
        )

    def inputs_modified(self) -> bool:
        """Whether an input saved at the forward has been modified in place since (its version counter moved)."""
        for ref, version in self.input_versions:
            tensor = ref()
            if tensor is not None and buffer_version_counter(tensor) != version:
                return True
        return False

    def mutated_buffers(self) -> list[tuple[str, BufferPlace]]:
        """The buffers whose values the recomputation changed since the forward ended, with where each is held (see
        :data:`BufferPlace`). Where the region puts its buffers back, one replaced by another object since was replaced
        by other code: each recomputation gives the live object back."""
        mutated = []
        for name, owner, key, buffer, value, _ in self.buffers_after_forward:
            current = own_buffers(owner).get(key)
            if name in self.written_between or (self.protects_buffers and current is not buffer):
                continue
            if current is None or not same_values(value, current):
                mutated.append((name, (id(owner), key)))
        return mutated

    def saved_differs(self, description: str) -> None:
        """Note that a tensor this call saved, ``description`` (as the sentinel words it), was recomputed with other
        values while every op compared matched: the op at which the recomputation stopped, when it stopped before the
        region's end, saved it as an input (see :meth:`Attribution.finish`)."""
        op = str(self.ops[self.cursor].func) if self.cursor < len(self.ops) else None
        self._diverge(self.cursor, op, "saved", random=False, same_inputs=False, diff=math.inf, saved=description)

    def _diverge(
        self,
        index: int,
        op: str | None,
        kind: DivergenceKind,
        *,
        random: bool,
        same_inputs: bool,
        diff: float,
        buffer_input: bool = False,
        parameter_input: bool = False,
        saved: str | None = None,
        region_input: bool = False,
        generator: bool = False,
        draw_changed: bool = False,
    ) -> None:
        self.max_abs_diff = max(self.max_abs_diff, diff)
        if self.divergence is None:
            self.divergence = Divergence(
                index,
                op,
                kind,
                random,
                same_inputs,
                buffer_input,
                parameter_input,
                saved,
                region_input,
                generator,
                draw_changed,
            )

    def parameters_before(self, func: OpOverload, args: Any, kwargs: Any) -> list[tuple[str, torch.Tensor, Any]]:
        """The region's parameters an op is about to write in place (``embedding_renorm_`` on a detached weight:
        known by storage), each with the written tensor and a copy of its values."""
        if not self.parameter_storages:
            return []
        written = [
            (name, tensor)
            for tensor in written_tensors(func, args, kwargs)
            if (name := self.parameter_storages.get(storage_pointer(tensor))) is not None
        ]
        return [(name, tensor, _recorded(tensor)) for name, tensor in written]

    def note_cast(self, source: torch.Tensor, cast: torch.Tensor) -> None:
        """A cast autocast may cache, left out of the ops (see ``_CallMode._autocast_cached_cast``): an op that reads
        the cast of one of the region's parameters reads that parameter, for the cause rules."""
        name = self.parameter_storages.get(storage_pointer(source))
        if name is not None and isinstance(cast, torch.Tensor):
            self.parameter_storages[storage_pointer(cast)] = name

    def note_writes(self, before: list[tuple[str, torch.Tensor, Any]], *, recomputing: bool) -> None:
        """Note the parameters an op wrote in place with other values than they held (see :meth:`parameters_before`)."""
        noted = self.parameters_written if recomputing else self.parameters_written_in_forward
        for name, tensor, value in before:
            if name not in noted and not same_values(value, local_tensor(tensor)):
                noted.append(name)

    def start_observing(self) -> None:
        """Learn, at each forward and recomputation, where the region's buffers and parameters live: FSDP2 frees a
        gathered parameter after the forward and gathers it again, elsewhere, for the backward, where a tensor the
        recomputation writes may have taken the forward's place."""
        module = self.module
        self.buffer_writer_outputs = set()  # a recomputation's own, each time
        self.buffer_ids = frozenset(id(buffer) for buffer in module.buffers())
        self.buffer_storages = frozenset(storage_pointer(buffer) for buffer in module.buffers())
        # Each tensor holding a parameter's values (a quantized weight's data and scale) stands for the parameter.
        self.parameter_storages = {
            storage_pointer(part): name
            for name, param in module.named_parameters()
            for part in plain_parts(param) or (param,)
        }

    def _writes_buffer(self, func: OpOverload, args: Any, kwargs: Any) -> bool:
        return any(id(tensor) in self.buffer_ids for tensor in written_tensors(func, args, kwargs))


class _CallMode(TorchDispatchMode):
    """The dispatch mode of one call: it records every op of the forward, or compares every op of the
    recomputation with the recorded one (reading inputs only until a first difference is found)."""

    def __init__(self, call: CallRecord, *, comparing: bool) -> None:
        super().__init__()
        self.call = call
        self.comparing = comparing
        self.stage = "comparing" if comparing else "recording"
        # The ops a framework runs inside the region for itself, never recorded nor compared.
        self._framework = FrameworkOps()
        # The device types autocast casts for as the call starts (inside an op, autocast reads as off).
        self._autocast = (
            frozenset(
                device
                for device in _AUTOCAST_DEVICES
                if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
            )
            if torch.is_autocast_cache_enabled()
            else frozenset()
        )

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        call = self.call
        if self._autocast_cached_cast(func, args):
            out = func(*args, **kwargs)
            if call.abandoned is None:
                with disable_current_modes(), call.contained(self.stage):
                    call.note_cast(args[0], out)
            return out
        if self._framework.skips(func, args) or not _observed(func) or call.abandoned is not None:
            return func(*args, **kwargs)
        inputs: list[Any] | None = None
        before: list[tuple[str, torch.Tensor, Any]] = []
        # The observer's own ops must reach no mode below (selective checkpointing would cache them).
        with disable_current_modes(), call.contained(self.stage):
            _refuse_transformed(func, args, kwargs)
            if not self.comparing or call.divergence is None:
                inputs = call.signature(args, kwargs)
            before = call.parameters_before(func, args, kwargs)
        out = func(*args, **kwargs)
        if call.abandoned is None:
            with disable_current_modes(), call.contained(self.stage):
                if self.comparing:
                    call.compare(func, inputs, out, args, kwargs)
                else:
                    call.record(func, inputs or [], args, kwargs, out)
                call.note_writes(before, recomputing=self.comparing)
        return out

    def _autocast_cached_cast(self, func: Any, args: Any) -> bool:
        """Whether ``func`` is a cast autocast may take from its cache (a ``float32`` leaf that requires grad, a
        parameter, cast to the lower precision): a region called again inside one autocast context finds its weights
        cast already and runs no such op, while its recomputation, in a fresh context, runs it. Never recorded nor
        compared, so that the two line up; the cast weights are compared where an op reads them."""
        if not self._autocast or str(func.overloadpacket) != "aten._to_copy":
            return False
        source = args[0] if args else None
        return (
            isinstance(source, torch.Tensor)
            and source.device.type in self._autocast
            and source.dtype == torch.float32
            and source.is_leaf
            and source.requires_grad
        )


def _observed(func: Any) -> bool:
    """Whether the observer records and compares ``func``: not ``aten.detach`` (recomputation detaches its inputs,
    the forward does not), no metadata query (see :data:`_METADATA_QUERIES`) and no collective (see
    :data:`COLLECTIVE_NAMESPACES`)."""
    if func is torch.ops.aten.detach.default or getattr(func, "overloadpacket", None) in _METADATA_QUERIES:
        return False
    return getattr(func, "namespace", None) not in COLLECTIVE_NAMESPACES


class Attribution:
    """Observes every checkpointed region of one pass, through the wrapper's observer hook.

    Args:
        module: The model whose checkpointed regions are observed.
        replay_host_rng: Observe only these regions, replaying their host RNG at recomputation (the host-RNG
            confirmation pass); ``None`` observes every region.
    """

    def __init__(self, module: nn.Module, replay_host_rng: frozenset[str] | None = None) -> None:
        self._module = module
        self.names = list(checkpointed_modules(module))
        self._name_of = {id(sub): name for name, sub in checkpointed_modules(module).items()}
        self._replay_host_rng = replay_host_rng
        self.calls: list[CallRecord] = []
        self._last_recomputed: CallRecord | None = None
        self._mutated: dict[str, list[str]] = {}
        # Where each mutated buffer is held, by its name in `_mutated`.
        self._mutated_places: dict[str, BufferPlace] = {}
        # What the regions saved, compared exactly (see `_note_saved_differences`), once `observing` is entered.
        self._saved: RecomputationSentinel | None = None

    def contexts(self, region_call: RegionCall) -> tuple[ContextFactory, ContextFactory]:
        """The forward and recompute contexts of one call of a region (see :class:`Attribution`)."""
        module = region_call.module
        call = CallRecord(
            region=self._name_of.get(id(module), region_call.region),
            module=module,
            kept=region_call.data_dependent,
            protects_buffers=region_call.protects_buffers,
            replays_rng=region_call.replays_rng,
            exposed_buffers=region_call.exposed_buffers,
        )
        if self._replay_host_rng is not None and call.region not in self._replay_host_rng:
            return contextlib.nullcontext, contextlib.nullcontext
        call.arguments = [value for value in region_call.inputs if isinstance(value, torch.Tensor)]
        call.host_generators = held_host_generators(module.modules(), region_call.inputs)
        call.input_versions = [(weakref.ref(value), buffer_version_counter(value)) for value in call.arguments]
        call.recomputed_from = region_call.recomputed_from
        return partial(self._forward, call), partial(self._recompute, call)

    @contextlib.contextmanager
    def observing(self) -> Iterator[None]:
        """Observe the model's checkpointed regions that run inside this block (no other model's): every op, and every
        tensor they save through an exact sentinel (see :meth:`_note_saved_differences`), but in the regions a
        sentinel of the caller's watches (one around the check): it keeps watching them, and sees the pass."""
        try:
            self._saved = RecomputationSentinel(self._module, mode="exact")
        except Exception as err:  # the observer's own failure never reaches the pass: it compares the ops alone
            _log.info("lightning_ckpt_determinism: attribution compares no saved tensor: %s", first_line(err))
            self._saved = None
        with contextlib.ExitStack() as stack:
            stack.enter_context(observing(self, self._module))
            if self._saved is not None:
                stack.enter_context(observing_saved_tensors(self._saved, self._module, unwatched_only=True))
            yield

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
        last: dict[int, CallRecord] = {id(call.module): call for call in self.calls}
        for call in last.values():
            if call.recomputations:
                for name, place in call.mutated_buffers():
                    named = f"{call.region}.{name}"
                    self._mutated.setdefault(call.region, []).append(named)
                    self._mutated_places[named] = place
        uncomparable = sorted({name for call in self.calls for name in call.uncomparable})
        if uncomparable:
            _log.info(
                "lightning_ckpt_determinism: attribution compared arguments of types %s as equal: they have no usable"
                " `==`.",
                uncomparable,
            )
        self._note_saved_differences()
        for call in self.calls:
            call.release()
            call.buffers_after_forward = []
            call.input_versions = []
            call.arguments, call.input_prints = [], []

    def _note_saved_differences(self) -> None:
        """A call whose recomputed ops all matched but a saved tensor differed: torch saves an op's inputs before the
        op runs, and its early stop can end the recomputation right there, so a tensor no recomputed op produced
        (``torch.from_numpy`` of a fresh draw, read by the region's last op) differs unseen by the ops. The sentinel
        saw it: the call diverges at that tensor."""
        try:
            found = self._saved.first_saved_mismatches() if self._saved is not None else {}
        except Exception as err:  # as in `observing`
            _log.info("lightning_ckpt_determinism: attribution compared no saved tensor: %s", first_line(err))
            return
        for name, (ordinal, description) in found.items():
            # Both number a region's calls as they start (the sentinel's context inside this observer's).
            calls = [call for call in self.calls if call.region == name]
            call = calls[ordinal] if ordinal < len(calls) else None
            if call is None or not call.recomputations or call.abandoned is not None:
                continue
            if call.divergence is None and call.error is None:
                call.saved_differs(description)

    def host_rng_suspects(self) -> frozenset[str]:
        """Regions whose difference is not yet explained and that read host RNG in their forward."""
        return frozenset(
            call.region
            for call in self.calls
            if call.host_rng_read and call.divergence is not None and evidence_cause(call.divergence) is None
        )

    def host_rng_readers(self) -> frozenset[str]:
        """Regions whose forward read (drew from, or seeded) Python's or NumPy's global RNG at some call."""
        return frozenset(call.region for call in self.calls if call.host_rng_read)

    def parameters_written_in_forward(self) -> frozenset[str]:
        """The parameters (as the model names them) a region's forward wrote in place, changing their values."""
        return frozenset(
            f"{call.region}.{name}" if call.region else name
            for call in self.calls
            for name in call.parameters_written_in_forward
        )

    def diverging_regions(self) -> frozenset[str]:
        return frozenset(call.region for call in self.calls if call.divergence is not None or call.error)

    def reports(
        self,
        *,
        gradients_diverged: bool,
        host_rng_explained: frozenset[str],
        ended_otherwise: Collection[BufferPlace] | None = None,
    ) -> tuple[list[RegionReport], list[str]]:
        """One :class:`RegionReport` per checkpointed region, in module order, and the mutated buffers' names.

        Args:
            gradients_diverged: Whether the step's gradients diverged.
            host_rng_explained: The regions whose difference replaying host RNG removed.
            ended_otherwise: Where the buffers that ended the checkpointed pass otherwise than the reference pass are
                held (see :data:`BufferPlace`); a buffer a recomputation changed counts only among them (a `checkpoint`
                call of the model's own inside a region updates its norm's statistics again in both passes).
                ``None``: every one counts.
        """
        mutated = self._mutated
        if ended_otherwise is not None:
            ended = set(ended_otherwise)
            mutated = {
                name: [buffer for buffer in found if self._mutated_places[buffer] in ended]
                for name, found in mutated.items()
            }
        reports = region_reports(
            self.names,
            [call.evidence() for call in self.calls],
            mutated,
            gradients_diverged=gradients_diverged,
            host_rng_explained=host_rng_explained,
        )
        return reports, [buffer for name in self.names for buffer in mutated.get(name, [])]

    @contextlib.contextmanager
    def _forward(self, call: CallRecord) -> Iterator[None]:
        self.calls.append(call)
        call.start_observing()
        call.note_forward_parameters()
        before = call.host_rng_before = capture_host_rng(call.host_generators)
        try:
            with _CallMode(call, comparing=False):
                yield
        except BaseException as err:
            call.error = err
            raise
        finally:
            call.host_rng_read = not same_host_rng(before, capture_host_rng(held for held, _ in before.held))
            call.snapshot_buffers()

    @contextlib.contextmanager
    def _recompute(self, call: CallRecord) -> Iterator[None]:
        """Entered at each recomputation of ``call``: the first is compared with the forward, later ones only run."""
        self._last_recomputed = call
        if not call.recomputations:
            call.note_written_between()
            call.note_substituted()
        call.start_observing()
        replayed = call.host_rng_before if self._replay_host_rng is not None else None
        with replaying_host_rng(replayed) if replayed is not None else contextlib.nullcontext():
            # The recorded copies were released after the first comparison, and a later recomputation replays the
            # same state: it runs unobserved.
            comparing = _CallMode(call, comparing=True) if not call.recomputations else contextlib.nullcontext()
            metrics = _MetricStates(call.module) if not call.recomputations else None
            try:
                with comparing:
                    yield
            except StopRecomputationError:
                raise
            except BaseException as err:
                call.error = err
                raise
            finally:
                if metrics is not None:
                    call.metrics_updated = metrics.changed()
                call.recomputations += 1
                call.release()


class _MetricStates:
    """The states of the torchmetrics metrics inside a region, copied when its recomputation starts: a metric updated
    in forward is updated again by recomputation (torchmetrics states are neither buffers nor replayed)."""

    def __init__(self, module: nn.Module) -> None:
        self._states = [
            (name, metric, {state: _state_copy(getattr(metric, state)) for state in metric_state_names(metric)})
            for name, metric in named_metrics(module)
        ]

    def changed(self) -> list[str]:
        """The metrics (their names relative to the region) whose states changed since the copy."""
        return [
            name
            for name, metric, states in self._states
            if any(not _same_state(value, getattr(metric, state)) for state, value in states.items())
        ]


def _state_copy(value: Any) -> Any:
    """A metric state as it is now: a tensor's values, a list state's items (the tensors it holds are not written)."""
    if isinstance(value, torch.Tensor):
        return local_tensor(value).detach().clone()
    return list(value) if isinstance(value, list) else value


def _same_state(copy: Any, value: Any) -> bool:
    if isinstance(copy, list) and isinstance(value, list):
        return len(copy) == len(value) and all(a is b for a, b in zip(copy, value, strict=True))
    return same_item(copy, local_tensor(value) if isinstance(value, torch.Tensor) else value)


def _refuse_transformed(func: OpOverload, args: Any, kwargs: Any) -> None:
    """Raise where an op's tensors are under a function transform or forward-mode AD (see
    :func:`~lightning_ckpt_determinism._torch_compat.under_transform`): the call is then no longer observed, as for
    any failure of the observer's own, instead of reading values no mode may read."""
    if any(isinstance(leaf, torch.Tensor) and under_transform(leaf) for leaf in _flatten([args, kwargs])):
        raise TransformedTensors(
            f"`{func}` ran under a function transform or forward-mode AD (`torch.func.jvp`, `vmap`, dual tensors),"
            " whose values attribution cannot read"
        )


class TransformedTensors(RuntimeError):
    """An op's tensors are under a function transform or forward-mode AD: attribution leaves the call unobserved."""


def _changed_inputs(recorded: _Op, inputs: list[Any], positions: Sequence[int] | None = None) -> frozenset[int]:
    """The positions of the region's buffers and parameters (or of ``positions``) among an op's inputs whose values
    at recomputation differ from those at the forward."""
    return frozenset(
        position
        for position in ((*recorded.buffer_inputs, *recorded.parameter_inputs) if positions is None else positions)
        if position < min(len(recorded.inputs), len(inputs))
        and isinstance(recorded.inputs[position], Fingerprint)
        and not recorded.inputs[position].same_as(inputs[position])
    )


def _failure(error: BaseException | None) -> RecomputeFailure | None:
    if error is None:
        return None
    if not isinstance(error, CheckpointError):
        return "error"
    return "metadata" if is_metadata_mismatch(error) else "checkpoint"


def _keep_data_dependent(kept: KeptOutputs | None) -> KeepDataDependent:
    if kept is not None and kept.keep:
        return "on"
    return "unguarded" if kept is not None and kept.dropped else "off"


def _draws_torch_rng(func: Any, args: Any, kwargs: Any) -> bool:
    """Whether ``func``, an op without torch's random tag that returned other values for the same inputs, draws from
    torch's generators (a custom op drawing ``torch.rand`` inside): run once more on those inputs, it moves the state of
    the CPU's or its devices' generator, which every stream is then put back from. An op that writes its arguments (by
    its schema) or takes a tensor subclass with a dispatch of its own (a DTensor) is not run again; what else the op
    does (a generator of its own drawn, a Python counter) happens once more, in attribution's pass only."""
    if not isinstance(func, OpOverload) or writes_its_arguments(func):
        return False
    tensors = [leaf for leaf in _flatten([args, kwargs or {}]) if isinstance(leaf, torch.Tensor)]
    if any(type(tensor).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__ for tensor in tensors):
        return False  # a subclass's op may run collectives (DTensor), which one rank alone must not enter
    devices = {tensor.device for tensor in tensors}
    before = capture_rng(devices)
    try:
        func(*args, **(kwargs or {}))
    except Exception:  # an op that cannot run again here proves nothing either way
        return False
    finally:
        after = capture_rng(devices)
        restore_rng(before)
    return not same_torch_rng(before, after)


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _flatten(item)]
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in _flatten(item)]
    return [value]


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


def _returns_views(func: OpOverload, count: int) -> list[bool]:
    flags = returned_views(func)
    if len(flags) == count:
        return flags
    # One list return (``split``, ``unbind``) flattens into several tensors.
    return [any(flags)] * count
