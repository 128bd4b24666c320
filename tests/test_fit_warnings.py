"""The package's warnings during a fit read as the README shows them, on lines of their own, and the warning format is
the one found before once the fit ends."""

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest

from lightning_ckpt_determinism import (
    CheckpointingConfig,
    LightningCkptDeterminismWarning,
    RecomputationMonitor,
    SingleDeviceCheckpointingStrategy,
)
from tests.helpers import StackModule, trainer_kwargs

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
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "default"}
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
