from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.nn import functional as F

from lightning_ckpt_determinism import CheckpointingConfig, RecomputationMonitor, SingleDeviceCheckpointingStrategy
from tests.helpers import StackModule, trainer_kwargs


class ScheduledByHand(StackModule):
    """Steps its learning-rate scheduler and scales a learning rate by hand in `training_step`, and reads the
    learning rate into its loss: a rerun of the step must start from the settings the live step started from."""

    def __init__(self) -> None:
        super().__init__(block="DropoutBlock")
        self.lrs: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        scheduler = self.lr_schedulers()
        optimizer = self.optimizers().optimizer
        scheduler.step()  # type: ignore[union-attr]
        optimizer.param_groups[1]["lr"] *= 0.9
        lr = optimizer.param_groups[0]["lr"]
        self.lrs.append(lr)
        x, y = batch
        return F.mse_loss(self.model(x), y) * (1 + lr)

    def configure_optimizers(self) -> Any:
        first, *rest = list(self.parameters())
        optimizer = torch.optim.AdamW([{"params": rest}, {"params": [first], "lr": 0.05}], lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}


def _fit(tmp_path: Path, monitor: RecomputationMonitor | None) -> tuple[pl.Trainer, ScheduledByHand]:
    pl.seed_everything(0, verbose=False)
    module = ScheduledByHand()
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=["DropoutBlock"]))
    callbacks = [monitor] if monitor is not None else []
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, strategy=strategy, callbacks=callbacks, max_steps=4))
    trainer.fit(module)
    return trainer, module


@pytest.mark.parametrize("attribution", ["on_divergence", "always"])
def test_learning_rates_set_in_training_step_are_as_without_the_monitor(tmp_path: Path, attribution: str) -> None:
    plain_trainer, plain = _fit(tmp_path / "without", None)
    monitor = RecomputationMonitor(every_n_steps=1, attribution=attribution)  # type: ignore[arg-type]
    trainer, module = _fit(tmp_path / "with", monitor)
    # Every check reran the step from its own learning rate: no false divergence, the same rates seen.
    assert [entry.grad_divergence for entry in monitor.history] == [0.0] * 4
    assert module.lrs == plain.lrs == [0.05, 0.025, 0.0125, 0.00625]
    groups = [{key: group[key] for key in ("lr", "initial_lr")} for group in trainer.optimizers[0].param_groups]
    assert groups == [
        {key: group[key] for key in ("lr", "initial_lr")} for group in plain_trainer.optimizers[0].param_groups
    ]
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 4
    assert all(torch.equal(value, plain.state_dict()[key]) for key, value in module.state_dict().items())
    ours, theirs = trainer.optimizers[0].state_dict()["state"], plain_trainer.optimizers[0].state_dict()["state"]
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[at][key], theirs[at][key]) for at in ours for key in ours[at])
