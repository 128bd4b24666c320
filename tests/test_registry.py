"""The package's strategies by name in Lightning's strategy registry, from Python and YAML, and the one line for a
stock Lightning strategy given `checkpointing`."""

import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.strategies import StrategyRegistry

from lightning_ckpt_determinism import (
    CheckpointingCLI,
    DDPCheckpointingStrategy,
    FSDPCheckpointingStrategy,
    ModelParallelCheckpointingStrategy,
    RecomputationMonitor,
    SingleDeviceCheckpointingStrategy,
)
from tests.helpers import StackModule, trainer_kwargs

ROOT = Path(__file__).parent.parent


def test_each_strategy_is_registered_by_name_with_classes_auto() -> None:
    expected = {
        "single_device_checkpointing": SingleDeviceCheckpointingStrategy,
        "ddp_checkpointing": DDPCheckpointingStrategy,
        "fsdp_checkpointing": FSDPCheckpointingStrategy,
        "model_parallel_checkpointing": ModelParallelCheckpointingStrategy,
    }
    for name, strategy in expected.items():
        assert StrategyRegistry[name]["strategy"] is strategy
        assert StrategyRegistry[name]["init_params"]["checkpointing"].classes == "auto"


def test_the_names_are_registered_by_the_lightning_layer_never_by_the_package_root() -> None:
    code = (
        "import lightning_ckpt_determinism\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "print('ddp_checkpointing' in StrategyRegistry)\n"
        "import lightning_ckpt_determinism.lightning\n"
        "print('ddp_checkpointing' in StrategyRegistry)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]


def test_a_registered_name_and_the_monitor_are_the_one_flag_start(tmp_path: Path) -> None:
    monitor = RecomputationMonitor(every_n_steps=2)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, strategy="ddp_checkpointing", callbacks=[monitor]))
    trainer.fit(StackModule(block="PlainBlock"))
    assert isinstance(trainer.strategy, DDPCheckpointingStrategy) and trainer.strategy.checkpointing.classes == "auto"
    # The check ran on the 3 blocks `classes: auto` chose, as `names: ["model.blocks.*"]` would have.
    assert [(entry.step, entry.diverged) for entry in monitor.history] == [(0, False), (2, False)]
    assert monitor.last_report is not None
    assert monitor.last_report.checked_regions == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]


def write(tmp_path: Path, strategy: str) -> Path:
    config = tmp_path / "run.yaml"
    config.write_text(
        f"trainer:\n  default_root_dir: {tmp_path}\n  accelerator: cpu\n  max_steps: 2\n  logger: false\n"
        f"  enable_checkpointing: false\n  enable_progress_bar: false\n  strategy:{strategy}\n"
        "  callbacks:\n    - class_path: lightning_ckpt_determinism.RecomputationMonitor\n"
        "model:\n  class_path: tests.helpers.StackModule\n  init_args:\n    block: PlainBlock\n"
    )
    return config


def test_a_registered_name_in_yaml_trains_checkpointed_and_monitored(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    cli = CheckpointingCLI(args=["fit", "--config", str(write(tmp_path, " single_device_checkpointing"))])
    assert isinstance(cli.trainer.strategy, SingleDeviceCheckpointingStrategy) and cli.trainer.global_step == 2
    (monitor,) = [callback for callback in cli.trainer.callbacks if isinstance(callback, RecomputationMonitor)]  # type: ignore[attr-defined]
    assert monitor.last_report is not None and monitor.last_report.checked_regions == [
        "model.blocks.0",
        "model.blocks.1",
        "model.blocks.2",
    ]


@pytest.mark.parametrize(("stock", "ours", "name"), [("DDPStrategy", "DDPCheckpointingStrategy", "ddp_checkpointing")])
def test_a_stock_strategy_given_checkpointing_is_one_line_naming_the_packages_strategy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], stock: str, ours: str, name: str
) -> None:
    strategy = (
        f"\n    class_path: lightning.pytorch.strategies.{stock}\n    init_args:\n      checkpointing:\n"
        "        classes: [PlainBlock]"
    )
    with pytest.raises(SystemExit) as exited:
        CheckpointingCLI(args=["fit", "--config", str(write(tmp_path, strategy))])
    assert exited.value.code == 2
    assert capsys.readouterr().err == (
        f"error: `trainer.strategy`: lightning.pytorch.strategies.{stock} takes no `checkpointing`; use `class_path:"
        f" lightning_ckpt_determinism.{ours}` with the same `init_args`, or `strategy: {name}` for `classes: auto`.\n"
    )
