"""Another activation checkpointing inside or around a region, found at the region's first forward and warned once.

Nested checkpointing is not wrong, but it recomputes the inner part once more in backward for no memory saved, and
this package's checks cannot see into a checkpoint of someone else's. The usual cause is stacking two libraries:
transformers' ``gradient_checkpointing_enable()``, torch's ``CheckpointWrapper`` (``checkpoint_wrapper``,
``torch.distributed.algorithms._checkpoint``), torch's composable ``checkpoint(module)``, or a
``torch.utils.checkpoint.checkpoint`` call in the forward. Saved-tensor hooks entered inside a region
(``torch.autograd.graph.save_on_cpu``, a user's own ``saved_tensors_hooks``) are warned of alike: autograd gives the
tensors saved under them to those hooks rather than to checkpointing, so the region keeps them and recomputes
nothing of them.

The probe (:func:`probing_for_nesting`) is the package's only frame inspection, and it is active only inside its
block: once per region, around its first eager forward with grad enabled, it looks for a checkpoint call among the
frames above the region's call (a checkpoint around it), and a profile function (``sys.setprofile``, set only while
that forward runs and only if no profiler is set) catches a checkpoint or saved-tensor hooks entered inside it.
"""

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from types import CodeType, FrameType
from typing import Any

import torch

from lightning_ckpt_determinism._torch_compat import (
    checkpoint_codes,
    is_checkpoint_hooks,
    reentrant_backward_code,
    saved_tensors_hooks_codes,
)
from lightning_ckpt_determinism.errors import LightningCkptDeterminismWarning

__all__ = ["probing_for_nesting"]

# Frames of torch's files, and of `contextlib` (hooks made by a generator, as `allow_mutation_on_saved_tensors`), are
# passed through: the hooks' caller is the first frame outside them.
_PASSED_THROUGH = (os.path.join(os.path.dirname(torch.__file__), ""), contextlib.__file__)
# Frames of these files are torch's checkpoint machinery or its dynamo wrappers, never the caller.
_MACHINERY = tuple(
    os.path.join("torch", *parts)
    for parts in (("utils", "checkpoint.py"), ("_dynamo", "eval_frame.py"), ("_compile.py",))
)


class NestedCheckpoint:
    """The other checkpointing, as told by the frame that called into it.

    Args:
        frame: The first frame outside torch's checkpoint machinery that led to the checkpoint call, ``None`` for a
            reentrant checkpoint found in its backward (the call that made it has returned).
        region_code: The code of the package's region call, to tell a region of its own.
        region: The region call the probe runs in (the wrapper), to tell a region calling itself.
    """

    def __init__(self, frame: FrameType | None, region_code: CodeType, region: object) -> None:
        self.recursion = frame is not None and frame.f_code is region_code and frame.f_locals["self"] is region
        self.what, self.fix = _describe(frame, region_code, recursion=self.recursion)


def _describe(frame: FrameType | None, region_code: CodeType, *, recursion: bool) -> tuple[str, str]:
    if frame is None:
        return (
            "a reentrant checkpoint (`use_reentrant=True`), which runs the region once more in its backward",
            "remove it, or leave this module out of the `CheckpointingConfig`",
        )
    code = frame.f_code
    where = f"{getattr(code, 'co_qualname', code.co_name)} ({code.co_filename}:{frame.f_lineno})"
    if recursion:
        return (
            f"the same region, `{frame.f_locals['self'].region}`, whose forward calls the module itself",
            "recurse through a function the forward calls rather than through the module, or checkpoint a module"
            " around the recursion instead",
        )
    if code is region_code:
        return (
            f"another region of this package, `{frame.f_locals['self'].region}`",
            "select either the outer or the inner modules in one `CheckpointingConfig`, not both",
        )
    if os.path.join("transformers", "") in code.co_filename:
        return (
            "transformers' gradient checkpointing (`activation_checkpointing_enable()`, formerly"
            " `gradient_checkpointing_enable()`)",
            "do not call `activation_checkpointing_enable()` or `gradient_checkpointing_enable()` (or call the"
            " matching `..._disable()`): this package's regions replace it",
        )
    if code.co_filename.endswith(os.path.join("_checkpoint", "checkpoint_wrapper.py")):
        return (
            "torch's `CheckpointWrapper`",
            "drop `checkpoint_wrapper` / torch's `apply_activation_checkpointing` and keep this package's",
        )
    if code.co_filename.endswith(os.path.join("_composable", "checkpoint_activation.py")):
        return "torch's composable `checkpoint(module)`", "drop that `checkpoint(module)` call and keep this package's"
    return (
        f"a checkpoint call in {where}",
        "remove that call, or leave this module out of the `CheckpointingConfig`",
    )


def _caller(frame: FrameType | None) -> FrameType | None:
    """The first frame from ``frame`` outwards that is not torch's checkpoint machinery."""
    while frame is not None and frame.f_code.co_filename.endswith(_MACHINERY):
        frame = frame.f_back
    return frame


@contextmanager
def probing_for_nesting(region_class: str, region_code: CodeType) -> Iterator[None]:
    """Look for another checkpointing around and inside the block, a region's first eager forward, and warn once of
    each kind found: one around it at once, one inside it when the block ends.

    Args:
        region_class: The region's class name, as the warnings name it.
        region_code: The code of the package's region call (the frame in the stack above the block whose callers are
            "around").
    """
    frame: FrameType | None = sys._getframe()
    while frame is not None and frame.f_code is not region_code:
        frame = frame.f_back
    region = None if frame is None else frame.f_locals["self"]
    around = _checkpoint_around(frame, region_code, region)
    if around is not None:
        _warn_nested(region_class, around, inside=False)
    with _checkpoints_inside(region_code, region) as (inside, hooks):
        yield
    if inside:
        _warn_nested(region_class, inside[0], inside=True)
    if hooks:
        _warn_hooks(region_class, hooks[0])


def _checkpoint_around(frame: FrameType | None, region_code: CodeType, region: object) -> NestedCheckpoint | None:
    """The checkpoint call among the frames above the region's own call ``frame``, if there is one: a checkpoint
    call, or the backward of a reentrant one, which runs its function again with grad enabled."""
    codes = checkpoint_codes()
    frame = None if frame is None else frame.f_back
    while frame is not None:
        if frame.f_code is reentrant_backward_code():
            return NestedCheckpoint(None, region_code, region)
        if frame.f_code in codes:
            return NestedCheckpoint(_caller(frame), region_code, region)
        frame = frame.f_back
    return None


@contextmanager
def _checkpoints_inside(region_code: CodeType, region: object) -> Iterator[tuple[list[NestedCheckpoint], list[str]]]:
    """Collect the checkpoint calls and the saved-tensor hooks (described) entered inside this block (in this
    thread); nothing if a profiler is set. Hooks open around a checkpoint call come with it (transformers'
    offloading checkpoint enters `save_on_cpu` around its `checkpoint`): the checkpoint's warning covers them."""
    found: list[NestedCheckpoint] = []
    hooks: list[str] = []
    if sys.getprofile() is not None:
        yield found, hooks
        return
    codes = checkpoint_codes()
    entered, exited = saved_tensors_hooks_codes()
    # Each use of the user's hooks: described, or None once a checkpoint was called while it was open; and the entries
    # not left yet, each with the hooks entered (alive while open, so that an identity names one object).
    entries: list[list[str | None]] = []
    open_entries: list[tuple[object, list[str | None]]] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code in codes:
            if not found:
                found.append(NestedCheckpoint(_caller(frame.f_back), region_code, region))
            for _, entry in open_entries:
                entry[0] = None
        elif code is entered or code is exited:
            held = frame.f_locals["self"]
            if is_checkpoint_hooks(held):
                return
            if code is entered:
                # Entered again while open (`with hooks:` inside `with hooks:`): the same use of them.
                again = [entry for other, entry in open_entries if other is held]
                entry = again[0] if again else [_hooks_entered(frame)]
                if not again:
                    entries.append(entry)
                open_entries.append((held, entry))
            else:  # the latest entry into these hooks is left
                last = max((at for at, (other, _) in enumerate(open_entries) if other is held), default=None)
                if last is not None:
                    del open_entries[last]

    sys.setprofile(profile)
    try:
        yield found, hooks
    finally:
        sys.setprofile(None)
        hooks.extend(entry[0] for entry in entries if entry[0] is not None)


def _hooks_entered(frame: FrameType) -> str:
    """The saved-tensor hooks whose ``__enter__`` runs in ``frame``, and the first frame outside torch that entered
    them."""
    name = type(frame.f_locals["self"]).__name__
    caller = frame.f_back
    while caller is not None and caller.f_code.co_filename.startswith(_PASSED_THROUGH):
        caller = caller.f_back
    if caller is None:
        return f"`{name}`"
    code = caller.f_code
    return f"`{name}` entered in {getattr(code, 'co_qualname', code.co_name)} ({code.co_filename}:{caller.f_lineno})"


def _warn_hooks(region_class: str, hooks: str) -> None:
    """Warn once that regions of ``region_class`` enter saved-tensor hooks inside them, which autograd gives the
    tensors saved under them instead of checkpointing."""
    warnings.warn(
        f"lightning_ckpt_determinism: checkpointed `{region_class}` regions enter saved-tensor hooks inside them:"
        f" {hooks}. Autograd gives the tensors saved under them to those hooks, not to checkpointing: they are kept"
        " (or offloaded) rather than recomputed, and the checks cannot compare them. Enter the hooks around the"
        " checkpointed module instead (around the step), or leave this module out of the `CheckpointingConfig`.",
        LightningCkptDeterminismWarning,
        stacklevel=2,
    )


def _warn_nested(region_class: str, nested: NestedCheckpoint, *, inside: bool) -> None:
    """Warn once that regions of ``region_class`` have ``nested`` inside (or around) them.

    Args:
        region_class: The region's class name (the warning leaves out the region's name, so that the warnings
            registry shows it once for all regions of the class).
        nested: The other checkpointing.
        inside: Whether it runs inside the region (else around it).
    """
    # A region in itself is checkpointed by this package alone, which the checks see into.
    unseen = "" if nested.recursion else ", and this package's checks cannot see into the other one"
    warnings.warn(
        f"lightning_ckpt_determinism: checkpointed `{region_class}` regions have another activation checkpointing"
        f" {'inside' if inside else 'around'} them: {nested.what}. Nested checkpointing recomputes the inner part"
        f" once more in backward for no memory saved{unseen}: {nested.fix}.",
        LightningCkptDeterminismWarning,
        stacklevel=2,
    )
