"""Every private torch API the package uses, in one place, each with the torch versions it is known in.

A torch upgrade touches this file only. The versions are those of the API's first release, read from each release's
sources; the newest of them (``SelectiveCheckpointContext.op_output``, 2.12, read by the compiled routing policy)
sets the package's floor. The package is tested on the versions its README names. Nothing here imports Lightning.
"""

import contextlib
import copy
import inspect
import operator
import re
from collections.abc import Callable, Iterable, Iterator
from itertools import chain
from types import CodeType
from typing import Any

import torch
from torch import nn

# The module `torch.compile` returns, and the dynamo context a compiled module or call carries (>= 2.0;
# `innermost_backend` >= 2.11, the context's `fullgraph` >= 2.9).
from torch._dynamo.eval_frame import OptimizeContext, OptimizedModule, innermost_backend

# Symbolic sizes: whether a comparison holds for every value of a traced size (>= 2.1).
from torch.fx.experimental.symbolic_shapes import statically_known_true

# The checkpoint module itself, for its global debug-mode flag (>= 2.1).
from torch.utils import checkpoint as _torch_checkpoint

# Dispatch modes: the base class, and the switch that lets a mode's own bookkeeping run below every mode (>= 2.0).
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

# Pytree helpers over nested outputs (>= 2.0).
from torch.utils._pytree import tree_leaves, tree_map

# Non-reentrant checkpoint internals: the early stop it raises inside recomputation once every saved tensor is back,
# and its registry of `determinism_check` names (both >= 2.1).
from torch.utils.checkpoint import CheckpointError, _allowed_determinism_checks_to_fns, _StopRecomputationError

__all__ = [
    "KEPT_OUTPUT_MUTATED",
    "RECOMPILE_LOGGER",
    "RECORD_FUNCTION_ENTER",
    "RECORD_FUNCTION_EXIT",
    "SAVED_VALUE_COMPARED_ON_THE_LEFT",
    "KeptOutputsServedAgain",
    "OpOverload",
    "OpOverloadPacket",
    "OptimizeContext",
    "OptimizedModule",
    "StopRecomputationError",
    "TorchDispatchMode",
    "aot_backends",
    "at_backward_end",
    "autograd_nodes_made",
    "below_current_modes",
    "buffer_version_counter",
    "checkpoint_codes",
    "checkpoint_debug_enabled",
    "checkpoint_saved_counter",
    "child_modules",
    "comm_hook_states",
    "compile_options",
    "compiled_call",
    "compiled_inner",
    "current_graph_task_id",
    "determinism_checks",
    "disable_current_modes",
    "dynamo_context",
    "dynamo_context_key",
    "fsdp1_flat_parameters",
    "functorch_config",
    "graphsafe_run_with_rng_state",
    "hit_recompile_limit",
    "hook_dicts",
    "hook_handles_made",
    "in_place_overload",
    "inductor_compilers",
    "innermost_backend",
    "is_checkpoint_hooks",
    "is_compiled_module",
    "is_fsdp1_parameter_view",
    "is_kept_output_mutation",
    "is_metadata_mismatch",
    "module_call",
    "module_path_steps",
    "no_python_dispatch",
    "own_buffers",
    "own_parameters",
    "random_only_through_dropout_p",
    "reentrant_backward_code",
    "returned_views",
    "returns_alias",
    "returns_what_it_wrote",
    "run_and_save_rng_state",
    "run_with_rng_state",
    "saved_tensors_hooks_codes",
    "saved_tensors_hooks_enabled",
    "set_compiled_call",
    "set_dynamo_context",
    "statically_known_true",
    "tree_leaves",
    "tree_map",
    "under_transform",
    "version_counter",
    "view_base",
    "waited",
    "writes_its_arguments",
    "written_tensors",
]

# Op overloads and their packets, as dispatch modes and selective-checkpointing policies receive them (>= 2.0).
OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket

StopRecomputationError = _StopRecomputationError
disable_current_modes = _disable_current_modes

# The ops `torch.profiler.record_function` runs as its scope opens (its name the first argument) and closes, which a
# dispatch mode sees (>= 2.0; `_record_function_enter_new` >= 1.13).
RECORD_FUNCTION_ENTER = torch.ops.profiler._record_function_enter_new.default
RECORD_FUNCTION_EXIT = torch.ops.profiler._record_function_exit._RecordFunction


def below_current_modes() -> contextlib.AbstractContextManager[Any]:
    """:func:`disable_current_modes` where a dispatch mode is active, and a context that does nothing (about 4 µs
    cheaper) where none is: the dispatch stack's length is read (>= 2.0).

    Example::

        >>> with below_current_modes():
        ...     torch.ones(1).sin()
        tensor([0.8415])
    """
    if torch._C._len_torch_dispatch_stack():
        return _disable_current_modes()
    return contextlib.nullcontext()


# A functional collective's result before its wait (tensor parallelism's all-reduce, `RowwiseParallel`): a wrapper
# whose inner tensor holds the result only once waited for (`trigger_wait` waits once, then hands the inner tensor
# back; checked on 2.13).
_AsyncCollectiveTensor: Any = None
if torch.distributed.is_available():  # a build without torch.distributed has none
    from torch.distributed._functional_collectives import AsyncCollectiveTensor as _AsyncCollectiveTensor


def waited(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or, for a functional collective's result not waited for yet, its values once the collective is
    done (the wait the op that uses it would make, made first; it is made once). ``AsyncCollectiveTensor`` and its
    ``trigger_wait``: checked on 2.13.

    Example::

        >>> values = torch.ones(2)
        >>> waited(values) is values
        True
    """
    if _AsyncCollectiveTensor is not None and isinstance(tensor, _AsyncCollectiveTensor):
        return tensor.trigger_wait()
    return tensor


def saved_tensors_hooks_enabled() -> bool:
    """Whether saved-tensor hooks may be registered here: ``False`` inside
    ``torch.autograd.graph.disable_saved_tensors_hooks``, which ``torch.func.grad``, ``vjp``, ``jacrev`` and
    ``hessian`` enter (no checkpoint can run there). ``_saved_tensors_hooks_is_enabled``: checked on 2.13.

    Example::

        >>> with torch.autograd.graph.disable_saved_tensors_hooks("not here"):
        ...     inside = saved_tensors_hooks_enabled()
        >>> inside, saved_tensors_hooks_enabled()
        (False, True)
    """
    return bool(torch._C._autograd._saved_tensors_hooks_is_enabled())  # type: ignore[attr-defined]


def under_transform(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is wrapped by a ``torch.func`` transform (``vmap``, ``grad``: a functorch wrapper), or a
    forward-mode AD level is open (dual tensors, ``torch.func.jvp``): values a dispatch mode must not reduce (a
    reduction of a dual argument inside a mode ends the process on 2.13, and unpacking one there fails an internal
    assert). ``is_functorch_wrapped_tensor`` and ``forward_ad._current_level``: checked on 2.13.

    Example::

        >>> from torch.autograd import forward_ad
        >>> with forward_ad.dual_level():
        ...     inside = under_transform(torch.ones(2))
        >>> inside, under_transform(torch.ones(2))
        (True, False)
    """
    return torch.autograd.forward_ad._current_level >= 0 or bool(
        torch._C._functorch.is_functorch_wrapped_tensor(tensor)
    )


# The functorch config the partitioner reads: `activation_memory_budget` (>= 2.4), `enable_autograd_cache` (>= 2.5).
functorch_config: Any = torch._functorch.config

# A block in which ops skip every Python dispatch mode and tensor subclass (>= 1.13): the sentinel's own reads, which
# a selective-checkpointing mode must not cache as the model's ops. A C++ guard, entered for every saved tensor where
# `disable_current_modes` would pop and push the mode stack in Python.
no_python_dispatch: Callable[[], Any] = torch._C._DisableTorchDispatch

# RNG functionalization: the forward saves the generator state a random op drew from, its recomputation replays it
# (>= 2.1); the graph-safe form CUDA graphs use (>= 2.7).
run_and_save_rng_state: Any = torch._prims.rng_prims.run_and_save_rng_state
run_with_rng_state: Any = torch._prims.rng_prims.run_with_rng_state
graphsafe_run_with_rng_state: Any = torch._prims.rng_prims.graphsafe_run_with_rng_state


def written_tensors(func: OpOverload, args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The tensors an op writes in place, as its schema declares them (``Tensor(a!)``, ``Tensor(a!)[]``), read from
    ``OpOverload._schema`` (>= 1.13)."""
    written: list[torch.Tensor] = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        written.extend(leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor))
    return written


def is_metadata_mismatch(error: BaseException) -> bool:
    """Whether ``error`` is the ``CheckpointError`` non-reentrant checkpointing raises when a recomputed tensor has
    another shape, dtype or device than the one the forward saved.

    torch tells it from its other ``CheckpointError`` (another number of tensors saved) by its message only:
    "torch.utils.checkpoint: Recomputed values for the following tensors have different metadata than during the
    forward pass.", matched on "different metadata". The message is the same from torch 2.1 (>= 2.1, where
    ``CheckpointError`` and this check of the recomputed tensors appeared) to 2.13 (read in its sources);
    ``tests/test_torch_compat.py`` pins it on the installed torch.

    Args:
        error: An error raised while a region was recomputed.

    Example::

        >>> is_metadata_mismatch(RuntimeError("different metadata")), is_metadata_mismatch(CheckpointError("other"))
        (False, False)
    """
    return isinstance(error, CheckpointError) and "different metadata" in str(error)


KEPT_OUTPUT_MUTATED = "Tensor cached during selective activation checkpoint has been mutated"
"""How torch's recompute context of selective checkpointing says that an op output it kept was written in place after
the forward kept it (>= 2.4; the same words to 2.13, read in its sources); ``tests/test_torch_compat.py`` pins it on the
installed torch."""


class KeptOutputsServedAgain:
    """torch's recompute context of selective checkpointing, serving the outputs its forward kept to every
    recomputation: torch's serves them to the first only, and a second backward through the graph
    (``retain_graph=True``) or a gradient penalty then fails ("Trying to backward an extra time"). At its first entry
    it copies the cache torch's forward filled (``_CachedTorchDispatchMode.storage``, a mapping of each op to its kept
    outputs, which torch marks consumed as it serves them; checked on 2.13, and copied one level deep whatever holds
    an op's entries) and puts that copy back at every later entry. The kept outputs then live as long as the graph
    that holds the context, not until their first use.

    Args:
        context: The recompute context ``create_selective_checkpoint_contexts`` returned.
    """

    __slots__ = ("_context", "_kept")

    def __init__(self, context: Any) -> None:
        self._context = context
        self._kept: dict[Any, Any] | None = None

    def __enter__(self) -> Any:
        storage = self._context.storage
        if self._kept is None:
            self._kept = {key: copy.copy(entries) for key, entries in storage.items()}
        else:
            storage.clear()
            storage.update({key: copy.copy(entries) for key, entries in self._kept.items()})
        return self._context.__enter__()

    def __exit__(self, kind: Any, error: BaseException | None, trace: Any) -> Any:
        return self._context.__exit__(kind, error, trace)


def is_kept_output_mutation(error: BaseException) -> bool:
    """Whether ``error`` is torch's refusal to give a recomputation an op output that selective checkpointing kept and
    the forward then wrote in place (a ``RuntimeError`` told by its message, :data:`KEPT_OUTPUT_MUTATED`; >= 2.4).

    Example::

        >>> is_kept_output_mutation(RuntimeError(KEPT_OUTPUT_MUTATED)), is_kept_output_mutation(ValueError("x"))
        (True, False)
    """
    return isinstance(error, RuntimeError) and str(error).startswith(KEPT_OUTPUT_MUTATED)


def random_only_through_dropout_p(func: OpOverload) -> bool:
    """Whether an op's randomness is a ``dropout_p`` argument of its schema (the attention kernels:
    ``_scaled_dot_product_flash_attention`` and its kin, tagged random for their dropout), read from
    ``OpOverload._schema`` (>= 1.13)."""
    return any(argument.name == "dropout_p" for argument in func._schema.arguments)


def in_place_overload(func: OpOverload) -> bool | None:
    """Whether an op overload that writes a positional tensor argument (``relu_``, ``_foreach_mul_``) returns only
    arguments it wrote, or nothing: what it gives back is its input written over. ``None`` for one that writes no
    positional tensor argument (a functional op, an ``out=`` form writing keyword-only ``out`` tensors, a list
    overload writing an ``int[]``). Read from ``OpOverload._schema`` (>= 1.13)."""
    written = [
        argument
        for argument in func._schema.arguments
        if argument.alias_info is not None and argument.alias_info.is_write and not argument.kwarg_only
    ]
    if not any(str(argument.type) in ("Tensor", "List[Tensor]") for argument in written):
        return None
    return all(ret.alias_info is not None and ret.alias_info.is_write for ret in func._schema.returns)


def returned_views(func: OpOverload) -> list[bool]:
    """For each return of an op, whether its schema declares it a view of an argument (``Tensor(a)``, not written),
    read from ``OpOverload._schema`` (>= 1.13)."""
    return [ret.alias_info is not None and not ret.alias_info.is_write for ret in func._schema.returns]


def returns_what_it_wrote(func: OpOverload) -> bool:
    """Whether an op writes an argument and returns it, or returns nothing: an ``out=`` form (``mm.out``) or an
    in-place op, whose outputs selective checkpointing cannot keep; an op that writes state and returns new tensors
    (a fused fake-quantize updating its observer) does not. Read from ``OpOverload._schema`` (>= 1.13)."""
    returns = func._schema.returns
    return bool(func._schema.is_mutable) and (
        not returns or any(ret.alias_info is not None and ret.alias_info.is_write for ret in returns)
    )


def writes_its_arguments(func: OpOverload) -> bool:
    """Whether an op's schema declares that it writes an argument (an in-place or ``out=`` op), read from
    ``OpOverload._schema`` (>= 1.13)."""
    return bool(func._schema.is_mutable)


def returns_alias(func: OpOverload) -> bool:
    """Whether any return of an op aliases an argument by its schema (a view, an in-place or ``out=`` op), read from
    ``OpOverload._schema`` (>= 1.13)."""
    return any(ret.alias_info is not None for ret in func._schema.returns)


autograd_nodes_made: Callable[[], int] = torch.autograd._get_sequence_nr
"""How many autograd nodes this thread has made so far: the sequence number the next one gets (``torch.autograd``,
>= 2.1; torch's FX tracer reads it too). The difference across a forward counts the nodes it made."""

current_graph_task_id: Callable[[], int] = torch._C._current_graph_task_id
"""The id of the backward (graph task) running now, ``-1`` outside any (``torch._C``, >= 2.1): torch's own function,
not wrapped, since the extractor asks it for every saved tensor."""


def determinism_checks() -> dict[str, Callable[..., Any]]:
    """torch's registry of ``determinism_check`` names for non-reentrant checkpointing (>= 2.1). The package adds its
    two names when it wraps its first region; it waits for a public registration API of torch's to do it without this
    private dictionary."""
    return _allowed_determinism_checks_to_fns


def _pack_hook_code() -> CodeType | None:
    """The code of the pack hook a non-reentrant checkpoint's forward pushes (``_checkpoint_hook``'s, >= 2.1)."""
    init = getattr(getattr(_torch_checkpoint, "_checkpoint_hook", None), "__init__", None)
    constants = getattr(getattr(init, "__code__", None), "co_consts", ())
    found = [code for code in constants if isinstance(code, CodeType) and code.co_name == "pack_hook"]
    return found[0] if len(found) == 1 and "frame" in found[0].co_freevars else None


_CHECKPOINT_PACK_HOOK = _pack_hook_code()
_FRAME_CELL = -1 if _CHECKPOINT_PACK_HOOK is None else _CHECKPOINT_PACK_HOOK.co_freevars.index("frame")


def checkpoint_saved_counter() -> Callable[[], int] | None:
    """Inside the forward of a non-reentrant checkpoint: what gives how many tensors that forward has saved so far
    (the holders of torch's ``_CheckpointFrame``, >= 2.1, reached through the pack hook on top of the saved-tensor hook
    stack, ``torch._C._autograd._top_saved_tensors_default_hooks``, >= 2.0). ``None`` where the hook on top is not a
    checkpoint's, or this torch's differs.

    Example::

        >>> checkpoint_saved_counter() is None  # outside any checkpoint
        True
    """
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    pack: Any = None if hooks is None else hooks[0]
    if _CHECKPOINT_PACK_HOOK is None or getattr(pack, "__code__", None) is not _CHECKPOINT_PACK_HOOK:
        return None
    holders = getattr(pack.__closure__[_FRAME_CELL].cell_contents, "weak_holders", None)
    return holders.__len__ if isinstance(holders, list) else None


def checkpoint_debug_enabled() -> bool:
    """Whether torch's checkpoint debug mode is on globally (``set_checkpoint_debug_enabled(True)``, >= 2.1): it then
    refuses any ``context_fn``."""
    return bool(_torch_checkpoint._checkpoint_debug_enabled)


def checkpoint_codes() -> frozenset[CodeType]:
    """The code of torch's checkpoint entry points: ``checkpoint`` itself (under its dynamo wrapper), the
    non-reentrant generator (which the composable ``checkpoint(module)`` enters directly) and the reentrant
    ``CheckpointFunction.forward`` (>= 2.1). A frame running one of them is inside a checkpoint call."""
    from torch.utils import checkpoint as torch_checkpoint

    return frozenset(
        {
            inspect.unwrap(torch_checkpoint.checkpoint).__code__,
            torch_checkpoint._checkpoint_without_reentrant_generator.__code__,
            torch_checkpoint.CheckpointFunction.forward.__code__,
        }
    )


def reentrant_backward_code() -> CodeType:
    """The code of the reentrant checkpoint's ``CheckpointFunction.backward`` (>= 2.1), which runs the checkpointed
    function again with grad enabled: a frame running it is a reentrant checkpoint's recomputation, whose call has
    returned."""
    return _torch_checkpoint.CheckpointFunction.backward.__code__


def saved_tensors_hooks_codes() -> tuple[CodeType, CodeType]:
    """The code of ``torch.autograd.graph.saved_tensors_hooks.__enter__`` and ``__exit__`` (>= 1.13), which every
    saved-tensor hooks context runs (``save_on_cpu``, ``allow_mutation_on_saved_tensors``, a user's own, and
    checkpoint's)."""
    hooks = torch.autograd.graph.saved_tensors_hooks
    return hooks.__enter__.__code__, hooks.__exit__.__code__


def is_checkpoint_hooks(hooks: object) -> bool:
    """Whether ``hooks`` are the non-reentrant checkpoint's own saved-tensor hooks, those of its forward or of its
    recomputation (``_checkpoint_hook``, ``_recomputation_hook``, >= 2.1)."""
    return isinstance(hooks, (_torch_checkpoint._checkpoint_hook, _torch_checkpoint._recomputation_hook))


def aot_backends() -> tuple[Any, Callable[..., Any], Callable[..., Any]]:
    """The ``aot_autograd`` backends the graph scan recompiles through: ``AotAutograd``, ``aot_eager`` and its
    backward compiler ``boxed_nop`` (>= 2.0), imported only when needed (they import inductor)."""
    from torch._dynamo.backends.common import AotAutograd
    from torch._dynamo.backends.debugging import aot_eager, boxed_nop

    return AotAutograd, aot_eager, boxed_nop


def inductor_compilers() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Inductor's ``compile_fx`` and its per-graph ``compile_fx_inner`` (>= 2.0), imported only when needed."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    return compile_fx, compile_fx_inner


def compiled_call(module: nn.Module) -> Any:
    """The compiled ``_call_impl`` that ``Module.compile()`` installs (>= 2.2), or ``None``."""
    return getattr(module, "_compiled_call_impl", None)


def set_compiled_call(module: nn.Module, call: Any) -> None:
    """Replace the compiled ``_call_impl`` of a module compiled with ``Module.compile()`` (the attribute
    :func:`compiled_call` reads, >= 2.2): the module's next call runs ``call``."""
    module._compiled_call_impl = call


def is_compiled_module(module: nn.Module) -> bool:
    """Whether ``module`` is a ``torch.compile`` wrapper (``OptimizedModule``, >= 2.0) or was compiled in place with
    ``Module.compile()`` (>= 2.2)."""
    return isinstance(module, OptimizedModule) or compiled_call(module) is not None


def fsdp1_flat_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """The flat parameters of every FSDP1 unit of ``model`` (``FullyShardedDataParallel``'s ``_handle``, >= 2.0)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    for unit in FullyShardedDataParallel.fsdp_modules(model):
        flat = getattr(getattr(unit, "_handle", None), "flat_param", None)
        if flat is not None:
            yield flat


def is_fsdp1_parameter_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view of an FSDP1 flat parameter (``FlatParameter``'s ``_is_flat_param`` flag, >= 2.1):
    one of the original parameters FSDP1 sets on a module as a plain tensor inside its forward and takes back after."""
    return bool(getattr(tensor._base, "_is_flat_param", False))


version_counter: Callable[[torch.Tensor], int] = operator.attrgetter("_version")
"""A tensor's version counter, ``Tensor._version``: bumped by every in-place write to it or to a view of it
(>= 1.0). A C-level getter: the sentinel reads every parameter's at each region call."""


def at_backward_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the backward under way has finished (``Variable._execution_engine.queue_callback``,
    as FSDP2 queues its final callback, >= 1.0). Call it from inside a backward (a tensor hook).

    Example::

        >>> ended = []
        >>> x = torch.ones(2, requires_grad=True)
        >>> y = (x * 2).sum()
        >>> _ = y.register_hook(lambda grad: at_backward_end(lambda: ended.append(x.grad is not None)))
        >>> y.backward()
        >>> ended
        [True]
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def buffer_version_counter(tensor: torch.Tensor) -> int:
    """:data:`version_counter` of a buffer or an input, ``-1`` for an inference tensor (made under
    ``torch.inference_mode()``: a cache that ``trainer.validate`` filled), which has none and which nothing outside
    inference mode can write (``Tensor.is_inference``, >= 1.9).

    Example::

        >>> with torch.inference_mode():
        ...     cache = torch.zeros(2)
        >>> buffer_version_counter(cache), buffer_version_counter(torch.zeros(2).add_(1))
        (-1, 1)
    """
    return -1 if tensor.is_inference() else tensor._version


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor a view was taken from, ``Tensor._base``; ``None`` for a tensor that is not a view (>= 1.0)."""
    return tensor._base


def comm_hook_states(module: nn.Module) -> list[object]:
    """The states of the Python communication hooks registered on a ``DistributedDataParallel`` module
    (``register_comm_hook``: PowerSGD's ``PowerSGDState`` ...), none for any other module (``_comm_hooks``, >= 2.0).

    Example::

        >>> comm_hook_states(torch.nn.Linear(2, 2))
        []
    """
    return [state for _, state in getattr(module, "_comm_hooks", ()) if state is not None]


def own_buffers(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """The buffers a module holds itself (not its submodules'), by key: ``Module._buffers``, the dict itself, so that
    an entry can be swapped without ``register_buffer``'s checks or a ``__setattr__`` hook (>= 1.0)."""
    buffers: dict[str, torch.Tensor | None] = module._buffers
    return buffers


def child_modules(attributes: Iterable[dict[str, Any]]) -> tuple[nn.Module | None, ...]:
    """The children of the modules whose ``vars`` are ``attributes``, in order: the values of each one's
    ``Module._modules`` (``None`` where one was registered as such; >= 1.0). Read at every call of a region, which
    compares them with the last call's (modules compare by identity) to see a submodule added, removed or replaced."""
    return tuple(chain.from_iterable([own["_modules"].values() for own in attributes]))


# The hook dictionaries of a module, each keyed by its hooks' handle ids (`Module.__init__`, >= 2.1, which added
# `_forward_hooks_always_called`; the `_with_kwargs` ones mark hooks of `_forward_hooks` and `_forward_pre_hooks`).
_HOOK_DICTS = (
    "_backward_pre_hooks",
    "_backward_hooks",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def hook_dicts(attributes: dict[str, Any]) -> list[dict[int, Any]]:
    """The hook dictionaries of a module, empty ones included, from its attribute dict (``vars(module)``), keyed by
    handle id (the dictionaries ``Module.__init__`` makes, >= 2.1).

    Example::

        >>> layer = torch.nn.Linear(2, 2)
        >>> handle = layer.register_forward_hook(lambda module, inputs, output: None)
        >>> [list(hooks) for hooks in hook_dicts(vars(layer)) if hooks] == [[handle.id]]
        True
    """
    return [attributes[name] for name in _HOOK_DICTS if name in attributes]


def hook_handles_made() -> int:
    """The id torch gives the next hook handle, one more for every hook registered in this process on any module or
    tensor (``RemovableHandle.next_id``, >= 1.0): a hook registered after this call has this id or a larger one.

    Example::

        >>> made = hook_handles_made()
        >>> torch.nn.Linear(2, 2).register_forward_hook(lambda *args: None).id >= made
        True
    """
    made: int = torch.utils.hooks.RemovableHandle.next_id
    return made


def own_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """The parameters a module holds itself (not its submodules'), by key: ``Module._parameters``, read without
    ``Module.__getattr__``'s slow path, for reads at every region call; FSDP2 swaps its parameters in this dict
    (>= 1.0)."""
    parameters: dict[str, nn.Parameter | None] = module._parameters
    return parameters


def compiled_inner(module: OptimizedModule) -> nn.Module:
    """The module a ``torch.compile`` wrapper compiles, ``OptimizedModule._orig_mod`` (>= 2.0)."""
    inner: nn.Module = module._orig_mod
    return inner


def module_call(module: nn.Module) -> Callable[..., Any]:
    """A module's uncompiled call, ``Module._call_impl``, which ``Module.compile()`` compiles (>= 2.2)."""
    call: Callable[..., Any] = module._call_impl
    return call


def dynamo_context(compiled: Any) -> OptimizeContext | None:
    """The dynamo context of a ``torch.compile`` wrapper (its ``dynamo_ctx``, >= 2.0) or of the compiled call a
    ``Module.compile()`` installs (a cell of its closure, >= 2.2); ``None`` for anything else."""
    if isinstance(compiled, OptimizedModule):
        return compiled.dynamo_ctx if isinstance(compiled.dynamo_ctx, OptimizeContext) else None
    cells = getattr(compiled, "__closure__", None) or ()
    return next((cell.cell_contents for cell in cells if isinstance(cell.cell_contents, OptimizeContext)), None)


def dynamo_context_key(compiled: Any) -> Any:
    """What identifies a compiled part across recompiles: a wrapper's ``dynamo_ctx`` (>= 2.0), else the compiled
    call itself."""
    return getattr(compiled, "dynamo_ctx", compiled)


def set_dynamo_context(wrapper: OptimizedModule, context: Any) -> None:
    """Make a ``torch.compile`` wrapper call through ``context``: set its ``dynamo_ctx`` and rebuild its forward
    (``OptimizedModule._initialize``, >= 2.0)."""
    wrapper.dynamo_ctx = context
    wrapper._initialize()


def compile_options(context: OptimizeContext) -> tuple[bool, Any]:
    """The ``fullgraph`` (>= 2.9) and ``dynamic`` (``_dynamic``, >= 2.0) a dynamo context was made with."""
    return bool(context.fullgraph), context._dynamic


RECOMPILE_LOGGER = "torch._dynamo.convert_frame"
"""The logger through which dynamo reports a frame that hit its recompile limit (>= 2.0; never through ``warnings``)."""


def hit_recompile_limit(message: str) -> bool:
    """Whether a record of :data:`RECOMPILE_LOGGER` says a frame hit a recompile limit: dynamo's text names the
    limit it hit, ``config.recompile_limit`` (``config.cache_size_limit`` before 2.6; checked on 2.13)."""
    return "hit config." in message


# The steps of dynamo's attribute path of a module in a graph's `nn_module_stack`: `.name`, `[0]`, `['key']`.
_PATH_STEP = re.compile(r"\.(\w+)|\[(\d+)\]|\[['\"]([^'\"]+)['\"]\]")


def module_path_steps(path: str) -> list[tuple[str, str, str]] | None:
    """The steps of dynamo's attribute path of a module (``L['self'].blocks[0]._modules['dropout']``, in a graph
    node's ``nn_module_stack``, >= 2.0): each an attribute, an index or a key (the others empty); ``None`` for a path
    that does not start at a local (``L[...]``)."""
    if not path.startswith("L["):
        return None
    return [tuple(step) for step in _PATH_STEP.findall(path[path.index("]") + 1 :])]  # type: ignore[misc]


SAVED_VALUE_COMPARED_ON_THE_LEFT = True
"""torch's non-reentrant checkpoint compares the value a ``determinism_check`` extractor gave at the forward with the
extractor's value of the recomputed tensor as ``saved != extract(recomputed)``, the saved value on the left
(``_CheckpointFrame.check_recomputed_tensors_match`` in ``torch/utils/checkpoint.py``), so the saved object's
``__ne__`` runs first, with the recomputed value as its argument. The sentinel's kept value relies on it, and the
package's ``Recomputed`` on the reflected ``__ne__`` that a kept ``dict`` of torch's metadata falls back to. The
comparison comes with ``determinism_check`` (>= 2.1); the operand order is checked on 2.13."""
