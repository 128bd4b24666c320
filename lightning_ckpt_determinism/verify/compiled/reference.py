"""What a recomputation check does differently when the model, or a checkpointed region of it, is compiled.

Under ``torch.compile`` recomputation happens inside the compiled backward graph: the partitioner decides what to
recompute, and the compiler replays RNG and updates buffers by itself. A check then compares the live compiled,
checkpointed step with a reference pass compiled with checkpointing off *and* with
``torch._functorch.config.activation_memory_budget`` at 1.0, so that the partitioner recomputes nothing on its own
in the reference: a recomputation bug of the compiler (pytorch#190717: dropout redrawn when the budget is below 1)
shows in the live step only. The budget is read when a graph is compiled, and a graph may be compiled again at any
later call (a last partial batch, a new shape), so :func:`reference_pass` applies it around every reference call,
not only the first.

Per-op attribution observes eager dispatch, so it runs under :func:`eager_semantics`: its findings are those of the
same step run eagerly. A divergence of the compiled step that the eager step does not show is the compiler's
(``compiler_recompute``).

The engine of the live-step check uses the same helpers for its reference pass.
"""

import contextlib
import functools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_ckpt_determinism._torch_compat import functorch_config, is_compiled_module
from lightning_ckpt_determinism.checkpointing.foreign import foreign_checkpointing_off
from lightning_ckpt_determinism.checkpointing.wrapper import checkpointing_disabled, run_plainly

__all__ = ["eager_semantics", "is_compiled", "reference_pass"]


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` or any of its submodules is compiled (``torch.compile(module)`` or ``module.compile()``).

    A compiled function that is not a module's (a compiled ``training_step``) is not seen; the reference pass is
    compile-correct anyway, only the eager attribution depends on this.

    Args:
        module: The model.

    Example::

        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> is_compiled(model)
        False
        >>> model[0].compile(backend="eager")
        >>> is_compiled(model)
        True
    """
    return any(is_compiled_module(sub) for sub in module.modules())


@contextlib.contextmanager
def reference_pass(plain: Iterable[nn.Module] | None = None, model: nn.Module | None = None) -> Iterator[None]:
    """Run a check's reference pass: checkpointing off (transformers' own on ``model`` too), and no recomputation
    chosen by the compiler either.

    Enter it around every reference call (each forward and backward of the reference), compiled or not: it costs
    nothing eagerly, and a graph compiled during the call, first or later, is compiled with the budget at 1.0.
    Checkpointing off compiles one graph more per compiled frame, once.

    Args:
        plain: The checkpointed modules to run plainly; ``None`` for all of them. Each subset is another set of
            guards for a compiled region, so a compiled model should keep to ``None``.
        model: The model the pass runs, whose transformers' gradient checkpointing is switched off for it (see
            :func:`~lightning_ckpt_determinism.checkpointing.foreign.foreign_checkpointing_off`).

    Example::

        >>> model = torch.nn.Linear(2, 1)
        >>> with reference_pass():
        ...     loss = model(torch.ones(1, 2)).sum()
        ...     torch._functorch.config.activation_memory_budget
        1.0
    """
    checkpointing_off = checkpointing_disabled() if plain is None else run_plainly(plain)
    with checkpointing_off, foreign_checkpointing_off(model), _whole_budget():
        yield


@functools.cache
def _whole_budget() -> Any:
    """The one patch of the compiler's ``activation_memory_budget`` to 1.0 that every reference pass enters (it nests):
    torch makes a context variable for each patch object, which stays in the caller's context after it exits, so a
    patch made per pass would leave one more at every check."""
    return functorch_config.patch(activation_memory_budget=1.0)


def eager_semantics() -> contextlib.AbstractContextManager[None]:
    """Run compiled modules eagerly inside this block (``torch.compiler.set_stance("force_eager")``).

    Example::

        >>> model = torch.nn.Linear(2, 1)
        >>> model.compile(backend="eager")
        >>> with eager_semantics():
        ...     loss = model(torch.ones(1, 2)).sum()
    """
    return torch.compiler.set_stance("force_eager")  # type: ignore[return-value]
