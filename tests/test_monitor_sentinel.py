"""The monitor's sentinel in Lightning fits: every step's recomputed saved tensors compared with the forward's."""

import csv
import logging
import warnings
from pathlib import Path
from typing import Any, get_args

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckpt_determinism import (
    CheckpointingConfig,
    LightningCkptDeterminismWarning,
    RecomputationDivergenceError,
    RecomputationMonitor,
    SingleDeviceCheckpointingStrategy,
    apply_activation_checkpointing,
    recomputation_sentinel,
)
from lightning_ckpt_determinism.checkpointing.contexts import KEPT_BUFFER_BYTES
from lightning_ckpt_determinism.lightning import monitor as monitor_module
from lightning_ckpt_determinism.lightning.reference import plain_regions, regions_that_fit
from lightning_ckpt_determinism.lightning.watch import SentinelFinding
from lightning_ckpt_determinism.verify.digest import DigestTier
from lightning_ckpt_determinism.verify.reports import read_otherwise_hint
from tests.helpers import DIM, ArmedBlock, PlainBlock, StackModule, failing_from, trainer_kwargs

METRIC = "recompute/sentinel/mismatches"


def monitored_trainer(
    tmp_path: Path, monitor: RecomputationMonitor | None, steps: int = 12, log_every_n_steps: int = 1
) -> pl.Trainer:
    """A seeded Trainer checkpointing the stack's blocks under ``monitor``, logging to a CSV file in ``tmp_path``."""
    pl.seed_everything(0, verbose=False)
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["model.blocks.*"]))
    kwargs = trainer_kwargs(
        tmp_path,
        max_steps=steps,
        strategy=strategy,
        callbacks=[] if monitor is None else [monitor],
        logger=CSVLogger(tmp_path),
        log_every_n_steps=log_every_n_steps,
    )
    return pl.Trainer(**kwargs)


def fit(tmp_path: Path, monitor: RecomputationMonitor | None, module: StackModule, steps: int = 12) -> pl.Trainer:
    trainer = monitored_trainer(tmp_path, monitor, steps)
    trainer.fit(module)
    return trainer


def logged(tmp_path: Path, key: str) -> list[tuple[int, float]]:
    with open(tmp_path / "lightning_logs" / "version_0" / "metrics.csv") as file:
        return [(int(row["step"]), float(row[key])) for row in csv.DictReader(file) if row.get(key)]


def armed_module(step: int = 5) -> StackModule:
    module = StackModule(block="PlainBlock", n=3)
    torch.manual_seed(1)
    module.model.blocks[1] = ArmedBlock(armed=step)
    return module


@pytest.mark.parametrize("sentinel", get_args(DigestTier))
def test_a_clean_fit_logs_zero_mismatches_at_every_step(tmp_path: Path, sentinel: str) -> None:
    monitor = RecomputationMonitor(every_n_steps=50, sentinel=sentinel)  # type: ignore[arg-type]
    fit(tmp_path, monitor, StackModule(block="DropoutBlock"))
    assert logged(tmp_path, METRIC) == [(step, 0.0) for step in range(12)]
    report = monitor.sentinel_report
    assert report is not None and report.mismatches == 0
    assert all(region.compared >= 12 for region in report.regions.values())


@pytest.mark.parametrize("sentinel", get_args(DigestTier))
def test_the_default_monitor_trains_a_model_whose_saved_tensors_have_odd_strides(tmp_path: Path, sentinel: str) -> None:
    monitor = RecomputationMonitor() if sentinel == "light" else RecomputationMonitor(sentinel=sentinel)  # type: ignore[arg-type]
    trainer = fit(tmp_path, monitor, StackModule(block="AttentionPoolBlock"))
    assert trainer.global_step == 12
    assert logged(tmp_path, METRIC) == [(step, 0.0) for step in range(12)]
    compared = logged(tmp_path, "recompute/sentinel/compared")
    assert [step for step, _ in compared] == list(range(12)) and all(count > 0 for _, count in compared)
    report = monitor.sentinel_report
    assert report is not None and report.mismatches == 0
    assert report.compared == sum(count for _, count in compared)


def test_a_failure_of_the_sentinels_own_reads_leaves_that_tensor_out_and_the_fit_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from lightning_ckpt_determinism.verify.digest import DigestMode, DigestPlans

    read = DigestPlans.read

    def failing(self: DigestPlans, tensor: torch.Tensor, mode: DigestMode) -> torch.Tensor | None:
        if tensor.grad_fn is not None and tensor.grad_fn.name() == "TanhBackward0":
            raise RuntimeError("an injected failure")
        return read(self, tensor, mode)

    monkeypatch.setattr(DigestPlans, "read", failing)
    monitor = RecomputationMonitor(every_n_steps=50, sentinel="sampled")
    with caplog.at_level("WARNING", logger="lightning_ckpt_determinism"):
        trainer = fit(tmp_path, monitor, StackModule(block="PlainBlock"), steps=4)
    assert trainer.global_step == 4
    report = monitor.sentinel_report
    # Each block saves its input and tanh's output: the input is compared, tanh's output left out.
    assert report is not None and report.mismatches == 0
    assert report.not_compared == report.compared > 0
    warned = [record.getMessage() for record in caplog.records if "could not read" in record.getMessage()]
    # Once per region and tensor, naming both, however many steps met it.
    assert len(warned) == len(set(warned)) > 0
    assert all("of region `model.blocks." in message and "an injected failure" in message for message in warned)


# The armed block counts its calls in a list, which recomputation repeats: the checks leave it out.
ARMED_COUNT = ["calls"]


def test_a_defect_of_one_step_is_caught_at_that_step_which_the_periodic_check_misses(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monitor = RecomputationMonitor(every_n_steps=50, exclude_attributes=ARMED_COUNT)
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(caplog.handler)
    try:
        with (
            caplog.at_level("INFO", logger="lightning.pytorch"),
            pytest.warns(LightningCkptDeterminismWarning, match=r"region `model.blocks.1` recompute .* at step 5: 1"),
            # A defect of one step: the check it asked for finds the next one exact, and says so.
            pytest.warns(
                LightningCkptDeterminismWarning,
                match=r"the full check at step 6, which a sentinel finding asked for, found recomputation exact",
            ),
        ):
            fit(tmp_path, monitor, armed_module(step=5))
    finally:
        logger.removeHandler(caplog.handler)
    (summary,) = {record.getMessage() for record in caplog.records if "RecomputationMonitor ran" in record.getMessage()}
    assert (
        "ran 1 periodic check this fit (the first step, then every 50 steps) and 1 follow-up check that sentinel"
        in summary
    )
    assert logged(tmp_path, METRIC) == [(step, 1.0 if step == 5 else 0.0) for step in range(12)]
    assert logged(tmp_path, "recompute/sentinel/regions/model.blocks.1/mismatches") == [(5, 1.0)]
    # The periodic check ran at step 0 and, asked by the sentinel, at step 6: the defect did not recur there.
    assert [(entry.step, entry.diverged) for entry in monitor.history] == [(0, False), (6, False)]
    report = monitor.sentinel_report
    assert report is not None and report.regions["model.blocks.1"].mismatches == 1
    assert (
        report.regions["model.blocks.1"].first_mismatch
        == "the 3rd tensor the region saved (made by `TanhBackward0`, shape (8, 8), float32)"
    )


def test_raise_mode_stops_the_fit_at_the_step_of_the_mismatch_before_its_optimizer_step(tmp_path: Path) -> None:
    monitor = RecomputationMonitor(every_n_steps=50, on_divergence="raise", exclude_attributes=ARMED_COUNT)
    module = armed_module(step=5)
    trainer = monitored_trainer(tmp_path / "raised", monitor)
    with pytest.raises(RecomputationDivergenceError, match=r"region `model.blocks.1` .* at step 5"):
        trainer.fit(module)
    # Logged up to the step of the mismatch, which is logged before the error stops the fit, and shown in
    # `trainer.callback_metrics` too (not the step before's zero).
    assert logged(tmp_path / "raised", METRIC) == [(step, 1.0 if step == 5 else 0.0) for step in range(6)]
    shown = {key: float(value) for key, value in trainer.callback_metrics.items() if "mismatches" in key}
    assert shown == {METRIC: 1.0, "recompute/sentinel/regions/model.blocks.1/mismatches": 1.0}
    # Ground truth: the same model trained for the five steps before it. Step 5's gradients were never applied.
    twin = armed_module(step=5)
    fit(tmp_path / "twin", None, twin, steps=5)
    assert all(torch.equal(value, twin.state_dict()[key]) for key, value in module.state_dict().items())


@pytest.mark.parametrize("on_divergence", ["warn", "raise"])
def test_a_finding_whose_message_fails_still_warns_or_raises_naming_its_region_and_step_and_is_followed_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_divergence: str
) -> None:
    monkeypatch.setattr(SentinelFinding, "message", failing_from(1, SentinelFinding.message))
    monitor = RecomputationMonitor(every_n_steps=50, on_divergence=on_divergence, exclude_attributes=ARMED_COUNT)  # type: ignore[arg-type]
    said = (
        r"the sentinel saw region `model.blocks.1` recompute other values than its forward at step 5; the monitor"
        r" failed to write the details \(RuntimeError: injected\). Please report it."
    )
    if on_divergence == "raise":
        with pytest.raises(RecomputationDivergenceError, match=said):
            fit(tmp_path, monitor, armed_module(step=5))
        return
    with (
        pytest.warns(LightningCkptDeterminismWarning, match=said),
        pytest.warns(
            LightningCkptDeterminismWarning,
            match=r"the full check at step 6, which a sentinel finding asked for, found recomputation exact",
        ),
    ):
        fit(tmp_path, monitor, armed_module(step=5))
    # Followed up as any finding is: step 6 checked in full, and the counts logged.
    assert [(entry.step, entry.diverged) for entry in monitor.history] == [(0, False), (6, False)]
    assert logged(tmp_path, METRIC) == [(step, 1.0 if step == 5 else 0.0) for step in range(12)]


def test_a_defect_read_at_a_later_logging_step_is_warned_and_logged_at_the_step_it_happened(tmp_path: Path) -> None:
    monitor = RecomputationMonitor(every_n_steps=50, exclude_attributes=ARMED_COUNT)
    pl.seed_everything(0, verbose=False)
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["model.blocks.*"]))
    kwargs = trainer_kwargs(
        tmp_path, max_steps=12, strategy=strategy, callbacks=[monitor], logger=CSVLogger(tmp_path), log_every_n_steps=5
    )
    with (
        pytest.warns(
            LightningCkptDeterminismWarning, match=r"region `model.blocks.1` recompute .* at step 2: 1"
        ) as caught,
        pytest.warns(
            LightningCkptDeterminismWarning,
            match=r"the full check at step 5, which a sentinel finding asked for, found recomputation exact",
        ),
    ):
        pl.Trainer(**kwargs).fit(armed_module(step=2))
    # Read at the logging step 4, logged at step 2; the logging steps 4, 9 and the fit's last step (11) show the rest.
    assert logged(tmp_path, METRIC) == [(2, 1.0), (4, 0.0), (9, 0.0), (11, 0.0)]
    assert logged(tmp_path, "recompute/sentinel/regions/model.blocks.1/mismatches") == [(2, 1.0)]
    warning = next(str(w.message) for w in caught if "the sentinel saw" in str(w.message))
    assert "Step 5 is checked in full" in warning
    # The full check the finding asked for ran at step 5, the step after the read.
    assert [(entry.step, entry.diverged) for entry in monitor.history] == [(0, False), (5, False)]


@pytest.mark.parametrize("end", ["max_steps", "max_epochs"])
def test_a_finding_at_the_fits_last_step_promises_no_check_after_it(tmp_path: Path, end: str) -> None:
    monitor = RecomputationMonitor(every_n_steps=50, exclude_attributes=ARMED_COUNT)
    pl.seed_everything(0, verbose=False)
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["model.blocks.*"]))
    # The fit's last step is 3, whichever limit ends it.
    limit = {"max_steps": 4} if end == "max_steps" else {"max_steps": -1, "max_epochs": 1, "limit_train_batches": 4}
    kwargs = trainer_kwargs(tmp_path, strategy=strategy, callbacks=[monitor], log_every_n_steps=50, **limit)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LightningCkptDeterminismWarning)
        pl.Trainer(**kwargs).fit(armed_module(step=3))
    said = [str(w.message) for w in caught if "the sentinel saw" in str(w.message)]
    assert len(said) == 1 and "at step 3" in said[0]
    ended = (
        "The fit ended before a check could name the cause: run `check_recomputation(model, closure,"
        " attribution=True)` on a batch of that step to name it."
    )
    assert said[0].endswith(ended)


class _StopAfter(pl.Callback):
    """Stops the fit after the training batch of global step ``step``, as `EarlyStopping` does after a validation."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        trainer.should_stop = trainer.global_step > self.step


def test_a_fit_stopped_before_the_check_a_finding_promised_says_so_at_its_end(tmp_path: Path) -> None:
    monitor = RecomputationMonitor(every_n_steps=50, exclude_attributes=ARMED_COUNT)
    monitor.hint_syntax = "yaml"  # as `CheckpointingCLI` sets it: the run has a config for the audit
    pl.seed_everything(0, verbose=False)
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["model.blocks.*"]))
    callbacks = [monitor, _StopAfter(step=2)]
    kwargs = trainer_kwargs(
        tmp_path, max_steps=8, strategy=strategy, callbacks=callbacks, logger=CSVLogger(tmp_path), log_every_n_steps=1
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LightningCkptDeterminismWarning)
        trainer = pl.Trainer(**kwargs)
        trainer.fit(armed_module(step=2))
    said = [str(w.message) for w in caught if issubclass(w.category, LightningCkptDeterminismWarning)]
    assert trainer.global_step == 3
    assert any("at step 2" in line and "Step 3 is checked in full" in line for line in said), said
    assert [entry.step for entry in monitor.history] == [0]  # step 3's check never ran
    assert (
        "lightning_ckpt_determinism: the fit ended before step 3, whose check was to name the cause of the"
        " sentinel's finding: run the audit on this config to name it." in said
    )


def test_a_region_that_differed_once_reads_clean_again_in_callback_metrics(tmp_path: Path) -> None:
    # Lightning keeps a metric's last value: the region's count goes back to 0 there once its periods are clean; the
    # loggers keep the point of the step that differed.
    monitor = RecomputationMonitor(every_n_steps=50, exclude_attributes=ARMED_COUNT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LightningCkptDeterminismWarning)
        trainer = fit(tmp_path, monitor, armed_module(step=2), steps=8)
    metrics = trainer.callback_metrics
    assert metrics["recompute/sentinel/regions/model.blocks.1/mismatches"] == 0.0
    assert logged(tmp_path, "recompute/sentinel/regions/model.blocks.1/mismatches") == [(2, 1.0)]


def test_under_gradient_accumulation_the_follow_up_check_is_the_next_global_steps(tmp_path: Path) -> None:
    # The defect is in the recomputation of step 0's first micro-batch: the sentinel's finding asks for a full check,
    # which the next micro-batch of the same step must not take (a second history and logger entry for step 0).
    # Without attribution, step 0's check names no cause, so the finding asks for one.
    monitor = RecomputationMonitor(every_n_steps=100, exclude_attributes=ARMED_COUNT, attribution="never")
    pl.seed_everything(0, verbose=False)
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["model.blocks.*"]))
    logger = CSVLogger(tmp_path)
    kwargs = trainer_kwargs(
        tmp_path, max_steps=3, strategy=strategy, callbacks=[monitor], logger=logger, accumulate_grad_batches=2
    )
    with (
        pytest.warns(LightningCkptDeterminismWarning, match="at step 0") as caught,
        pytest.warns(
            LightningCkptDeterminismWarning,
            match=r"the full check at step 1, which a sentinel finding asked for, found recomputation exact",
        ),
    ):
        pl.Trainer(**kwargs).fit(armed_module(step=0))
    assert [(entry.step, entry.diverged) for entry in monitor.history] == [(0, True), (1, False)]
    assert any("the sentinel saw region `model.blocks.1`" in str(warning.message) for warning in caught)
    assert [step for step, _ in logged(tmp_path, "recompute/grad_divergence")] == [0, 1]


@pytest.mark.parametrize("armed", [4, 3], ids=["watched", "unwatched"])
def test_every_other_step_watched_catches_a_defect_at_a_watched_step_and_compares_nothing_between(
    tmp_path: Path, armed: int
) -> None:
    monitor = RecomputationMonitor(every_n_steps=50, exclude_attributes=ARMED_COUNT, sentinel_every_n_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path, monitor, armed_module(step=armed))
    messages = [str(warning.message) for warning in caught if warning.category is LightningCkptDeterminismWarning]
    assert not any("compared nothing" in message for message in messages)
    compared = dict(logged(tmp_path, "recompute/sentinel/compared"))
    assert list(compared) == list(range(12))
    if armed == 4:
        assert any("the sentinel saw region `model.blocks.1` recompute other values" in m for m in messages)
        # The even steps, and the step after the finding (5), digested in full: nothing between them.
        watched = [0, 2, 4, 5, 6, 8, 10]
        assert compared[5] > compared[4]
        assert [(entry.step, entry.diverged) for entry in monitor.history] == [(0, False), (5, False)]
    else:
        # A defect at an unwatched step only is missed: the trade-off `sentinel_every_n_steps` makes.
        assert not any("the sentinel saw" in message for message in messages)
        watched = [0, 2, 4, 6, 8, 10]
    assert [step for step, count in compared.items() if count > 0] == watched
    assert logged(tmp_path, METRIC) == [(step, 1.0 if step == armed else 0.0) for step in watched]
    report = monitor.sentinel_report
    assert report is not None and report.compared == sum(compared.values())


def test_a_period_that_compares_nothing_leaves_the_total_and_its_regions_as_the_last_period_logged_them(
    tmp_path: Path,
) -> None:
    # Every block draws NumPy noise: each watched step (0 and 4) differs in each region; the steps between compare
    # nothing, and `trainer.callback_metrics` keeps the counts of the last period that compared.
    seen: list[tuple[float, float]] = []

    class Reader(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            metrics = trainer.callback_metrics
            regions = sum(float(v) for k, v in metrics.items() if k.startswith("recompute/sentinel/regions/"))
            seen.append((float(metrics[METRIC]), regions))

    monitor = RecomputationMonitor(every_n_steps=100, sentinel_every_n_steps=4, on_divergence="ignore")
    pl.seed_everything(0, verbose=False)
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["model.blocks.*"]))
    kwargs = trainer_kwargs(tmp_path, max_steps=6, strategy=strategy, callbacks=[monitor, Reader()])
    pl.Trainer(**kwargs, log_every_n_steps=1).fit(StackModule(block="NumpyNoiseBlock"))
    first = seen[0][0]
    assert first > 0 and all(total == regions for total, regions in seen)
    assert [total for total, _ in seen] == [first] * 4 + [seen[4][0]] * 2 and seen[4][0] > 0


def _weights(tmp_path: Path, sentinel: str | None, every: int = 1) -> dict[str, Any]:
    monitor = (
        None
        if sentinel is None
        else RecomputationMonitor(every_n_steps=4, sentinel=sentinel, sentinel_every_n_steps=every)  # type: ignore[arg-type]
    )
    module = StackModule(block="DropoutBlock")
    fit(tmp_path, monitor, module, steps=6)
    return {name: value.clone() for name, value in module.state_dict().items()}


class BranchAtOneStep(PlainBlock):
    """Exact, but gates its ``tanh`` by a ``sigmoid`` at one step only (``branch_at``): a code path its first call
    did not take. The step is set on it before each batch."""

    def __init__(self, branch_at: int = 3) -> None:
        super().__init__()
        self.branch_at = branch_at
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.linear(x)
        if self.step == self.branch_at:
            return x + torch.tanh(hidden) * torch.sigmoid(hidden)
        return x + torch.tanh(hidden)


class BranchingModule(StackModule):
    def __init__(self) -> None:
        super().__init__(block="PlainBlock", n=2)
        torch.manual_seed(1)
        self.model.blocks = torch.nn.ModuleList([BranchAtOneStep(), BranchAtOneStep()])

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        for block in self.model.blocks:
            block.step = self.global_step


def test_a_step_whose_every_call_takes_a_new_code_path_is_said_to_compare_nothing_for_that_reason(
    tmp_path: Path,
) -> None:
    monitor = RecomputationMonitor(every_n_steps=50, sentinel="exact")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path, monitor, BranchingModule(), steps=6)
    messages = [str(warning.message) for warning in caught if warning.category is LightningCkptDeterminismWarning]
    said = [message for message in messages if "compared nothing" in message]
    assert len(said) == 1 and "at step 3: every call it met took a code path its region had not learned yet" in said[0]
    compared = dict(logged(tmp_path, "recompute/sentinel/compared"))
    assert [step for step, count in compared.items() if count == 0] == [3]  # the step after is compared again
    report = monitor.sentinel_report
    assert report is not None and report.on_new_paths == report.not_compared > 0


class ShorterAtOneStep(BranchAtOneStep):
    """Exact, but saves fewer tensors at one step (``branch_at``): a path that never reaches the positions the light
    tier's targets hold on the path it learned."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.linear(x))
        if self.step == self.branch_at:
            return x + hidden
        return x + hidden * torch.sigmoid(self.gate(hidden)) * torch.tanh(self.gate(x))


def test_a_light_step_whose_calls_never_reach_their_targets_is_said_to_take_new_paths(tmp_path: Path) -> None:
    module = BranchingModule()
    module.model.blocks = torch.nn.ModuleList([ShorterAtOneStep(), ShorterAtOneStep()])
    monitor = RecomputationMonitor(every_n_steps=50, sentinel="light")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path, monitor, module, steps=6)
    said = [str(warning.message) for warning in caught if "compared nothing" in str(warning.message)]
    assert len(said) == 1 and "at step 3: every call it met took a code path its region had not learned yet" in said[0]
    assert [step for step, count in logged(tmp_path, "recompute/sentinel/compared") if count == 0] == [3]
    report = monitor.sentinel_report
    # Two targets a call, each left out on the new path, in each of the two blocks.
    assert report is not None and report.on_new_paths == report.not_compared == 4


class FrozenFeatureLoss(StackModule):
    """A perceptual-style loss: a frozen, checkpointed feature block applied to the prediction and to the target (a
    call that saves nothing, and so recomputes nothing)."""

    def __init__(self) -> None:
        super().__init__(block="PlainBlock", n=2)
        self.features = PlainBlock(dim=1)
        self.features.requires_grad_(False)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.features(self.model(x)), self.features(y))


def test_a_region_call_that_saves_nothing_is_not_counted_as_left_out(tmp_path: Path) -> None:
    monitor = RecomputationMonitor(every_n_steps=50, sentinel="light")
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["features"]))
    pl.Trainer(**trainer_kwargs(tmp_path, max_steps=4, strategy=strategy, callbacks=[monitor])).fit(FrozenFeatureLoss())
    report = monitor.sentinel_report
    assert report is not None and report.compared > 0
    assert (report.on_new_paths, report.not_compared, report.mismatches) == (0, 0, 0)


def test_training_is_bit_identical_with_the_sentinel_on_and_off(tmp_path: Path) -> None:
    off = _weights(tmp_path / "off", "off")
    for name, weights in (
        ("light", _weights(tmp_path / "l", "light")),
        ("sampled", _weights(tmp_path / "s", "sampled")),
        ("exact", _weights(tmp_path / "e", "exact")),
        ("light, every 2nd step", _weights(tmp_path / "l2", "light", every=2)),
    ):
        assert all(torch.equal(weights[key], off[key]) for key in off), name
    assert all(torch.equal(value, off[key]) for key, value in _weights(tmp_path / "none", None).items())


def test_auto_reference_regions_fit_the_free_memory_and_rotate() -> None:
    saved = [4 << 20, 6 << 20, 4 << 20, 6 << 20]  # bytes each region holds when run plainly
    assert regions_that_fit(saved, free_bytes=16 << 20) == 2  # 12 MiB usable: the two largest take 12
    assert regions_that_fit(saved, free_bytes=100 << 20) == 4
    assert regions_that_fit(saved, free_bytes=1 << 20) == 1  # at least one region is checked
    assert plain_regions(["a", "b", "c", "d"], 2, checks=0) == ["a", "b"]
    assert plain_regions(["a", "b", "c", "d"], 2, checks=1) == ["c", "d"]
    assert plain_regions(["a", "b", "c", "d"], 4, checks=3) is None


def test_auto_reference_regions_run_every_region_plainly_off_cuda(tmp_path: Path) -> None:
    monitor = RecomputationMonitor(every_n_steps=2)
    fit(tmp_path, monitor, StackModule(block="DropoutBlock"), steps=4)
    assert monitor.reference_regions == "auto"
    assert [entry.checked_regions for entry in monitor.history] == [None, None]
    assert monitor.last_report is not None
    assert monitor.last_report.checked_regions == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]


def test_auto_reference_regions_take_as_many_regions_as_the_free_memory_holds(tmp_path: Path, monkeypatch) -> None:
    module = StackModule(block="DropoutBlock")
    probe = StackModule(block="DropoutBlock").model
    apply_activation_checkpointing(probe, CheckpointingConfig(names=["blocks.*"]))
    with recomputation_sentinel(probe) as sentinel:
        probe(torch.randn(8, 8)).sum().backward()  # one batch of the module's data
    per_block = max(sentinel.saved_bytes.values())
    # As on CUDA: room for two blocks' activations, with the margin.
    monkeypatch.setattr(monitor_module, "free_memory", lambda device: int(2 * per_block / 0.75) + 1)
    monitor = RecomputationMonitor(every_n_steps=1)
    fit(tmp_path, monitor, module, steps=3)
    assert [entry.checked_regions for entry in monitor.history] == [
        ["model.blocks.0", "model.blocks.1"],
        ["model.blocks.2", "model.blocks.0"],
        ["model.blocks.1", "model.blocks.2"],
    ]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_reference_regions_read_the_cuda_free_memory(tmp_path: Path) -> None:
    module = StackModule(block="DropoutBlock")
    monitor = RecomputationMonitor(every_n_steps=1)
    strategy = SingleDeviceCheckpointingStrategy(
        checkpointing=CheckpointingConfig(names=["model.blocks.*"]), device="cuda"
    )
    trainer = pl.Trainer(
        **trainer_kwargs(tmp_path, max_steps=2, strategy=strategy, callbacks=[monitor], accelerator="cuda")
    )
    trainer.fit(module)
    free = torch.cuda.mem_get_info()[0]
    saved = list(monitor._watch.saved_bytes.values())
    assert regions_that_fit(saved, free) == 3  # a GPU holds a tiny model's activations many times over
    assert [entry.checked_regions for entry in monitor.history] == [None, None]


def early_stopped(tmp_path: Path, module: StackModule, on_divergence: str) -> pl.Trainer:
    """docs/large-runs.md's setup: `EarlyStopping` on the sentinel's mismatches, 8 steps an epoch, logged every 50."""
    from lightning.pytorch.callbacks import EarlyStopping

    pl.seed_everything(0, verbose=False)
    monitor = RecomputationMonitor(every_n_steps=100, on_divergence=on_divergence, exclude_attributes=ARMED_COUNT)  # type: ignore[arg-type]
    stopping = EarlyStopping(monitor=METRIC, divergence_threshold=0.0, strict=True, check_on_train_epoch_end=True)
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["model.blocks.*"]))
    trainer = pl.Trainer(
        **trainer_kwargs(tmp_path, max_steps=24, strategy=strategy, callbacks=[monitor, stopping], log_every_n_steps=50)
    )
    trainer.fit(module)
    return trainer


def test_early_stopping_on_the_sentinels_mismatches_works_with_epochs_shorter_than_the_logging_interval(
    tmp_path: Path,
) -> None:
    clean = early_stopped(tmp_path / "clean", StackModule(block="PlainBlock", n=3), "warn")
    assert clean.global_step == 24 and not clean.should_stop
    assert float(clean.callback_metrics[METRIC]) == 0.0
    # The defect at step 5 is read at the first epoch's end (step 7), and EarlyStopping stops there.
    broken = early_stopped(tmp_path / "broken", armed_module(step=5), "ignore")
    assert broken.should_stop and broken.global_step == 8
    assert float(broken.callback_metrics[METRIC]) == 1.0


def test_the_sentinels_counts_are_in_callback_metrics_from_the_first_step(tmp_path: Path) -> None:
    seen: list[float] = []

    class Reader(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 1:
                seen.append(float(trainer.callback_metrics[METRIC]))

    pl.seed_everything(0, verbose=False)
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["model.blocks.*"]))
    callbacks = [RecomputationMonitor(every_n_steps=100), Reader()]
    pl.Trainer(**trainer_kwargs(tmp_path, strategy=strategy, callbacks=callbacks, log_every_n_steps=50)).fit(
        StackModule(block="PlainBlock")
    )
    assert seen == [0.0]


def test_compared_per_step_is_the_same_whatever_the_logging_interval(tmp_path: Path) -> None:
    # The sampled tier compares every saved tensor every step: the same count at each step of a plain model.
    runs = {}
    for every in (1, 4):
        monitor = RecomputationMonitor(every_n_steps=100, sentinel="sampled")
        monitored_trainer(tmp_path / str(every), monitor, 8, every).fit(StackModule(block="PlainBlock"))
        runs[every] = (
            logged(tmp_path / str(every), "recompute/sentinel/compared"),
            logged(tmp_path / str(every), "recompute/sentinel/compared_per_step"),
        )
    (each, each_per_step), (fourth, fourth_per_step) = runs[1], runs[4]
    per_step = each[0][1]
    assert per_step > 0 and each == [(step, per_step) for step in range(8)] and each_per_step == each
    assert fourth == [(3, 4 * per_step), (7, 4 * per_step)]
    assert fourth_per_step == [(3, per_step), (7, per_step)]


@pytest.mark.parametrize("how", ["second fit", "resumed"])
def test_compared_per_step_counts_from_the_first_step_of_a_second_fit(tmp_path: Path, how: str) -> None:
    # A second `fit` of the same Trainer, or a fit resumed from a checkpoint (whose global step Lightning restores
    # after `on_fit_start`), starts at step 8: its first period holds four steps, not twelve.
    def trainer(root: Path, max_steps: int) -> pl.Trainer:
        return monitored_trainer(root, RecomputationMonitor(every_n_steps=100, sentinel="sampled"), max_steps, 4)

    first, module = trainer(tmp_path, 8), StackModule(block="PlainBlock")
    first.fit(module)
    if how == "second fit":
        first.fit_loop.epoch_loop.max_steps = 16
        first.fit(module)
        steps = [3, 7, 11, 15]
    else:
        first.save_checkpoint(tmp_path / "step8.ckpt")
        tmp_path = tmp_path / "resumed"
        trainer(tmp_path, 16).fit(StackModule(block="PlainBlock"), ckpt_path=tmp_path.parent / "step8.ckpt")
        steps = [11, 15]
    compared = logged(tmp_path, "recompute/sentinel/compared")
    per_step = logged(tmp_path, "recompute/sentinel/compared_per_step")
    assert [step for step, _ in per_step] == steps
    each = per_step[0][1]
    assert each > 0 and per_step == [(step, each) for step in steps]
    assert compared == [(step, 4 * each) for step in steps]


class TwoOptimizers(StackModule):
    """Manual optimization stepping two optimizers a batch: the global step moves on by two at each batch."""

    def __init__(self) -> None:
        super().__init__(block="PlainBlock")
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        for optimizer in self.optimizers():
            loss = self.loss(batch)
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        self.log("train/loss", loss)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        blocks = list(self.model.blocks)
        return [
            torch.optim.SGD([p for block in blocks[:1] for p in block.parameters()], lr=0.1),
            torch.optim.SGD([p for block in blocks[1:] for p in block.parameters()], lr=0.1),
        ]


def test_with_two_optimizers_the_sentinels_counts_are_logged_with_lightnings_own_metrics(tmp_path: Path) -> None:
    # Lightning logs once per batch that stepped, whatever the number of optimizers: its `train/loss` and the
    # sentinel's counts reach the logger at the same batches, each batch's counts once.
    monitor = RecomputationMonitor(every_n_steps=100, sentinel="sampled", loss_fn=lambda m, b, i: m.loss(b))
    pl.seed_everything(0, verbose=False)
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["model.blocks.*"]))
    kwargs = trainer_kwargs(
        tmp_path, max_steps=12, strategy=strategy, callbacks=[monitor], logger=CSVLogger(tmp_path), log_every_n_steps=2
    )
    pl.Trainer(**kwargs).fit(TwoOptimizers())
    with open(tmp_path / "lightning_logs" / "version_0" / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    losses = [row for row in rows if row.get("train/loss")]
    compared = [row for row in rows if row.get("recompute/sentinel/compared")]
    assert len(losses) == 3 and len(compared) == 3  # six batches, logged at every second one
    per_step = {float(row["recompute/sentinel/compared_per_step"]) for row in compared}
    assert len(per_step) == 1 and per_step.pop() > 0


class NoisyFromItsThirdCall(PlainBlock):
    """Exact at its first two calls (step 0's forward and recomputation), NumPy noise from then on: a defect the
    sentinel finds at step 1, and a follow-up check finds too."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(1)
        h = torch.tanh(self.linear(x))
        if len(self.calls) > 2:
            h = h * (1 + torch.from_numpy(np.random.standard_normal(x.shape).astype(np.float32)))
        return x + h


def test_a_reused_monitors_finding_is_followed_up_though_an_earlier_fit_diverged_at_that_step(tmp_path: Path) -> None:
    # The first fit's follow-up check of step 3 diverged; the second fit, of another model, has its finding at step 3
    # and no check there: that finding is not named by the first fit's check, and step 4 is checked in full.
    monitor = RecomputationMonitor(every_n_steps=50, exclude_attributes=ARMED_COUNT)
    first = StackModule(block="PlainBlock", n=3)
    first.model.blocks[1] = NoisyFromItsThirdCall()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(tmp_path / "first", monitor, first, steps=6)
    assert [(entry.step, entry.diverged) for entry in monitor.history] == [(0, False), (3, True)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path / "second", monitor, armed_module(step=3), steps=6)
    said = [str(warning.message) for warning in caught if "the sentinel saw" in str(warning.message)]
    assert len(said) == 1 and "at step 3" in said[0] and "Step 4 is checked in full" in said[0]
    assert [(entry.step, entry.diverged) for entry in monitor.history][2:] == [(0, False), (4, False)]


class CriticFirst(StackModule):
    """Manual optimization as a GAN steps: a critic first, on the stack's output detached (its backward recomputes
    no checkpointed region), then the stack itself."""

    def __init__(self) -> None:
        super().__init__(block="DropoutBlock")
        self.automatic_optimization = False
        self.critic = torch.nn.Linear(1, 1)

    def critic_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.critic(self.model(x).detach()), y)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        critic, stack = self.optimizers()
        for optimizer, loss in ((critic, self.critic_loss(batch)), (stack, super().training_step(batch, batch_idx))):
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(self.critic.parameters(), lr=0.1), torch.optim.SGD(self.model.parameters(), lr=0.1)]


def test_a_first_manual_backward_that_recomputes_nothing_is_said_and_promises_no_check(tmp_path: Path) -> None:
    # Dropout without its RNG state replayed: the sentinel sees the stack's recomputation differ at every step.
    monitor = RecomputationMonitor(every_n_steps=2, loss_fn=lambda module, batch, _: module.critic_loss(batch))
    config = CheckpointingConfig(names=["model.blocks.*"], preserve_rng_state=False)
    kwargs = trainer_kwargs(
        tmp_path, max_steps=8, strategy=SingleDeviceCheckpointingStrategy(checkpointing=config), callbacks=[monitor]
    )
    pl.seed_everything(0, verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LightningCkptDeterminismWarning)
        pl.Trainer(**kwargs).fit(CriticFirst())
    said = [str(warning.message) for warning in caught]
    assert [record.skipped for record in monitor.history] == ["no checkpointed region was recomputed in this step"] * 4
    assert [line for line in said if "no checkpointed region, so" in line] == [
        "lightning_ckpt_determinism: the first `manual_backward` of step 0, the one the check compares (with"
        " `loss_fn` giving its loss), recomputed no checkpointed region, so its check was skipped rather than compare"
        " that backward with itself; the sentinel still watches every recomputation. For the check to run, call"
        " `manual_backward` first on a loss that runs the checkpointed modules, with `loss_fn` returning that loss."
    ]
    findings = [line for line in said if "recompute other values than its forward" in line]
    assert findings and all(
        line.endswith(
            "No check names the cause while a step's first `manual_backward` recomputes no checkpointed region (see"
            " that warning)."
        )
        for line in findings
    ), findings
    assert not [line for line in said if "is checked in full" in line or "fit ended before" in line]


class CountsWhenArmed(PlainBlock):
    """Scales by how often it ran while armed, a count its recomputation adds to again: a defect only at calls made
    armed."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.calls: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.armed:
            return super().forward(x)
        self.calls.append(1)
        return x + torch.tanh(self.linear(x) * (1.0 + 0.01 * len(self.calls)))


class ArmedOnLastMicroBatch(StackModule):
    """Arms its middle block on the last of every three micro-batches."""

    def __init__(self) -> None:
        super().__init__(block="PlainBlock")
        self.model.blocks[1] = CountsWhenArmed()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.model.blocks[1].armed = batch_idx % 3 == 2
        return super().training_step(batch, batch_idx)

    def train_dataloader(self) -> DataLoader:
        x = torch.randn(72, DIM, generator=torch.Generator().manual_seed(2))  # 9 batches: three steps an epoch
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)


def test_a_follow_up_check_that_finds_the_step_exact_says_the_finding_stays_unexplained(tmp_path: Path) -> None:
    monitor = RecomputationMonitor(every_n_steps=100, sentinel="exact")
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["model.blocks.*"]))
    kwargs = trainer_kwargs(tmp_path, max_steps=4, strategy=strategy, callbacks=[monitor], accumulate_grad_batches=3)
    pl.seed_everything(0, verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LightningCkptDeterminismWarning)
        pl.Trainer(**kwargs).fit(ArmedOnLastMicroBatch())
    said = [str(warning.message) for warning in caught]
    assert any("region `model.blocks.1` recompute other values" in line for line in said), said
    follow_ups = [record for record in monitor.history if record.step > 0]
    assert follow_ups and all(record.grad_divergence == 0.0 for record in follow_ups)
    assert [line for line in said if "which a sentinel finding asked for" in line] == [
        f"lightning_ckpt_determinism: the full check at step {follow_ups[0].step}, which a sentinel finding asked for,"
        " found recomputation exact in its first micro-batch, the one a check reruns under `accumulate_grad_batches`:"
        " the difference shows at some calls only, so no check names its cause; the sentinel's finding and its"
        " region stand."
    ]


class ArmedAfterTheFirstClosureCall(StackModule):
    """Trained by LBFGS, which calls its closure (the training step) three times a step: arms its middle block from
    the second call of each step on."""

    def __init__(self) -> None:
        super().__init__(block="PlainBlock")
        self.model.blocks[1] = CountsWhenArmed()
        self.closure_calls = 0

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.closure_calls = 0

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.model.blocks[1].armed = self.closure_calls > 0
        self.closure_calls += 1
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)


def test_a_follow_up_check_of_a_step_with_several_backwards_says_it_reran_the_first_alone(tmp_path: Path) -> None:
    monitor = RecomputationMonitor(every_n_steps=100, sentinel="exact")
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["model.blocks.*"]))
    kwargs = trainer_kwargs(tmp_path, max_steps=2, strategy=strategy, callbacks=[monitor])
    pl.seed_everything(0, verbose=False)
    module = ArmedAfterTheFirstClosureCall()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LightningCkptDeterminismWarning)
        pl.Trainer(**kwargs).fit(module)
    said = [str(warning.message) for warning in caught]
    assert module.closure_calls == 3
    assert any("region `model.blocks.1` recompute other values than its forward at step 0" in line for line in said)
    assert [(record.step, record.grad_divergence) for record in monitor.history] == [(0, 0.0), (1, 0.0)]
    assert [line for line in said if "which a sentinel finding asked for" in line] == [
        "lightning_ckpt_determinism: the full check at step 1, which a sentinel finding asked for, found recomputation"
        " exact in the first backward of that step, the one a check reruns (batches of this fit ran up to 3 backwards:"
        " an optimizer calling its closure again, as LBFGS and SAM do, or several `manual_backward` calls; a"
        " difference at a later one is the sentinel's alone to see): the difference shows at some calls only, so no"
        " check names its cause; the sentinel's finding and its region stand."
    ]


class ThreeBackwardsThenASkippedBatch(StackModule):
    """Manual optimization with three `manual_backward` calls a batch, the last two through its middle block armed
    at batch 0; batch 1 returns before any backward."""

    def __init__(self) -> None:
        super().__init__(block="PlainBlock")
        self.model.blocks[1] = CountsWhenArmed()
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        if batch_idx == 1:
            return
        x, y = batch
        optimizer = self.optimizers()
        optimizer.zero_grad()  # type: ignore[union-attr]
        for backward in range(3):
            self.model.blocks[1].armed = batch_idx == 0 and backward > 0
            self.manual_backward(F.mse_loss(self.model(x), y))
        self.model.blocks[1].armed = False
        optimizer.step()  # type: ignore[union-attr]


def test_a_follow_up_after_a_batch_without_backward_still_says_it_reran_the_first_backward_alone(tmp_path) -> None:
    monitor = RecomputationMonitor(
        every_n_steps=100,
        sentinel="exact",
        loss_fn=lambda module, batch, _: F.mse_loss(module.model(batch[0]), batch[1]),
    )
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["model.blocks.*"]))
    kwargs = trainer_kwargs(tmp_path, max_steps=2, strategy=strategy, callbacks=[monitor])
    pl.seed_everything(0, verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LightningCkptDeterminismWarning)
        pl.Trainer(**kwargs).fit(ThreeBackwardsThenASkippedBatch())
    said = [str(warning.message) for warning in caught if "which a sentinel finding asked for" in str(warning.message)]
    assert len(said) == 1 and "(batches of this fit ran up to 3 backwards:" in said[0], said


class ShiftsALargeTableFromAStep(PlainBlock):
    """Shifts a table over 1 MiB in its forward from step ``start`` on, then reads it: the region copies no table that
    large before it knows a forward changes it, so the first changing call recomputes from the shifted values."""

    def __init__(self, start: int = 2) -> None:
        super().__init__()
        self.register_buffer("table", torch.zeros((KEPT_BUFFER_BYTES // 4 + DIM) // DIM, DIM))
        self.start = start
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.step >= self.start:
            with torch.no_grad():
                self.table.add_(0.5)
        return x + torch.tanh(self.linear(x) + self.table[0])


class LargeTableModule(StackModule):
    def __init__(self) -> None:
        super().__init__(block="PlainBlock")
        self.model.blocks[1] = ShiftsALargeTableFromAStep()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.model.blocks[1].step = self.global_step


def test_a_follow_up_check_that_finds_the_step_exact_names_large_buffers_read_otherwise_this_fit(
    tmp_path: Path,
) -> None:
    monitor = RecomputationMonitor(every_n_steps=100, sentinel="exact")
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["model.blocks.*"]))
    pl.seed_everything(0, verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LightningCkptDeterminismWarning)
        pl.Trainer(
            **trainer_kwargs(tmp_path, max_steps=4, strategy=strategy, callbacks=[monitor], log_every_n_steps=1)
        ).fit(LargeTableModule())
    said = [str(warning.message) for warning in caught if "which a sentinel finding asked for" in str(warning.message)]
    assert [record.step for record in monitor.history] == [0, 3]
    assert said == [
        "lightning_ckpt_determinism: the full check at step 3, which a sentinel finding asked for, found recomputation"
        " exact in that step: the difference shows at some calls only, so no check names its cause; the sentinel's"
        f" finding and its region stand. A cause seen this fit: {read_otherwise_hint(['model.blocks.1.table'])}"
    ]


@pytest.mark.parametrize("attribution", ["on_divergence", "always"])
def test_a_difference_in_the_live_steps_gradients_alone_is_found_whatever_the_attribution(
    tmp_path: Path, attribution: Any
) -> None:
    # The table's first shift (step 2) is recomputed from the shifted values in the live step only: a fresh two-pass
    # rerun copies the table first, so a check that looked at its own passes alone read 0.0 there.
    weights = []
    for name, monitor in (
        ("plain", None),
        ("monitored", RecomputationMonitor(every_n_steps=1, attribution=attribution, sentinel="off")),
    ):
        pl.seed_everything(0, verbose=False)
        module = LargeTableModule()
        callbacks = [] if monitor is None else [monitor]
        strategy = (
            "auto"
            if monitor is None
            else SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["model.blocks.*"]))
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LightningCkptDeterminismWarning)
            pl.Trainer(**trainer_kwargs(tmp_path / name, max_steps=3, strategy=strategy, callbacks=callbacks)).fit(
                module
            )
        weights.append(module.state_dict())
        if monitor is not None:
            assert [(record.step, record.diverged) for record in monitor.history] == [(0, False), (1, False), (2, True)]
            assert monitor.history[2].grad_divergence > 0.0
    # Ground truth: the checkpointed fit's step 2 applied other gradients than the plain twin's.
    assert not torch.equal(weights[0]["model.blocks.1.linear.weight"], weights[1]["model.blocks.1.linear.weight"])


class ScaledInBackward(PlainBlock):
    """Scales ``tanh``'s input in its recomputation (inside a backward) only: a defect of every step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.5 if torch._C._current_graph_task_id() != -1 else 1.0
        return x + torch.tanh(self.linear(x) * scale)


def test_a_follow_up_check_within_the_tolerance_says_so_rather_than_exact(tmp_path: Path) -> None:
    monitor = RecomputationMonitor(every_n_steps=100, tolerance=1e6)
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["model.blocks.1"]))
    module = StackModule(block="PlainBlock")
    module.model.blocks[1] = ScaledInBackward()
    pl.seed_everything(0, verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LightningCkptDeterminismWarning)
        pl.Trainer(**trainer_kwargs(tmp_path, max_steps=3, strategy=strategy, callbacks=[monitor])).fit(module)
    follow_up = monitor.history[-1]
    assert [record.step for record in monitor.history] == [0, 1] and 0.0 < follow_up.grad_divergence < 1e6
    said = [str(warning.message) for warning in caught if "which a sentinel finding asked for" in str(warning.message)]
    assert said == [
        "lightning_ckpt_determinism: the full check at step 1, which a sentinel finding asked for, found the gradients"
        f" of that step within `tolerance` (grad_divergence {follow_up.grad_divergence:.3g}): no check tells a"
        " difference that small from agreement; the sentinel's finding and its region stand."
    ]


def test_a_sentinel_that_raises_at_a_checked_step_leaves_that_checks_figures_in_callback_metrics(
    tmp_path: Path,
) -> None:
    monitor = RecomputationMonitor(every_n_steps=1, tolerance=1e6, on_divergence="raise")
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["model.blocks.1"]))
    module = StackModule(block="PlainBlock")
    module.model.blocks[1] = ScaledInBackward()
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_steps=3, strategy=strategy, callbacks=[monitor]))
    with pytest.raises(RecomputationDivergenceError, match="at step 0"):
        trainer.fit(module)
    (check,) = monitor.history
    assert (check.step, check.diverged) == (0, False) and check.grad_divergence > 0.0
    assert trainer.callback_metrics["recompute/grad_divergence"].item() == pytest.approx(check.grad_divergence)
    assert trainer.callback_metrics["recompute/sentinel/mismatches"] > 0


class TableThenArmed(LargeTableModule):
    """:class:`LargeTableModule` whose last block counts when armed, on the last of every three micro-batches."""

    def __init__(self) -> None:
        super().__init__()
        self.model.blocks[2] = CountsWhenArmed()
        self.arming = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.model.blocks[2].armed = self.arming and batch_idx % 3 == 2
        return super().training_step(batch, batch_idx)

    def train_dataloader(self) -> DataLoader:
        x = torch.randn(72, DIM, generator=torch.Generator().manual_seed(2))
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)


def test_a_follow_up_check_names_only_the_buffers_read_otherwise_in_its_own_fit(tmp_path: Path) -> None:
    # Checkpointed by hand, the regions' counts outlive a fit: the second fit read no buffer otherwise.
    module = TableThenArmed()
    apply_activation_checkpointing(module, CheckpointingConfig(names=["model.blocks.*"]))
    said = []
    for fit, accumulate in ((0, 1), (1, 3)):
        module.arming = fit == 1
        monitor = RecomputationMonitor(every_n_steps=100, sentinel="exact")
        kwargs = trainer_kwargs(
            tmp_path, max_steps=4, callbacks=[monitor], log_every_n_steps=1, accumulate_grad_batches=accumulate
        )
        pl.seed_everything(0, verbose=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", LightningCkptDeterminismWarning)
            pl.Trainer(**kwargs).fit(module)
        (line,) = [str(w.message) for w in caught if "which a sentinel finding asked for" in str(w.message)]
        said.append(line)
    assert said[0].endswith(f"A cause seen this fit: {read_otherwise_hint(['model.blocks.1.table'])}")
    assert said[1].endswith("the sentinel's finding and its region stand.")
