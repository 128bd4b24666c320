"""The one process-wide state the checkpointed regions read: whether a check has switched checkpointing off.

A plain object rather than a ContextVar, because dynamo cannot trace a ContextVar read (it breaks the graph, and then
fails on the checkpoint call), and a check switches every region of the process off at once: the traced path reads
``disabled``, a bool dynamo guards on, so that switching checkpointing off compiles one more graph, once, whatever the
nesting depth. It changes only inside :func:`~lightning_ckpt_determinism.checkpointing.wrapper.checkpointing_disabled`.
Everything else a region reads belongs to its wrapper (its plan, its profile, the observers registered on its model),
and the region call whose forward runs now is context-local
(:class:`~lightning_ckpt_determinism.checkpointing.determinism_check.InRegionCall`).

Threads: one training thread per model. The counters here and on each wrapper (``plain_depth``, the profiles, the
observers' counts) are plain Python values, changed without a lock by the training thread, or by autograd's backward
thread (which recomputes) while the training thread waits in ``backward``. Two threads that train models of one
process at once are not supported while either runs a check: the switch is process-wide, so the other thread's
regions would run plainly too.
"""

__all__: list[str] = []


class _Switch:
    def __init__(self) -> None:
        self.depth = 0
        self.disabled = False


_SWITCH = _Switch()
