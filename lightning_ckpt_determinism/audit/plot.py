"""The picture of a budget's trade-off, as an SVG written by hand: no plotting package needed.

Kept bytes run along x and the share of the recompute cost recomputed along y; each granularity is one polyline
through its plans at the sweep's budgets, drawn as steps (a plan's cost holds until the next plan's bytes, see
:func:`stairs`), its plan at the config's budget a dot, and the budget a dashed vertical line. Each element carries a
class (``curve``, ``plan``, ``budget``, ``x-tick``, ``y-tick``) and curves and dots a ``data-granularity``, so that a
test or a script can read the picture back.
"""

import math
from collections.abc import Sequence
from xml.sax.saxutils import escape

from lightning_ckpt_determinism.audit.trade_off import GRANULARITIES, TradeOff, TradeOffPoint
from lightning_ckpt_determinism.checkpointing.budget_plan import format_bytes

__all__ = ["stairs", "trade_off_svg"]

WIDTH, HEIGHT = 640, 420
LEFT, RIGHT, TOP, BOTTOM = 72, 24, 48, 64
MIDDLE, END = 'text-anchor="middle"', 'text-anchor="end"'
COLORS = {"module": "#1f77b4", "op": "#d62728"}
_UNITS = (("B", 1), ("KiB", 1024), ("MiB", 1024**2), ("GiB", 1024**3))


def trade_off_svg(found: TradeOff) -> str:
    """The trade-off as an SVG document.

    Args:
        found: The trade-off, as the audit plans it.

    Returns:
        The SVG text.

    Example::

        >>> from lightning_ckpt_determinism.audit.trade_off import trade_off
        >>> from lightning_ckpt_determinism.checkpointing.budget_plan import plan_from_figures
        >>> from lightning_ckpt_determinism.checkpointing.measure import OpFigures, RegionFigures
        >>> from lightning_ckpt_determinism.config import CheckpointingConfig
        >>> figures = [RegionFigures("a", 2048, 512, 0, 1, 50, (OpFigures(0, "aten.mm.default", 1024, 30),))]
        >>> plan = plan_from_figures(figures, CheckpointingConfig(names=["a"], memory_budget=1600))
        >>> svg = trade_off_svg(trade_off(plan))
        >>> svg.startswith("<svg"), svg.count("<polyline"), "kept bytes (KiB)" in svg
        (True, 2, True)
    """
    points = [point for curve in found.curves.values() for point in curve]
    largest = max([found.budget_bytes, *(point.kept_bytes for point in points), 1])
    unit, scale = next((name, size) for name, size in reversed(_UNITS) if largest >= size or size == 1)
    x_ticks = _ticks(largest / scale)
    x_top = x_ticks[-1]

    def x(num_bytes: float) -> float:
        return LEFT + (num_bytes / scale) / x_top * (WIDTH - LEFT - RIGHT)

    def y(share: float) -> float:
        return HEIGHT - BOTTOM - share * (HEIGHT - TOP - BOTTOM)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}"'
        ' font-family="sans-serif" font-size="12">',
        "<title>memory budget trade-off: kept bytes against recompute cost</title>",
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        _text(
            WIDTH / 2,
            24,
            f"memory budget trade-off (the config plans at {found.granularity} granularity)",
            'text-anchor="middle" font-size="14"',
        ),
    ]
    for value in x_ticks:
        at = x(value * scale)
        parts.append(
            f'<g class="x-tick"><line x1="{at:.2f}" y1="{TOP}" x2="{at:.2f}" y2="{HEIGHT - BOTTOM + 5}"'
            f' stroke="#dddddd"/>{_text(at, HEIGHT - BOTTOM + 20, _number(value), MIDDLE)}</g>'
        )
    for value in _ticks(1.0):
        at = y(value)
        parts.append(
            f'<g class="y-tick"><line x1="{LEFT - 5}" y1="{at:.2f}" x2="{WIDTH - RIGHT}" y2="{at:.2f}"'
            f' stroke="#dddddd"/>{_text(LEFT - 8, at + 4, format(value, ".0%"), END)}</g>'
        )
    parts += [
        f'<path d="M{LEFT},{TOP} V{HEIGHT - BOTTOM} H{WIDTH - RIGHT}" fill="none" stroke="black"/>',
        _text((LEFT + WIDTH - RIGHT) / 2, HEIGHT - 20, f"kept bytes ({unit})", MIDDLE),
        _text(
            18,
            (TOP + HEIGHT - BOTTOM) / 2,
            f"recompute cost recomputed ({found.cost_model})",
            f'text-anchor="middle" transform="rotate(-90 18 {(TOP + HEIGHT - BOTTOM) / 2})"',
        ),
    ]
    budget = x(found.budget_bytes)
    parts += [
        f'<line class="budget" x1="{budget:.2f}" y1="{TOP}" x2="{budget:.2f}" y2="{HEIGHT - BOTTOM}" stroke="#555555"'
        ' stroke-dasharray="5,4"/>',
        _text(budget + 4, TOP + 12, f"budget {format_bytes(found.budget_bytes)}", 'fill="#555555"'),
    ]
    for granularity in GRANULARITIES:
        color = COLORS[granularity]
        line = " ".join(f"{x(kept):.2f},{y(share):.2f}" for kept, share in stairs(found.curves[granularity]))
        plan = found.plans[granularity]
        parts += [
            f'<polyline class="curve" data-granularity="{granularity}" points="{line}" fill="none" stroke="{color}"'
            ' stroke-width="2"/>',
            f'<circle class="plan" data-granularity="{granularity}" cx="{x(plan.kept_bytes):.2f}"'
            f' cy="{y(plan.recompute_share):.2f}" r="5" fill="{color}" stroke="black"/>',
        ]
    parts += [*_legend(found.granularity), "</svg>"]
    return "\n".join(parts) + "\n"


def stairs(curve: Sequence[TradeOffPoint]) -> list[tuple[int, float]]:
    """The vertices that draw ``curve`` as steps: each plan's recompute share holds from its kept bytes until the
    next plan's, as no plan in between was found; equal neighbours are drawn once.

    Args:
        curve: Plans in the order of their budgets.

    Returns:
        ``(kept bytes, recompute share)`` vertices.

    Example::

        >>> curve = [TradeOffPoint(10, 10, 1.0, 1, 0), TradeOffPoint(60, 50, 0.4, 1, 1)]
        >>> stairs([*curve, TradeOffPoint(99, 50, 0.4, 1, 1)])
        [(10, 1.0), (50, 1.0), (50, 0.4)]
    """
    vertices: list[tuple[int, float]] = []
    for point in curve:
        corners = [(point.kept_bytes, point.recompute_share)]
        if vertices:
            corners.insert(0, (point.kept_bytes, vertices[-1][1]))
        vertices += [corner for corner in corners if not vertices or corner != vertices[-1]]
    return vertices


def _legend(granularity: str) -> list[str]:
    left, top = LEFT + 10, HEIGHT - BOTTOM - 86
    parts = [f'<rect x="{left}" y="{top}" width="222" height="76" fill="white" stroke="#999999"/>']
    for row, name in enumerate(GRANULARITIES):
        at = top + 16 + 18 * row
        label = f"{name} granularity" + (" (the config's)" if name == granularity else "")
        parts += [
            f'<line x1="{left + 8}" y1="{at}" x2="{left + 36}" y2="{at}" stroke="{COLORS[name]}" stroke-width="2"/>',
            _text(left + 44, at + 4, label),
        ]
    at = top + 52
    parts += [
        f'<circle cx="{left + 22}" cy="{at}" r="5" fill="white" stroke="black"/>',
        _text(left + 44, at + 4, "the plan at the budget"),
        f'<line x1="{left + 8}" y1="{at + 16}" x2="{left + 36}" y2="{at + 16}" stroke="#555555"'
        ' stroke-dasharray="5,4"/>',
        _text(left + 44, at + 20, "the budget"),
    ]
    return parts


def _text(x: float, y: float, text: str, attributes: str = "") -> str:
    return f'<text x="{x:.2f}" y="{y:.2f}" {attributes}>{escape(text)}</text>'.replace(" >", ">")


def _ticks(top: float) -> list[float]:
    """Ticks from 0 at a round step (1, 2, 2.5 or 5 times a power of ten), the last at or above ``top``."""
    rough = top / 5
    power = 10 ** math.floor(math.log10(rough))
    step = next(power * factor for factor in (1, 2, 2.5, 5, 10) if power * factor >= rough)
    count = math.ceil(round(top / step, 9))
    return [round(index * step, 9) for index in range(count + 1)]


def _number(value: float) -> str:
    return f"{value:g}"
