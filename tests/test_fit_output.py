"""The package's warnings during a fit read as the README shows them, on lines of their own, its notes show on
stderr, and the warning format and the package logger are what they were before once the fit ends or raises."""

import contextlib
import importlib.util
import logging
import re
import subprocess
import sys
import types
import warnings
from collections.abc import Iterator
from pathlib import Path

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
from tests.helpers import StackModule, child_env, trainer_kwargs

REPO = Path(__file__).resolve().parents[1]

# A fit with Lightning's TQDM bar whose block 0 draws a dropout mask that recomputation draws again.
_FIT = """
import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning_ckpt_determinism import CheckpointingConfig, RecomputationMonitor, SingleDeviceCheckpointingStrategy
from tests.helpers import StackModule, trainer_kwargs

config = CheckpointingConfig(classes=["DropoutBlock"], preserve_rng_state=False)
trainer = pl.Trainer(**trainer_kwargs("{root}", enable_progress_bar=True, max_steps=6),
    callbacks=[RecomputationMonitor(every_n_steps=5), TQDMProgressBar()],
    strategy=SingleDeviceCheckpointingStrategy(checkpointing=config))
trainer.fit(StackModule())
"""

_WARNING_START = "lightning_ckpt_determinism: "


def test_the_package_warnings_of_a_fit_start_lines_of_their_own_without_a_file_prefix(tmp_path: Path) -> None:
    env = child_env(PYTHONWARNINGS="default")
    result = subprocess.run(
        [sys.executable, "-c", _FIT.format(root=tmp_path)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # the bar's stdout and the warnings' stderr in the order written
        timeout=240,
        check=False,
    )
    text = result.stdout.decode()
    assert result.returncode == 0, text
    assert "it/s]" in text  # the bar was drawn
    shown = [found.start() for found in re.finditer(re.escape(_WARNING_START) + "(recomputation|the sentinel)", text)]
    # The check at steps 0 and 5 and the sentinel's first mismatch.
    assert len(shown) >= 3, text
    for start in shown:
        assert text[start - 1] in "\r\n", repr(text[max(0, start - 80) : start + 40])
    # No file:line prefix on any of them (Lightning's format gives one to every path containing "lightning").
    assert not re.search(r"\.py:\d+: " + re.escape(_WARNING_START), text), text


def test_a_fit_formats_only_the_package_warnings_and_puts_the_format_back(tmp_path: Path) -> None:
    before = warnings.formatwarning
    seen: dict[str, str] = {}

    class Formats(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            ours = LightningCkptDeterminismWarning
            seen["ours"] = warnings.formatwarning("block 2 differs", ours, "/x/results.py", 9)
            seen["other"] = warnings.formatwarning("deprecated", DeprecationWarning, "/x/other.py", 3)

    trainer = pl.Trainer(
        **trainer_kwargs(tmp_path, max_steps=1),
        callbacks=[RecomputationMonitor(), Formats()],
        strategy=SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=["PlainBlock"])),
    )
    trainer.fit(StackModule(block="PlainBlock"))
    assert seen["ours"] == "lightning_ckpt_determinism: block 2 differs\n"
    assert seen["other"] == before("deprecated", DeprecationWarning, "/x/other.py", 3)
    assert warnings.formatwarning is before


def test_a_fit_that_raises_puts_the_format_back(tmp_path: Path) -> None:
    before = warnings.formatwarning

    class Fails(pl.Callback):
        def on_train_batch_start(self, *args: object) -> None:
            raise RuntimeError("the user's callback failed")

    trainer = pl.Trainer(
        **trainer_kwargs(tmp_path, max_steps=1),
        callbacks=[RecomputationMonitor(), Fails()],
        strategy=SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=["PlainBlock"])),
    )
    with pytest.raises(RuntimeError, match="the user's callback failed"):
        trainer.fit(StackModule(block="PlainBlock"))
    assert warnings.formatwarning is before


def test_a_fit_leaves_a_module_imported_lazily_unloaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A fit reads the warning registry of every loaded module: reading a lazily imported module's attributes imports
    # it (scikit-image and librosa register theirs so), which here fails and ended the fit.
    source = tmp_path / "optional_plugin.py"
    source.write_text("raise ImportError('a dependency that is not installed')\n")
    spec = importlib.util.spec_from_file_location("optional_plugin", source)
    assert spec is not None and spec.loader is not None
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "optional_plugin", module)
    spec.loader.exec_module(module)
    trainer = pl.Trainer(
        **trainer_kwargs(tmp_path, max_steps=1),
        callbacks=[RecomputationMonitor()],
        strategy=SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=["PlainBlock"])),
    )
    trainer.fit(StackModule(block="PlainBlock"))
    assert trainer.global_step == 1
    assert type(module) is not types.ModuleType  # still the lazy loader's: never loaded


class NotingModule(StackModule):
    """Logs one package note per training step."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logging.getLogger("lightning_ckpt_determinism.x").info("note at step %d", batch_idx)
        return super().training_step(batch, batch_idx)


class FailsAtStep(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, i: int) -> None:
        if i == self.step:
            raise RuntimeError("the user's callback failed")


class LoggerDuringFit(pl.Callback):
    """What the package logger is while the fit trains."""

    def __init__(self) -> None:
        self.seen: tuple[int, int, bool] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        logger = logging.getLogger("lightning_ckpt_determinism")
        self.seen = (len(logger.handlers), logger.level, logger.propagate)


def _logger_state() -> tuple[list[logging.Handler], int, bool]:
    logger = logging.getLogger("lightning_ckpt_determinism")
    return list(logger.handlers), logger.level, logger.propagate


@contextlib.contextmanager
def _application_without_logging() -> Iterator[None]:
    """The root logger without handlers (pytest gives it its own), as in a script that configured no logging."""
    root = logging.getLogger()
    handlers = list(root.handlers)
    for handler in handlers:
        root.removeHandler(handler)
    try:
        yield
    finally:
        for handler in handlers:
            root.addHandler(handler)


def _fit(tmp_path: Path, part: str, fails_at: int | None, during: LoggerDuringFit) -> None:
    """A fit with the package's strategy, its monitor (on a model checkpointed by hand), or both."""
    callbacks: list[pl.Callback] = [during] + ([FailsAtStep(fails_at)] if fails_at is not None else [])
    module = NotingModule(block="PlainBlock")
    config = CheckpointingConfig(classes=["PlainBlock"])
    kwargs = trainer_kwargs(tmp_path, max_steps=2)
    if part != "strategy":
        callbacks.append(RecomputationMonitor())
    if part == "monitor":
        apply_activation_checkpointing(module, config)
    else:
        kwargs["strategy"] = SingleDeviceCheckpointingStrategy(checkpointing=config)
    trainer = pl.Trainer(**kwargs, callbacks=callbacks)
    if fails_at is None:
        trainer.fit(module)
        return
    with pytest.raises(RuntimeError, match="the user's callback failed"):
        trainer.fit(module)


@pytest.mark.parametrize("part", ["strategy", "monitor", "both"])
@pytest.mark.parametrize("fails_at", [None, 1])
def test_a_fit_shows_the_package_notes_on_stderr_and_puts_the_logger_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], part: str, fails_at: int | None
) -> None:
    during = LoggerDuringFit()
    with _application_without_logging():
        before = _logger_state()
        _fit(tmp_path, part, fails_at, during)
        after = _logger_state()
        logging.getLogger("lightning_ckpt_determinism.x").info("note after the fit")
    # During the fit: one handler of the package's own (one for the strategy and the monitor together), INFO shown,
    # nothing passed on to the root.
    assert during.seen == (len(before[0]) + 1, logging.INFO, False)
    assert after == before
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note ")]
    # One note per `training_step` call, and none once the fit is over.
    assert notes == _notes_expected(part, fails_at)


@pytest.mark.parametrize("part", ["strategy", "monitor"])
def test_a_fit_installs_no_handler_when_the_application_configured_logging(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, part: str
) -> None:
    # pytest's own handlers sit on the root logger: the application's logging, which receives the notes.
    assert logging.getLogger().handlers
    before = _logger_state()
    during = LoggerDuringFit()
    _fit(tmp_path, part, None, during)
    assert during.seen == (len(before[0]), logging.INFO, before[2])
    assert _logger_state() == before
    notes = [r.getMessage() for r in caplog.records if r.name == "lightning_ckpt_determinism.x"]
    assert notes == _notes_expected(part, None)


def _notes_expected(part: str, fails_at: int | None) -> list[str]:
    """The `training_step` calls of a fit: steps 0 and 1, or step 0 alone when the fit fails at step 1; the monitor
    checks step 0, whose reference pass calls `training_step` again."""
    steps = [0, 1] if fails_at is None else [0]
    calls = [0, *steps] if part != "strategy" else steps
    return [f"note at step {step}" for step in calls]
