"""A ``memory_budget`` under DDP and FSDP2 on two CPU processes (gloo), each rank with batches of its own size, and
under tensor parallelism.

Run by ``tests/test_budget_training.py``, which starts both ranks itself (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) so that Lightning creates no process of its own. Usage:
``python tests/distributed_budget_script.py OUT_DIR``. The process group times out after a minute, so that a hang
fails the test instead of stalling it. Each rank writes ``OUT_DIR/rank{N}.json``: per strategy, the plan it applied,
the plan its own batch gives in plain PyTorch, and which blocks each of its steps checkpointed.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from examples.gpt import shard_blocks_then_model
from lightning_ckpt_determinism import (
    CheckpointingConfig,
    CheckpointingPlan,
    DDPCheckpointingStrategy,
    ModelParallelCheckpointingStrategy,
    plan_activation_checkpointing,
)
from tests.helpers import StackModule, TensorParallelStackModule, close_process_group, trainer_kwargs
from tests.test_budget import CONFIG, DIM, _mixed
from tests.test_budget_training import MixedModule

BUDGET = 0.6


def _rows() -> int:
    return 16 + 8 * dist.get_rank()


class RankSizedModule(MixedModule):
    """Batches of 16 rows on rank 0 and 24 on rank 1."""

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(3 + dist.get_rank())
        x = torch.randn(3 * _rows(), DIM, generator=generator)
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=_rows())


class ShardedRankSizedModule(RankSizedModule):
    """Each block, then the model, sharded with FSDP2."""

    def configure_model(self) -> None:
        shard_blocks_then_model(self)


def _figures(plan: CheckpointingPlan) -> list[list[int]]:
    return [[entry.plain_bytes, entry.checkpointed_bytes, entry.flops] for entry in plan.candidates]


def _op_figures(plan: CheckpointingPlan) -> list[list[list[Any]]]:
    return [[[op.index, op.op, op.bytes, op.cost] for op in entry.ops] for entry in plan.candidates]


def fit(module: RankSizedModule, strategy: Any, out_dir: Path, granularity: str = "module") -> dict[str, Any]:
    trainer = pl.Trainer(
        **trainer_kwargs(out_dir, max_steps=3, strategy=strategy, devices=2, use_distributed_sampler=False)  # type: ignore[arg-type]
    )
    trainer.fit(module)
    plan = strategy.checkpointing_plan
    assert plan is not None
    twin = _mixed()
    x, y = next(iter(module.train_dataloader()))
    config = CheckpointingConfig(**CONFIG, memory_budget=BUDGET, budget_granularity=granularity)  # type: ignore[arg-type]
    own = plan_activation_checkpointing(twin, config, lambda: F.mse_loss(twin(x), y).backward())
    return {
        "checkpointed": plan.checkpointed,
        "figures": _figures(plan),
        "own_figures": _figures(own),
        "op_figures": _op_figures(plan),
        "own_op_figures": _op_figures(own),
        "saved_ops": {name: [list(call) for call in calls] for name, calls in plan.saved_ops.items()},
        "steps": module.checkpointed,
    }


def fit_tensor_parallel(out_dir: Path) -> dict[str, Any]:
    """A stack of MLP blocks sharded with tensor parallelism (both ranks see the same batches), planned at 70 %."""
    config = CheckpointingConfig(names=["model.blocks.*"], memory_budget=0.7)
    strategy = ModelParallelCheckpointingStrategy(
        checkpointing=config, data_parallel_size=1, tensor_parallel_size=2, process_group_backend="gloo"
    )
    module = TensorParallelStackModule(block="MLPBlock")
    trainer = pl.Trainer(
        **trainer_kwargs(out_dir, max_steps=3, strategy=strategy, devices=2, use_distributed_sampler=False)  # type: ignore[arg-type]
    )
    trainer.fit(module)
    plan = strategy.checkpointing_plan
    assert plan is not None
    twin = StackModule(block="MLPBlock")
    x, y = next(iter(twin.train_dataloader()))
    unsharded = plan_activation_checkpointing(twin, config, lambda: F.mse_loss(twin(x), y).backward())
    return {"checkpointed": plan.checkpointed, "figures": _figures(plan), "unsharded_figures": _figures(unsharded)}


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    config = CheckpointingConfig(names=["model.blocks.*"], memory_budget=BUDGET)
    pl.seed_everything(0, verbose=False)
    ddp = DDPCheckpointingStrategy(checkpointing=config, process_group_backend="gloo")
    found = {"ddp": fit(RankSizedModule(), ddp, out_dir)}
    pl.seed_everything(0, verbose=False)
    fsdp2 = ModelParallelCheckpointingStrategy(
        checkpointing=config, data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo"
    )
    found["fsdp2"] = fit(ShardedRankSizedModule(), fsdp2, out_dir)
    pl.seed_everything(0, verbose=False)
    op_config = CheckpointingConfig(names=["model.blocks.*"], memory_budget=BUDGET, budget_granularity="op")
    ddp_op = DDPCheckpointingStrategy(checkpointing=op_config, process_group_backend="gloo")
    found["ddp_op"] = fit(RankSizedModule(), ddp_op, out_dir, "op")
    pl.seed_everything(0, verbose=False)
    found["tp"] = fit_tensor_parallel(out_dir)
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(found))


if __name__ == "__main__":
    try:
        main(Path(sys.argv[1]))
    finally:
        close_process_group()
