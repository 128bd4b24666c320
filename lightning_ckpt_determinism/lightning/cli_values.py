"""The package's own values in a config LightningCLI parsed, checked before anything is built, with their keys.

LightningCLI builds a ``CheckpointingConfig`` or a ``RecomputationMonitor`` deep inside its instantiation, where an
error no longer says which key of the config it came from. :func:`check_parsed_config` builds each of them once from
the parsed config beforehand, so that a mistake gets the message the constructor gives in Python, with the field
named by its key (``trainer.strategy.checkpointing.every_n``, as LightningCLI names every other key and as the
command line overrides it).
"""

import dataclasses
import importlib
import inspect
import re
from collections.abc import Iterator
from typing import Any

from jsonargparse import Namespace

from lightning_ckpt_determinism.config import CheckpointingConfig
from lightning_ckpt_determinism.errors import CheckpointingConfigError
from lightning_ckpt_determinism.lightning.monitor import RecomputationMonitor

__all__ = ["check_parsed_config"]

_LEADING_NAME = re.compile(r"^`([^`]+)`")
# jsonargparse fills in every field of a dataclass it parses: a namespace with exactly these keys is a config.
_CONFIG_FIELDS = frozenset(field.name for field in dataclasses.fields(CheckpointingConfig))
_MONITOR_ARGUMENTS = frozenset(inspect.signature(RecomputationMonitor).parameters)


def check_parsed_config(config: Namespace) -> None:
    """Build every ``CheckpointingConfig`` and ``RecomputationMonitor`` that ``config`` describes once, as
    LightningCLI will, and raise the first one's error with the field named by its key.

    Args:
        config: What LightningCLI parsed (of its subcommand, when it has one).

    Raises:
        CheckpointingConfigError: The constructor's, its field named by its key.

    Example::

        >>> fields = {**dataclasses.asdict(CheckpointingConfig(classes=["Block"])), "every_n": 0}
        >>> try:
        ...     check_parsed_config(Namespace(strategy=Namespace(checkpointing=Namespace(**fields))))
        ... except CheckpointingConfigError as err:
        ...     print(err)
        `strategy.checkpointing.every_n` must be an integer >= 1, got 0.
    """
    for key, build, arguments in _package_values(config, ""):
        try:
            build(**arguments)
        except CheckpointingConfigError as err:
            raise type(err)(located(str(err), key, set(arguments))) from err


def located(message: str, key: str, fields: set[str]) -> str:
    """``message`` of the value at ``key`` with its leading field named by its full key, or with ``key`` before it
    when it names no field.

    Args:
        message: The constructor's message.
        key: The key of the value built, such as ``trainer.strategy.checkpointing``.
        fields: The fields of the value.

    Example::

        >>> located("`every_n` must be an integer >= 1, got 0.", "trainer.strategy.checkpointing", {"every_n"})
        '`trainer.strategy.checkpointing.every_n` must be an integer >= 1, got 0.'
    """
    leading = _LEADING_NAME.match(message)
    if leading is not None and leading[1] in fields:
        return f"`{key}.{leading[1]}`{message[leading.end() :]}"
    return f"`{key}`: {message}"


def _package_values(value: Any, key: str) -> Iterator[tuple[str, Any, dict[str, Any]]]:
    """``(key, constructor, arguments)`` of each package value under ``value``, in the order of the config."""
    if isinstance(value, list):
        for index, item in enumerate(value):
            yield from _package_values(item, f"{key}[{index}]")
        return
    if not isinstance(value, Namespace):
        return
    given = vars(value)
    if set(given) == _CONFIG_FIELDS:
        yield key, CheckpointingConfig, dict(given)
        return
    if "class_path" in given:
        init_args = given.get("init_args")
        if _is_monitor(given["class_path"]) and isinstance(init_args, Namespace):
            # The monitor's own arguments, of a subclass too; a nested class (a `loss_fn` by `class_path`) is built
            # by LightningCLI alone.
            own = {
                name: argument
                for name, argument in vars(init_args).items()
                if name in _MONITOR_ARGUMENTS and not isinstance(argument, Namespace)
            }
            yield key, RecomputationMonitor, own
        yield from _package_values(init_args, key)
        return
    for name, argument in given.items():
        yield from _package_values(argument, _joined(key, name))


def _is_monitor(class_path: object) -> bool:
    if not isinstance(class_path, str):
        return False
    module, _, name = class_path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return False  # LightningCLI has said so already
    return isinstance(found, type) and issubclass(found, RecomputationMonitor)


def _joined(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name
