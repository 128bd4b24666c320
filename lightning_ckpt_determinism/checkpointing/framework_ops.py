"""The ops a framework runs inside a region for itself, left out wherever a region's op calls are counted or compared.

An FSDP2 unit inside a checkpointed region gathers its parameters in its forward's hooks, inside the region, and
again, otherwise or not at all, around the region's recomputation: those ops are FSDP2's, not the region's. FSDP2 runs
them inside ``record_function`` scopes named ``FSDP::...``, whose enter and exit are ops of the ``profiler``
namespace. Counting op calls by position (a ``budget_granularity="op"`` plan, the meter that measured it) or comparing
them one by one (attribution) must leave out both those scopes' ops and the profiler's own.
"""

from typing import Any

from lightning_ckpt_determinism._torch_compat import RECORD_FUNCTION_ENTER, RECORD_FUNCTION_EXIT

__all__ = ["FrameworkOps"]

FRAMEWORK_SCOPES = ("FSDP::",)
"""How the ``record_function`` scopes of a framework's own work inside a region are named (FSDP2's hooks)."""


class FrameworkOps:
    """Follows the ``record_function`` scopes of one forward or recomputation of a region, op by op.

    Example::

        >>> import torch
        >>> from torch.utils._python_dispatch import TorchDispatchMode
        >>> class Kept(TorchDispatchMode):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.framework, self.ops = FrameworkOps(), []
        ...     def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ...         if not self.framework.skips(func, args):
        ...             self.ops.append(str(func))
        ...         return func(*args, **(kwargs or {}))
        >>> with Kept() as mode:
        ...     with torch.profiler.record_function("FSDP::pre_forward"):
        ...         _ = torch.ones(2) * 2  # the framework's
        ...     _ = torch.ones(2) + 1
        >>> mode.ops
        ['aten.ones.default', 'aten.add.Tensor']
    """

    __slots__ = ("_depth",)

    def __init__(self) -> None:
        # How deep inside a framework's scope the ops run (0: outside every one).
        self._depth = 0

    def skips(self, func: Any, args: Any) -> bool:
        """Whether ``func``, called with ``args``, is left out: a profiler op, or any op inside a framework's scope.
        Call it for every op, in order.

        Args:
            func: The op.
            args: Its positional arguments (an entered scope's name is the first).
        """
        if getattr(func, "namespace", None) != "profiler":
            return self._depth > 0
        if func is RECORD_FUNCTION_ENTER:
            named = bool(args) and isinstance(args[0], str) and args[0].startswith(FRAMEWORK_SCOPES)
            self._depth += self._depth > 0 or named
        elif func is RECORD_FUNCTION_EXIT and self._depth:
            self._depth -= 1
        return True
