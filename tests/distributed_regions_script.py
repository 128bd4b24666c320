"""Collectives inside checkpointed regions, and tensor parallelism, on two CPU processes (gloo).

Run by ``tests/test_distributed_regions.py``, which starts both ranks itself (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) so that Lightning creates no process of its own. Usage:
``python tests/distributed_regions_script.py OUT_DIR``. The process group times out after a minute, far below gloo's
default, so that a hang fails the test instead of stalling it. Each rank writes ``OUT_DIR/rank{N}.json``: for each
scenario, what the check or the monitor found.
"""

import copy
import json
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn import functional as F

from lightning_ckpt_determinism import (
    CheckpointingConfig,
    DDPCheckpointingStrategy,
    LightningCkptDeterminismWarning,
    ModelParallelCheckpointingStrategy,
    RecomputationMonitor,
    RecomputationReport,
    apply_activation_checkpointing,
    check_recomputation,
    recomputation_sentinel,
)
from tests.helpers import (
    DIM,
    InnerUnitsStackModule,
    ShardedStackModule,
    SquaredMLPBlock,
    StackModule,
    TensorParallelStackModule,
    TrailingAllReduceBlock,
    make_stack,
    parallelize_blocks,
    run_rank,
    trainer_kwargs,
)

COLLECTIVE_BLOCKS = ("SyncNormBlock", "AllToAllBlock")


def _agree(decision: bool) -> bool:
    flag = torch.tensor(float(decision))
    dist.all_reduce(flag)
    return bool(flag.item() > 0)


def _found(report: RecomputationReport) -> dict[str, Any]:
    return {
        "grad_divergence": report.grad_divergence,
        "error": report.error,
        "regions": [[region.name, region.cause, region.ops_compared] for region in report.regions],
    }


def _stack(block: str, defect: bool) -> nn.Module:
    import tests.helpers as helpers

    model = make_stack(getattr(helpers, block))
    model.blocks[1].noise = defect
    return model


def plain_check(model: nn.Module, block: str) -> dict[str, Any]:
    """``check_recomputation`` with attribution, without Lightning, on every rank at once."""
    apply_activation_checkpointing(model, CheckpointingConfig(classes=[block]))
    rank = dist.get_rank()
    x = torch.randn(8, DIM, generator=torch.Generator().manual_seed(rank))
    y = torch.randn(8, 1, generator=torch.Generator().manual_seed(10 + rank))
    np.random.seed(0)
    report = check_recomputation(
        model, lambda: F.mse_loss(model(x), y), attribution=True, gradients="backward", agree=_agree
    )
    return _found(report)


def fit(module: pl.LightningModule, strategy: Any, monitor: RecomputationMonitor, out_dir: Path) -> dict[str, Any]:
    """A two-step fit with the monitor checking every step, logged to CSV (the monitor warns without a logger)."""
    np.random.seed(0)
    kwargs = trainer_kwargs(out_dir, max_steps=2, devices=2, callbacks=[monitor], logger=CSVLogger(out_dir))
    trainer = pl.Trainer(**{**kwargs, "strategy": strategy})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LightningCkptDeterminismWarning)
        trainer.fit(module)
    report = monitor.last_report
    return {
        "history": [[record.step, record.grad_divergence, record.diverged] for record in monitor.history],
        "regions": [[region.name, region.cause] for region in (report.regions if report else [])],
        "warnings": [str(w.message) for w in caught if issubclass(w.category, LightningCkptDeterminismWarning)],
    }


def _monitor(defect: bool) -> RecomputationMonitor:
    # A clean model is attributed at every check; a defect by the default, on divergence.
    if defect:
        return RecomputationMonitor(every_n_steps=1, on_divergence="ignore")
    return RecomputationMonitor(every_n_steps=1, attribution="always")


def _with_defect(module: StackModule, defect: bool) -> StackModule:
    module.model.blocks[1].noise = defect
    return module


def path_of_one_rank() -> list[float]:
    """Regions ending in an all-reduce after their last saved tensor take a path of their own on rank 1 at steps 2
    and 9 (rank 1 then probes for it at the calls after each, rank 0 does not): the largest difference of their
    gradients from a plain twin's at each step."""
    plain = make_stack(TrailingAllReduceBlock)
    model = copy.deepcopy(plain)
    apply_activation_checkpointing(model, CheckpointingConfig(classes=["TrailingAllReduceBlock"]))
    rank, differences = dist.get_rank(), []
    for step in range(12):
        for twin in (plain, model):
            for block in twin.blocks:
                block.detour = step in (2, 9) and rank == 1
        x = torch.randn(8, DIM, generator=torch.Generator().manual_seed(10 * step + rank))
        grads = [torch.autograd.grad(twin(x).square().sum(), list(twin.parameters())) for twin in (plain, model)]
        differences.append(max(float((a - b).abs().max()) for a, b in zip(*grads, strict=True)))
    return differences


def tensor_parallel_sentinel(mesh: Any) -> list[int]:
    """The exact sentinel over regions that save an all-reduce's result under tensor parallelism, twenty steps: what
    it compared and found."""
    torch.manual_seed(0)
    model = nn.Sequential(*(SquaredMLPBlock() for _ in range(3)))
    parallelize_blocks(model, mesh)
    apply_activation_checkpointing(model, CheckpointingConfig(classes=["SquaredMLPBlock"]))
    with recomputation_sentinel(model, mode="exact") as sentinel:
        for step in range(20):
            model(torch.randn(16, DIM, generator=torch.Generator().manual_seed(step))).square().sum().backward()
    report = sentinel.report()
    return [report.compared, report.mismatches]


def inner_units_sentinel(mesh: Any) -> list[list[list[Any]]]:
    """FSDP2 units inside checkpointed blocks, NumPy noise in the middle one, watched by a sentinel opened afresh at
    each of three steps: what each step found, region by region (mismatched, cause)."""
    from torch.distributed.fsdp import fully_shard

    model = _stack("MLPBlock", True)
    for block in model.blocks:
        for layer in block.modules():
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    apply_activation_checkpointing(model, CheckpointingConfig(classes=["MLPBlock"]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    found = []
    for step in range(3):
        with recomputation_sentinel(model, mode="exact") as sentinel:
            model(torch.randn(8, DIM, generator=torch.Generator().manual_seed(step))).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        regions = sentinel.report().regions.values()
        found.append([[region.mismatches > 0, region.cause] for region in regions])
    return found


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    results: dict[str, Any] = {}
    for block in COLLECTIVE_BLOCKS:
        checkpointing = CheckpointingConfig(classes=[block])
        for defect in (False, True):
            name = f"{block}_{'numpy_noise' if defect else 'clean'}"
            results[f"check_{name}"] = plain_check(_stack(block, defect), block)
            pl.seed_everything(0, verbose=False)
            ddp = DDPCheckpointingStrategy(checkpointing=checkpointing, process_group_backend="gloo")
            results[f"ddp_{name}"] = fit(_with_defect(StackModule(block), defect), ddp, _monitor(defect), out_dir)
            pl.seed_everything(0, verbose=False)
            fsdp2 = ModelParallelCheckpointingStrategy(
                checkpointing=checkpointing, data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo"
            )
            module = _with_defect(ShardedStackModule(block), defect)
            results[f"fsdp2_{name}"] = fit(module, fsdp2, _monitor(defect), out_dir)
    for defect in (False, True):
        # FSDP2 units inside the checkpointed blocks, resharded after their forward (the default).
        pl.seed_everything(0, verbose=False)
        fsdp2 = ModelParallelCheckpointingStrategy(
            checkpointing=CheckpointingConfig(classes=["MLPBlock"]),
            data_parallel_size=2,
            tensor_parallel_size=1,
            process_group_backend="gloo",
        )
        module = _with_defect(InnerUnitsStackModule("MLPBlock"), defect)
        results[f"fsdp2_inner_units_{'numpy_noise' if defect else 'clean'}"] = fit(
            module, fsdp2, _monitor(defect), out_dir
        )
    mesh = init_device_mesh("cpu", (2,))
    for defect in (False, True):
        name = "numpy_noise" if defect else "clean"
        model = _stack("MLPBlock", defect)
        parallelize_blocks(model, mesh)
        results[f"tp_check_{name}"] = plain_check(model, "MLPBlock")
        pl.seed_everything(0, verbose=False)
        tp = ModelParallelCheckpointingStrategy(
            checkpointing=CheckpointingConfig(classes=["MLPBlock"]),
            data_parallel_size=1,
            tensor_parallel_size=2,
            process_group_backend="gloo",
        )
        module = _with_defect(TensorParallelStackModule(), defect)
        results[f"tp_fit_{name}"] = fit(module, tp, _monitor(defect), out_dir)
    results["path_of_one_rank"] = path_of_one_rank()
    results["tp_sentinel"] = tensor_parallel_sentinel(mesh)
    results["inner_units_sentinel"] = inner_units_sentinel(mesh)
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    run_rank(main, Path(sys.argv[1]))
