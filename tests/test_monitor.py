import copy
import csv
import functools
import io
import math
import random
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.plugins import MixedPrecision, Precision
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.nn import functional as F

from lightning_ckpt_determinism import (
    CheckpointingConfig,
    CheckpointingConfigError,
    FSDPCheckpointingStrategy,
    LightningCkptDeterminismWarning,
    RecomputationDivergenceError,
    RecomputationMonitor,
    RecomputationReport,
    SingleDeviceCheckpointingStrategy,
)
from lightning_ckpt_determinism.lightning import checks as checks_module
from lightning_ckpt_determinism.lightning.support import StrategySupport
from tests.helpers import (
    DIM,
    BatchOnlyModule,
    CollectingModule,
    FailingRecomputeBlock,
    GradientPenaltyModule,
    HeldNoiseModule,
    ManualModule,
    MaskingModule,
    MomentumTeacherModule,
    NumpyNoiseBlock,
    OwnBackwardModule,
    PlainBlock,
    PlainMetricsModule,
    ReentrantHeadModule,
    SkipsOnItsSecondCallModule,
    StackModule,
    ValidatedStackModule,
    WarmupModule,
    manual_loss,
    trainer_kwargs,
)


def fit(tmp_path, module=None, monitor=None, block="DropoutBlock", checkpointing=True, **overrides):
    pl.seed_everything(0, verbose=False)
    module = module if module is not None else StackModule(block=block)
    strategy = (
        SingleDeviceCheckpointingStrategy(
            checkpointing=CheckpointingConfig(classes=[block], **overrides.pop("config", {}))
        )
        if checkpointing
        else "auto"
    )
    callbacks = [monitor] if monitor is not None else []
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, callbacks=callbacks, strategy=strategy, **overrides))
    trainer.fit(module)
    return trainer, module


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every_n_steps": 0}, r"`every_n_steps` must be an integer >= 1, got 0\."),
        ({"tolerance": -1}, r"`tolerance` must be a non-negative float, got -1\."),
        ({"tolerance": float("inf")}, r"`tolerance` must be a finite non-negative float, got inf: an infinite"),
        ({"on_divergence": "stop"}, r"`on_divergence` can be warn, raise, ignore, got 'stop'\."),
        ({"loss_fn": 3}, r"`loss_fn` must be callable, got int\."),
        (
            {"loss_fn": lambda module, batch: batch},
            r"`loss_fn` must take \(module, batch, batch_idx\), got a function of \(module, batch\)\.",
        ),
        (
            {"loss_fn": nn.MSELoss()},
            r"`loss_fn` must take \(module, batch, batch_idx\) and return the step's loss, got the loss criterion"
            r" MSELoss: give a function",
        ),
        ({"loss_fn": F.mse_loss}, r"`loss_fn` must take .* got the loss criterion mse_loss: give a function"),
        ({"log_prefix": ""}, r"`log_prefix` must be a non-empty string, got ''\."),
        ({"log_prefix": 5}, r"`log_prefix` must be a non-empty string, got 5\."),
        (
            {"log_prefix": "recompute/"},
            r"`log_prefix` must not start or end with '/', got 'recompute/': metrics are named"
            r" `log_prefix/grad_divergence`; write 'recompute'\.",
        ),
        ({"history_size": 0}, r"`history_size` must be an integer >= 1, got 0\."),
        ({"attribution": "sometimes"}, r"`attribution` can be on_divergence, always, never, got 'sometimes'\."),
        ({"calibrate_noise": 1}, r"`calibrate_noise` must be True or False, got 1\."),
        ({"every_n_steps": True}, r"`every_n_steps` must be an integer >= 1, got True\."),
        ({"reference_regions": 0}, r"`reference_regions` must be None, 'auto' or an integer >= 1, got 0\."),
        ({"sentinel": "always"}, r"`sentinel` can be light, sampled, exact, off, got 'always'\."),
        ({"sentinel_every_n_steps": 0}, r"`sentinel_every_n_steps` must be an integer >= 1, got 0\."),
        (
            {"sentinel": "off", "sentinel_every_n_steps": 5},
            r"`sentinel_every_n_steps`=5 paces the sentinel, which `sentinel`='off' turns off; choose a tier",
        ),
        (
            {"exclude_attributes": 5},
            r"`exclude_attributes` must be a list of attribute names \(non-empty strings\), got 5\.",
        ),
        ({"exclude_attributes": "steps"}, r"`exclude_attributes` must be a list .*, got 'steps'\."),
        ({"exclude_attributes": ["steps", ""]}, r"`exclude_attributes` must be a list .*, got \['steps', ''\]\."),
        ({"exclude_attributes": [1]}, r"`exclude_attributes` must be a list .*, got \[1\]\."),
    ],
)
def test_each_argument_is_checked_with_the_config_error(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(CheckpointingConfigError, match=f"^{message}"):
        RecomputationMonitor(**kwargs)  # type: ignore[arg-type]


def test_exclude_attributes_takes_any_collection_of_names() -> None:
    assert sorted(RecomputationMonitor(exclude_attributes=("steps", "seen")).exclude_attributes) == ["seen", "steps"]
    assert RecomputationMonitor(exclude_attributes={"steps"}).exclude_attributes == ["steps"]


def test_checks_first_step_then_every_n_optimizer_steps(tmp_path):
    monitor = RecomputationMonitor(every_n_steps=3)
    fit(tmp_path, monitor=monitor, max_steps=7)
    assert [entry.step for entry in monitor.history] == [0, 3, 6]
    assert all(entry.grad_divergence == 0.0 and not entry.diverged for entry in monitor.history)
    assert monitor.last_checked_step == 6


def test_gradient_accumulation_checks_once_per_optimizer_step(tmp_path):
    monitor = RecomputationMonitor(every_n_steps=2)
    fit(tmp_path, monitor=monitor, max_steps=4, accumulate_grad_batches=2)
    assert [entry.step for entry in monitor.history] == [0, 2]


def test_divergence_warns_naming_the_worst_parameters_again_every_n_steps_checks(tmp_path):
    monitor = RecomputationMonitor(every_n_steps=2, sentinel="off")
    with pytest.warns(LightningCkptDeterminismWarning, match=r"recomputation diverged at step \d: grad_div") as rec:
        fit(tmp_path, monitor=monitor, config={"preserve_rng_state": False}, max_steps=8)
    messages = [str(w.message) for w in rec if "recomputation diverged" in str(w.message)]
    # Four checks (steps 0, 2, 4, 6), each diverging: a warning at the first, and again two checks later.
    assert [message.split(":")[1].strip() for message in messages] == [
        f"recomputation diverged at step {step}" for step in (0, 4)
    ]
    assert "The worst parameters: model." in messages[0]
    assert len(monitor.history) == 4
    assert all(entry.diverged and entry.grad_divergence > 0 for entry in monitor.history)


def test_divergence_raises_in_raise_mode_with_the_check_shown_in_callback_metrics(tmp_path):
    monitor = RecomputationMonitor(every_n_steps=1, on_divergence="raise")
    config = CheckpointingConfig(classes=["DropoutBlock"], preserve_rng_state=False)
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=config)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, callbacks=[monitor], strategy=strategy))
    with pytest.raises(RecomputationDivergenceError, match="recomputation diverged at step 0"):
        trainer.fit(StackModule(block="DropoutBlock"))
    [record] = monitor.history
    assert record.diverged and record.grad_divergence > 0
    assert float(trainer.callback_metrics["recompute/grad_divergence"]) == pytest.approx(record.grad_divergence)


def test_ignore_mode_only_records_the_metric(tmp_path):
    monitor = RecomputationMonitor(every_n_steps=2, on_divergence="ignore")
    with warnings.catch_warnings():
        warnings.simplefilter("error", LightningCkptDeterminismWarning)
        fit(tmp_path, monitor=monitor, config={"preserve_rng_state": False}, logger=CSVLogger(tmp_path))
    assert [entry.diverged for entry in monitor.history] == [True, True]


def test_metric_is_written_to_tensorboard(tmp_path):
    monitor = RecomputationMonitor(every_n_steps=2)
    fit(tmp_path, monitor=monitor, max_steps=5, logger=TensorBoardLogger(tmp_path, name="tb"))
    accumulator = EventAccumulator(str(tmp_path / "tb" / "version_0")).Reload()
    assert "recompute/grad_divergence" in accumulator.Tags()["scalars"]
    events = accumulator.Scalars("recompute/grad_divergence")
    assert [(e.step, e.value) for e in events] == [(0, 0.0), (2, 0.0), (4, 0.0)]
    assert [e.value for e in accumulator.Scalars("recompute/max_abs_diff")] == [0.0, 0.0, 0.0]


def test_log_prefix_names_the_metrics(tmp_path):
    monitor = RecomputationMonitor(every_n_steps=10, log_prefix="ac_check", on_divergence="ignore")
    fit(tmp_path, monitor=monitor, logger=CSVLogger(tmp_path), config={"preserve_rng_state": False})
    rows = read_csv(tmp_path / "lightning_logs" / "version_0" / "metrics.csv")
    checked = [row for row in rows if row.get("ac_check/grad_divergence")]
    assert [row["step"] for row in checked] == ["0"]
    assert float(checked[0]["ac_check/grad_divergence"]) > 0


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path) as file:
        return list(csv.DictReader(file))


def read_training_metrics(log_dir: Path) -> list[dict[str, str]]:
    rows = read_csv(log_dir / "metrics.csv")
    return [
        {key: value for key, value in row.items() if not key.startswith("recompute/") and value}
        for row in rows
        if row.get("train/loss")
    ]


class StaticLossScale(Precision):
    """Scales the loss by 8 in ``pre_backward`` and the gradients back before each optimizer step."""

    def pre_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:  # type: ignore[override]
        return super().pre_backward(tensor * 8.0, module)

    def optimizer_step(self, optimizer, model, closure, **kwargs):  # type: ignore[no-untyped-def,override]
        def unscaled() -> object:
            loss = closure()
            for group in optimizer.param_groups:
                for parameter in group["params"]:
                    if parameter.grad is not None:
                        parameter.grad.div_(8.0)
            return loss

        return optimizer.step(unscaled, **kwargs)


# Each makes the Trainer arguments of one way to train (plugins hold state, so every run gets new ones).
TRAINING_SETUPS: dict[str, Callable[[], dict]] = {
    "plain": dict,
    "accumulate_3": lambda: {"accumulate_grad_batches": 3},
    "accumulate_2_clipping": lambda: {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05},
    "bf16_mixed": lambda: {"precision": "bf16-mixed"},
    # On CPU `precision="16-mixed"` becomes bf16: the plugin gives fp16 autocast with a GradScaler.
    "fp16_grad_scaler": lambda: {"plugins": [MixedPrecision("16-mixed", "cpu")]},
    "static_loss_scale": lambda: {"plugins": [StaticLossScale()]},
}


@pytest.mark.parametrize("setup", sorted(TRAINING_SETUPS))
@pytest.mark.parametrize("block", ["DropoutBlock", "BatchNormBlock"])
def test_training_is_bit_identical_with_the_monitor(tmp_path, setup, block):
    runs = {}
    for name, monitor in (("plain", None), ("monitored", RecomputationMonitor(every_n_steps=1))):
        trainer, module = fit(
            tmp_path / name,
            monitor=monitor,
            block=block,
            max_steps=5,
            logger=CSVLogger(tmp_path / name, name="logs"),
            log_every_n_steps=1,
            **TRAINING_SETUPS[setup](),
        )
        runs[name] = (trainer, module)
    (plain_trainer, plain), (monitored_trainer, monitored) = runs["plain"], runs["monitored"]
    history = monitored_trainer.callbacks[0].history  # type: ignore[attr-defined]
    assert [entry.grad_divergence for entry in history if entry.skipped is None] == [0.0] * len(
        [entry for entry in history if entry.skipped is None]
    )
    assert len(history) == 5
    assert list(plain.state_dict()) == list(monitored.state_dict())
    for (key, expected), actual in zip(plain.state_dict().items(), monitored.state_dict().values(), strict=True):
        assert torch.equal(expected, actual), key
    plain_opt = plain_trainer.optimizers[0].state_dict()["state"]
    monitored_opt = monitored_trainer.optimizers[0].state_dict()["state"]
    for index, state in plain_opt.items():
        assert torch.equal(state["momentum_buffer"], monitored_opt[index]["momentum_buffer"])
    plain_metrics = read_training_metrics(tmp_path / "plain" / "logs" / "version_0")
    assert len(plain_metrics) >= 5
    assert plain_metrics == read_training_metrics(tmp_path / "monitored" / "logs" / "version_0")
    assert torch.equal(plain_trainer.callback_metrics["train/loss"], monitored_trainer.callback_metrics["train/loss"])
    scaler = getattr(plain_trainer.strategy.precision_plugin, "scaler", None)
    if scaler is not None:
        other = monitored_trainer.strategy.precision_plugin.scaler
        assert scaler.state_dict() == other.state_dict()


class _StepCounter(pl.Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_start(self, *args: object) -> None:
        self.steps += 1


def test_a_fit_without_a_checkpointed_module_stops_at_fit_start_saying_what_to_add(tmp_path):
    # It warned and trained unprotected before; a monitor that cannot check stops the fit before its first step.
    monitor, counter = RecomputationMonitor(every_n_steps=1), _StepCounter()
    module = StackModule()
    weights = {key: value.clone() for key, value in module.state_dict().items()}
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, callbacks=[counter, monitor], max_steps=2))
    with pytest.raises(CheckpointingConfigError, match=r"^`RecomputationMonitor` has nothing to check") as raised:
        trainer.fit(module)
    message = str(raised.value)
    assert message.startswith(
        "`RecomputationMonitor` has nothing to check: no module of StackModule is checkpointed at fit start under"
        ' SingleDeviceStrategy. Add a checkpointing strategy (e.g. `strategy="single_device_checkpointing"` or'
        ' `"ddp_checkpointing"`, which checkpoint `classes="auto"`, or'
        " `DDPCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=[YourBlock]))`;"
    )
    assert "`apply_activation_checkpointing` in `configure_model`" in message
    assert "\n" not in message
    assert counter.steps == 0
    assert trainer.global_step == 0
    assert all(torch.equal(weights[key], value) for key, value in module.state_dict().items())
    assert list(monitor.history) == []


def test_custom_loss_fn_replaces_training_step(tmp_path):
    calls = []

    def loss_fn(module, batch, batch_idx):
        calls.append(batch_idx)
        x, y = batch
        return F.l1_loss(module(x), y)

    monitor = RecomputationMonitor(every_n_steps=2, loss_fn=loss_fn)
    fit(tmp_path, monitor=monitor)
    assert calls == [0, 0, 2, 2]  # reference and checkpointed pass at steps 0 and 2
    assert monitor.last_report is not None
    assert monitor.last_report.reference_loss > 0


def test_manual_optimization_needs_a_loss_fn(tmp_path):
    with pytest.raises(ValueError, match="`RecomputationMonitor` needs `loss_fn` with manual optimization"):
        fit(tmp_path, module=ManualModule(), monitor=RecomputationMonitor())
    monitor = RecomputationMonitor(every_n_steps=2, loss_fn=manual_loss)
    _, monitored = fit(tmp_path, module=ManualModule(), monitor=monitor)
    assert [(entry.step, entry.grad_divergence) for entry in monitor.history] == [(0, 0.0), (2, 0.0)]
    _, plain = fit(tmp_path / "plain", module=ManualModule())
    for (key, expected), actual in zip(plain.state_dict().items(), monitored.state_dict().values(), strict=True):
        assert torch.equal(expected, actual), key
    broken = RecomputationMonitor(every_n_steps=2, loss_fn=manual_loss, on_divergence="ignore")
    fit(tmp_path / "broken", module=ManualModule(), monitor=broken, config={"preserve_rng_state": False})
    assert all(entry.grad_divergence > 0.0 for entry in broken.history)


def test_a_loss_fn_that_runs_no_region_skips_the_check_rather_than_find_it_exact(tmp_path):
    # Its two passes ran the same computation: their equal gradients proved nothing, and the check read 0.0.
    def head_only(module, batch, batch_idx):
        x, y = batch
        return F.mse_loss(module.model.head(x), y)

    monitor = RecomputationMonitor(every_n_steps=2, loss_fn=head_only, sentinel="off")
    with pytest.warns(LightningCkptDeterminismWarning) as caught:
        _, monitored = fit(tmp_path, monitor=monitor, config={"preserve_rng_state": False})
    [line] = [str(w.message) for w in caught if "the check at step 0 was skipped" in str(w.message)]
    assert "its passes, `loss_fn`, recomputed no checkpointed region" in line
    # Skipped at the steps a check was due, not retried at every step in between (two passes each).
    assert [(entry.step, entry.skipped) for entry in monitor.history] == [
        (step, "the check's passes recomputed no checkpointed region") for step in (0, 2)
    ]
    _, unmonitored = fit(tmp_path / "plain", config={"preserve_rng_state": False})
    for (key, expected), actual in zip(unmonitored.state_dict().items(), monitored.state_dict().values(), strict=True):
        assert torch.equal(expected, actual), key


@pytest.mark.parametrize("manual", [False, True])
def test_a_loss_fn_returning_none_skips_the_check_with_a_line_naming_loss_fn(tmp_path, manual):
    monitor = RecomputationMonitor(loss_fn=lambda module, batch, batch_idx: None)
    module = ManualModule() if manual else StackModule()
    with pytest.warns(LightningCkptDeterminismWarning) as caught:
        _, monitored = fit(tmp_path, module=module, monitor=monitor)
    [line] = [str(w.message) for w in caught if "the check at step 0 failed" in str(w.message)]
    assert "(TypeError: `loss_fn` returned NoneType: return the step's loss, a tensor of one element" in line
    assert "If the error is in your `loss_fn`, which the check calls as `loss_fn(module, batch, batch_idx)`" in line
    assert "give the monitor a `loss_fn`" not in line
    assert line.count("lightning_ckpt_determinism:") == 1
    _, plain = fit(tmp_path / "plain", module=ManualModule() if manual else StackModule())
    for (key, expected), actual in zip(plain.state_dict().items(), monitored.state_dict().values(), strict=True):
        assert torch.equal(expected, actual), key


class HalvedManualModule(ManualModule):
    """Accumulates two batches by hand: ``manual_backward(loss / 2)``, an optimizer step every second batch."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        loss = StackModule.training_step(self, batch, batch_idx)
        self.manual_backward(loss / 2)
        if batch_idx % 2 == 1:
            optimizer.step()  # type: ignore[union-attr]
            optimizer.zero_grad()  # type: ignore[union-attr]
        return loss


def test_a_loss_fn_returning_another_loss_than_manual_backward_got_is_named_not_blamed_on_recomputation(tmp_path):
    monitor = RecomputationMonitor(every_n_steps=1, loss_fn=manual_loss, on_divergence="ignore", sentinel="off")
    _, monitored = fit(tmp_path, module=HalvedManualModule(), monitor=monitor)
    report = monitor.last_report
    assert report is not None and report.diverged and report.cause == "outside_state"
    assert report.reference_loss == pytest.approx(2 * report.checkpointed_loss, rel=1e-6)
    assert report.hint is not None
    assert report.hint.startswith("Under manual optimization the check reruns `loss_fn`, which returned another loss")
    assert not any(region.diverged for region in report.regions)  # attribution found every region exact
    halved = RecomputationMonitor(
        every_n_steps=1, loss_fn=lambda module, batch, index: manual_loss(module, batch, index) / 2
    )
    _, clean = fit(tmp_path / "halved", module=HalvedManualModule(), monitor=halved)
    assert [entry.grad_divergence for entry in halved.history] == [0.0] * len(halved.history) != []
    _, plain = fit(tmp_path / "plain", module=HalvedManualModule())
    for model in (monitored, clean):
        for (key, expected), actual in zip(plain.state_dict().items(), model.state_dict().values(), strict=True):
            assert torch.equal(expected, actual), key


def test_the_loss_fn_hint_reads_alike_on_every_rank_so_the_warning_says_it_once() -> None:
    # Each rank's losses differ (their own batches); a hint holding them would be said once per rank, unnamed.
    hints = {
        checks_module._with_manual_loss_hint(
            RecomputationReport(0.5, 0.5, diverged=True, tolerance=0.0, reference_loss=2 * loss, checkpointed_loss=loss)
        ).hint
        for loss in (1.5, 2.25)
    }
    assert len(hints) == 1


class ManualPenaltyModule(ManualModule, GradientPenaltyModule):
    """:class:`ManualModule`'s step over :class:`GradientPenaltyModule`'s loss: the regions recompute inside
    ``training_step``, before ``manual_backward``."""


def _penalty_loss(module: pl.LightningModule, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
    return GradientPenaltyModule.training_step(module, batch, batch_idx)  # type: ignore[arg-type]


def test_a_manual_step_that_recomputes_before_its_loss_is_not_blamed_on_outside_state(tmp_path):
    # The penalty recomputes the regions (NumPy noise in each) before the loss: its differing loss is recomputation's.
    monitor = RecomputationMonitor(
        every_n_steps=1, loss_fn=_penalty_loss, on_divergence="ignore", sentinel="off", attribution="never"
    )
    fit(tmp_path, module=ManualPenaltyModule("NumpyNoiseBlock"), monitor=monitor, block="NumpyNoiseBlock", max_steps=1)
    report = monitor.last_report
    assert report is not None and report.diverged and report.cause != "outside_state"
    assert report.checkpointed_loss != report.reference_loss


def _weighted(loss: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A decorator whose wrapper takes ``(module, batch, batch_idx)`` and gives ``loss`` a weight besides."""

    @functools.wraps(loss)
    def wrapper(module: pl.LightningModule, batch: Any, batch_idx: int) -> torch.Tensor:
        return loss(module, batch, batch_idx, 0.5)

    return wrapper


@_weighted
def _weighted_loss(module: pl.LightningModule, batch: Any, batch_idx: int, weight: float) -> torch.Tensor:
    return weight * manual_loss(module, batch, batch_idx)


class _LossObject:
    def __call__(self, module: pl.LightningModule, batch: Any, batch_idx: int) -> torch.Tensor:
        return manual_loss(module, batch, batch_idx)


@pytest.mark.parametrize(
    "loss_fn",
    [
        _weighted_loss,
        functools.partial(lambda scale, module, batch, batch_idx: scale * manual_loss(module, batch, batch_idx), 1.0),
        _LossObject(),
        lambda *args: manual_loss(*args),
    ],
    ids=["a decorator's wrapper", "a partial", "a callable object", "a lambda of *args"],
)
def test_a_loss_fn_callable_as_module_batch_batch_idx_is_taken(loss_fn: Callable[..., torch.Tensor]) -> None:
    assert RecomputationMonitor(loss_fn=loss_fn).loss_fn is loss_fn


def test_state_is_saved_in_and_restored_from_lightning_checkpoints(tmp_path):
    monitor = RecomputationMonitor(every_n_steps=1, history_size=2)
    trainer, _ = fit(tmp_path, monitor=monitor)
    assert [entry.step for entry in monitor.history] == [2, 3]
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["callbacks"][monitor.state_key]
    assert saved == {"last_checked_step": 3, "history": [asdict(entry) for entry in monitor.history], "checks": 4}

    resumed = RecomputationMonitor(every_n_steps=1, history_size=2)
    pl.seed_everything(0, verbose=False)
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=["DropoutBlock"]))
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_steps=6, callbacks=[resumed], strategy=strategy))
    trainer.fit(StackModule(), ckpt_path=path)
    assert [entry.step for entry in resumed.history] == [4, 5]
    assert resumed.last_checked_step == 5


def test_state_key_distinguishes_instances():
    assert RecomputationMonitor(every_n_steps=5).state_key != RecomputationMonitor(every_n_steps=50).state_key


def test_check_runs_in_train_mode_under_the_trainers_precision_context(tmp_path):
    seen = []

    def loss_fn(module, batch, batch_idx):
        x, y = batch
        out = module(x)
        seen.append((module.training, torch.is_autocast_enabled("cpu"), out.dtype, x.device.type))
        return F.mse_loss(out.float(), y)

    monitor = RecomputationMonitor(every_n_steps=10, loss_fn=loss_fn)
    fit(tmp_path, monitor=monitor, precision="bf16-mixed")
    assert seen == [(True, True, torch.bfloat16, "cpu")] * 2
    assert monitor.last_report is not None
    assert monitor.last_report.grad_divergence == 0.0


class SkipFirstBatchModule(StackModule):
    def __init__(self) -> None:
        super().__init__()
        self.batches_seen: list[int] = []

    def training_step(self, batch, batch_idx):
        self.batches_seen.append(batch_idx)
        return None if batch_idx == 0 else super().training_step(batch, batch_idx)


def test_a_skipped_training_step_is_not_checked(tmp_path):
    module = SkipFirstBatchModule()
    monitor = RecomputationMonitor(every_n_steps=10)
    fit(tmp_path, module=module, monitor=monitor, max_steps=2)
    # Batch 0 skips (no backward, so no check); batch 1 is checked. The reference pass's call to `training_step`
    # appended to the list too, and the check put the list back as the live step left it.
    assert module.batches_seen == [0, 1]
    assert [entry.step for entry in monitor.history] == [1]
    assert monitor.last_report is not None and monitor.last_report.grad_divergence == 0.0


@pytest.mark.parametrize("block", ["BatchNormBlock", "DropoutBlock"])
def test_a_gradient_penalty_trains_with_the_monitor_and_logs_zero(tmp_path, block):
    monitor = RecomputationMonitor(every_n_steps=1, attribution="always")
    logger = CSVLogger(tmp_path)
    _, module = fit(tmp_path, module=GradientPenaltyModule(block=block), monitor=monitor, block=block, logger=logger)
    assert [entry.grad_divergence for entry in monitor.history] == [0.0] * 4
    assert monitor.last_report is not None
    assert [region.recomputations for region in monitor.last_report.regions] == [2] * 3
    with open(Path(logger.log_dir) / "metrics.csv") as file:
        logged = [
            float(row["recompute/grad_divergence"]) for row in csv.DictReader(file) if row["recompute/grad_divergence"]
        ]
    assert logged == [0.0] * 4
    # The same training without checkpointing and without the monitor ends with the same weights.
    _, plain = fit(tmp_path / "plain", module=GradientPenaltyModule(block=block), block=block, checkpointing=False)
    assert all(
        torch.equal(a, b) for a, b in zip(module.state_dict().values(), plain.state_dict().values(), strict=True)
    )


def test_host_rng_under_a_gradient_penalty_is_named_on_its_regions_not_as_outside_state(tmp_path):
    # The penalty's backward recomputes every region inside `training_step`, before the loss: the live loss differs
    # from the reference's through recomputation itself, so it is no sign of state outside the regions.
    monitor = RecomputationMonitor(every_n_steps=1)
    module = GradientPenaltyModule(block="NumpyNoiseBlock")
    with pytest.warns(LightningCkptDeterminismWarning) as caught:
        fit(tmp_path, module=module, monitor=monitor, block="NumpyNoiseBlock", max_steps=2)
    said = [str(warning.message) for warning in caught if "recomputation diverged at step" in str(warning.message)]
    assert len(said) == 2  # each step checked
    assert all("cause host_rng" in line and "Recomputation is not the cause" not in line for line in said)
    report = monitor.last_report
    assert report is not None and report.diverged and report.cause is None
    assert {(region.name, region.cause) for region in report.regions if region.diverged} == {
        (f"model.blocks.{index}", "host_rng") for index in range(3)
    }


@pytest.mark.parametrize(
    ("block", "config"), [("DropoutBlock", {"preserve_rng_state": False}), ("NumpyNoiseBlock", {})]
)
def test_training_of_a_defective_model_is_unchanged_by_the_monitor(tmp_path, block, config):
    # Its recomputation draws random numbers the reference pass does not: the check must still leave every stream
    # where the live step left it.
    modules = []
    for name, monitor in (
        ("plain", None),
        ("monitored", RecomputationMonitor(every_n_steps=1, on_divergence="ignore")),
    ):
        np.random.seed(0)
        _, module = fit(tmp_path / name, monitor=monitor, block=block, config=config)
        modules.append(module)
        if monitor is not None:
            assert all(entry.diverged and entry.grad_divergence > 0 for entry in monitor.history)
    for (key, expected), actual in zip(modules[0].state_dict().items(), modules[1].state_dict().values(), strict=True):
        assert torch.equal(expected, actual), key


# Training code the check must leave undisturbed: it reruns the step from what the step started with.
PATTERNS = {
    "in_place_batch_masking": MaskingModule,
    "warmup_counter": WarmupModule,
    "collected_outputs": CollectingModule,
    "training_step_without_batch_idx": BatchOnlyModule,
    "reentrant_checkpoint_elsewhere": ReentrantHeadModule,
    "generators_and_a_tensor_attribute": HeldNoiseModule,
    "own_backward": OwnBackwardModule,
}


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_training_code_patterns_train_bit_identically_and_log_zero(tmp_path, pattern):
    modules = []
    for name, monitor in (("plain", None), ("monitored", RecomputationMonitor(every_n_steps=1))):
        _, module = fit(tmp_path / name, module=PATTERNS[pattern](), monitor=monitor)
        modules.append(module)
        if monitor is not None:
            assert [entry.grad_divergence for entry in monitor.history] == [0.0] * 4
    plain, monitored = modules
    for (key, expected), actual in zip(plain.state_dict().items(), monitored.state_dict().values(), strict=True):
        assert torch.equal(expected, actual), key
    for counter in ("steps_seen", "backward_calls", "hooks_seen"):
        assert vars(plain).get(counter) == vars(monitored).get(counter), counter
    if pattern == "collected_outputs":
        assert len(monitored.collected) == len(plain.collected) == 4
        assert all(torch.equal(a, b) for a, b in zip(plain.collected, monitored.collected, strict=True))


@pytest.mark.parametrize("module_class", [BatchOnlyModule, ReentrantHeadModule])
def test_attribution_names_the_region_under_awkward_training_code(tmp_path, module_class):
    monitor = RecomputationMonitor(every_n_steps=1, on_divergence="ignore")
    fit(tmp_path, module=module_class(), monitor=monitor, max_steps=1, config={"preserve_rng_state": False})
    report = monitor.last_report
    assert report is not None and report.diverged
    assert [(region.name, region.cause) for region in report.regions] == [
        (f"model.blocks.{index}", "rng_not_preserved") for index in range(3)
    ]


class FrozenModule(StackModule):
    """Every parameter frozen; the loss still needs grad (through its input), so backward runs and fills nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.requires_grad_(False)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.model(x.requires_grad_(True)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


def test_a_check_that_compares_no_gradient_is_an_error_finding_not_zero(tmp_path):
    monitor = RecomputationMonitor(every_n_steps=1, on_divergence="raise")
    with pytest.raises(RecomputationDivergenceError, match="the check could not compare gradients: no parameter"):
        fit(tmp_path, module=FrozenModule(), monitor=monitor, max_steps=1)
    assert monitor.last_report is not None
    assert monitor.last_report.grad_divergence == math.inf


def test_reference_regions_rotate_and_find_a_defect_in_one_block_within_a_cycle(tmp_path):
    module = StackModule(block="PlainBlock", n=4)
    module.model.blocks[2] = NumpyNoiseBlock()
    monitor = RecomputationMonitor(every_n_steps=1, reference_regions=1, on_divergence="ignore", attribution="never")
    fit(tmp_path, module=module, monitor=monitor, block="PlainBlock", max_steps=4, config={"names": ["model.blocks.2"]})
    checked = [entry.checked_regions for entry in monitor.history]
    assert checked == [["model.blocks.0"], ["model.blocks.1"], ["model.blocks.2"], ["model.blocks.3"]]
    # While the noise block stays checkpointed in the reference, it carries the same error as the live step; the
    # check that runs it plainly finds it in the gradients. Its recomputation draws from NumPy again at every step,
    # which every check sees in the stream the live backward moved (`host_rng`, with exact gradients elsewhere).
    assert [entry.grad_divergence > 0.0 for entry in monitor.history] == [False, False, True, False]
    assert [entry.diverged for entry in monitor.history] == [True] * 4
    assert monitor.last_report is not None and monitor.last_report.cause == "host_rng"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Lightning's FSDP needs a CUDA device")
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_fsdp1_monitor_logs_zero_when_clean_and_a_positive_divergence_on_a_defect_and_changes_no_weight(
    tmp_path, use_orig_params
):
    for name, config in (("clean", {}), ("defect", {"preserve_rng_state": False})):
        fits = {}
        monitor = RecomputationMonitor(every_n_steps=1, on_divergence="ignore")
        for monitored in (True, False):
            strategy = FSDPCheckpointingStrategy(
                checkpointing=CheckpointingConfig(classes=["DropoutBlock"], **config), use_orig_params=use_orig_params
            )
            pl.seed_everything(0, verbose=False)
            kwargs = trainer_kwargs(tmp_path / f"{name}_{monitored}", accelerator="cuda", devices=1, strategy=strategy)
            trainer = pl.Trainer(**kwargs, callbacks=[monitor] if monitored else [])
            trainer.fit(StackModule())
            fits[monitored] = {key: value.cpu() for key, value in trainer.strategy.model.state_dict().items()}
        # What the last check compared and why it could not, for a failure seen only on a GPU machine.
        divergences = [entry.grad_divergence for entry in monitor.history]
        report = monitor.last_report
        said = f"{name}: {divergences}, error {report.error!r}, compared {list(report.per_parameter)}"
        assert len(divergences) == 4, said
        assert (
            all(v == 0.0 for v in divergences) if name == "clean" else all(0.0 < v < math.inf for v in divergences)
        ), said
        # The two-pass check, through FSDP1's root wrapper, names each block and the cause.
        named = [(region.name, region.cause) for region in report.regions or []]
        assert named == ([] if name == "clean" else [(f"model.blocks.{i}", "rng_not_preserved") for i in range(3)])
        # The checks change no weight: the fit without the monitor ends where the monitored one does.
        assert fits[True].keys() == fits[False].keys()
        assert all(torch.equal(value, fits[False][key]) for key, value in fits[True].items()), name


class _NoTwoPassSupport(StrategySupport):
    """A strategy's support that says the two-pass check cannot run there."""

    def two_pass_unavailable(self) -> str | None:
        return "this strategy runs the model only through its wrapper"


class _NoTwoPassStrategy(SingleDeviceCheckpointingStrategy):
    _monitor_support = _NoTwoPassSupport


def test_where_the_two_pass_check_cannot_run_a_divergence_is_reported_live_without_a_region(tmp_path, monkeypatch):
    # A strategy's support may say so (FSDP1's did, before its passes ran through its root wrapper).
    config = CheckpointingConfig(classes=["DropoutBlock"], preserve_rng_state=False)
    attributed = RecomputationMonitor(every_n_steps=1, on_divergence="ignore", sentinel="off")
    fit(tmp_path / "attributed", monitor=attributed, config={"preserve_rng_state": False})

    def two_pass(*args, **kwargs):
        raise AssertionError("the two-pass check ran")

    monkeypatch.setattr(checks_module, "check_recomputation", two_pass)
    # The light sentinel sees the redrawn masks and asks for a check with attribution at the next step: that check
    # is live too.
    live = RecomputationMonitor(every_n_steps=1, on_divergence="warn")
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        **trainer_kwargs(tmp_path / "live", callbacks=[live], strategy=_NoTwoPassStrategy(checkpointing=config))
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LightningCkptDeterminismWarning)
        trainer.fit(StackModule())
    diverged = [str(w.message) for w in caught if "recomputation diverged" in str(w.message)]
    assert diverged and "No region is named: this strategy runs the model only through its wrapper." in diverged[0]
    assert attributed.last_report.regions and live.last_report.regions == []
    assert [entry.grad_divergence for entry in live.history] == [e.grad_divergence for e in attributed.history]
    assert len(live.history) == 4 and all(entry.grad_divergence > 0.0 for entry in live.history)

    always = RecomputationMonitor(attribution="always")
    trainer = pl.Trainer(
        **trainer_kwargs(tmp_path / "always", callbacks=[always], strategy=_NoTwoPassStrategy(checkpointing=config))
    )
    with pytest.raises(CheckpointingConfigError, match=r"^`RecomputationMonitor\(attribution='always'\)` cannot run"):
        trainer.fit(StackModule())


class _NoCheckSupport(StrategySupport):
    """A strategy's support that says no gradient check can run there without changing training."""

    def check_unavailable(self) -> str | None:
        return "this strategy's gradients cannot be set aside"


class _NoCheckStrategy(SingleDeviceCheckpointingStrategy):
    _monitor_support = _NoCheckSupport


def _sentinel_alone(
    tmp_path: Any, make_module: Callable[[], Any], strategy: type, monitor: RecomputationMonitor
) -> tuple[pl.Trainer, Any, list[str], Any]:
    """A fit of ``make_module()`` under ``strategy`` with ``monitor``, where dropout masks are redrawn at recomputation
    (the sentinel sees it at every step), and its plain twin's fit without the monitor: the trainer, the monitored
    module, the package's warnings and the twin."""
    config = CheckpointingConfig(classes=["DropoutBlock"], preserve_rng_state=False)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        **trainer_kwargs(tmp_path / "alone", callbacks=[monitor], strategy=strategy(checkpointing=config))
    )
    module = make_module()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LightningCkptDeterminismWarning)
        trainer.fit(module)
    pl.seed_everything(0, verbose=False)
    twin = make_module()
    pl.Trainer(**trainer_kwargs(tmp_path / "twin", strategy=strategy(checkpointing=config))).fit(twin)
    return trainer, module, [str(w.message) for w in caught], twin


def test_where_no_gradient_check_can_run_the_sentinel_runs_alone_and_training_is_untouched(tmp_path, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("a gradient check ran")

    monkeypatch.setattr(checks_module, "check_live_step", never)
    monkeypatch.setattr(checks_module, "check_recomputation", never)
    monitor = RecomputationMonitor(every_n_steps=1)
    _, module, messages, twin = _sentinel_alone(tmp_path, StackModule, _NoCheckStrategy, monitor)
    said = [m for m in messages if "runs no gradient check" in m]
    assert len(said) == 1 and "this strategy's gradients cannot be set aside" in said[0]
    sentinel = [m for m in messages if "the sentinel saw" in m]
    assert sentinel and all("No gradient check runs under this strategy" in m for m in sentinel)
    assert list(monitor.history) == [] and monitor.sentinel_report.mismatches > 0
    # Ground truth: the same fit without the monitor trains to the same weights.
    assert all(torch.equal(value, twin.state_dict()[key]) for key, value in module.state_dict().items())

    config = CheckpointingConfig(classes=["DropoutBlock"], preserve_rng_state=False)
    off = RecomputationMonitor(sentinel="off")
    trainer = pl.Trainer(
        **trainer_kwargs(tmp_path / "off", callbacks=[off], strategy=_NoCheckStrategy(checkpointing=config))
    )
    with pytest.raises(CheckpointingConfigError, match=r"^`RecomputationMonitor\(sentinel='off'\)` has nothing to do"):
        trainer.fit(StackModule())


class FetchesItsBatches(StackModule):
    """Lightning's ``training_step(self, dataloader_iter)``: the step takes its batch from the iterator itself."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def training_step(self, dataloader_iter):  # type: ignore[override]
        (x, y), batch_idx, _ = next(dataloader_iter)
        self.seen = [*self.seen, batch_idx]
        return F.mse_loss(self.model(x), y)


def test_a_training_step_that_fetches_its_own_batches_runs_the_sentinel_alone_and_trains_as_without_it(tmp_path):
    # A check would rerun the step, which would take the next batch: none runs, and the fit trains the batches the
    # twin trains. The monitor's own metrics reach `callback_metrics` (Lightning asks `self.log` for a batch size here).
    monitor = RecomputationMonitor(every_n_steps=1)
    strategy = SingleDeviceCheckpointingStrategy
    trainer, module, messages, twin = _sentinel_alone(tmp_path, FetchesItsBatches, strategy, monitor)
    said = [m for m in messages if "runs no gradient check" in m]
    assert len(said) == 1 and "`training_step(self, dataloader_iter)` fetches its own batches" in said[0]
    assert any("No gradient check runs for a `training_step` that fetches its own batches" in m for m in messages)
    assert list(monitor.history) == [] and monitor.sentinel_report.mismatches > 0
    assert trainer.callback_metrics["recompute/sentinel/mismatches"] > 0
    assert module.seen == twin.seen == list(range(len(module.seen)))
    assert all(torch.equal(value, twin.state_dict()[key]) for key, value in module.state_dict().items())


class LBFGSModule(StackModule):
    """Trained with LBFGS, whose step calls the training closure several times."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)


def test_an_optimizer_that_calls_its_closure_again_is_checked_once_per_step(tmp_path):
    modules = []
    for name, monitor in (("plain", None), ("monitored", RecomputationMonitor(every_n_steps=1))):
        _, module = fit(tmp_path / name, module=LBFGSModule(), monitor=monitor, max_steps=2)
        modules.append(module)
        if monitor is not None:
            assert [(entry.step, entry.grad_divergence) for entry in monitor.history] == [(0, 0.0), (1, 0.0)]
    for (key, expected), actual in zip(modules[0].state_dict().items(), modules[1].state_dict().values(), strict=True):
        assert torch.equal(expected, actual), key


class EpochLoggingLBFGSModule(LBFGSModule):
    """LBFGS whose closure logs its loss for the epoch: every closure call adds to the epoch's mean."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.log("train/loss", loss, on_step=False, on_epoch=True)
        return loss


class LogsAroundBackwardModule(ManualModule):
    """Manual optimization logging on both sides of its backward, as Lightning's GAN example does."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.log("before", loss, on_step=True, on_epoch=True)
        optimizer.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(loss)
        optimizer.step()  # type: ignore[union-attr]
        self.log("after", 2 * loss.detach(), on_step=True, on_epoch=True)
        return loss


@pytest.mark.parametrize(
    ("make", "loss_fn"),
    [(EpochLoggingLBFGSModule, None), (LogsAroundBackwardModule, manual_loss)],
    ids=["LBFGS", "manual"],
)
def test_what_training_step_logs_is_the_same_with_the_monitor_checking_the_first_batch(
    tmp_path: Path, make: Callable[[], pl.LightningModule], loss_fn: Any
) -> None:
    # Lightning drops an epoch's first-batch values of a hook when another hook logged between two of its calls: the
    # check's metrics, logged from `on_after_backward`, wiped what `training_step` logged before them.
    logged = []
    for name, monitor in (("plain", None), ("monitored", RecomputationMonitor(every_n_steps=1, loss_fn=loss_fn))):
        logger = CSVLogger(tmp_path, name=name)
        trainer, _ = fit(
            tmp_path / name, module=make(), monitor=monitor, max_steps=3, logger=logger, log_every_n_steps=1
        )
        logger.save()
        with open(logger.experiment.metrics_file_path) as file:
            rows = [
                {k: v for k, v in row.items() if v and not k.startswith("recompute/")} for row in csv.DictReader(file)
            ]
        shown = {key: value for key, value in trainer.callback_metrics.items() if not key.startswith("recompute/")}
        logged.append(([row for row in rows if len(row) > 2], shown))
        if monitor is not None:
            assert [entry.step for entry in monitor.history] == [0, 1, 2]
            assert trainer.callback_metrics["recompute/grad_divergence"] == 0.0
    (plain_rows, plain_shown), (rows, shown) = logged
    assert rows == plain_rows
    assert plain_shown.keys() == shown.keys() and len(shown) >= 1
    assert all(torch.equal(plain_shown[key], shown[key]) for key in shown)


@pytest.mark.parametrize("every_n_steps", [1, 2])
def test_parameters_a_step_changes_in_place_are_copied_after_the_first_skip_and_training_is_unchanged(
    tmp_path, every_n_steps
):
    modules = []
    for name, monitor in (("plain", None), ("monitored", RecomputationMonitor(every_n_steps=every_n_steps))):
        if monitor is None:
            _, module = fit(tmp_path / name, module=MomentumTeacherModule(), monitor=monitor)
        else:
            with pytest.warns(
                LightningCkptDeterminismWarning, match=r"changed parameters in place \(teacher.inp.weight"
            ):
                _, module = fit(tmp_path / name, module=MomentumTeacherModule(), monitor=monitor)
            # The first check cannot rerun the step (the teacher was not copied); the next step is checked, with the
            # teacher copied at its start and put back after, and so is every later check.
            skipped, *checked = monitor.history
            assert (skipped.step, skipped.skipped) == (0, "parameters changed in place in the step")
            expected = [1, 2, 3] if every_n_steps == 1 else [1, 2]
            assert [(entry.step, entry.skipped, entry.grad_divergence) for entry in checked] == [
                (step, None, 0.0) for step in expected
            ]
        modules.append(module)
    for (key, expected), actual in zip(modules[0].state_dict().items(), modules[1].state_dict().values(), strict=True):
        assert torch.equal(expected, actual), key


@pytest.mark.parametrize(
    ("block", "initialised"),
    [
        ("LazyBlock", "model.blocks.0.inp.weight, model.blocks.0.inp.bias, model.blocks.1.inp.weight ..."),
        (
            "LazyNormBlock",
            "model.blocks.0.norm.running_mean, model.blocks.0.norm.running_var, model.blocks.1.norm.running_mean ...",
        ),
    ],
    ids=["lazy parameters", "lazy buffers only"],
)
def test_a_step_that_initialises_lazy_modules_is_skipped_as_such_and_the_next_is_checked_without_copies(
    tmp_path, block, initialised
):
    _, plain = fit(tmp_path / "plain", block=block, checkpointing=False, log_every_n_steps=1)
    monitor = RecomputationMonitor(every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LightningCkptDeterminismWarning)
        _, module = fit(tmp_path / "monitored", block=block, monitor=monitor, log_every_n_steps=1)
    said = [str(w.message) for w in caught if issubclass(w.category, LightningCkptDeterminismWarning)]
    assert [m for m in said if "skipped" in m or "could not" in m or "failed" in m] == [
        "lightning_ckpt_determinism: the check at step 0 was skipped: its `training_step` initialised lazy modules"
        f" ({initialised}), which a rerun of the step cannot undo. The next step is checked; initialise them before the"
        " fit (one forward in `setup`) to check this one too."
    ]
    # The first step's calls ran plainly, which is why the sentinel compared nothing at it.
    assert [m for m in said if "compared nothing" in m] == [
        "lightning_ckpt_determinism: the sentinel compared nothing in the steps logged at step 0: no checkpointed"
        " region saved a tensor for backward, running checkpointed, eagerly and with gradients, in the steps since"
        " the last logged one (every call returned before saving one, as a LayerDrop that returns its input; or a"
        " call that initialises a region's lazy modules, which runs without checkpointing)."
        " `recompute/sentinel/compared` is 0 and no"
        " `recompute/sentinel/mismatches` is logged for them; the periodic check still compares gradients at the steps"
        " that recompute a region."
    ]
    skipped, *checked = monitor.history
    assert (skipped.step, skipped.skipped) == (0, "lazy modules initialised in training_step")
    assert [(entry.step, entry.skipped, entry.grad_divergence) for entry in checked] == [
        (step, None, 0.0) for step in (1, 2, 3)
    ]
    # The sentinel watched every step from the first (whose call initialising the modules ran plainly).
    report = monitor.sentinel_report
    assert report is not None and report.compared > 0 and report.mismatches == 0
    assert module.state_dict().keys() == plain.state_dict().keys()
    assert all(torch.equal(value, plain.state_dict()[key]) for key, value in module.state_dict().items())


@pytest.mark.parametrize("sentinel", ["light", "exact"])
def test_a_step_that_sizes_a_buffer_is_checked_and_trains_as_without_checkpointing(tmp_path, sentinel):
    # The first step sizes the per-channel observers' statistics: the check puts the empty values back for its
    # reference pass, then the sized ones.
    _, plain = fit(tmp_path / "plain", block="PerChannelQuantBlock", checkpointing=False)
    monitor = RecomputationMonitor(every_n_steps=1, sentinel=sentinel)
    _, module = fit(tmp_path / "monitored", block="PerChannelQuantBlock", monitor=monitor)
    assert [(entry.step, entry.skipped, entry.grad_divergence) for entry in monitor.history] == [
        (step, None, 0.0) for step in range(4)
    ]
    report = monitor.sentinel_report
    assert report is not None and report.compared > 0 and report.mismatches == 0
    assert all(torch.equal(value, plain.state_dict()[key]) for key, value in module.state_dict().items())


@pytest.mark.parametrize("attribution", ["on_divergence", "always"])
def test_a_cache_made_by_trainer_validate_before_the_fit_is_checked_and_trains_as_without_checkpointing(
    tmp_path, attribution
):
    # `trainer.validate` runs under `torch.inference_mode()` (the fit's own validation under `no_grad`): each block's
    # positional table is an inference tensor when the fit starts.
    def validated_then_fit(monitor):
        pl.seed_everything(0, verbose=False)
        module = ValidatedStackModule(block="InferenceCacheBlock")
        config = CheckpointingConfig(classes=["InferenceCacheBlock"])
        strategy = "auto" if monitor is None else SingleDeviceCheckpointingStrategy(checkpointing=config)
        callbacks = [] if monitor is None else [monitor]
        trainer = pl.Trainer(**trainer_kwargs(tmp_path / str(monitor), callbacks=callbacks, strategy=strategy))
        trainer.validate(module, verbose=False)
        assert all(block.table.is_inference() for block in module.model.blocks)
        trainer.fit(module)
        return module

    plain = validated_then_fit(None)
    monitor = RecomputationMonitor(every_n_steps=1, attribution=attribution)
    module = validated_then_fit(monitor)
    assert [(entry.step, entry.skipped, entry.grad_divergence) for entry in monitor.history] == [
        (step, None, 0.0) for step in range(4)
    ]
    report = monitor.sentinel_report
    assert report is not None and report.compared > 0 and report.mismatches == 0
    assert all(torch.equal(value, plain.state_dict()[key]) for key, value in module.state_dict().items())
    assert all(
        torch.equal(mine.table, twin.table) for mine, twin in zip(module.model.blocks, plain.model.blocks, strict=True)
    )


def test_two_monitors_in_one_trainer_are_refused_at_fit_start_in_one_line(tmp_path):
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=["DropoutBlock"]))
    callbacks = [RecomputationMonitor(), RecomputationMonitor(log_prefix="again")]
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, callbacks=callbacks, strategy=strategy))
    module = StackModule()
    before = {key: value.clone() for key, value in module.state_dict().items()}
    twice = r"^`RecomputationMonitor` is in the Trainer's callbacks 2 times: give it once\."
    with pytest.raises(CheckpointingConfigError, match=twice):
        trainer.fit(module)
    assert all(torch.equal(value, before[key]) for key, value in module.state_dict().items())


def test_a_barebones_trainer_is_told_where_the_metrics_go_and_gets_no_logging_call(tmp_path):
    monitor = RecomputationMonitor(every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, _ = fit(tmp_path, monitor=monitor, barebones=True, log_every_n_steps=None)
    said = [str(w.message) for w in caught]
    assert [m for m in said if "RecomputationMonitor" in m and "barebones" in m] == [
        "`RecomputationMonitor` runs under `Trainer(barebones=True)`, which turns logging off: its metrics go only to"
        " its `history` (and its findings to warnings). Leave `barebones` off to log them."
    ]
    # Lightning refuses each `self.log` under barebones: only the module's own, one a step, reached it.
    assert sum("You are trying to `self.log()`" in m for m in said) == 4
    assert [(entry.step, entry.grad_divergence) for entry in monitor.history] == [(step, 0.0) for step in range(4)]
    assert dict(trainer.callback_metrics) == {}


def test_batches_without_a_backward_are_not_said_to_have_compared_nothing_and_train_as_without_the_monitor(tmp_path):
    # StochasticWeightAveraging's last epoch recomputes the BatchNorm statistics with forwards only.
    states = []
    for name, monitor in (("plain", None), ("monitored", RecomputationMonitor(every_n_steps=1))):
        swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)
        overrides = {"max_steps": -1, "max_epochs": 2, "limit_train_batches": 3, "callbacks_extra": [swa]}
        overrides.update(logger=CSVLogger(tmp_path / name), log_every_n_steps=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", LightningCkptDeterminismWarning)
            _, module = fit_with(tmp_path / name, monitor, "BatchNormBlock", **overrides)
        states.append(module.state_dict())
        assert [str(w.message) for w in caught if "compared nothing" in str(w.message)] == []
        if monitor is not None:
            assert monitor.sentinel_report.compared > 0 and monitor.sentinel_report.mismatches == 0
    assert all(torch.equal(value, states[0][key]) for key, value in states[1].items())


class StreamedBatches(torch.utils.data.IterableDataset):
    """Three batches of (inputs, targets), streamed: a dataloader without a length."""

    def __iter__(self):
        generator = torch.Generator().manual_seed(2)
        for _ in range(3):
            x = torch.randn(8, 8, generator=generator)
            yield x, x.sum(dim=1, keepdim=True)


class StreamingModule(StackModule):
    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(StreamedBatches(), batch_size=None)


def test_a_dataloader_without_a_length_shows_the_counts_at_the_epochs_end_on_one_process(tmp_path):
    monitor = RecomputationMonitor(every_n_steps=50)
    trainer, _ = fit(tmp_path, module=StreamingModule(), monitor=monitor, max_steps=-1, max_epochs=1)
    assert trainer.global_step == 3
    # Read at step 0 (checked) and at the epoch's end (step 2), however long the logging interval.
    compared = monitor.sentinel_report.compared
    assert compared > 0 and trainer.callback_metrics["recompute/sentinel/compared"] == compared


class _HalvesAWeightBeforeBackward(pl.Callback):
    """Halves a block's weight in place between the forward and the backward of step 2."""

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if trainer.global_step == 2:
            with torch.no_grad():
                pl_module.model.blocks[1].linear.weight.mul_(0.5)


def test_a_parameter_a_hook_writes_before_backward_is_named_as_the_steps_write_not_training_steps(tmp_path):
    # Without checkpointing, autograd refuses the write: the weight the forward saved changed before its backward.
    plain = pl.Trainer(**trainer_kwargs(tmp_path / "plain", callbacks=[_HalvesAWeightBeforeBackward()], max_steps=4))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        plain.fit(StackModule(block="PlainBlock"))
    monitor = RecomputationMonitor(every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_with(tmp_path / "checked", monitor, "PlainBlock", [_HalvesAWeightBeforeBackward()], max_steps=4)
    said = [str(warning.message) for warning in caught if "lightning_ckpt_determinism" in str(warning.message)]
    written = "model.blocks.1.linear.weight"
    assert any(
        f"step 2 was skipped: the step changed parameters in place ({written}) in `training_step` or a hook before"
        " its backward" in line
        for line in said
    ), said
    assert not any("`training_step` changed parameters" in line for line in said)
    # The recomputation read the halved weight: the sentinel saw the step differ.
    assert any("the sentinel saw region `model.blocks.1` recompute other values" in line for line in said), said
    assert [(entry.step, entry.skipped) for entry in monitor.history][:2] == [
        (0, None),
        (1, None),
    ] and monitor.history[2].skipped == "parameters changed in place in the step"


def fit_with(tmp_path, monitor, block, callbacks_extra=(), **overrides):
    """:func:`fit` with more callbacks after the monitor."""
    pl.seed_everything(0, verbose=False)
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=[block]))
    callbacks = [*([monitor] if monitor is not None else []), *callbacks_extra]
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, callbacks=callbacks, strategy=strategy, **overrides))
    module = StackModule(block=block)
    trainer.fit(module)
    return trainer, module


def test_a_metric_held_in_a_plain_dict_is_updated_once_per_step(tmp_path):
    totals = []
    for name, monitor in (("plain", None), ("monitored", RecomputationMonitor(every_n_steps=1))):
        _, module = fit(tmp_path / name, module=PlainMetricsModule(), monitor=monitor)
        totals.append(int(module.metrics["mse"].total))
    assert totals[0] == totals[1] == 4 * 8


@pytest.mark.parametrize(
    ("attribution", "skips_from"),
    [("on_divergence", 2), ("always", 2)],
    ids=["live reference", "live reference before attribution"],
)
def test_a_rerun_that_returns_no_loss_is_an_error_finding(tmp_path, monkeypatch, attribution, skips_from):
    SkipsOnItsSecondCallModule.calls = []
    monkeypatch.setattr(SkipsOnItsSecondCallModule, "skips_from", skips_from)
    monitor = RecomputationMonitor(every_n_steps=100, on_divergence="ignore", attribution=attribution)
    fit(tmp_path, module=SkipsOnItsSecondCallModule(), monitor=monitor, max_steps=1)
    assert monitor.last_report is not None
    assert monitor.last_report.error is not None
    assert "its rerun of `training_step` returned None" in monitor.last_report.error
    assert monitor.history[0].diverged and monitor.history[0].grad_divergence == math.inf


@pytest.mark.parametrize("skips_from", [3, 4], ids=["two-pass reference", "two-pass checkpointed pass"])
def test_an_attribution_rerun_that_returns_no_loss_leaves_the_live_checks_verdict(tmp_path, monkeypatch, skips_from):
    # The live check compared the applied gradients (exact here); only the attribution after it could not run.
    SkipsOnItsSecondCallModule.calls = []
    monkeypatch.setattr(SkipsOnItsSecondCallModule, "skips_from", skips_from)
    monitor = RecomputationMonitor(every_n_steps=100, on_divergence="raise", attribution="always")
    fit(tmp_path, module=SkipsOnItsSecondCallModule(), monitor=monitor, max_steps=1)
    assert monitor.last_report is not None and monitor.last_report.error is None
    assert [(entry.step, entry.diverged, entry.grad_divergence) for entry in monitor.history] == [(0, False, 0.0)]


class PartialFreeze(pl.Callback):
    """Zeroes the gradient of the first block's first rows after each backward, as a partial freeze does."""

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pl_module.model.blocks[0].linear.weight.grad[:2].zero_()


def test_a_callback_that_changes_gradients_before_the_monitor_is_named_with_the_order_that_fixes_it(tmp_path):
    histories = {}
    for order in ("freeze_first", "monitor_first"):
        monitor = RecomputationMonitor(every_n_steps=1)
        callbacks = [PartialFreeze(), monitor] if order == "freeze_first" else [monitor, PartialFreeze()]
        kwargs = trainer_kwargs(
            tmp_path / order,
            callbacks=callbacks,
            strategy=SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=["PlainBlock"])),
        )
        pl.seed_everything(0, verbose=False)
        trainer = pl.Trainer(**kwargs)
        if order == "freeze_first":
            with (
                pytest.warns(
                    LightningCkptDeterminismWarning,
                    match=r"`PartialFreeze` run `on_after_backward` before `RecomputationMonitor`.* List"
                    r" `RecomputationMonitor` before them in `callbacks`\.",
                ),
                pytest.warns(LightningCkptDeterminismWarning, match="recomputation diverged"),
            ):
                trainer.fit(StackModule(block="PlainBlock"))
        else:
            trainer.fit(StackModule(block="PlainBlock"))
        histories[order] = [entry.grad_divergence for entry in monitor.history]
    # Listed first, the freeze's zeros read as a divergence; listed after the monitor, the checks are exact.
    assert all(divergence > 0 for divergence in histories["freeze_first"])
    assert histories["monitor_first"] == [0.0] * 4


@pytest.mark.skipif(not hasattr(BaseException, "add_note"), reason="exception notes need Python 3.11")
@pytest.mark.parametrize(
    ("syntax", "naming"),
    [
        ("yaml", "`python -m lightning_ckpt_determinism audit --config <the run's config>` names"),
        ("python", "the `regions` of `check_recomputation(model, closure, attribution=True)` run on one batch name"),
    ],
)
def test_a_fit_whose_recomputation_raises_says_under_the_error_what_names_the_region(tmp_path, syntax, naming):
    monitor = RecomputationMonitor(every_n_steps=1)
    monitor.hint_syntax = syntax
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as raised:
        fit(tmp_path, monitor=monitor, block="InPlaceReluBlock", max_steps=2)
    assert raised.value.__notes__ == [
        "lightning_ckpt_determinism: raised in backward, where the checkpointed regions are recomputed. If their"
        f" recomputation raised it, {naming} the region, the cause and the fix."
    ]


class RaisesAtSecondStep(StackModule):
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if batch_idx == 1:
            raise ValueError("the user's own error")
        return super().training_step(batch, batch_idx)


def test_an_error_outside_backward_gets_no_note(tmp_path):
    with pytest.raises(ValueError, match="the user's own error") as raised:
        fit(tmp_path, module=RaisesAtSecondStep(), monitor=RecomputationMonitor(every_n_steps=1), max_steps=3)
    assert getattr(raised.value, "__notes__", []) == []


class TooNarrowBlock(PlainBlock):
    """A shape mistake in a checkpointed block's forward: its layer takes twice the features it is given."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__(dim)
        self.linear = nn.Linear(2 * dim, dim)


@pytest.mark.skipif(not hasattr(BaseException, "add_note"), reason="exception notes need Python 3.11")
@pytest.mark.parametrize(
    ("block", "noted"), [("TooNarrowBlock", False), ("FailingRecomputeBlock", True)], ids=["forward", "recomputation"]
)
def test_an_error_of_a_checkpointed_forward_gets_no_note_and_one_of_its_recomputation_does(tmp_path, block, noted):
    # The region's forward runs inside torch's checkpoint as well: only a backward frame says a recomputation ran.
    module = StackModule(block="PlainBlock")
    module.model.blocks[1] = TooNarrowBlock() if block == "TooNarrowBlock" else FailingRecomputeBlock()
    with pytest.raises(RuntimeError) as raised:
        fit(
            tmp_path,
            module=module,
            monitor=RecomputationMonitor(every_n_steps=100),
            block="PlainBlock",
        )
    assert ("raised in backward" in " ".join(getattr(raised.value, "__notes__", []))) is noted, raised.value


@pytest.mark.parametrize("max_steps", [1, 3])
def test_a_monitor_reused_for_a_new_model_checks_the_first_step_of_its_second_fit(tmp_path, max_steps):
    # A sweep reusing one monitor: its first fit's last check was at step 0 (`max_steps=1`) or its first step is
    # long past; the second fit, of a model with host noise in a block, is checked at its own first step.
    monitor = RecomputationMonitor(every_n_steps=100, on_divergence="ignore")
    fit(tmp_path / "clean", module=StackModule(block="PlainBlock"), monitor=monitor, block="PlainBlock", max_steps=1)
    assert [(entry.step, entry.diverged) for entry in monitor.history] == [(0, False)]
    noisy = StackModule(block="PlainBlock")
    noisy.model.blocks[1] = NumpyNoiseBlock()
    config = {"names": ["model.blocks.1"]}
    fit(tmp_path / "noisy", module=noisy, monitor=monitor, block="PlainBlock", max_steps=max_steps, config=config)
    assert [(entry.step, entry.diverged) for entry in monitor.history] == [(0, False), (0, True)]
    assert monitor.last_report is not None and monitor.last_report.diverged


class OddStepsUseTheBlocks(StackModule):
    """Runs its checkpointed blocks at odd batches only; a plain head of its own at even ones."""

    def __init__(self) -> None:
        super().__init__(block="PlainBlock")
        self.head = torch.nn.Linear(DIM, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.model(x) if batch_idx % 2 else self.head(x), y)


def test_a_step_that_recomputes_no_region_is_a_skipped_check_not_a_clean_one(tmp_path):
    monitor = RecomputationMonitor(every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LightningCkptDeterminismWarning)
        fit(tmp_path, module=OddStepsUseTheBlocks(), monitor=monitor, block="PlainBlock", max_steps=4)
    reason = "no checkpointed region was recomputed in this step"
    assert [(record.step, record.skipped, record.grad_divergence) for record in monitor.history][1::2] == [
        (1, None, 0.0),
        (3, None, 0.0),
    ]
    assert [(record.step, record.skipped) for record in monitor.history][::2] == [(0, reason), (2, reason)]
    said = [str(w.message) for w in caught if "no checkpointed region was recomputed at step" in str(w.message)]
    assert said and said[0].startswith("lightning_ckpt_determinism: no checkpointed region was recomputed at step 0:")


def test_a_random_stream_left_elsewhere_within_the_tolerance_is_said_with_gradients_within_it(tmp_path):
    # Dropout unreplayed: the gradients differ (a generous tolerance accepts that), and torch's RNG ends each step
    # elsewhere than without checkpointing, which counts whatever the tolerance; the warning does not call the
    # gradients exact.
    monitor = RecomputationMonitor(every_n_steps=1, tolerance=10.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LightningCkptDeterminismWarning)
        fit(tmp_path, monitor=monitor, config={"preserve_rng_state": False})
    first = next(record for record in monitor.history if record.skipped is None)
    assert 0.0 < first.grad_divergence <= 10.0 and first.diverged
    said = [str(w.message) for w in caught if "recomputation drew from torch's RNG" in str(w.message)]
    assert said and said[0].startswith(
        f"lightning_ckpt_determinism: recomputation drew from torch's RNG at step {first.step}: it ended the step in"
        " another state than the same step without checkpointing; the gradients are within the tolerance (10)."
    )


@pytest.mark.parametrize("action", ["default", "module", "once"])
def test_a_second_fit_in_the_process_shows_its_findings_where_the_first_showed_the_same_words(tmp_path, action):
    # Under Python's default filter a warning shows once per message and line for the life of the process: a notebook
    # cell run again showed no finding of its fit.
    shown = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter(action)
        for run in range(2):
            monitor = RecomputationMonitor(every_n_steps=1)
            fit(tmp_path / str(run), monitor=monitor, config={"preserve_rng_state": False})
            assert all(record.diverged for record in monitor.history)
            shown.append([str(w.message) for w in caught if "recomputation diverged at step" in str(w.message)])
            caught.clear()
    assert shown[0] and shown[1] == shown[0]


class NanLossModule(StackModule):
    """A dropout stack whose loss is NaN: every gradient of both of a check's passes is NaN at the same places."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * math.nan


def test_a_random_stream_left_elsewhere_at_a_nan_loss_does_not_call_the_gradients_exact(tmp_path):
    monitor = RecomputationMonitor(every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LightningCkptDeterminismWarning)
        fit(tmp_path, module=NanLossModule(), monitor=monitor, config={"preserve_rng_state": False})
    first = next(record for record in monitor.history if record.skipped is None)
    # NaN in the same places on both passes compares equal.
    assert (first.grad_divergence, first.diverged) == (0.0, True)
    said = [str(w.message) for w in caught if "recomputation drew from torch's RNG" in str(w.message)]
    assert said and said[0].startswith(
        f"lightning_ckpt_determinism: recomputation drew from torch's RNG at step {first.step}: it ended the step in"
        " another state than the same step without checkpointing; the gradients are not comparable (the loss is nan"
        " in both passes)."
    )


class GradientNoiseModule(StackModule):
    """A dropout stack whose parameters' hooks add noise drawn from torch's RNG to their gradients in every backward."""

    def on_fit_start(self) -> None:
        for param in self.parameters():
            param.register_hook(lambda grad: grad + 1e-3 * torch.randn_like(grad))


def test_a_backward_hook_drawing_from_torchs_rng_is_not_recomputation_moving_it(tmp_path):
    # The regions replay torch's RNG (the default): what draws from it in the live backward is the hooks, which the
    # step without checkpointing runs too.
    _, plain = fit(tmp_path / "plain", module=GradientNoiseModule(), checkpointing=False)
    monitor = RecomputationMonitor(every_n_steps=1, on_divergence="raise")
    _, checked = fit(tmp_path / "checked", module=GradientNoiseModule(), monitor=monitor)
    assert [(record.diverged, record.grad_divergence) for record in monitor.history] == [(False, 0.0)] * 4
    assert all(torch.equal(value, plain.state_dict()[key]) for key, value in checked.state_dict().items())


def test_a_divergence_a_warning_filter_turns_into_an_error_ends_the_fit_as_before(tmp_path):
    # The check's own warning, the sentinel off: recording the check raises it, which is not a failure of the monitor.
    monitor = RecomputationMonitor(every_n_steps=1, sentinel="off")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="lightning_ckpt_determinism: recomputation diverged")
        diverged = r"^lightning_ckpt_determinism: recomputation diverged at step 0"
        with pytest.raises(LightningCkptDeterminismWarning, match=diverged):
            fit(tmp_path, monitor=monitor, config={"preserve_rng_state": False})


def test_a_divergence_under_a_grad_scaler_is_figured_in_the_units_of_the_gradients_stepped_with(tmp_path):
    # The live gradients are the loss scale times those the optimizer steps with: the figures are divided back.
    figures = []
    for scale in (1.0, 1024.0):
        monitor = RecomputationMonitor(every_n_steps=1, on_divergence="ignore")
        scaler = torch.amp.GradScaler("cpu", init_scale=scale)
        random.seed(0)
        fit(
            tmp_path / str(scale),
            monitor=monitor,
            block="PythonRandomBlock",
            max_steps=1,
            plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        )
        report = monitor.last_report
        figures.append((report.grad_divergence, report.max_abs_diff, report.worst_parameters))
    (divergence, max_abs_diff, worst), scaled = figures
    assert divergence > 0 and max_abs_diff > 0
    assert scaled[0] == pytest.approx(divergence, rel=1e-6)
    assert scaled[1] == pytest.approx(max_abs_diff, rel=1e-3)
    assert [name for name, _ in scaled[2]] == [name for name, _ in worst]
    assert [diff for _, diff in scaled[2]] == pytest.approx([diff for _, diff in worst], rel=1e-3)


class SnapshotsAtBatchStart(pl.Callback):
    """Saves and copies the LightningModule at every batch's start, as a callback keeping snapshots does."""

    def __init__(self) -> None:
        self.copies: list[tuple[pl.LightningModule, pl.LightningModule]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        saved = io.BytesIO()
        torch.save(pl_module, saved)
        saved.seek(0)
        self.copies.append((torch.load(saved, weights_only=False), copy.deepcopy(pl_module)))


def test_a_module_saved_or_copied_while_a_check_waits_for_its_step_is_the_modules_own(tmp_path):
    snapshots = SnapshotsAtBatchStart()
    monitor = RecomputationMonitor(every_n_steps=1)
    trainer, _ = fit_with(tmp_path, monitor, "DropoutBlock", callbacks_extra=[snapshots], max_steps=2)
    assert [record.step for record in monitor.history] == [0, 1]
    batch = next(iter(trainer.train_dataloader))
    for loaded, copied in snapshots.copies:
        for snapshot in (loaded, copied):
            # Its `training_step` is its own: it runs on the snapshot, not on the module being trained.
            step = snapshot.training_step
            assert getattr(step, "__self__", None) is snapshot and step.__func__ is type(snapshot).training_step
            assert torch.isfinite(snapshot.training_step(batch, 0))


def _own_step(module: pl.LightningModule, batch: Any, batch_idx: int) -> torch.Tensor:
    return StackModule.training_step(module, batch, batch_idx)


class OwnStepModule(StackModule):
    """A module whose ``training_step`` is an instance attribute of its own (a ``partial``), set in ``__init__``."""

    def __init__(self) -> None:
        super().__init__(block="DropoutBlock")
        self.training_step = functools.partial(_own_step, self)


def test_a_copy_taken_while_a_check_waits_keeps_the_modules_own_training_step_attribute(tmp_path):
    snapshots = SnapshotsAtBatchStart()
    pl.seed_everything(0, verbose=False)
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=["DropoutBlock"]))
    monitor = RecomputationMonitor(every_n_steps=1)
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, callbacks=[monitor, snapshots], strategy=strategy, max_steps=2))
    trainer.fit(OwnStepModule())
    assert [record.step for record in monitor.history] == [0, 1]
    for loaded, copied in snapshots.copies:
        for snapshot in (loaded, copied):
            step = vars(snapshot)["training_step"]
            assert isinstance(step, functools.partial) and step.func is _own_step and step.args[0] is snapshot
