"""Two-process CPU DDP training of a LightningModule that compiles its model, with the monitor; run by
``tests/test_compile.py``.

Usage: ``python tests/ddp_compile_script.py OUT_DIR``. Lightning's launcher starts rank 1 by running this script
again; each rank writes ``OUT_DIR/rank{N}.json``.
"""

import json
import sys
from dataclasses import asdict
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_ckpt_determinism import CheckpointingConfig, DDPCheckpointingStrategy, RecomputationMonitor
from tests.helpers import StackModule, run_rank, trainer_kwargs


class CompiledStackModule(StackModule):
    """Compiles its model with ``aot_eager`` in ``configure_model``."""

    def configure_model(self) -> None:
        if not isinstance(self.model, torch._dynamo.eval_frame.OptimizedModule):
            self.model = torch.compile(self.model, backend="aot_eager")  # type: ignore[assignment]


def main(out_dir: Path) -> None:
    pl.seed_everything(0, verbose=False)
    module = CompiledStackModule()
    monitor = RecomputationMonitor(every_n_steps=2, on_divergence="raise")
    strategy = DDPCheckpointingStrategy(
        checkpointing=CheckpointingConfig(names=["model.blocks.*"]), process_group_backend="gloo"
    )
    trainer = pl.Trainer(**{**trainer_kwargs(out_dir, devices=2, callbacks=[monitor]), "strategy": strategy})
    trainer.fit(module)
    result = {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "history": [asdict(record) for record in monitor.history],
        "compiled": monitor.last_report is not None and monitor.last_report.compiled,
        "checksum": float(sum(p.double().sum() for p in module.parameters())),
    }
    (out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    run_rank(main, Path(sys.argv[1]))
