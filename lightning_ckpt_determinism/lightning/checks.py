"""The step adapter: run a check of the live Lightning step with the engine its settings call for.

By default the live-step engine (:func:`~lightning_ckpt_determinism.verify.live_step.check_live_step`) compares the
live, checkpointed gradients with one reference pass through the strategy's own wrapper; a divergence is then rerun with
attribution by the two-pass engine (:func:`~lightning_ckpt_determinism.check_recomputation`) from the step's captured
state, whose regions and cause join the live report; ``attribution="always"`` does so after every live check. A
``loss_fn`` under automatic optimization runs the two-pass engine directly. Under a strategy whose support says the
two-pass engine cannot run there (FSDP1), every check is live and a divergence is reported without attribution.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_ckpt_determinism.checkpointing.wrapper import checkpointed_modules
from lightning_ckpt_determinism.lightning.comm_hooks import CommHookStates
from lightning_ckpt_determinism.lightning.optimizer_settings import OptimizerSettings
from lightning_ckpt_determinism.lightning.parallel import agree, all_reduce
from lightning_ckpt_determinism.lightning.step import (
    SkippedStep,
    StepCapture,
    live_reference,
    logging_suppressed,
    loss_fn_loss,
    loss_on_every_rank,
    loss_scale,
    scales_the_loss,
)
from lightning_ckpt_determinism.lightning.support import StrategySupport
from lightning_ckpt_determinism.verify.cause import Cause
from lightning_ckpt_determinism.verify.compiled import is_compiled
from lightning_ckpt_determinism.verify.core import CheckScope, losses_differ, read_otherwise_since, with_attribution
from lightning_ckpt_determinism.verify.live_step import check_live_step
from lightning_ckpt_determinism.verify.reports import RecomputationReport
from lightning_ckpt_determinism.verify.two_pass import NothingRecomputed, check_recomputation

__all__ = ["CheckSettings", "LossFn", "StepCheck"]

LossFn = Callable[[pl.LightningModule, Any, int], torch.Tensor]

_SKIPPED_REFERENCE = (
    "the check could not compare gradients: its rerun of `training_step` returned None where the live step returned"
    " a loss (it decides to skip from state the check does not restore)"
)


@dataclass(frozen=True)
class CheckSettings:
    """How the monitor checks a step (its arguments that decide a check)."""

    tolerance: float
    attribution: Literal["on_divergence", "always", "never"]
    calibrate_noise: bool
    loss_fn: LossFn | None
    internals: frozenset[str]
    exclude_attributes: frozenset[str] = frozenset()


class StepCheck:
    """The check of one live step, run right after its backward on every rank at once.

    Args:
        trainer: The Trainer.
        pl_module: The LightningModule.
        capture: What the step started from.
        settings: How to check.
        support: What the strategy says the check needs of it.
    """

    def __init__(
        self,
        trainer: "pl.Trainer",
        pl_module: "pl.LightningModule",
        capture: StepCapture,
        settings: CheckSettings,
        support: StrategySupport,
    ) -> None:
        self.trainer = trainer
        self.pl_module = pl_module
        self.capture = capture
        self.settings = settings
        self.support = support

    def run(
        self, plain: list[tuple[str, nn.Module]] | None, gradients_before: list[torch.Tensor | None] | None
    ) -> RecomputationReport | None:
        """The report (every rank's figures reduced), or ``None`` when the live gradients are not finite and a
        GradScaler skips the step.

        Args:
            plain: The regions the reference runs plainly (``None``: all of them).
            gradients_before: What the gradient holders held before the live backward.
        """
        # A step that set a learning rate or stepped a scheduler has it so again after the check's reruns.
        after_step = OptimizerSettings(self.trainer)
        try:
            return self._run(plain, gradients_before)
        finally:
            after_step.restore()

    def _run(
        self, plain: list[tuple[str, nn.Module]] | None, gradients_before: list[torch.Tensor | None] | None
    ) -> RecomputationReport | None:
        settings = self.settings
        two_pass = self.support.two_pass_unavailable() is None
        try:
            if two_pass and settings.loss_fn is not None and self.pl_module.automatic_optimization:
                # The live step's loss is `training_step`'s, not `loss_fn`'s: both passes are `loss_fn`'s.
                return self._two_pass(attribution=settings.attribution == "always")
            report = self._live(plain, gradients_before)
        except SkippedStep:  # a rerun of `training_step` returned None, on every rank alike: nothing to compare
            return RecomputationReport(
                grad_divergence=math.inf,
                max_abs_diff=math.inf,
                diverged=True,
                tolerance=settings.tolerance,
                error=_SKIPPED_REFERENCE,
            )
        if report is None:
            return None
        attributed = settings.attribution == "always" or (report.diverged and settings.attribution == "on_divergence")
        if two_pass and attributed and report.error is None:
            # Decided alike on every rank: the comparison's figures are reduced over ranks. The live gradients are the
            # ones applied: a difference in them stands whatever a fresh two-pass finds (a large buffer first written
            # at this call recomputes otherwise live only, and is copied for every later pass).
            try:
                two_passes = self._two_pass(attribution=True)
            except (SkippedStep, NothingRecomputed):
                pass  # its rerun returned None or ran no region: the live finding stands, without a region named
            else:
                joined = report.diverged or not two_passes.diverged
                report = with_attribution(report, two_passes) if joined else two_passes
        checked = [name for name, _ in (plain if plain is not None else checkpointed_modules(self.pl_module).items())]
        report = replace(report, checked_regions=checked, compiled=is_compiled(self.pl_module))
        if (
            not self.pl_module.automatic_optimization
            and report.cause == Cause.OUTSIDE_STATE
            and losses_differ(report.reference_loss, report.checkpointed_loss)
        ):
            report = _with_manual_loss_hint(report)
        return report

    def _live(
        self, plain: list[tuple[str, nn.Module]] | None, gradients_before: list[torch.Tensor | None] | None
    ) -> RecomputationReport | None:
        """:func:`check_live_step` of the step, its reference run through the strategy."""
        trainer, pl_module, capture, settings = self.trainer, self.pl_module, self.capture, self.settings
        live_reference_pass = live_reference(
            trainer,
            pl_module,
            capture,
            None if plain is None else [module for _, module in plain],
            settings.loss_fn,
            capture.batch_idx,
        )
        # DDP's communication hooks run in the reference's backward too: from the states the live step started from,
        # then back to those it left.
        hooks = capture.comm_hooks if capture.comm_hooks is not None else CommHookStates(None)
        with hooks.replaying() as start_over:

            def reference() -> float:
                start_over()
                capture.restore_optimizer_settings()
                return live_reference_pass()

            return self._compare_live(reference, gradients_before)

    def _compare_live(
        self, reference: Callable[[], float], gradients_before: list[torch.Tensor | None] | None
    ) -> RecomputationReport | None:
        """:func:`check_live_step` with this ``reference`` pass."""
        pl_module, capture, settings, strategy = self.pl_module, self.capture, self.settings, self.trainer.strategy
        report = check_live_step(
            pl_module,
            reference,
            capture.state,
            parameters=self.support.gradient_holders(pl_module),
            all_reduce=all_reduce(strategy),
            tolerance=settings.tolerance,
            clone_gradients=self.support.writes_into_bucket_views(),
            gradients_before=gradients_before,
            calibrate_noise=settings.calibrate_noise,
            skip_non_finite=scales_the_loss(strategy),
            live_loss=capture.loss,
            recomputed_in_forward=capture.recomputed_in_forward,
            read_otherwise=read_otherwise_since(pl_module, capture.read_otherwise_before),
            exclude_attributes=settings.exclude_attributes,
            internal_attributes=settings.internals,
            written_parameters=capture.written_parameters,
            written_before_backward=capture.written_before_backward,
            backward_drew_host_rng=capture.backward_drew_host_rng,
            backward_drew_torch_rng=capture.backward_drew_torch_rng,
            device=strategy.root_device,
        )
        scale = loss_scale(strategy)
        return report if report is None or scale == 1.0 else _unscaled(report, scale)

    def _two_pass(self, *, attribution: bool) -> RecomputationReport:
        """:func:`check_recomputation` from the step's captured state and arguments, the live gradients set aside.

        It runs each pass as the strategy's :meth:`~StrategySupport.two_pass_loss` says (on the module itself, not
        through a DDP wrapper, so that each rank compares its own gradients; through FSDP1's root wrapper), and takes
        gradients as the strategy's :meth:`~StrategySupport.two_pass_gradients` says: ``torch.autograd.grad`` under
        DDP with ``find_unused_parameters=True``, so that no DDP reducer hook fires outside DDP's forward,
        ``backward()`` elsewhere (FSDP2's sharded parameters, reentrant checkpointing elsewhere in the model).
        """
        pl_module, capture, settings = self.pl_module, self.capture, self.settings
        strategy = self.trainer.strategy
        loss_fn = settings.loss_fn

        def closure() -> torch.Tensor:
            args, kwargs = capture.arguments()
            capture.restore_optimizer_settings()
            if loss_fn is not None:
                return loss_fn_loss(loss_fn, pl_module, args[0], capture.batch_idx)
            return loss_on_every_rank(strategy, lambda: self.support.two_pass_loss(pl_module, *args, **kwargs))

        holders = [param for _, param in self.support.gradient_holders(pl_module)]
        # The state after the step and its live gradients come back whatever the check raises.
        with CheckScope(
            pl_module,
            holders,
            clone_gradients=self.support.writes_into_bucket_views(),
            internal_attributes=settings.internals,
            written_parameters=capture.written_parameters,
        ):
            capture.state.restore()
            with strategy.precision_plugin.train_step_context(), logging_suppressed(pl_module):
                return check_recomputation(
                    pl_module,
                    closure,
                    tolerance=settings.tolerance,
                    attribution=attribution,
                    calibrate_noise=settings.calibrate_noise,
                    gradients=self.support.two_pass_gradients(),
                    agree=lambda decision: agree(strategy, decision),
                    exclude_attributes=settings.exclude_attributes,
                    written_parameters=capture.written_parameters,
                )


def _unscaled(report: RecomputationReport, scale: float) -> RecomputationReport:
    """``report`` of gradients a GradScaler scaled by ``scale``, its differences in the units of the gradients the
    optimizer steps with (its divergences are relative, and so the same)."""
    return replace(
        report,
        max_abs_diff=report.max_abs_diff / scale,
        per_parameter={name: diff / scale for name, diff in report.per_parameter.items()},
        worst_parameters=[(name, diff / scale) for name, diff in report.worst_parameters],
    )


def _with_manual_loss_hint(report: RecomputationReport) -> RecomputationReport:
    """``report`` (cause ``"outside_state"`` under manual optimization) with a hint that names the likeliest reason
    first: ``loss_fn``, the check's rerun, returned another loss than the step's first ``manual_backward`` got. The
    losses are the report's (``reference_loss``, ``checkpointed_loss``), not the hint's: every rank's hint reads alike,
    and the warning says it once."""
    said = (
        "Under manual optimization the check reruns `loss_fn`, which returned another loss than the step's first"
        " `manual_backward` was given (the report's `reference_loss` and `checkpointed_loss`). If `loss_fn` does not"
        " return that loss, scaled as the step scales it (`loss / 2` to accumulate two batches by hand), make it do"
        " so; otherwise:"
    )
    return replace(report, hint=f"{said} {report.hint}" if report.hint else said)
