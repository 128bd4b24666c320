"""The step adapter wraps the user's ``training_step``, ``log`` and ``log_dict`` for a checked step only, and puts the
module's own back whatever the step raises."""

from typing import Any, ClassVar

import lightning.pytorch as pl
import pytest
import torch

from lightning_ckpt_determinism import (
    CheckpointingConfig,
    LightningCkptDeterminismWarning,
    RecomputationMonitor,
    SingleDeviceCheckpointingStrategy,
)
from lightning_ckpt_determinism.lightning.step import logging_suppressed
from tests.helpers import StackModule, trainer_kwargs

WRAPPED = ("training_step", "log", "log_dict")


class RecordingModule(StackModule):
    """Records, at each ``training_step`` call, which of its methods the instance holds in its own ``__dict__`` (a
    wrapper put in place of the class's method), and raises at the call ``fail_at`` counts to. The record is the
    class's, which no check restores (the instance's attributes it would)."""

    fail_at: ClassVar[int | None] = None
    seen: ClassVar[list[tuple[int, tuple[str, ...]]]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append((batch_idx, tuple(name for name in WRAPPED if name in self.__dict__)))
        if len(self.seen) == self.fail_at:
            raise RuntimeError("the step fails here")
        return super().training_step(batch, batch_idx)


@pytest.fixture(autouse=True)
def _fresh_record(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(RecordingModule, "seen", [])


def _fit(tmp_path: Any, module: StackModule, max_steps: int) -> None:
    pl.seed_everything(0, verbose=False)
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=["DropoutBlock"]))
    monitor = RecomputationMonitor(every_n_steps=2, sentinel="off")
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, callbacks=[monitor], strategy=strategy, max_steps=max_steps))
    trainer.fit(module)


def _own(module: pl.LightningModule) -> list[str]:
    return [name for name in WRAPPED if name in module.__dict__]


def test_only_a_checked_steps_rerun_runs_with_logging_suppressed_and_every_step_calls_the_modules_own_method(
    tmp_path: Any,
) -> None:
    module = RecordingModule()
    _fit(tmp_path, module, max_steps=3)
    # Steps 0 and 2 are checked: their live call finds the class's own methods (the capture put them back before
    # calling), the check's rerun finds `log` and `log_dict` suppressed; step 1 is not checked and runs once.
    assert module.seen == [(0, ()), (0, ("log", "log_dict")), (1, ()), (2, ()), (2, ("log", "log_dict"))]
    assert _own(module) == []


def test_the_modules_own_methods_are_back_when_the_live_step_raises(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(RecordingModule, "fail_at", 1)
    module = RecordingModule()
    with pytest.raises(RuntimeError, match="the step fails here"):
        _fit(tmp_path, module, max_steps=3)
    assert len(module.seen) == 1
    assert _own(module) == []
    assert module.training_step.__func__ is RecordingModule.training_step


def test_a_check_whose_rerun_raises_is_skipped_and_the_modules_own_methods_are_back(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(RecordingModule, "fail_at", 2)
    module = RecordingModule()
    with pytest.warns(
        LightningCkptDeterminismWarning, match=r"the check at step 0 failed \(RuntimeError: the step fails"
    ):
        _fit(tmp_path, module, max_steps=3)
    # The rerun of step 0 raised: the fit went on, step 2 was checked again, each call with the methods it expects.
    assert module.seen == [(0, ()), (0, ("log", "log_dict")), (1, ()), (2, ()), (2, ("log", "log_dict"))]
    assert _own(module) == []
    assert module.training_step.__func__ is RecordingModule.training_step


def test_logging_suppressed_puts_an_instances_own_log_back_when_its_block_raises() -> None:
    module = StackModule()
    logged: list[str] = []

    def own_log(name: str, value: Any, **kwargs: Any) -> None:
        logged.append(name)

    module.log = own_log  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="inside"), logging_suppressed(module):
        module.log("ignored", 1.0)
        module.log_dict({"ignored": 1.0})
        raise ValueError("inside")
    module.log("kept", 1.0)
    assert logged == ["kept"]
    assert module.__dict__["log"] is own_log and "log_dict" not in module.__dict__
