"""Train the example GPT with activation checkpointing from a LightningCLI YAML.

Run from the repository root::

    python -m examples.train fit --config examples/configs/gpt_blocks_by_class.yaml
"""

from lightning.pytorch.cli import LightningCLI

from examples.gpt import GPTModule, SyntheticTokensDataModule


def main() -> None:
    LightningCLI(GPTModule, SyntheticTokensDataModule, seed_everything_default=0)


if __name__ == "__main__":
    main()
