"""The monitor's sentinel over one fit: every training step's recomputed saved tensors compared with the forward's.

The sentinel (:func:`~lightning_ckpt_determinism.recomputation_sentinel`) is entered when the fit starts and left
when it ends. At each training batch's end the monitor reads the batch's counts once: the number of mismatching
region calls, computed on the device, reduced over ranks (one small all-reduce), read back to the host; only when
something differed does every rank read its details, and every rank's are gathered. The counts are logged at
Lightning's logging steps (``log_every_n_steps``), each logged value counting everything since the last logged step.
The monitor's own check passes are not watched: they rerun the step, they do not train.
"""

import contextlib
from dataclasses import dataclass, field

import lightning.pytorch as pl

from lightning_ckpt_determinism.lightning.parallel import all_reduce, gather
from lightning_ckpt_determinism.verify.sentinel import RecomputationSentinel, SentinelReport, recomputation_sentinel

__all__ = ["SentinelFinding", "SentinelWatch"]


@dataclass(frozen=True)
class SentinelFinding:
    """A region whose recomputation differed at one step, over every rank.

    Attributes:
        step: The global step at the step's start.
        region: The region's name.
        mismatches: Saved tensors that differed, summed over ranks.
        first_mismatch: The first that differed, as the first rank that found one describes it.
        ranks: The ranks where it differed.
    """

    step: int
    region: str
    mismatches: int
    first_mismatch: str
    ranks: list[int] = field(default_factory=list)

    def message(self, several_ranks: bool) -> str:
        ranks = f" (rank{'s' if len(self.ranks) > 1 else ''} {', '.join(map(str, self.ranks))})"
        where = ranks if several_ranks else ""
        return (
            f"lightning_ckpt_determinism: the sentinel saw region `{self.region}` recompute other values than its"
            f" forward at step {self.step}{where}: {self.mismatches} saved tensor{'s' if self.mismatches != 1 else ''}"
            f" differed, the first {self.first_mismatch}. The next step is checked in full, with attribution, to name"
            " the cause."
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
        self._warned: dict[str, int] = {}
        self._logged_step = -1
        self.step = 0

    def start(self, pl_module: "pl.LightningModule") -> None:
        """Enter the sentinel for the fit (every region of ``pl_module`` is watched)."""
        self.stop()
        self.sentinel = self._entered.enter_context(recomputation_sentinel(pl_module, exact=self.exact))
        self._unlogged = dict.fromkeys(self.sentinel.regions, 0)
        self._warned, self._logged_step = {}, -1

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
        """Count what the batch compared (one host read), on every rank alike; the regions that differed."""
        sentinel = self.sentinel
        if sentinel is None:
            return []
        strategy = trainer.strategy
        counts = all_reduce(strategy)(sentinel.pending_mismatches(strategy.root_device), "sum").tolist()
        if not any(counts):
            sentinel.settle(clean=True)
            return []
        found = gather(strategy, (trainer.global_rank, sentinel.settle()))
        findings = []
        for name in sentinel.regions:
            here = [(rank, regions[name]) for rank, regions in found if regions[name].mismatches]
            if here:
                total = sum(region.mismatches for _, region in here)
                self._unlogged[name] = self._unlogged.get(name, 0) + total
                first = here[0][1].first_mismatch or "(unnamed)"
                findings.append(SentinelFinding(self.step, name, total, first, [rank for rank, _ in here]))
        return findings

    def news(self, findings: list[SentinelFinding], every_n_steps: int, *, several_ranks: bool) -> list[str]:
        """The warnings due for ``findings``: a region warns again only ``every_n_steps`` after its last warning."""
        messages = []
        for finding in findings:
            last = self._warned.get(finding.region)
            if last is None or finding.step - last >= every_n_steps:
                self._warned[finding.region] = finding.step
                messages.append(finding.message(several_ranks))
        return messages

    def metrics_due(self, trainer: "pl.Trainer", *, last: bool = False) -> dict[str, float] | None:
        """The metrics to log now, or ``None``: at the batch that completes a step Lightning logs at
        (``log_every_n_steps``), under that step, and at the fit's end (``last``) for what is still unlogged.

        ``{prefix}/sentinel/mismatches`` counts every mismatching saved tensor since the last logged step, summed
        over ranks; ``{prefix}/sentinel/regions/<name>/mismatches`` is given for each region that had any.
        """
        every = getattr(trainer, "log_every_n_steps", 50)
        due = trainer.global_step > self.step and every > 0 and (self.step + 1) % every == 0
        due = due and self._logged_step != self.step
        if self.sentinel is None or not (due or (last and any(self._unlogged.values()))):
            return None
        self._logged_step = self.step
        logged = {f"{self.prefix}/sentinel/mismatches": float(sum(self._unlogged.values()))}
        for name, count in self._unlogged.items():
            if count:
                logged[f"{self.prefix}/sentinel/regions/{name}/mismatches"] = float(count)
        self._unlogged = dict.fromkeys(self._unlogged, 0)
        return logged
