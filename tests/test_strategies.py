"""Tests for `lightning_ckpt_determinism.lightning.strategies`: checkpointing applied by Lightning strategies in a
fit."""

import json
import logging
import math
import sys
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from examples.broken import SyntheticRegression
from examples.moe import MoEModule
from lightning_ckpt_determinism import (
    CheckpointingConfig,
    CheckpointingConfigError,
    DDPCheckpointingStrategy,
    FSDPCheckpointingStrategy,
    LightningCkptDeterminismWarning,
    ModelParallelCheckpointingStrategy,
    RecomputationMonitor,
    SingleDeviceCheckpointingStrategy,
    apply_activation_checkpointing,
    checkpointed_modules,
)
from tests.helpers import CheckpointedModulesRecorder, StackModule, child_env, run_launcher, trainer_kwargs

REPO = Path(__file__).resolve().parents[1]
DDP_SCRIPT = REPO / "tests" / "ddp_train_script.py"
BLOCKS = ["model.blocks.0", "model.blocks.1", "model.blocks.2"]
CONFIG = CheckpointingConfig(classes=["DropoutBlock"])


def _weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def _unequal(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> list[str]:
    assert first.keys() == second.keys()
    return [name for name in first if not torch.equal(first[name], second[name])]


def _fit(
    tmp_path: Path,
    module: pl.LightningModule,
    strategy: object = "auto",
    datamodule: pl.LightningDataModule | None = None,
    **overrides: object,
) -> pl.Trainer:
    torch.manual_seed(5)
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, strategy=strategy, **overrides))
    trainer.fit(module, datamodule=datamodule)
    return trainer


@pytest.fixture
def lightning_info(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """``caplog`` receiving Lightning's info lines, which do not reach the root logger when Lightning was imported
    while the root logger had no handler (it then stops their propagation)."""
    logger = logging.getLogger("lightning.pytorch")
    attached = not logger.propagate
    if attached:
        logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        if attached:
            logger.removeHandler(caplog.handler)


# Single device.


def test_single_device_strategy_trains_checkpointed_and_equals_an_unchecked_run(
    tmp_path: Path, lightning_info: pytest.LogCaptureFixture
) -> None:
    initial = _weights(StackModule())
    recorder = CheckpointedModulesRecorder()
    module = StackModule()
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CONFIG)
    trainer = _fit(tmp_path, module, strategy, callbacks=[recorder])
    assert trainer.global_step == 4
    assert recorder.seen == [BLOCKS] * 4
    assert checkpointed_modules(module) == {}
    assert sorted(_unequal(initial, _weights(module))) == sorted(initial)

    unchecked = StackModule()
    _fit(tmp_path, unchecked)
    assert _unequal(_weights(unchecked), _weights(module)) == []

    applied = [
        record.getMessage() for record in lightning_info.records if "lightning_ckpt_determinism" in record.getMessage()
    ]
    # The blocks run no data-dependent op: nothing is said of `keep_data_dependent`, at setup or after. Without a
    # monitor, the line says what would check the recomputation.
    assert applied == [
        "lightning_ckpt_determinism: activation checkpointing (non-reentrant) applied to 3 modules (3 x DropoutBlock);"
        " every_n=1, save_ops=none. Nothing checks its recomputation: add `RecomputationMonitor` to the Trainer's"
        " callbacks."
    ]


def test_the_setup_line_of_a_monitored_fit_says_what_was_applied_and_one_module_in_the_singular(
    tmp_path: Path, lightning_info: pytest.LogCaptureFixture
) -> None:
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["model.blocks.1"]))
    _fit(tmp_path, StackModule(), strategy, max_steps=1, callbacks=[RecomputationMonitor()])
    said = [record.getMessage() for record in lightning_info.records if "applied to" in record.getMessage()]
    assert said == [
        "lightning_ckpt_determinism: activation checkpointing (non-reentrant) applied to 1 module (1 x DropoutBlock);"
        " every_n=1, save_ops=none."
    ]


class _EvaluatedStack(StackModule):
    """A :class:`StackModule` with a validation and a test loop over its training data."""

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val/loss", F.mse_loss(self.model(batch[0]), batch[1]))

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("test/loss", F.mse_loss(self.model(batch[0]), batch[1]))

    def val_dataloader(self) -> DataLoader:
        return self.train_dataloader()

    def test_dataloader(self) -> DataLoader:
        return self.train_dataloader()


def test_the_setup_line_is_said_once_across_fit_validate_and_test_of_one_trainer(
    tmp_path: Path, lightning_info: pytest.LogCaptureFixture
) -> None:
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["model.blocks.1"]))
    module = _EvaluatedStack()
    trainer = _fit(tmp_path, module, strategy, max_steps=1, callbacks=[RecomputationMonitor()])
    trainer.validate(module, verbose=False)
    trainer.test(module, verbose=False)
    said = [record.getMessage() for record in lightning_info.records if "applied to" in record.getMessage()]
    assert len(said) == 1

    # Each fit says what it applied, on the same Trainer too.
    trainer.fit(_EvaluatedStack())
    said = [record.getMessage() for record in lightning_info.records if "applied to" in record.getMessage()]
    assert len(said) == 2


@pytest.mark.parametrize("keep", [True, False])
def test_the_regions_that_route_are_named_once_after_the_first_batch_with_keep_data_dependent(
    keep: bool, tmp_path: Path, lightning_info: pytest.LogCaptureFixture
) -> None:
    # Two mixture-of-experts blocks, which run topk and nonzero, and the head, which runs neither.
    config = CheckpointingConfig(names=["blocks.*", "head"], keep_data_dependent=keep)
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=config)
    torch.manual_seed(0)
    _fit(tmp_path, MoEModule(blocks=2), strategy, max_steps=3, datamodule=SyntheticRegression(size=64))
    said = [
        record.getMessage() for record in lightning_info.records if "lightning_ckpt_determinism" in record.getMessage()
    ]
    assert said[0].startswith(
        "lightning_ckpt_determinism: activation checkpointing (non-reentrant) applied to 3 modules (2 x MoEBlock,"
        " 1 x Linear); every_n=1, save_ops=none."
    )
    routing = [
        "lightning_ckpt_determinism: keep_data_dependent keeps the outputs of the data-dependent ops (topk, sort,"
        " argmax, nonzero, bincount, item ...) that 2 regions ran in the first batch (blocks.0, blocks.1) and serves"
        " them to their recomputation, so that it routes as the forward did; floating outputs are kept up to the size"
        " of the region's largest input."
    ]
    # Without the guard nothing is kept, and nothing is said.
    assert said[1:] == (routing if keep else [])


def test_strategy_names_are_relative_to_the_lightning_module(tmp_path: Path) -> None:
    recorder = CheckpointedModulesRecorder()
    config = CheckpointingConfig(names=["model.blocks.*"], every_n=2)
    _fit(tmp_path, StackModule(), SingleDeviceCheckpointingStrategy(checkpointing=config), callbacks=[recorder])
    assert recorder.seen == [["model.blocks.1"]] * 4


def test_strategy_can_fit_twice_and_unwraps_after_each(tmp_path: Path) -> None:
    recorder = CheckpointedModulesRecorder()
    module = StackModule()
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CONFIG)
    _fit(tmp_path, module, strategy, callbacks=[recorder], max_steps=2)
    assert checkpointed_modules(module) == {}
    _fit(tmp_path, module, SingleDeviceCheckpointingStrategy(checkpointing=CONFIG), callbacks=[recorder], max_steps=2)
    assert recorder.seen == [BLOCKS] * 4
    assert checkpointed_modules(module) == {}


def test_model_already_checkpointed_by_the_user_is_left_alone(tmp_path: Path) -> None:
    recorder = CheckpointedModulesRecorder()
    module = StackModule()
    apply_activation_checkpointing(module, CheckpointingConfig(names=["model.blocks.0"]))
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CONFIG)
    with pytest.warns(
        LightningCkptDeterminismWarning,
        match=r"1 module of StackModule is already checkpointed \(1 x DropoutBlock\);"
        r" `SingleDeviceCheckpointingStrategy` leaves them as they are and applies nothing",
    ):
        _fit(tmp_path, module, strategy, callbacks=[recorder])
    assert recorder.seen == [["model.blocks.0"]] * 4
    # Teardown removes only what the strategy applied; the user's checkpointing stays.
    assert list(checkpointed_modules(module)) == ["model.blocks.0"]


def test_a_memory_budget_over_a_model_checkpointed_by_the_user_is_said_to_be_left_unapplied(tmp_path: Path) -> None:
    recorder = CheckpointedModulesRecorder()
    module = StackModule()
    apply_activation_checkpointing(module, CheckpointingConfig(names=["model.blocks.0"]))
    config = CheckpointingConfig(names=["model.blocks.*"], memory_budget=0.5)
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=config)
    with pytest.warns(
        LightningCkptDeterminismWarning,
        match=r"leaves them as they are and applies nothing, nor its `memory_budget` \(0\.5\)\.",
    ):
        _fit(tmp_path, module, strategy, callbacks=[recorder])
    # The user's checkpointing runs every step, untouched by a plan, and no plan is claimed.
    assert recorder.seen == [["model.blocks.0"]] * 4
    assert strategy.checkpointing_plan is None


def test_entry_matching_nothing_warns_at_setup_and_the_rest_applies(tmp_path: Path) -> None:
    recorder = CheckpointedModulesRecorder()
    config = CheckpointingConfig(classes=["DropoutBlock", "Block"])
    with pytest.warns(LightningCkptDeterminismWarning, match=r"entries \['Block'\] match no module of StackModule"):
        _fit(tmp_path, StackModule(), SingleDeviceCheckpointingStrategy(checkpointing=config), callbacks=[recorder])
    assert recorder.seen == [BLOCKS] * 4


def test_config_matching_nothing_fails_at_setup_before_any_step(tmp_path: Path) -> None:
    recorder = CheckpointedModulesRecorder()
    module = StackModule()
    initial = _weights(module)
    config = CheckpointingConfig(classes=["Block"], names=["blocks.*"])
    trainer = pl.Trainer(
        **trainer_kwargs(
            tmp_path, strategy=SingleDeviceCheckpointingStrategy(checkpointing=config), callbacks=[recorder]
        )
    )
    message = (
        r"matches no module of StackModule: classes=\['Block'\], names=\['blocks\.\*'\]\."
        r" Did you mean 'model\.blocks\.\*' for 'blocks\.\*'\? The model's module classes"
        r" are \['Dropout', 'DropoutBlock', 'Linear', 'ModuleList', 'Stack', 'StackModule'\]; its module names include"
        r" \['model', 'model\.inp', 'model\.blocks', .*\]\. Names are relative to the module the config is applied to"
    )
    with pytest.raises(ValueError, match=message):
        trainer.fit(module)
    assert recorder.seen == []
    assert trainer.global_step == 0
    assert checkpointed_modules(module) == {}
    assert _unequal(initial, _weights(module)) == []


# Lightning checkpoints.


def test_lightning_checkpoint_saved_with_checkpointing_loads_strictly_without(tmp_path: Path) -> None:
    recorder = CheckpointedModulesRecorder()
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpts", filename="{step}", every_n_train_steps=4, save_top_k=-1)
    module = StackModule()
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CONFIG)
    _fit(tmp_path, module, strategy, callbacks=[recorder, saver], enable_checkpointing=True)
    path = tmp_path / "ckpts" / "step=4.ckpt"
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    assert recorder.saved == [BLOCKS]

    loaded = StackModule.load_from_checkpoint(path, strict=True)
    assert checkpointed_modules(loaded) == {}
    assert _unequal(_weights(module), _weights(loaded)) == []
    assert list(torch.load(path, weights_only=True)["state_dict"]) == list(StackModule().state_dict())


def test_lightning_checkpoint_saved_without_checkpointing_loads_strictly_into_a_checkpointed_model(
    tmp_path: Path,
) -> None:
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpts", filename="plain", every_n_train_steps=4, save_top_k=-1)
    module = StackModule()
    _fit(tmp_path, module, callbacks=[saver], enable_checkpointing=True)

    target = StackModule(n=3)
    apply_activation_checkpointing(target, CONFIG)
    state = torch.load(tmp_path / "ckpts" / "plain.ckpt", weights_only=True)["state_dict"]
    loaded = target.load_state_dict(state, strict=True)
    assert (loaded.missing_keys, loaded.unexpected_keys) == ([], [])
    assert list(checkpointed_modules(target)) == BLOCKS
    assert _unequal(_weights(module), _weights(target)) == []


# Constructors.


@pytest.mark.parametrize(
    "strategy", [SingleDeviceCheckpointingStrategy, DDPCheckpointingStrategy, FSDPCheckpointingStrategy]
)
def test_strategy_needs_a_checkpointing_config(strategy: type) -> None:
    with pytest.raises(TypeError, match=r"`checkpointing` must be a `CheckpointingConfig`, got dict\. Build one with"):
        strategy(checkpointing={"classes": ["Block"]})


def test_a_device_given_first_is_told_that_checkpointing_comes_first() -> None:
    with pytest.raises(TypeError) as single:
        SingleDeviceCheckpointingStrategy("cpu")  # type: ignore[arg-type]
    assert str(single.value) == (
        "`checkpointing` must be a `CheckpointingConfig`, got str. 'cpu' reads as a device, and `checkpointing` comes"
        " first: pass the device by name, `SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(...),"
        " device='cpu')`."
    )
    with pytest.raises(TypeError) as ddp:
        DDPCheckpointingStrategy(torch.device("cpu"))  # type: ignore[arg-type]
    assert str(ddp.value) == (
        "`checkpointing` must be a `CheckpointingConfig`, got device. 'cpu' reads as a device: give devices to the"
        " Trainer (`accelerator`, `devices`)."
    )
    with pytest.raises(TypeError, match=r"got str\. Build one with"):
        SingleDeviceCheckpointingStrategy("Block")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "own", [{"activation_checkpointing_policy": {nn.Linear}}, {"activation_checkpointing": nn.Linear}]
)
def test_fsdp_strategy_rejects_fsdps_own_checkpointing(own: dict[str, object]) -> None:
    name = next(iter(own))
    with pytest.raises(
        ValueError, match=rf"`{name}` is FSDP's own activation checkpointing; `FSDPCheckpointingStrategy`"
    ):
        FSDPCheckpointingStrategy(checkpointing=CONFIG, **own)


def test_fsdp_strategy_on_cpu_is_refused_in_one_line_that_names_the_cpu_strategy(tmp_path: Path) -> None:
    module = StackModule()
    initial = _weights(module)
    strategy = FSDPCheckpointingStrategy(checkpointing=CONFIG)
    refused = (
        r"^`FSDPCheckpointingStrategy` needs a CUDA accelerator \(Lightning's FSDP shards on GPUs only\), got CPU;"
        r" shard on CPU with `ModelParallelCheckpointingStrategy\(data_parallel_size=N, .*`fully_shard`"
    )
    with pytest.raises(CheckpointingConfigError, match=refused):
        _fit(tmp_path, module, strategy, accelerator="cpu", devices=1)
    assert _unequal(initial, _weights(module)) == []
    assert checkpointed_modules(module) == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Lightning's FSDP needs a CUDA device")
def test_fsdp_strategy_trains_checkpointed_on_one_gpu(tmp_path: Path) -> None:
    recorder = CheckpointedModulesRecorder()
    module = StackModule()
    initial = _weights(module)
    strategy = FSDPCheckpointingStrategy(checkpointing=CONFIG)
    trainer = _fit(tmp_path, module, strategy, accelerator="cuda", devices=1, callbacks=[recorder])
    assert trainer.global_step == 4
    assert recorder.seen == [BLOCKS] * 4
    assert checkpointed_modules(module) == {}
    final = {name: tensor.cpu() for name, tensor in _weights(module).items()}
    assert all(torch.isfinite(tensor).all() for tensor in final.values())
    assert _unequal(initial, final) != []


# DDP: two CPU processes.


@pytest.mark.slow
def test_ddp_strategy_trains_checkpointed_on_two_processes_and_equals_unchecked_ddp(tmp_path: Path) -> None:
    # A clean launch: no rank, world or seed left in the environment by this process or its own launcher.
    launch_vars = {"LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED"}
    env = {key: value for key, value in child_env().items() if key not in launch_vars}
    outputs = [tmp_path / f"rank{rank}.json" for rank in (0, 1)]
    run_launcher([sys.executable, str(DDP_SCRIPT), str(tmp_path)], outputs, timeout=180, env=env)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]

    for rank, result in enumerate(ranks):
        checkpointed, unchecked = result["checkpointed"], result["unchecked"]
        assert checkpointed["rank"] == rank
        assert checkpointed["global_step"] == unchecked["global_step"] == 4
        assert checkpointed["seen"] == [BLOCKS] * 4
        assert unchecked["seen"] == [[]] * 4
        assert checkpointed["wrapped_after_fit"] == []
        assert math.isfinite(checkpointed["loss"])
        assert checkpointed["loss"] == unchecked["loss"]
        assert checkpointed["final"] != checkpointed["initial"]
        assert checkpointed["final"] == unchecked["final"]
    # Different batches on each rank, yet the averaged gradients leave both with the same weights.
    assert ranks[0]["checkpointed"]["loss"] != ranks[1]["checkpointed"]["loss"]
    assert ranks[0]["checkpointed"]["final"] == ranks[1]["checkpointed"]["final"]


class ConfiguredStackModule(StackModule):
    def configure_model(self) -> None:
        """ModelParallelStrategy requires the hook; this model needs no parallelism applied."""


def test_mixin_applies_on_a_strategy_that_never_calls_setup_model(tmp_path):
    recorder = CheckpointedModulesRecorder()
    strategy = ModelParallelCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=["DropoutBlock"]))
    _fit(tmp_path, ConfiguredStackModule(), strategy, max_steps=2, callbacks=[recorder])
    assert recorder.seen == [["model.blocks.0", "model.blocks.1", "model.blocks.2"]] * 2


def test_mixin_rejects_a_config_matching_nothing_on_a_strategy_that_never_calls_setup_model(tmp_path):
    recorder = CheckpointedModulesRecorder()
    strategy = ModelParallelCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=["NoSuchClass"]))
    with pytest.raises(ValueError, match="`CheckpointingConfig` matches no module of ConfiguredStackModule"):
        _fit(tmp_path, ConfiguredStackModule(), strategy, max_steps=2, callbacks=[recorder])
    assert recorder.seen == []


class _FakeGPUAccelerator(CPUAccelerator):
    """An accelerator that chooses ``cuda:<index>`` for the Trainer's ``devices``, constructible on a CPU machine."""

    @staticmethod
    def parse_devices(devices: object) -> list[int]:
        return list(range(devices)) if isinstance(devices, int) else list(devices)  # type: ignore[call-overload]

    @staticmethod
    def get_parallel_devices(devices: list[int]) -> list[torch.device]:
        return [torch.device("cuda", index) for index in devices]


@pytest.mark.parametrize(("devices", "expected"), [(1, "cuda:0"), ([3], "cuda:3")])
def test_the_single_device_strategy_follows_the_trainers_accelerator_and_devices(
    tmp_path: Path, devices: object, expected: str
) -> None:
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=["PlainBlock"]))
    trainer = pl.Trainer(
        **trainer_kwargs(tmp_path, accelerator=_FakeGPUAccelerator(), devices=devices, strategy=strategy)
    )
    assert trainer.strategy is strategy and strategy.root_device == torch.device(expected)
    # On the CPU, and with a device given, as Lightning's own SingleDeviceStrategy.
    cpu = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=["PlainBlock"]))
    pl.Trainer(**trainer_kwargs(tmp_path, strategy=cpu))
    assert cpu.root_device == SingleDeviceStrategy(device="cpu").root_device
    given = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=["PlainBlock"]), device="cpu")
    pl.Trainer(**trainer_kwargs(tmp_path, accelerator="auto", strategy=given))
    assert given.root_device == torch.device("cpu")
    # "cuda" alone gets the index that `torch.cuda.set_device` needs when Lightning sets the device up.
    bare = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=["PlainBlock"]), device="cuda")
    assert bare.root_device == torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_initialized() else 0)
    assert bare.root_device.index is not None
    contradicted = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=["X"]), device="cpu")
    with pytest.raises(MisconfigurationException, match="CPU parallel_devices set through SingleDeviceCheckpointing"):
        pl.Trainer(**trainer_kwargs(tmp_path, accelerator="gpu", strategy=contradicted))


def test_the_single_device_strategy_from_yaml_without_a_device_follows_the_accelerator(tmp_path: Path) -> None:
    from lightning_ckpt_determinism import CheckpointingCLI

    config = tmp_path / "run.yaml"
    config.write_text(
        "trainer:\n  accelerator:\n    class_path: tests.test_strategies._FakeGPUAccelerator\n  devices: [2]\n"
        "  logger: false\n  enable_checkpointing: false\n"
        "  strategy:\n    class_path: lightning_ckpt_determinism.SingleDeviceCheckpointingStrategy\n"
        "    init_args:\n      checkpointing:\n        classes: [PlainBlock]\n"
        "model:\n  class_path: tests.helpers.StackModule\n  init_args:\n    block: PlainBlock\n"
    )
    cli = CheckpointingCLI(args=["--config", str(config)], run=False)
    assert cli.trainer.strategy.root_device == torch.device("cuda", 2)
