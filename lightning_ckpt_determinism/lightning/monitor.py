"""A Lightning callback that periodically checks that recomputation reproduces the forward pass."""

import contextlib
import inspect
import math
import traceback
from dataclasses import asdict
from typing import Any, Literal, get_args

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_ckpt_determinism._library_compat import compiled_by_lightning
from lightning_ckpt_determinism.checkpointing import checkpointed_modules
from lightning_ckpt_determinism.checkpointing.wrapper import buffers_read_otherwise, recomputations
from lightning_ckpt_determinism.config import (
    NonNegativeFloat,
    NotEmptyStr,
    PositiveInt,
    check_bool,
    check_choice,
    check_metric_prefix,
    check_non_negative_float,
    check_positive_int,
)
from lightning_ckpt_determinism.errors import (
    CheckpointingConfigError,
    LightningCkptDeterminismWarning,
    RecomputationDivergenceError,
)
from lightning_ckpt_determinism.lightning.checks import CheckSettings, LossFn, StepCheck
from lightning_ckpt_determinism.lightning.findings import CheckRecord
from lightning_ckpt_determinism.lightning.fit_output import FitOutput
from lightning_ckpt_determinism.lightning.parallel import agree, all_reduce, gather, same_on_every_rank
from lightning_ckpt_determinism.lightning.reference import free_memory, plain_regions, regions_that_fit_now
from lightning_ckpt_determinism.lightning.results import CheckResults, shown_before_raising
from lightning_ckpt_determinism.lightning.schedule import CheckSchedule
from lightning_ckpt_determinism.lightning.step import (
    StepCapture,
    after_backward_before,
    fetches_its_batches,
    lightning_internals,
)
from lightning_ckpt_determinism.lightning.support import StrategySupport, support_of, unmonitored
from lightning_ckpt_determinism.lightning.watch import SentinelFinding, SentinelWatch
from lightning_ckpt_determinism.verify.cause import Syntax
from lightning_ckpt_determinism.verify.compiled import is_compiled
from lightning_ckpt_determinism.verify.reports import RecomputationReport, read_otherwise_hint
from lightning_ckpt_determinism.verify.sentinel import SentinelMode, SentinelReport
from lightning_ckpt_determinism.verify.two_pass import NothingRecomputed, PassFailed, raised_in_autograd

__all__ = ["RecomputationMonitor"]


_CHECK_ELSEWHERE = (
    "check the same model on one device, under DDP or under FSDP2 (`ModelParallelCheckpointingStrategy`), with a"
    " `training_step` given its batch, or with `check_recomputation(model, closure)` on a batch"
)


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
    gradients are not finite under a GradScaler (a step it skips) is recorded as skipped.

    With attribution the monitor also compares, op by op, what each checkpointed region recomputes with what its
    forward produced, in a two-pass rerun from the captured state on every rank: a region that differs (or whose
    buffers recomputation changed) counts as a divergence even when the gradients agree, up to five diverging
    regions (worst over ranks) are logged as ``{log_prefix}/regions/{name}/max_abs_diff``, with
    ``{log_prefix}/regions/{name}/buffer_mutations`` (how many buffers recomputation changed) for a region whose
    buffers changed, and the warning names the region, the first differing op, the cause, the buffers, what to
    change and the ranks that found it. With ``calibrate_noise`` the noise floor is logged as
    ``{log_prefix}/noise_floor``.

    A check costs one reference forward and backward without recomputation, under one training step (see
    ``docs/performance.md``), and holds the activations of that pass (``reference_regions`` bounds them) and one
    extra set of gradients during the check step. Attribution observes every op of the regions from Python (several
    steps) and, by default, runs only when the check diverged.

    Fix hints name settings as Python writes them (``preserve_host_rng=True`` in the ``CheckpointingConfig``). With
    :attr:`hint_syntax` set to ``"yaml"`` the warnings and the summary name them as a LightningCLI YAML writes them
    (``preserve_host_rng: true`` under ``trainer.strategy.init_args.checkpointing``);
    :class:`~lightning_ckpt_determinism.CheckpointingCLI` sets it on the monitors it builds.

    Args:
        every_n_steps: Check every this many optimizer steps; the first training step of a fit is always checked
            so a broken setup shows at once.
        tolerance: Largest ``grad_divergence`` that still counts as equal. ``0.0`` demands bit-identical
            gradients, which the CPU and deterministic kernels give.
        on_divergence: ``"warn"`` (rank zero, naming the worst parameters), ``"raise"``
            (:class:`~lightning_ckpt_determinism.errors.RecomputationDivergenceError` on every rank alike) or
            ``"ignore"`` (metric only).
        loss_fn: ``loss_fn(pl_module, batch, batch_idx) -> loss``; by default the LightningModule's own
            ``training_step`` (its loss tensor or ``["loss"]`` of its dict) with every ``self.log`` during the
            check suppressed. Required with manual optimization, where it is the reference of the first
            ``manual_backward`` and returns the loss that backward is given (``loss / 2`` where the step passes
            that); under automatic optimization it makes the check the slower two-pass
            :func:`~lightning_ckpt_determinism.check_recomputation` with that loss.
        log_prefix: Prefix of the logged metric names.
        history_size: How many recent results the callback keeps (and saves in checkpoints).
        attribution: When to attribute differences to regions, ops and causes (see above for the cost):
            ``"on_divergence"`` reruns a check that diverged with attribution (decided on all ranks alike);
            ``"always"`` follows every live check with the two-pass check with attribution, which also catches
            buffer mutations that change no gradient (the live gradients' verdict stands where they differed);
            ``"never"`` keeps to gradients, and the warning names parameters only. Under FSDP1, whose model runs only
            through its root wrapper, no check is attributed: a divergence is reported without a region, and
            ``"always"`` is refused at fit start.
        calibrate_noise: Run the reference pass twice per check and count only divergences above the measured
            noise floor, for non-deterministic kernels (GPU atomics) that differ from run to run by themselves.
        reference_regions: ``None`` runs every checkpointed region plainly in the reference pass. ``k`` runs only
            ``k`` of them plainly per check (the others stay checkpointed), rotating so that every region is
            covered every ``ceil(n / k)`` checks: less extra memory on the check step. A region whose recomputation
            differs shows at the checks that run it plainly. ``"auto"`` runs, on CUDA, as many as fit the device's
            free memory with a margin (each region's activations as the sentinel measured them), and every region
            elsewhere. A compiled model runs every region plainly.
        sentinel: On every training step (see ``sentinel_every_n_steps``), compare tensors the checkpointed regions save
            for backward, after their recomputation, with the forward's, through digests on the device (see
            :func:`~lightning_ckpt_determinism.recomputation_sentinel` and docs/performance.md for the costs):
            ``"light"`` (the default) digests, per region call, its last saved tensor, its last floating-point one
            computed from the region's values (one that requires grad) and one more in turn (every saved tensor within
            as many steps as the region saves), each through a window of its rows; ``"sampled"`` every saved tensor
            through that window (every element within 16 steps); ``"exact"`` every element; ``"off"`` nothing. The
            counts stay on the device and are read at Lightning's logging steps
            (``log_every_n_steps``), at check steps and at the fit's end, so a finding is read at most
            ``min(log_every_n_steps, every_n_steps)`` steps after it happened (with ``on_divergence="raise"``, at every
            step before the optimizer step: one small all-reduce and host read per step); the counts are in
            ``trainer.callback_metrics`` from the first step and at every epoch end. It logs
            ``{log_prefix}/sentinel/compared``, ``.../compared_per_step``, ``.../mismatches`` and
            ``{log_prefix}/sentinel/regions/{name}/mismatches``; the loggers get each step that had mismatches at that
            step. A mismatch warns, naming the step it happened at (once per region and ``every_n_steps``), or raises as
            ``on_divergence`` says; after a warning the next step digests every element of every saved tensor and is
            checked in full, with attribution, so that the op and cause are named. It watches training batches only: a
            validation loop run with gradients on (an input-gradient metric under ``torch.enable_grad()`` with
            ``Trainer(inference_mode=False)``) recomputes its regions unwatched, and what that recomputation does is
            neither counted nor raised.
        sentinel_every_n_steps: Watch only the training steps whose global step is a multiple of this (and the
            step after a finding); the others run as without a sentinel, so its cost a step is divided by about
            this much. The default 1 watches every step. Above 1 a defect that shows at unwatched steps only is
            missed, and the light tier's turn over a region's saved tensors counts watched steps;
            ``compared_per_step`` still divides by every step.
        prog_bar: Show ``grad_divergence`` in the progress bar too (the other metrics stay in the loggers and
            ``trainer.callback_metrics``).
        exclude_attributes: Attribute names the check never compares (on any module inside a checkpointed
            region): values that legitimately differ between the live step and the reference pass, such as a
            timestamp or a stored ``loss.item()``. They are still put back after each check.

    Attributes:
        history: The last ``history_size`` checks' records (``CheckRecord``: step, ``grad_divergence``, whether
            it diverged or why it was skipped), alike on every rank (reduced over ranks); saved in checkpoints.
        last_report: The last check's full :class:`~lightning_ckpt_determinism.RecomputationReport` as this rank
            found it, or ``None`` before the first: under the two-pass check each rank's regions and ops are its own,
            and ``history``, the metrics and the warnings hold what the ranks found together.
        hint_syntax: How hints spell settings: ``"python"``, or ``"yaml"`` (set by ``CheckpointingCLI``).

    Raises:
        CheckpointingConfigError: If an argument is out of range; at fit start, before any step, if the module uses
            manual optimization and no ``loss_fn`` is given, if no module is checkpointed (no checkpointing strategy
            and no ``apply_activation_checkpointing`` in ``configure_model``), if the strategy is none the monitor
            runs under, or if ``attribution="always"`` under a strategy whose support says the two-pass check
            cannot run there (``StrategySupport.two_pass_unavailable``; on every rank alike).
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
        loss_fn: LossFn | None = None,
        log_prefix: NotEmptyStr = "recompute",
        history_size: PositiveInt = 32,
        attribution: Literal["on_divergence", "always", "never"] = "on_divergence",
        calibrate_noise: bool = False,
        reference_regions: PositiveInt | Literal["auto"] | None = "auto",
        sentinel: Literal[SentinelMode, "off"] = "light",
        sentinel_every_n_steps: PositiveInt = 1,
        prog_bar: bool = False,
        exclude_attributes: list[str] | None = None,
    ) -> None:
        super().__init__()
        # The one check of each argument, from Python and LightningCLI alike; plain types save, pickle and key alike.
        self.every_n_steps = check_positive_int("every_n_steps", every_n_steps)
        self.tolerance = check_non_negative_float("tolerance", tolerance)
        self.on_divergence = check_choice("on_divergence", on_divergence, ("warn", "raise", "ignore"))
        self.loss_fn = _checked_loss_fn(loss_fn)
        self.log_prefix = check_metric_prefix("log_prefix", log_prefix)
        self.attribution = check_choice("attribution", attribution, ("on_divergence", "always", "never"))
        self.calibrate_noise = check_bool("calibrate_noise", calibrate_noise)
        self.reference_regions: int | str | None = check_positive_int(
            "reference_regions", reference_regions, optional=True, choices=("auto",)
        )
        self.sentinel = check_choice("sentinel", sentinel, (*get_args(SentinelMode), "off"))
        self.sentinel_every_n_steps = check_positive_int("sentinel_every_n_steps", sentinel_every_n_steps)
        if self.sentinel == "off" and self.sentinel_every_n_steps != 1:
            raise CheckpointingConfigError(
                f"`sentinel_every_n_steps`={self.sentinel_every_n_steps} paces the sentinel, which `sentinel`='off'"
                " turns off; choose a tier (`light`, the default) or leave `sentinel_every_n_steps` at 1."
            )
        self.prog_bar = check_bool("prog_bar", prog_bar)
        self.exclude_attributes = _attribute_names(exclude_attributes)
        # How hints name settings: "python", or "yaml" where the run is YAML-driven (`CheckpointingCLI` says so).
        self.hint_syntax: Syntax = "python"
        self.last_report: RecomputationReport | None = None
        self._schedule = CheckSchedule(self.every_n_steps)
        self._results = CheckResults(
            history_size=check_positive_int("history_size", history_size),
            log_prefix=self.log_prefix,
            every_n_steps=self.every_n_steps,
            on_divergence=self.on_divergence,
            attribution=self.attribution,
            calibrate_noise=self.calibrate_noise,
            prog_bar=self.prog_bar,
        )
        self.history = self._results.history
        self._enabled = False
        # Whether this fit allows no gradient check (`StrategySupport.check_unavailable`, or a `training_step` that
        # fetches its own batches), and where, as a finding's warning says it.
        self._checks_off = False
        # The global steps whose check diverged in this fit.
        self._diverged_in_fit: set[int] = set()
        self._read_otherwise_at_start: dict[str, int] = {}
        # How many backwards the batch under way ran, and the most any batch of this fit ran (an optimizer calling
        # its closure again, as LBFGS and SAM do, or several `manual_backward` calls): a check reruns the first alone.
        self._backwards_in_batch = self._most_backwards = 0
        self._unchecked_here = "under this strategy"
        # Whether the last check was skipped because the step's first `manual_backward` recomputed nothing.
        self._backward_unrecomputed = False
        self._support: StrategySupport | None = None
        self._capture: StepCapture | None = None
        self._armed = contextlib.ExitStack()
        self._gradients_before: list[torch.Tensor | None] | None = None
        self._internals: frozenset[str] = frozenset()
        tier = "light" if self.sentinel == "off" else self.sentinel
        self._watch = SentinelWatch(
            tier=tier,  # type: ignore[arg-type]
            prefix=self.log_prefix,
            every_n_steps=self.sentinel_every_n_steps,
        )
        # Whether every rank's training epochs end at the same batch, so that all read the sentinel (a collective)
        # together at an epoch's end.
        self._epochs_end_together = True
        # Parameters a skipped step wrote in place (in `training_step` or a hook before its backward): captured from
        # the next check on.
        self._written_parameters: set[str] = set()
        # Whether this fit said that no module is checkpointed (a memory budget's plan may leave every one plain).
        self._said_nothing_to_check = False
        # The package's warnings and notes while this monitor's fit lasts (see `fit_output`).
        self._fit_output = FitOutput()

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, log_prefix=self.log_prefix)

    @property
    def last_checked_step(self) -> int:
        """The global step last checked, or ``-1``."""
        return self._schedule.last_checked

    @property
    def sentinel_report(self) -> SentinelReport | None:
        """What this rank's sentinel compared during the last fit (cumulative), or ``None`` without one."""
        return self._watch.report

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._disarm()
        if not pl_module.automatic_optimization and self.loss_fn is None:
            how = (
                "Set `loss_fn: your_package.your_module.loss_fn` under the monitor's `init_args`, a function"
                " `loss_fn(module, batch, batch_idx) -> torch.Tensor`"
                if _hint_syntax(self.hint_syntax) == "yaml"
                else "Pass `loss_fn=lambda module, batch, batch_idx: ...`"
            )
            raise CheckpointingConfigError(
                "`RecomputationMonitor` needs `loss_fn` with manual optimization: the default reruns"
                f" `training_step`, which would step the optimizers. {how} returning the loss."
            )
        self._fit_output.hold(trainer)
        self._said_nothing_to_check = False
        self._internals = lightning_internals()
        self._schedule.start_fit()
        self._diverged_in_fit = set()
        # The regions' counts outlive a fit where the model was checkpointed by hand: this fit's are those that grow.
        self._read_otherwise_at_start = buffers_read_otherwise(pl_module)
        self._backwards_in_batch = self._most_backwards = 0
        self._support = support_of(trainer.strategy)
        problem = unmonitored(self._support, trainer.strategy, pl_module, _hint_syntax(self.hint_syntax))
        unattributed = None if self._support is None else self._support.two_pass_unavailable()
        unchecked = None if self._support is None else self._support.check_unavailable()
        where, self._unchecked_here = f"under {type(trainer.strategy).__name__}", "under this strategy"
        if unchecked is None and (fetched := fetches_its_batches(pl_module)) is not None:
            unchecked, where = fetched, f"for `{type(pl_module).__name__}`"
            self._unchecked_here = "for a `training_step` that fetches its own batches"
        problem = problem or self._refused_here(where, unattributed, unchecked) or _given_twice(trainer)
        self._checks_off = unchecked is not None
        self._backward_unrecomputed = False
        steps_compiled = compiled_by_lightning(pl_module) and not is_compiled(pl_module)
        unseen = _STEPS_COMPILED_UNSEEN if steps_compiled else None
        self._results.start_fit(_hint_syntax(self.hint_syntax), unattributed, unchecked, unseen)
        # Agreed before raising: a rank that went on alone would wait for the others in its first collective.
        self._enabled = not agree(trainer.strategy, problem is not None)
        if not self._enabled:
            raise CheckpointingConfigError(
                problem or "`RecomputationMonitor` has nothing to check on another rank; see the error it raised."
            )
        self._watch.steps_compiled = steps_compiled
        if self.sentinel != "off":
            self._watch.start(trainer, pl_module)
        if unchecked is not None:
            rank_zero_warn(
                f"lightning_ckpt_determinism: `RecomputationMonitor` runs no gradient check {where}: {unchecked}."
                f" Its sentinel still compares each step's recomputation. To check gradients too, {_CHECK_ELSEWHERE}.",
                category=LightningCkptDeterminismWarning,
            )
        if steps_compiled:
            rank_zero_warn(
                "lightning_ckpt_determinism: `trainer.fit(torch.compile(module))` compiles the LightningModule's steps"
                " as functions, inside which neither the sentinel nor attribution sees: the checks still compare"
                " gradients, but a divergence is named without its region or cause. Compile the model or its blocks"
                " in `configure_model` instead to have them named.",
                category=LightningCkptDeterminismWarning,
            )
        earlier = after_backward_before(trainer.callbacks, self)  # type: ignore[attr-defined]
        if earlier and not self._checks_off:
            rank_zero_warn(
                f"lightning_ckpt_determinism: {', '.join(f'`{name}`' for name in earlier)} run `on_after_backward`"
                " before `RecomputationMonitor`, which checks gradients there: a change they make to the gradients"
                " would read as a divergence. List `RecomputationMonitor` before them in `callbacks`.",
                category=LightningCkptDeterminismWarning,
            )
        if trainer.barebones:
            rank_zero_warn(
                "`RecomputationMonitor` runs under `Trainer(barebones=True)`, which turns logging off: its metrics go"
                " only to its `history` (and its findings to warnings). Leave `barebones` off to log them.",
                category=LightningCkptDeterminismWarning,
            )
        elif not trainer.loggers:
            rank_zero_warn(
                "`RecomputationMonitor` runs under a Trainer without a logger: its metrics go only to its"
                " `history` and to `trainer.callback_metrics`. Give the Trainer a logger (TensorBoard, CSV ...) to"
                " watch them.",
                category=LightningCkptDeterminismWarning,
            )

    def _refused_here(self, where: str, unattributed: str | None, unchecked: str | None) -> str | None:
        """Why this monitor's settings cannot run ``where`` (under a strategy, for a module), which cannot attribute
        (``unattributed``) or check gradients (``unchecked``); ``None`` where they can."""
        if unattributed is not None and self.attribution == "always":
            return (
                f"`RecomputationMonitor(attribution='always')` cannot run {where}: {unattributed}. Use"
                " `attribution='on_divergence'` (the live check, which names no region there) or FSDP2"
                " (`ModelParallelCheckpointingStrategy`)."
            )
        if unchecked is not None and self.sentinel == "off":
            return (
                f"`RecomputationMonitor(sentinel='off')` has nothing to do {where}: {unchecked}. Turn the"
                f" sentinel on, or {_CHECK_ELSEWHERE}."
            )
        return None

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._watch.train_starts(trainer.global_step)
        if trainer.world_size == 1:
            self._epochs_end_together = True
            return
        batches = trainer.num_training_batches
        known = not getattr(trainer, "reload_dataloaders_every_n_epochs", 0) and math.isfinite(batches)
        self._epochs_end_together = same_on_every_rank(trainer.strategy, int(batches) if known else -1) and known
        if not self._epochs_end_together and self.sentinel != "off":
            rank_zero_info(
                "lightning_ckpt_determinism: the ranks' training epochs may end at different batches (their"
                " dataloaders differ in length, have none, or are reloaded): the sentinel's counts reach"
                " `trainer.callback_metrics` at logging and check steps, not at epoch ends, where the ranks would not"
                " read them together."
            )

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        self._disarm()
        self._backwards_in_batch = 0
        self._watch.step_started(trainer.global_step)
        if not self._enabled or self._checks_off or not self._schedule.due(trainer.global_step):
            return
        # No hook runs where the step starts: the capture wraps `training_step` itself for this step.
        capture = StepCapture(
            pl_module,
            batch_idx,
            self._internals,
            frozenset(self._written_parameters),
            wrapper=trainer.strategy.model,
            contain_failures=trainer.world_size == 1,
        )
        self._capture = self._armed.enter_context(capture.installed())
        self._gradients_before = None

    @override
    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: torch.Tensor) -> None:
        self._watch.backward_started()
        self._backwards_in_batch += 1
        self._most_backwards = max(self._most_backwards, self._backwards_in_batch)
        if self._capture is None or not self._capture.captured or self._support is None:
            return
        self._capture.backward_started(loss)
        held = [grad for _, grad in self._support.gradient_holders(pl_module)]
        if any(param.grad is not None for param in held):
            # Gradients the step accumulates onto (a later micro-batch, or accumulation by hand): the reference
            # starts from them too.
            self._gradients_before = [None if p.grad is None else p.grad.detach().clone() for p in held]

    @override
    def on_after_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        capture, support = self._capture, self._support
        if capture is not None and capture.failure is not None:
            self._capture = None
            self._check_failed(trainer.global_step, capture.failure)
            return
        if capture is None or not capture.captured or support is None:
            return
        self._capture = None  # only the step's first backward is checked (LBFGS calls its closure again)
        if not checkpointed_modules(pl_module):
            # A memory budget's plan may leave every region plain (the same plan on every rank): both passes would
            # run the same plain forward, which proves nothing.
            if not self._said_nothing_to_check:
                self._said_nothing_to_check = True
                rank_zero_info(
                    "lightning_ckpt_determinism: no module is checkpointed (the memory budget's plan leaves every"
                    " one plain): RecomputationMonitor has nothing to check."
                )
            return
        step = trainer.global_step
        self._schedule.checking(step)
        failure: Exception | None = None
        try:
            initialised = capture.initialised()
            changed = list(dict.fromkeys([*capture.changed_parameters(), *initialised]))
        except Exception as err:  # the monitor's own failure skips the check, on every rank alike
            failure, initialised, changed = err, [], []
        if agree(trainer.strategy, failure is not None):
            self._check_failed(step, failure or RuntimeError("the check failed on another rank"))
            return
        if agree(trainer.strategy, bool(changed)):
            self._skip_changed_parameters(step, changed, initialised)
            return
        compiled = is_compiled(pl_module) or compiled_by_lightning(pl_module)
        if not compiled and not agree(trainer.strategy, recomputations(pl_module) > capture.recomputations_before):
            # No eager region recomputed on any rank (a compiled one recomputes inside its graph, uncounted): the
            # step ran as without checkpointing, and a check would compare it with itself.
            self._skip_unrecomputed(step, manual=not pl_module.automatic_optimization)
            return
        self._backward_unrecomputed = False
        plain = self._reference_regions(trainer, pl_module)
        follow_up = self._schedule.follow_up is not None and step >= self._schedule.follow_up
        settings = self._settings(self._schedule.attribution(step, self.attribution))
        # Not counted by a `memory_budget`'s measurement of the first batch: the plan is the one without the monitor.
        with self._watch.paused(), support.check_running():
            try:
                report = StepCheck(trainer, pl_module, capture, settings, support).run(plain, self._gradients_before)
            except NothingRecomputed:  # raised on every rank alike
                self._skip_rerun_unrecomputed(step)
                return
            except PassFailed as err:
                # Raised on every rank alike: none waits in a collective of this check, and each skips it.
                self._check_failed(step, err.__cause__ if isinstance(err.__cause__, Exception) else err)
                return
            except Exception as err:
                # The check puts the state after the step and its gradients back whatever it raises. On several
                # processes another rank may wait in a collective of this check: there it raises.
                if trainer.world_size > 1:
                    raise
                self._check_failed(step, err)
                return
        if report is None:
            self._results.skipped(step, "non-finite gradients (the GradScaler skips this step)")
            return
        if plain is not None:
            rank_zero_info(
                f"lightning_ckpt_determinism: step {step} checked with regions {report.checked_regions} run plainly in"
                " the reference pass."
            )
        self._schedule.checked_this_fit = True
        self.last_report = report
        # Reduced over ranks: a follow-up check is decided alike on every rank from it (a rank that decided from its
        # own report alone would check a step the others do not, and wait in a collective they never enter).
        try:
            diverged = self._results.record(trainer, pl_module, step, report, plain is not None, follow_up=follow_up)
        except (RecomputationDivergenceError, Warning):  # `on_divergence="raise"`; a warning filter set to "error"
            raise
        except Exception as err:
            if trainer.world_size > 1:  # another rank may wait in a collective of the record
                raise
            self._check_failed(step, err)
            return
        if diverged:
            self._diverged_in_fit.add(step)
        elif follow_up:
            self._follow_up_exact(trainer, pl_module, step)

    @override
    def on_before_optimizer_step(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: torch.optim.Optimizer
    ) -> None:
        if self.on_divergence != "raise":
            return
        # Before the optimizer steps, so that a step whose recomputation differed never applies its gradients.
        self._watch.step_ended(batch_end=False)
        findings = self._watch.read(trainer)
        if findings:
            # The loggers and `trainer.callback_metrics` show the step that raises, its check's figures included.
            self._results.show_held(trainer, pl_module)
            self._publish(trainer, pl_module)
            shown_before_raising(trainer)
        self._respond(trainer, findings)

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._disarm()
        self._results.show_held(trainer, pl_module)
        self._watch.step_ended(next_step=trainer.global_step)
        plan = getattr(trainer.strategy, "checkpointing_plan", None)
        self._watch.all_plain = plan is not None and not plan.checkpointed
        logging = self._watch.metrics_due(trainer)
        step = self._watch.step
        # Read at epoch ends and check steps too, so that `EarlyStopping` and `ModelCheckpoint` find the counts in
        # `trainer.callback_metrics` from the first step (checked) and at every epoch end, however short the epoch.
        epoch_end = trainer.is_last_batch and self._epochs_end_together
        shown = self._schedule.last_checked == step or epoch_end or trainer.global_step == trainer.max_steps
        if logging or shown:
            self._respond(trainer, self._watch.read(trainer), last=_last_batch_of_fit(trainer))
            self._publish(trainer, pl_module, so_far=not logging)

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._disarm()
        self._watch.stop()
        self._fit_output.release()
        if self._enabled and raised_in_autograd(exception):
            naming = (
                "`python -m lightning_ckpt_determinism audit --config <the run's config>` names"
                if _hint_syntax(self.hint_syntax) == "yaml"
                else "the `regions` of `check_recomputation(model, closure, attribution=True)` run on one batch name"
            )
            line = (
                "lightning_ckpt_determinism: raised in backward, where the checkpointed regions are recomputed. If"
                f" their recomputation raised it, {naming} the region, the cause and the fix."
            )
            if hasattr(exception, "add_note"):  # Python >= 3.11: shown under the error, where people read it
                exception.add_note(line)
            else:
                rank_zero_warn(line, category=LightningCkptDeterminismWarning)

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._disarm()
        self._respond(trainer, self._watch.read(trainer), last=True)
        self._watch.failed_after_last_read()
        follow_up = self._schedule.follow_up
        if follow_up is not None:
            # Stopped early (`EarlyStopping`, `should_stop`) after a finding promised the next step's full check, or
            # every check from then on was skipped.
            promised = (
                f"the fit ended before step {follow_up}, whose check was"
                if trainer.global_step <= follow_up
                else f"every check from step {follow_up} on was skipped, the first of which was"
            )
            rank_zero_warn(
                f"lightning_ckpt_determinism: {promised} to name the cause of the sentinel's finding:"
                f" {self._how_to_name()}.",
                category=LightningCkptDeterminismWarning,
            )
        if trainer.loggers:
            # Lightning takes no `self.log` here: what is left goes to the loggers only.
            self._publish(trainer, None, last=True)
        self._watch.stop()
        if self._enabled:
            self._summarise(trainer)
        self._fit_output.release()

    def _summarise(self, trainer: "pl.Trainer") -> None:
        """The fit's summary paragraph on rank zero; a failure of its own to write it is a warning, not the fit's end
        (no collective follows it)."""
        plan = getattr(trainer.strategy, "checkpointing_plan", None)
        try:
            text = self._results.text(self._watch.totals, plan)
        except Exception as err:
            rank_zero_warn(
                f"lightning_ckpt_determinism: the monitor could not write the fit's summary ({type(err).__name__}:"
                f" {err}); its `history` and metrics hold what it found. Please report it.",
                category=LightningCkptDeterminismWarning,
            )
            return
        rank_zero_info(text)

    @override
    def state_dict(self) -> dict[str, Any]:
        history = [asdict(record) for record in self.history]
        return {"last_checked_step": self.last_checked_step, "history": history, "checks": self._results.checks}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._schedule.last_checked = state_dict["last_checked_step"]
        self.history.clear()
        self.history.extend(CheckRecord(**record) for record in state_dict["history"])
        self._results.checks = state_dict.get("checks", 0)

    def _respond(self, trainer: "pl.Trainer", findings: list[SentinelFinding], *, last: bool = False) -> None:
        """Warn or raise on the sentinel's ``findings``; after a warning, the next step is checked in full with every
        element digested, unless a check of the finding's step already named the cause or the fit ends."""
        step = self._watch.step
        # This fit's checks alone: a reused monitor's history holds an earlier fit's records of the same steps.
        checked = self._diverged_in_fit if self.attribution != "never" else set()
        # Decided over the findings that warn: one a region's earlier warning holds back promises nothing.
        told = findings if self.on_divergence == "raise" else self._watch.due(findings, self.every_n_steps)
        named = bool(told) and all(finding.step in checked for finding in told)
        if named and all(finding.step in self._results.warned_steps for finding in told):
            then = "The check of that step names the cause (see its warning)."
        elif named:
            then = "The check of that step names the cause (in `history` and the fit's summary)."
        elif self._checks_off:
            then = f"No gradient check runs {self._unchecked_here}: {self._how_to_name()}."
        elif self._backward_unrecomputed:
            then = (
                "No check names the cause while a step's first `manual_backward` recomputes no checkpointed region"
                " (see that warning)."
            )
        elif last:
            then = f"The fit ended before a check could name the cause: {self._how_to_name()}."
        else:
            # Under manual optimization each optimizer's step moves the global step: the next batch's is unknown.
            upcoming = f"Step {step + 1}" if trainer.lightning_module.automatic_optimization else "The next step"
            then = f"{upcoming} is checked in full, every saved tensor compared, to name the op and cause."
        warned = self._watch.respond(
            told,
            on_divergence=self.on_divergence,
            several_ranks=trainer.world_size > 1,
            then=then,
            syntax=self._results.syntax,
        )
        if warned and not named and not last and not self._checks_off and not self._backward_unrecomputed:
            self._schedule.follow_up = step + 1
            self._watch.escalate(step + 1)

    def _publish(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule | None", *, so_far: bool = False, last: bool = False
    ) -> None:
        """The sentinel's points since the last logged step to the loggers, each at its step, and its period to
        ``trainer.callback_metrics``; with ``so_far``, its counts since the last logged step to
        ``trainer.callback_metrics`` alone, leaving them for the loggers' next point. A failure of the monitor's own
        turning the counts into metrics stops the sentinel, not the fit: on every rank alike at its next read."""
        try:
            values = self._watch.so_far() if so_far else None
            metrics = None if so_far else self._watch.metrics(last=last)
        except Exception as err:
            self._watch.failed(err, several_ranks=trainer.world_size > 1 and not last)
            return
        if so_far:
            self._results.publish(trainer, pl_module, values, self._watch.step, loggers=False)
            return
        if metrics is None:
            return
        for step, points in metrics.points:
            self._results.publish(trainer, None, points, step)
        if pl_module is not None:
            self._results.publish(trainer, pl_module, metrics.period, self._watch.step, loggers=False)

    def _settings(self, attribution: Any) -> CheckSettings:
        return CheckSettings(
            self.tolerance,
            attribution,
            self.calibrate_noise,
            self.loss_fn,
            self._internals,
            frozenset(self.exclude_attributes),
        )

    def _disarm(self) -> None:
        self._armed.close()
        self._capture = None

    def _check_failed(self, step: int, err: Exception) -> None:
        """A check that raised on one process is skipped: the step trains on as it would without the monitor."""
        where = traceback.extract_tb(err.__traceback__)[-1:] if err.__traceback__ is not None else []
        at = "".join(f", raised at {frame.filename}:{frame.lineno} in {frame.name}" for frame in where)
        reason = f"{type(err).__name__}: {str(err).removeprefix('lightning_ckpt_determinism: ')}{at}"
        self._schedule.checked_this_fit = True  # the next check comes `every_n_steps` on, not at the next step
        self._results.skipped(step, f"the check failed ({reason})")
        self._results.warn_once(
            "check_failed",
            f"lightning_ckpt_determinism: the check at step {step} failed ({reason}) and was skipped; training goes"
            f" on as without the monitor. {self._where_a_check_fails()} otherwise please report it.",
        )

    def _where_a_check_fails(self) -> str:
        """The user's code a check runs again, where its failures usually come from."""
        if self.loss_fn is not None:
            return (
                "If the error is in your `loss_fn`, which the check calls as `loss_fn(module, batch, batch_idx)` for"
                " the step's loss, fix it there;"
            )
        return (
            "If the error is in your `training_step`, which the check runs again from the step's start, make it safe"
            " to run twice or give the monitor a `loss_fn`;"
        )

    def _how_to_name(self) -> str:
        """What names the cause of a finding no check of the fit named: the audit of the run's config under
        `CheckpointingCLI`, `check_recomputation` in a run built in Python."""
        if _hint_syntax(self.hint_syntax) == "yaml":
            return "run the audit on this config to name it"
        return "run `check_recomputation(model, closure, attribution=True)` on a batch of that step to name it"

    def _follow_up_exact(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", step: int) -> None:
        """Say once that a check a sentinel finding asked for found the step exact: the finding stays unexplained,
        but for the large buffers some calls of this fit recomputed from other values than their forwards read."""
        backwards = self._most_backwards
        if trainer.accumulate_grad_batches > 1:
            where = "its first micro-batch, the one a check reruns under `accumulate_grad_batches`"
        elif backwards > 1:
            where = (
                f"the first backward of that step, the one a check reruns (batches of this fit ran up to {backwards}"
                " backwards: an optimizer calling its closure again, as LBFGS and SAM do, or several `manual_backward`"
                " calls; a difference at a later one is the sentinel's alone to see)"
            )
        else:
            where = "that step"
        before = self._read_otherwise_at_start
        own = [name for name, count in buffers_read_otherwise(pl_module).items() if count > before.get(name, 0)]
        # Every rank's (a rank alone may have read a buffer otherwise): each rank reaches here at the same check.
        read = sorted(set().union(*gather(trainer.strategy, own)))
        seen = f" A cause seen this fit: {read_otherwise_hint(read)}" if read else ""
        divergence = self._results.history[-1].grad_divergence if self._results.history else 0.0
        floor = self.last_report.noise_floor if self.last_report is not None else 0.0
        allowed = "the noise floor `calibrate_noise` measured" if floor > self.tolerance else "`tolerance`"
        found = (
            f"found recomputation exact in {where}: the difference shows at some calls only, so no check names its"
            " cause"
            if not divergence
            else f"found the gradients of {where} within {allowed} (grad_divergence {divergence:.3g}): no check tells"
            " a difference that small from agreement"
        )
        self._results.warn_once(
            "follow_up_exact",
            f"lightning_ckpt_determinism: the full check at step {step}, which a sentinel finding asked for, {found};"
            f" the sentinel's finding and its region stand.{seen}",
        )

    def _skip_unrecomputed(self, step: int, *, manual: bool) -> None:
        """Skip a check of a step in which no checkpointed region was recomputed, saying so once."""
        self._results.skipped(step, "no checkpointed region was recomputed in this step")
        if manual:
            self._backward_unrecomputed = True
            # Only the step's first `manual_backward` is checked: a GAN's discriminator stepped first on detached
            # fakes recomputes nothing, though the generator's backward after it does.
            said = (
                f"lightning_ckpt_determinism: the first `manual_backward` of step {step}, the one the check compares"
                " (with `loss_fn` giving its loss), recomputed no checkpointed region, so its check was skipped"
                " rather than compare that backward with itself; the sentinel still watches every recomputation. For"
                " the check to run, call `manual_backward` first on a loss that runs the checkpointed modules, with"
                " `loss_fn` returning that loss."
            )
        else:
            said = (
                f"lightning_ckpt_determinism: no checkpointed region was recomputed at step {step}: the step ran as"
                " without checkpointing, so its check was skipped rather than compare the step with itself. If that"
                " is not expected, check that `training_step` calls the modules the strategy checkpointed, with"
                " gradients enabled. A function you compiled yourself that calls them hides their recomputation:"
                " compile the module instead, or the LightningModule through `trainer.fit(torch.compile(module))`."
                " Saved-tensor hooks (`save_on_cpu`) entered inside them take their saved tensors from checkpointing."
            )
        self._results.warn_once("unrecomputed", said)

    def _skip_rerun_unrecomputed(self, step: int) -> None:
        """Skip a check whose own passes recomputed no checkpointed region, though the step did, saying so once; the
        next check comes `every_n_steps` on (its passes would likely recompute nothing either)."""
        self._schedule.checked_this_fit = True
        self._results.skipped(step, "the check's passes recomputed no checkpointed region")
        rerun = "`loss_fn`" if self.loss_fn is not None else "`training_step` run again"
        self._results.warn_once(
            "rerun_unrecomputed",
            f"lightning_ckpt_determinism: the check at step {step} was skipped: its passes, {rerun}, recomputed no"
            " checkpointed region, so they would compare a step with itself. Make them run the checkpointed modules"
            " as the step does (`loss_fn` returning the loss the step backpropagates).",
        )

    def _skip_changed_parameters(self, step: int, changed: list[str], initialised: list[str]) -> None:
        """Skip a check whose ``training_step`` changed parameters in place (on any rank): the capture copies them
        from the next step on, which is then checked. Parameters and buffers of lazy modules that the step initialised
        are not written again: the next step is checked without copying them."""
        self._schedule.skipped(step)
        written = [name for name in changed if name not in initialised]
        if changed and not written:
            self._results.skipped(step, "lazy modules initialised in training_step")
            self._results.warn_once(
                "initialised_lazy_modules",
                f"lightning_ckpt_determinism: the check at step {step} was skipped: its `training_step` initialised"
                f" lazy modules ({_some(changed)}), which a rerun of the step cannot undo. The next"
                " step is checked; initialise them before the fit (one forward in `setup`) to check this one too.",
            )
            return
        self._results.skipped(step, "parameters changed in place in the step")
        self._written_parameters.update(written)
        self._results.warn_once(
            "changed_parameters",
            f"lightning_ckpt_determinism: the check at step {step} was skipped: the step changed parameters in place"
            f" ({_some(written)}) in `training_step` or a hook before its backward (`on_before_backward`), which"
            " the check had not copied. It copies them from now on, and checks the next step.",
        )

    def _reference_regions(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule"
    ) -> list[tuple[str, nn.Module]] | None:
        """The regions the reference runs plainly at this check (``None``: all), rotating with ``reference_regions``."""
        regions = list(checkpointed_modules(pl_module).items())
        count = self.reference_regions
        if count == "auto":
            # Every rank runs the same regions plainly, the fewest any rank has room for: a region run plainly on one
            # rank and recomputed on another would run its collectives on one rank only.
            strategy = trainer.strategy
            fit = regions_that_fit_now(list(self._watch.saved_bytes.values()), free_memory(strategy.root_device))
            fewest = torch.tensor([len(regions) if fit is None else fit], device=strategy.root_device)
            count = int(all_reduce(strategy)(fewest, "min").item())
        plain = plain_regions(regions, None if count is None else int(count), self._results.checks)
        if plain is not None and is_compiled(pl_module):
            # Each subset would be another set of guards, one recompile each, past dynamo's limit on a deep model.
            self._results.warn_once(
                "compiled_reference_regions",
                "`RecomputationMonitor(reference_regions=...)` runs every region plainly in the reference pass of a"
                " compiled model: a rotating subset would compile a graph per subset.",
            )
            return None
        return plain


def _last_batch_of_fit(trainer: "pl.Trainer") -> bool:
    """Whether the fit ends after the training batch ending now (at ``max_steps``, or at the last batch of the last
    epoch), so that no step after it is checked."""
    if trainer.max_steps > -1 and trainer.global_step >= trainer.max_steps:
        return True
    epochs = trainer.max_epochs
    return bool(trainer.is_last_batch) and epochs not in (None, -1) and trainer.current_epoch + 1 >= epochs


def _given_twice(trainer: "pl.Trainer") -> str | None:
    """Why the Trainer's callbacks cannot hold several monitors; ``None`` where they hold one."""
    monitors = sum(isinstance(callback, RecomputationMonitor) for callback in trainer.callbacks)  # type: ignore[attr-defined]
    return None if monitors < 2 else given_twice(monitors)


def given_twice(monitors: int | None = None) -> str:
    """Why the Trainer's callbacks cannot hold several monitors (``monitors`` of them, where known).

    Example::

        >>> given_twice(2).split(":")[0]
        "`RecomputationMonitor` is in the Trainer's callbacks 2 times"
    """
    times = "more than once" if monitors is None else f"{monitors} times"
    return (
        f"`RecomputationMonitor` is in the Trainer's callbacks {times}: give it once. One monitor checks every"
        " checkpointed region; several would check each step again, and only the last one's sentinel would see the"
        " regions."
    )


def _some(names: list[str]) -> str:
    """The first three of ``names`` for a message (``on another rank`` for none)."""
    return f"{', '.join(names[:3]) or 'on another rank'}{' ...' if len(names) > 3 else ''}"


def _checked_loss_fn(loss_fn: object) -> LossFn | None:
    """``loss_fn`` where it is ``None`` or can be called as ``loss_fn(module, batch, batch_idx)``.

    Raises:
        CheckpointingConfigError: Otherwise, naming what it takes.
    """
    if loss_fn is None:
        return None
    if not callable(loss_fn):
        raise CheckpointingConfigError(f"`loss_fn` must be callable, got {type(loss_fn).__name__}.")
    if str(getattr(loss_fn, "__module__", "")).startswith("torch.nn"):
        # A criterion (`nn.MSELoss()`, `F.mse_loss`) binds three positional arguments too, and fails in every check.
        raise CheckpointingConfigError(
            f"`loss_fn` must take (module, batch, batch_idx) and return the step's loss, got the loss criterion"
            f" {getattr(loss_fn, '__name__', type(loss_fn).__name__)}: give a function that computes the loss from"
            " the batch, as `training_step` does."
        )
    called = loss_fn.forward if isinstance(loss_fn, nn.Module) else loss_fn  # a module's own signature is (*args)
    try:
        signature = inspect.signature(called, follow_wrapped=False)  # a decorator's wrapper is what is called
    except (TypeError, ValueError):  # a builtin or extension without one: called as it is
        return loss_fn  # type: ignore[return-value]
    try:
        signature.bind(None, None, 0)
    except TypeError:
        raise CheckpointingConfigError(
            f"`loss_fn` must take (module, batch, batch_idx), got a function of {signature}."
        ) from None
    return loss_fn  # type: ignore[return-value]


_STEPS_COMPILED_UNSEEN = (
    "No region is named: the LightningModule's steps are compiled (`trainer.fit(torch.compile(module))`), and"
    " attribution sees no region inside them; the difference may be the compiler's own recomputation"
    " (`compiler_recompute`) as well as a cause below. Compile the model or its blocks in `configure_model` instead to"
    " have the region and cause named."
)


def _hint_syntax(syntax: object) -> Syntax:
    return "yaml" if check_choice("hint_syntax", syntax, ("python", "yaml")) == "yaml" else "python"


def _attribute_names(names: list[str] | None) -> list[str]:
    if names is None:
        return []
    if not isinstance(names, list | tuple | set | frozenset) or not all(
        isinstance(name, str) and name for name in names
    ):
        raise CheckpointingConfigError(
            f"`exclude_attributes` must be a list of attribute names (non-empty strings), got {names!r}."
        )
    return list(names)
