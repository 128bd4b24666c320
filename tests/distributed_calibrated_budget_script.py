"""A ``budget_cost="calibrated"`` budget under DDP on two CPU processes (gloo), at each granularity, where the two
ranks' calibrations give different rates on purpose, and a plain DDP fit beside it.

Run by ``tests/test_budget_cost.py``, which starts both ranks itself (see ``tests/distributed_budget_script.py``).
Usage: ``python tests/distributed_calibrated_budget_script.py OUT_DIR``. Each rank writes ``OUT_DIR/rank{N}.json``, per
granularity: the plan it applied, the plans plain PyTorch gives on the largest rank's batch at the rank's own rates and
at the least rates, which blocks each step checkpointed, and whether the trained weights equal the plain fit's.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.nn import functional as F

from lightning_ckpt_determinism import CheckpointingConfig, DDPCheckpointingStrategy, plan_activation_checkpointing
from lightning_ckpt_determinism.checkpointing import calibration
from lightning_ckpt_determinism.checkpointing.cost import Rates
from tests.distributed_budget_script import BUDGET, RankSizedModule
from tests.helpers import run_rank, trainer_kwargs
from tests.test_budget import CONFIG, DIM, _mixed

# Rank 0 calibrates the fixed roofline's rates (50 FLOPs per byte), rank 1 a device as fast at arithmetic as at
# moving bytes; their least is (3 TFLOP/s, 2 TB/s).
RATES = [Rates(100e12, 2e12), Rates(3e12, 3e12)]
LEAST = Rates(3e12, 2e12)


def _largest_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 1's first batch (24 rows, the larger), whose figures are the maximum the ranks plan from."""
    x = torch.randn(3 * 24, DIM, generator=torch.Generator().manual_seed(4))[:24]
    return x, x.sum(dim=1, keepdim=True)


def _own_plan(rates: Rates, granularity: str) -> list[Any]:
    """The checkpointed blocks and saved ops plain PyTorch plans on the largest batch when the calibration gives
    ``rates``."""
    calibration.measure_rates = lambda device, dtype=torch.float32: rates  # type: ignore[assignment]
    twin = _mixed()
    x, y = _largest_batch()
    config = CheckpointingConfig(
        **CONFIG,  # type: ignore[arg-type]
        memory_budget=BUDGET,
        budget_granularity=granularity,  # type: ignore[arg-type]
        budget_cost="calibrated",
    )
    plan = plan_activation_checkpointing(twin, config, lambda: F.mse_loss(twin(x), y).backward())
    return [plan.checkpointed, {name: [list(call) for call in calls] for name, calls in plan.saved_ops.items()}]


def _fit(strategy: Any, out_dir: Path) -> RankSizedModule:
    pl.seed_everything(0, verbose=False)
    module = RankSizedModule()
    trainer = pl.Trainer(
        **trainer_kwargs(out_dir, max_steps=3, strategy=strategy, devices=2, use_distributed_sampler=False)  # type: ignore[arg-type]
    )
    trainer.fit(module)
    return module


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    plain = _fit(DDPStrategy(process_group_backend="gloo"), out_dir / "plain")
    found = {}
    for granularity in ("module", "op"):
        calibration.measure_rates = lambda device, dtype=torch.float32: RATES[rank]  # type: ignore[assignment]
        config = CheckpointingConfig(
            names=["model.blocks.*"],
            memory_budget=BUDGET,
            budget_granularity=granularity,  # type: ignore[arg-type]
            budget_cost="calibrated",
        )
        strategy = DDPCheckpointingStrategy(checkpointing=config, process_group_backend="gloo")
        module = _fit(strategy, out_dir / granularity)
        plan = strategy.checkpointing_plan
        assert plan is not None
        checkpointed = [name.removeprefix("model.") for name in plan.checkpointed]
        saved = {name.removeprefix("model."): [list(call) for call in calls] for name, calls in plan.saved_ops.items()}
        found[granularity] = {
            "plan": [checkpointed, saved],
            "figures": [
                [entry.cost, [[op.index, op.op, op.bytes, op.cost] for op in entry.ops]] for entry in plan.candidates
            ],
            "own_plan": _own_plan(RATES[rank], granularity),
            "least_plan": _own_plan(LEAST, granularity),
            "steps": module.checkpointed,
            "identical_to_plain": all(
                torch.equal(ours, theirs) for ours, theirs in zip(module.parameters(), plain.parameters(), strict=True)
            ),
        }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(found))


if __name__ == "__main__":
    run_rank(main, Path(sys.argv[1]))
