"""The audit's view of a ``memory_budget``: the trade-off between the bytes the candidates keep and what they
recompute, at module and at op granularity, from one measured step.

Each granularity's curve is its plan at :data:`SWEEP` budgets, from the least any plan can keep to everything kept
plainly, and at the bytes each of those module plans keeps (where the module curve steps): at op granularity that is
the exact optimum at each budget, and at module granularity the module plan (the least cost over whole modules).
Both are costed alike, in the cost model the config's ``budget_cost`` names (a roofline cost per op call by default,
:mod:`~lightning_ckpt_determinism.checkpointing.cost`): the share of the candidates' recompute cost that the plan
recomputes. Op granularity can choose whatever module granularity chooses, so its curve never lies above the other.
"""

import warnings
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from lightning_ckpt_determinism._text import aligned
from lightning_ckpt_determinism.checkpointing.budget_plan import CheckpointingPlan, format_bytes, plan_from_figures
from lightning_ckpt_determinism.checkpointing.measure import RegionFigures
from lightning_ckpt_determinism.config import CheckpointingConfig
from lightning_ckpt_determinism.errors import LightningCkptDeterminismWarning

__all__ = ["GRANULARITIES", "SWEEP", "TradeOff", "TradeOffPoint", "trade_off", "trade_off_table"]

SWEEP = 20
"""How many budgets each curve is planned at."""

GRANULARITIES: tuple[Literal["module", "op"], ...] = ("module", "op")
"""The granularities the trade-off compares, in the order it shows them."""


@dataclass(frozen=True)
class TradeOffPoint:
    """One plan on a trade-off curve.

    Attributes:
        budget_bytes: The budget it was planned for.
        kept_bytes: What the candidates keep under it.
        recompute_share: The share of the candidates' recompute cost it recomputes, in the config's cost model.
        checkpointed: How many candidates it checkpoints.
        kept_ops: How many op outputs the checkpointed candidates keep (0 at module granularity).

    Example::

        >>> TradeOffPoint(budget_bytes=100, kept_bytes=90, recompute_share=0.5, checkpointed=1, kept_ops=0).kept_bytes
        90
    """

    budget_bytes: int
    kept_bytes: int
    recompute_share: float
    checkpointed: int
    kept_ops: int


@dataclass(frozen=True)
class TradeOff:
    """The trade-off at both granularities, and the plans for the config's budget.

    Attributes:
        granularity: The granularity the config plans at.
        cost_model: The cost model both granularities are costed in: the config's ``budget_cost``.
        budget_bytes: The config's budget, in bytes.
        curves: Each granularity's plans at the same budgets, ascending: the :data:`SWEEP` budgets and the bytes the
            module plans at those keep.
        plans: Each granularity's plan for the config's budget.

    Example::

        >>> from lightning_ckpt_determinism.checkpointing.measure import OpFigures
        >>> figures = [RegionFigures("a", 100, 10, 0, 1, 50, (OpFigures(0, "aten.mm.default", 40, 30),))]
        >>> found = trade_off(plan_from_figures(figures, CheckpointingConfig(names=["a"], memory_budget=55)))
        >>> found.granularity, found.budget_bytes, [point.budget_bytes for point in found.curves["op"]][:3]
        ('module', 55, [10, 14, 19])
    """

    granularity: str
    cost_model: str
    budget_bytes: int
    curves: dict[str, tuple[TradeOffPoint, ...]]
    plans: dict[str, TradeOffPoint]

    def figures(self) -> dict[str, Any]:
        """The trade-off as JSON takes it: these fields, each point a dict of its own fields."""
        return asdict(self)


def trade_off(plan: CheckpointingPlan) -> TradeOff:
    """The trade-off around ``plan``: both granularities planned from its figures at :data:`SWEEP` budgets, at the
    bytes the module plans at those keep, and at ``plan``'s budget.

    Args:
        plan: The config's plan, from figures measured with their op calls.

    Returns:
        The curves, and the plans for the budget: ``plan`` itself at its granularity.

    Example::

        >>> from lightning_ckpt_determinism.checkpointing.measure import OpFigures
        >>> ops = (OpFigures(0, "aten.mm.default", 40, 30), OpFigures(1, "aten.relu.default", 40, 20))
        >>> figures = [RegionFigures("a", 100, 10, 0, 1, 50, ops)]
        >>> found = trade_off(plan_from_figures(figures, CheckpointingConfig(names=["a"], memory_budget=55)))
        >>> found.plans["module"].recompute_share, found.plans["op"].recompute_share
        (1.0, 0.4)
        >>> [(point.kept_bytes, point.recompute_share) for point in found.curves["op"]][::6]
        [(10, 1.0), (10, 1.0), (50, 0.4), (90, 0.0)]
    """
    figures = list(plan.candidates)
    ran = [entry for entry in figures if entry.calls]
    least = sum(min(entry.plain_bytes, entry.checkpointed_bytes) for entry in ran)
    plain = sum(entry.plain_bytes for entry in figures)
    # At least a byte, the least budget a config takes (a model whose candidates save nothing plans at 0).
    sweep = {max(least + (plain - least) * step // (SWEEP - 1), 1) for step in range(SWEEP)}
    module = replace(plan.config, budget_granularity="module")
    # Also where the module curve steps: the op curve is then known at every module plan's bytes.
    steps = {max(_quietly(figures, replace(module, memory_budget=budget)).kept_bytes, 1) for budget in sweep}
    budgets = sorted(sweep | steps)
    curves: dict[str, tuple[TradeOffPoint, ...]] = {}
    plans: dict[str, TradeOffPoint] = {}
    for granularity in GRANULARITIES:
        config = replace(plan.config, budget_granularity=granularity)
        curves[granularity] = tuple(
            _point(_quietly(figures, replace(config, memory_budget=budget))) for budget in budgets
        )
        own = granularity == plan.config.budget_granularity
        plans[granularity] = _point(
            plan if own else _quietly(figures, replace(config, memory_budget=max(plan.budget_bytes, 1)))
        )
    config = plan.config
    return TradeOff(config.budget_granularity, config.budget_cost, plan.budget_bytes, curves, plans)


def _quietly(figures: list[RegionFigures], config: CheckpointingConfig) -> CheckpointingPlan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LightningCkptDeterminismWarning)
        return plan_from_figures(figures, config)


def _point(plan: CheckpointingPlan) -> TradeOffPoint:
    """The plan on the curve, with its recompute share in the config's cost model at either granularity."""
    return TradeOffPoint(
        budget_bytes=plan.budget_bytes,
        kept_bytes=plan.kept_bytes,
        recompute_share=plan.recompute_share,
        checkpointed=len(plan.checkpointed),
        kept_ops=sum(map(len, plan.saved_ops.values())),
    )


def trade_off_table(found: TradeOff, plan: CheckpointingPlan) -> str:
    """The trade-off as a table, one row per budget with the config's budget among them and marked, followed by the
    config's plan.

    Args:
        found: The trade-off.
        plan: The config's plan.
    """
    header = ("budget", "module: checkpointed", "kept", "recomputed", "op: checkpointed", "ops kept", "kept")
    rows = [(*header, "recomputed", "")]
    points = [(module, op, "") for module, op in zip(found.curves["module"], found.curves["op"], strict=True)]
    config = (found.plans["module"], found.plans["op"], f"<- the config's budget, planned at {found.granularity} level")
    points.append(config)
    points.sort(key=lambda row: (row[0].budget_bytes, row[2] == ""))
    count = len(plan.candidates)
    for module, op, mark in points:
        rows.append(
            (
                format_bytes(module.budget_bytes),
                f"{module.checkpointed} of {count}",
                format_bytes(module.kept_bytes),
                f"{module.recompute_share:.1%}",
                f"{op.checkpointed} of {count}",
                str(op.kept_ops),
                format_bytes(op.kept_bytes),
                f"{op.recompute_share:.1%}",
                mark,
            )
        )
    return "\n".join(
        [
            f"memory budget trade-off at module and op granularity (the config plans at {found.granularity} level):"
            " each granularity's plan at each budget, the bytes the candidates keep and the share of their recompute"
            f" cost recomputed (cost model: {plan.config.budget_cost})",
            *aligned(rows),
            "",
            str(plan),
        ]
    )
