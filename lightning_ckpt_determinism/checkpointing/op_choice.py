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

import torch

from lightning_ckpt_determinism.checkpointing.measure import RegionFigures

__all__ = ["choose_kept_ops"]

MAX_POINTS = 20_000
"""The most points a frontier keeps before it is thinned (see the module's text)."""

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
    unran: dict[str, tuple[int, ...]] = {entry.name: () for entry in figures if not entry.calls}
    plain = sum(entry.plain_bytes for entry in ran)
    if plain <= budget_bytes:  # every candidate plain fits: nothing recomputed, no module checkpointed, no search
        return OpChoice(kept=unran, kept_bytes=plain, cost=0, slack_bytes=0)
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
    frontier = _Frontier()
    slack = 0
    for index, entry in enumerate(ran):
        frontier.extend(options[entry.name], budget_bytes - rest[index + 1])
        if len(frontier) > MAX_POINTS:
            slack += frontier.thin()
    kept = dict(unran)
    for entry, option in zip(ran, frontier.cheapest_path(), strict=True):
        chosen = options[entry.name][option][2]
        if chosen is not None:
            kept[entry.name] = chosen
    kept_bytes, cost = frontier.cheapest()
    order = [entry.name for entry in figures]
    return OpChoice(
        kept=dict(sorted(kept.items(), key=lambda item: order.index(item[0]))),
        kept_bytes=kept_bytes,
        cost=cost // scale,
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


class _Frontier:
    """The combinations of the candidates added so far that no other beats in both bytes and cost, as tensors
    (bytes ascending, cost strictly descending), with the option each step took and the point it extended, to read
    the cheapest combination back. Combining is a sum of every point with every option, filtered and reduced to its
    Pareto points on tensors, a block of points at a time."""

    def __init__(self) -> None:
        self.bytes = torch.zeros(1, dtype=torch.int64)
        self.cost = torch.zeros(1, dtype=torch.int64)
        # Per candidate added: for each point then, the index of the point it extended and of the option it took.
        self._steps: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __len__(self) -> int:
        return len(self.bytes)

    def extend(self, options: Sequence[tuple[int, int, Any]], room: int) -> None:
        """Add a candidate: every point with each of its ``options`` (bytes, cost, ...) that keeps at most ``room``."""
        sizes = torch.tensor([option[0] for option in options], dtype=torch.int64)
        costs = torch.tensor([option[1] for option in options], dtype=torch.int64)
        rows = max(1, _BLOCK // len(options))
        parts = []
        for start in range(0, len(self.bytes), rows):
            points = torch.arange(start, min(start + rows, len(self.bytes)))
            total = (self.bytes[points, None] + sizes[None, :]).flatten()
            parent = points[:, None].expand(-1, len(options)).flatten()
            option = torch.arange(len(options)).expand(len(points), -1).flatten()
            fits = total <= room
            parts.append(
                _pareto_points(total[fits], (self.cost[parent] + costs[option])[fits], parent[fits], option[fits])
            )
        columns = [torch.cat(column) for column in zip(*parts, strict=True)]
        self.bytes, self.cost, parent, option = _pareto_points(*columns)
        self._steps.append((parent, option))

    def thin(self) -> int:
        """Keep the cheapest point of each band of bytes so that at most :data:`MAX_POINTS` stay; the band's width."""
        low, high = int(self.bytes[0]), int(self.bytes[-1])
        band = max(1, -(-(high - low + 1) // MAX_POINTS))
        bands = (self.bytes - low) // band
        # Cost descends with bytes: the last point of a band is its cheapest.
        last = torch.cat([bands[1:] != bands[:-1], torch.tensor([True])]).nonzero().flatten()
        self.bytes, self.cost = self.bytes[last], self.cost[last]
        parent, option = self._steps[-1]
        self._steps[-1] = (parent[last], option[last])
        return band

    def cheapest(self) -> tuple[int, int]:
        """The bytes and cost of the cheapest point (the last: cost descends strictly with bytes)."""
        return int(self.bytes[-1]), int(self.cost[-1])

    def cheapest_path(self) -> list[int]:
        """The option each candidate took in the cheapest point, in the order they were added."""
        point, path = len(self.bytes) - 1, []
        for parent, option in reversed(self._steps):
            path.append(int(option[point]))
            point = int(parent[point])
        return path[::-1]


_BLOCK = 1 << 22
"""How many sums :meth:`_Frontier.extend` forms at a time (a few tens of MiB of int64)."""


def _pareto_points(
    size: torch.Tensor, cost: torch.Tensor, parent: torch.Tensor, option: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The points no other beats, bytes ascending and cost strictly descending; of equal points the first given
    stays (sorted stably by cost, then by bytes)."""
    order = torch.sort(cost, stable=True).indices
    order = order[torch.sort(size[order], stable=True).indices]
    size, cost, parent, option = size[order], cost[order], parent[order], option[order]
    before = torch.cummin(cost, dim=0).values
    keep = torch.cat([torch.tensor([True]), cost[1:] < before[:-1]]) if len(cost) else cost.bool()
    return size[keep], cost[keep], parent[keep], option[keep]
