"""`classes: auto`: a model's transformer layers checkpointed without naming their class, from Python and YAML."""

import logging
from pathlib import Path

import lightning.pytorch as pl
import pytest
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from lightning_ckpt_determinism import (
    CheckpointingCLI,
    CheckpointingConfig,
    CheckpointingConfigError,
    apply_activation_checkpointing,
    check_recomputation,
    checkpointed_modules,
)
from lightning_ckpt_determinism.checkpointing.auto import auto_layers
from tests.helpers import StackModule, fsdp1_unit_on_the_cpu, one_process_group
from tests.test_transformers import MODELS, build, lm_loss, token_ids


@pytest.mark.parametrize("name", sorted(MODELS))
def test_auto_checkpoints_the_layers_transformers_own_gradient_checkpointing_would(name: str) -> None:
    model, _ = build(name, "eager")
    # Ground truth: the modules transformers' `gradient_checkpointing_enable()` turns on.
    theirs = [name for name, sub in model.named_modules() if isinstance(sub, GradientCheckpointingLayer)]
    assert len(theirs) == 2
    assert apply_activation_checkpointing(model, CheckpointingConfig(classes="auto")) == theirs
    report = check_recomputation(model, lm_loss(model, token_ids()))
    assert (report.diverged, report.grad_divergence, report.error) == (False, 0.0, None)
    assert report.checked_regions == theirs


def test_auto_without_transformers_layers_checkpoints_the_largest_module_list_of_one_class() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.ModuleList([nn.Linear(4, 4), nn.ReLU()])  # two classes: not repeated blocks
            self.heads = nn.ModuleList(nn.Linear(4, 1) for _ in range(2))
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3))

    model = Model()
    choice = auto_layers(model)
    assert choice.names == ("blocks.0", "blocks.1", "blocks.2")
    assert choice.reason == "the 3 Sequential of the ModuleList `blocks`"
    assert apply_activation_checkpointing(model, CheckpointingConfig(classes="auto")) == list(choice.names)


def test_auto_chooses_the_blocks_fsdp1_units_wrap_not_the_units(tmp_path: Path) -> None:
    # FSDP1's `auto_wrap_policy` makes each block a unit of its own, which takes the block's name.
    model = nn.Module()
    with one_process_group(tmp_path):
        model.blocks = nn.ModuleList(fsdp1_unit_on_the_cpu(nn.Sequential(nn.Linear(4, 4), nn.Tanh())) for _ in range(3))
        choice = auto_layers(model)
        assert choice.names == ("blocks.0", "blocks.1", "blocks.2")
        assert choice.reason == "the 3 Sequential of the ModuleList `blocks`"
        assert apply_activation_checkpointing(model, CheckpointingConfig(classes="auto")) == list(choice.names)
        assert [type(region).__name__ for region in checkpointed_modules(model).values()] == ["Sequential"] * 3


def test_auto_in_a_model_without_layers_to_choose_says_what_it_looked_for_and_how_to_name_blocks() -> None:
    with pytest.raises(
        CheckpointingConfigError, match=r"classes=auto \(found no GradientCheckpointingLayer and no"
    ) as raised:
        apply_activation_checkpointing(nn.Sequential(nn.Linear(2, 2)), CheckpointingConfig(classes="auto"))
    assert (
        "finds transformer layers only: name the blocks to checkpoint with `classes=[...]` (one of the classes below)"
        " or `names=[...]` (globs of the names below)." in str(raised.value)
    )


def test_a_single_class_name_is_still_refused_and_auto_is_not_a_class_name() -> None:
    with pytest.raises(CheckpointingConfigError) as raised:
        CheckpointingConfig(classes="Block")  # type: ignore[arg-type]
    assert str(raised.value) == (
        "`classes` must be a list of strings or 'auto', got 'Block'; use ['Block'], or 'auto' for a transformer's"
        " layers."
    )
    assert CheckpointingConfig(classes="auto").classes == "auto"


@pytest.mark.parametrize(
    ("classes", "message"),
    [
        ("Auto", r"^`classes` must be 'auto' or a list, got 'Auto'; write 'auto'\.$"),
        ("autp", r"^`classes` must be 'auto' or a list, got 'autp': did you mean 'auto'\? A class name goes in a list"),
        (
            ["auto"],
            r"^`classes` holds 'auto' in a list \(\['auto'\]\): 'auto' is a value of its own.* write `classes: auto`",
        ),
        (["auto", "Linear"], r"^`classes` holds 'auto' in a list \(\['auto', 'Linear'\]\)"),
    ],
)
def test_auto_misspelt_or_in_a_list_is_refused_saying_how_to_write_it(classes: object, message: str) -> None:
    with pytest.raises(CheckpointingConfigError, match=message):
        CheckpointingConfig(classes=classes)  # type: ignore[arg-type]


def test_auto_from_yaml_names_its_choice_in_the_setup_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(
        f"trainer:\n  default_root_dir: {tmp_path}\n  accelerator: cpu\n  max_steps: 2\n  logger: false\n"
        "  enable_checkpointing: false\n"
        "  enable_progress_bar: false\n  enable_model_summary: false\n"
        "  strategy:\n    class_path: lightning_ckpt_determinism.SingleDeviceCheckpointingStrategy\n"
        "    init_args:\n      checkpointing:\n        classes: auto\n"
        "model:\n  class_path: tests.helpers.StackModule\n  init_args:\n    block: PlainBlock\n"
    )
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
            pl.seed_everything(0, verbose=False)
            cli = CheckpointingCLI(args=["fit", "--config", str(config)], save_config_kwargs={"overwrite": True})
    finally:
        logger.removeHandler(caplog.handler)
    assert cli.trainer.global_step == 2
    (line,) = {r.getMessage() for r in caplog.records if "activation checkpointing (non-reentrant)" in r.getMessage()}
    # The same modules as naming them.
    named = apply_activation_checkpointing(
        StackModule(block="PlainBlock"), CheckpointingConfig(names=["model.blocks.*"])
    )
    assert named == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]
    chose = "chosen by `auto`: the 3 PlainBlock of the ModuleList `model.blocks`"
    assert f"applied to 3 modules (3 x PlainBlock, {chose})" in line


def test_the_coming_from_pages_python_runs_and_builds_the_one_flag_trainer() -> None:
    page = (Path(__file__).parent.parent / "docs" / "coming-from.md").read_text()
    code = page.split("```python\n")[1].split("```")[0]
    scope: dict[str, object] = {}
    exec(code, scope)
    trainer = scope["trainer"]
    assert isinstance(trainer, pl.Trainer) and trainer.strategy.checkpointing.classes == "auto"  # type: ignore[attr-defined]
