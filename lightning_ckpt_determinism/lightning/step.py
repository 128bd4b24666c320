"""Run a LightningModule's training step for a check: capture the live step's start, rerun it, without logging."""

import contextlib
import functools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import nn

from lightning_ckpt_determinism._torch_compat import at_backward_end
from lightning_ckpt_determinism.checkpointing.rng import RNGState, capture_rng, same_host_rng, same_torch_rng
from lightning_ckpt_determinism.checkpointing.wrapper import buffers_read_otherwise, recomputations, replays_torch_rng
from lightning_ckpt_determinism.lightning.comm_hooks import CommHookStates
from lightning_ckpt_determinism.lightning.optimizer_settings import OptimizerSettings
from lightning_ckpt_determinism.lightning.parallel import agree
from lightning_ckpt_determinism.verify.compiled import reference_pass
from lightning_ckpt_determinism.verify.core import region_modules
from lightning_ckpt_determinism.verify.state import StateMark, StepState
from lightning_ckpt_determinism.verify.two_pass import SkippedPass

__all__ = [
    "SkippedStep",
    "StepCapture",
    "after_backward_before",
    "fetches_its_batches",
    "lightning_internals",
    "live_reference",
    "logging_suppressed",
    "loss_fn_loss",
    "loss_on_every_rank",
    "loss_scale",
    "scales_the_loss",
    "training_step_arguments",
    "training_step_loss",
]

_log = logging.getLogger(__name__)


def lightning_internals() -> frozenset[str]:
    """What ``LightningModule.__init__`` sets: Lightning's bookkeeping, which a check never captures nor restores.

    Example::

        >>> "_trainer" in lightning_internals()
        True
    """
    return frozenset(vars(pl.LightningModule()))


class SkippedStep(SkippedPass):
    """The training step returned ``None``: Lightning skips the batch, so the check does too."""


def after_backward_before(callbacks: list[pl.Callback], callback: pl.Callback) -> list[str]:
    """The class names of the callbacks listed before ``callback`` that override ``on_after_backward``: Lightning runs
    them first, so a check made in ``callback``'s ``on_after_backward`` would compare the gradients they leave.

    Example::

        >>> class Clip(pl.Callback):
        ...     def on_after_backward(self, trainer, pl_module):
        ...         pass
        >>> mine = pl.Callback()
        >>> after_backward_before([Clip(), pl.Callback(), mine, Clip()], mine)
        ['Clip']
    """
    earlier = callbacks[: callbacks.index(callback)] if callback in callbacks else []
    return [
        type(other).__name__
        for other in earlier
        if getattr(type(other), "on_after_backward", None) is not pl.Callback.on_after_backward
    ]


def fetches_its_batches(pl_module: "pl.LightningModule") -> str | None:
    """Why no check can rerun ``pl_module``'s training step, where it fetches its own batches
    (``training_step(self, dataloader_iter)``: a rerun would take the next batch); ``None`` for a step that is given
    its batch.

    Example::

        >>> class FetchesItsOwn(pl.LightningModule):
        ...     def training_step(self, dataloader_iter): ...
        >>> fetches_its_batches(FetchesItsOwn()) is not None, fetches_its_batches(pl.LightningModule())
        (True, None)
    """
    if not is_param_in_hook_signature(pl_module.training_step, "dataloader_iter", explicit=True):
        return None
    return (
        "its `training_step(self, dataloader_iter)` fetches its own batches, so a check's rerun of the step would"
        " train on the next batch"
    )


def training_step_arguments(pl_module: "pl.LightningModule", batch: Any, batch_idx: int) -> tuple[Any, ...]:
    """The positional arguments Lightning passes to ``training_step``: ``batch_idx`` only if the step takes it."""
    if is_param_in_hook_signature(pl_module.training_step, "batch_idx", min_args=2):
        return (batch, batch_idx)
    return (batch,)


def loss_of(output: Any) -> torch.Tensor:
    """The loss of a ``training_step`` output: the tensor, or ``["loss"]`` of a dict.

    Raises:
        SkippedStep: If the output is ``None``.
    """
    if output is None:
        raise SkippedStep
    return output["loss"] if isinstance(output, Mapping) else output


def loss_fn_loss(
    loss_fn: Callable[["pl.LightningModule", Any, int], torch.Tensor],
    pl_module: "pl.LightningModule",
    batch: Any,
    batch_idx: int,
) -> torch.Tensor:
    """What the monitor's ``loss_fn`` returns for the batch: the step's loss, a tensor of one element.

    Raises:
        TypeError: If it returns anything else, naming what it returned.

    Example::

        >>> float(loss_fn_loss(lambda module, batch, batch_idx: batch.sum(), None, torch.ones(2), 0))
        2.0
    """
    loss = loss_fn(pl_module, batch, batch_idx)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else ""
        raise TypeError(
            f"`loss_fn` returned {type(loss).__name__}{shape}: return the step's loss, a tensor of one element (the"
            " loss its first `manual_backward` is given)"
        )
    return loss


def loss_on_every_rank(strategy: Any, step: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The loss ``step`` gives (a rerun of ``training_step``), skipped on every rank if on any: a rerun that returned
    None from state the check does not put back, on one rank alone, would leave the others waiting in the backward's
    all-reduce or reduce-scatter. One collective on several processes.

    Args:
        strategy: The strategy, whose ranks agree.
        step: Runs the step's forward and returns its loss, raising :class:`SkippedStep` where it skips.

    Raises:
        SkippedStep: On every rank, if ``step`` skipped on any.

    Example::

        >>> class OneDevice:  # a strategy on one device: its decision is its own
        ...     def reduce_boolean_decision(self, decision, all=True):
        ...         return decision
        >>> float(loss_on_every_rank(OneDevice(), lambda: torch.tensor(2.0)))
        2.0
    """
    loss = None
    with contextlib.suppress(SkippedStep):
        loss = step()
    if agree(strategy, loss is None) or loss is None:  # the second test only tells the type checker what agree did
        raise SkippedStep
    return loss


def scales_the_loss(strategy: Any) -> bool:
    """Whether the strategy's precision plugin scales the loss before backward with a GradScaler (which skips the
    steps whose gradients are not finite).

    Args:
        strategy: The Trainer's strategy.
    """
    return getattr(strategy.precision_plugin, "scaler", None) is not None


def loss_scale(strategy: Any) -> float:
    """The factor the strategy's GradScaler multiplies the loss by before backward at this step (``1.0`` without one,
    or with one disabled): the live gradients are that many times those the optimizer steps with.

    Args:
        strategy: The Trainer's strategy.
    """
    scaler = getattr(strategy.precision_plugin, "scaler", None)
    return 1.0 if scaler is None else float(scaler.get_scale())


def training_step_loss(pl_module: "pl.LightningModule", *args: Any, **kwargs: Any) -> torch.Tensor:
    """The loss of the LightningModule's own ``training_step`` called on the bare module with these arguments."""
    return loss_of(pl_module.training_step(*args, **kwargs))


@contextlib.contextmanager
def logging_suppressed(pl_module: "pl.LightningModule") -> Iterator[None]:
    """Make ``self.log`` and ``self.log_dict`` do nothing, so the check adds nothing to the training metrics."""
    names = ("log", "log_dict")
    own = {name: pl_module.__dict__[name] for name in names if name in pl_module.__dict__}
    for name in names:
        setattr(pl_module, name, _ignore)
    try:
        yield
    finally:
        for name in names:
            if name in own:
                setattr(pl_module, name, own[name])
            else:
                delattr(pl_module, name)


@contextlib.contextmanager
def _before_backward_hooks_off(trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> Iterator[None]:
    """Make the callbacks' and the module's ``on_before_backward`` do nothing: the precision plugin's
    ``pre_backward`` calls them, and they ran for the live loss already."""
    # `Trainer.callbacks` is set by Lightning's callback connector, not declared on the class.
    callbacks = trainer.callbacks  # type: ignore[attr-defined]
    own = pl_module.__dict__.get("on_before_backward")
    trainer.callbacks = []  # type: ignore[attr-defined]
    pl_module.on_before_backward = _ignore  # type: ignore[method-assign]
    try:
        yield
    finally:
        trainer.callbacks = callbacks  # type: ignore[attr-defined]
        if own is None:
            del pl_module.on_before_backward
        else:
            pl_module.on_before_backward = own  # type: ignore[method-assign]


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


def _copy_tensors(value: Any) -> Any:
    return apply_to_collection(value, torch.Tensor, lambda tensor: tensor.detach().clone())


class StepCapture:
    """What the live training step starts from, captured at the entry of its first ``training_step`` call.

    :meth:`installed` puts a wrapper in place of the module's ``training_step`` for one step: on its first call it
    records a :class:`StepState` and copies of the arguments, puts the module's own ``training_step`` back and calls
    it. Later calls in the step (an optimizer such as LBFGS calls its closure again) run the real one directly. The
    wrapper's ``__wrapped__`` is the real method, whose signature Lightning reads to decide whether to pass
    ``batch_idx``.

    Args:
        pl_module: The LightningModule.
        batch_idx: The index of the step's batch.
        internal_attributes: Attributes the state never captures nor restores (Lightning's own bookkeeping).
        written_parameters: Parameters an earlier step wrote in place in ``training_step``: their values are captured
            with the state, so that a check can rerun the step from where it started.
        wrapper: The strategy's wrapper of the module (DDP's), whose communication hook states are captured too.
        contain_failures: Whether a failure of the capture itself is kept in :attr:`failure` (the step then runs
            uncaptured) rather than raised: on one process, where no other rank waits for this one's check.
    """

    def __init__(
        self,
        pl_module: "pl.LightningModule",
        batch_idx: int,
        internal_attributes: frozenset[str],
        written_parameters: frozenset[str] = frozenset(),
        *,
        wrapper: nn.Module | None = None,
        contain_failures: bool = False,
    ) -> None:
        self.pl_module = pl_module
        self._wrapper = wrapper
        # The data of DDP's communication hook states as the step started, where it has any (see `CommHookStates`).
        self.comm_hooks: CommHookStates | None = None
        # The optimizers' hyperparameters and the schedulers' states as the step started.
        self._optimizer_settings: OptimizerSettings | None = None
        self.batch_idx = batch_idx
        self._internal = internal_attributes
        self.written_parameters = written_parameters
        self._contain = contain_failures
        self.failure: Exception | None = None
        self._state: StepState | None = None
        self.args: tuple[Any, ...] = ()
        self.kwargs: dict[str, Any] = {}
        self.loss = float("nan")
        # Whether `training_step` recomputed a region before it returned the loss (a gradient penalty).
        self.recomputed_in_forward = False
        # How many eager recomputations the regions had run as the step started.
        self.recomputations_before = 0
        # The regions' counts of buffers recomputed with other values than their forward read, as the step started.
        self.read_otherwise_before: dict[str, int] = {}
        # The buffers and region attributes hooks wrote between the live forward and its backward (see
        # `backward_started`), which the reference pass, run without those hooks, leaves as its forward left them.
        self.written_before_backward: list[str] = []
        # Whether the host's random streams, and torch's RNG, moved during the live backward, where nothing but the
        # regions' recomputation runs the user's code (see `_watch_hooks`).
        self.backward_drew_host_rng = False
        self.backward_drew_torch_rng = False

    @property
    def captured(self) -> bool:
        return self._state is not None

    @property
    def state(self) -> StepState:
        """What the step started from.

        Raises:
            RuntimeError: If the step has not started yet.
        """
        if self._state is None:
            raise RuntimeError("lightning_ckpt_determinism: the check step's `training_step` has not run yet.")
        return self._state

    @contextlib.contextmanager
    def installed(self) -> Iterator["StepCapture"]:
        """Capture at the next ``training_step`` call inside this block; the module's own method is back after it."""
        module = self.pl_module
        own = module.__dict__.get("training_step")
        capturing = _CapturingStep(self, module, own)
        module.training_step = capturing  # type: ignore[method-assign]
        try:
            yield self
        finally:
            _put_back(module, own, capturing)

    def changed_parameters(self) -> list[str]:
        """The parameters changed in place since the step started (a momentum teacher updated in ``training_step``,
        an ``nn.Embedding`` with ``max_norm``) whose values the state did not capture.

        A check cannot rerun such a step from where it started; the monitor captures them from the next check on.
        """
        return self.state.unrestored_parameters()

    def initialised(self) -> list[str]:
        """The parameters and buffers of lazy modules the step initialised (:meth:`StepState.initialised`)."""
        return self.state.initialised()

    def restore_optimizer_settings(self) -> None:
        """Give the optimizers the hyperparameters and the schedulers the states the step started from (a rerun of
        ``training_step`` that reads its learning rate reads the live step's)."""
        if self._optimizer_settings is not None:
            self._optimizer_settings.restore()

    def arguments(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Fresh copies of the captured arguments (a step may change its batch in place)."""
        return _copy_tensors(self.args), _copy_tensors(self.kwargs)

    def _run(self, real: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # Before anything of the step runs: later hooks and callbacks may draw random numbers or change the batch.
        try:
            state = StepState(self.pl_module, self._internal, self.written_parameters)
            self.comm_hooks = CommHookStates(self._wrapper)
            self._optimizer_settings = OptimizerSettings(self.pl_module.trainer)
            self.args, self.kwargs = _copy_tensors(args), _copy_tensors(kwargs)
        except Exception as err:
            if not self._contain:
                raise
            self.failure = err
        else:
            self._state = state
        before = self.recomputations_before = recomputations(self.pl_module)
        self.read_otherwise_before = buffers_read_otherwise(self.pl_module)
        output = real(*args, **kwargs)
        self.recomputed_in_forward = recomputations(self.pl_module) > before
        loss = output.get("loss") if isinstance(output, Mapping) else output
        # Under manual optimization the live loss is the first `manual_backward`'s (see `backward_started`).
        if self.pl_module.automatic_optimization and isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self.loss = float(loss.detach())
        return output

    def backward_started(self, loss: torch.Tensor) -> None:
        """The step's first backward is about to run on ``loss``: under manual optimization, the live loss the check
        compares with ``loss_fn``'s (unknown where a GradScaler has scaled it), and whether a region recomputed
        before it. Called from the monitor's ``on_before_backward``: the hooks that run after it, up to the backward
        (later callbacks', the module's), may write buffers and region attributes (a dropout schedule), which
        :attr:`written_before_backward` names once the backward reaches ``loss``."""
        self._watch_hooks(loss)
        if self.pl_module.automatic_optimization:
            return
        # The check runs inside `training_step` here: what recomputed until now came before the loss (a penalty).
        self.recomputed_in_forward = recomputations(self.pl_module) > self.recomputations_before
        if not scales_the_loss(self.pl_module.trainer.strategy) and loss.numel() == 1:
            self.loss = float(loss.detach())

    def _watch_hooks(self, loss: torch.Tensor) -> None:
        """Note what the hooks between now and the backward of ``loss`` write: a state taken now, compared when the
        backward reaches ``loss``, before it recomputes any region."""
        if not loss.requires_grad:
            return
        module = self.pl_module
        try:
            before = StateMark(module, self._internal)
        except Exception:  # the check then compares them all, as without this note
            _log.debug("could not capture the state before the backward's hooks", exc_info=True)
            return

        def backward_reached(grad: torch.Tensor) -> None:
            handle.remove()
            try:
                within = region_modules(module)
                self.written_before_backward = before.differing_buffers() + before.differing_attributes(within)
                at_backward_end(self._rng_watch(capture_rng([module.device]), torch_rng=not replays_torch_rng(module)))
            except Exception:  # never the backward's failure
                _log.debug("could not compare the state after the backward's hooks", exc_info=True)

        handle = loss.register_hook(backward_reached)

    def _rng_watch(self, started: RNGState, *, torch_rng: bool) -> Callable[[], None]:
        """What notes, when the backward ends, whether the host's random streams, and torch's RNG where some region
        does not replay it (``torch_rng``), moved since ``started``: a region's recomputation that drew from them
        unreplayed (hooks before and after the backward cannot; a backward hook that draws from torch's RNG, as
        gradient noise does, is told apart only by the regions replaying it, the default)."""

        def ended() -> None:
            try:
                now = capture_rng(started.devices)
                self.backward_drew_host_rng = not same_host_rng(started.host, now.host)
                self.backward_drew_torch_rng = torch_rng and not same_torch_rng(started, now)
            except Exception:  # never the backward's failure
                _log.debug("could not compare the random streams after the backward", exc_info=True)

        return ended


class _CapturingStep:
    """What stands in for the module's ``training_step`` until the step starts (see :meth:`StepCapture.installed`):
    it puts the module's own method back and runs it, captured. A pickle or copy of the module taken meanwhile (a
    callback saving it at the batch's start) gets the copy's own method in its place, as if nothing stood in."""

    def __init__(self, capture: StepCapture, module: "pl.LightningModule", own: Any) -> None:
        self._capture, self._module, self._own = capture, module, own
        self._real = module.training_step
        functools.update_wrapper(self, self._real)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _put_back(self._module, self._own, self)
        return self._capture._run(self._real, args, kwargs)

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        if self._own is not None:  # the module's own instance attribute (a `partial`, a compiled step), copied
            return _given, (self._own,)
        return getattr, (self._module, "training_step")


def _given(value: Any) -> Any:
    """``value``: what a copy of a :class:`_CapturingStep` becomes where the module held its own ``training_step``."""
    return value


def _put_back(module: "pl.LightningModule", own: Any, installed: Callable[..., Any]) -> None:
    """Put the module's own ``training_step`` back, if ``installed`` is still in its place (idempotent)."""
    if module.__dict__.get("training_step") is installed:
        if own is None:
            del module.training_step
        else:
            module.training_step = own  # type: ignore[method-assign]


def live_reference(
    trainer: "pl.Trainer",
    pl_module: "pl.LightningModule",
    capture: StepCapture,
    plain_modules: Iterable[nn.Module] | None,
    loss_fn: Callable[["pl.LightningModule", Any, int], torch.Tensor] | None,
    batch_idx: int,
) -> Callable[[], float]:
    """The reference pass of a live-step check, as a closure: the step's forward with checkpointing off (all
    regions, or only ``plain_modules``; compiled regions with the compiler's own recomputation off too, see
    :func:`~lightning_ckpt_determinism.verify.compiled.reference_pass`) and its backward, treated as Lightning treats
    the live loss. The closure returns the loss as ``training_step`` returned it (before the division below), to
    compare with the live step's.

    The forward goes through the strategy's own wrapper (``strategy.training_step``: DDP, FSDP), with the captured
    arguments and logging suppressed; with ``loss_fn`` (manual optimization) it calls ``loss_fn`` on the module. The
    loss is divided by ``accumulate_grad_batches`` under automatic optimization, prepared by the strategy for
    backward (DDP's ``prepare_for_backward`` under manual optimization), then handed to the precision plugin's
    ``pre_backward`` (its GradScaler, or a scale of the user's) and ``backward`` (the module's ``backward``, which a
    user may override), as ``strategy.backward`` does, without the ``on_before_backward``/``on_after_backward``
    hooks: they ran for the live loss.
    """
    strategy = trainer.strategy

    def run() -> float:
        args, kwargs = capture.arguments()
        with reference_pass(plain_modules, pl_module), logging_suppressed(pl_module):
            if loss_fn is None:
                loss = loss_on_every_rank(strategy, lambda: loss_of(strategy.training_step(*args, **kwargs)))
            else:
                with strategy.precision_plugin.train_step_context():
                    loss = loss_fn_loss(loss_fn, pl_module, args[0], batch_idx)
            # The loss as `training_step` returned it, as the live step's is kept, to compare the two.
            returned = float(loss.detach())
            if pl_module.automatic_optimization:
                loss = loss / trainer.accumulate_grad_batches
            strategy.pre_backward(loss)
            precision = strategy.precision_plugin
            with _before_backward_hooks_off(trainer, pl_module):
                loss = precision.pre_backward(loss, pl_module)
            optimizer = trainer.optimizers[0] if pl_module.automatic_optimization and trainer.optimizers else None
            precision.backward(loss, pl_module, optimizer)
        return returned

    return run
