"""Train an example model with activation checkpointing from a LightningCLI YAML.

The YAML names the model and data classes (``class_path``), so the same file also drives the audit. Run from the
repository root::

    python -m examples.train fit --config examples/configs/gpt_blocks_by_class.yaml
    python -m lightning_ckpt_determinism audit --config examples/configs/gpt_blocks_by_class.yaml

The package's ``CheckpointingCLI`` ends a run with a mistake in its configuration with one line on stderr that names
the field by its key and the value, as the constructor does in Python, and exit code 2, instead of a long traceback::

    error: `trainer.strategy.checkpointing.every_n` must be an integer >= 1, got 0.
"""

import gc

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import ArgsType

from lightning_ckpt_determinism import CheckpointingCLI

__all__ = ["main"]


def main(args: ArgsType = None, run: bool = True) -> CheckpointingCLI:
    """Build the model, data and Trainer from the command line (or ``args``) and run the subcommand.

    Args:
        args: The command line without the program name; ``None`` reads ``sys.argv``.
        run: Whether to run the subcommand (``fit``, ...); without it ``args`` holds no subcommand.

    Returns:
        The CLI, with its ``trainer``, ``model`` and ``datamodule``.

    Raises:
        SystemExit: With code 2 for a configuration error, after one line on stderr.

    Example::

        python -m examples.train fit --config examples/configs/gpt_blocks_by_class.yaml
    """
    return CheckpointingCLI(
        pl.LightningModule,
        pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        seed_everything_default=0,
        args=args,
        run=run,
    )


if __name__ == "__main__":
    try:
        main()
    finally:
        # gloo's threads still running at interpreter exit now and then abort a finished multi-process run: the group
        # is destroyed here, and what still holds it (the Trainer, a sharded model) collected, so that they stop now.
        gc.collect()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
