"""The monitor's own failures end no fit and change no training: an error inside the sentinel's hooks (in a forward,
in a backward's recomputation, at a step's end) stops the sentinel with one warning, and a periodic check that
raises on one process is skipped with one warning; the fit trains on exactly as a fit without checkpointing does."""

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_ckpt_determinism import (
    CheckpointingConfig,
    LightningCkptDeterminismWarning,
    RecomputationMonitor,
    SingleDeviceCheckpointingStrategy,
    apply_activation_checkpointing,
)
from lightning_ckpt_determinism.lightning import watch
from lightning_ckpt_determinism.lightning.findings import FitSummary
from lightning_ckpt_determinism.lightning.results import CheckResults
from lightning_ckpt_determinism.lightning.step import StepCapture
from lightning_ckpt_determinism.lightning.watch import SentinelWatch
from lightning_ckpt_determinism.verify import core, live_step
from lightning_ckpt_determinism.verify.sentinel import RecomputationSentinel, observer, recomputation_sentinel
from lightning_ckpt_determinism.verify.sentinel.calls import RegionCall
from lightning_ckpt_determinism.verify.sentinel.state import RegionParameters
from lightning_ckpt_determinism.verify.sentinel.step import SentinelStep
from lightning_ckpt_determinism.verify.state import StepState
from tests.helpers import StackModule, batch, failing_from, make_stack, trained_state, trainer_kwargs

STEPS = 4


def train(tmp_path: Path, monitor: RecomputationMonitor | None) -> tuple[pl.Trainer, dict[str, torch.Tensor]]:
    """A seeded fit of a dropout stack, checkpointed under ``monitor``, or plain without one; its final weights and
    optimizer state."""
    pl.seed_everything(0, verbose=False)
    module = StackModule(lr=0.01)
    strategy = (
        SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=["DropoutBlock"]))
        if monitor is not None
        else "auto"
    )
    callbacks = [monitor] if monitor is not None else []
    trainer = pl.Trainer(
        **trainer_kwargs(
            tmp_path / str(monitor is None),
            callbacks=callbacks,
            strategy=strategy,
            max_steps=STEPS,
            log_every_n_steps=2,  # the sentinel's counts become metrics at steps 1 and 3, and are shown at 0 and 2
        )
    )
    trainer.fit(module)
    return trainer, trained_state(module, trainer)


def monitored_fit(tmp_path: Path) -> tuple[pl.Trainer, dict[str, torch.Tensor], RecomputationMonitor, list[str]]:
    """The fit under a monitor checking every step, the package's own warnings it gave (the loggerless note left
    out), and the plain twin's fit checked against it."""
    monitor = RecomputationMonitor(every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LightningCkptDeterminismWarning)
        trainer, found = train(tmp_path, monitor)
    said = [
        str(warning.message)
        for warning in caught
        if warning.category is LightningCkptDeterminismWarning and "without a logger" not in str(warning.message)
    ]
    _, plain = train(tmp_path, None)
    assert trainer.global_step == STEPS
    assert list(found) == list(plain)
    for key, expected in plain.items():
        assert torch.equal(found[key], expected), key
    return trainer, found, monitor, said


# Where the sentinel's own code runs inside the step: at a region's forward, at its end, at each recomputed tensor
# torch compares, when the step's digests are compared, and when a clean step is read; and after it, when its counts
# become the logged metrics, or are shown in `trainer.callback_metrics` between logging steps.
SENTINEL_PARTS = {
    "region_forward_start": (RegionParameters, "now", 3),
    "region_forward_end": (RegionCall, "forward_done", 2),
    "recomputed_tensor": (RegionCall, "recomputed", 4),
    "comparing_the_step": (SentinelStep, "flags", 1),
    "clean_read": (SentinelStep, "regions", 1),
    "starting_a_step": (RecomputationSentinel, "next_step", 2),
    "turning_counts_into_metrics": (SentinelWatch, "metrics", 1),
    "showing_counts_between_logs": (SentinelWatch, "so_far", 2),
}


@pytest.mark.parametrize("part", sorted(SENTINEL_PARTS))
def test_a_failure_inside_the_sentinel_stops_it_with_one_warning_and_training_is_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, part: str
) -> None:
    owner, name, call = SENTINEL_PARTS[part]
    monkeypatch.setattr(owner, name, failing_from(call, getattr(owner, name)))
    _, _, monitor, said = monitored_fit(tmp_path)
    assert said == [
        "lightning_ckpt_determinism: the sentinel stopped after a failure of its own (RuntimeError: injected);"
        " training goes on, and the periodic check still runs. Please report it."
    ]
    # The periodic check still ran at every step, and found the stack exact.
    assert [(record.step, record.grad_divergence) for record in monitor.history] == [(n, 0.0) for n in range(STEPS)]
    report = monitor.sentinel_report
    assert report is not None and report.mismatches == 0


@pytest.mark.parametrize(
    ("owner", "name", "call"),
    [
        (live_step, "compare_gradients", 2),
        (StepState, "__init__", 1),
        (StepCapture, "initialised", 2),
        (CheckResults, "record", 2),
    ],
    ids=["inside_the_check", "capturing_the_step", "before_the_check", "recording_the_check"],
)
def test_a_check_that_raises_on_one_process_is_skipped_with_one_warning_and_training_is_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, call: int
) -> None:
    monkeypatch.setattr(owner, name, failing_from(call, getattr(owner, name)))
    _, _, monitor, said = monitored_fit(tmp_path)
    failed = STEPS - (call - 1)
    history = list(monitor.history)
    assert [record.grad_divergence for record in history[: call - 1]] == [0.0] * (call - 1)
    skipped = [record.skipped or "" for record in history[call - 1 :]]
    assert len(skipped) == failed
    assert all(reason.startswith("the check failed (RuntimeError: injected, raised at ") for reason in skipped)
    (warning,) = said
    assert warning.startswith(f"lightning_ckpt_determinism: the check at step {call - 1} failed (RuntimeError:")
    assert warning.endswith(
        "and was skipped; training goes on as without the monitor. If the error is in your `training_step`, which"
        " the check runs again from the step's start, make it safe to run twice or give the monitor a `loss_fn`;"
        " otherwise please report it."
    )


def test_a_failure_setting_the_frozen_gradients_aside_gives_the_live_ones_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A check sets the live gradients aside, then the frozen parameters' ones: the second failing at the first check
    # (and the first at every later one) must leave the step's gradients for its optimizer.
    monkeypatch.setattr(core, "GradientStash", failing_from(2, core.GradientStash))
    _, _, monitor, said = monitored_fit(tmp_path)
    assert [(record.step, (record.skipped or "")[:40]) for record in monitor.history] == [
        (step, "the check failed (RuntimeError: injected") for step in range(STEPS)
    ]
    (warning,) = said
    assert warning.startswith("lightning_ckpt_determinism: the check at step 0 failed (RuntimeError: injected")


def test_a_failure_reading_the_sentinels_counts_stops_it_with_one_warning_and_training_is_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(SentinelStep, "compared", property(failing_from(2, SentinelStep.compared.fget)))
    _, _, monitor, said = monitored_fit(tmp_path)
    assert said == [
        "lightning_ckpt_determinism: the sentinel stopped after a failure of its own (RuntimeError: injected);"
        " training goes on, and the periodic check still runs. Please report it."
    ]
    assert [(record.step, record.grad_divergence) for record in monitor.history] == [(n, 0.0) for n in range(STEPS)]


# Where the monitor's own code runs at the fit's edges: the sentinel's start, and the summary's writing at its end
# (the part, its one warning, and whether the sentinel ran).
EDGE_PARTS = {
    "starting_the_sentinel": (
        observer,
        "compiled_regions",
        "lightning_ckpt_determinism: the sentinel could not start (RuntimeError: injected); training goes on without"
        " it. Please report it.",
        False,
    ),
    "writing_the_summary": (
        FitSummary,
        "text",
        "lightning_ckpt_determinism: the monitor could not write the fit's summary (RuntimeError: injected); its"
        " `history` and metrics hold what it found. Please report it.",
        True,
    ),
}


@pytest.mark.parametrize("part", sorted(EDGE_PARTS))
def test_a_failure_of_its_own_at_the_fits_edges_leaves_the_fit_training_unchanged_and_checked_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, part: str
) -> None:
    owner, name, warning, sentinel_ran = EDGE_PARTS[part]
    monkeypatch.setattr(owner, name, failing_from(1, getattr(owner, name)))
    _, _, monitor, said = monitored_fit(tmp_path)
    assert said == [warning]
    assert [(record.step, record.grad_divergence) for record in monitor.history] == [(n, 0.0) for n in range(STEPS)]
    report = monitor.sentinel_report
    assert (report is not None and report.mismatches == 0) if sentinel_ran else report is None


def test_a_failure_turning_the_last_logged_counts_into_metrics_is_said_at_the_fits_end_where_no_read_follows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As on a rank of several: the failure waits for the next read, and the fit's last read has no record to read.
    deferred = SentinelWatch.failed

    def as_on_several_ranks(self: SentinelWatch, error: Exception, *, several_ranks: bool) -> None:
        deferred(self, error, several_ranks=True)

    monkeypatch.setattr(SentinelWatch, "failed", as_on_several_ranks)
    monkeypatch.setattr(SentinelWatch, "metrics", failing_from(2, SentinelWatch.metrics))  # at step 3, the last
    _, _, monitor, said = monitored_fit(tmp_path)
    assert said == [
        "lightning_ckpt_determinism: the sentinel stopped after a failure of its own (RuntimeError: injected);"
        " training goes on, and the periodic check still runs. Please report it."
    ]
    assert [(record.step, record.grad_divergence) for record in monitor.history] == [(n, 0.0) for n in range(STEPS)]


def test_a_lightning_whose_logging_interval_cannot_be_read_trains_checked_with_the_counts_in_callback_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def renamed(trainer: pl.Trainer) -> bool:
        raise AttributeError("'_TrainingEpochLoop' object has no attribute '_batches_that_stepped'")

    monkeypatch.setattr(watch, "lightning_logs_this_batch", renamed)
    trainer, _, monitor, said = monitored_fit(tmp_path)
    assert said == [
        "lightning_ckpt_determinism: the monitor could not read which batches Lightning logs at (AttributeError:"
        " '_TrainingEpochLoop' object has no attribute '_batches_that_stepped'); the sentinel's counts reach"
        " `trainer.callback_metrics` at check steps and epoch ends, and the loggers at the fit's end. Please report it."
    ]
    assert [(record.step, record.grad_divergence) for record in monitor.history] == [(n, 0.0) for n in range(STEPS)]
    report = monitor.sentinel_report
    assert report is not None and report.compared > 0 and report.mismatches == 0
    # No step was logged: the counts shown cover the whole fit.
    assert float(trainer.callback_metrics["recompute/sentinel/mismatches"]) == 0.0
    assert float(trainer.callback_metrics["recompute/sentinel/compared"]) == report.compared
    assert float(trainer.callback_metrics["recompute/sentinel/compared_per_step"]) == report.compared / STEPS


def test_a_standalone_sentinel_that_fails_in_a_backward_leaves_the_gradients_exact_and_names_its_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(RegionCall, "recomputed", failing_from(1, RegionCall.recomputed))
    x, y = batch()
    gradients = []
    for checkpointed in (False, True):
        model = make_stack()
        if checkpointed:
            apply_activation_checkpointing(model, CheckpointingConfig(classes=["DropoutBlock"]))
        torch.manual_seed(3)
        with recomputation_sentinel(model) as sentinel:
            torch.nn.functional.mse_loss(model(x), y).backward()
        gradients.append([param.grad for param in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*gradients, strict=True))
    assert isinstance(sentinel.failure, RuntimeError) and str(sentinel.failure) == "injected"
    with pytest.raises(RuntimeError, match=r"^injected$"):
        sentinel.end_step()


class FailsOnItsNthCall:
    """A monitor's ``loss_fn`` that raises on its ``n``-th call: the user's own code, not safe to run twice."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def __call__(self, module: pl.LightningModule, batch: Any, batch_idx: int) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.n:
            raise ValueError(f"loss_fn failed on call {self.n}")
        x, y = batch
        return torch.nn.functional.mse_loss(module.model(x), y)


@pytest.mark.parametrize("n", [1, 2], ids=["reference pass", "checkpointed pass"])
def test_the_users_code_failing_in_either_pass_of_a_check_is_a_skipped_check_not_a_divergence(
    tmp_path: Path, n: int
) -> None:
    # The two-pass check (a `loss_fn` under automatic optimization) reruns it as its reference pass, then as its
    # checkpointed pass: a failure in either, before any recomputation, says nothing about recomputation.
    monitor = RecomputationMonitor(every_n_steps=1, loss_fn=FailsOnItsNthCall(n), on_divergence="raise")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LightningCkptDeterminismWarning)
        trainer, found = train(tmp_path, monitor)
    _, plain = train(tmp_path, None)
    assert trainer.global_step == STEPS
    assert all(torch.equal(found[key], expected) for key, expected in plain.items())
    first, *later = monitor.history
    assert not first.diverged
    assert first.skipped is not None and first.skipped.startswith(
        f"the check failed (ValueError: loss_fn failed on call {n}, raised at "
    )
    assert [(record.diverged, record.grad_divergence) for record in later] == [(False, 0.0)] * (STEPS - 1)
    said = [str(w.message) for w in caught if "the check at step 0 failed" in str(w.message)]
    assert len(said) == 1
