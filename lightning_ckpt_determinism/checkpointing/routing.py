"""Outputs that decide shapes or routing, kept from a region's forward and served to its recomputation.

Which ops count as data-dependent (the rule): every op torch tags ``dynamic_output_shape`` (``nonzero``,
``bincount``, ``_unique2``, ``unique_consecutive``, ``masked_select``, ``repeat_interleave.Tensor`` ...) or
``data_dependent_output`` (``_local_scalar_dense``, behind ``.item()``), plus a fixed list of ops torch 2.13 leaves
untagged although their result decides which rows go where: ``topk``, ``sort``, ``argsort``, ``kthvalue``,
``argmax``, ``argmin``, ``max.dim``, ``min.dim``, ``searchsorted`` and ``histc``. ``index.Tensor`` carries the tag
for its boolean-mask form only, which is the one that counts: indexing with integer indices (a gather) has the
shape of its indices, and keeping it would keep activation-sized data.

Which outputs are kept (the size rule): an op's outputs are kept or recomputed together. An op with integer and
boolean outputs only (indices, counts, masks) and Python scalars is kept always; an op with floating outputs
(``topk``'s values with its indices, ``masked_select`` of activations) only when its floating outputs hold at most as
many elements as the region's largest tensor input (nested in the call's tuples, lists and dicts too), so that the
floating values kept cost at most what checkpointing already saves for the region. A larger op is recomputed, its
indices too, and the audit lists it as not kept. Integer outputs are kept whatever their size: routing indices are
tokens x k, but an integer op over a hidden layer keeps activation-sized data.

An op's ``out=`` form (``torch.argmax(x, out=index)``) is served by running it, then writing the kept values into
its ``out`` tensors: the region reads them there.

Eagerly, :class:`KeptOutputs` caches the kept outputs of one checkpointed call and serves copies of them to every
recomputation of that call (a gradient penalty or ``retain_graph=True`` recomputes it more than once; torch's
selective checkpointing serves its cache only once); the cache goes with the autograd graph that holds the call.
Under ``torch.compile``, :class:`CompiledPolicy` marks the same outputs ``CheckpointPolicy.MUST_SAVE`` in torch's
selective-checkpointing pair, the only context the compiler accepts; it learns the region's input size from
``aten.alias`` markers that :func:`mark_region_inputs` puts in front of the region.
"""

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from lightning_ckpt_determinism._torch_compat import (
    OpOverload,
    TorchDispatchMode,
    disable_current_modes,
    statically_known_true,
    tree_leaves,
    tree_map,
    writes_its_arguments,
)

__all__ = [
    "CompiledPolicy",
    "KeptOutputs",
    "fits_size_rule",
    "input_limit",
    "is_data_dependent",
    "is_random_op",
    "mark_region_inputs",
]

_aten = torch.ops.aten
_TAGS = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)
_UNTAGGED_PACKETS = frozenset(
    {
        _aten.topk,
        _aten.sort,
        _aten.argsort,
        _aten.kthvalue,
        _aten.argmax,
        _aten.argmin,
        _aten.searchsorted,
        _aten.histc,
    }
)
_UNTAGGED_OVERLOADS = frozenset({_aten.max.dim, _aten.min.dim})
_MASK_DTYPES = (torch.bool, torch.uint8)
_RECOMPUTED = object()


def is_random_op(func: Any) -> bool:
    """Whether ``func`` draws from a random generator (``torch.Tag.nondeterministic_seeded``: dropout, ``rand*``,
    ``bernoulli`` ...): an op whose output selective checkpointing keeps is not run again in recomputation, so a
    random one left out would shift what every later random op of the recomputation draws.

    Example::

        >>> is_random_op(torch.ops.aten.native_dropout.default), is_random_op(torch.ops.aten.addmm.default)
        (True, False)
    """
    return isinstance(func, OpOverload) and torch.Tag.nondeterministic_seeded in func.tags


def is_data_dependent(func: Any, args: tuple[Any, ...]) -> bool:
    """Whether ``func`` called with ``args`` returns what decides shapes or routing (see the module's rule).

    Args:
        func: The op, as a dispatch mode sees it.
        args: Its positional arguments.

    Example::

        >>> is_data_dependent(torch.ops.aten.topk.default, (torch.ones(3), 2))
        True
        >>> is_data_dependent(torch.ops.aten.index.Tensor, (torch.ones(3), [torch.tensor([0, 2])]))
        False
    """
    if not _by_rule(func):
        return False
    if func is _aten.index.Tensor:
        return len(args) > 1 and any(
            isinstance(index, torch.Tensor) and index.dtype in _MASK_DTYPES for index in args[1] or ()
        )
    return True


def _by_rule(func: Any) -> bool:
    if not isinstance(func, OpOverload):
        return False
    if func in _UNTAGGED_OVERLOADS or func.overloadpacket in _UNTAGGED_PACKETS:
        return True
    return any(tag in func.tags for tag in _TAGS)


def input_limit(inputs: Iterable[Any]) -> Any:
    """The size rule's limit: the number of elements of the largest tensor among ``inputs``, in their tuples, lists
    and dicts too (symbolic if compiled).

    Args:
        inputs: A region call's inputs.

    Example::

        >>> input_limit((torch.ones(4, 2), 3, [torch.ones(10)]))
        10
    """
    limit: Any = 0
    for value in tree_leaves(list(inputs)):
        if isinstance(value, torch.Tensor):
            limit = torch.sym_max(limit, value.numel())
    return limit


def fits_size_rule(output: Any, limit: Any) -> bool:
    """Whether an op's floating outputs hold at most ``limit`` elements; outputs of unknown size do not fit.

    Args:
        output: What a data-dependent op returned.
        limit: The region's :func:`input_limit`.

    Example::

        >>> fits_size_rule((torch.ones(2), torch.ones(2, dtype=torch.long)), 2)
        True
    """
    floating = sum(
        leaf.numel()
        for leaf in tree_leaves(output)
        if isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex())
    )
    return statically_known_true(floating <= limit)


def mark_region_inputs(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """``inputs`` with each tensor behind an ``aten.alias`` (a view, free once compiled), for :class:`CompiledPolicy`;
    tensors in the inputs' tuples, lists and dicts too, as :func:`input_limit` reads them eagerly.

    Traced inside the region, so the policy sees the markers first and reads the inputs' sizes from them: the
    compiler calls the policy with each op and its output, never with the region's inputs.
    """
    marked = []
    for value in inputs:
        if isinstance(value, torch.Tensor):
            marked.append(_aten.alias.default(value))
            continue
        # Nested ones are marked, not replaced: the forward may write into the very list or dict it was given.
        for leaf in tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                _aten.alias.default(leaf)
        marked.append(value)
    return tuple(marked)


class KeptOutputs:
    """What one eager checkpointed call keeps of its data-dependent ops, and the log of what it saw.

    Args:
        keep: Keep outputs by the size rule (``keep_data_dependent``); ``False`` only logs what runs, for the check.
        dropped: ``keep_data_dependent`` is on but the region's guard is not: its first checkpointed forward ran no
            data-dependent op. Only the check's hint reads it.
        save_ops: The config's ``save_ops``: torch's selective checkpointing keeps these, so they are logged as
            kept and not cached twice.
        on_forward: Called with whether a data-dependent op ran, once the forward has run without an error.

    Example::

        >>> kept = KeptOutputs(keep=True, save_ops=frozenset())
        >>> kept.note_inputs((torch.ones(4, 2),))
        >>> with kept.forward():
        ...     _, indices = torch.ones(4, 2).topk(1)
        >>> kept.seen
        [('aten.topk.default', True)]
    """

    def __init__(
        self,
        *,
        keep: bool,
        save_ops: frozenset[Any],
        on_forward: Callable[[bool], None] | None = None,
        dropped: bool = False,
    ) -> None:
        self.keep = keep
        self.dropped = dropped
        self.seen: list[tuple[str, bool]] = []
        self._save_ops = save_ops
        self._on_forward = on_forward
        self._limit: Any = 0
        self._outputs: dict[Any, list[Any]] = {}

    def note_inputs(self, inputs: tuple[Any, ...]) -> None:
        """Take the size rule's limit from the region's inputs, as the forward starts."""
        self._limit = input_limit(inputs)

    def forward(self) -> "_KeepForward":
        return _KeepForward(self)

    def recompute(self) -> "_ServeRecompute":
        """A fresh mode for one recomputation: it serves the kept outputs from the first one on."""
        return _ServeRecompute(self._outputs)

    def _record(self, func: Any, args: tuple[Any, ...], out: Any) -> None:
        if not is_data_dependent(func, args):
            return
        by_save_ops = func in self._save_ops
        kept = by_save_ops or (self.keep and fits_size_rule(out, self._limit))
        self.seen.append((str(func), kept))
        if self.keep and not by_save_ops:
            self._outputs.setdefault(func, []).append(tree_map(_copy, out) if kept else _RECOMPUTED)

    def _forward_done(self) -> None:
        if self._on_forward is not None:
            self._on_forward(bool(self.seen))


class _KeepForward(TorchDispatchMode):
    def __init__(self, kept: KeptOutputs) -> None:
        super().__init__()
        self.kept = kept

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.kept._record(func, args, out)
        return out

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        super().__exit__(exc_type, exc_value, traceback)
        if exc_type is None:
            self.kept._forward_done()


class _ServeRecompute(TorchDispatchMode):
    def __init__(self, outputs: dict[Any, list[Any]]) -> None:
        super().__init__()
        self._outputs = outputs
        self._served: dict[Any, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        entries = self._outputs.get(func)
        # Counted as the forward counted them: only the data-dependent calls (a boolean mask is one, an integer
        # index into the same `index.Tensor` is not and must not take a kept mask's place).
        if entries is not None and is_data_dependent(func, args):
            position = self._served.get(func, 0)
            self._served[func] = position + 1
            # Past the forward's calls the region runs other code than it did; torch's metadata check then says so.
            if position < len(entries) and entries[position] is not _RECOMPUTED:
                if writes_its_arguments(func):
                    # An `out=` form: the region reads its `out` tensors, which the values are written into.
                    return _written(func(*args, **(kwargs or {})), entries[position])
                # A copy each time: the region may modify what it gets in place, and a later recomputation must
                # get the forward's values again.
                return tree_map(_copy, entries[position])
        return func(*args, **(kwargs or {}))


def _written(out: Any, kept: Any) -> Any:
    """``out``, what an ``out=`` op returned (its ``out`` tensors), with the kept values written into them below
    every dispatch mode (resized first where the kept ones have another shape)."""
    with disable_current_modes(), torch.no_grad():
        for target, value in zip(tree_leaves(out), tree_leaves(kept), strict=True):
            if isinstance(target, torch.Tensor):
                target.resize_(value.shape).copy_(value)
    return out


def _copy(value: Any) -> Any:
    """A copy of a kept output, made below every dispatch mode: a mode of the user's (or selective checkpointing's)
    sees the model's ops, never the guard's own."""
    if not isinstance(value, torch.Tensor):
        return value
    with disable_current_modes():
        return value.detach().clone()


class CompiledPolicy:
    """The selective-checkpointing policy of a compiled region: ``save_ops`` and the kept data-dependent ops
    ``MUST_SAVE``, everything else ``PREFER_RECOMPUTE`` (what torch gives a region without a policy).

    One per traced region: it reads the region's input sizes from the markers that lead the region's ops.

    Args:
        save_ops: Ops always saved.
        keep: Also save data-dependent ops by the size rule.

    Example::

        >>> policy = CompiledPolicy(save_ops=frozenset(), keep=True)
        >>> policy(None, torch.ops.aten.mm.default)
        <CheckpointPolicy.PREFER_RECOMPUTE: 3>
    """

    def __init__(self, *, save_ops: frozenset[Any], keep: bool) -> None:
        self._save_ops = save_ops
        self._keep = keep
        self._limit: Any = 0
        self._reading_markers = keep

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if self._reading_markers:
            if op is _aten.alias.default:
                self._limit = torch.sym_max(self._limit, args[0].numel())
                return CheckpointPolicy.PREFER_RECOMPUTE
            self._reading_markers = False
        if op in self._save_ops:
            return CheckpointPolicy.MUST_SAVE
        if self._keep and is_data_dependent(op, args) and fits_size_rule(ctx.op_output, self._limit):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE
