"""Tests for `memory_budget` under the strategies: measured in the first batch, planned and applied from the second."""

import json
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import BatchSizeFinder
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util
from torch._dynamo.testing import CompileCounterWithBackend
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckpt_determinism import (
    CheckpointingConfig,
    CheckpointingConfigError,
    LightningCkptDeterminismWarning,
    RecomputationMonitor,
    SingleDeviceCheckpointingStrategy,
    checkpointed_modules,
    plan_activation_checkpointing,
)
from lightning_ckpt_determinism.checkpointing.budget_plan import plan_from_figures
from lightning_ckpt_determinism.checkpointing.measure import RegionFigures
from lightning_ckpt_determinism.lightning.fit_budget import PLAN_TAG, auto_budget, log_plan_text
from tests.helpers import REPO, launch_ranks, trainer_kwargs
from tests.test_budget import CONFIG, DIM, ROWS, _mixed


class MixedModule(pl.LightningModule):
    """Regresses with the heterogeneous blocks of `test_budget`; records which blocks each step checkpointed."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _mixed()
        self.checkpointed: list[list[str]] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.checkpointed.append([name.removeprefix("model.") for name in checkpointed_modules(self)])
        x, y = batch
        return F.mse_loss(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(3)
        x = torch.randn(4 * ROWS, DIM, generator=generator)
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=ROWS)


def _fit(tmp_path: Path, strategy: object = "auto", **overrides: object) -> tuple[pl.Trainer, MixedModule]:
    pl.seed_everything(0)
    module = MixedModule()
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, strategy=strategy, **overrides))  # type: ignore[arg-type]
    trainer.fit(module)
    return trainer, module


def _strategy(budget: object) -> SingleDeviceCheckpointingStrategy:
    config = CheckpointingConfig(names=["model.blocks.*"], memory_budget=budget)  # type: ignore[arg-type]
    return SingleDeviceCheckpointingStrategy(checkpointing=config)


def test_a_fit_with_a_budget_checkpoints_the_plan_from_the_second_step_bit_identical_to_a_plain_fit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    strategy = _strategy(0.6)
    assert strategy.checkpointing_plan is None
    _, module = _fit(tmp_path, strategy)
    plan = strategy.checkpointing_plan
    assert plan is not None
    every = [f"blocks.{index}" for index in range(6)]
    planned = [name.removeprefix("model.") for name in plan.checkpointed]
    assert 0 < len(planned) < 6
    assert module.checkpointed == [every] + [planned] * 3
    # The plan is what planning in plain PyTorch gives for the first batch.
    twin = _mixed()
    x, y = next(iter(module.train_dataloader()))
    expected = plan_activation_checkpointing(
        twin, CheckpointingConfig(**CONFIG, memory_budget=0.6), lambda: F.mse_loss(twin(x), y).backward()
    )
    assert planned == expected.checkpointed
    assert [entry.flops for entry in plan.candidates] == [entry.flops for entry in expected.candidates]
    assert plan.kept_bytes == expected.kept_bytes
    assert f"lightning_ckpt_determinism: {plan.summary()}." in caplog.text
    # The setup line, before the plan, says the 6 checkpointed are for the measurement and a plan is to come.
    (setup,) = {r.getMessage() for r in caplog.records if "activation checkpointing (non-reentrant)" in r.getMessage()}
    assert "applied to 6 modules" in setup
    assert setup.endswith(
        "The memory_budget's plan is pending: the first batch measures these 6 checkpointed, and from the second the"
        " plan keeps some of them plain (its own line says which). Nothing checks its recomputation: add"
        " `RecomputationMonitor` to the Trainer's callbacks."
    )
    _, plain = _fit(tmp_path / "plain")
    for (name, weight), plain_weight in zip(module.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(weight, plain_weight), name
    # Teardown leaves the model as it was given.
    assert checkpointed_modules(module) == {}


def test_a_budget_that_keeps_every_module_plain_trains_with_the_monitor_which_says_once_it_has_nothing_to_check(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    strategy = _strategy(1.0)
    monitor = RecomputationMonitor(every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LightningCkptDeterminismWarning)
        _, module = _fit(tmp_path, strategy, callbacks=[monitor], logger=CSVLogger(tmp_path), log_every_n_steps=1)
    # Nor does the sentinel say it compared nothing: there is nothing checkpointed to compare.
    assert [str(w.message) for w in caught if "compared nothing" in str(w.message)] == []
    assert strategy.checkpointing_plan is not None
    assert strategy.checkpointing_plan.checkpointed == []
    assert module.checkpointed[1:] == [[]] * 3
    # The first step, every block checkpointed, is checked and clean; the others have nothing to check.
    assert [(entry.step, entry.grad_divergence) for entry in monitor.history] == [(0, 0.0)]
    assert monitor.sentinel_report is not None and monitor.sentinel_report.mismatches == 0
    said = "RecomputationMonitor has nothing to check."
    assert [record.getMessage().endswith(said) for record in caplog.records].count(True) == 1


def test_the_monitor_stays_clean_under_a_plan_and_its_summary_names_the_plan(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    strategy = _strategy(0.6)
    monitor = RecomputationMonitor(every_n_steps=1)
    _fit(tmp_path, strategy, callbacks=[monitor])
    assert [entry.grad_divergence for entry in monitor.history] == [0.0] * 4
    report = monitor.sentinel_report
    assert report is not None
    assert report.mismatches == 0 < report.compared
    assert strategy.checkpointing_plan is not None
    summary = [record.getMessage() for record in caplog.records if "RecomputationMonitor ran" in record.getMessage()]
    assert len(summary) == 1 and summary[0].endswith(f" It trained under a {strategy.checkpointing_plan.summary()}.")


@pytest.mark.parametrize("granularity", ["module", "op"])
def test_a_monitor_rerunning_the_measured_step_leaves_the_plan_as_without_it(tmp_path: Path, granularity: str) -> None:
    # `attribution="always"` reruns the first step checkpointed (its two-pass check) inside the measured batch: those
    # forwards must not count, or the regions would look twice their size.
    plans = []
    for monitor in (None, RecomputationMonitor(every_n_steps=1, attribution="always")):
        config = CheckpointingConfig(names=["model.blocks.*"], memory_budget=0.6, budget_granularity=granularity)  # type: ignore[arg-type]
        strategy = SingleDeviceCheckpointingStrategy(checkpointing=config)
        _fit(tmp_path / str(monitor is None), strategy, callbacks=[] if monitor is None else [monitor])
        plans.append(strategy.checkpointing_plan)
    without, monitored = plans
    assert without is not None and monitored is not None
    assert str(monitored) == str(without)
    assert (monitored.checkpointed, monitored.saved_ops) == (without.checkpointed, without.saved_ops)


class SizedModule(MixedModule):
    """``MixedModule`` with the ``batch_size`` attribute Lightning's ``BatchSizeFinder`` scales."""

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(3)
        x = torch.randn(4 * ROWS, DIM, generator=generator)
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=self.batch_size)


def _sized_fit(tmp_path: Path, budget: object, batch_size: int, *callbacks: pl.Callback) -> SizedModule:
    pl.seed_everything(0)
    module = SizedModule(batch_size)
    strategy = _strategy(budget)
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, strategy=strategy, callbacks=[RecomputationMonitor(), *callbacks]))
    trainer.fit(module)
    assert strategy.checkpointing_plan is not None
    module.plan = strategy.checkpointing_plan.checkpointed  # type: ignore[assignment]
    return module


@pytest.mark.parametrize("budget", ["20KiB", 1.0])
def test_a_batch_size_finders_trials_are_not_what_the_budget_plans_from(tmp_path: Path, budget: object) -> None:
    # The finder's trial batches (from size 4 up) run inside the fit before the monitor's `on_fit_start`; it then
    # restores the model, and the fit trains at the size it found (8 or 16, by Lightning's version). Each trial
    # measures at its own size and plans at its second batch, so a trial's batch is never larger than its plan's.
    finder = BatchSizeFinder(mode="power", steps_per_trial=2, init_val=4, max_trials=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LightningCkptDeterminismWarning)
        found = _sized_fit(tmp_path / "finder", budget, 4, finder)
    assert found.batch_size > 4
    assert [str(w.message) for w in caught if "batch holds" in str(w.message)] == []
    at_found, at_four = (_sized_fit(tmp_path / str(size), budget, size) for size in (found.batch_size, 4))
    assert found.plan == at_found.plan  # type: ignore[attr-defined]
    if budget == "20KiB":
        assert at_four.plan != at_found.plan  # type: ignore[attr-defined]
    # The fit's own four steps: the first measured with every candidate checkpointed, then the plan.
    planned = [name.removeprefix("model.") for name in found.plan]  # type: ignore[attr-defined]
    assert found.checkpointed[-4:] == [[f"blocks.{index}" for index in range(6)]] + [planned] * 3


def test_auto_off_cuda_is_a_one_line_error_at_setup(tmp_path: Path) -> None:
    with pytest.raises(
        CheckpointingConfigError, match=r"^`memory_budget`='auto' needs a CUDA device, the model is on cpu; give bytes"
    ):
        _fit(tmp_path, _strategy("auto"))


def test_a_fit_at_op_granularity_keeps_the_plans_op_outputs_and_trains_bit_identical_to_a_plain_fit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = CheckpointingConfig(names=["model.blocks.*"], memory_budget=0.8, budget_granularity="op")
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=config)
    monitor = RecomputationMonitor(every_n_steps=1)
    _, module = _fit(tmp_path, strategy, callbacks=[monitor])
    plan = strategy.checkpointing_plan
    assert plan is not None
    assert any(plan.saved_ops.values())
    assert set(plan.saved_ops) == set(plan.checkpointed)
    # The plan is what planning in plain PyTorch gives for the first batch.
    twin = _mixed()
    x, y = next(iter(module.train_dataloader()))
    expected = plan_activation_checkpointing(
        twin,
        CheckpointingConfig(**CONFIG, memory_budget=0.8, budget_granularity="op"),
        lambda: F.mse_loss(twin(x), y).backward(),
    )
    assert {name.removeprefix("model."): calls for name, calls in plan.saved_ops.items()} == expected.saved_ops
    assert plan.kept_bytes == expected.kept_bytes <= plan.budget_bytes
    assert f"lightning_ckpt_determinism: {plan.summary()}." in caplog.text
    assert [entry.grad_divergence for entry in monitor.history] == [0.0] * 4
    report = monitor.sentinel_report
    assert report is not None
    assert report.mismatches == 0 < report.compared
    _, plain = _fit(tmp_path / "plain")
    for (name, weight), plain_weight in zip(module.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(weight, plain_weight), name
    assert checkpointed_modules(module) == {}


@pytest.fixture(scope="module")
def distributed(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("budget")
    launch_ranks(REPO / "tests" / "distributed_budget_script.py", str(out_dir), timeout=300)
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_ranks_with_batches_of_their_own_size_apply_one_plan_from_the_largest_figures(
    distributed: list[dict[str, Any]], kind: str
) -> None:
    ranks = [found[kind] for found in distributed]
    assert ranks[0]["checkpointed"] == ranks[1]["checkpointed"]
    assert ranks[0]["figures"] == ranks[1]["figures"]
    # Rank 1's batches are larger: its figures are the maximum (FSDP2's gathered parameters are not counted as
    # activations), rank 0's own are smaller.
    assert ranks[0]["figures"] == ranks[1]["own_figures"] != ranks[0]["own_figures"]
    planned = [name.removeprefix("model.") for name in ranks[0]["checkpointed"]]
    assert 0 < len(planned) < 6
    for rank in ranks:
        assert rank["steps"] == [[f"blocks.{index}" for index in range(6)], planned, planned]


@pytest.mark.slow
def test_ddp_ranks_at_op_granularity_plan_alike_from_the_largest_op_figures(distributed: list[dict[str, Any]]) -> None:
    ranks = [found["ddp_op"] for found in distributed]
    assert ranks[0]["saved_ops"] == ranks[1]["saved_ops"]
    assert ranks[0]["op_figures"] == ranks[1]["op_figures"]
    # Rank 1's batches are larger: every op's figures are its, rank 0's own are smaller.
    assert ranks[0]["op_figures"] == ranks[1]["own_op_figures"] != ranks[0]["own_op_figures"]
    assert all(entry for entry in ranks[0]["op_figures"])
    planned = [name.removeprefix("model.") for name in ranks[0]["checkpointed"]]
    for rank in ranks:
        assert rank["steps"][1:] == [planned, planned]


@pytest.mark.slow
def test_an_op_plan_of_a_region_holding_fsdp2_units_applies_at_every_step(distributed: list[dict[str, Any]]) -> None:
    # The units gather their parameters inside the region, in FSDP2's own scopes: counted neither by the meter nor
    # by the plan's positions, which otherwise differ from the measured call at every step (every kept output is then
    # recomputed, with a warning).
    ranks = [found["fsdp2_stage_op"] for found in distributed]
    assert ranks[0]["saved_ops"] == ranks[1]["saved_ops"]
    assert any(ranks[0]["saved_ops"].values())
    for rank in ranks:
        assert not [message for message in rank["warnings"] if "as its op call" in message]


@pytest.mark.slow
def test_fsdp2_ranks_at_op_granularity_keep_one_plans_op_outputs_and_train_bit_identical_to_a_plain_twin(
    distributed: list[dict[str, Any]],
) -> None:
    ranks = [found["fsdp2_op"] for found in distributed]
    assert ranks[0]["saved_ops"] == ranks[1]["saved_ops"]
    assert any(ranks[0]["saved_ops"].values())
    assert ranks[0]["op_figures"] == ranks[1]["op_figures"] == ranks[1]["own_op_figures"] != ranks[0]["own_op_figures"]
    planned = [name.removeprefix("model.") for name in ranks[0]["checkpointed"]]
    for rank in ranks:
        assert all(rank["sharded"])
        assert rank["steps"] == [[f"blocks.{index}" for index in range(6)], planned, planned]
        # The sharded backward recomputes the addmm calls the plan recomputes in plain PyTorch on one process: fewer
        # than the same regions keeping no op outputs.
        every, under_plan, keeping_nothing = rank["plain_pytorch_addmm"]
        assert rank["recomputed_addmm"] == [every, under_plan, under_plan]
        assert under_plan < keeping_nothing
        assert not [message for message in rank["warnings"] if "budget_granularity" in message]
        assert rank["grad_divergence"] == [0.0] * 3
        mismatches, compared = rank["sentinel"]
        assert mismatches == 0 < compared
        # Each local shard equals a plain twin's (same seed, no checkpointing, no monitor).
        assert rank["differing"] == []


@pytest.mark.slow
def test_tensor_parallel_ranks_measure_their_shards_and_apply_one_plan(distributed: list[dict[str, Any]]) -> None:
    ranks = [found["tp"] for found in distributed]
    assert ranks[0] == ranks[1]
    planned = [name.removeprefix("model.") for name in ranks[0]["checkpointed"]]
    assert 0 < len(planned) < 3
    # Each rank keeps its shard of every block's hidden layer: less than the same blocks unsharded keep. The FLOP
    # counter counts a DTensor op's logical FLOPs, so they equal the unsharded blocks'.
    sharded, unsharded = ranks[0]["figures"], ranks[0]["unsharded_figures"]
    assert all(a[0] < b[0] and a[2] == b[2] for a, b in zip(sharded, unsharded, strict=True))


class CompiledMixedModule(MixedModule):
    """`MixedModule` whose forward is compiled; records how many frames the compiler had compiled at each step."""

    def __init__(self) -> None:
        super().__init__()
        self.counter = CompileCounterWithBackend("aot_eager")
        self.frames: list[int] = []
        self._compiled = torch.compile(lambda x: self.model(x), backend=self.counter)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.frames.append(self.counter.frame_count)
        self.checkpointed.append([name.removeprefix("model.") for name in checkpointed_modules(self)])
        x, y = batch
        return F.mse_loss(self._compiled(x), y)


def test_a_compiled_model_is_measured_eagerly_and_compiles_once_with_the_plan(tmp_path: Path) -> None:
    torch._dynamo.reset()
    pl.seed_everything(0)
    module = CompiledMixedModule()
    strategy = _strategy(0.6)
    pl.Trainer(**trainer_kwargs(tmp_path, strategy=strategy)).fit(module)  # type: ignore[arg-type]
    plan = strategy.checkpointing_plan
    assert plan is not None
    # The measured batch ran uncompiled, and measured what eager planning measures; the plan compiled once, at the
    # second batch, and nothing recompiled after.
    assert module.frames[:2] == [0, 0]
    compiled_once = module.frames[2]
    assert compiled_once > 0 and module.frames[3] == module.counter.frame_count == compiled_once
    twin = _mixed()
    x, y = next(iter(module.train_dataloader()))
    expected = plan_activation_checkpointing(
        twin, CheckpointingConfig(**CONFIG, memory_budget=0.6), lambda: F.mse_loss(twin(x), y).backward()
    )
    assert plan.checkpointed == [f"model.{name}" for name in expected.checkpointed]
    assert plan.kept_bytes == expected.kept_bytes
    # A compiled fit that checkpoints the plan from its start compiles as many frames.
    torch._dynamo.reset()
    pl.seed_everything(0)
    direct = CompiledMixedModule()
    names = [name.removeprefix("model.") for name in plan.checkpointed]
    fixed = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=[f"model.{n}" for n in names]))
    pl.Trainer(**trainer_kwargs(tmp_path / "direct", strategy=fixed)).fit(direct)  # type: ignore[arg-type]
    torch._dynamo.reset()
    assert direct.counter.frame_count == compiled_once


class CompiledInPlaceModule(CompiledMixedModule):
    """`CompiledMixedModule` whose model is compiled in place (``Module.compile``), as the strategy can see."""

    def __init__(self) -> None:
        super().__init__()
        self.model.compile(backend=self.counter)
        self._compiled = self.model


def test_a_compiled_model_at_op_granularity_checkpoints_its_regions_whole_with_one_note(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torch._dynamo.reset()
    pl.seed_everything(0)
    module = CompiledInPlaceModule()
    config = CheckpointingConfig(names=["model.blocks.*"], memory_budget=0.8, budget_granularity="op")
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=config)
    pl.Trainer(**trainer_kwargs(tmp_path, strategy=strategy)).fit(module)  # type: ignore[arg-type]
    plan = strategy.checkpointing_plan
    assert plan is not None and any(plan.saved_ops.values())
    note = "compiled regions keep none of the planned op outputs"
    assert [note in record.getMessage() for record in caplog.records].count(True) == 1
    compiled_once = module.frames[2]
    assert compiled_once > 0 and module.frames[3] == compiled_once
    # As many frames as a compiled fit that checkpoints the plan's modules whole from its start: the same graphs.
    torch._dynamo.reset()
    pl.seed_everything(0)
    direct = CompiledInPlaceModule()
    fixed = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=list(plan.checkpointed)))
    pl.Trainer(**trainer_kwargs(tmp_path / "direct", strategy=fixed)).fit(direct)  # type: ignore[arg-type]
    torch._dynamo.reset()
    assert direct.counter.frame_count == compiled_once


class GrowingBatchesModule(MixedModule):
    """`MixedModule` whose third and fourth batches are twice as large as the measured first one."""

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(3)
        batches = []
        for rows in (ROWS, ROWS, 2 * ROWS, 2 * ROWS):
            x = torch.randn(rows, DIM, generator=generator)
            batches.append((x, x.sum(dim=1, keepdim=True)))
        return DataLoader(batches, batch_size=None)


def test_a_batch_larger_than_the_measured_one_is_said_once(tmp_path: Path) -> None:
    strategy = _strategy(0.6)
    with pytest.warns(LightningCkptDeterminismWarning, match="more than 110% of the") as caught:
        pl.Trainer(**trainer_kwargs(tmp_path, strategy=strategy)).fit(GrowingBatchesModule())  # type: ignore[arg-type]
    measured = ROWS * DIM * 4 + ROWS * 4
    said = [str(warning.message) for warning in caught if "was measured on" in str(warning.message)]
    assert len(said) == 1
    assert f"holds {2 * measured} bytes of tensors, more than 110% of the {measured} bytes" in said[0]


def test_auto_is_the_figures_free_memory_leaves_and_plans_like_the_same_budget_in_bytes() -> None:
    figures = [RegionFigures(f"model.blocks.{index}", 400, 100, 10, 1) for index in range(3)]
    # 2000 free bytes, 25 % left unused: 1500; the measured step needed 900 - 300 kept = 600 besides: 900 remain.
    assert auto_budget(free_bytes=2000, step_peak_bytes=900, figures=figures) == 900
    assert auto_budget(free_bytes=100, step_peak_bytes=900, figures=figures) == 0
    auto = plan_from_figures(figures, CheckpointingConfig(**CONFIG, memory_budget="auto"), auto_bytes=900)
    in_bytes = plan_from_figures(figures, CheckpointingConfig(**CONFIG, memory_budget=900))
    assert (auto.checkpointed, auto.budget_bytes) == (in_bytes.checkpointed, 900)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_on_a_roomy_cuda_device_keeps_every_block_plain_and_trains(tmp_path: Path) -> None:
    strategy = _strategy("auto")
    _, module = _fit(tmp_path, strategy, accelerator="cuda", devices=1)
    plan = strategy.checkpointing_plan
    assert plan is not None
    # A few KiB of activations against a GPU's free memory: nothing needs checkpointing.
    assert plan.budget_bytes > sum(entry.plain_bytes for entry in plan.candidates) > 0
    assert plan.checkpointed == [] and module.checkpointed[1:] == [[]] * 3
    assert all(torch.isfinite(param).all() for param in module.parameters())


class _NoText:
    """A logger whose experiment takes no text: left out without a word."""

    experiment = object()


def test_the_plan_is_logged_once_as_text_to_tensorboard_at_the_step_it_applies_from(tmp_path: Path) -> None:
    strategy = _strategy(0.6)
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    _fit(tmp_path, strategy, logger=[logger, CSVLogger(tmp_path / "csv")], log_every_n_steps=1)
    plan = strategy.checkpointing_plan
    assert plan is not None
    events = EventAccumulator(str(tmp_path / "run" / "version_0"), size_guidance={"tensors": 0})
    events.Reload()
    tags = [tag for tag in events.Tags()["tensors"] if tag.startswith(PLAN_TAG)]
    assert tags == [f"{PLAN_TAG}/text_summary"]
    (logged,) = events.Tensors(tags[0])
    # Planned when the second batch starts, after one optimizer step.
    assert logged.step == 1
    text = tensor_util.make_ndarray(logged.tensor_proto).item().decode()
    assert text.startswith("```\n") and text.endswith("\n```")
    assert text.removeprefix("```\n").removesuffix("\n```") == str(plan)
    assert log_plan_text([_NoText(), logger], plan) == [logger]
