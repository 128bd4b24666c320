"""Tests for the shipped examples: each YAML under ``examples/configs/`` names its command and loads; GPT ones train."""

import math
import sys
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.cli import LightningCLI

from examples import train
from examples.gpt import Block, GPTModule
from examples.moe import MoEBlock, MoEModule
from lightning_ckpt_determinism import (
    ActivationCheckpointingMixin,
    CheckpointingConfig,
    LightningCkptDeterminismWarning,
    RecomputationMonitor,
    checkpointed_modules,
)
from lightning_ckpt_determinism.checkpointing import select_modules
from lightning_ckpt_determinism.config import resolve_class_path
from tests.helpers import CheckpointedModulesRecorder

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "examples" / "configs").glob("*.yaml"))
TRAIN_COMMAND = "# python -m examples.train fit --config "
TRAIN_CONFIGS = [path for path in CONFIGS if path.read_text().startswith(TRAIN_COMMAND)]
GPT_CONFIGS = [path for path in TRAIN_CONFIGS if path.name.startswith("gpt_")]
BROKEN_CONFIGS = [path for path in CONFIGS if path.name.startswith("broken_")]
SHOWN_AT_ONCE = "(the monitor shows the defect at once)"


def _ids(paths: list[Path]) -> list[str]:
    return [path.name for path in paths]


def _run_train_main(monkeypatch: pytest.MonkeyPatch, argv: list[str], run: bool) -> LightningCLI:
    """Run ``examples.train.main`` with ``argv`` as the command line; the LightningCLI it built."""
    # LightningCLI seeds through `seed_everything`, which exports the seed to the environment.
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    # LightningCLI warns when it is given `args` while the process has its own (pytest's).
    monkeypatch.setattr(sys, "argv", ["examples/train.py"])
    return train.main(argv, run=run)


def _checkpointing_of(path: Path) -> CheckpointingConfig:
    return CheckpointingConfig(**yaml.safe_load(path.read_text())["trainer"]["strategy"]["init_args"]["checkpointing"])


def test_the_gpt_configs_are_shipped() -> None:
    assert {"gpt_blocks_by_class.yaml", "gpt_blocks_by_name.yaml"} <= set(_ids(GPT_CONFIGS))


@pytest.mark.parametrize("path", CONFIGS, ids=_ids(CONFIGS))
def test_config_starts_with_the_command_that_runs_it_and_parses(path: Path) -> None:
    text = path.read_text()
    first_line = text.splitlines()[0]
    assert first_line.startswith("# python "), first_line
    assert f"--config examples/configs/{path.name}" in first_line
    assert isinstance(yaml.safe_load(text), dict)


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=_ids(TRAIN_CONFIGS))
def test_train_config_loads_with_lightning_cli_into_a_checkpointing_strategy(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cli = _run_train_main(monkeypatch, ["--config", str(path), f"--trainer.default_root_dir={tmp_path}"], run=False)
    strategy = cli.trainer.strategy
    spec = yaml.safe_load(path.read_text())["trainer"]["strategy"]
    assert type(strategy) is resolve_class_path(spec["class_path"])
    assert isinstance(strategy, ActivationCheckpointingMixin)
    assert isinstance(strategy.checkpointing, CheckpointingConfig)
    assert strategy.checkpointing == _checkpointing_of(path)
    model_class = resolve_class_path(yaml.safe_load(path.read_text())["model"]["class_path"])
    assert type(cli.model) is model_class
    assert model_class in (GPTModule, MoEModule)
    selected = select_modules(cli.model, strategy.checkpointing)
    assert selected
    block = MoEBlock if model_class is MoEModule else Block
    assert all(isinstance(module, block) for module in selected.values())


@pytest.mark.parametrize("path", GPT_CONFIGS, ids=_ids(GPT_CONFIGS))
def test_gpt_config_trains_with_checkpointing_applied(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = [
        "fit",
        "--config",
        str(path),
        "--trainer.max_steps=3",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.logger=false",
        "--trainer.callbacks+=tests.helpers.CheckpointedModulesRecorder",
    ]
    cli = _run_train_main(monkeypatch, argv, run=True)
    expected = list(
        select_modules(GPTModule(**yaml.safe_load(path.read_text())["model"]["init_args"]), _checkpointing_of(path))
    )
    assert expected
    assert all(isinstance(cli.model.get_submodule(name), Block) for name in expected)
    (recorder,) = [callback for callback in cli.trainer.callbacks if isinstance(callback, CheckpointedModulesRecorder)]
    assert cli.trainer.global_step == 3
    plan = cli.trainer.strategy.checkpointing_plan
    if _checkpointing_of(path).memory_budget is None:
        assert plan is None
        assert recorder.seen == [expected] * 3
    else:
        # The first step measures every match checkpointed; the plan, a strict subset here, applies from the second.
        assert plan is not None and 0 < len(plan.checkpointed) < len(expected)
        assert recorder.seen == [expected] + [plan.checkpointed] * 2
    assert checkpointed_modules(cli.model) == {}
    assert math.isfinite(cli.trainer.callback_metrics["train/loss"].item())
    assert all(torch.isfinite(param).all() for param in cli.model.parameters())


@pytest.mark.parametrize("path", BROKEN_CONFIGS, ids=_ids(BROKEN_CONFIGS))
def test_broken_config_trains_to_a_visible_defect(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    train_line = path.read_text().splitlines()[1]
    assert train_line.startswith(f"# Train it: python -m examples.train fit --config examples/configs/{path.name} (")
    argv = [
        "fit",
        "--config",
        str(path),
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
    ]
    if SHOWN_AT_ONCE not in train_line:
        assert train_line.endswith("(its first backward fails: audit it)")
        with pytest.raises(RuntimeError):
            _run_train_main(monkeypatch, argv, run=True)
        return
    with pytest.warns(LightningCkptDeterminismWarning, match="^lightning_ckpt_determinism: "):
        cli = _run_train_main(monkeypatch, argv, run=True)
    (monitor,) = [callback for callback in cli.trainer.callbacks if isinstance(callback, RecomputationMonitor)]
    assert cli.trainer.global_step <= 30
    assert monitor.history[0].step == 0
    if "parameter_write" in path.name:
        # The step writes a parameter in place (the forward's renormalisation), which the check cannot rerun from
        # where it started: it skips the step, and the sentinel counts the recomputation's write at every step.
        assert monitor.history[0].skipped == "parameters changed in place in the step"
        assert cli.trainer.callback_metrics["recompute/sentinel/mismatches"].item() > 0
        return
    assert monitor.history[0].diverged
    metric = next(
        (f"recompute/{kind}s" for kind in ("buffer_mutation", "attribute_mutation") if kind in path.name),
        "recompute/grad_divergence",
    )
    assert cli.trainer.callback_metrics[metric].item() > 0
