"""Lightning features a fit combines with checkpointing, each trained three ways from the same seed: without
checkpointing (the ground truth), checkpointed, and checkpointed under the monitor checking every step. The three
must end with the same weights, buffers and optimizer state, bit for bit, and the monitor must find nothing."""

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import callbacks
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parametrizations

from lightning_ckpt_determinism import (
    CheckpointingConfig,
    RecomputationMonitor,
    SingleDeviceCheckpointingStrategy,
)
from tests.helpers import DIM, DropoutBlock, Stack, StackModule, trained_state, trainer_kwargs

# Lightning 2.6 and later (the floor suite runs 2.5).
EMA_WEIGHT_AVERAGING = getattr(callbacks, "EMAWeightAveraging", None)


class WeightNormBlock(nn.Module):
    """A weight-normed linear layer (``parametrizations.weight_norm``: the weight is made from ``g`` and ``v`` at each
    forward), ReLU, dropout, residual."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.linear = parametrizations.weight_norm(nn.Linear(dim, dim))
        self.dropout = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(torch.relu(self.linear(x)))


class SpectralNormBlock(nn.Module):
    """A spectrally normed linear layer (``parametrizations.spectral_norm``): each training forward runs a power
    iteration that updates its ``_u`` and ``_v`` buffers in place, which a recomputation must not do again."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.linear = parametrizations.spectral_norm(nn.Linear(dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.linear(x))


class HookSpectralNormBlock(SpectralNormBlock):
    """The older ``nn.utils.spectral_norm``: a forward pre-hook sets ``weight`` from ``weight_orig`` and updates the
    ``weight_u`` buffer in place."""

    def __init__(self, dim: int = DIM) -> None:
        nn.Module.__init__(self)
        self.linear = nn.utils.spectral_norm(nn.Linear(dim, dim))


class TwoOptimizersModule(StackModule):
    """Manual optimization with two optimizers: SGD on the body every step, Adam on the head every other step."""

    def __init__(self) -> None:
        super().__init__(lr=0.01)
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        body, head = self.optimizers()  # type: ignore[misc]
        loss = super().training_step(batch, batch_idx)
        body.zero_grad()
        head.zero_grad()
        self.manual_backward(loss)
        body.step()
        if batch_idx % 2 == 0:
            head.step()
        return loss

    def configure_optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        body = [param for name, param in self.named_parameters() if not name.startswith("model.head")]
        return torch.optim.SGD(body, lr=0.05, momentum=0.9), torch.optim.Adam(self.model.head.parameters(), lr=0.01)


class TogglingModule(TwoOptimizersModule):
    """Lightning's GAN recipe: each optimizer's step under `toggle_optimizer`, which freezes the other's parameters,
    the head's loss backpropagated on top of gradients it holds already (no `zero_grad` between the two)."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        body, head = self.optimizers()  # type: ignore[misc]
        x, y = batch
        self.toggle_optimizer(body)  # the head is frozen: its gradients stay None
        loss = F.mse_loss(self(x), y)
        self.manual_backward(loss)
        body.step()
        body.zero_grad()
        self.untoggle_optimizer(body)
        self.toggle_optimizer(head)
        self.manual_backward(F.mse_loss(self(x), -y))
        head.step()
        head.zero_grad()
        self.untoggle_optimizer(head)
        return loss


class OutsideTensorModule(StackModule):
    """A learned temperature held as a plain tensor that requires grad, not a parameter, trained by the optimizer."""

    def __init__(self) -> None:
        super().__init__(lr=0.01)
        self.log_temperature = torch.zeros((), requires_grad=True)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x) * self.log_temperature.exp(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([*self.parameters(), self.log_temperature], lr=0.05, momentum=0.9)


def manual_loss(module: pl.LightningModule, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
    """The loss :class:`TwoOptimizersModule` backpropagates, as the monitor's ``loss_fn``."""
    x, y = batch
    return F.mse_loss(module(x), y)


class StepSchedulerModule(StackModule):
    """AdamW under a one-cycle learning rate stepped every optimizer step."""

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=20)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class ValidatedModule(StackModule):
    """Validation between training steps (dropout off there, on again after)."""

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val/loss", F.mse_loss(self.model(x), y))

    def val_dataloader(self) -> Any:
        return self.train_dataloader()


class SometimesNoLossModule(StackModule):
    """Returns no loss at every third batch: Lightning skips that step's backward and optimizer step."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx % 3 == 1 else loss


@dataclass
class Scenario:
    """One way to train: the module, its checkpointed block, the monitor's arguments and the Trainer's."""

    module: Callable[[], StackModule] = lambda: StackModule(lr=0.01)
    block: type[nn.Module] = DropoutBlock
    monitor: dict[str, Any] = field(default_factory=dict)
    trainer: Callable[[], dict[str, Any]] = dict
    resume_at: int | None = None


SCENARIOS = {
    "resume_from_ckpt_path": Scenario(trainer=lambda: {"max_steps": 6}, resume_at=3),
    "two_optimizers_manual": Scenario(
        module=TwoOptimizersModule, monitor={"loss_fn": manual_loss}, trainer=lambda: {"max_steps": 5}
    ),
    "toggle_optimizer_manual": Scenario(
        module=TogglingModule, monitor={"loss_fn": manual_loss}, trainer=lambda: {"max_steps": 6}
    ),
    "tensor_trained_outside_the_module": Scenario(module=OutsideTensorModule, trainer=lambda: {"max_steps": 4}),
    "step_interval_scheduler": Scenario(module=StepSchedulerModule, trainer=lambda: {"max_steps": 6}),
    "val_check_interval": Scenario(
        module=ValidatedModule, trainer=lambda: {"max_steps": 5, "val_check_interval": 2, "limit_val_batches": 2}
    ),
    "steps_without_loss": Scenario(module=SometimesNoLossModule, trainer=lambda: {"max_steps": 5}),
    "partial_last_accumulation": Scenario(
        trainer=lambda: {"max_epochs": 2, "max_steps": -1, "limit_train_batches": 5, "accumulate_grad_batches": 3}
    ),
    "ema_weight_averaging": Scenario(trainer=lambda: {"max_steps": 5, "callbacks": [EMA_WEIGHT_AVERAGING()]}),
    "weight_norm": Scenario(block=WeightNormBlock, trainer=lambda: {"max_steps": 4}),
    "spectral_norm": Scenario(block=SpectralNormBlock, trainer=lambda: {"max_steps": 4}),
    "hook_spectral_norm": Scenario(block=HookSpectralNormBlock, trainer=lambda: {"max_steps": 4}),
}


def train(tmp_path: Path, scenario: Scenario, way: str) -> tuple[dict[str, torch.Tensor], RecomputationMonitor | None]:
    """Train ``scenario`` one ``way`` (``"plain"``, ``"checkpointed"``, ``"monitored"``): its final weights, buffers
    and optimizer state, and the monitor of its last fit."""
    folder = tmp_path / way
    for max_steps, resumed in _legs(scenario):
        pl.seed_everything(0, verbose=False)
        module = scenario.module()
        torch.manual_seed(0)
        module.model = Stack([scenario.block() for _ in range(3)])
        kwargs = scenario.trainer()
        monitor = RecomputationMonitor(every_n_steps=1, **scenario.monitor) if way == "monitored" else None
        callbacks = [*kwargs.pop("callbacks", []), *([monitor] if monitor is not None else [])]
        if scenario.resume_at is not None:
            callbacks.append(ModelCheckpoint(dirpath=folder, save_last=True))
            kwargs.update(max_steps=max_steps, enable_checkpointing=True)
        strategy = (
            SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=[scenario.block]))
            if way != "plain"
            else "auto"
        )
        trainer = pl.Trainer(**trainer_kwargs(folder, strategy=strategy, callbacks=callbacks, **kwargs))
        trainer.fit(module, ckpt_path=folder / "last.ckpt" if resumed else None)
    return trained_state(module, trainer), monitor


def _legs(scenario: Scenario) -> list[tuple[int | None, bool]]:
    """The fits of a run, as ``(max_steps, resumed)``: one, or for a resumed scenario its first ``resume_at`` steps,
    then the rest resumed from the first fit's last checkpoint."""
    if scenario.resume_at is None:
        return [(None, False)]
    return [(scenario.resume_at, False), (scenario.trainer()["max_steps"], True)]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_checkpointed_and_monitored_training_equals_training_without_checkpointing(tmp_path, name):
    if name == "ema_weight_averaging" and EMA_WEIGHT_AVERAGING is None:
        pytest.skip("`EMAWeightAveraging` needs Lightning 2.6")
    scenario = SCENARIOS[name]
    plain, _ = train(tmp_path, scenario, "plain")
    checkpointed, _ = train(tmp_path, scenario, "checkpointed")
    monitored, monitor = train(tmp_path, scenario, "monitored")
    assert list(checkpointed) == list(monitored) == list(plain)
    assert any(key.startswith("optimizer") for key in plain)
    for key, expected in plain.items():
        assert torch.equal(checkpointed[key], expected), f"checkpointed: {key}"
        assert torch.equal(monitored[key], expected), f"monitored: {key}"
    assert monitor is not None
    assert monitor.history, "no check ran"
    assert [record.grad_divergence for record in monitor.history] == [0.0] * len(monitor.history)
    report = monitor.sentinel_report
    assert report is not None
    assert report.compared > 0
    assert report.mismatches == 0
