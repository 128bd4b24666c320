"""What a user sees of the monitor: the summary at the fit's end, the metrics in `callback_metrics` and the progress
bar, `EarlyStopping` on them, a warning without a logger, and buffer mutations found at the default settings."""

import csv
import logging
import warnings
from pathlib import Path
from typing import ClassVar

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.loggers import CSVLogger

from lightning_ckpt_determinism import (
    CAUSE_HINTS,
    CheckpointingConfig,
    LightningCkptDeterminismWarning,
    RecomputationMonitor,
    SingleDeviceCheckpointingStrategy,
)
from tests.helpers import PlainBlock, StackModule, trained_state, trainer_kwargs


def fit(tmp_path: Path, monitor: RecomputationMonitor, *callbacks: pl.Callback, block: str = "DropoutBlock", **options):
    config = options.pop("config", {})
    pl.seed_everything(0, verbose=False)
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=[block], **config))
    kwargs = {"max_steps": 4, "logger": CSVLogger(tmp_path), "log_every_n_steps": 1, **options}
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, strategy=strategy, callbacks=[monitor, *callbacks], **kwargs))
    trainer.fit(StackModule(block=block))
    return trainer


@pytest.fixture
def lightning_info(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """Lightning's info lines, which reach ``caplog`` directly or only through its own logger."""
    logger = logging.getLogger("lightning.pytorch")
    if not logger.propagate:
        logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="lightning.pytorch")
    yield caplog
    logger.removeHandler(caplog.handler)


def summaries(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if "RecomputationMonitor ran" in record.getMessage()]


def test_a_clean_fit_ends_with_a_summary_of_what_was_checked(tmp_path: Path, lightning_info) -> None:
    fit(tmp_path, RecomputationMonitor(every_n_steps=2))
    (summary,) = summaries(lightning_info)
    assert summary.startswith(
        "lightning_ckpt_determinism: RecomputationMonitor ran 2 periodic checks this fit (the first step, then every 2"
        " steps): none diverged."
    )
    assert " The sentinel compared " in summary and summary.endswith(
        " recomputed saved tensors with the forward's: none differed."
    )


class CountsOnceArmed(PlainBlock):
    """Exact until ``armed``: then it scales by a count it keeps in a global, a code path its region had not taken,
    which its recomputation counts on."""

    armed = False
    count: ClassVar[list[int]] = [0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.linear(x)
        if self.armed:
            self.count[0] += 1
            hidden = hidden * (1 + 0.01 * self.count[0])
        return x + torch.tanh(hidden)


class ArmedAtOneMicroBatch(StackModule):
    """Arms its blocks for one micro-batch of the second step (of two, under `accumulate_grad_batches=2`), and for it
    alone: the second by default."""

    def __init__(self, batch_idx: int = 3) -> None:
        super().__init__(block="PlainBlock", n=2)
        self.model.blocks = torch.nn.ModuleList([CountsOnceArmed(), CountsOnceArmed()])
        self.armed_at = batch_idx

    def on_train_batch_start(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        for block in self.model.blocks:
            block.armed = batch_idx == self.armed_at


def _saved_by_one_armed_call() -> int:
    """How many activations one armed call saves for backward (its weights are not recomputed), counted by torch's
    own hooks without checkpointing."""
    block, packs = CountsOnceArmed(), []
    block.armed = True
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packs.append(t) or t, lambda t: t):
        block(torch.randn(2, 8, requires_grad=True))
    weights = {parameter.untyped_storage().data_ptr() for parameter in block.parameters()}
    return sum(saved.untyped_storage().data_ptr() not in weights for saved in packs)


# The first micro-batch is the one a check reruns: armed there, the step is left unchecked (checks at step 0 only).
@pytest.mark.parametrize(("max_steps", "armed_at", "every_n_steps"), [(2, 3, 1), (3, 3, 1), (2, 2, 100)])
def test_calls_down_a_first_taken_code_path_are_said_to_be_left_out_not_that_none_differed(
    tmp_path: Path, lightning_info, max_steps: int, armed_at: int, every_n_steps: int
) -> None:
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=["CountsOnceArmed"]))
    monitor = RecomputationMonitor(every_n_steps=every_n_steps, sentinel="exact")
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        **trainer_kwargs(
            tmp_path, strategy=strategy, callbacks=[monitor], max_steps=max_steps, accumulate_grad_batches=2
        )
    )
    trainer.fit(ArmedAtOneMicroBatch(armed_at))
    # Neither engine saw it: the path's one call is learned, and the check reruns the first micro-batch only.
    assert [entry.grad_divergence for entry in monitor.history] == [0.0] * len(range(0, max_steps, every_n_steps))
    (summary,) = summaries(lightning_info)
    left_out = 2 * _saved_by_one_armed_call()
    said = (
        f" It left out {left_out} saved tensors of calls down code paths their regions had not taken before: a path is"
        " compared from its second call on, and a check reruns a step's first micro-batch only."
    )
    # Taken at step 1 (by either micro-batch): where that is the fit's last step, no later step compared the path,
    # which the summary adds.
    last = (
        f" {left_out} of them were of the last step it watched, whose new paths no later step compared: a defect"
        " arriving with them would show only at a later step, which this fit did not run."
    )
    assert summary.endswith(said + last if max_steps == 2 else said)


class SkippingModule(StackModule):
    """Skips every batch: its ``training_step`` returns ``None``."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        super().training_step(batch, batch_idx)


def test_a_fit_that_checked_nothing_says_so_not_that_nothing_diverged(tmp_path: Path, lightning_info) -> None:
    pl.seed_everything(0, verbose=False)
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=["DropoutBlock"]))
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, strategy=strategy, callbacks=[RecomputationMonitor()]))
    trainer.fit(SkippingModule())
    (summary,) = summaries(lightning_info)
    assert summary == (
        "lightning_ckpt_determinism: RecomputationMonitor ran no gradient check this fit: no training step was"
        " checked, so nothing is proven about its recomputation. The sentinel compared no recomputed saved tensor."
    )


def test_a_diverging_fit_ends_with_the_worst_figure_its_step_and_each_cause(tmp_path: Path, lightning_info) -> None:
    monitor = RecomputationMonitor(every_n_steps=1, on_divergence="ignore")
    fit(tmp_path, monitor, config={"preserve_rng_state": False})
    (summary,) = summaries(lightning_info)
    worst = max(monitor.history, key=lambda entry: entry.grad_divergence)
    assert f"4 diverged, the worst grad_divergence {worst.grad_divergence:.3g} at step {worst.step}." in summary
    assert "Cause rng_not_preserved in model.blocks.0, model.blocks.1, model.blocks.2: A random op draws" in summary
    assert "recomputed saved tensors with the forward's: " in summary and " differed (model.blocks.0: " in summary


def test_the_metrics_reach_callback_metrics_as_tensors_and_the_progress_bar_when_asked(tmp_path: Path) -> None:
    plain = fit(tmp_path / "plain", RecomputationMonitor(every_n_steps=1))
    shown = fit(tmp_path / "shown", RecomputationMonitor(every_n_steps=1, prog_bar=True))
    for trainer in (plain, shown):
        metrics = trainer.callback_metrics
        assert isinstance(metrics["recompute/grad_divergence"], torch.Tensor)
        assert float(metrics["recompute/grad_divergence"]) == 0.0
        assert float(metrics["recompute/sentinel/mismatches"]) == 0.0
    assert "recompute/grad_divergence" not in plain.progress_bar_metrics
    assert shown.progress_bar_metrics["recompute/grad_divergence"] == 0.0
    # Written to the logger once per check, not twice.
    with open(tmp_path / "plain" / "lightning_logs" / "version_0" / "metrics.csv") as file:
        logged = [row["step"] for row in csv.DictReader(file) if row["recompute/grad_divergence"]]
    assert logged == ["0", "1", "2", "3"]


def test_early_stopping_monitors_the_divergence_at_every_epoch_end(tmp_path: Path) -> None:
    # Strict: the metric must be there at every train-epoch end, though only the first step of the fit is checked.
    clean = fit(
        tmp_path / "clean",
        RecomputationMonitor(every_n_steps=100),
        EarlyStopping(
            "recompute/grad_divergence", divergence_threshold=0.0, strict=True, check_on_train_epoch_end=True
        ),
        max_steps=24,
    )
    assert clean.global_step == 24 and not clean.should_stop
    broken = fit(
        tmp_path / "broken",
        RecomputationMonitor(every_n_steps=100, on_divergence="ignore"),
        EarlyStopping(
            "recompute/grad_divergence", divergence_threshold=0.0, strict=True, check_on_train_epoch_end=True
        ),
        max_steps=24,
        config={"preserve_rng_state": False},
    )
    assert broken.should_stop and broken.global_step == 8  # stopped at the end of the first epoch


def test_a_trainer_without_a_logger_is_warned(tmp_path: Path) -> None:
    with pytest.warns(LightningCkptDeterminismWarning, match=r"without a logger: its metrics go only to its `history`"):
        fit(tmp_path, RecomputationMonitor(every_n_steps=2), logger=False)


def test_buffers_updated_twice_are_caught_at_the_default_settings(tmp_path: Path) -> None:
    monitor = RecomputationMonitor()
    with (
        pytest.warns(LightningCkptDeterminismWarning, match=r"recomputation changed buffers at step 0: 9 buffers"),
        pytest.warns(
            LightningCkptDeterminismWarning,
            # One warning per region, each naming the region's own statistics.
            match=r"the sentinel saw region `model\.blocks\.(\d)` .* at step 0: 3 mismatches, first:"
            r" buffer `model\.blocks\.\1\.norm\.running_mean` changed by recomputation",
        ),
    ):
        fit(tmp_path, monitor, block="BatchNormBlock", config={"protect_buffers": False})
    # The check of step 0 names the buffers, so the sentinel's finding at that step asks for no further check.
    assert [(record.step, record.diverged) for record in monitor.history] == [(0, True)]
    report = monitor.last_report
    assert report is not None and report.grad_divergence == 0.0
    assert [region.cause for region in report.regions] == ["buffer_mutation"] * 3
    with open(tmp_path / "lightning_logs" / "version_0" / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row["recompute/buffer_mutations"]]
    assert [(row["step"], float(row["recompute/buffer_mutations"])) for row in rows] == [("0", 9.0)]


class MomentumSchedule(pl.Callback):
    """Where the step's backward is about to start, sets each block's BatchNorm momentum for the next step (a plain
    attribute its forward reads) and, with ``buffers``, moves its count of batches on (a buffer)."""

    def __init__(self, buffers: bool) -> None:
        self.buffers = buffers

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        for block in pl_module.model.blocks:
            block.norm.momentum = 0.1 + 0.05 * (trainer.global_step + 1)
            if self.buffers:
                block.norm.num_batches_tracked.add_(10)


def test_what_a_hook_writes_between_the_forward_and_the_backward_is_no_finding(tmp_path: Path) -> None:
    def trained(strategy: object, *callbacks: pl.Callback) -> dict[str, torch.Tensor]:
        pl.seed_everything(0, verbose=False)
        module = StackModule(block="BatchNormBlock")
        trainer = pl.Trainer(
            **trainer_kwargs(tmp_path, strategy=strategy, callbacks=[*callbacks, MomentumSchedule(True)])
        )
        trainer.fit(module)
        return trained_state(module, trainer)

    def checkpointing() -> SingleDeviceCheckpointingStrategy:
        return SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=["BatchNormBlock"]))

    monitor = RecomputationMonitor(every_n_steps=1, on_divergence="raise")
    plain, unmonitored, monitored = trained("auto"), trained(checkpointing()), trained(checkpointing(), monitor)
    assert [(record.step, record.diverged) for record in monitor.history] == [(step, False) for step in range(4)]
    assert monitor.last_report is not None
    assert monitor.last_report.buffer_mutations == monitor.last_report.attribute_mutations == []
    for state in (unmonitored, monitored):
        assert state.keys() == plain.keys() and all(torch.equal(state[key], plain[key]) for key in plain)


def test_a_buffer_recomputation_updates_again_is_named_beside_what_a_hook_writes(tmp_path: Path) -> None:
    monitor = RecomputationMonitor()
    with (
        pytest.warns(LightningCkptDeterminismWarning, match=r"recomputation changed buffers at step 0: 9 buffers"),
        pytest.warns(LightningCkptDeterminismWarning, match=r"the sentinel saw region `model\.blocks\.\d`"),
    ):
        fit(tmp_path, monitor, MomentumSchedule(False), block="BatchNormBlock", config={"protect_buffers": False})
    report = monitor.last_report
    assert report is not None and report.attribute_mutations == []
    assert [region.cause for region in report.regions] == ["buffer_mutation"] * 3


def test_a_forward_that_differs_before_any_recomputation_blames_state_outside_the_regions(tmp_path: Path) -> None:
    from examples.broken import BrokenModule, SyntheticRegression

    monitor = RecomputationMonitor(every_n_steps=100, sentinel="off")
    pl.seed_everything(0, verbose=False)
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=["Block"]))
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_steps=1, strategy=strategy, callbacks=[monitor]))
    with pytest.warns(LightningCkptDeterminismWarning, match="before anything was recomputed") as caught:
        trainer.fit(BrokenModule(defect="outside_state"), SyntheticRegression())
    report = monitor.last_report
    assert report is not None and report.diverged and report.cause == "outside_state"
    assert report.reference_loss != report.checkpointed_loss
    # Attribution reran the step: every region recomputed what its forward produced, and none is blamed.
    assert len(report.regions) == 4 and not any(region.diverged for region in report.regions)
    messages = [str(warning.message) for warning in caught if "recomputation diverged" in str(warning.message)]
    assert len(messages) == 1 and "Region `" not in messages[0]


def test_a_finding_held_back_asks_for_no_check_when_the_one_shown_was_checked_already(tmp_path: Path) -> None:
    # Dropout redrawn in recomputation, logged every 5 steps: one read holds the findings of steps 1-5. Step 4's
    # finding is the one shown (step 0's warned 4 steps before), and the periodic check of step 4 named its cause:
    # no follow-up check runs for the findings held back.
    monitor = RecomputationMonitor(every_n_steps=4)
    with pytest.warns(LightningCkptDeterminismWarning) as record:
        fit(tmp_path, monitor, max_steps=6, log_every_n_steps=5, config={"preserve_rng_state": False})
    messages = [
        str(warning.message) for warning in record if "the sentinel saw region `model.blocks.0`" in str(warning.message)
    ]
    assert [(entry.step, entry.diverged) for entry in monitor.history] == [(0, True), (4, True)]
    assert len(messages) == 2 and "at step 4:" in messages[1]
    assert messages[1].endswith("The check of that step names the cause (in `history` and the fit's summary).")


def test_the_sentinel_points_to_a_checks_warning_only_when_that_warning_was_shown(tmp_path: Path) -> None:
    # Dropout redrawn in recomputation: every step differs; the check at step 4 repeats step 0's finding and its
    # warning is held back (a finding warns again only `every_n_steps` checks later).
    monitor = RecomputationMonitor(every_n_steps=4)
    with pytest.warns(LightningCkptDeterminismWarning) as record:
        fit(tmp_path, monitor, max_steps=6, config={"preserve_rng_state": False})
    messages = [str(warning.message) for warning in record]
    checks = [message for message in messages if "recomputation diverged at step" in message]
    sentinel = {
        step: message
        for message in messages
        for step in (0, 4)
        if f"recompute other values than its forward at step {step}:" in message
    }
    assert [record.step for record in monitor.history if record.diverged] == [0, 4]
    assert len(checks) == 1 and "at step 0:" in checks[0]
    assert sentinel[0].endswith("The check of that step names the cause (see its warning).")
    assert sentinel[4].endswith("The check of that step names the cause (in `history` and the fit's summary).")


def test_a_cause_in_several_regions_is_summarised_with_every_regions_state(tmp_path: Path, lightning_info) -> None:
    monitor = RecomputationMonitor(every_n_steps=1, on_divergence="ignore")
    fit(tmp_path, monitor, block="BatchNormBlock", config={"protect_buffers": False})
    (summary,) = summaries(lightning_info)
    statistics = ("running_mean", "running_var", "num_batches_tracked")
    changed = ", ".join(f"model.blocks.{index}.norm.{name}" for index in range(3) for name in statistics)
    hint = CAUSE_HINTS["buffer_mutation"]
    assert (
        f"Cause buffer_mutation in model.blocks.0, model.blocks.1, model.blocks.2: {hint} Changed: {changed}."
        in summary
    )


class HookCounted(pl.Callback):
    """Moves a count the blocks read (through the module's `scale`) where the step's backward is about to start:
    their recomputation reads another scale than their forward did, which no rerun of the step reproduces."""

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        pl_module.model.scale[0] += 0.5


class ScaledBlock(PlainBlock):
    """Scales its activation by the first item of a list it holds by reference."""

    def __init__(self, scale: list[float]) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x) * self.scale[0])


class ScaledStack(StackModule):
    """Its blocks scaled by `model.scale[0]`, one list they share."""

    def __init__(self) -> None:
        super().__init__(block="PlainBlock")
        self.model.scale = [1.0]
        for index in range(len(self.model.blocks)):
            self.model.blocks[index] = ScaledBlock(self.model.scale)


def test_a_difference_a_hook_makes_is_named_as_one_that_changes_from_pass_to_pass(tmp_path: Path) -> None:
    monitor = RecomputationMonitor(every_n_steps=1)
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=["ScaledBlock"]))
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, strategy=strategy, callbacks=[monitor, HookCounted()], max_steps=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LightningCkptDeterminismWarning)
        trainer.fit(ScaledStack())
    # The sentinel names the blocks; the check's rerun runs no hook, so attribution finds every region exact.
    assert any("region `model.blocks.0` recompute other values" in str(warning.message) for warning in caught)
    (said,) = [str(warning.message) for warning in caught if "recomputation diverged" in str(warning.message)]
    assert (
        "Every checkpointed region recomputed exactly what its forward produced when rerun with attribution: the"
        " difference changes from pass to pass, as Python state a module updates in forward (a counter) does, or"
        " state that a hook between the forward and the backward changes (`on_before_backward`), which the rerun"
        " does not run."
    ) in said
