"""The audit's view of a ``memory_budget``: the trade-off between the bytes the candidates keep and what they
recompute, for each number of checkpointed candidates, then the plan for the budget."""

from lightning_ckpt_determinism._text import aligned
from lightning_ckpt_determinism.checkpointing.budget_plan import CheckpointingPlan, format_bytes
from lightning_ckpt_determinism.checkpointing.measure import RegionFigures

__all__ = ["trade_off", "trade_off_table"]


def trade_off(candidates: tuple[RegionFigures, ...]) -> list[tuple[int, int, float]]:
    """For each number ``k`` of checkpointed candidates, the least bytes they keep and the share of their forward
    FLOPs recomputed then: the ``k`` candidates whose checkpointing saves the most bytes are checkpointed (those that
    did not run in the measured step always are).

    Args:
        candidates: The plan's figures.

    Returns:
        ``(k, kept_bytes, recomputed_flops_share)`` for each ``k`` from the fewest to every candidate.

    Example::

        >>> figures = (RegionFigures("0", 100, 10, 5, 1), RegionFigures("1", 60, 10, 15, 1))
        >>> trade_off(figures)
        [(0, 160, 0.0), (1, 70, 0.25), (2, 20, 1.0)]
    """
    ran = [figures for figures in candidates if figures.calls]
    idle = [figures for figures in candidates if not figures.calls]
    by_saving = sorted(ran, key=lambda figures: figures.saving, reverse=True)
    total_flops = sum(figures.flops for figures in candidates)
    rows = []
    for count in range(len(ran) + 1):
        chosen = [*idle, *by_saving[:count]]
        plain = by_saving[count:]
        kept = sum(figures.checkpointed_bytes for figures in chosen) + sum(figures.plain_bytes for figures in plain)
        recomputed = sum(figures.flops for figures in chosen)
        rows.append((len(chosen), kept, recomputed / total_flops if total_flops else 0.0))
    return rows


def trade_off_table(plan: CheckpointingPlan) -> str:
    """The trade-off of :func:`trade_off` as a table, the plan's row marked, followed by the plan itself.

    Args:
        plan: The plan for the config's budget.
    """
    rows = [("checkpointed", "kept", "recomputed", "")]
    for count, kept, share in trade_off(plan.candidates):
        mark = "<- as many as the plan" if count == len(plan.checkpointed) else ""
        within = "" if kept <= plan.budget_bytes else " (over budget)"
        rows.append((f"{count} of {len(plan.candidates)}", format_bytes(kept) + within, f"{share:.0%}", mark))
    return "\n".join(
        [
            "memory budget trade-off (bytes the candidates keep, share of their forward FLOPs recomputed):",
            *aligned(rows),
            "",
            str(plan),
        ]
    )
