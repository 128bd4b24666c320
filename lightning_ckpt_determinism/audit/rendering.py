"""What the audit prints and writes: one summary per region over every batch, the table, the footer, the JSON."""

import argparse
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_ckpt_determinism._text import aligned
from lightning_ckpt_determinism.verify.cause import Cause, respelt
from lightning_ckpt_determinism.verify.compiled.graph_scan import GraphScan
from lightning_ckpt_determinism.verify.core import step_cause
from lightning_ckpt_determinism.verify.outcome import Verdict, divergent_call, region_outcome, report_diverged, worse
from lightning_ckpt_determinism.verify.reports import RecomputationReport

__all__ = ["diverged", "document", "footer", "scan_notes", "shortfall_note", "summarize", "table"]


@dataclass
class RegionSummary:
    """One region over every checked batch.

    ``verdict`` is the worst :data:`~lightning_ckpt_determinism.verify.outcome.Verdict` over the batches.
    ``data_dependent_ops`` maps each data-dependent op its forward ran to whether its outputs were kept from the
    forward in every batch.
    """

    name: str
    verdict: Verdict
    cause: Cause | None
    max_abs_diff: float
    first_divergent_op: tuple[str, int] | None
    hint: str | None
    batches_diverged: int = 0
    ops_compared: int = 0
    data_dependent_ops: dict[str, bool] = field(default_factory=dict)
    first_divergent_call: int | None = None
    calls: int = 0


def summarize(reports: list[RecomputationReport]) -> list[RegionSummary]:
    """Each region over every batch: its worst verdict, and the cause of its first batch that diverged (of its first
    with a cause when none did)."""
    summaries: dict[str, RegionSummary] = {}
    for report in reports:
        for region in report.regions:
            outcome = region_outcome(region)
            summary = summaries.setdefault(region.name, RegionSummary(region.name, "unchecked", None, 0.0, None, None))
            summary.max_abs_diff = max(summary.max_abs_diff, region.max_abs_diff)
            summary.batches_diverged += outcome.verdict == "diverged"
            first_of_its_kind = summary.cause is None or (
                outcome.verdict == "diverged" and summary.verdict != "diverged"
            )
            if outcome.cause is not None and first_of_its_kind:
                # The audit reads a YAML and takes flags: its hints name settings as they are written there.
                summary.cause = outcome.cause
                summary.hint = None if outcome.hint is None else respelt(outcome.hint, "audit")
                if outcome.verdict == "noise" and summary.hint is not None:
                    summary.hint = _within_the_floor(summary.hint)
                summary.first_divergent_op = region.first_divergent_op
                summary.first_divergent_call, summary.calls = region.first_divergent_call, region.calls
            summary.verdict = worse(summary.verdict, outcome.verdict)
            summary.ops_compared += region.ops_compared
            for op, kept in region.data_dependent_ops.items():
                summary.data_dependent_ops[op] = summary.data_dependent_ops.get(op, True) and kept
    return list(summaries.values())


# The advice a `nondeterministic_kernel` hint ends with, taken already where the verdict is `noise`.
_CALIBRATE_ADVICE = ", or check with `--calibrate-noise` so that differences within the noise floor are tolerated"


def _within_the_floor(hint: str) -> str:
    """A cause's hint for a region whose difference the measured noise floor tolerates (the verdict `noise`): said
    first, and without the advice to calibrate, which the audit followed."""
    return f"Within the noise floor measured, so tolerated. {hint.replace(_CALIBRATE_ADVICE, '')}"


def diverged(reports: list[RecomputationReport]) -> bool:
    return any(report_diverged(report) for report in reports)


def table(summaries: list[RegionSummary]) -> str:
    header = ("region", "verdict", "cause", "max diff", "first divergent op", "hint")
    rows = [header]
    for summary in summaries:
        op = "-"
        if summary.first_divergent_op is not None:
            call = divergent_call(summary.first_divergent_call, summary.calls)
            where = f"op {summary.first_divergent_op[1]}, {call}" if call else f"op {summary.first_divergent_op[1]}"
            op = f"{summary.first_divergent_op[0]} ({where})"
        rows.append(
            (
                summary.name,
                summary.verdict,
                summary.cause or "-",
                f"{summary.max_abs_diff:.3g}",
                op,
                summary.hint or "-",
            )
        )
    return "\n".join(aligned(rows))


def scan_notes(scan: GraphScan) -> list[str]:
    """Say what the scan of the compiled backward graphs covered."""
    notes = [
        f"note: {scan.scanned_graphs} compiled backward graph{'s' if scan.scanned_graphs != 1 else ''} scanned for"
        " random ops that recomputation draws afresh instead of replaying"
    ]
    notes.extend(
        f"note: {part} is not scanned (inductor and aot_autograd backends are): a compiler_recompute divergence there"
        " names no region"
        for part in scan.unscanned
    )
    return notes


def shortfall_note(checked: int, seen: int, asked: int) -> str:
    """Say that the training data ran out before ``--batches`` were checked."""
    skipped = seen - checked
    no_loss = f", and `training_step` returned no loss for {skipped}" if skipped else ""
    return f"note: checked {_batches(checked)}: the training data has only {seen}{no_loss} (asked for {asked})"


def _batches(count: int) -> str:
    return f"{count} batch{'es' if count != 1 else ''}"


def footer(
    reports: list[RecomputationReport], summaries: list[RegionSummary], notes: list[str], args: argparse.Namespace
) -> str:
    divergence = max(report.grad_divergence for report in reports)
    noise = max(report.noise_floor for report in reports)
    lines = [
        f"gradients: grad_divergence up to {divergence:.3g} over {_batches(len(reports))} (tolerance {args.tolerance:g}"
        + (f", noise floor {noise:.3g})" if args.calibrate_noise else ")"),
        *notes,
    ]
    lines.extend(_data_dependent_line(summary) for summary in summaries if summary.data_dependent_ops)
    buffers = list(dict.fromkeys(name for report in reports for name in report.buffer_mutations))
    if buffers:
        lines.append(f"buffers changed by recomputation: {', '.join(buffers)}")
    errors = list(dict.fromkeys(report.error.splitlines()[0] for report in reports if report.error))
    lines.extend(f"error: {error}" for error in errors)
    if any(report.compiled for report in reports):
        scanned_regions = any(summary.cause == Cause.COMPILER_RECOMPUTE for summary in summaries)
        lines.append(
            "compiled: both passes ran compiled; the regions were compared with eager semantics (the same step run"
            " under torch.compiler.set_stance('force_eager'))"
            + ("; compiler_recompute regions were found in the compiled backward graphs" if scanned_regions else "")
        )
    diverged_regions = [summary.name for summary in summaries if summary.verdict == "diverged"]
    if diverged_regions:
        lines.append(
            f"result: {len(diverged_regions)} of {len(summaries)} checkpointed regions diverged:"
            f" {', '.join(diverged_regions)}"
        )
    elif (blamed := next((report for report in reports if step_cause(report) is not None), None)) is not None:
        lines.append(f"result: diverged: {blamed.cause}: {respelt(blamed.hint or '', 'audit')}")
    elif diverged(reports):
        lines.append(
            "result: diverged: every region recomputed what its forward produced, but the gradients of the two"
            " passes differ (Python state a module changes in forward, such as a list it appends to)"
        )
    else:
        noise = sum(summary.verdict == "noise" for summary in summaries)
        within = f" ({noise} differ within the noise floor)" if noise else ""
        lines.append(f"result: none of the {len(summaries)} checkpointed regions diverged{within}")
    return "\n".join(lines)


def _data_dependent_line(summary: RegionSummary) -> str:
    ops = ", ".join(f"{op} ({'kept' if kept else 'recomputed'})" for op, kept in summary.data_dependent_ops.items())
    return f"data-dependent ops in {summary.name}: {ops}"


def document(
    args: argparse.Namespace,
    device: str,
    reports: list[RecomputationReport],
    summaries: list[RegionSummary],
    notes: list[str],
    budget: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON report: the run's settings, the verdict, the notes, each region's summary, every check, and the
    ``memory_budget``'s trade-off (``None`` without one)."""
    return {
        "config": str(args.config[0]),
        "configs": [str(config) for config in args.config],
        "device": device,
        "batches": len(reports),
        "batches_asked": args.batches,
        "tolerance": args.tolerance,
        "calibrate_noise": args.calibrate_noise,
        "exclude_attributes": args.exclude_attributes,
        "diverged": diverged(reports),
        "notes": notes,
        "regions": [asdict(summary) for summary in summaries],
        "buffer_mutations": list(dict.fromkeys(name for report in reports for name in report.buffer_mutations)),
        "checks": [asdict(report) for report in reports],
        "memory_budget": budget,
    }
