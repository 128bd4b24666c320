"""What the monitor's checks found, and how it is shown: the history, the fit's summary, the metrics, the warnings."""

from collections import deque

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_ckpt_determinism.checkpointing.budget_plan import CheckpointingPlan
from lightning_ckpt_determinism.errors import LightningCkptDeterminismWarning, RecomputationDivergenceError
from lightning_ckpt_determinism.lightning.findings import (
    CheckRecord,
    FitSummary,
    SentinelTotals,
    divergence_message,
    metrics,
    reduce_findings,
    warning_key,
)
from lightning_ckpt_determinism.lightning.parallel import all_reduce, gather
from lightning_ckpt_determinism.verify.cause import Syntax, respelt
from lightning_ckpt_determinism.verify.reports import RecomputationReport

__all__ = ["CheckResults"]


class CheckResults:
    """The checks' results over fits: each check's figures reduced over ranks (collectives on every rank alike),
    its history entry, the metrics in the loggers and ``trainer.callback_metrics``, and a divergence warned on rank
    zero (each kind again only ``every_n_steps`` checks later) or raised on every rank.

    Args:
        history_size: How many recent results are kept.
        log_prefix: The prefix of the logged metric names.
        every_n_steps: How many checks pass before a kind of finding warns again.
        on_divergence: ``"warn"``, ``"raise"`` or ``"ignore"``.
        attribution: The monitor's ``attribution``, which the warning's text follows.
        calibrate_noise: Whether the noise floor is logged.
        prog_bar: Whether ``{log_prefix}/grad_divergence`` is shown in the progress bar.

    Example::

        >>> results = CheckResults(history_size=4, log_prefix="recompute", every_n_steps=1, on_divergence="warn")
        >>> results.skipped(0, "non-finite gradients")
        >>> results.history[0].skipped, results.summary.skipped
        ('non-finite gradients', 1)
    """

    def __init__(
        self,
        *,
        history_size: int,
        log_prefix: str,
        every_n_steps: int,
        on_divergence: str,
        attribution: str = "on_divergence",
        calibrate_noise: bool = False,
        prog_bar: bool = False,
    ) -> None:
        self.history: deque[CheckRecord] = deque(maxlen=history_size)
        self.log_prefix = log_prefix
        self.every_n_steps = every_n_steps
        self.on_divergence = on_divergence
        self.attribution = attribution
        self.calibrate_noise = calibrate_noise
        self.prog_bar = prog_bar
        self.checks = 0
        self.summary = FitSummary()
        self.syntax: Syntax = "python"
        self.unattributed: str | None = None
        self.unseen: str | None = None
        # The check count at which each kind of finding last warned.
        self._warned: dict[str, int] = {}
        # The steps whose check warned this fit (a rate-limited one did not): only those may be pointed to.
        self.warned_steps: set[int] = set()
        # The per-region metrics put in `trainer.callback_metrics` this fit (see `_region_keys_kept`).
        self._regions: set[str] = set()
        # The last check's metrics, held for `trainer.callback_metrics` until the batch ends (see `show_held`).
        self._held: tuple[dict[str, float], int] | None = None

    def start_fit(
        self,
        syntax: Syntax = "python",
        unattributed: str | None = None,
        unchecked: str | None = None,
        unseen: str | None = None,
    ) -> None:
        """A fit starts: its summary is empty, and every kind of finding warns at once.

        Args:
            syntax: How the fit's warnings and summary spell the settings their hints name.
            unattributed: Why this fit's strategy cannot attribute a divergence to a region, or ``None``.
            unchecked: Why no gradient check runs this fit, or ``None``.
            unseen: A sentence saying why attribution sees no region of this fit and what to do, or ``None``.
        """
        self.summary = FitSummary(unchecked=unchecked)
        self._warned, self.syntax, self.unattributed, self.unseen = {}, syntax, unattributed, unseen
        self.warned_steps = set()
        self._regions = set()
        self._held = None

    def skipped(self, step: int, reason: str) -> None:
        """Keep a check of ``step`` skipped for ``reason``.

        Args:
            step: The global step.
            reason: Why it was skipped.
        """
        self.history.append(CheckRecord(step, skipped=reason))
        self.summary.skipped += 1

    def record(
        self,
        trainer: "pl.Trainer",
        pl_module: "pl.LightningModule",
        step: int,
        report: RecomputationReport,
        subset: bool,
        *,
        follow_up: bool = False,
    ) -> bool:
        """Count a check, reduce its report over ranks, log and keep it, and warn or raise if it diverged.

        Args:
            trainer: The Trainer.
            pl_module: The LightningModule (its ``self.log`` fills ``trainer.callback_metrics``, see :meth:`show_held`).
            step: The global step checked.
            report: This rank's report.
            subset: Whether the reference ran only some regions plainly (they are kept with the history entry).
            follow_up: Whether a sentinel finding asked for this check (the summary counts them apart).

        Returns:
            Whether any rank diverged: the same on every rank.

        Raises:
            RecomputationDivergenceError: On every rank, with ``on_divergence="raise"``, if any rank diverged.
        """
        self.checks += 1
        strategy = trainer.strategy
        findings = reduce_findings(
            report,
            strategy.root_device,
            all_reduce(strategy),
            lambda value: gather(strategy, value),
            trainer.global_rank,
        )
        self.summary.add(step, findings, follow_up=follow_up)
        logged = metrics(findings, self.log_prefix, calibrate_noise=self.calibrate_noise)
        self.publish(trainer, None, logged, step)
        self._held = (logged, step)
        self.history.append(
            CheckRecord(
                step,
                findings.grad_divergence,
                findings.max_abs_diff,
                findings.diverged,
                checked_regions=list(report.checked_regions) if subset else None,
            )
        )
        if not findings.diverged or self.on_divergence == "ignore":
            return findings.diverged
        message = respelt(
            divergence_message(step, findings, report, self.attribution, self.unattributed, self.unseen), self.syntax
        )
        if self.on_divergence == "raise":
            self.show_held(trainer, pl_module)
            shown_before_raising(trainer)
            raise RecomputationDivergenceError(message)
        if self.warn_once(warning_key(findings), message):
            self.warned_steps.add(step)
        return True

    def publish(
        self,
        trainer: "pl.Trainer",
        pl_module: "pl.LightningModule | None",
        logged: dict[str, float] | None,
        step: int,
        *,
        loggers: bool = True,
    ) -> None:
        """Write ``logged`` to the loggers at ``step``, and put it in ``trainer.callback_metrics`` (for
        ``ModelCheckpoint``, ``EarlyStopping`` and the progress bar) through ``self.log(..., logger=False)``.

        Args:
            trainer: The Trainer.
            pl_module: The LightningModule, or ``None`` to leave ``trainer.callback_metrics`` alone (a step past, or
                a hook where Lightning takes no ``self.log``).
            logged: The metrics, or ``None`` for none.
            step: The global step they belong to.
            loggers: Whether the loggers get them.
        """
        if not logged:
            return
        for logger in trainer.loggers if loggers else []:
            logger.log_metrics(logged, step=step)
        if pl_module is None or trainer.barebones:  # `Trainer(barebones=True)` takes no `self.log`
            return
        shown = f"{self.log_prefix}/grad_divergence"
        for name, value in _region_keys_kept(logged, self._regions).items():
            prog_bar = self.prog_bar and name == shown
            # `batch_size`: a `training_step(self, dataloader_iter)` gives Lightning none to infer.
            pl_module.log(
                name, float(value), logger=False, on_step=True, on_epoch=False, prog_bar=prog_bar, batch_size=1
            )

    def show_held(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Put the last check's metrics in ``trainer.callback_metrics``, at the batch's end (or before the check
        raises). A check runs in ``on_after_backward``, where a ``self.log`` would make Lightning drop, at an epoch's
        first batch, what ``training_step`` logged before it whenever ``training_step`` logs again after it (a closure
        LBFGS calls again, manual optimization logging on both sides of a backward): Lightning resets a hook's values
        there when another hook logged since.

        Args:
            trainer: The Trainer.
            pl_module: The LightningModule.
        """
        held, self._held = self._held, None
        if held is not None:
            self.publish(trainer, pl_module, held[0], held[1], loggers=False)

    def warn_once(self, key: str, message: str) -> bool:
        """Warn on rank zero when a kind of finding first shows, and again when it recurs ``every_n_steps`` checks
        later; the metrics carry every check's numbers.

        Args:
            key: The kind of finding.
            message: The warning.

        Returns:
            Whether it warned.
        """
        last = self._warned.get(key)
        if last is None or self.checks - last >= self.every_n_steps:
            self._warned[key] = self.checks
            rank_zero_warn(message, category=LightningCkptDeterminismWarning)
            return True
        return False

    def text(self, sentinel: SentinelTotals | None, plan: CheckpointingPlan | None = None) -> str:
        """The fit's summary paragraph, with what ``sentinel`` compared and the ``memory_budget`` plan the fit ran.

        Args:
            sentinel: What the sentinel compared and found over every rank, or ``None`` without one.
            plan: The strategy's plan, or ``None`` without a budget.
        """
        text = respelt(self.summary.text(self.every_n_steps, sentinel), self.syntax)
        return text if plan is None else f"{text} It trained under a {plan.summary()}."


def shown_before_raising(trainer: "pl.Trainer") -> None:
    """Move what the monitor logged at this step into ``trainer.callback_metrics`` before it raises: Lightning does
    so when they are read, and a fit that raises leaves no read for it after the error (they would show the step
    before's values).

    Args:
        trainer: The Trainer.
    """
    trainer.callback_metrics  # noqa: B018


def _region_keys_kept(values: dict[str, float], earlier: set[str]) -> dict[str, float]:
    """``values`` with 0.0 for each per-region metric put in ``earlier`` this fit and absent now, where ``values``
    carry its total (``p/m`` for ``p/regions/a/m``): Lightning keeps a key's last value in
    ``trainer.callback_metrics``, where a region that differed once would read as differing for the rest of the fit
    (``EarlyStopping`` on it would stop on a clean epoch). Where ``values`` leave the total out (a sentinel period that
    compared nothing), both keep their last values, so that a region's count never contradicts its total.
    ``earlier`` takes the per-region keys of ``values``.

    Example::

        >>> earlier = set()
        >>> _region_keys_kept({"p/m": 1.0, "p/regions/a/m": 1.0}, earlier)
        {'p/m': 1.0, 'p/regions/a/m': 1.0}
        >>> _region_keys_kept({"p/m": 0.0}, earlier), _region_keys_kept({"p/compared": 0.0}, earlier)
        ({'p/regions/a/m': 0.0, 'p/m': 0.0}, {'p/compared': 0.0})
    """
    absent = sorted(key for key in earlier - values.keys() if _total_of(key) in values)
    earlier.update(key for key in values if "/regions/" in key)
    return {**dict.fromkeys(absent, 0.0), **values}


def _total_of(key: str) -> str:
    """The total of a per-region metric: ``p/m`` for ``p/regions/a/m``."""
    kind, _, region_metric = key.partition("/regions/")
    return f"{kind}/{region_metric.rsplit('/', 1)[-1]}"
