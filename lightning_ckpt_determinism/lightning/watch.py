"""The monitor's sentinel over one fit: each watched training step's recomputed saved tensors compared with the
forward's.

The sentinel (:func:`~lightning_ckpt_determinism.recomputation_sentinel`) is entered when the fit starts and left
when it ends. Each training batch's comparisons stay on the device, closed into one record per batch
(:meth:`SentinelWatch.step_ended`): no host read and no collective per step. They are read
(:meth:`SentinelWatch.read`) at Lightning's logging steps (``log_every_n_steps``), at the monitor's check steps, at
epoch ends and at the fit's end, and, with ``on_divergence="raise"``, at every step before the optimizer steps:
every record since the last read is reduced over ranks in one small all-reduce and read back to the host once; only
the steps where something differed are read in detail on every rank, and every rank's details gathered. A finding
keeps the step at which it happened. The counts are logged at the logging steps (and shown in
``trainer.callback_metrics`` at check steps and epoch ends too, :meth:`SentinelWatch.so_far`):
``{prefix}/sentinel/compared`` and ``{prefix}/sentinel/compared_per_step`` always, ``{prefix}/sentinel/mismatches``
when something was compared (a period that compared nothing has no mismatch count to show, and the monitor says once
why); in the loggers a step that had mismatches gets its own point, at that step. Only training batches are watched,
from their start to their end: between them the sentinel is paused, so a validation loop run with gradients on (an
input-gradient metric under ``torch.enable_grad()``, the sanity check included), which recomputes its regions in its
own backward, neither counts in the metrics nor raises. The monitor's own check passes are not watched either: they
rerun the step, they do not train. With ``every_n_steps`` above 1 the sentinel watches only the batches whose global
step is a multiple of it, and the step after a finding; the others run paused, as between batches, on every rank
alike. A failure of the sentinel's own bookkeeping stops the sentinel on every rank alike, with one warning, and never
the fit.
"""

import contextlib
from dataclasses import dataclass, field

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_ckpt_determinism._library_compat import lightning_logs_this_batch
from lightning_ckpt_determinism.errors import LightningCkptDeterminismWarning, RecomputationDivergenceError
from lightning_ckpt_determinism.lightning.findings import SentinelTotals
from lightning_ckpt_determinism.lightning.parallel import agree, all_reduce, gather
from lightning_ckpt_determinism.verify.cause import Cause, Syntax, respelt
from lightning_ckpt_determinism.verify.sentinel import (
    RecomputationSentinel,
    SentinelMode,
    SentinelRegion,
    SentinelReport,
    SentinelStep,
    recomputation_sentinel,
)

__all__ = ["SentinelFinding", "SentinelWatch"]


@dataclass(frozen=True)
class SentinelFinding:
    """A region whose recomputation differed at one step, over every rank.

    Attributes:
        step: The global step at the step's start.
        region: The region's name.
        mismatches: Mismatches (saved tensors that differed, parameters or buffers recomputation changed), summed
            over ranks.
        first_mismatch: The first, as the first rank that found one describes it.
        ranks: The ranks where it differed.
        cause: The first mismatch's cause when the sentinel knows it (a parameter written, a buffer changed).
    """

    step: int
    region: str
    mismatches: int
    first_mismatch: str
    ranks: list[int] = field(default_factory=list)
    cause: Cause | None = None

    def message(self, several_ranks: bool, then: str = "") -> str:
        """The warning: where and when it differed, and the cause where known, else ``then`` (what comes next).

        Args:
            several_ranks: Whether to name the ranks.
            then: What the monitor does next to name the cause, as a sentence, or ``""``.
        """
        ranks = f" (rank{'s' if len(self.ranks) > 1 else ''} {', '.join(map(str, self.ranks))})"
        where = ranks if several_ranks else ""
        count = f"{self.mismatches} mismatch{'es' if self.mismatches != 1 else ''}"
        after = f" Cause {self.cause}: {self.cause.hint}" if self.cause is not None else f" {then}" if then else ""
        return (
            f"lightning_ckpt_determinism: the sentinel saw region `{self.region}` recompute other values than its"
            f" forward at step {self.step}{where}: {count}, first: {self.first_mismatch}.{after}"
        )


@dataclass(frozen=True)
class SentinelMetrics:
    """The sentinel's metrics at a logging step.

    Attributes:
        points: What the loggers get, as ``(step, metrics)`` in step order: each step that had mismatches, with the
            tensors compared since the previous point, then the logging step itself.
        period: What ``trainer.callback_metrics`` gets at the logging step: everything since the last logging step.
    """

    points: list[tuple[int, dict[str, float]]]
    period: dict[str, float]


@dataclass
class _StepCounts:
    """What one read step compared and found, summed over ranks."""

    compared: int = 0
    mismatches: dict[str, int] = field(default_factory=dict)
    on_new_paths: int = 0
    # Of `on_new_paths`, those of the last step read that compared or left out anything: no later step of the fit
    # compares their paths, if it ends there.
    on_new_paths_last: int = 0


class SentinelWatch:
    """The sentinel of one fit, with the records not yet read and the counts not yet logged.

    Args:
        tier: The sentinel's tier (:data:`~lightning_ckpt_determinism.verify.sentinel.SentinelMode`).
        prefix: The monitor's ``log_prefix``.
        every_n_steps: The steps it watches: those whose global step is a multiple of it, and the step after a
            finding.
    """

    def __init__(self, *, tier: SentinelMode, prefix: str, every_n_steps: int = 1) -> None:
        self.tier = tier
        self.prefix = prefix
        self.every_n_steps = every_n_steps
        self.sentinel: RecomputationSentinel | None = None
        self._entered = contextlib.ExitStack()
        # The pause held between training batches (see the module's description), lifted while a batch runs.
        self._between_batches = contextlib.ExitStack()
        self._is_between_batches = False
        self._pending: list[tuple[int, SentinelStep | None, Exception | None]] = []
        # A failure of this rank's own since the last read (reading a clean record, starting a step, turning counts
        # into metrics), reduced with the next read's counts: one more record on this rank alone, or one fewer, would
        # change the length of what every rank reduces, and a rank that stopped alone would not read with the others.
        self._failed_since_read: Exception | None = None
        # Whether a memory budget's plan keeps every module plain: there is nothing to compare.
        self.all_plain = False
        # Whether Lightning compiles the LightningModule's steps (`trainer.fit(torch.compile(module))`): the compiler
        # recomputes every region out of the sentinel's sight, and none is a compiled module the sentinel can name.
        self.steps_compiled = False
        self._unlogged: dict[int, _StepCounts] = {}
        # Everything the fit's reads counted, over every rank: the fit's summary says it.
        self._read_totals = _StepCounts()
        # Training batches since the last logged step (a period that compared nothing still has its 0 to log), and
        # those of them the sentinel watched that ran a backward (one without, such as the statistics epoch of
        # `StochasticWeightAveraging`, recomputes nothing).
        self._batches_since_logged = 0
        self._watched_since_logged = 0
        # Whether the sentinel watches the batch under way (see `every_n_steps`), and whether it ran a backward.
        self._watching = True
        self._backward_ran = False
        self._warned: dict[str, int] = {}
        self._logged_step = -1
        # The last global step the logged periods cover, that of the batch that ended last, and that of each unlogged
        # batch by the step it started at: a batch covers one global step per optimizer step it took (two optimizers
        # stepping, two), so that `compared_per_step` counts global steps.
        self._covered = self._last_end = -1
        self._ends: dict[int, int] = {}
        self._said_nothing_compared = False
        # Whether this fit said that Lightning's logging interval could not be read.
        self._said_no_interval = False
        self._exact_from: int | None = None
        # False once the sentinel stopped after a failure of its own (its report stays readable).
        self._active = False
        self.step = 0

    def start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Enter the sentinel for the fit (every region of ``pl_module`` is watched). A failure of its own to start
        on any rank leaves it off on every rank, with one warning: the fit trains on without it."""
        self.stop()
        self.sentinel, failure = None, None
        try:
            self.sentinel = self._entered.enter_context(recomputation_sentinel(pl_module, mode=self.tier))
        except Exception as err:
            failure = err
        if agree(trainer.strategy, failure is not None):
            self._entered.close()
            self.sentinel, self._active = None, False
            reason = f"{type(failure).__name__}: {failure}" if failure is not None else "on another rank"
            rank_zero_warn(
                f"lightning_ckpt_determinism: the sentinel could not start ({reason}); training goes on without it."
                " Please report it.",
                category=LightningCkptDeterminismWarning,
            )
            return
        self._pending, self._unlogged, self._batches_since_logged, self._watched_since_logged = [], {}, 0, 0
        self._read_totals = _StepCounts()
        self._failed_since_read = None
        self._watching = True
        # The first period counts from the fit's first step (a resumed fit, a second `fit`, start past 0).
        self._warned, self._said_nothing_compared, self._said_no_interval = {}, False, False
        self.train_starts(trainer.global_step)
        self._exact_from = None
        self._active = True
        self._pause_between_batches()  # until the first batch starts: the sanity check runs before it

    def train_starts(self, global_step: int) -> None:
        """The first period counts from ``global_step``, the fit's first: past 0 in a second ``fit`` and in a fit
        resumed from a checkpoint, whose loops Lightning restores after ``on_fit_start``.

        Args:
            global_step: The Trainer's global step as training starts.
        """
        self._logged_step = self._covered = self._last_end = global_step - 1
        self._ends = {}

    def stop(self) -> None:
        """Leave the sentinel (its report stays readable)."""
        self._resume()
        self._entered.close()

    def _pause_between_batches(self) -> None:
        if self.sentinel is not None and self._active and not self._is_between_batches:
            self._between_batches.enter_context(self.sentinel.paused())
            self._is_between_batches = True

    def _resume(self) -> None:
        self._between_batches.close()
        self._is_between_batches = False

    @property
    def report(self) -> SentinelReport | None:
        """Everything the sentinel compared this fit on this rank, or ``None`` before a fit."""
        return None if self.sentinel is None else self.sentinel.report()

    @property
    def totals(self) -> SentinelTotals | None:
        """What the fit's reads counted over every rank, or ``None`` before a fit."""
        if self.sentinel is None:
            return None
        found = self._read_totals.mismatches
        mismatches = {name: found[name] for name in self.sentinel.regions if found.get(name)}
        # A compiled region that graph-breaks runs eagerly, and is compared: only the others go unseen.
        regions = self.sentinel.report().regions
        compiled = self.sentinel.regions if self.steps_compiled else self.sentinel.compiled
        unseen = [name for name in compiled if name not in regions or not regions[name].compared]
        totals = self._read_totals
        return SentinelTotals(totals.compared, mismatches, unseen, totals.on_new_paths, totals.on_new_paths_last)

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Watch nothing inside this block (the monitor's check passes)."""
        return self.sentinel.paused() if self.sentinel is not None else contextlib.nullcontext()

    @property
    def saved_bytes(self) -> dict[str, int]:
        """The bytes each region saved for backward at its first forward, as the sentinel measured them."""
        return {} if self.sentinel is None else self.sentinel.saved_bytes

    def escalate(self, step: int) -> None:
        """Digest every element of every saved tensor at global ``step`` (the step after a finding was read).

        Args:
            step: The global step.
        """
        self._exact_from = step

    def step_started(self, step: int) -> None:
        """A training batch starts at global step ``step``: the sentinel watches until it ends, and the windows move
        on (the tier is ``"exact"`` at an escalated step)."""
        self.step = step
        self._backward_ran = False
        if self.sentinel is None:
            return
        if self._exact_from is not None and step > self._exact_from:
            self._exact_from = None  # past the escalated step: back to the tier
        self._watching = step == self._exact_from or step % self.every_n_steps == 0
        if not self._watching:
            return  # paused as between batches: the step runs as without a sentinel
        self._resume()
        try:
            self.sentinel.next_step("exact" if step == self._exact_from else None)
        except Exception as err:  # the step is still recorded at its end; the next read stops it on every rank alike
            self._failed_since_read = err

    def backward_started(self) -> None:
        """The batch under way runs a backward, which recomputes its regions."""
        self._backward_ran = True

    def step_ended(self, *, batch_end: bool = True, next_step: int | None = None) -> None:
        """Close what was compared since the last call into one record, unread (no host read, no collective); at a
        batch's end, pause the sentinel until the next batch starts.

        Args:
            batch_end: Whether a training batch ends (``False`` before the optimizer step, under ``"raise"``).
            next_step: The global step after the batch, where it ends (one more than where it started per optimizer
                step it took).
        """
        if batch_end:
            self._pause_between_batches()
        if self.sentinel is None or not self._active:
            return
        if next_step is not None:  # cleared at each logged period, as the counts are
            self._last_end = self._ends[self.step] = max(next_step - 1, self.step)
        self._batches_since_logged += batch_end
        if not self._watching:
            return
        self._watched_since_logged += batch_end and self._backward_ran
        try:
            self._pending.append((self.step, self.sentinel.end_step(), None))
        except Exception as err:
            self._pending.append((self.step, None, err))

    def read(self, trainer: "pl.Trainer") -> list[SentinelFinding]:
        """Read every record since the last read: one all-reduce of the counts and one host read, on every rank
        alike; the steps that differed are read in detail and gathered. The findings, each at its step.

        Every rank calls the same collectives whatever happens: a failure of the sentinel's own bookkeeping on any
        rank is reduced with the counts, and then every rank stops its sentinel.
        """
        sentinel, pending = self.sentinel, self._pending
        if sentinel is None or not self._active or not pending:
            return []
        self._pending = []
        strategy = trainer.strategy
        device = strategy.root_device
        regions = len(sentinel.regions)
        failed = next((error for _, _, error in pending if error is not None), self._failed_since_read)
        self._failed_since_read = None
        counts, compared = [], []
        # What calls on new code paths left out at each step whose records compared or left out anything (a step's
        # micro-batches each close a record; a step without a backward closes an empty one).
        new_paths_at: dict[int, int] = {}
        for step, record, _ in pending:
            found, seen = None, 0
            try:
                if record is not None and failed is None:
                    found, seen = record.mismatch_counts(device), record.compared
                    if seen or record.on_new_paths:
                        new_paths_at[step] = new_paths_at.get(step, 0) + record.on_new_paths
            except Exception as err:
                failed, found = err, None
            counts.append(found if found is not None else torch.zeros(regions, dtype=torch.int64, device=device))
            compared.append(seen)
        last = new_paths_at[max(new_paths_at)] if new_paths_at else 0
        # Each record's mismatches per region, then what every record compared, what calls on new code paths left
        # out (in all, and at the last step that compared or left out anything, with whether there was one), then
        # the failure flag: summed over ranks in one collective, so that each counts the same ranks.
        tail = [*compared, sum(new_paths_at.values()), last, int(bool(new_paths_at)), int(failed is not None)]
        reduced = all_reduce(strategy)(
            torch.cat([*counts, torch.tensor(tail, dtype=torch.int64, device=device)]), "sum"
        ).tolist()
        if reduced[-1]:
            self._fail(failed)
            return []
        compared_by_all = reduced[len(pending) * regions : -4]
        self._read_totals.on_new_paths += reduced[-4]
        if reduced[-2]:  # else the last step that did is one an earlier read counted
            self._read_totals.on_new_paths_last = reduced[-3]
        differed = []
        for index, (step, record, _) in enumerate(pending):
            row = reduced[index * regions : (index + 1) * regions]
            if compared_by_all[index]:
                self._unlogged.setdefault(step, _StepCounts()).compared += compared_by_all[index]
                self._read_totals.compared += compared_by_all[index]
            if record is None:  # only with a failure, which the flag carries
                continue
            if any(row):
                differed.append((step, record))
                continue
            try:
                sentinel.read(record, clean=True)
            except Exception as err:  # the sentinel stopped; the next read stops it on every rank alike
                self._failed_since_read = err
        if not differed:
            return []
        try:
            periods: list[dict[str, SentinelRegion]] | None = [sentinel.read(record) for _, record in differed]
        except Exception as err:
            failed, periods = err, None
        gathered = gather(strategy, (trainer.global_rank, periods))
        if any(by_step is None for _, by_step in gathered):
            self._fail(failed)
            return []
        return [
            finding
            for at, (step, _) in enumerate(differed)
            for finding in self._findings(step, [(rank, by_step[at]) for rank, by_step in gathered])
        ]

    def _findings(self, step: int, found: list[tuple[int, dict[str, SentinelRegion]]]) -> list[SentinelFinding]:
        findings = []
        counts = self._unlogged.setdefault(step, _StepCounts())
        for name in self.sentinel.regions if self.sentinel is not None else []:
            here = [(rank, regions[name]) for rank, regions in found if regions[name].mismatches]
            if here:
                total = sum(region.mismatches for _, region in here)
                counts.mismatches[name] = counts.mismatches.get(name, 0) + total
                totals = self._read_totals.mismatches
                totals[name] = totals.get(name, 0) + total
                first = here[0][1]
                findings.append(
                    SentinelFinding(
                        step, name, total, first.first_mismatch or "(unnamed)", [rank for rank, _ in here], first.cause
                    )
                )
        return findings

    def failed(self, error: Exception, *, several_ranks: bool) -> None:
        """A failure of the monitor's own with the sentinel's counts between reads (turning them into metrics,
        publishing them): on one process the sentinel stops now; on several, the next read stops it on every rank
        alike (a rank that stopped alone would leave the others waiting in that read's collective).

        Args:
            error: What was raised.
            several_ranks: Whether other ranks read with this one later in the fit (a failure no read reduces is said
                at the fit's end, :meth:`failed_after_last_read`).
        """
        if not self._active:
            return  # stopped already, and said so
        if several_ranks:
            self._failed_since_read = error
        else:
            self._fail(error)

    def failed_after_last_read(self) -> None:
        """Stop the sentinel after a failure of this rank's own that no read reduced (the fit's last read found no
        record to read with it), saying so: no read follows, so this rank alone does."""
        error, self._failed_since_read = self._failed_since_read, None
        if error is not None and self._active:
            self._fail(error)

    def _fail(self, error: Exception | None) -> None:
        """Stop the sentinel after a failure of its own (here or on another rank), saying so once."""
        reason = f"{type(error).__name__}: {error}" if error is not None else "on another rank"
        rank_zero_warn(
            f"lightning_ckpt_determinism: the sentinel stopped after a failure of its own ({reason}); training goes"
            " on, and the periodic check still runs. Please report it.",
            category=LightningCkptDeterminismWarning,
        )
        self.stop()
        self._active = False

    def respond(
        self,
        findings: list[SentinelFinding],
        *,
        on_divergence: str,
        several_ranks: bool,
        then: str = "",
        syntax: Syntax = "python",
    ) -> bool:
        """Act on ``findings`` as ``on_divergence`` says: raise on every rank, warn on rank zero of each, or nothing;
        whether a warning was given.

        Args:
            findings: What :meth:`read` returned, alike on every rank; to warn, those of them :meth:`due` keeps.
            on_divergence: ``"warn"``, ``"raise"`` or ``"ignore"``.
            several_ranks: Whether the messages name the ranks.
            then: What the monitor does next to name a cause the sentinel does not know (a sentence), or ``""``.
            syntax: How the messages spell the settings their hints name.

        Raises:
            RecomputationDivergenceError: With ``on_divergence="raise"``, if anything differed.
        """
        if not findings or on_divergence == "ignore":
            return False
        if on_divergence == "raise":
            messages = (_told(finding, several_ranks, "", syntax) for finding in findings)
            raise RecomputationDivergenceError(" ".join(messages))
        for finding in findings:
            self._warned[finding.region] = finding.step
            rank_zero_warn(_told(finding, several_ranks, then, syntax), category=LightningCkptDeterminismWarning)
        return True

    def due(self, findings: list[SentinelFinding], every_n_steps: int) -> list[SentinelFinding]:
        """The ``findings`` that warn: a region's first, and one ``every_n_steps`` after its last warning.

        Args:
            findings: What :meth:`read` returned.
            every_n_steps: Steps before a region warns again.
        """
        last = dict(self._warned)
        due = []
        for finding in findings:
            if finding.region not in last or finding.step - last[finding.region] >= every_n_steps:
                last[finding.region] = finding.step
                due.append(finding)
        return due

    def metrics_due(self, trainer: "pl.Trainer") -> bool:
        """Whether the batch ending now completes a step Lightning logs at (``log_every_n_steps``) not logged yet.
        Where Lightning's count of batches cannot be read (a Lightning that keeps it elsewhere; every rank alike),
        never, said once: the counts then reach ``trainer.callback_metrics`` at check steps and epoch ends, and the
        loggers at the fit's end.

        Args:
            trainer: The Trainer.
        """
        if trainer.global_step <= self.step or self._logged_step == self.step or not self._active:
            return False
        try:
            return lightning_logs_this_batch(trainer)
        except Exception as err:
            if not self._said_no_interval:
                self._said_no_interval = True
                rank_zero_warn(
                    "lightning_ckpt_determinism: the monitor could not read which batches Lightning logs at"
                    f" ({type(err).__name__}: {err}); the sentinel's counts reach `trainer.callback_metrics` at check"
                    " steps and epoch ends, and the loggers at the fit's end. Please report it.",
                    category=LightningCkptDeterminismWarning,
                )
            return False

    def metrics(self, *, last: bool = False) -> SentinelMetrics | None:
        """The metrics of every step read since the last logged one, logged at the current step (or, at the fit's
        end with ``last``, what is still unlogged); ``None`` when there is nothing to log.

        ``{prefix}/sentinel/compared`` counts the saved tensors compared (``compared_per_step`` the same per
        training step, alike whatever the logging interval); ``{prefix}/sentinel/mismatches`` the
        mismatches, given only when something was compared or differed (both summed over ranks);
        ``{prefix}/sentinel/regions/<name>/mismatches`` for each region that had any. The loggers get a point at
        each step that had mismatches (counting the steps since the previous point) and one at the current step.

        Args:
            last: The fit ends: log what is unlogged, if anything.
        """
        if self.sentinel is None or not self._active or (last and not self._batches_since_logged):
            return None
        first = since_step = self._covered
        end = self._period_end
        self._logged_step, self._covered = self.step, end
        unlogged, self._unlogged, self._batches_since_logged = self._unlogged, {}, 0
        watched, self._watched_since_logged = self._watched_since_logged, 0
        ends, self._ends = self._ends, {}
        points: list[tuple[int, dict[str, float]]] = []
        since = _StepCounts()
        for step in sorted(unlogged):
            _add(since, unlogged[step])
            if unlogged[step].mismatches:
                at = ends.get(step, step)
                points.append((step, self._values(since, at - since_step)))
                since, since_step = _StepCounts(), at
        if not points or points[-1][0] != self.step:
            points.append((self.step, self._values(since, end - since_step)))
        total = self._total(unlogged)
        if watched and not total.compared and not total.mismatches:
            self._nothing_compared()
        return SentinelMetrics(points, self._values(total, end - first))

    def so_far(self) -> dict[str, float] | None:
        """What ``trainer.callback_metrics`` gets between logging steps (at check steps and epoch ends): the counts
        of every step read since the last logged one, leaving them for the loggers' next point; ``None`` when there
        is nothing to show."""
        if self.sentinel is None or not self._active:
            return None
        return self._values(self._total(self._unlogged), self._period_end - self._covered)

    @property
    def _period_end(self) -> int:
        """The last global step the period under way covers: that of the batch that ended last."""
        return max(self._last_end, self.step)

    @staticmethod
    def _total(unlogged: dict[int, _StepCounts]) -> _StepCounts:
        total = _StepCounts()
        for counts in unlogged.values():
            _add(total, counts)
        return total

    def _values(self, counts: _StepCounts, steps: int) -> dict[str, float]:
        mismatches = sum(counts.mismatches.values())
        values = {
            f"{self.prefix}/sentinel/compared": float(counts.compared),
            f"{self.prefix}/sentinel/compared_per_step": counts.compared / max(steps, 1),
        }
        if counts.compared or mismatches:
            values[f"{self.prefix}/sentinel/mismatches"] = float(mismatches)
        for name, count in counts.mismatches.items():
            values[f"{self.prefix}/sentinel/regions/{name}/mismatches"] = float(count)
        return values

    def _nothing_compared(self) -> None:
        """Say once per fit why a logged period compared nothing."""
        if self._said_nothing_compared or self.sentinel is None or self.all_plain:
            return  # without a checkpointed region the monitor says so itself
        self._said_nothing_compared = True
        report = self.sentinel.report()
        if self.steps_compiled:
            why = (
                "the LightningModule's steps are compiled (`trainer.fit(torch.compile(module))`), and the compiler"
                " recomputes every region out of the sentinel's sight"
            )
        elif report.compiled and len(report.compiled) == len(report.regions):
            why = "every checkpointed region is compiled, and the compiler recomputes it out of the sentinel's sight"
        elif report.not_compared and report.on_new_paths == report.not_compared:
            why = (
                "every call it met took a code path its region had not learned yet (a branch taken for the first"
                " time, or a loop run another number of times, as a recurrent layer over a new sequence length; the"
                " next call that takes it is learned and compared)"
            )
        elif report.not_compared:
            why = (
                f"the {report.not_compared} saved tensors it met were left out (opaque workspaces, tensors without"
                " bits to read, or tensors it failed to read)"
            )
        else:
            why = (
                "no checkpointed region saved a tensor for backward, running checkpointed, eagerly and with"
                " gradients, in the steps since the last logged one (every call returned before saving one, as a"
                " LayerDrop that returns its input; or a call that initialises a region's lazy modules, which runs"
                " without checkpointing)"
            )
        rank_zero_warn(
            f"lightning_ckpt_determinism: the sentinel compared nothing in the steps logged at step {self.step}:"
            f" {why}. `{self.prefix}/sentinel/compared` is 0 and no `{self.prefix}/sentinel/mismatches` is logged"
            " for them; the periodic check still compares gradients at the steps that recompute a region.",
            category=LightningCkptDeterminismWarning,
        )


def _told(finding: SentinelFinding, several_ranks: bool, then: str, syntax: Syntax) -> str:
    """``finding``'s message; where writing it fails, a shorter one that says so (the finding still warns or raises,
    on every rank alike)."""
    try:
        return respelt(finding.message(several_ranks, then), syntax)
    except Exception as err:
        return (
            f"lightning_ckpt_determinism: the sentinel saw region `{finding.region}` recompute other values than its"
            f" forward at step {finding.step}; the monitor failed to write the details ({type(err).__name__}: {err})."
            " Please report it."
        )


def _add(into: _StepCounts, counts: _StepCounts) -> None:
    into.compared += counts.compared
    for name, count in counts.mismatches.items():
        into.mismatches[name] = into.mismatches.get(name, 0) + count
