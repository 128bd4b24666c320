"""Every private torch API the package uses, in one place, each with the torch versions it is known in.

A torch upgrade touches this file only. The versions are those of the API's first release, read from each release's
sources; the newest of them (``SelectiveCheckpointContext.op_output``, 2.12, read by the compiled routing policy)
sets the package's floor. The package is tested on the versions its README names. Nothing here imports Lightning.
"""

import inspect
from collections.abc import Callable, Iterator
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
from torch.utils.checkpoint import _allowed_determinism_checks_to_fns, _StopRecomputationError

__all__ = [
    "SAVED_VALUE_COMPARED_ON_THE_LEFT",
    "OpOverload",
    "OpOverloadPacket",
    "OptimizeContext",
    "OptimizedModule",
    "StopRecomputationError",
    "TorchDispatchMode",
    "aot_backends",
    "checkpoint_codes",
    "checkpoint_debug_enabled",
    "compiled_call",
    "current_graph_task_id",
    "determinism_checks",
    "disable_current_modes",
    "fsdp1_flat_parameters",
    "functorch_config",
    "graphsafe_run_with_rng_state",
    "inductor_compilers",
    "innermost_backend",
    "is_compiled_module",
    "no_python_dispatch",
    "run_and_save_rng_state",
    "run_with_rng_state",
    "set_compiled_call",
    "statically_known_true",
    "tree_leaves",
    "tree_map",
    "written_tensors",
]

# Op overloads and their packets, as dispatch modes and selective-checkpointing policies receive them (>= 2.0).
OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket

StopRecomputationError = _StopRecomputationError
disable_current_modes = _disable_current_modes

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


def current_graph_task_id() -> int:
    """The id of the backward (graph task) running now, ``-1`` outside any (``torch._C``, >= 2.1)."""
    return int(torch._C._current_graph_task_id())


def determinism_checks() -> dict[str, Callable[..., Any]]:
    """torch's registry of ``determinism_check`` names for non-reentrant checkpointing (>= 2.1)."""
    return _allowed_determinism_checks_to_fns


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


SAVED_VALUE_COMPARED_ON_THE_LEFT = True
"""torch's non-reentrant checkpoint compares the value a ``determinism_check`` extractor gave at the forward with the
extractor's value of the recomputed tensor as ``saved != extract(recomputed)``, the saved value on the left
(``_CheckpointFrame.check_recomputed_tensors_match`` in ``torch/utils/checkpoint.py``), so the saved object's
``__ne__`` runs first, with the recomputed value as its argument. The sentinel's kept value relies on it, and the
package's ``Recomputed`` on the reflected ``__ne__`` that a kept ``dict`` of torch's metadata falls back to. The
comparison comes with ``determinism_check`` (>= 2.1); the operand order is checked on 2.13."""
