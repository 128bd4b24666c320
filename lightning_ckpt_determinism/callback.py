"""A Lightning callback that periodically checks that recomputation reproduces the forward pass."""

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_ckpt_determinism._compile import is_compiled
from lightning_ckpt_determinism._grads import GradientStash
from lightning_ckpt_determinism._lightning_step import (
    LIGHTNING_INTERNALS,
    SkippedStep,
    StepCapture,
    live_reference,
    logging_suppressed,
    training_step_loss,
)
from lightning_ckpt_determinism._state import StepState
from lightning_ckpt_determinism._types import NonNegativeFloat, NotEmptyStr, PositiveInt
from lightning_ckpt_determinism.attribution import RegionReport
from lightning_ckpt_determinism.check import RecomputationReport, check_recomputation
from lightning_ckpt_determinism.errors import (
    CheckpointingConfigError,
    LightningCkptDeterminismWarning,
    RecomputationDivergenceError,
)
from lightning_ckpt_determinism.live_check import check_live_step
from lightning_ckpt_determinism.wrapping import _region_name, checkpointed_modules

__all__ = ["RecomputationMonitor"]

_DIVERGENCE_ACTIONS = ("warn", "raise", "ignore")
_ATTRIBUTION_MODES = ("on_divergence", "always", "never")
_LOGGED_REGIONS = 5
_NAMED_REGIONS = 3


class RecomputationMonitor(Callback):
    r"""Every ``every_n_steps`` optimizer steps, check the live training step against a pass without checkpointing.

    On a check step the real step runs as always, checkpointed; its ``training_step`` is wrapped for that call only,
    to capture what it starts from (every random stream, buffers, torchmetrics states, a copy of the batch and
    arguments, the modules' plain Python attributes). After its backward, in ``on_after_backward``, the live
    gradients are set aside, the captured state is put back, and one reference pass with checkpointing off runs
    through the strategy's own wrapper (DDP's all-reduce, FSDP's reduce-scatter, FSDP2's hooks), its loss treated as
    Lightning treats the live one (divided by ``accumulate_grad_batches``, scaled by the GradScaler). The gradients
    are compared on what each rank holds (shards of sharded ones) with the sums all-reduced; then the live gradients
    and the state after the step are put back, so training continues exactly as without the monitor (weights,
    optimizer state, buffers and logged metrics are bit-identical). It logs ``{log_prefix}/grad_divergence``
    (relative L2 of the gradient difference; ``0.0`` when recomputation is exact) and ``{log_prefix}/max_abs_diff``
    at the global step through the Trainer's loggers; every rank holds the same values and takes the same decision.
    A check that compares nothing (no gradient anywhere) is an error finding, never ``0.0``; a check whose live
    gradients are not finite (a step the GradScaler skips) is recorded as skipped.

    With attribution the monitor also compares, op by op, what each checkpointed region recomputes with what its
    forward produced, in a two-pass rerun from the captured state on every rank: a region that differs (or whose
    buffers recomputation changed) counts as a divergence even when the gradients agree, up to five diverging
    regions (worst over ranks) are logged as ``{log_prefix}/regions/{name}/max_abs_diff``, with
    ``{log_prefix}/regions/{name}/buffer_mutations`` (how many buffers recomputation changed) for a region whose
    buffers changed, and the warning names the region, the first differing op, the cause, the buffers, what to
    change and the ranks that found it. With ``calibrate_noise`` the noise floor is logged as
    ``{log_prefix}/noise_floor``.

    A check costs one reference forward and backward without recomputation, under one training step (see the
    README's Performance section), and holds the activations of that pass (``reference_regions`` bounds them) and one
    extra set of gradients during the check step. Attribution observes every op of the regions from Python (several
    steps) and, by default, runs only when the check diverged.

    Args:
        every_n_steps: Check every this many optimizer steps; the first training step of a fit is always checked
            so a broken setup shows at once.
        tolerance: Largest ``grad_divergence`` that still counts as equal. ``0.0`` demands bit-identical
            gradients, which the CPU and deterministic kernels give.
        on_divergence: ``"warn"`` (rank zero, naming the worst parameters), ``"raise"``
            (:class:`RecomputationDivergenceError` on every rank alike) or ``"ignore"`` (metric only).
        loss_fn: ``loss_fn(pl_module, batch, batch_idx) -> loss``; by default the LightningModule's own
            ``training_step`` (its loss tensor or ``["loss"]`` of its dict) with every ``self.log`` during the
            check suppressed. Required with manual optimization, where it is the reference of the first
            ``manual_backward``; under automatic optimization it makes the check the slower two-pass
            :func:`~lightning_ckpt_determinism.check_recomputation` with that loss.
        log_prefix: Prefix of the logged metric names.
        history_size: How many recent results the callback keeps (and saves in checkpoints).
        attribution: When to attribute differences to regions, ops and causes (see above for the cost):
            ``"on_divergence"`` reruns a check that diverged with attribution (decided on all ranks alike);
            ``"always"`` runs the two-pass check with attribution on every check, which also catches buffer
            mutations that change no gradient;
            ``"never"`` keeps to gradients, and the warning names parameters only.
        calibrate_noise: Run the reference pass twice per check and count only divergences above the measured
            noise floor, for non-deterministic kernels (GPU atomics) that differ from run to run by themselves.
        reference_regions: ``None`` runs every checkpointed region plainly in the reference pass. ``k`` runs only
            ``k`` of them plainly per check (the others stay checkpointed), rotating so that every region is
            covered every ``ceil(n / k)`` checks: less extra memory on the check step. A region whose recomputation
            differs shows at the checks that run it plainly. A compiled model runs every region plainly.

    Raises:
        CheckpointingConfigError: If an argument is out of range, or at fit start if the module uses manual
            optimization and no ``loss_fn`` is given.
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
        every_n_steps: PositiveInt = 100,
        tolerance: NonNegativeFloat = 0.0,
        on_divergence: Literal["warn", "raise", "ignore"] = "warn",
        loss_fn: Callable[[pl.LightningModule, Any, int], torch.Tensor] | None = None,
        log_prefix: NotEmptyStr = "recompute",
        history_size: PositiveInt = 32,
        attribution: Literal["on_divergence", "always", "never"] = "on_divergence",
        calibrate_noise: bool = False,
        reference_regions: PositiveInt | None = None,
    ) -> None:
        super().__init__()
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise CheckpointingConfigError(f"`every_n_steps` must be an integer >= 1, got {every_n_steps!r}.")
        if not (isinstance(tolerance, (int, float)) and tolerance >= 0.0):
            raise CheckpointingConfigError(f"`tolerance` must be a non-negative float, got {tolerance!r}.")
        if on_divergence not in _DIVERGENCE_ACTIONS:
            raise CheckpointingConfigError(
                f"`on_divergence` can be {', '.join(_DIVERGENCE_ACTIONS)}, got {on_divergence!r}."
            )
        if loss_fn is not None and not callable(loss_fn):
            raise CheckpointingConfigError(f"`loss_fn` must be callable, got {type(loss_fn).__name__}.")
        if not log_prefix:
            raise CheckpointingConfigError("`log_prefix` must be a non-empty string, got ''.")
        if isinstance(history_size, bool) or not isinstance(history_size, int) or history_size < 1:
            raise CheckpointingConfigError(f"`history_size` must be an integer >= 1, got {history_size!r}.")
        if attribution not in _ATTRIBUTION_MODES:
            raise CheckpointingConfigError(
                f"`attribution` can be {', '.join(_ATTRIBUTION_MODES)}, got {attribution!r}."
            )
        if not isinstance(calibrate_noise, bool):
            raise CheckpointingConfigError(f"`calibrate_noise` must be True or False, got {calibrate_noise!r}.")
        if reference_regions is not None and (
            isinstance(reference_regions, bool) or not isinstance(reference_regions, int) or reference_regions < 1
        ):
            raise CheckpointingConfigError(
                f"`reference_regions` must be None or an integer >= 1, got {reference_regions!r}."
            )
        # LightningCLI hands jsonargparse's restricted types; plain ones save, pickle and key the state alike.
        self.every_n_steps = int(every_n_steps)
        self.tolerance = float(tolerance)
        self.on_divergence = on_divergence
        self.loss_fn = loss_fn
        self.log_prefix = str(log_prefix)
        self.attribution = attribution
        self.calibrate_noise = calibrate_noise
        self.reference_regions = None if reference_regions is None else int(reference_regions)
        self.last_checked_step = -1
        self.history: deque[dict[str, Any]] = deque(maxlen=int(history_size))
        self.last_report: RecomputationReport | None = None
        self._enabled = False
        self._checked_this_fit = False
        self._warned: set[str] = set()
        self._capture: StepCapture | None = None
        self._gradients_before: list[torch.Tensor | None] | None = None
        self._checks = 0

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, log_prefix=self.log_prefix)

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._checked_this_fit = False
        self._disarm()
        if not pl_module.automatic_optimization and self.loss_fn is None:
            raise CheckpointingConfigError(
                "`RecomputationMonitor` needs `loss_fn` with manual optimization: the default reruns"
                " `training_step`, which would step the optimizers. Pass"
                " `loss_fn=lambda module, batch, batch_idx: ...` returning the loss."
            )
        strategy = trainer.strategy
        if not isinstance(strategy, _SUPPORTED_STRATEGIES):
            self._enabled = False
            rank_zero_warn(
                f"`RecomputationMonitor` is tested under single-device, DDP, FSDP and ModelParallel strategies (and"
                f" their subclasses), not under {type(strategy).__name__}, so no check will run.",
                category=LightningCkptDeterminismWarning,
            )
        elif not checkpointed_modules(pl_module):
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
        self._disarm()
        step = trainer.global_step
        if not self._enabled or step == self.last_checked_step:
            return
        if self._checked_this_fit and step % self.every_n_steps:
            return
        # No hook runs where the step starts: the capture wraps `training_step` itself for this step.
        self._capture = StepCapture(pl_module, batch_idx)
        self._gradients_before = None

    @override
    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: torch.Tensor) -> None:
        if self._capture is None or not self._capture.captured:
            return
        held = [grad for _, grad in _gradient_holders(trainer, pl_module)]
        if any(param.grad is not None for param in held):
            # Gradients the step accumulates onto (a later micro-batch, or accumulation by hand): the reference
            # starts from them too.
            self._gradients_before = [None if p.grad is None else p.grad.detach().clone() for p in held]

    @override
    def on_after_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        capture = self._capture
        if capture is None or not capture.captured:
            return
        self._capture = None  # only the step's first backward is checked (LBFGS calls its closure again)
        step = trainer.global_step
        self.last_checked_step = step
        changed = capture.changed_parameters()
        if trainer.strategy.reduce_boolean_decision(bool(changed), all=False):
            self._checked_this_fit = True
            self.history.append({"step": step, "skipped": "parameters changed in place in training_step"})
            self._warn_once(
                "changed_parameters",
                f"lightning_ckpt_determinism: the check at step {step} was skipped: `training_step` changed parameters"
                f" in place ({', '.join(changed[:3]) or 'on another rank'}{' ...' if len(changed) > 3 else ''}), so"
                " the check cannot rerun the step from where it started. Change them outside `training_step` (a"
                " momentum teacher in `on_train_batch_end`, for example) to have the step checked.",
            )
            return
        report = self._check(trainer, pl_module, capture)
        if report is None:
            self.history.append({"step": step, "skipped": "non-finite gradients (the GradScaler skips this step)"})
            return
        self._checked_this_fit = True
        self._checks += 1
        self.last_report = report
        self._record(trainer, pl_module, step, report)

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._disarm()

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._disarm()

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._disarm()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"last_checked_step": self.last_checked_step, "history": list(self.history), "checks": self._checks}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_checked_step = state_dict["last_checked_step"]
        self.history.clear()
        self.history.extend(state_dict["history"])
        self._checks = state_dict.get("checks", 0)

    def _disarm(self) -> None:
        if self._capture is not None:
            self._capture.remove()
            self._capture = None

    def _check(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", capture: StepCapture
    ) -> RecomputationReport | None:
        if self.attribution == "always" or (self.loss_fn is not None and pl_module.automatic_optimization):
            return self._two_pass(trainer, pl_module, capture, attribution=self.attribution == "always")
        regions = list(checkpointed_modules(pl_module).items())
        plain = self._reference_regions(pl_module, regions)
        holders = _gradient_holders(trainer, pl_module)
        try:
            report = self._live_check(trainer, pl_module, capture, plain, holders)
        except SkippedStep:
            return RecomputationReport(
                grad_divergence=math.inf,
                max_abs_diff=math.inf,
                diverged=True,
                tolerance=self.tolerance,
                error=(
                    "the check could not compare gradients: the reference pass's `training_step` returned None where"
                    " the live step returned a loss (it decides to skip from state the check does not restore)"
                ),
            )
        if report is None:
            return None
        report.checked_regions = [name for name, _ in (regions if plain is None else plain)]
        report.compiled = is_compiled(pl_module)
        if self.reference_regions is not None:
            rank_zero_info(
                f"lightning_ckpt_determinism: step {trainer.global_step} checked with regions"
                f" {report.checked_regions} run plainly in the reference pass."
            )
        if report.diverged and report.error is None and self.attribution == "on_divergence":
            # Decided alike on every rank: the comparison's figures are reduced over ranks.
            attributed = self._two_pass(trainer, pl_module, capture, attribution=True)
            report.regions, report.buffer_mutations = attributed.regions, attributed.buffer_mutations
            report.cause, report.hint, report.error = attributed.cause, attributed.hint, attributed.error
        return report

    def _live_check(
        self,
        trainer: "pl.Trainer",
        pl_module: "pl.LightningModule",
        capture: StepCapture,
        plain: list[tuple[str, nn.Module]] | None,
        holders: list[tuple[str, torch.Tensor]],
    ) -> RecomputationReport | None:
        """:func:`check_live_step` of the step ``capture`` saw, its reference run through the strategy."""
        strategy = trainer.strategy
        return check_live_step(
            pl_module,
            live_reference(
                trainer,
                pl_module,
                capture,
                None if plain is None else [module for _, module in plain],
                self.loss_fn,
                capture.batch_idx,
            ),
            capture.state,
            parameters=holders,
            all_reduce=partial(_all_reduce, strategy),
            tolerance=self.tolerance,
            clone_gradients=_writes_into_bucket_views(strategy),
            gradients_before=self._gradients_before,
            calibrate_noise=self.calibrate_noise,
            skip_non_finite=getattr(strategy.precision_plugin, "scaler", None) is not None,
            live_loss=capture.loss,
            exclude_attributes=LIGHTNING_INTERNALS,
            device=strategy.root_device,
        )

    def _reference_regions(
        self, pl_module: "pl.LightningModule", regions: list[tuple[str, nn.Module]]
    ) -> list[tuple[str, nn.Module]] | None:
        """The regions the reference runs plainly at this check (``None``: all), rotating with ``reference_regions``."""
        count = self.reference_regions
        if count is None or count >= len(regions):
            return None
        if is_compiled(pl_module):
            # Each subset would be another set of guards, one recompile each, past dynamo's limit on a deep model.
            self._warn_once(
                "compiled_reference_regions",
                "`RecomputationMonitor(reference_regions=...)` runs every region plainly in the reference pass of a"
                " compiled model: a rotating subset would compile a graph per subset.",
            )
            return None
        start = self._checks * count % len(regions)
        return [regions[(start + offset) % len(regions)] for offset in range(count)]

    def _two_pass(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", capture: StepCapture, attribution: bool
    ) -> RecomputationReport:
        """:func:`check_recomputation` from the step's captured state and arguments, the live gradients set aside.

        It runs on the module itself, not through a DDP wrapper (each rank compares its own gradients), and takes
        gradients with ``backward()``, which works with FSDP2's sharded parameters and with reentrant checkpointing
        elsewhere in the model.
        """
        strategy = trainer.strategy
        loss_fn = self.loss_fn

        def closure() -> torch.Tensor:
            args, kwargs = capture.arguments()
            if loss_fn is not None:
                return loss_fn(pl_module, args[0], capture.batch_idx)
            return training_step_loss(pl_module, *args, **kwargs)

        holders = [param for _, param in _gradient_holders(trainer, pl_module)]
        after_step = StepState(pl_module, LIGHTNING_INTERNALS)
        stash = GradientStash(holders, clone=_writes_into_bucket_views(strategy))
        try:
            capture.state.restore()
            with strategy.precision_plugin.train_step_context(), logging_suppressed(pl_module):
                return check_recomputation(
                    pl_module,
                    closure,
                    tolerance=self.tolerance,
                    attribution=attribution,
                    calibrate_noise=self.calibrate_noise,
                    gradients="backward",
                    agree=partial(strategy.reduce_boolean_decision, all=False),
                )
        finally:
            stash.put_back()
            after_step.restore()

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
        divergence, max_abs_diff, diverged_anywhere, noise_floor = _all_reduce(trainer.strategy, local, "max").tolist()
        diverged = diverged_anywhere > 0.0
        # Every rank's findings reach every rank (one collective, only on a divergence, decided alike everywhere).
        findings = _gather(_RankFindings.of(trainer.global_rank, report)) if diverged else []
        metrics = {
            f"{self.log_prefix}/grad_divergence": divergence,
            f"{self.log_prefix}/max_abs_diff": max_abs_diff,
        }
        if self.calibrate_noise:
            metrics[f"{self.log_prefix}/noise_floor"] = noise_floor
        for region in _worst_over_ranks(findings)[:_LOGGED_REGIONS]:
            metrics[f"{self.log_prefix}/regions/{region.name}/max_abs_diff"] = region.max_abs_diff
            if region.buffer_mutations:
                metrics[f"{self.log_prefix}/regions/{region.name}/buffer_mutations"] = float(
                    len(region.buffer_mutations)
                )
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        entry: dict[str, Any] = {
            "step": step,
            "grad_divergence": divergence,
            "max_abs_diff": max_abs_diff,
            "diverged": diverged,
        }
        if self.reference_regions is not None:
            entry["checked_regions"] = list(report.checked_regions)
        self.history.append(entry)
        if not diverged or self.on_divergence == "ignore":
            return
        message = _divergence_message(step, divergence, max_abs_diff, report, findings, self.attribution)
        if self.on_divergence == "raise":
            raise RecomputationDivergenceError(message)
        causes = sorted({region.cause or "" for finding in findings for region in finding.regions})
        errors = sorted({finding.error.split(":", 1)[0] for finding in findings if finding.error})
        self._warn_once(f"causes:{causes}" if causes else f"errors:{errors}" if errors else "gradients", message)

    def _warn_once(self, key: str, message: str) -> None:
        """Warn on rank zero the first time a kind of finding shows; the metrics carry every check's numbers."""
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message, category=LightningCkptDeterminismWarning)


_SUPPORTED_STRATEGIES = (SingleDeviceStrategy, DDPStrategy, FSDPStrategy, ModelParallelStrategy)


def _gradient_holders(trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> list[tuple[str, torch.Tensor]]:
    """The tensors whose ``.grad`` the step fills, by name: the module's trainable parameters, plus FSDP1's flat
    parameters when it keeps the original ones (``use_orig_params=True`` accumulates into the flat gradient)."""
    holders: list[tuple[str, torch.Tensor]] = [
        (_region_name(name), param) for name, param in pl_module.named_parameters() if param.requires_grad
    ]
    if isinstance(trainer.strategy, FSDPStrategy) and trainer.strategy.model is not None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        known = {id(param) for _, param in holders}
        for index, fsdp_module in enumerate(FullyShardedDataParallel.fsdp_modules(trainer.strategy.model)):
            handle = getattr(fsdp_module, "_handle", None)
            flat = getattr(handle, "flat_param", None)
            if flat is not None and id(flat) not in known and flat.requires_grad:
                holders.append((f"<FSDP flat parameter {index}>", flat))
    return holders


def _writes_into_bucket_views(strategy: Any) -> bool:
    return isinstance(strategy.model, DistributedDataParallel) and bool(strategy.model.gradient_as_bucket_view)


def _all_reduce(strategy: Any, tensor: torch.Tensor, op: str) -> torch.Tensor:
    return strategy.reduce(tensor, reduce_op=op)


def _gather(finding: "_RankFindings") -> list["_RankFindings"]:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [finding]
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, finding)
    return gathered


@dataclass
class _RankFindings:
    """What one rank found, sent to every rank when a check diverged."""

    rank: int
    error: str | None
    worst_parameters: list[tuple[str, float]]
    regions: list[RegionReport]
    attributed: bool
    hint: str | None

    @classmethod
    def of(cls, rank: int, report: RecomputationReport) -> "_RankFindings":
        regions = _diverging_regions(report)
        return cls(rank, report.error, report.worst_parameters, regions, bool(report.regions), report.hint)


def _worst_over_ranks(findings: list[_RankFindings]) -> list[RegionReport]:
    """Each diverging region once, with its largest difference over ranks, worst first."""
    worst: dict[str, RegionReport] = {}
    for finding in findings:
        for region in finding.regions:
            if region.name not in worst or region.max_abs_diff > worst[region.name].max_abs_diff:
                worst[region.name] = region
    return sorted(worst.values(), key=lambda region: -region.max_abs_diff)


def _divergence_message(
    step: int,
    divergence: float,
    max_abs_diff: float,
    report: RecomputationReport,
    findings: list[_RankFindings],
    attribution: str,
) -> str:
    shown = "inf" if math.isinf(divergence) else f"{divergence:.3g}"
    ranks = len(findings) > 1
    parts = [
        f"lightning_ckpt_determinism: recomputation diverged at step {step}: grad_divergence={shown} (tolerance"
        f" {report.tolerance:g}), max_abs_diff={max_abs_diff:.3g}."
    ]
    errors = [finding for finding in findings if finding.error]
    for finding in errors[:1]:
        where = f" on rank {finding.rank}" if ranks else ""
        parts.append(f"Recomputation failed{where}: {(finding.error or '').rstrip('.')}.")
    if report.worst_parameters and not errors:
        worst = ", ".join(f"{name} ({diff:.3g})" for name, diff in report.worst_parameters)
        parts.append(f"The worst parameters: {worst}.")
    sentences: dict[str, list[int]] = {}
    for finding in findings:
        for region in finding.regions[:_NAMED_REGIONS]:
            sentences.setdefault(_region_sentence(region), []).append(finding.rank)
    for sentence, on in list(sentences.items())[:_NAMED_REGIONS]:
        suffix = f" (rank{'s' if len(on) > 1 else ''} {', '.join(map(str, on))})" if ranks else ""
        parts.append(f"{sentence.rstrip('.')}{suffix}.")
    if sentences or errors:
        return " ".join(parts)
    hints = list(dict.fromkeys(finding.hint for finding in findings if finding.hint))
    if hints:
        return " ".join([*parts, *hints])
    if any(finding.attributed for finding in findings):
        parts.append(
            "Every checkpointed region recomputed exactly what its forward produced when rerun with attribution: the"
            " difference changes from pass to pass, as Python state a module updates in forward (a counter) does."
        )
    elif attribution == "never":
        parts.append("Set `attribution` to be told which region and op.")
    return " ".join(
        [
            *parts,
            "Something in a checkpointed module differs between forward and recomputation: dropout with"
            " `preserve_rng_state=False`, NumPy or `random` without `preserve_host_rng=True`, buffers without"
            " `protect_buffers=True`, Python state read in forward, or a non-deterministic kernel.",
        ]
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
    # A region the graph scan named differs only compiled: its eager values, which `max_abs_diff` measures, agree.
    diff = "" if region.cause == "compiler_recompute" else f", max abs diff {region.max_abs_diff:.3g}"
    return f"Region `{region.name}` diverged{where}{diff}, cause {region.cause}: {region.hint}"
