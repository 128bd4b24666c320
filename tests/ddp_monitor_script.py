"""Two-process CPU DDP training with the monitor, run by ``tests/test_callback_ddp.py``.

Usage: ``python tests/ddp_monitor_script.py OUT_DIR warn|raise``. Lightning's launcher starts rank 1 by running
this script again; each rank writes ``OUT_DIR/rank{N}.json``.
"""

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger

from lightning_ckpt_determinism import (
    CheckpointingConfig,
    DDPCheckpointingStrategy,
    RecomputationDivergenceError,
    RecomputationMonitor,
)
from tests.helpers import DIM, StackModule, trainer_kwargs


class RankOneCounterBlock(torch.nn.Module):
    """Exact on rank 0; on rank 1 reads a call counter in forward, so its recomputation differs."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(DIM, DIM)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        scale = float(self.calls) if dist.get_rank() == 1 else 1.0
        return x + torch.tanh(self.linear(x) * scale)


def main(out_dir: Path, mode: str) -> None:
    pl.seed_everything(0, verbose=False)
    module = StackModule(block="PlainBlock")
    module.model.blocks[1] = RankOneCounterBlock()
    monitor = RecomputationMonitor(every_n_steps=2, on_divergence=mode)  # type: ignore[arg-type]
    strategy = DDPCheckpointingStrategy(
        checkpointing=CheckpointingConfig(classes=["PlainBlock", "RankOneCounterBlock"]),
        process_group_backend="gloo",
    )
    kwargs = trainer_kwargs(out_dir, max_steps=4, devices=2, callbacks=[monitor], logger=CSVLogger(out_dir))
    trainer = pl.Trainer(**{**kwargs, "strategy": strategy})
    error = None
    try:
        trainer.fit(module)
    except RecomputationDivergenceError as err:
        error = str(err)
    result = {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "history": list(monitor.history),
        "local_divergence": monitor.last_report.grad_divergence if monitor.last_report else None,
        "error": error,
        "checksum": float(sum(p.double().sum() for p in module.parameters())),
    }
    (out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
