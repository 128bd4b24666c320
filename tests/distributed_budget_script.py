"""A ``memory_budget`` under DDP and FSDP2 on two CPU processes (gloo), each rank with batches of its own size, and
under tensor parallelism.

Run by ``tests/test_budget_training.py``, which starts both ranks itself (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) so that Lightning creates no process of its own. Usage:
``python tests/distributed_budget_script.py OUT_DIR``. The process group times out after a minute, so that a hang
fails the test instead of stalling it. Each rank writes ``OUT_DIR/rank{N}.json``: per strategy, the plan it applied,
the plan its own batch gives in plain PyTorch, and which blocks each of its steps checkpointed; for FSDP2 at op
granularity also what the monitor found and the parameters whose local shard differs from a plain twin's.
"""

import json
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from examples.gpt import shard_blocks_then_model
from lightning_ckpt_determinism import (
    CheckpointingConfig,
    CheckpointingPlan,
    DDPCheckpointingStrategy,
    LightningCkptDeterminismWarning,
    ModelParallelCheckpointingStrategy,
    RecomputationMonitor,
    apply_activation_checkpointing,
    plan_activation_checkpointing,
)
from lightning_ckpt_determinism.checkpointing.wrapper import keep_op_calls
from lightning_ckpt_determinism.verify.gradients import local_tensor
from tests.helpers import OpCounter, StackModule, TensorParallelStackModule, run_rank, trainer_kwargs
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


class RecomputedAddmm(pl.Callback):
    """How many ``aten.addmm`` calls each step's backward runs; placed before the monitor, so that the count ends
    before the monitor's reference pass starts."""

    def __init__(self) -> None:
        self.counts: list[int] = []
        self._mode: OpCounter | None = None

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._mode = OpCounter().__enter__()

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self._mode is not None
        self._mode.__exit__(None, None, None)
        self.counts.append(self._mode.counts["aten.addmm"])


def _figures(plan: CheckpointingPlan) -> list[list[int]]:
    return [[entry.plain_bytes, entry.checkpointed_bytes, entry.flops] for entry in plan.candidates]


def _op_figures(plan: CheckpointingPlan) -> list[list[list[Any]]]:
    return [[[op.index, op.op, op.bytes, op.cost] for op in entry.ops] for entry in plan.candidates]


def _trainer(out_dir: Path, strategy: Any, callbacks: list[Any] | None = None) -> pl.Trainer:
    return pl.Trainer(
        **trainer_kwargs(
            out_dir, max_steps=3, strategy=strategy, devices=2, use_distributed_sampler=False, callbacks=callbacks or []
        )  # type: ignore[arg-type]
    )


def fit(
    module: RankSizedModule,
    strategy: Any,
    out_dir: Path,
    granularity: str = "module",
    callbacks: list[Any] | None = None,
) -> dict[str, Any]:
    _trainer(out_dir, strategy, callbacks).fit(module)
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


def fit_fsdp2_ops(out_dir: Path) -> dict[str, Any]:
    """FSDP2 at op granularity with the monitor checking every step, and a plain twin (same seed, no checkpointing)."""
    pl.seed_everything(0, verbose=False)
    op_config = CheckpointingConfig(names=["model.blocks.*"], memory_budget=BUDGET, budget_granularity="op")
    strategy = ModelParallelCheckpointingStrategy(
        checkpointing=op_config, data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo"
    )
    monitor = RecomputationMonitor(every_n_steps=1)
    counter = RecomputedAddmm()
    module = ShardedRankSizedModule()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LightningCkptDeterminismWarning)
        found = fit(module, strategy, out_dir, "op", [counter, monitor])
    plan = strategy.checkpointing_plan
    assert plan is not None
    pl.seed_everything(0, verbose=False)
    plain = ShardedRankSizedModule()
    sizes = {"data_parallel_size": 2, "tensor_parallel_size": 1, "process_group_backend": "gloo"}
    _trainer(out_dir, ModelParallelStrategy(**sizes)).fit(plain)
    pairs = [
        (name, local_tensor(ours), local_tensor(theirs))
        for (name, ours), theirs in zip(module.named_parameters(), plain.parameters(), strict=True)
    ]
    report = monitor.sentinel_report
    assert report is not None
    return {
        **found,
        "grad_divergence": [entry.grad_divergence for entry in monitor.history],
        "sentinel": [report.mismatches, report.compared],
        "sharded": [local_tensor(param) is not param for param in module.parameters()],
        "differing": [name for name, ours, theirs in pairs if not torch.equal(ours, theirs)],
        "warnings": [str(w.message) for w in caught if issubclass(w.category, LightningCkptDeterminismWarning)],
        "recomputed_addmm": counter.counts,
        "plain_pytorch_addmm": _addmm_in_plain_pytorch(module, plan),
    }


class StagedStack(torch.nn.Module):
    """A stack's input projection, its blocks as one ``nn.Sequential`` stage, and its head."""

    def __init__(self) -> None:
        super().__init__()
        stack = _mixed()
        self.inp, self.stage, self.head = stack.inp, torch.nn.Sequential(*stack.blocks), stack.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stage(self.inp(x)))


class StageOfUnits(RankSizedModule):
    """A :class:`StagedStack` whose blocks are each an FSDP2 unit of their own, then the model."""

    def __init__(self) -> None:
        super().__init__()
        self.model = StagedStack()

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.stage:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def fit_fsdp2_stage_ops(out_dir: Path) -> dict[str, Any]:
    """The stage of FSDP2 units checkpointed as one region at op granularity: the units gather their parameters
    inside it, which no op position of the plan may count."""
    pl.seed_everything(0, verbose=False)
    config = CheckpointingConfig(names=["model.stage"], memory_budget=0.5, budget_granularity="op")
    strategy = ModelParallelCheckpointingStrategy(
        checkpointing=config, data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LightningCkptDeterminismWarning)
        _trainer(out_dir, strategy).fit(StageOfUnits())
    plan = strategy.checkpointing_plan
    assert plan is not None
    return {
        "saved_ops": {name: [list(call) for call in calls] for name, calls in plan.saved_ops.items()},
        "warnings": [str(w.message) for w in caught if issubclass(w.category, LightningCkptDeterminismWarning)],
    }


def _addmm_in_plain_pytorch(module: RankSizedModule, plan: CheckpointingPlan) -> list[int]:
    """The ``aten.addmm`` calls a backward of this rank's first batch runs in plain PyTorch on one process, with every
    block checkpointed, under the plan, and under the plan keeping no op outputs."""
    x, y = next(iter(module.train_dataloader()))
    counts = []
    for setup in ("every block", "plan", "plan keeping nothing"):
        twin = torch.nn.ModuleDict({"model": _mixed()})
        if setup == "every block":
            apply_activation_checkpointing(twin, CheckpointingConfig(names=["model.blocks.*"]))
        else:
            plan.apply(twin)
        if setup == "plan keeping nothing":
            for name in plan.checkpointed:
                keep_op_calls(twin.get_submodule(name), ())
        loss = F.mse_loss(twin["model"](x), y)
        with OpCounter() as mode:
            loss.backward()
        counts.append(mode.counts["aten.addmm"])
    return counts


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
    found["fsdp2_op"] = fit_fsdp2_ops(out_dir)
    found["fsdp2_stage_op"] = fit_fsdp2_stage_ops(out_dir)
    pl.seed_everything(0, verbose=False)
    found["tp"] = fit_tensor_parallel(out_dir)
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(found))


if __name__ == "__main__":
    run_rank(main, Path(sys.argv[1]))
