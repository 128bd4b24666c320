"""The monitor's sentinel watches training batches only: a validation loop run with gradients on (an input-gradient
metric under ``torch.enable_grad()``) recomputes its checkpointed regions in its own backward, and what that
recomputation does is neither counted in the sentinel's training metrics nor raised."""

from pathlib import Path
from typing import Any, get_args

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckpt_determinism import (
    CheckpointingConfig,
    RecomputationDivergenceError,
    RecomputationMonitor,
    SingleDeviceCheckpointingStrategy,
    apply_activation_checkpointing,
    recomputation_sentinel,
)
from lightning_ckpt_determinism.verify.digest import DigestTier
from tests.helpers import DIM, ArmedBlock, StackModule, trainer_kwargs
from tests.test_monitor_sentinel import logged

TIERS = get_args(DigestTier)
# The armed block counts its training calls in a list, which recomputation repeats: the checks leave it out.
COUNTS = ["calls", "eval_calls"]


class EvalCountBlock(ArmedBlock):
    """An :class:`ArmedBlock` (exact in training, but for the recomputation of training step ``armed``) whose
    eval-mode calls scale ``tanh``'s input by a count of them kept in a list, which recomputation does not replay:
    in validation, its recomputation differs from its forward."""

    def __init__(self, armed: int) -> None:
        super().__init__(armed=armed)
        self.eval_calls: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            return super().forward(x)
        self.eval_calls.append(1)
        return x + torch.tanh(self.linear(x) * (1.0 + 0.1 * len(self.eval_calls)))


class InputGradientModule(StackModule):
    """Dropout blocks around an :class:`EvalCountBlock`; validation logs the norm of the loss's gradient with respect
    to the input, computed under ``torch.enable_grad()`` (which recomputes every checkpointed region)."""

    def __init__(self, armed: int = -1) -> None:
        # A small learning rate keeps twelve steps finite, so that weights compare by value.
        super().__init__(block="DropoutBlock", n=3, lr=0.01)
        torch.manual_seed(1)
        self.model.blocks[1] = EvalCountBlock(armed)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val/input_gradient", input_gradient(self, batch).norm())

    def val_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(3)
        x = torch.randn(16, DIM, generator=generator)
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)


def input_gradient(module: StackModule, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    with torch.enable_grad():
        x = x.detach().clone().requires_grad_(True)
        (gradient,) = torch.autograd.grad(F.mse_loss(module.model(x), y), x)
    return gradient


def fit(
    tmp_path: Path,
    module: StackModule,
    monitor: RecomputationMonitor | None,
    *,
    validate: bool = True,
    sanity_check: bool = True,
) -> pl.Trainer:
    pl.seed_everything(0, verbose=False)
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["model.blocks.*"]))
    kwargs = trainer_kwargs(
        tmp_path,
        max_steps=12,
        strategy=strategy,
        callbacks=[] if monitor is None else [monitor],
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        # Validation with gradients: Lightning's default inference mode would forbid `enable_grad` in it.
        inference_mode=False,
        val_check_interval=4,
        limit_val_batches=None if validate else 0,
        num_sanity_val_steps=2 if sanity_check else 0,
    )
    trainer = pl.Trainer(**kwargs)
    trainer.fit(module)
    return trainer


def weights(module: StackModule) -> dict[str, Any]:
    return {name: value.clone() for name, value in module.state_dict().items()}


def test_the_validation_recomputation_differs_from_its_forward() -> None:
    # Ground truth for the tests below: the sentinel on its own, without the monitor, sees this validation differ.
    module = InputGradientModule()
    apply_activation_checkpointing(module, CheckpointingConfig(names=["model.blocks.*"]))
    module.eval()
    with recomputation_sentinel(module, mode="exact") as sentinel:
        input_gradient(module, next(iter(module.val_dataloader())))
    report = sentinel.report()
    assert report.regions["model.blocks.1"].mismatches == 1
    assert (report.mismatches, report.regions["model.blocks.0"].compared > 0) == (1, True)


@pytest.mark.parametrize("sentinel", TIERS)
def test_a_validation_loop_with_gradients_is_not_a_training_finding(tmp_path: Path, sentinel: str) -> None:
    module = InputGradientModule()
    monitor = RecomputationMonitor(
        every_n_steps=50,
        on_divergence="raise",
        sentinel=sentinel,  # type: ignore[arg-type]
        exclude_attributes=COUNTS,
    )
    # Without the sanity check, the regions' first calls are training's in both fits (the light tier learns from
    # a region's first call otherwise than from a later one, so the sanity check would change step 0's count).
    trainer = fit(tmp_path / "validated", module, monitor, sanity_check=False)
    assert trainer.global_step == 12
    # Three validations of two batches ran their backward through the regions: a forward and a recomputation each.
    assert len(module.model.blocks[1].eval_calls) == 2 * 3 * 2
    report = monitor.sentinel_report
    assert report is not None and report.mismatches == 0
    # What the sentinel counted is what the same fit without validation counts, step by step.
    twin_monitor = RecomputationMonitor(
        every_n_steps=50,
        on_divergence="raise",
        sentinel=sentinel,  # type: ignore[arg-type]
        exclude_attributes=COUNTS,
    )
    twin = InputGradientModule()
    fit(tmp_path / "unvalidated", twin, twin_monitor, validate=False)
    for key in ("recompute/sentinel/compared", "recompute/sentinel/mismatches"):
        assert logged(tmp_path / "validated", key) == logged(tmp_path / "unvalidated", key), key
    assert [step for step, _ in logged(tmp_path / "validated", "recompute/sentinel/mismatches")] == list(range(12))
    twin_report = twin_monitor.sentinel_report
    assert twin_report is not None
    assert (report.compared, report.not_compared) == (twin_report.compared, twin_report.not_compared)
    # And training went as without the monitor, validation included.
    plain = InputGradientModule()
    fit(tmp_path / "plain", plain, None, sanity_check=False)
    trained, twin_weights = weights(module), weights(plain)
    assert trained.keys() == twin_weights.keys()
    assert all(torch.isfinite(value).all() and torch.equal(value, twin_weights[key]) for key, value in trained.items())


def test_a_training_defect_still_raises_at_its_step_with_validation_in_the_fit(tmp_path: Path) -> None:
    module = InputGradientModule(armed=5)
    monitor = RecomputationMonitor(every_n_steps=50, on_divergence="raise", exclude_attributes=COUNTS)
    with pytest.raises(RecomputationDivergenceError, match=r"region `model.blocks.1` .* at step 5: 1 mismatch"):
        fit(tmp_path / "raised", module, monitor)
    # The validation after step 3 ran before, and raised nothing.
    assert len(module.model.blocks[1].eval_calls) == 2 * (2 + 2)
    # Ground truth: the same model trained for the five steps before it. Step 5's gradients were never applied.
    twin = InputGradientModule(armed=5)
    pl.seed_everything(0, verbose=False)
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["model.blocks.*"]))
    kwargs = trainer_kwargs(
        tmp_path / "twin", max_steps=5, strategy=strategy, inference_mode=False, val_check_interval=4
    )
    pl.Trainer(**kwargs).fit(twin)
    trained, twin_weights = weights(module), weights(twin)
    assert all(torch.isfinite(value).all() and torch.equal(value, twin_weights[key]) for key, value in trained.items())
