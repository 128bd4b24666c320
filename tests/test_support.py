"""Tests for `lightning_ckpt_determinism.lightning.support`: what the monitor needs of a strategy, asked of the
strategy (or, for Lightning's stock strategies, of their adapter)."""

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

import lightning_ckpt_determinism
import lightning_ckpt_determinism.lightning as lightning_layer
from lightning_ckpt_determinism import (
    CheckpointingConfig,
    CheckpointingConfigError,
    DDPCheckpointingStrategy,
    FSDPCheckpointingStrategy,
    ModelParallelCheckpointingStrategy,
    RecomputationMonitor,
    SingleDeviceCheckpointingStrategy,
    apply_activation_checkpointing,
)
from lightning_ckpt_determinism.lightning.support import (
    DDPSupport,
    FSDPSupport,
    StrategySupport,
    stock_support,
    support_of,
)
from tests.helpers import StackModule, trainer_kwargs

CONFIG = CheckpointingConfig(classes=["DropoutBlock"])


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        (SingleDeviceStrategy("cpu"), StrategySupport),
        (DDPStrategy(), DDPSupport),
        (FSDPStrategy(), FSDPSupport),
        (ModelParallelStrategy(), StrategySupport),
    ],
)
def test_lightnings_stock_strategies_get_their_support_from_the_adapter(strategy: object, expected: type) -> None:
    support = support_of(strategy)
    assert type(support) is expected
    assert support is not None and support.strategy is strategy


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        (SingleDeviceCheckpointingStrategy(checkpointing=CONFIG), StrategySupport),
        (DDPCheckpointingStrategy(checkpointing=CONFIG), DDPSupport),
        (FSDPCheckpointingStrategy(checkpointing=CONFIG), FSDPSupport),
        (ModelParallelCheckpointingStrategy(checkpointing=CONFIG), StrategySupport),
    ],
)
def test_the_packages_strategies_declare_their_support(strategy: object, expected: type) -> None:
    assert type(support_of(strategy)) is expected


def test_a_strategy_that_is_no_stock_one_has_no_stock_support() -> None:
    assert stock_support(object()) is None  # type: ignore[arg-type]


class _RecordingSupport(StrategySupport):
    asked = 0

    def gradient_holders(self, pl_module: "pl.LightningModule") -> list[tuple[str, torch.Tensor]]:
        type(self).asked += 1
        return super().gradient_holders(pl_module)


class _DeclaringStrategy(SingleDeviceStrategy):
    """A strategy of the user's that says what the monitor needs of it."""

    def monitor_support(self) -> StrategySupport:
        return _RecordingSupport(self)


class _UnsupportedStrategy(SingleDeviceStrategy):
    """A strategy that says the monitor cannot run under it."""

    def monitor_support(self) -> None:
        return None


def _fit(tmp_path: Path, strategy: pl.strategies.Strategy) -> RecomputationMonitor:
    module = StackModule()
    apply_activation_checkpointing(module, CONFIG)
    monitor = RecomputationMonitor(every_n_steps=1, sentinel="off")
    torch.manual_seed(5)
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, strategy=strategy, callbacks=[monitor], max_steps=2))
    trainer.fit(module)
    return monitor


def test_the_monitor_asks_a_strategy_for_what_it_declares(tmp_path: Path) -> None:
    _RecordingSupport.asked = 0
    monitor = _fit(tmp_path, _DeclaringStrategy("cpu"))
    assert [record.grad_divergence for record in monitor.history] == [0.0, 0.0]
    assert _RecordingSupport.asked >= 2


def test_under_a_strategy_without_support_the_monitor_stops_the_fit_at_its_start(tmp_path: Path) -> None:
    # It warned and trained unchecked before: a monitor that cannot check says so before the first step.
    module, monitor = StackModule(), RecomputationMonitor(every_n_steps=1, sentinel="off")
    apply_activation_checkpointing(module, CONFIG)
    strategy = _UnsupportedStrategy("cpu")
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, strategy=strategy, callbacks=[monitor], max_steps=2))
    with pytest.raises(
        CheckpointingConfigError,
        match=r"^`RecomputationMonitor` cannot check under _UnsupportedStrategy: it runs under single-device, DDP,"
        r" FSDP and ModelParallel strategies and their subclasses\. Use one of those .*, give the strategy a"
        r" `monitor_support\(\)` that returns a `StrategySupport`, or remove the monitor\.$",
    ):
        trainer.fit(module)
    assert trainer.global_step == 0
    assert list(monitor.history) == []
    assert monitor.last_report is None


def test_the_root_exports_every_public_name_of_the_lightning_layer() -> None:
    assert set(lightning_layer.__all__) <= set(lightning_ckpt_determinism.__all__)
    for name in lightning_layer.__all__:
        assert getattr(lightning_ckpt_determinism, name) is getattr(lightning_layer, name)
    for name in lightning_ckpt_determinism.__all__:
        assert hasattr(lightning_ckpt_determinism, name), name
