"""The monitor's sentinel over one fit: every training step's recomputed saved tensors compared with the forward's.

The sentinel (:func:`~lightning_ckpt_determinism.recomputation_sentinel`) is entered when the fit starts and left
when it ends. At each training batch's end the monitor reads the batch's counts once: the number of mismatches per
region, computed on the device, reduced over ranks (one small all-reduce), read back to the host; only when
something differed does every rank read its details, and every rank's are gathered. The counts are logged at
Lightning's logging steps (``log_every_n_steps``), each logged value counting everything since the last logged step:
``{prefix}/sentinel/compared`` always, ``{prefix}/sentinel/mismatches`` only when something was compared (a period
that compared nothing has no mismatch count to show, and the monitor says once why). The monitor's own check passes
are not watched: they rerun the step, they do not train. A failure of the sentinel's own bookkeeping stops the
sentinel on every rank alike, with one warning, and never the fit.
"""

import contextlib
from dataclasses import dataclass, field

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_ckpt_determinism.errors import LightningCkptDeterminismWarning, RecomputationDivergenceError
from lightning_ckpt_determinism.lightning.parallel import all_reduce, gather
from lightning_ckpt_determinism.verify.cause import Cause, Syntax, respelt
from lightning_ckpt_determinism.verify.sentinel import (
    RecomputationSentinel,
    SentinelRegion,
    SentinelReport,
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

    def message(self, several_ranks: bool) -> str:
        ranks = f" (rank{'s' if len(self.ranks) > 1 else ''} {', '.join(map(str, self.ranks))})"
        where = ranks if several_ranks else ""
        count = f"{self.mismatches} mismatch{'es' if self.mismatches != 1 else ''}"
        if self.cause is not None:
            then = f" Cause {self.cause}: {self.cause.hint}"
        else:
            then = " The next step is checked in full, with attribution, to name the cause."
        return (
            f"lightning_ckpt_determinism: the sentinel saw region `{self.region}` recompute other values than its"
            f" forward at step {self.step}{where}: {count}, first: {self.first_mismatch}.{then}"
        )


class SentinelWatch:
    """The sentinel of one fit, with the counts not yet logged.

    Args:
        exact: Digest every element instead of a rotating sample.
        prefix: The monitor's ``log_prefix``.
    """

    def __init__(self, *, exact: bool, prefix: str) -> None:
        self.exact = exact
        self.prefix = prefix
        self.sentinel: RecomputationSentinel | None = None
        self._entered = contextlib.ExitStack()
        self._unlogged: dict[str, int] = {}
        self._unlogged_compared = 0
        self._unlogged_steps = 0
        self._warned: dict[str, int] = {}
        self._logged_step = -1
        self._said_nothing_compared = False
        # False once the sentinel stopped after a failure of its own (its report stays readable).
        self._active = False
        self.step = 0

    def start(self, pl_module: "pl.LightningModule") -> None:
        """Enter the sentinel for the fit (every region of ``pl_module`` is watched)."""
        self.stop()
        self.sentinel = self._entered.enter_context(recomputation_sentinel(pl_module, exact=self.exact))
        self._unlogged = dict.fromkeys(self.sentinel.regions, 0)
        self._unlogged_compared = self._unlogged_steps = 0
        self._warned, self._logged_step, self._said_nothing_compared = {}, -1, False
        self._active = True

    def stop(self) -> None:
        """Leave the sentinel (its report stays readable)."""
        self._entered.close()

    @property
    def report(self) -> SentinelReport | None:
        """Everything the sentinel compared this fit, or ``None`` before a fit."""
        return None if self.sentinel is None else self.sentinel.report()

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Watch nothing inside this block (the monitor's check passes)."""
        return self.sentinel.paused() if self.sentinel is not None else contextlib.nullcontext()

    @property
    def saved_bytes(self) -> dict[str, int]:
        """The bytes each region saved for backward at its first forward, as the sentinel measured them."""
        return {} if self.sentinel is None else self.sentinel.saved_bytes

    def step_started(self, step: int) -> None:
        """A training batch starts at global step ``step``: the sample moves on."""
        self.step = step
        if self.sentinel is not None:
            self.sentinel.next_step()

    def step_ended(self, trainer: "pl.Trainer") -> list[SentinelFinding]:
        """Count what the batch compared (one host read), on every rank alike; the regions that differed.

        Every rank calls the same collectives whatever happens: a failure of the sentinel's own bookkeeping on any
        rank is reduced with the counts, and then every rank stops its sentinel.
        """
        sentinel = self.sentinel
        if sentinel is None or not self._active:
            return []
        strategy = trainer.strategy
        device = strategy.root_device
        failed = None
        try:
            pending = sentinel.pending_mismatches(device)
            compared = sentinel.pending_compared()
        except Exception as err:
            failed, compared = err, 0
            pending = torch.zeros(len(sentinel.regions), dtype=torch.int64, device=device)
        flag = torch.tensor([int(failed is not None)], dtype=torch.int64, device=device)
        counts = all_reduce(strategy)(torch.cat([pending, flag]), "sum").tolist()
        if counts[-1]:
            self._fail(failed)
            return []
        self._unlogged_compared += compared
        self._unlogged_steps += 1
        if not any(counts[:-1]):
            sentinel.settle(clean=True)
            return []
        try:
            period: dict[str, SentinelRegion] | None = sentinel.settle()
        except Exception as err:
            failed, period = err, None
        found = gather(strategy, (trainer.global_rank, period))
        if any(regions is None for _, regions in found):
            self._fail(failed)
            return []
        return self._findings(found)

    def _findings(self, found: list[tuple[int, dict[str, SentinelRegion]]]) -> list[SentinelFinding]:
        findings = []
        for name in self.sentinel.regions if self.sentinel is not None else []:
            here = [(rank, regions[name]) for rank, regions in found if regions[name].mismatches]
            if here:
                total = sum(region.mismatches for _, region in here)
                self._unlogged[name] = self._unlogged.get(name, 0) + total
                first = here[0][1]
                findings.append(
                    SentinelFinding(
                        self.step,
                        name,
                        total,
                        first.first_mismatch or "(unnamed)",
                        [rank for rank, _ in here],
                        first.cause,
                    )
                )
        return findings

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
        every_n_steps: int,
        several_ranks: bool,
        syntax: Syntax = "python",
    ) -> bool:
        """Act on a batch's ``findings`` as ``on_divergence`` says: raise on every rank, warn on rank zero (a region
        again only ``every_n_steps`` after its last warning), or nothing; whether a warning was given.

        Args:
            findings: What :meth:`step_ended` returned, alike on every rank.
            on_divergence: ``"warn"``, ``"raise"`` or ``"ignore"``.
            every_n_steps: Steps before a region warns again.
            several_ranks: Whether the messages name the ranks.
            syntax: How the messages spell the settings their hints name.

        Raises:
            RecomputationDivergenceError: With ``on_divergence="raise"``, if anything differed.
        """
        if not findings or on_divergence == "ignore":
            return False
        if on_divergence == "raise":
            messages = (respelt(finding.message(several_ranks), syntax) for finding in findings)
            raise RecomputationDivergenceError(" ".join(messages))
        warned = False
        for finding in findings:
            last = self._warned.get(finding.region)
            if last is None or finding.step - last >= every_n_steps:
                self._warned[finding.region] = finding.step
                message = respelt(finding.message(several_ranks), syntax)
                rank_zero_warn(message, category=LightningCkptDeterminismWarning)
                warned = True
        return warned

    def metrics_due(self, trainer: "pl.Trainer", *, last: bool = False) -> dict[str, float] | None:
        """The metrics to log now, or ``None``: at the batch that completes a step Lightning logs at
        (``log_every_n_steps``), under that step, and at the fit's end (``last``) for what is still unlogged.

        ``{prefix}/sentinel/compared`` counts the saved tensors compared since the last logged step;
        ``{prefix}/sentinel/mismatches`` every mismatch since then, summed over ranks, given only when something was
        compared or differed; ``{prefix}/sentinel/regions/<name>/mismatches`` for each region that had any.
        """
        every = getattr(trainer, "log_every_n_steps", 50)
        due = trainer.global_step > self.step and every > 0 and (self.step + 1) % every == 0
        due = due and self._logged_step != self.step
        pending = self._unlogged_steps > 0
        if self.sentinel is None or not self._active or not (due or (last and pending)):
            return None
        self._logged_step = self.step
        mismatches = sum(self._unlogged.values())
        logged = {f"{self.prefix}/sentinel/compared": float(self._unlogged_compared)}
        if self._unlogged_compared or mismatches:
            logged[f"{self.prefix}/sentinel/mismatches"] = float(mismatches)
        else:
            self._nothing_compared()
        for name, count in self._unlogged.items():
            if count:
                logged[f"{self.prefix}/sentinel/regions/{name}/mismatches"] = float(count)
        self._unlogged = dict.fromkeys(self._unlogged, 0)
        self._unlogged_compared = self._unlogged_steps = 0
        return logged

    def _nothing_compared(self) -> None:
        """Say once per fit why a logged period compared nothing."""
        if self._said_nothing_compared or self.sentinel is None:
            return
        self._said_nothing_compared = True
        report = self.sentinel.report()
        if report.compiled and len(report.compiled) == len(report.regions):
            why = "every checkpointed region is compiled, and the compiler recomputes it out of the sentinel's sight"
        elif report.not_compared:
            why = (
                f"the {report.not_compared} saved tensors it met were left out (opaque workspaces, tensors without"
                " bits to read, or tensors it failed to read)"
            )
        else:
            why = "no checkpointed region ran eagerly with gradients in the steps since the last logged one"
        rank_zero_warn(
            f"lightning_ckpt_determinism: the sentinel compared nothing in the steps logged at step {self.step}:"
            f" {why}. `{self.prefix}/sentinel/compared` is 0 and no `{self.prefix}/sentinel/mismatches` is logged"
            " for them; the periodic check still compares gradients.",
            category=LightningCkptDeterminismWarning,
        )
