"""Tests for `budget_cost`: the plan at each cost model equals a brute force over the test's own measurement, costed
by hand; the calibration measures positive rates, once; ranks that calibrate differently under DDP plan alike."""

import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from lightning_ckpt_determinism import (
    CheckpointingConfig,
    SingleDeviceCheckpointingStrategy,
    plan_activation_checkpointing,
)
from lightning_ckpt_determinism.checkpointing import calibration
from lightning_ckpt_determinism.checkpointing.cost import ROOFLINE, Rates, op_cost, roofline_cost
from tests.helpers import REPO, launch_ranks
from tests.test_budget import CONFIG, _mixed
from tests.test_budget_ops import (
    FLOPS_PER_BYTE,
    Figures,
    _brute_force,
    _cost_and_bytes,
    _own_measurement,
    _plan,
    _small,
)
from tests.test_budget_training import _fit

# Rates whose ratio (1 FLOP per byte) makes the small model's matmuls compute-bound, where the fixed roofline's 50
# makes them memory-bound: the plans differ.
KNOWN = Rates(flop_rate=3e12, bandwidth=3e12)


def _known_rates(monkeypatch: pytest.MonkeyPatch, rates: Rates = KNOWN) -> list[tuple[torch.device, torch.dtype]]:
    """Make the calibration give ``rates``; the list fills with the (device, dtype) of each calibration."""
    asked: list[tuple[torch.device, torch.dtype]] = []

    def measured(device: torch.device, dtype: torch.dtype = torch.float32) -> Rates:
        asked.append((device, dtype))
        return rates

    monkeypatch.setattr(calibration, "measure_rates", measured)
    return asked


def _module_brute_force(figures: Figures, budget: int) -> int:
    """The least recompute cost within ``budget`` over every subset of whole blocks checkpointed."""
    best = None
    for mask in itertools.product((False, True), repeat=len(figures)):
        kept = cost = 0
        for on, (plain, inputs, calls) in zip(mask, figures.values(), strict=True):
            kept += inputs if on else plain
            cost += sum(call[2] for call in calls) if on else 0
        if kept <= budget:
            best = cost if best is None else min(best, cost)
    assert best is not None
    return best


@pytest.mark.parametrize("fraction", [0.4, 0.6, 0.85])
def test_flops_plans_the_brute_force_optimum_of_a_flop_only_cost_elementwise_ops_free(fraction: float) -> None:
    own = _own_measurement(_small(), flops_per_byte=None)
    plan = _plan(_small(), fraction, cost="flops")
    cost, kept = _cost_and_bytes(plan, own)
    assert cost == _brute_force(own, plan.budget_bytes)
    assert kept == plan.kept_bytes <= plan.budget_bytes
    # Only the matmuls cost anything, and the region's cost is its forward FLOPs.
    for entry in plan.candidates:
        assert all(op.cost == op.flops for op in entry.ops)
        assert all(op.cost == 0 for op in entry.ops if "mm" not in op.op)
        assert entry.cost == entry.flops > 0
    # A free op is never worth keeping: every kept output is a matmul's.
    assert all("mm" in op for calls in plan.saved_ops.values() for _, op in calls)


@pytest.mark.parametrize("fraction", [0.4, 0.6, 0.85])
def test_calibrated_rates_plan_as_the_roofline_costed_by_hand_at_those_rates(
    fraction: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = _known_rates(monkeypatch)
    own = _own_measurement(_small(), flops_per_byte=KNOWN.flop_rate / KNOWN.bandwidth)
    plan = _plan(_small(), fraction, cost="calibrated")
    assert asked == [(torch.device("cpu"), torch.float32)]
    for entry in plan.candidates:
        assert [(op.op, op.bytes, op.cost) for op in entry.ops] == own[entry.name][2]
    cost, kept = _cost_and_bytes(plan, own)
    assert cost == _brute_force(own, plan.budget_bytes)
    assert kept == plan.kept_bytes <= plan.budget_bytes
    total = sum(call[2] for _, _, calls in own.values() for call in calls)
    assert plan.recompute_share == pytest.approx(cost / total)


def test_calibrated_rates_change_the_plan_the_fixed_roofline_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    _known_rates(monkeypatch)
    plans = {cost: _plan(_small(), 0.7, granularity="module", cost=cost) for cost in ("roofline", "calibrated")}
    assert plans["roofline"].checkpointed != plans["calibrated"].checkpointed
    plans = {cost: _plan(_small(), 1.0, cost=cost) for cost in ("roofline", "calibrated")}
    # The matmuls (compute-bound at 1 FLOP per byte) cost more calibrated; a recomputed sin (memory-bound at both) the
    # same.
    pairs = zip(plans["roofline"].candidates[1].ops, plans["calibrated"].candidates[1].ops, strict=True)
    products = [(fixed.cost, calibrated.cost) for fixed, calibrated in pairs if fixed.op == "aten.mm.default"]
    assert all(fixed < calibrated for fixed, calibrated in products[:2])
    assert products[2] == (0, 0)  # never recomputed (early stop), as the last sin below
    pairs = zip(plans["roofline"].candidates[0].ops, plans["calibrated"].candidates[0].ops, strict=True)
    sins = [(fixed.cost, calibrated.cost) for fixed, calibrated in pairs if fixed.op == "aten.sin.default"]
    assert len(sins) == 4
    assert all(fixed == calibrated > 0 for fixed, calibrated in sins[:3])
    # The last saves its input before it runs: torch's early stop ends the recomputation there, and it costs nothing.
    assert sins[3] == (0, 0)


@pytest.mark.parametrize(("cost", "flops_per_byte"), [("roofline", FLOPS_PER_BYTE), ("calibrated", 1.0)])
@pytest.mark.parametrize("fraction", [0.45, 0.7])
def test_module_granularity_minimises_the_same_cost_over_whole_blocks(
    cost: str, flops_per_byte: float, fraction: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    _known_rates(monkeypatch)
    own = _own_measurement(_small(), flops_per_byte=flops_per_byte)
    plan = _plan(_small(), fraction, granularity="module", cost=cost)
    assert plan.saved_ops == {}
    assert [entry.cost for entry in plan.candidates] == [sum(call[2] for call in own[name][2]) for name in own]
    recomputed = sum(entry.cost for entry in plan.candidates if entry.name in plan.checkpointed)
    assert recomputed == _module_brute_force(own, plan.budget_bytes)
    assert plan.kept_bytes <= plan.budget_bytes
    total = sum(entry.cost for entry in plan.candidates)
    assert plan.recompute_share == pytest.approx(recomputed / total)
    flops = sum(entry.flops for entry in plan.candidates)
    recomputed_flops = sum(entry.flops for entry in plan.candidates if entry.name in plan.checkpointed)
    assert plan.recomputed_flops_share == pytest.approx(recomputed_flops / flops)


def test_the_roofline_cost_is_the_larger_of_the_two_times_in_byte_equivalents() -> None:
    a, b = torch.ones(64, 64), torch.ones(64, 64)
    mm = torch.ops.aten.mm.default
    # 2 * 64**3 FLOPs; three 16 KiB matrices moved.
    flops, moved = 2 * 64**3, 3 * 64 * 64 * 4
    assert op_cost(mm, (a, b), {}, a @ b) == max(math.ceil(flops / 50), moved) == moved
    assert op_cost(mm, (a, b), {}, a @ b, Rates(1e12, 1e12)) == flops
    assert op_cost(mm, (a, b), {}, a @ b, None) == flops
    assert roofline_cost(101, 0, Rates(2.0, 1.0)) == 51
    assert Rates(100e12, 2e12) == ROOFLINE


def test_the_calibration_measures_positive_finite_rates_once_per_device() -> None:
    calibration.measure_rates.cache_clear()
    rates = calibration.measure_rates(torch.device("cpu"))
    assert all(math.isfinite(value) and value > 0 for value in (rates.flop_rate, rates.bandwidth))
    # Cached for the process: the same object again, until the cache is cleared.
    assert calibration.measure_rates(torch.device("cpu")) is rates
    assert calibration.measure_rates.cache_info().hits == 1


def test_the_calibration_leaves_the_processs_random_streams_where_they_were() -> None:
    # A calibrated plan must not move the dropout masks of the steps after it.
    calibration.measure_rates.cache_clear()
    before = torch.get_rng_state()
    calibration.measure_rates(torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), before)


def test_a_strategy_plans_with_the_calibrated_rates_as_plain_pytorch_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = _known_rates(monkeypatch)
    config = CheckpointingConfig(
        names=["model.blocks.*"], memory_budget=0.6, budget_granularity="op", budget_cost="calibrated"
    )
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=config)
    _, module = _fit(tmp_path, strategy)
    plan = strategy.checkpointing_plan
    assert plan is not None
    assert asked == [(torch.device("cpu"), torch.float32)]
    # What plain PyTorch plans for the first batch at the same rates.
    twin = _mixed()
    x, y = next(iter(module.train_dataloader()))
    config = replace(config, names=[], classes=CONFIG["classes"])
    twin = plan_activation_checkpointing(twin, config, lambda: F.mse_loss(twin(x), y).backward())
    assert {name.removeprefix("model."): calls for name, calls in plan.saved_ops.items()} == twin.saved_ops
    assert [entry.cost for entry in plan.candidates] == [entry.cost for entry in twin.candidates]


@pytest.mark.slow
def test_ddp_ranks_that_calibrate_differently_plan_alike_and_train_as_a_plain_fit(tmp_path: Path) -> None:
    launch_ranks(REPO / "tests" / "distributed_calibrated_budget_script.py", str(tmp_path), timeout=400)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for granularity in ("module", "op"):
        found = [rank[granularity] for rank in ranks]
        # Both ranks apply the plan of the least rates, from the same costs, checkpointed from the second step.
        assert found[0]["plan"] == found[1]["plan"] == found[0]["least_plan"] == found[1]["least_plan"]
        assert found[0]["figures"] == found[1]["figures"]
        for rank in found:
            assert rank["steps"][1:] == [found[0]["plan"][0]] * 2
            assert rank["identical_to_plain"] is True
    # At module granularity each rank's own rates plan otherwise: without the reduction the ranks would disagree.
    assert ranks[0]["module"]["own_plan"] != ranks[1]["module"]["own_plan"]
    assert any(ranks[0]["op"]["plan"][1].values())
