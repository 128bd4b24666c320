"""The one piece of process-wide state the checkpointed regions read: what a check changes in every region.

A plain object rather than ContextVars, because dynamo cannot trace a ContextVar read (it breaks the graph, and then
fails on the checkpoint call). The traced path reads only ``disabled``, a bool dynamo guards on: switching
checkpointing off compiles one more graph, once, whatever the nesting depth. The observers are read only by eager
calls, so compiled graphs never guard on them. The state is per process, not per thread, and changes only inside the
context managers that own a field each: ``checkpointing_disabled`` (``depth``, ``disabled``), ``observing``
(``observer``) and ``observing_saved_tensors`` (``saved_observer``).
"""

from typing import Any

__all__: list[str] = []


class _Switch:
    def __init__(self) -> None:
        self.depth = 0
        self.disabled = False
        # A RegionObserver (see `wrapper`) and a SavedTensorObserver (see `saved`), when one is registered.
        self.observer: Any = None
        self.saved_observer: Any = None


_SWITCH = _Switch()
