"""Train an example model with activation checkpointing from a LightningCLI YAML.

The YAML names the model and data classes (``class_path``), so the same file also drives the audit. Run from the
repository root::

    python -m examples.train fit --config examples/configs/gpt_blocks_by_class.yaml
    python -m lightning_ckpt_determinism audit --config examples/configs/gpt_blocks_by_class.yaml
"""

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI


def main() -> None:
    LightningCLI(
        pl.LightningModule,
        pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        seed_everything_default=0,
    )


if __name__ == "__main__":
    main()
