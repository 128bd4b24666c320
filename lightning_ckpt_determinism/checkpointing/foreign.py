"""Another library's activation checkpointing, switched off for a check's reference pass.

A reference pass must run without recomputation anywhere: a region of this package runs plainly inside
:func:`~lightning_ckpt_determinism.checkpointing.wrapper.checkpointing_disabled`, but transformers' own gradient
checkpointing (``gradient_checkpointing_enable()``, a ``gradient_checkpointing`` flag on its layers) stacked on the
package's regions would still recompute its layers there, so a defect inside them would be in both passes and cancel
out. Its flags are switched off for the pass and put back after, whatever is raised. Other checkpointing (torch's
``CheckpointWrapper``, a ``checkpoint`` call in a forward) has no switch: the nesting warning names it.
"""

import contextlib
from collections.abc import Iterator

from torch import nn

__all__ = ["foreign_checkpointing_off"]


@contextlib.contextmanager
def foreign_checkpointing_off(module: nn.Module | None) -> Iterator[None]:
    """Run ``module`` with transformers' gradient checkpointing off inside this block (its layers' flags put back
    after); nothing for ``None`` or a module without it.

    Args:
        module: The model the reference pass runs, or ``None``.

    Example::

        >>> layer = nn.Linear(2, 2)
        >>> layer.gradient_checkpointing = True  # as transformers' `gradient_checkpointing_enable()` sets it
        >>> with foreign_checkpointing_off(layer):
        ...     layer.gradient_checkpointing
        False
        >>> layer.gradient_checkpointing
        True
    """
    # The flag as its layers hold it (`vars`: a class attribute or a property is not transformers' switch).
    flagged = (
        [] if module is None else [sub for sub in module.modules() if vars(sub).get("gradient_checkpointing") is True]
    )
    for sub in flagged:
        setattr(sub, "gradient_checkpointing", False)  # noqa: B010 - a flag nn.Module's own typing does not know
    try:
        yield
    finally:
        for sub in flagged:
            setattr(sub, "gradient_checkpointing", True)  # noqa: B010
