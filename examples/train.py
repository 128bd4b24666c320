"""Train an example model with activation checkpointing from a LightningCLI YAML.

The YAML names the model and data classes (``class_path``), so the same file also drives the audit. Run from the
repository root::

    python -m examples.train fit --config examples/configs/gpt_blocks_by_class.yaml
    python -m lightning_ckpt_determinism audit --config examples/configs/gpt_blocks_by_class.yaml

A mistake in the configuration ends the run with one line on stderr that names the field and the value, and exit
code 2, instead of a long traceback::

    error: `trainer.strategy.checkpointing.every_n`: Not of type PositiveInt: 0 does not conform to restriction v>0
"""

import re
import sys
from argparse import ArgumentError
from itertools import takewhile
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import ArgsType, LightningCLI

from lightning_ckpt_determinism import CheckpointingConfigError

__all__ = ["CheckpointingCLI", "main"]

# jsonargparse nests the errors of each part of a config under the part's key, one level deeper each time.
_PARSER_KEY = re.compile(r'( *)Parser key "([^"]+)":(.*)')
# The package's messages start with the argument they are about, in backticks; jsonargparse's never do.
_PACKAGE_MESSAGE = re.compile(r"^ *- (`.+)$", re.MULTILINE)


class CheckpointingCLI(LightningCLI):
    """A ``LightningCLI`` that reports a configuration error on one line, without a traceback, and exits with 2.

    It covers values that LightningCLI rejects while parsing (against a type such as ``PositiveInt`` or a
    ``Literal`` in a signature: the line names the full key), values that a constructor rejects with a message that
    starts with the argument in backticks (every :class:`CheckpointingConfigError` does, e.g. for an op torch does
    not know) and a :class:`CheckpointingConfigError` raised inside ``trainer.fit`` when the strategy sets the model
    up (a selection that matches no module). Any other error keeps its traceback. Copy it into your own script.

    Args:
        *args: Passed to ``LightningCLI``.
        **kwargs: Passed to ``LightningCLI``; ``parser_kwargs`` gets ``exit_on_error=False`` unless it says otherwise.

    Raises:
        SystemExit: With code 2 after printing the error, for a configuration error.

    Example::

        if __name__ == "__main__":
            CheckpointingCLI(MyLightningModule, MyDataModule)
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Parse errors are raised to here instead of printing the whole usage.
        kwargs["parser_kwargs"] = {"exit_on_error": False, **(kwargs.get("parser_kwargs") or {})}
        try:
            super().__init__(*args, **kwargs)
        except (ArgumentError, ValueError) as err:
            message = _configuration_error(err)
            if message is None:
                raise
            print(f"error: {message}", file=sys.stderr)
            sys.exit(2)


def _configuration_error(err: Exception) -> str | None:
    """One line for a configuration error: the package's own message where there is one, else jsonargparse's."""
    if isinstance(err, CheckpointingConfigError):
        return str(err)
    package_message = _PACKAGE_MESSAGE.search(str(err))
    if package_message:
        return package_message[1]
    return _parse_error(str(err)) if isinstance(err, ArgumentError) else None


def _parse_error(text: str) -> str:
    """The innermost value that jsonargparse's nested message rejects, as ```full.key`: why``."""
    lines = text.splitlines()
    chain: list[tuple[int, str]] = []  # (indent, key) of the keys around the current line
    keys: list[str] = []
    at = 0
    for index, line in enumerate(lines):
        if match := _PARSER_KEY.fullmatch(line):
            chain = [outer for outer in chain if outer[0] < len(match[1])] + [(len(match[1]), match[2])]
            if len(chain) > len(keys):
                keys, at = [key for _, key in chain], index
    if not keys:
        return lines[0]
    indent = " " * (len(lines[at]) - len(lines[at].lstrip()) + 2)
    block = list(takewhile(lambda line: line.startswith(indent), lines[at + 1 :]))
    reason = lines[at].split('":', 1)[1].strip() or next(iter(block), "").strip()
    options = [number for number, line in enumerate(block) if line.startswith(indent + "  - ")]
    if reason.startswith("Does not validate against any of the Union subtypes") and options:
        # Of the alternatives, the class whose arguments were given is the one meant, else the first (None is last).
        first = next((number for number in options if block[number].endswith(":")), options[0])
        option = block[first].strip()[2:]
        if option.endswith(":") and first + 1 < len(block):  # "Problem with given class_path '...':" above why
            reason = block[first + 1].strip()
        else:
            given = [line.strip() for line in block if line.startswith(indent + "Given value:")]
            expected = re.sub(r"Not a valid subclass of (\S+)", r"expected a mapping of \1 arguments", option)
            reason = f"{expected}, got {given[-1].removeprefix('Given value: ')}" if given else expected
    return f"`{'.'.join(keys)}`: {reason}"


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
        # gloo's threads still running at interpreter exit now and then abort a finished multi-process run.
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
