"""The audit's trade-off of a `memory_budget` at module and op granularity, its JSON figures and its `--plot`."""

import contextlib
import io
import itertools
import json
import re
import xml.etree.ElementTree as ET
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from lightning_ckpt_determinism import CheckpointingConfig
from lightning_ckpt_determinism.audit import main
from lightning_ckpt_determinism.audit.plot import stairs
from lightning_ckpt_determinism.audit.trade_off import SWEEP, TradeOffPoint, trade_off
from lightning_ckpt_determinism.checkpointing.budget_plan import format_bytes, measure_candidates, plan_from_figures
from lightning_ckpt_determinism.checkpointing.measure import RegionFigures
from tests.test_audit import CHECKPOINTING, audit, write_config
from tests.test_budget_training import MixedModule

SVG = "{http://www.w3.org/2000/svg}"
UNITS = {"B": 1, "KiB": 1024, "MiB": 1024**2}
NAMES = ["model.blocks.*"]
# Six blocks of three kinds (tests/test_budget.py), at op granularity within 60 % of what they keep plainly.
MIXED = """\
trainer:
  accelerator: cpu
  strategy:
    class_path: lightning_ckpt_determinism.SingleDeviceCheckpointingStrategy
    init_args:
      checkpointing:
        names: ["model.blocks.*"]
        memory_budget: 0.6
        budget_granularity: op
model:
  class_path: tests.test_budget_training.MixedModule
"""


@pytest.fixture(scope="module")
def audited(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One audit of the mixed model at op granularity, with `--json` and `--plot`: its exit code, output and files."""
    folder = tmp_path_factory.mktemp("trade_off")
    config = folder / "mixed.yaml"
    config.write_text(MIXED)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(
            ["audit", "--config", str(config), "--json", str(folder / "a.json"), "--plot", str(folder / "t.svg")]
        )
    return {
        "code": code,
        "out": out.getvalue(),
        "figures": json.loads((folder / "a.json").read_text())["memory_budget"],
        "svg": ET.parse(folder / "t.svg").getroot(),
    }


@pytest.fixture(scope="module")
def measured() -> list[RegionFigures]:
    """The test's own measurement: a twin of the audited model on the first batch of the same data (bytes and costs
    depend on shapes only)."""
    torch.manual_seed(0)
    twin = MixedModule()
    x, y = next(iter(twin.train_dataloader()))
    config = CheckpointingConfig(names=NAMES)
    return measure_candidates(twin, config, ops=True, closure=lambda: F.mse_loss(twin.model(x), y).backward())


def _curve(figures: dict[str, Any], granularity: str) -> list[TradeOffPoint]:
    return [TradeOffPoint(**point) for point in figures["curves"][granularity]]


def _recomputed(figures: list[RegionFigures], checkpointed: list[str], kept: dict[str, Any]) -> float:
    """The share of the recompute cost (the config's model) a plan recomputes, counted by the test: every op call of a
    checkpointed candidate but those it keeps."""
    total = sum(op.cost for entry in figures for op in entry.ops)
    spent = sum(
        op.cost
        for entry in figures
        if entry.name in checkpointed
        for op in entry.ops
        if (op.index, op.op) not in set(kept.get(entry.name, ()))
    )
    return spent / total


def _at(curve: list[TradeOffPoint], kept_bytes: int) -> float:
    """The stair's height at ``kept_bytes``: the recompute share of the last plan keeping at most that."""
    return [point.recompute_share for point in curve if point.kept_bytes <= kept_bytes][-1]


def test_the_audit_prints_both_trade_offs_from_one_measurement_with_the_plan_marked(
    audited: dict[str, Any], measured: list[RegionFigures]
) -> None:
    assert audited["code"] == 0
    figures = audited["figures"]
    assert figures["granularity"] == "op"
    least = sum(min(entry.plain_bytes, entry.checkpointed_bytes) for entry in measured)
    plain = sum(entry.plain_bytes for entry in measured)
    assert figures["budget_bytes"] == int(0.6 * plain)
    budgets = [point.budget_bytes for point in _curve(figures, "op")]
    assert budgets == [point.budget_bytes for point in _curve(figures, "module")] == sorted(set(budgets))
    assert {least + (plain - least) * step // (SWEEP - 1) for step in range(SWEEP)} <= set(budgets)
    assert (budgets[0], budgets[-1]) == (least, plain)
    # Each point is the plan at its budget, planned by the test from its own measurement and costed by the test.
    for granularity in ("module", "op"):
        for point in [*_curve(figures, granularity), TradeOffPoint(**figures["plans"][granularity])]:
            config = CheckpointingConfig(names=NAMES, memory_budget=point.budget_bytes, budget_granularity=granularity)
            plan = plan_from_figures(measured, config)
            assert point.kept_bytes == plan.kept_bytes <= point.budget_bytes
            assert point.checkpointed == len(plan.checkpointed)
            assert point.recompute_share == pytest.approx(_recomputed(measured, plan.checkpointed, plan.saved_ops))
    # The printed table: a row per budget and the config's budget among them, marked, then the op plan.
    out = audited["out"]
    lines = out.split("\n\n")[0].splitlines()
    assert lines[0].startswith("memory budget trade-off at module and op granularity (the config plans at op level)")
    rows = [re.split(r"\s{2,}", line) for line in lines[2:]]
    assert len(rows) == len(budgets) + 1
    (marked,) = [row for row in rows if len(row) == 9]
    assert marked[-1] == "<- the config's budget, planned at op level"
    module, op = TradeOffPoint(**figures["plans"]["module"]), TradeOffPoint(**figures["plans"]["op"])
    assert marked[:8] == [
        format_bytes(figures["budget_bytes"]),
        f"{module.checkpointed} of 6",
        format_bytes(module.kept_bytes),
        f"{module.recompute_share:.1%}",
        f"{op.checkpointed} of 6",
        str(op.kept_ops),
        format_bytes(op.kept_bytes),
        f"{op.recompute_share:.1%}",
    ]
    config = CheckpointingConfig(names=NAMES, memory_budget=0.6, budget_granularity="op")
    assert str(plan_from_figures(measured, config)) in out


def test_the_op_curve_never_rises_and_never_lies_above_the_module_curve(audited: dict[str, Any]) -> None:
    module, op = _curve(audited["figures"], "module"), _curve(audited["figures"], "op")
    # Monotonic: as the budget grows, op granularity keeps no less and recomputes no more.
    for earlier, later in itertools.pairwise(op):
        assert later.kept_bytes >= earlier.kept_bytes
        assert later.recompute_share <= earlier.recompute_share
    assert op[0].recompute_share == 1.0 and op[-1].recompute_share == 0.0
    # At every budget, and as drawn (steps over kept bytes) at every byte count either curve reaches.
    for module_point, op_point in zip(module, op, strict=True):
        assert op_point.recompute_share <= module_point.recompute_share
    for kept in {point.kept_bytes for point in [*module, *op]}:
        if kept >= module[0].kept_bytes:
            assert _at(op, kept) <= _at(module, kept)
    # It is lower somewhere: the mixed blocks have op outputs worth keeping.
    assert any(o.recompute_share < m.recompute_share for m, o in zip(module, op, strict=True))


def _axis(svg: ET.Element, name: str) -> tuple[float, float]:
    """The scale and offset from a value to a coordinate, read from two of the axis's labelled ticks."""
    ticks = []
    for tick in svg.iter(f"{SVG}g"):
        if tick.get("class") == f"{name}-tick":
            line, text = tick.find(f"{SVG}line"), tick.find(f"{SVG}text")
            assert line is not None and text is not None and text.text is not None
            at = float(line.get("x1" if name == "x" else "y1", "nan"))
            ticks.append((float(text.text.rstrip("%")) / (100 if name == "y" else 1), at))
    (low, low_at), (high, high_at) = ticks[0], ticks[-1]
    scale = (high_at - low_at) / (high - low)
    return scale, low_at - low * scale


def test_plot_writes_an_svg_whose_curves_are_the_trade_off(audited: dict[str, Any]) -> None:
    svg, figures = audited["svg"], audited["figures"]
    assert svg.tag == f"{SVG}svg"
    labels = [text.text or "" for text in svg.iter(f"{SVG}text")]
    (x_label,) = [label for label in labels if label.startswith("kept bytes (")]
    unit = UNITS[x_label.removeprefix("kept bytes (").removesuffix(")")]
    x_scale, x_offset = _axis(svg, "x")
    y_scale, y_offset = _axis(svg, "y")

    def data(x: float, y: float) -> tuple[float, float]:
        return (x - x_offset) / x_scale * unit, (y - y_offset) / y_scale

    curves = {line.get("data-granularity"): line for line in svg.iter(f"{SVG}polyline")}
    assert set(curves) == {"module", "op"}
    width = max(point.kept_bytes for point in _curve(figures, "op"))
    for granularity, line in curves.items():
        drawn = [data(*map(float, pair.split(","))) for pair in (line.get("points") or "").split()]
        expected = stairs(_curve(figures, granularity))
        assert len(drawn) == len(expected)
        for (x, y), (kept, share) in zip(drawn, expected, strict=True):
            assert x == pytest.approx(kept, abs=width * 1e-3)
            assert y == pytest.approx(share, abs=1e-3)
    # Each granularity's plan marked where it lies; the budget a vertical line.
    for circle in svg.iter(f"{SVG}circle"):
        if circle.get("class") == "plan":
            plan = TradeOffPoint(**figures["plans"][circle.get("data-granularity")])
            x, y = data(float(circle.get("cx", "nan")), float(circle.get("cy", "nan")))
            assert (x, y) == (
                pytest.approx(plan.kept_bytes, abs=width * 1e-3),
                pytest.approx(plan.recompute_share, abs=1e-3),
            )
    (budget,) = [line for line in svg.iter(f"{SVG}line") if line.get("class") == "budget"]
    assert budget.get("x1") == budget.get("x2")
    assert data(float(budget.get("x1", "nan")), 0)[0] == pytest.approx(figures["budget_bytes"], abs=width * 1e-3)
    assert "op granularity (the config's)" in labels and "module granularity" in labels


def test_plot_needs_an_svg_path_and_a_budget_each_a_one_line_error(capsys, tmp_path) -> None:
    config = tmp_path / "mixed.yaml"
    config.write_text(MIXED)
    picture = tmp_path / "trade_off.png"
    code, out, err = audit(capsys, "--config", str(config), "--plot", str(picture))
    assert (code, out) == (2, "")
    assert err == (
        f"lightning-ckpt-determinism audit: error: `--plot` {str(picture)!r} must end in .svg: the trade-off is drawn"
        " as an SVG picture; give a path such as trade-off.svg\n"
    )
    unbudgeted = write_config(tmp_path, "unbudgeted", CHECKPOINTING.format(classes="Block"))
    picture = tmp_path / "trade_off.svg"
    code, out, err = audit(capsys, "--config", str(unbudgeted), "--plot", str(picture))
    assert (code, out) == (2, "")
    assert err.count("\n") == 1
    assert err.startswith(f"lightning-ckpt-determinism audit: error: `--plot` {str(picture)!r} draws a `memory_budget`")
    assert "set `memory_budget` under `trainer.strategy.init_args.checkpointing`, or leave out `--plot`" in err
    assert not picture.exists()


def test_the_trade_off_of_candidates_that_save_nothing_plans_at_one_byte_instead_of_failing() -> None:
    figures = [RegionFigures("a", 0, 0, 0, 1, 0, ()), RegionFigures("b", 0, 0, 0, 0, 0, ())]
    found = trade_off(plan_from_figures(figures, CheckpointingConfig(names=["a", "b"], memory_budget="50%")))
    for curve in found.curves.values():
        assert [point.kept_bytes for point in curve] == [0]
