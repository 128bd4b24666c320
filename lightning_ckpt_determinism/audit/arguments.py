"""The audit's command line: its arguments, their types, and the exit codes."""

import argparse
import difflib
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

__all__ = ["EXIT_DIVERGED", "EXIT_OK", "EXIT_USAGE", "PROGRAM", "UsageError", "misspelt_option", "parser"]

EXIT_OK = 0
EXIT_DIVERGED = 1
EXIT_USAGE = 2
PROGRAM = "lightning-ckpt-determinism"


class UsageError(Exception):
    """A problem with the command line or the configuration: reported in one line, exit code 2."""


class _OneLineParser(argparse.ArgumentParser):
    """argparse's parser, saying a usage error in one line (with where to find the usage) rather than the usage
    block and the error."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.long_options: list[str] = []
        super().__init__(*args, **kwargs)

    def add_argument(self, *names: Any, **kwargs: Any) -> argparse.Action:
        """argparse's ``add_argument``, noting the long options in :attr:`long_options`."""
        self.long_options += [name for name in names if isinstance(name, str) and name.startswith("--")]
        return super().add_argument(*names, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def parser() -> argparse.ArgumentParser:
    """The ``lightning-ckpt-determinism`` parser, with its ``audit`` command.

    Example::

        >>> args, overrides = parser().parse_known_args(["audit", "--config", "run.yaml", "--trainer.max_steps=3"])
        >>> args.config, args.batches, overrides
        ([PosixPath('run.yaml')], 1, ['--trainer.max_steps=3'])
    """
    parser = _OneLineParser(prog=PROGRAM, description="Check that activation recomputation is exact.")
    commands = parser.add_subparsers(dest="command", required=True)
    audit = commands.add_parser(
        "audit",
        help="check a LightningCLI training config before a long run",
        description=(
            "Build the model, data and checkpointing strategy from a LightningCLI YAML, check that every checkpointed"
            " region recomputes exactly what its forward produced, and say what to change where it does not."
            " The YAML is parsed as LightningCLI's `fit` parses it, so the config.yaml a run saved works, and"
            " LightningCLI's dotted overrides (--trainer.precision=bf16-true, --model.init_args.lr=0.1) may follow."
            " Exit 0 when all regions agree, 1 when any diverges, 2 on a usage or configuration error."
        ),
        allow_abbrev=False,
    )
    _audit_arguments(audit)
    return parser


def misspelt_option(overrides: Sequence[str]) -> str | None:
    """The usage error for the first of ``overrides`` (what the audit's own options left for LightningCLI) that is
    not dotted and is close to one of the audit's options, or ``None``: a typo such as ``--batch`` would otherwise
    reach the YAML's parser, which blames the config.

    Args:
        overrides: The arguments ``parse_known_args`` did not recognise.

    Example::

        >>> misspelt_option(["--batch", "2"])
        'unknown option --batch: did you mean --batches?'
        >>> misspelt_option(["--trainer.max_steps=3"]) is None
        True
    """
    audit = _OneLineParser(add_help=False)
    _audit_arguments(audit)
    for argument in overrides:
        name = argument.split("=", 1)[0]
        if not name.startswith("--") or "." in name:
            continue
        close = difflib.get_close_matches(name, audit.long_options, n=1, cutoff=0.75)
        if close:
            return f"unknown option {name}: did you mean {close[0]}?"
    return None


def _audit_arguments(audit: argparse.ArgumentParser) -> None:
    """Add the ``audit`` command's options to ``audit``."""
    audit.add_argument(
        "--config",
        required=True,
        type=Path,
        action="append",
        help="the LightningCLI YAML used for training (such as a run's saved config.yaml); give it more than once to"
        " merge several, later ones winning, as LightningCLI does",
    )
    audit.add_argument("--batches", type=_positive_int, default=1, help="training batches to check (default 1)")
    audit.add_argument("--json", type=Path, help="also write the full report as JSON to this file")
    audit.add_argument(
        "--plot",
        type=Path,
        metavar="PATH.svg",
        help="with a `memory_budget` in the config: also draw its trade-off (kept bytes against recompute cost, at"
        " module and op granularity) as an SVG picture to this file",
    )
    audit.add_argument(
        "--tolerance",
        type=_non_negative_float,
        default=None,
        help="largest gradient divergence counted as equal (default: the config's RecomputationMonitor's, else 0)",
    )
    audit.add_argument(
        "--calibrate-noise",
        action="store_true",
        help="run the reference pass twice and tolerate differences within the noise floor (GPU atomics)",
    )
    audit.add_argument(
        "--model", metavar="CLASS_PATH", help="the LightningModule class, when the YAML's `model` names no class_path"
    )
    audit.add_argument(
        "--data", metavar="CLASS_PATH", help="the LightningDataModule class, when the YAML's `data` names no class_path"
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0.0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a finite non-negative number, got {text!r}")
    return value
