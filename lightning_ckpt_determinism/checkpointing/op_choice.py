"""The exact choice at op granularity: each candidate plain, or checkpointed keeping a chosen set of its op outputs.

A candidate checkpointed while keeping the outputs of op calls ``S`` keeps its checkpointed bytes (inputs, and what
``save_ops`` and ``keep_data_dependent`` keep) plus the bytes of ``S``, and recomputes every op call not in ``S``;
plain, it keeps its plain bytes and recomputes nothing. Choosing one option per candidate with the least recompute
cost and the kept bytes within the budget is a grouped knapsack. It is solved on Pareto frontiers (Nemhauser and
Ullmann): each candidate's options reduce to those no other option beats in both bytes and cost, and candidates are
added one at a time, keeping only the combinations that no other beats and that can still fit once every remaining
candidate keeps its least. That search is exact: the plan is the least cost within the budget, so a larger budget
never costs more. Identical candidates (equal figures) share one frontier.

A frontier that grows past :data:`MAX_POINTS` is thinned: of the points within one band of bytes only the cheapest
stays. Each thinning may lose at most its band's width of bytes, so the plan then costs at most what the exact
optimum costs with the budget lowered by the sum of the bands, which the choice reports as its ``slack_bytes``
(0 when no thinning happened).
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from lightning_ckpt_determinism.checkpointing.measure import RegionFigures

__all__ = ["choose_kept_ops"]

MAX_POINTS = 20_000
"""The most points a frontier keeps before it is thinned (see the module's text)."""

# A point: (bytes, cost, back), where back is (the point it extends, the candidate's option) or None.
_Point = tuple[int, int, tuple["_Point", int] | None]
_T = TypeVar("_T", bound=tuple[int, int, Any])


@dataclass(frozen=True)
class OpChoice:
    """The choice for each candidate that ran: checkpointed keeping some op calls' outputs, or plain.

    Attributes:
        kept: The checkpointed candidates, each with the indices of the op calls whose outputs it keeps.
        kept_bytes: What the candidates keep in all.
        cost: What the plan recomputes, in the roofline model's byte-equivalents.
        slack_bytes: 0 when the choice is proved optimal; else it costs at most the optimum at the budget lowered by
            this many bytes.

    Example::

        >>> from lightning_ckpt_determinism.checkpointing.measure import OpFigures
        >>> figures = [RegionFigures("a", 100, 10, 0, 1, 50, (OpFigures(0, "aten.mm.default", 40, 30),))]
        >>> choose_kept_ops(figures, 60)
        OpChoice(kept={'a': (0,)}, kept_bytes=50, cost=20, slack_bytes=0)
    """

    kept: dict[str, tuple[int, ...]]
    kept_bytes: int
    cost: int
    slack_bytes: int


def choose_kept_ops(figures: Sequence[RegionFigures], budget_bytes: int) -> OpChoice | None:
    """The least-cost choice within ``budget_bytes`` (then the fewest modules checkpointed, as at module granularity:
    a region free to recompute under the FLOP count stays plain where it fits; then the fewest bytes); ``None`` when
    even checkpointing every candidate keeping nothing keeps more. Candidates that did not run are checkpointed
    keeping nothing and add nothing.

    Args:
        figures: Each candidate's figures with its op calls, in module order.
        budget_bytes: The most the candidates may keep.

    Example::

        >>> from lightning_ckpt_determinism.checkpointing.measure import OpFigures
        >>> ops = (OpFigures(0, "aten.mm.default", 40, 30), OpFigures(1, "aten.relu.default", 40, 20))
        >>> choose_kept_ops([RegionFigures("a", 100, 10, 0, 1, 50, ops)], 55).kept
        {'a': (0,)}
    """
    ran = [entry for entry in figures if entry.calls]
    # Costs are weighed times `scale`, plus one for each module checkpointed: of equal costs, fewer modules win.
    scale = len(ran) + 1
    # Identical candidates (equal figures under other names) share one frontier.
    frontiers: dict[RegionFigures, list[tuple[int, int, tuple[int, ...] | None]]] = {}
    for entry in ran:
        key = replace(entry, name="")
        if key not in frontiers:
            frontiers[key] = _options(entry, budget_bytes, scale)
    options = {entry.name: frontiers[replace(entry, name="")] for entry in ran}
    least = [min(point[0] for point in options[entry.name]) for entry in ran]
    rest = [sum(least[index:]) for index in range(len(ran) + 1)]
    if rest[0] > budget_bytes:
        return None
    frontier: list[_Point] = [(0, 0, None)]
    slack = 0
    for index, entry in enumerate(ran):
        room = budget_bytes - rest[index + 1]
        combined: list[_Point] = [
            (point[0] + size, point[1] + cost, (point, option))
            for point in frontier
            for option, (size, cost, _) in enumerate(options[entry.name])
            if point[0] + size <= room
        ]
        frontier = _pareto(combined)
        if len(frontier) > MAX_POINTS:
            frontier, band = _thinned(frontier)
            slack += band
    best = min(frontier, key=lambda point: (point[1], point[0]))
    kept: dict[str, tuple[int, ...]] = {entry.name: () for entry in figures if not entry.calls}
    point: _Point = best
    for entry in reversed(ran):
        assert point[2] is not None  # one step back per candidate
        point, option = point[2]
        chosen = options[entry.name][option][2]
        if chosen is not None:
            kept[entry.name] = chosen
    order = [entry.name for entry in figures]
    return OpChoice(
        kept=dict(sorted(kept.items(), key=lambda item: order.index(item[0]))),
        kept_bytes=best[0],
        cost=best[1] // scale,
        slack_bytes=slack,
    )


def _options(entry: RegionFigures, budget_bytes: int, scale: int) -> list[tuple[int, int, tuple[int, ...] | None]]:
    """One candidate's options that no other beats: (bytes, cost times ``scale``, plus one where checkpointed; kept
    op indices or ``None`` for plain)."""
    subsets: list[tuple[int, int, tuple[int, ...]]] = [(entry.checkpointed_bytes, entry.cost * scale + 1, ())]
    for op in entry.ops:
        if op.bytes <= 0 or op.cost <= 0:
            continue
        grown = [(size + op.bytes, cost - op.cost * scale, (*kept, op.index)) for size, cost, kept in subsets]
        subsets = _pareto([*subsets, *(point for point in grown if point[0] <= budget_bytes)])
    return _pareto([(entry.plain_bytes, 0, None), *subsets])


def _pareto(points: list[_T]) -> list[_T]:
    """The points no other beats: bytes ascending, cost strictly descending (sorted stably, so the first of equal
    points stays)."""
    kept: list[_T] = []
    for point in sorted(points, key=lambda item: (item[0], item[1])):
        if not kept or point[1] < kept[-1][1]:
            kept.append(point)
    return kept


def _thinned(frontier: list[_Point]) -> tuple[list[_Point], int]:
    """The cheapest point of each band of bytes, and the band's width, so that at most :data:`MAX_POINTS` stay."""
    low, high = frontier[0][0], frontier[-1][0]
    band = max(1, -(-(high - low + 1) // MAX_POINTS))
    kept: dict[int, _Point] = {}
    for point in frontier:
        kept[(point[0] - low) // band] = point  # cost descends with bytes: the last in a band is its cheapest
    return list(kept.values()), band
