"""The sentinel: every tensor a checkpointed region saves for backward, compared after its recomputation with the
forward's, through digests, on every step.

Inside :func:`recomputation_sentinel` the sentinel is torch's ``determinism_check`` extractor for every eagerly
checkpointed region (:mod:`~lightning_ckpt_determinism.checkpointing.determinism_check`). At the region's forward, torch
hands it each tensor it saves, before the op that saves it has run. The sentinel digests each on its device (a row and a
column reduction, in :mod:`~lightning_ckpt_determinism.verify.digest`) once its value is final: at once where the
region's profile (:mod:`~lightning_ckpt_determinism.checkpointing.profile`) says the op that saved it leaves it as it
was, at the forward's end where the profile says it is filled late (``rrelu_with_noise``'s ``noise``), and at the
forward's end for every tensor of a call the region learns from (its first, and the first of each kind of call: see the
profile's description). A call that took another code path than its profile (another number of saved tensors or autograd
nodes, or its output from another op) keeps what it digested as it went only where the profile of that path says the
value was final (all of it counts as not compared on a path the region has no profile of yet). It keeps each tensor's
position, metadata and the op that produced it. At the region's first unpack in backward, once the region is recomputed
to the end, torch compares each kept value with the recomputed tensor (``!=``): the sentinel compares the metadata at
once (a difference raises torch's ``CheckpointError`` as before, under ``determinism_check= "default"``) and digests the
recomputed tensor. Around each recomputation it also watches the region's state: a parameter whose version counter moves
(recomputation writes it in place) and a buffer whose values change where no recompute context puts them back (without
``protect_buffers``, BatchNorm updates its statistics a second time) are mismatches, with their cause. A parameter
written in place since the region's forward started (its version counter moved: the forward writes it) is digested
before and after each recomputation from then on, and counts only when its values changed: an ``Embedding`` with
``max_norm`` renormalises its weight again in recomputation, which changes nothing where the forward left its rows
within ``max_norm`` (in ``float32`` a renormalised row can come out an ulp above it, and the second renormalisation then
changes it: a real write, reported). The tensor states of the torchmetrics metrics inside a region are digested alike: a
metric updated in forward is updated again by recomputation. The comparisons stay on the device, read back later
(:meth:`RecomputationSentinel.report`, or :meth:`RecomputationSentinel.settle` once per training step, after one
comparison for the whole step). Nothing is read back to the host inside forward or backward, and the sentinel's own ops
run below every dispatch mode, so that a selective-checkpointing cache or a mode of the user's never takes them for the
model's.

What it compares: activations. Parameters and buffers, which torch saves by reference (``addmm`` saves
``weight.t()``) and which may change legitimately before the recomputation (BatchNorm's running statistics), are
recognised by their storage and left out of the saved tensors (their writes are watched as above). Opaque
workspaces (an RNN layer's, see :data:`~lightning_ckpt_determinism.checkpointing.profile.OPAQUE_WORKSPACES`),
saved tensors no op wrote (eval-mode ``rrelu_with_noise``'s ``noise``), tensors without bits to read and any tensor
the sentinel fails to read are left out and counted as not compared; a failure of its own is logged once and never
reaches training. What it cannot see: compiled regions are recomputed by the compiler, which calls no extractor
(they count as not compared; regions that graph-break run eagerly and are compared); Python values a wrapper tensor
subclass keeps beside its inner tensors (it reads a DTensor's shard, and a wrapper subclass such as a quantized
weight through the inner tensors of its ``__tensor_flatten__``; one with neither is left out, said once per region);
writes to parameters that bump no version counter; with sampled digests, a change of single elements shows only at
the steps whose offset reads them.
"""

import contextlib
import logging
from collections.abc import Iterator

from torch import nn

from lightning_ckpt_determinism.checkpointing.wrapper import observing_saved_tensors
from lightning_ckpt_determinism.verify.sentinel.observer import RecomputationSentinel, SentinelMode, tier_of
from lightning_ckpt_determinism.verify.sentinel.report import SentinelRegion, SentinelReport
from lightning_ckpt_determinism.verify.sentinel.step import SentinelStep

__all__ = [
    "RecomputationSentinel",
    "SentinelMode",
    "SentinelRegion",
    "SentinelReport",
    "SentinelStep",
    "recomputation_sentinel",
]

_log = logging.getLogger(__name__)


@contextlib.contextmanager
def recomputation_sentinel(
    module: nn.Module, *, mode: SentinelMode = "light", exact: bool | None = None
) -> Iterator[RecomputationSentinel]:
    """Compare what each checkpointed region of ``module`` saves, after its recomputation, with the forward's.

    Inside the block, each eager checkpointed forward keeps digests of the activations it saves for backward, and
    each recomputation is digested and compared on the device (see the package's description). Nothing is digested
    outside the block, and the sentinel's report counts what was compared inside it. It changes no value the model
    computes: gradients and random streams are exactly those without it.

    Args:
        module: The model whose checkpointed regions to watch.
        mode: What to digest. ``"light"`` (the default): per region call, the last saved tensor, the last
            floating-point one computed from the region's values (one that requires grad, unlike dropout's
            noise; neither is a tensor computed from parameters alone, such as a weight's autocast cast) and one
            more whose position rotates with :meth:`RecomputationSentinel.next_step`, each through a window of
            about one element in 16 of each row, the window moving on with the steps (every saved tensor is
            compared within as many steps as the region saves tensors). ``"sampled"``: every saved tensor, through
            that window. ``"exact"``: every element of every saved tensor.
        exact: Deprecated: ``True`` means ``mode="exact"``, ``False`` means ``mode="sampled"``.

    Yields:
        The :class:`RecomputationSentinel`; its :meth:`~RecomputationSentinel.report` gives what it found.

    Raises:
        ValueError: If ``mode`` is not one of :data:`SentinelMode`.

    Example::

        >>> import numpy as np
        >>> import torch
        >>> from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing
        >>> class Noisy(torch.nn.Module):
        ...     def forward(self, x):
        ...         return torch.tanh(x * float(np.random.rand()))  # tanh saves its output: it differs
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 32), Noisy())
        >>> _ = apply_activation_checkpointing(model, CheckpointingConfig(classes=["Noisy"]))
        >>> with recomputation_sentinel(model) as sentinel:
        ...     model(torch.ones(2, 4)).sum().backward()
        >>> sentinel.report().regions["1"].mismatches
        1
    """
    # A generator's caller is two frames up: contextlib's `__enter__`, then the `with`.
    sentinel = RecomputationSentinel(module, mode=tier_of(mode, exact, stacklevel=4))
    if sentinel.compiled:
        _log.info(
            "lightning_ckpt_determinism: the sentinel does not see inside compiled checkpointed regions (%s): the"
            " compiler recomputes them; they count as not compared, and regions that graph-break run eagerly and are"
            " compared.",
            ", ".join(sentinel.compiled),
        )
    with observing_saved_tensors(sentinel, module):
        yield sentinel
