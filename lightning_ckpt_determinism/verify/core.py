"""What both check engines do alike: set a step's state and gradients aside, decide the verdict, name what could not
be compared.

The two-pass engine (:func:`~lightning_ckpt_determinism.check_recomputation`) and the live-step engine
(:func:`~lightning_ckpt_determinism.verify.live.check_live_step`) differ in which passes they run; the state they put
back, the rule that calls a divergence and the findings of a check that compared nothing are the same, and live here
once.
"""

import math
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from lightning_ckpt_determinism.checkpointing.wrapper import checkpointed_modules
from lightning_ckpt_determinism.verify.gradients import GradientStash, local_tensor
from lightning_ckpt_determinism.verify.reports import missing_reference_gradients, no_gradients
from lightning_ckpt_determinism.verify.state import StepState

__all__ = ["CheckScope", "gradients_diverge", "losses_differ", "region_modules", "uncomparable"]


class CheckScope:
    """The state a check's passes change, captured on entry, and the parameters' gradients, set aside on entry; both
    put back on exit, whatever is raised.

    The state is a :class:`~lightning_ckpt_determinism.verify.state.StepState`: random streams, buffers, torchmetrics
    states, plain Python attributes and the objects, arrays and tensors they hold, parameters written in place,
    training flags and grad mode. The gradients are set aside so that each pass
    starts from none, and given back last, so that a failure to restore the state cannot lose them.

    Args:
        module: The model whose state is captured.
        params: The parameters whose ``.grad`` is set aside.
        set_gradients_aside: Whether to set the gradients aside at all (a check that takes gradients with
            ``torch.autograd.grad`` never touches ``.grad``).
        clone_gradients: Set copies aside instead of the gradient tensors themselves (DDP with
            ``gradient_as_bucket_view=True``, whose buckets the next backward writes into).
        exclude_attributes: Attribute names the state leaves alone (see :class:`StepState`).
        written_parameters: Names of parameters the passes write in place: their values are captured too. ``None``
            (the default): every parameter's, each put back only where the passes wrote it (one copy of the
            parameters, this rank's shards, held while the scope is open).

    Example::

        >>> model = torch.nn.BatchNorm1d(2)
        >>> (model(torch.randn(4, 2)) ** 2).sum().backward()
        >>> with CheckScope(model, list(model.parameters())) as scope:
        ...     _ = model(torch.randn(4, 2))
        ...     model.weight.grad is None
        True
        >>> int(model.num_batches_tracked), model.weight.grad is not None
        (1, True)
    """

    def __init__(
        self,
        module: nn.Module,
        params: Sequence[torch.Tensor],
        *,
        set_gradients_aside: bool = True,
        clone_gradients: bool = False,
        exclude_attributes: Iterable[str] = (),
        written_parameters: Iterable[str] | None = None,
    ) -> None:
        self._module = module
        self._params = params
        self._set_aside = set_gradients_aside
        self._clone = clone_gradients
        self._exclude = tuple(exclude_attributes)
        self._written = None if written_parameters is None else tuple(written_parameters)
        self._state: StepState | None = None
        self._stash: GradientStash | None = None

    def __enter__(self) -> "CheckScope":
        self._state = StepState(self._module, self._exclude, self._written)
        if self._set_aside:
            self._stash = GradientStash(self._params, clone=self._clone)
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.restore()
        finally:
            if self._stash is not None:
                self._stash.put_back()

    @property
    def state(self) -> StepState:
        """The state captured on entry."""
        if self._state is None:
            raise RuntimeError("lightning_ckpt_determinism: a `CheckScope` has a state only inside its `with` block.")
        return self._state

    @property
    def gradients(self) -> list[torch.Tensor | None]:
        """The gradients set aside, as this rank's tensors (shards of sharded ones), in the order of the parameters."""
        grads = self._stash.gradients if self._stash is not None else [None] * len(self._params)
        return [None if grad is None else local_tensor(grad) for grad in grads]

    def unrestored(self) -> list[str]:
        """The parameters written in place since entry that the scope has no copy of (see
        :meth:`~lightning_ckpt_determinism.verify.state.StepState.unrestored_parameters`)."""
        return self._state.unrestored_parameters() if self._state is not None else []

    def restore(self) -> None:
        """Put the captured state back (not the gradients: those come back on exit); can be called any number of
        times."""
        if self._state is not None:
            self._state.restore()


def gradients_diverge(divergence: float, tolerance: float, noise_floor: float, *, error: str | None = None) -> bool:
    """The verdict on a check's gradients: a divergence above both the tolerance and the noise floor, or a check that
    could not compare them (``error``), which never passes.

    Args:
        divergence: The relative L2 divergence of the gradients (``grad_divergence``).
        tolerance: The largest divergence that still counts as equal.
        noise_floor: What two reference passes differ by, with a margin (``0.0`` when not calibrated).
        error: Why the gradients could not be compared; ``None`` when they were.

    Example::

        >>> gradients_diverge(1e-6, 0.0, 1e-5), gradients_diverge(1e-4, 0.0, 1e-5)
        (False, True)
        >>> gradients_diverge(0.0, 0.0, 0.0, error="the check could not compare gradients: ...")
        True
    """
    return error is not None or divergence > max(tolerance, noise_floor)


def uncomparable(
    missing: Sequence[str], *, missing_anywhere: bool, gradients_anywhere: bool, live: str, nowhere: str
) -> str | None:
    """Why a check could not compare gradients, or ``None`` when it could: nothing compared is a finding, never
    ``0.0``.

    Args:
        missing: The parameters (on this rank) the reference pass gave no gradient where the other pass gave one.
        missing_anywhere: Whether any rank has such a parameter.
        gradients_anywhere: Whether any parameter received a gradient in either pass, on any rank.
        live: The pass the reference is compared with, as the finding names it (``"the live step"``).
        nowhere: Where no gradient was found, as the finding says it (``"in either pass"``).

    Example::

        >>> uncomparable([], missing_anywhere=False, gradients_anywhere=False, live="the live step", nowhere="anywhere")
        'the check could not compare gradients: no parameter received a gradient anywhere'
        >>> uncomparable([], missing_anywhere=False, gradients_anywhere=True, live="the live step", nowhere="anywhere")
    """
    if missing_anywhere:
        return missing_reference_gradients(list(missing), live)
    if not gradients_anywhere:
        return no_gradients(nowhere)
    return None


def losses_differ(first: float, second: float) -> bool:
    """Whether two finite losses differ: two passes of one step from one state that compute other losses before any
    backward differ by state outside the checkpointed regions (recomputation happens in backward).

    Args:
        first: One pass's loss.
        second: The other pass's loss (``nan`` when it raised).

    Example::

        >>> losses_differ(1.0, 1.5), losses_differ(1.0, float("nan"))
        (True, False)
    """
    return math.isfinite(first) and math.isfinite(second) and first != second


def region_modules(module: nn.Module) -> list[nn.Module]:
    """Every module inside a checkpointed region of ``module``: those whose code recomputation reruns.

    Args:
        module: The model.

    Example::

        >>> from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Tanh()))
        >>> _ = apply_activation_checkpointing(model, CheckpointingConfig(names=["1"]))
        >>> [type(sub).__name__ for sub in region_modules(model)]
        ['Sequential', 'Tanh']
    """
    return [sub for region in checkpointed_modules(module).values() for sub in region.modules()]
