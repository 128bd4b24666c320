import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.nn import functional as F

from lightning_ckpt_determinism import CheckpointingConfig, RecomputationMonitor, SingleDeviceCheckpointingStrategy
from lightning_ckpt_determinism.lightning.optimizer_settings import OptimizerSettings
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


class HoldsAModule:
    """A learning-rate lambda that is an object holding a module (and a lock), as a warm-up tied to a model is."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.lock = threading.Lock()

    def __call__(self, epoch: int) -> float:
        return 0.5**epoch


def _trainer_with(optimizer: torch.optim.Optimizer, scheduler: Any = None) -> Any:
    configs = [] if scheduler is None else [SimpleNamespace(scheduler=scheduler)]
    return SimpleNamespace(optimizers=[optimizer], lr_scheduler_configs=configs)


def test_a_scheduler_is_put_back_holding_its_live_objects_never_copies_of_them() -> None:
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    warm_up = HoldsAModule(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warm_up)
    settings = OptimizerSettings(_trainer_with(optimizer, scheduler))  # a lock cannot be deep-copied: no copy made
    scheduler.step()
    scheduler.step()
    settings.restore()
    assert (scheduler.last_epoch, optimizer.param_groups[0]["lr"]) == (0, 0.1)
    assert scheduler.lr_lambdas[0] is warm_up and warm_up.module is model


def test_a_tensor_learning_rate_set_to_a_float_is_put_back_as_the_same_tensor() -> None:
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.Adam([param], lr=torch.tensor(0.1), betas=(torch.tensor(0.9), torch.tensor(0.99)))
    lr, betas = optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["betas"]
    settings = OptimizerSettings(_trainer_with(optimizer))
    optimizer.param_groups[0]["lr"] = 0.5
    betas[0].fill_(0.5)
    settings.restore()
    group = optimizer.param_groups[0]
    assert group["lr"] is lr and float(lr) == pytest.approx(0.1)
    assert group["betas"][0] is betas[0] and float(betas[0]) == pytest.approx(0.9)
