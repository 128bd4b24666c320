"""A ``memory_budget`` under DDP on two CPU processes (gloo), each rank with batches of its own size.

Run by ``tests/test_budget_training.py``, which starts both ranks itself (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) so that Lightning creates no process of its own. Usage:
``python tests/ddp_budget_script.py OUT_DIR``. The process group times out after a minute, so that a hang fails the
test instead of stalling it. Each rank writes ``OUT_DIR/rank{N}.json``: the plan it applied, the plan its own batch
gives in plain PyTorch, and which blocks each of its steps checkpointed.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckpt_determinism import (
    CheckpointingConfig,
    CheckpointingPlan,
    DDPCheckpointingStrategy,
    plan_activation_checkpointing,
)
from tests.helpers import close_process_group, trainer_kwargs
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


def _figures(plan: CheckpointingPlan) -> list[list[int]]:
    return [[entry.plain_bytes, entry.checkpointed_bytes, entry.flops] for entry in plan.candidates]


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    pl.seed_everything(0, verbose=False)
    module = RankSizedModule()
    config = CheckpointingConfig(names=["model.blocks.*"], memory_budget=BUDGET)
    strategy = DDPCheckpointingStrategy(checkpointing=config, process_group_backend="gloo")
    trainer = pl.Trainer(
        **trainer_kwargs(out_dir, max_steps=3, strategy=strategy, devices=2, use_distributed_sampler=False)  # type: ignore[arg-type]
    )
    trainer.fit(module)
    plan = strategy.checkpointing_plan
    assert plan is not None
    twin = _mixed()
    x, y = next(iter(module.train_dataloader()))
    own = plan_activation_checkpointing(
        twin, CheckpointingConfig(**CONFIG, memory_budget=BUDGET), lambda: F.mse_loss(twin(x), y).backward()
    )
    found = {
        "checkpointed": plan.checkpointed,
        "figures": _figures(plan),
        "own_figures": _figures(own),
        "steps": module.checkpointed,
    }
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(found))


if __name__ == "__main__":
    try:
        main(Path(sys.argv[1]))
    finally:
        close_process_group()
