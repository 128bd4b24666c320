"""A Lightning callback that periodically checks that recomputation reproduces the forward pass."""

import contextlib
import math
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_ckpt_determinism.check import RecomputationReport, check_recomputation
from lightning_ckpt_determinism.errors import LightningCkptDeterminismWarning, RecomputationDivergenceError
from lightning_ckpt_determinism.wrapping import checkpointed_modules

__all__ = ["RecomputationMonitor"]

_DIVERGENCE_ACTIONS = ("warn", "raise", "ignore")


class _SkippedStep(Exception):
    """The training step returned ``None``: Lightning skips the batch, so the check does too."""


class RecomputationMonitor(Callback):
    r"""Every ``every_n_steps`` optimizer steps, rerun the training step without and with checkpointing and log
    how far the gradients diverge.

    The check runs at the start of the step's first batch, in train mode, under the Trainer's precision context
    and on the step's device, with every random stream forked and restored, so training continues exactly as
    without the monitor (weights, optimizer state, buffers and logged metrics are bit-identical). It logs
    ``{log_prefix}/grad_divergence`` (relative L2 of the gradient difference; ``0.0`` when recomputation is
    exact) and ``{log_prefix}/max_abs_diff`` at the global step through the Trainer's loggers. Under DDP each
    rank checks its own batch without any gradient all-reduce; the logged values are the maximum over ranks and
    every rank takes the same decision.

    A check costs about two forward and backward passes of the step (see the README's Performance section).

    Args:
        every_n_steps: Check every this many optimizer steps; the first training step of a fit is always checked
            so a broken setup shows at once.
        tolerance: Largest ``grad_divergence`` that still counts as equal. ``0.0`` demands bit-identical
            gradients, which the CPU and deterministic kernels give.
        on_divergence: ``"warn"`` (rank zero, naming the worst parameters), ``"raise"``
            (:class:`RecomputationDivergenceError` on every rank alike) or ``"ignore"`` (metric only).
        loss_fn: ``loss_fn(pl_module, batch, batch_idx) -> loss``; by default the LightningModule's own
            ``training_step`` (its loss tensor or ``["loss"]`` of its dict) with every ``self.log`` during the
            check suppressed. Required with manual optimization.
        log_prefix: Prefix of the logged metric names.
        history_size: How many recent results the callback keeps (and saves in checkpoints).

    Raises:
        ValueError: If an argument is out of range, or at fit start if the module uses manual optimization
            and no ``loss_fn`` is given.
        RecomputationDivergenceError: During training, with ``on_divergence="raise"``, when a check diverges.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_ckpt_determinism import CheckpointingConfig, SingleDeviceCheckpointingStrategy
        >>> trainer = Trainer(
        ...     strategy=SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=["Block"])),
        ...     callbacks=[RecomputationMonitor(every_n_steps=100)],
        ... )
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        tolerance: float = 0.0,
        on_divergence: Literal["warn", "raise", "ignore"] = "warn",
        loss_fn: Callable[[pl.LightningModule, Any, int], torch.Tensor] | None = None,
        log_prefix: str = "recompute",
        history_size: int = 32,
    ) -> None:
        super().__init__()
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"`every_n_steps` must be an integer >= 1, got {every_n_steps!r}.")
        if not (isinstance(tolerance, (int, float)) and tolerance >= 0.0):
            raise ValueError(f"`tolerance` must be a non-negative float, got {tolerance!r}.")
        if on_divergence not in _DIVERGENCE_ACTIONS:
            raise ValueError(f"`on_divergence` can be {', '.join(_DIVERGENCE_ACTIONS)}, got {on_divergence!r}.")
        if loss_fn is not None and not callable(loss_fn):
            raise ValueError(f"`loss_fn` must be callable, got {type(loss_fn).__name__}.")
        if not log_prefix:
            raise ValueError("`log_prefix` must be a non-empty string, got ''.")
        if isinstance(history_size, bool) or not isinstance(history_size, int) or history_size < 1:
            raise ValueError(f"`history_size` must be an integer >= 1, got {history_size!r}.")
        self.every_n_steps = every_n_steps
        self.tolerance = float(tolerance)
        self.on_divergence = on_divergence
        self.loss_fn = loss_fn
        self.log_prefix = log_prefix
        self.last_checked_step = -1
        self.history: deque[dict[str, Any]] = deque(maxlen=history_size)
        self.last_report: RecomputationReport | None = None
        self._enabled = False
        self._checked_this_fit = False
        self._warned: set[str] = set()

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, log_prefix=self.log_prefix)

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._checked_this_fit = False
        if not pl_module.automatic_optimization and self.loss_fn is None:
            raise ValueError(
                "`RecomputationMonitor` needs `loss_fn` with manual optimization: the default reruns"
                " `training_step`, which would step the optimizers. Pass"
                " `loss_fn=lambda module, batch, batch_idx: ...` returning the loss."
            )
        regions = checkpointed_modules(pl_module)
        model = trainer.strategy.model
        if model is not pl_module and not isinstance(model, DistributedDataParallel):
            self._enabled = False
            rank_zero_warn(
                f"`RecomputationMonitor` supports single-device and DDP strategies; the model is wrapped in"
                f" {type(model).__name__} by {type(trainer.strategy).__name__}, so no check will run.",
                category=LightningCkptDeterminismWarning,
            )
        elif not regions:
            self._enabled = False
            rank_zero_warn(
                f"`RecomputationMonitor` found no checkpointed module in {type(pl_module).__name__}, so no check will"
                " run. Use a checkpointing strategy (e.g. `SingleDeviceCheckpointingStrategy(checkpointing=...)`) or"
                " `apply_activation_checkpointing`.",
                category=LightningCkptDeterminismWarning,
            )
        else:
            self._enabled = True

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if not self._enabled or step == self.last_checked_step:
            return
        if self._checked_this_fit and step % self.every_n_steps:
            return
        report = self._check(trainer, pl_module, batch, batch_idx)
        if report is None:
            return
        self._checked_this_fit = True
        self.last_checked_step = step
        self.last_report = report
        self._record(trainer, pl_module, step, report)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"last_checked_step": self.last_checked_step, "history": list(self.history)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_checked_step = state_dict["last_checked_step"]
        self.history.clear()
        self.history.extend(state_dict["history"])

    def _check(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> RecomputationReport | None:
        loss_fn = self.loss_fn

        def closure() -> torch.Tensor:
            if loss_fn is not None:
                return loss_fn(pl_module, batch, batch_idx)
            output = pl_module.training_step(batch, batch_idx)
            if output is None:
                raise _SkippedStep
            return output["loss"] if isinstance(output, Mapping) else output

        try:
            with trainer.strategy.precision_plugin.train_step_context(), _logging_suppressed(pl_module):
                return check_recomputation(pl_module, closure, tolerance=self.tolerance)
        except _SkippedStep:
            return None

    def _record(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", step: int, report: RecomputationReport
    ) -> None:
        local = torch.tensor(
            [report.grad_divergence, report.max_abs_diff, float(report.diverged)],
            dtype=torch.float64 if pl_module.device.type != "mps" else torch.float32,
            device=pl_module.device,
        )
        divergence, max_abs_diff, diverged_anywhere = trainer.strategy.reduce(local, reduce_op="max").tolist()
        metrics = {
            f"{self.log_prefix}/grad_divergence": divergence,
            f"{self.log_prefix}/max_abs_diff": max_abs_diff,
        }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        diverged = diverged_anywhere > 0.0
        self.history.append(
            {"step": step, "grad_divergence": divergence, "max_abs_diff": max_abs_diff, "diverged": diverged}
        )
        if not diverged or self.on_divergence == "ignore":
            return
        message = _divergence_message(step, divergence, max_abs_diff, report)
        if self.on_divergence == "raise":
            raise RecomputationDivergenceError(message)
        # One warning per kind of finding; the metric carries every check's numbers.
        key = report.error.split(":", 1)[0] if report.error else "gradients"
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message, category=LightningCkptDeterminismWarning)


def _divergence_message(step: int, divergence: float, max_abs_diff: float, report: RecomputationReport) -> str:
    if report.error:
        local = f"recomputation failed on this rank: {report.error}"
    elif report.worst_parameters:
        worst = ", ".join(f"{name} ({diff:.3g})" for name, diff in report.worst_parameters)
        local = f"the worst parameters on this rank: {worst}"
    else:
        local = "this rank's gradients agree; another rank diverged"
    shown = "inf" if math.isinf(divergence) else f"{divergence:.3g}"
    return (
        f"lightning_ckpt_determinism: recomputation diverged at step {step}: grad_divergence={shown} (tolerance"
        f" {report.tolerance:g}), max_abs_diff={max_abs_diff:.3g}; {local}. Something in a checkpointed module"
        " differs between forward and recomputation: dropout with `preserve_rng_state=False`, NumPy or `random`"
        " without `preserve_host_rng=True`, buffers without `protect_buffers=True`, Python state read in forward,"
        " or a non-deterministic kernel."
    )


@contextlib.contextmanager
def _logging_suppressed(pl_module: "pl.LightningModule") -> Iterator[None]:
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


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None
