"""What the monitor makes of a check on every rank: the figures reduced over ranks, the regions each rank found,
the metrics it logs, the history entry it keeps and the warning it gives."""

import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_ckpt_determinism.verify.cause import Cause
from lightning_ckpt_determinism.verify.compare import worst_parameters
from lightning_ckpt_determinism.verify.core import gradients_diverge
from lightning_ckpt_determinism.verify.live_step import OTHER_RANKS_STATE
from lightning_ckpt_determinism.verify.outcome import diverging, region_outcome, report_diverged
from lightning_ckpt_determinism.verify.reports import RecomputationReport, RegionReport

__all__ = ["CheckRecord", "Findings", "FitSummary", "divergence_message", "metrics", "reduce_findings", "warning_key"]

_LOGGED_REGIONS = 5
_NAMED_REGIONS = 3
_GENERIC_CAUSES = (
    "Something in a checkpointed module differs between forward and recomputation: dropout with"
    " `preserve_rng_state=False`, NumPy or `random` without `preserve_host_rng=True`, buffers without"
    " `protect_buffers=True`, Python state read in forward, or a non-deterministic kernel."
)


@dataclass(frozen=True)
class CheckRecord:
    """One entry of ``RecomputationMonitor.history``.

    Attributes:
        step: The global step checked.
        grad_divergence: The largest divergence over ranks (``nan`` when skipped).
        max_abs_diff: The largest gradient difference over ranks.
        diverged: Whether any rank diverged.
        skipped: Why the step was not checked, or ``None`` when it was.
        checked_regions: With ``reference_regions``, the regions the reference ran plainly; ``None`` otherwise.

    Example::

        >>> CheckRecord(step=0, grad_divergence=0.0, max_abs_diff=0.0, diverged=False).skipped is None
        True
    """

    step: int
    grad_divergence: float = math.nan
    max_abs_diff: float = math.nan
    diverged: bool = False
    skipped: str | None = None
    checked_regions: list[str] | None = None


@dataclass(frozen=True)
class RankFindings:
    """What one rank found, sent to every rank when a check diverged."""

    rank: int
    error: str | None
    worst_parameters: list[tuple[str, float]]
    regions: list[RegionReport]
    attributed: bool
    hint: str | None
    buffer_mutations: list[str] = field(default_factory=list)
    attribute_mutations: list[str] = field(default_factory=list)
    cause: str | None = None

    @classmethod
    def of(cls, rank: int, report: RecomputationReport) -> "RankFindings":
        regions = diverging(report.regions)
        return cls(
            rank,
            report.error,
            report.worst_parameters,
            regions,
            # Attribution that compared no op of any region saw none (steps compiled as functions): it proves nothing.
            any(region.ops_compared for region in report.regions),
            None if _told_by_another_rank(report) else report.hint,
            report.buffer_mutations,
            report.attribute_mutations,
            report.cause,
        )


def _told_by_another_rank(report: RecomputationReport) -> bool:
    """Whether ``report`` names buffers or attributes that changed on another rank only, whose own report names them
    (the hint then says it once, with their names)."""
    hint = report.hint or ""
    return any(hint.endswith(f" Changed: {placeholder}.") for placeholder in OTHER_RANKS_STATE)


@dataclass(frozen=True)
class Findings:
    """A check's figures over every rank, and each rank's findings when any diverged."""

    grad_divergence: float
    max_abs_diff: float
    noise_floor: float
    diverged: bool
    ranks: list[RankFindings] = field(default_factory=list)
    buffers_changed: int = 0
    gradients_diverged: bool = False
    attributes_changed: int = 0


def reduce_findings(report: RecomputationReport, device: torch.device, reduce: Any, gather: Any, rank: int) -> Findings:
    """The figures of this rank's ``report`` reduced over ranks (one collective), and, on a divergence anywhere,
    every rank's findings (one more, decided alike on every rank).

    Args:
        report: This rank's report.
        device: Where the reduced tensor lives.
        reduce: ``tensor, op -> reduced over ranks``.
        gather: ``value -> every rank's value``.
        rank: This rank.
    """
    diverged_here = report_diverged(report)
    gradients_here = gradients_diverge(report.grad_divergence, report.tolerance, report.noise_floor, error=report.error)
    figures = [report.grad_divergence, report.max_abs_diff, float(diverged_here), report.noise_floor]
    states = [float(len(report.buffer_mutations)), float(len(report.attribute_mutations))]
    local = torch.tensor(
        [*figures, *states, float(gradients_here)],
        dtype=torch.float64 if device.type != "mps" else torch.float32,
        device=device,
    )
    divergence, max_abs_diff, diverged, noise_floor, buffers, attributes, gradients = reduce(local, "max").tolist()
    ranks = gather(RankFindings.of(rank, report)) if diverged > 0.0 else []
    return Findings(
        divergence, max_abs_diff, noise_floor, diverged > 0.0, ranks, int(buffers), gradients > 0.0, int(attributes)
    )


def metrics(findings: Findings, prefix: str, *, calibrate_noise: bool) -> dict[str, float]:
    """The metrics of one check: divergence, largest difference, the noise floor if measured, and up to five
    diverging regions (worst over ranks) with their largest difference and buffers changed."""
    logged = {
        f"{prefix}/grad_divergence": findings.grad_divergence,
        f"{prefix}/max_abs_diff": findings.max_abs_diff,
        f"{prefix}/buffer_mutations": float(findings.buffers_changed),
        f"{prefix}/attribute_mutations": float(findings.attributes_changed),
    }
    if calibrate_noise:
        logged[f"{prefix}/noise_floor"] = findings.noise_floor
    for region in _worst_over_ranks(findings.ranks)[:_LOGGED_REGIONS]:
        logged[f"{prefix}/regions/{region.name}/max_abs_diff"] = region.max_abs_diff
        if region.buffer_mutations:
            logged[f"{prefix}/regions/{region.name}/buffer_mutations"] = float(len(region.buffer_mutations))
    return logged


def warning_key(findings: Findings) -> str:
    """What kind of finding this is, so that one kind warns once."""
    causes = sorted({region_outcome(region).cause or "" for finding in findings.ranks for region in finding.regions})
    errors = sorted({finding.error.split(":", 1)[0] for finding in findings.ranks if finding.error})
    return f"causes:{causes}" if causes else f"errors:{errors}" if errors else "gradients"


def divergence_message(
    step: int,
    findings: Findings,
    report: RecomputationReport,
    attribution: str,
    unattributed: str | None = None,
    unseen: str | None = None,
) -> str:
    """The warning (or error) for a check that diverged: the figures, the first error, the worst parameters, up to
    three regions with their op, cause, hint and ranks, or what to look for (with ``unattributed``, why no region is
    named: the strategy cannot run the two-pass check; with ``unseen``, a sentence saying why attribution sees no
    region of this fit and what to do)."""
    several = len(findings.ranks) > 1
    parts = [_headline(step, findings, report)]
    errors = [finding for finding in findings.ranks if finding.error]
    for finding in errors[:1]:
        where = f" on rank {finding.rank}" if several else ""
        parts.append(f"Recomputation failed{where}: {(finding.error or '').rstrip('.')}.")
    worst = _worst_parameters_over_ranks(findings.ranks) if findings.ranks else report.worst_parameters
    if worst and not errors:
        parts.append(f"The worst parameters: {', '.join(f'{name} ({diff:.3g})' for name, diff in worst)}.")
    sentences: dict[str, list[int]] = {}
    named = [(finding.rank, region) for finding in findings.ranks for region in finding.regions[:_NAMED_REGIONS]]
    # The catch-all cause last: under tensor parallelism a rank without a defect of its own sees other inputs arrive
    # through a collective (`python_state`), while the rank that has it names its specific cause.
    for rank, region in sorted(named, key=lambda entry: _is_catch_all(region_outcome(entry[1]).cause)):
        sentences.setdefault(region_outcome(region).finding or "", []).append(rank)
    for sentence, on in list(sentences.items())[:_NAMED_REGIONS]:
        suffix = f" (rank{'s' if len(on) > 1 else ''} {', '.join(map(str, on))})" if several else ""
        parts.append(f"{sentence.rstrip('.')}{suffix}.")
    if sentences or errors:
        return " ".join(parts)
    hints = list(dict.fromkeys(finding.hint for finding in findings.ranks if finding.hint))
    if hints:
        return " ".join([*parts, *hints])
    if any(finding.attributed for finding in findings.ranks):
        parts.append(
            "Every checkpointed region recomputed exactly what its forward produced when rerun with attribution: the"
            " difference changes from pass to pass, as Python state a module updates in forward (a counter) does, or"
            " state that a hook between the forward and the backward changes (`on_before_backward`), which the rerun"
            " does not run."
        )
    elif unattributed is not None:
        parts.append(
            f"No region is named: {unattributed}. To be told which region and op, check the same model under FSDP2"
            " (`ModelParallelCheckpointingStrategy`) or on one device."
        )
    elif unseen is not None:
        parts.append(unseen)
    elif attribution == "never":
        parts.append("Set `attribution` to be told which region and op.")
    return " ".join([*parts, _GENERIC_CAUSES])


def _is_catch_all(cause: object) -> bool:
    """Whether ``cause`` is attribution's last rule (other inputs, or another sequence of ops: ``python_state``), which
    a difference arriving from elsewhere also gets; named after the causes an op proves."""
    return cause == Cause.PYTHON_STATE


def _worst_parameters_over_ranks(ranks: list[RankFindings]) -> list[tuple[str, float]]:
    """The worst parameters of every rank's findings, each by its largest difference on any rank: a two-pass check
    compares each rank's own gradients, so a rank alone may hold the worst (the live check's figures are reduced
    already, the same on every rank)."""
    largest: dict[str, float] = {}
    for finding in ranks:
        for name, diff in finding.worst_parameters:
            largest[name] = max(diff, largest.get(name, diff))
    return worst_parameters(largest)


def _headline(step: int, findings: Findings, report: RecomputationReport) -> str:
    """What diverged: the gradients (with their figures), or, where they are exact, the buffers or the attributes
    (named), or the host's random streams, or torch's RNG."""
    tolerance = report.tolerance
    host_rng = any(finding.cause == Cause.HOST_RNG for finding in findings.ranks)
    torch_rng = any(finding.cause == Cause.RNG_NOT_PRESERVED for finding in findings.ranks)
    streams = host_rng or torch_rng
    if findings.gradients_diverged or not (findings.buffers_changed or findings.attributes_changed or streams):
        shown = "inf" if math.isinf(findings.grad_divergence) else f"{findings.grad_divergence:.3g}"
        return (
            f"lightning_ckpt_determinism: recomputation diverged at step {step}: grad_divergence={shown} (tolerance"
            f" {tolerance:g}), max_abs_diff={findings.max_abs_diff:.3g}."
        )
    # A difference within the tolerance does not diverge: the gradients are not exact then.
    gradients = "exact" if findings.grad_divergence == 0.0 else f"within the tolerance ({tolerance:g})"
    if not (math.isfinite(report.reference_loss) or math.isfinite(report.checkpointed_loss)):
        # NaN in both passes at the same places compares equal: such gradients hold nothing to compare.
        gradients = f"not comparable (the loss is {report.reference_loss} in both passes)"
    if findings.buffers_changed:
        names = [name for finding in findings.ranks for name in finding.buffer_mutations]
        return _changed_state(step, "buffer", findings.buffers_changed, names, gradients)
    if findings.attributes_changed:
        names = [name for finding in findings.ranks for name in finding.attribute_mutations]
        return _changed_state(step, "Python attribute", findings.attributes_changed, names, gradients)
    if not host_rng:
        return (
            f"lightning_ckpt_determinism: recomputation drew from torch's RNG at step {step}: it ended the step in"
            f" another state than the same step without checkpointing; the gradients are {gradients}."
        )
    return (
        f"lightning_ckpt_determinism: recomputation drew from the host's random streams at step {step}: Python's"
        " `random` or NumPy's global RNG ended the step in another state than the same step without checkpointing;"
        f" the gradients are {gradients}."
    )


def _changed_state(step: int, kind: str, count: int, names: list[str], gradients: str) -> str:
    named = list(dict.fromkeys(names))
    return (
        f"lightning_ckpt_determinism: recomputation changed {kind}s at step {step}: {count}"
        f" {kind.split()[-1]}{'s' if count != 1 else ''} ended the step otherwise than in the same step without"
        f" checkpointing ({', '.join(named[:6])}{' ...' if len(named) > 6 else ''}); the gradients are {gradients}."
    )


def _worst_over_ranks(findings: list[RankFindings]) -> list[RegionReport]:
    """Each diverging region once, with its largest difference over ranks, worst first."""
    worst: dict[str, RegionReport] = {}
    for finding in findings:
        for region in finding.regions:
            if region.name not in worst or region.max_abs_diff > worst[region.name].max_abs_diff:
                worst[region.name] = region
    return sorted(worst.values(), key=lambda region: -region.max_abs_diff)


@dataclass(frozen=True)
class SentinelTotals:
    """What the sentinel compared and found in a fit, over every rank (as its reads summed them): what the fit's
    summary says.

    Attributes:
        compared: Recomputed saved tensors compared.
        mismatches: Mismatches by region, the regions that had any, in region order.
        compiled: The regions inside compiled modules that the sentinel compared nothing of (the compiler recomputes
            them; one that graph-breaks runs eagerly and is compared).
        on_new_paths: Saved tensors left uncompared because their call took a code path its region had not learned
            yet (a branch taken for the first time).
        on_new_paths_last: Of ``on_new_paths``, those of the last step the sentinel watched, whose paths no later
            step of the fit compared.

    Example::

        >>> SentinelTotals(40, {"blocks.1": 6}).mismatches
        {'blocks.1': 6}
    """

    compared: int
    mismatches: dict[str, int] = field(default_factory=dict)
    compiled: list[str] = field(default_factory=list)
    on_new_paths: int = 0
    on_new_paths_last: int = 0


@dataclass
class FitSummary:
    """What the monitor found over one fit, for the paragraph it prints at the fit's end."""

    checks: int = 0
    follow_ups: int = 0
    diverged: int = 0
    skipped: int = 0
    worst: float = 0.0
    worst_step: int | None = None
    causes: dict[Cause, dict[str, str]] = field(default_factory=dict)
    # Why no gradient check ran this fit (the strategy's), or ``None``.
    unchecked: str | None = None

    def add(self, step: int, findings: Findings, *, follow_up: bool = False) -> None:
        """Count one check (``follow_up``: one a sentinel finding asked for, not a periodic one)."""
        self.checks += 1
        self.follow_ups += follow_up
        self.diverged += findings.diverged
        if self.worst_step is None or findings.grad_divergence > self.worst:
            self.worst, self.worst_step = findings.grad_divergence, step
        for finding in findings.ranks:
            for region in finding.regions:
                outcome = region_outcome(region)
                if outcome.cause is not None:
                    self.causes.setdefault(outcome.cause, {}).setdefault(region.name, outcome.hint or "")

    def text(self, every_n_steps: int, sentinel: SentinelTotals | None) -> str:
        """One paragraph: the checks, how many diverged, the worst figure and its step, each cause with its regions
        and hint, and what the sentinel compared."""
        skipped = f", {self.skipped} skipped" if self.skipped else ""
        periodic = self.checks - self.follow_ups
        follow_ups = (
            f" and {self.follow_ups} follow-up check{'s' if self.follow_ups != 1 else ''} that sentinel findings"
            " asked for"
            if self.follow_ups
            else ""
        )
        parts = [
            f"lightning_ckpt_determinism: RecomputationMonitor ran {periodic} periodic check"
            f"{'s' if periodic != 1 else ''} this fit (the first step, then every"
            f" {'step' if every_n_steps == 1 else f'{every_n_steps} steps'}{skipped})"
            f"{follow_ups}"
        ]
        if self.unchecked is not None:
            parts[0] = (
                f"lightning_ckpt_determinism: RecomputationMonitor ran no gradient check this fit: {self.unchecked}."
            )
        elif not self.checks:
            parts[0] = (
                "lightning_ckpt_determinism: RecomputationMonitor ran no gradient check this fit"
                f"{f' ({self.skipped} skipped)' if self.skipped else ''}: no training step was checked, so nothing is"
                " proven about its recomputation."
            )
        elif not self.diverged:
            parts[0] += ": none diverged."
        elif self.worst > 0:
            shown = "inf" if math.isinf(self.worst) else f"{self.worst:.3g}"
            parts[0] += f": {self.diverged} diverged, the worst grad_divergence {shown} at step {self.worst_step}."
        else:
            parts[0] += f": {self.diverged} found a defect, with gradients that compared equal."
        for cause, regions in sorted(self.causes.items(), key=lambda entry: _is_catch_all(entry[0])):
            parts.append(f"Cause {cause} in {', '.join(regions)}: {_joined_hint(list(regions.values()))}")
        if sentinel is not None:
            found = ", ".join(f"{name}: {count}" for name, count in sentinel.mismatches.items())
            differed = sum(sentinel.mismatches.values())
            if sentinel.compared or differed:
                parts.append(
                    f"The sentinel compared {sentinel.compared} recomputed saved tensors with the forward's:"
                    + (f" {differed} differed ({found})." if differed else " none differed.")
                )
            else:
                parts.append("The sentinel compared no recomputed saved tensor.")
            if sentinel.on_new_paths:
                parts.append(
                    f"It left out {sentinel.on_new_paths} saved tensors of calls down code paths their regions had"
                    " not taken before: a path is compared from its second call on, and a check reruns a step's"
                    " first micro-batch only."
                    + (
                        f" {sentinel.on_new_paths_last} of them were of the last step it watched, whose new paths no"
                        " later step compared: a defect arriving with them would show only at a later step, which this"
                        " fit did not run."
                        if sentinel.on_new_paths_last
                        else ""
                    )
                )
            if sentinel.compiled:
                unseen = len(sentinel.compiled)
                parts.append(
                    f"It does not see {unseen} compiled region{'s' if unseen != 1 else ''}"
                    f" ({', '.join(sentinel.compiled[:3])}{' ...' if unseen > 3 else ''}), which the compiler"
                    " recomputes."
                )
        return " ".join(parts)


# The end of a hint that names the state of its region: "... Changed: blocks.1.norm.running_mean, ...".
_NAMED_STATE = re.compile(
    r"^(?P<text>.*) (?P<label>Changed|Written|Updated|Substituted): (?P<names>[^:]+)\.$", re.DOTALL
)


def _joined_hint(hints: list[str]) -> str:
    """One hint for several regions of one cause: where each names its own region's state after the same text, that
    text with every region's names; else the first region's hint.

    Example::

        >>> _joined_hint(["Set it. Changed: a.x, a.y.", "Set it. Changed: b.x."])
        'Set it. Changed: a.x, a.y, b.x.'
        >>> _joined_hint(["One.", "Another."])
        'One.'
    """
    found = [_NAMED_STATE.match(hint) for hint in hints]
    parts = [(match["text"], match["label"]) for match in found if match is not None]
    if len(parts) < len(hints) or len(set(parts)) > 1:
        return hints[0]
    names = dict.fromkeys(name for match in found if match is not None for name in match["names"].split(", "))
    text, label = parts[0]
    return f"{text} {label}: {', '.join(names)}."
