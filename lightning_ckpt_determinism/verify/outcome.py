"""What a report comes to, decided in one place: each region's verdict, cause and finding, and whether a check
diverged. The monitor's findings and messages and the audit's table all read it."""

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from lightning_ckpt_determinism.verify.cause import Cause
from lightning_ckpt_determinism.verify.reports import RecomputationReport, RegionReport

__all__ = ["Verdict", "divergent_call", "diverging", "region_outcome", "report_diverged", "worse"]

Verdict = Literal["diverged", "noise", "unchecked", "ok"]
"""A region's verdict: ``"diverged"`` (its difference counts), ``"noise"`` (it differed, within the noise floor),
``"unchecked"`` (no op of it was compared: it did not run, or the pass failed before its recomputation), ``"ok"``."""

# From the mildest to the worst: a region checked several times has its worst verdict.
_SEVERITY: tuple[Verdict, ...] = ("unchecked", "ok", "noise", "diverged")


@dataclass(frozen=True)
class RegionOutcome:
    """What one :class:`~lightning_ckpt_determinism.verify.reports.RegionReport` comes to.

    Attributes:
        verdict: See :data:`Verdict`.
        cause: The region's cause; ``None`` when it reproduced its forward.
        hint: What to change; ``None`` when ``cause`` is.
        finding: The sentence that names the region, where and how it differed, its cause and hint; ``None``
            unless it differed.

    Example::

        >>> region_outcome(RegionReport(name="blocks.1", ops_compared=7))
        RegionOutcome(verdict='ok', cause=None, hint=None, finding=None)
    """

    verdict: Verdict
    cause: Cause | None
    hint: str | None
    finding: str | None


def region_outcome(region: RegionReport) -> RegionOutcome:
    """The verdict, cause, hint and finding of one region of one check.

    Args:
        region: The region's report.

    Example::

        >>> region = RegionReport("blocks.1", ops_compared=7, max_abs_diff=0.5, diverged=True, cause="python_state",
        ...                       first_divergent_op=("aten.add.Tensor", 2), hint="Fix it.")
        >>> outcome = region_outcome(region)
        >>> outcome.verdict, outcome.cause is Cause.PYTHON_STATE
        ('diverged', True)
        >>> outcome.finding.split(", ")[0]
        'Region `blocks.1` diverged at `aten.add.Tensor` (op 2 of the region)'
        >>> outcome.finding.split(", ")[1:]
        ['max abs diff 0.5', 'cause python_state: Fix it.']
    """
    if region.diverged:
        verdict: Verdict = "diverged"
    elif region.cause is not None:
        verdict = "noise"
    else:
        verdict = "ok" if region.ops_compared else "unchecked"
    # Reports built by hand may hold the cause's string.
    cause = None if region.cause is None else Cause(region.cause)
    finding = _finding(region, cause) if verdict in ("diverged", "noise") else None
    return RegionOutcome(verdict, cause, region.hint, finding)


def worse(first: Verdict, second: Verdict) -> Verdict:
    """The worse of two verdicts of one region.

    Args:
        first: One verdict.
        second: The other.

    Example::

        >>> worse("ok", "noise"), worse("diverged", "ok"), worse("unchecked", "ok")
        ('noise', 'diverged', 'ok')
    """
    return max(first, second, key=_SEVERITY.index)


def diverging(regions: Iterable[RegionReport]) -> list[RegionReport]:
    """The regions whose verdict is ``"diverged"``, the largest difference first.

    Args:
        regions: A check's regions.

    Example::

        >>> [region.name for region in diverging([RegionReport("a"), RegionReport("b", diverged=True)])]
        ['b']
    """
    found = (region for region in regions if region_outcome(region).verdict == "diverged")
    return sorted(found, key=lambda region: -region.max_abs_diff)


def report_diverged(report: RecomputationReport) -> bool:
    """Whether a check diverged: its gradients (or its pass), or any of its regions.

    Args:
        report: The check's report.

    Example::

        >>> report = RecomputationReport(0.0, 0.0, diverged=False, tolerance=0.0, regions=[RegionReport("a")])
        >>> report_diverged(report)
        False
    """
    return report.diverged or bool(diverging(report.regions))


def _finding(region: RegionReport, cause: Cause | None) -> str:
    if cause is not None and cause.state_change is not None:
        return f"Region `{region.name}` {cause.state_change}: {region.hint}"
    if cause == Cause.HOST_RNG and region.first_divergent_op is None and region.max_abs_diff == 0.0:
        return f"Region `{region.name}` drew from the host's random streams again, cause {cause}: {region.hint}"
    where = ""
    call = divergent_call(region.first_divergent_call, region.calls)
    if region.first_divergent_op is not None:
        op, index = region.first_divergent_op
        of = f"the region's {call}" if call else "the region"
        where = f" at `{op}` (op {index} of {of})"
    elif call:
        where = f" at its {call}"
    # A region the graph scan named differs only compiled: its eager values, which `max_abs_diff` measures, agree.
    diff = "" if cause == Cause.COMPILER_RECOMPUTE else f", max abs diff {region.max_abs_diff:.3g}"
    return f"Region `{region.name}` diverged{where}{diff}, cause {cause}: {region.hint}"


def divergent_call(first: int | None, calls: int) -> str | None:
    """Which call of a region called several times in the pass differed first (an RNN's timestep), in words;
    ``None`` for a region called once, or where no call differed.

    Args:
        first: The call's place, from 0 (:attr:`RegionReport.first_divergent_call`).
        calls: The region's calls in the pass (:attr:`RegionReport.calls`).

    Example::

        >>> divergent_call(5, 8), divergent_call(0, 1)
        ('call 5 of 8', None)
    """
    return f"call {first} of {calls}" if first is not None and calls > 1 else None
