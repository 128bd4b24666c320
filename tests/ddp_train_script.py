"""Two-process CPU DDP training with and without checkpointing, run by ``tests/test_strategy.py``.

Usage: ``python tests/ddp_train_script.py OUT_DIR``. Lightning's launcher starts rank 1 by running this script again;
each rank trains the same seeded model twice (plain ``DDPStrategy``, then ``DDPCheckpointingStrategy``) and writes
``OUT_DIR/rank{N}.json``.
"""

import hashlib
import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_ckpt_determinism import CheckpointingConfig, DDPCheckpointingStrategy, checkpointed_modules
from tests.helpers import CheckpointedModulesRecorder, StackModule, run_rank, trainer_kwargs


def _digest(module: torch.nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in module.parameters())).hexdigest()


def _fit(out_dir: Path, strategy: DDPStrategy) -> dict[str, object]:
    pl.seed_everything(0, verbose=False)
    module = StackModule(block="DropoutBlock")
    initial = _digest(module)
    recorder = CheckpointedModulesRecorder()
    trainer = pl.Trainer(**{**trainer_kwargs(out_dir, devices=2, callbacks=[recorder]), "strategy": strategy})
    trainer.fit(module)
    return {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "seen": recorder.seen,
        "wrapped_after_fit": list(checkpointed_modules(module)),
        "loss": float(trainer.callback_metrics["train/loss"]),
        "initial": initial,
        "final": _digest(module),
    }


def main(out_dir: Path) -> None:
    unchecked = _fit(out_dir, DDPStrategy(process_group_backend="gloo"))
    config = CheckpointingConfig(classes=["DropoutBlock"])
    checkpointed = _fit(out_dir, DDPCheckpointingStrategy(checkpointing=config, process_group_backend="gloo"))
    result = {"unchecked": unchecked, "checkpointed": checkpointed}
    (out_dir / f"rank{checkpointed['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    run_rank(main, Path(sys.argv[1]))
