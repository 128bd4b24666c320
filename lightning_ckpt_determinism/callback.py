"""A Lightning callback that periodically checks that recomputation reproduces the forward pass."""

import math
from collections import deque
from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_ckpt_determinism._lightning_step import SkippedStep, logging_suppressed, training_step_loss
from lightning_ckpt_determinism.attribution import RegionReport
from lightning_ckpt_determinism.check import RecomputationReport, check_recomputation
from lightning_ckpt_determinism.errors import LightningCkptDeterminismWarning, RecomputationDivergenceError
from lightning_ckpt_determinism.wrapping import checkpointed_modules

__all__ = ["RecomputationMonitor"]

_DIVERGENCE_ACTIONS = ("warn", "raise", "ignore")
_ATTRIBUTION_MODES = ("on_divergence", "always", "never")
_LOGGED_REGIONS = 5
_NAMED_REGIONS = 3


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

    With attribution the check also compares, op by op, what each checkpointed region recomputes with what its
    forward produced: a region that differs (or whose buffers recomputation changed) counts as a divergence even
    when the gradients agree, up to five diverging regions (worst first) are logged as
    ``{log_prefix}/regions/{name}/max_abs_diff`` (this rank's values), with
    ``{log_prefix}/regions/{name}/buffer_mutations`` (how many buffers recomputation changed) for a region whose
    buffers changed, and the warning names the region, the first differing op, the cause, the buffers or the error,
    and what to change. With ``calibrate_noise`` the noise floor is logged as
    ``{log_prefix}/noise_floor``.

    A check costs about two forward and backward passes of the step (1.7 steps measured, see the README's
    Performance section); ``calibrate_noise`` adds a reference pass. Attribution observes every op of the regions
    from Python (about three more steps measured) and, during the check step only, holds a copy of the regions'
    op outputs from forward until their recomputation: about the activation memory of the step without
    checkpointing, which the check's reference pass needs anyway. By default it runs only when the cheap check
    diverged, on the same batch from the same state, so clean checks stay cheap.

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
        attribution: When to attribute differences to regions, ops and causes (see above for the cost):
            ``"on_divergence"`` reruns a check that diverged with attribution (decided on all ranks alike);
            ``"always"`` attributes every check, which also catches buffer mutations that change no gradient;
            ``"never"`` keeps to gradients, and the warning names parameters only.
        calibrate_noise: Run the reference pass twice per check and count only divergences above the measured
            noise floor, for non-deterministic kernels (GPU atomics) that differ from run to run by themselves.

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
        attribution: Literal["on_divergence", "always", "never"] = "on_divergence",
        calibrate_noise: bool = False,
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
        if attribution not in _ATTRIBUTION_MODES:
            raise ValueError(f"`attribution` can be {', '.join(_ATTRIBUTION_MODES)}, got {attribution!r}.")
        if not isinstance(calibrate_noise, bool):
            raise ValueError(f"`calibrate_noise` must be True or False, got {calibrate_noise!r}.")
        self.every_n_steps = every_n_steps
        self.tolerance = float(tolerance)
        self.on_divergence = on_divergence
        self.loss_fn = loss_fn
        self.log_prefix = log_prefix
        self.attribution = attribution
        self.calibrate_noise = calibrate_noise
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
            return training_step_loss(pl_module, batch, batch_idx)

        def check(attribution: bool) -> RecomputationReport:
            with trainer.strategy.precision_plugin.train_step_context(), logging_suppressed(pl_module):
                return check_recomputation(
                    pl_module,
                    closure,
                    tolerance=self.tolerance,
                    attribution=attribution,
                    calibrate_noise=self.calibrate_noise,
                )

        try:
            report: RecomputationReport | None = check(attribution=self.attribution == "always")
        except SkippedStep:
            report = None
        # One collective on every rank, whatever happened locally, so that all ranks skip or all rerun alike (a
        # rerun's forward may hold collectives, e.g. SyncBatchNorm).
        flags = torch.tensor(
            [float(report is None), float(report is not None and report.diverged)], device=pl_module.device
        )
        skipped_anywhere, diverged_anywhere = trainer.strategy.reduce(flags, reduce_op="max").tolist()
        if report is None or skipped_anywhere > 0.0:
            return None
        if self.attribution == "on_divergence" and diverged_anywhere > 0.0:
            attributed = check(attribution=True)
            # A difference that changes from pass to pass may not come back; the first finding stands then.
            report = attributed if attributed.diverged else report
        return report

    def _record(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", step: int, report: RecomputationReport
    ) -> None:
        diverging = _diverging_regions(report)
        local = torch.tensor(
            [
                report.grad_divergence,
                report.max_abs_diff,
                float(report.diverged or bool(diverging)),
                report.noise_floor,
            ],
            dtype=torch.float64 if pl_module.device.type != "mps" else torch.float32,
            device=pl_module.device,
        )
        reduced = trainer.strategy.reduce(local, reduce_op="max").tolist()
        divergence, max_abs_diff, diverged_anywhere, noise_floor = reduced
        metrics = {
            f"{self.log_prefix}/grad_divergence": divergence,
            f"{self.log_prefix}/max_abs_diff": max_abs_diff,
        }
        if self.calibrate_noise:
            metrics[f"{self.log_prefix}/noise_floor"] = noise_floor
        for region in diverging[:_LOGGED_REGIONS]:
            metrics[f"{self.log_prefix}/regions/{region.name}/max_abs_diff"] = region.max_abs_diff
            if region.buffer_mutations:
                metrics[f"{self.log_prefix}/regions/{region.name}/buffer_mutations"] = float(
                    len(region.buffer_mutations)
                )
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        diverged = diverged_anywhere > 0.0
        self.history.append(
            {"step": step, "grad_divergence": divergence, "max_abs_diff": max_abs_diff, "diverged": diverged}
        )
        if not diverged or self.on_divergence == "ignore":
            return
        message = _divergence_message(step, divergence, max_abs_diff, report, self.attribution)
        if self.on_divergence == "raise":
            raise RecomputationDivergenceError(message)
        # One warning per kind of finding; the metric carries every check's numbers.
        if diverging:
            key = f"cause:{diverging[0].cause}"
        else:
            key = report.error.split(":", 1)[0] if report.error else "gradients"
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message, category=LightningCkptDeterminismWarning)


def _divergence_message(
    step: int, divergence: float, max_abs_diff: float, report: RecomputationReport, attribution: str
) -> str:
    if report.error:
        local = f"recomputation failed on this rank: {report.error}"
    elif report.worst_parameters:
        worst = ", ".join(f"{name} ({diff:.3g})" for name, diff in report.worst_parameters)
        local = f"the worst parameters on this rank: {worst}"
    elif _diverging_regions(report):
        local = "this rank's gradients agree"
    else:
        local = "this rank's gradients agree; another rank diverged"
    shown = "inf" if math.isinf(divergence) else f"{divergence:.3g}"
    message = (
        f"lightning_ckpt_determinism: recomputation diverged at step {step}: grad_divergence={shown} (tolerance"
        f" {report.tolerance:g}), max_abs_diff={max_abs_diff:.3g}; {local.rstrip('.')}."
    )
    diverging = _diverging_regions(report)
    if diverging:
        return f"{message} {' '.join(_region_sentence(region) for region in diverging[:_NAMED_REGIONS])}"
    if not (report.error or report.worst_parameters):
        return message
    if report.hint is not None:
        return f"{message} {report.hint}"
    if report.regions and not report.error:
        return (
            f"{message} Every checkpointed region recomputed exactly what its forward produced: the gradients differ"
            " because something changed between the check's two passes, such as Python state a module updates in"
            " forward (a counter)."
        )
    if report.regions:
        advice = ""
    elif attribution == "never":
        advice = " Set `attribution` to be told which region and op."
    else:
        advice = (
            " A rerun with attribution on the same batch did not diverge: the difference changes from pass to pass,"
            " as Python state read in forward (a counter) does."
        )
    return (
        f"{message} Something in a checkpointed module differs between forward and recomputation: dropout with"
        " `preserve_rng_state=False`, NumPy or `random` without `preserve_host_rng=True`, buffers without"
        f" `protect_buffers=True`, Python state read in forward, or a non-deterministic kernel.{advice}"
    )


def _diverging_regions(report: RecomputationReport) -> list[RegionReport]:
    """The diverged regions of ``report``, worst first."""
    return sorted((region for region in report.regions if region.diverged), key=lambda r: -r.max_abs_diff)


def _region_sentence(region: RegionReport) -> str:
    if region.first_divergent_op is None:
        where = ""
    else:
        op, index = region.first_divergent_op
        where = f" at `{op}` (op {index} of the region)"
    return (
        f"Region `{region.name}` diverged{where}, max abs diff {region.max_abs_diff:.3g}, cause {region.cause}:"
        f" {region.hint}"
    )
