"""``CheckpointingCLI``: a ``LightningCLI`` that reports a configuration mistake in one line and exits with 2.

LightningCLI shows a configuration mistake as a traceback of 40 to 80 lines, or as jsonargparse's nested report
of every alternative it tried. This CLI prints the one line that matters, naming the full key:

- a value that a signature rejects while parsing (``PositiveInt``, a ``Literal``):
  ``error: `trainer.strategy.checkpointing.every_n`: Not of type PositiveInt: 0 does not conform ...``;
- a ``class_path`` that names nothing: ``error: `model`: module 'examples.gpt' has no attribute 'GPTModul'``;
- a YAML syntax error in a ``--config`` file, with its place: ``error: run.yaml:3:4: invalid YAML: ...``;
- a constructor's message that starts with the argument in backticks (every :class:`CheckpointingConfigError`
  does: an op torch does not know, a strategy without ``checkpointing``) and a ``CheckpointingConfigError`` raised
  when the strategy sets the model up (a selection that matches no module);
- Lightning's own message for a strategy name it does not know (``strategy: dpp``).

Any other error keeps its traceback.
"""

import re
import sys
from argparse import ArgumentError
from itertools import pairwise, takewhile
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch.cli import LightningCLI

from lightning_ckpt_determinism.errors import CheckpointingConfigError

__all__ = ["CheckpointingCLI", "config_file_error", "configuration_error", "yaml_error"]

# jsonargparse nests the errors of each part of a config under the part's key, one level deeper each time.
_PARSER_KEY = re.compile(r'( *)Parser key "([^"]+)":(.*)')
# The package's messages start with the argument they are about, in backticks; jsonargparse's never do.
_PACKAGE_MESSAGE = re.compile(r"^ *- (`.+)$", re.MULTILINE)
_CONFIG_OPTIONS = ("--config", "-c")


class CheckpointingCLI(LightningCLI):
    """A ``LightningCLI`` that reports a configuration error on one line, without a traceback, and exits with 2.

    Use it in place of ``LightningCLI`` in a training script; it takes the same arguments. What counts as a
    configuration error is listed in :mod:`lightning_ckpt_determinism.lightning.cli`.

    Args:
        *args: Passed to ``LightningCLI``.
        **kwargs: Passed to ``LightningCLI``; ``parser_kwargs`` gets ``exit_on_error=False`` unless it says otherwise.

    Raises:
        SystemExit: With code 2 after printing the error, for a configuration error.

    Example::

        from lightning_ckpt_determinism import CheckpointingCLI

        if __name__ == "__main__":
            CheckpointingCLI(MyLightningModule, MyDataModule)
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Parse errors are raised to here instead of printing the whole usage.
        kwargs["parser_kwargs"] = {"exit_on_error": False, **(kwargs.get("parser_kwargs") or {})}
        try:
            given = kwargs.get("args")
            file_error = config_file_error(sys.argv[1:] if given is None else given)
            if file_error is not None:
                raise CheckpointingConfigError(file_error)
            super().__init__(*args, **kwargs)
        except (ArgumentError, ValueError) as err:
            message = configuration_error(err)
            if message is None:
                raise
            print(f"error: {message}", file=sys.stderr)
            sys.exit(2)


def config_file_error(args: Any) -> str | None:
    """The YAML syntax error of the first ``--config`` file in ``args`` that has one, as ``file:line:column``.

    Args:
        args: A command line as a list of strings (anything else, a dict or a namespace, holds no file to read).

    Example::

        >>> config_file_error(["fit", "--trainer.max_steps=1"]) is None
        True
    """
    if not isinstance(args, (list, tuple)):
        return None
    for path in _config_paths([str(arg) for arg in args]):
        try:
            text = path.read_text(encoding="utf-8")
            yaml.safe_load(text)
        except (OSError, UnicodeDecodeError):
            continue  # LightningCLI reports what it cannot read
        except yaml.YAMLError as err:
            return yaml_error(path, text, err)
    return None


def _config_paths(args: list[str]) -> list[Path]:
    values = [value for option, value in pairwise(args) if option in _CONFIG_OPTIONS]
    values += [arg.split("=", 1)[1] for arg in args if arg.split("=", 1)[0] in _CONFIG_OPTIONS and "=" in arg]
    return [Path(value) for value in values if Path(value).is_file()]


def yaml_error(path: Path, text: str, err: yaml.YAMLError) -> str:
    """One line for a YAML syntax error: ``file:line:column`` (1-based) and yaml's problem.

    Args:
        path: The file.
        text: Its text.
        err: What ``yaml.safe_load`` raised.

    Example::

        >>> text = "a: 1\\n b: 2"
        >>> try:
        ...     yaml.safe_load(text)
        ... except yaml.YAMLError as err:
        ...     print(yaml_error(Path("run.yaml"), text, err))
        run.yaml:2:3: invalid YAML: mapping values are not allowed here; correct the file there
    """
    if isinstance(err, yaml.MarkedYAMLError) and err.problem_mark is not None:
        line, column = err.problem_mark.line, err.problem_mark.column
        problem = " ".join(part for part in (err.problem, err.context) if part)
    elif isinstance(err, yaml.reader.ReaderError):
        line = text.count("\n", 0, err.position)
        column = err.position - (text.rfind("\n", 0, err.position) + 1)
        problem = f"unacceptable character #x{err.character:04x}: {err.reason}"
    else:
        return f"{path} is no valid YAML: {' '.join(str(err).split())}; correct the file"
    return f"{path}:{line + 1}:{column + 1}: invalid YAML: {problem}; correct the file there"


def configuration_error(err: Exception) -> str | None:
    """One line for a configuration error: the package's own message where there is one, else jsonargparse's;
    ``None`` for an error that is not about the configuration.

    Args:
        err: What building the CLI raised.

    Example::

        >>> configuration_error(CheckpointingConfigError("`every_n` must be positive"))
        '`every_n` must be positive'
        >>> configuration_error(ValueError("dropout probability has to be between 0 and 1")) is None
        True
    """
    if isinstance(err, CheckpointingConfigError):
        return str(err)
    package_message = _PACKAGE_MESSAGE.search(str(err))
    if package_message:
        return package_message[1]
    if "invalid strategy name" in str(err):
        # Lightning's own message for a strategy name it does not know (`strategy: dpp`), on one line.
        return " ".join(str(err).split())
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
