"""``CheckpointingCLI``: a ``LightningCLI`` that reports a configuration mistake in one line and exits with 2.

LightningCLI shows a configuration mistake as a traceback of 40 to 80 lines, or as jsonargparse's nested report
of every alternative it tried. This CLI prints the one line that matters, naming the full key:

- a value of ``CheckpointingConfig`` or ``RecomputationMonitor`` that their constructor refuses, with the message
  it gives in Python and the field named by its key, checked before anything is built:
  ``error: `trainer.strategy.checkpointing.every_n` must be an integer >= 1, got 0.``;
- a value outside a ``Literal``, in the same words as the package's choices:
  ``error: `trainer.callbacks[0].on_divergence` can be warn, raise, ignore, got 'stop'.``;
- any other value that a signature rejects while parsing: ``error: `trainer.max_steps`: Expected an int ...``;
- a ``class_path`` that names nothing: ``error: `model`: module 'examples.gpt' has no attribute 'GPTModul'``;
- a YAML syntax error in a ``--config`` file, with its place: ``error: run.yaml:3:4: invalid YAML: ...``;
- a constructor's message that starts with the argument in backticks (every :class:`CheckpointingConfigError`
  does: a strategy without ``checkpointing``) and a ``CheckpointingConfigError`` raised when the strategy sets the
  model up (a selection that matches no module) or when the fit starts (a monitor with nothing to check);
- Lightning's own message for a strategy name it does not know (``strategy: dpp``).

Any other error keeps its traceback.
"""

import ast
import contextlib
import dataclasses
import difflib
import inspect
import os
import re
import sys
from argparse import ArgumentError
from collections.abc import Callable, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import yaml
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import StrategyRegistry
from torch.multiprocessing import ProcessRaisedException

from lightning_ckpt_determinism import errors
from lightning_ckpt_determinism._library_compat import (
    bool_expected,
    class_refusing,
    is_unknown_strategy_error,
    list_expected,
    literal_rejection,
    package_message_in,
    rejected_value,
)
from lightning_ckpt_determinism.config import (
    AUTO_CLASSES,
    CheckpointingConfig,
    check_memory_budget,
    choice_message,
    class_path_meant,
    resolve_class_path,
)
from lightning_ckpt_determinism.errors import CheckpointingConfigError, RecomputationDivergenceError
from lightning_ckpt_determinism.lightning.cli_values import check_parsed_config
from lightning_ckpt_determinism.lightning.monitor import RecomputationMonitor, given_twice
from lightning_ckpt_determinism.lightning.registry import REGISTERED, register_strategies, registered_name

__all__ = [
    "CheckpointingCLI",
    "callback_indexed",
    "configuration_error",
    "misplaced_arguments",
    "yaml_error",
]

TRACEBACK_VARIABLE = "LIGHTNING_CKPT_DETERMINISM_TRACEBACK"
"""Set to ``1`` to see the traceback of a fit that ``on_divergence: raise`` stopped, rather than its one line."""

_CONFIG_OPTIONS = ("--config", "-c")
_KEY_AND_REASON = re.compile(r"`([^`]+)`: (.*)")
_WHOLE_CONFIG, _WHOLE_CONFIG_KEY = "`CheckpointingConfig` ", "`trainer.strategy.checkpointing`"
# A message that starts with a field's name (found when the strategy sets the model up) is named by its full key.
_FIELD_FIRST = re.compile(r"^`(\w+)`")


def _keyed_field(found: re.Match[str]) -> str:
    fields = {field.name for field in dataclasses.fields(CheckpointingConfig)}
    return f"`trainer.strategy.checkpointing.{found[1]}`" if found[1] in fields else found[0]


# Python's words for a class path whose module has no such name, as jsonargparse passes them on.
_NO_ATTRIBUTE = re.compile(r"module '([\w.]+)' has no attribute '(\w+)'")
_GIVEN_CLASS_PATH = re.compile(r"Problem with given class_path '([\w.]+)'")
# The package's error that ended a spawned process, last in the traceback text its parent receives.
_PACKAGE_ERROR = re.compile(r"^lightning_ckpt_determinism\.errors\.(\w+): (.*)\Z", re.MULTILINE | re.DOTALL)


class CheckpointingCLI(LightningCLI):
    """A ``LightningCLI`` that reports a configuration error on one line, without a traceback, and exits with 2.

    Use it in place of ``LightningCLI`` in a training script; it takes the same arguments. What counts as a
    configuration error is listed in :mod:`lightning_ckpt_determinism.lightning.cli`. The run is driven by its YAML:
    the fix hints of each :class:`~lightning_ckpt_determinism.RecomputationMonitor` it builds name settings as the
    YAML writes them (``preserve_host_rng: true`` under ``trainer.strategy.init_args.checkpointing``).

    Args:
        *args: Passed to ``LightningCLI``.
        **kwargs: Passed to ``LightningCLI``; ``parser_kwargs`` gets ``exit_on_error=False`` unless it says otherwise.

    Raises:
        SystemExit: With code 2 after printing the error, for a configuration error; with code 1 after printing its
            one line (step, region, cause), for a fit that ``on_divergence: raise`` stopped (set the environment
            variable ``LIGHTNING_CKPT_DETERMINISM_TRACEBACK=1`` for the traceback instead).

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
            self._arguments = sys.argv[1:] if given is None else given
            file_error = config_file_error(self._arguments)
            if file_error is not None:
                raise CheckpointingConfigError(file_error)
            super().__init__(*args, **kwargs)
        except (ArgumentError, ValueError, RuntimeError, RecomputationDivergenceError, ProcessRaisedException) as err:
            said = _one_line(err)
            if said is None:
                raise
            configs = _configs(sys.argv[1:] if given is None else given)
            misplaced = misplaced_arguments(configs)
            if said[1] == 2:
                arguments = sys.argv[1:] if given is None else given
                said = (misplaced or callback_indexed(said[0], configs, arguments), 2)
            print(f"error: {said[0]}", file=sys.stderr)
            sys.exit(said[1])

    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        """The Trainer, as ``LightningCLI`` builds it, with its monitors' hints in YAML form.

        Args:
            **kwargs: Passed to ``LightningCLI.instantiate_trainer``.
        """
        trainer = super().instantiate_trainer(**kwargs)
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, RecomputationMonitor):
                callback.hint_syntax = "yaml"
        return trainer

    def before_instantiate_classes(self) -> None:
        """Check the package's values before anything is built, naming each mistake's key."""
        super().before_instantiate_classes()
        parsed = self.config[self.subcommand] if self.subcommand else self.config
        check_parsed_config(parsed)
        dropped = _checkpointing_dropped(_configs(getattr(self, "_arguments", ())), parsed.get("trainer"))
        if dropped is not None:
            raise CheckpointingConfigError(dropped)


def _one_line(err: Exception) -> tuple[str, int] | None:
    """The line to print for ``err`` and the exit status (2: a configuration mistake, 1: a finding that stopped the
    fit), or ``None`` to let it raise. A spawned process's error is read from the text its parent receives."""
    if isinstance(err, ProcessRaisedException):
        child = _PACKAGE_ERROR.search(str(err))
        kind = None if child is None else getattr(errors, child[1], None)
        if child is None or not isinstance(kind, type):
            return None
        if issubclass(kind, CheckpointingConfigError):
            return " ".join(child[2].split()), 2
        err = kind(child[2]) if issubclass(kind, RecomputationDivergenceError) else err
    if isinstance(err, RecomputationDivergenceError):
        # A finding, not a crash: its message names the step, region and cause; the traceback adds nothing.
        wanted = os.environ.get(TRACEBACK_VARIABLE, "") not in ("", "0")
        return None if wanted else (" ".join(str(err).split()), 1)
    if isinstance(err, RuntimeError) and _MONITORS_TWICE not in str(err):
        return None  # the fit's own error, with its traceback
    message = configuration_error(err)
    return None if message is None else (message, 2)


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


_CLASS_KEYS = ("class_path", "init_args", "dict_kwargs")


def misplaced_arguments(configs: list[Any]) -> str | None:
    """The first argument a config puts beside a ``class_path`` instead of under its ``init_args``, or the strategy's
    ``checkpointing`` put under ``trainer``, said in one line; ``None`` when there is none. LightningCLI refuses both
    in words that blame something else ("Option 'class_path' is not accepted").

    Args:
        configs: The loaded ``--config`` files, in order.

    Example::

        >>> monitor = {"class_path": "lightning_ckpt_determinism.RecomputationMonitor", "every_n_steps": 1}
        >>> misplaced_arguments([{"trainer": {"callbacks": [monitor]}}])
        '`trainer.callbacks[0]`: `every_n_steps` sits beside `class_path`; put the arguments under `init_args:`.'
    """
    for config in configs:
        trainer = config.get("trainer") if isinstance(config, dict) else None
        if isinstance(trainer, dict) and "checkpointing" in trainer:
            return (
                "`trainer.checkpointing`: a `checkpointing` config belongs to the strategy; put it under"
                " `trainer.strategy.init_args.checkpointing`."
            )
        found = _beside_class_path(config, "")
        if found is not None:
            return f"`{found[0]}`: `{found[1]}` sits beside `class_path`; put the arguments under `init_args:`."
    return None


def callback_indexed(message: str, configs: list[Any], arguments: Any = ()) -> str:
    """``message`` with its leading ``trainer.callbacks`` key pointed at the callback it is about, by its index in the
    config's list (jsonargparse names the list alone): the one callback whose ``init_args`` hold the field named.
    Where none does and the command line sets the field (``--trainer.callbacks.init_args.sentinel=heavy``), the key
    is that argument as typed. ``message`` as it is otherwise.

    Args:
        message: The line about to be printed.
        configs: The loaded ``--config`` files, in order.
        arguments: The command line's arguments.

    Example::

        >>> monitor = {"class_path": "RecomputationMonitor", "init_args": {"sentinel": "heavy"}}
        >>> configs = [{"trainer": {"callbacks": [{"class_path": "LearningRateMonitor"}, monitor]}}]
        >>> callback_indexed("`trainer.callbacks.sentinel` can be light, sampled, exact, off, got 'heavy'.", configs)
        "`trainer.callbacks[1].sentinel` can be light, sampled, exact, off, got 'heavy'."
    """
    found = _CALLBACKS_KEY.match(message)
    if found is None:
        return message
    refused, listed, missing = _REFUSED.search(message), _LISTED_OF.search(message), _NO_ATTRIBUTE.search(message)
    field = found[1] or (refused[1] if refused is not None else None)
    lists = _listed_callbacks(configs)
    if field is not None:
        holding = _holding(lists, lambda path, init_args: field in init_args)
        typed = _typed_callback_argument(field, arguments) if not holding else None
        if typed is not None:
            return f"`{typed}`{message[found.end() :]}"
    elif listed is not None:  # its `init_args` a list: the callback of that class, its path written in full or not
        named = listed[1].rsplit(".", 1)[-1]
        holding = _holding(lists, lambda path, init_args: str(path).rsplit(".", 1)[-1] == named)
    elif missing is not None:  # a class path that names nothing: the callback whose path goes through the name
        through = f"{missing[1]}.{missing[2]}."
        holding = _holding(lists, lambda path, init_args: f"{path}.".startswith(through))
    else:
        return message
    if len(holding) != 1:
        return message
    key = f"trainer.callbacks[{min(holding)}]" + (f".{found[1]}" if found[1] else "")
    return f"`{key}`{message[found.end() :]}"


_CALLBACKS_KEY = re.compile(r"^`trainer\.callbacks(?:\.(\w+))?`")


def _typed_callback_argument(field: str, arguments: Any) -> str | None:
    """The last command-line argument that sets a callback's ``field`` (``--trainer.callbacks.init_args.<field>`` or
    ``--trainer.callbacks.<field>``), without its value; ``None`` where none does."""
    if not isinstance(arguments, (list, tuple)):
        return None
    pattern = re.compile(rf"--trainer\.callbacks\.(?:init_args\.)?{re.escape(field)}(?==|$)")
    typed = [matched[0] for matched in map(pattern.match, map(str, arguments)) if matched is not None]
    return typed[-1] if typed else None


_LISTED_OF = re.compile(r"the `init_args` of `([\w.]+)` are a list")


def _listed_callbacks(configs: list[Any]) -> list[list[tuple[object, dict[str, Any]]]]:
    """``(class_path, init_args)`` of each callback of each config that lists callbacks, in their orders."""
    lists = []
    for config in configs:
        trainer = config.get("trainer") if isinstance(config, dict) else None
        callbacks = trainer.get("callbacks") if isinstance(trainer, dict) else None
        if isinstance(callbacks, list):
            lists.append([_class_and_arguments(callback) for callback in callbacks])
    return lists


def _holding(
    lists: list[list[tuple[object, dict[str, Any]]]], holds: Callable[[object, dict[str, Any]], bool]
) -> set[int]:
    """The indices, in their own config's list, of the callbacks for which ``holds(class_path, init_args)``; empty
    where callbacks of two configs do (jsonargparse refuses a file as it loads it, so either may be the one)."""
    found = [(number, index) for number, callbacks in enumerate(lists) for index, callback in enumerate(callbacks)]
    found = [(number, index) for number, index in found if holds(*lists[number][index])]
    return {index for _, index in found} if len({number for number, _ in found}) == 1 else set()


def _class_and_arguments(callback: object) -> tuple[object, dict[str, Any]]:
    """A listed callback's ``class_path`` and ``init_args``; ``None`` and ``{}`` for what it does not hold as such."""
    if not isinstance(callback, dict):
        return None, {}
    arguments = callback.get("init_args")
    return callback.get("class_path"), arguments if isinstance(arguments, dict) else {}


def _beside_class_path(node: Any, key: str) -> tuple[str, str] | None:
    if isinstance(node, list):
        return next(
            filter(None, (_beside_class_path(item, f"{key}[{index}]") for index, item in enumerate(node))), None
        )
    if not isinstance(node, dict):
        return None
    if "class_path" in node:
        extra = [name for name in node if name not in _CLASS_KEYS]
        if extra:
            return key, str(extra[0])
    inner = (_beside_class_path(value, f"{key}.{name}" if key else str(name)) for name, value in node.items())
    return next(filter(None, inner), None)


def _configs(args: Any) -> list[Any]:
    """The YAML of each ``--config`` file in ``args`` that loads (a list of strings; anything else holds none)."""
    if not isinstance(args, (list, tuple)):
        return []
    loaded = []
    for path in _config_paths([str(arg) for arg in args]):
        with contextlib.suppress(OSError, UnicodeDecodeError, yaml.YAMLError):
            loaded.append(yaml.safe_load(path.read_text(encoding="utf-8")))
    return loaded


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
        '`trainer.strategy.checkpointing.every_n` must be positive'
        >>> configuration_error(ValueError("dropout probability has to be between 0 and 1")) is None
        True
    """
    if isinstance(err, RuntimeError) and _MONITORS_TWICE in str(err):
        # Lightning refuses two callbacks with one `state_key` (two monitors of the same arguments) in the Trainer.
        return f"`trainer.callbacks`: {given_twice()}"
    if isinstance(err, CheckpointingConfigError):
        # A mistake of the config as a whole found when the strategy sets the model up, named by the config's key.
        if str(err).startswith(_WHOLE_CONFIG):
            return f"{_WHOLE_CONFIG_KEY}: {err}"
        return _FIELD_FIRST.sub(_keyed_field, str(err), count=1)
    package_message = package_message_in(str(err))
    if package_message is not None:
        return package_message
    if is_unknown_strategy_error(err):
        return _class_path_as_a_name(err) or " ".join(str(err).split())
    stock = _stock_strategy_given_checkpointing(str(err))
    if stock is not None:
        return stock
    if not isinstance(err, ArgumentError):
        return None
    named = _registered_name_given_arguments(str(err)) or _not_a_strategy(str(err))
    if named is not None:
        return named
    top = _AT_THE_TOP.search(str(err))
    if top is not None:
        return f"`{top[1]}` sits at the top of the config; {_TRAINER_KEYS[top[1]]}."
    listed = _INIT_ARGS_LISTED.search(str(err))
    if listed is not None:
        return (
            f"`{listed[1]}`: the `init_args` of `{listed[2]}` are a list; write them as `name: value` lines, one"
            " argument each"
        )
    elsewhere = _belongs_elsewhere(str(err))
    if elsewhere is not None:
        return _in_package_words(rejected_value(str(err))) + elsewhere
    return _in_package_words(rejected_value(str(err))) + _option_meant(str(err)) + _class_path_meant(str(err))


_REFUSED = re.compile(r"Option '([^']+)' is not accepted")
_MONITORS_TWICE = "Found more than one stateful callback of type `RecomputationMonitor`"
_INIT_ARGS_LISTED = re.compile(
    r"Parser key \"([\w.]+)\":.*?Problem with given class_path '([\w.]+)':\s*'list' object has no attribute 'keys'",
    re.DOTALL,
)
# What a config's top level may hold that belongs under `trainer` (the subcommand refuses it as "does not accept
# option 'checkpointing.classes'"), and where it goes.
_AT_THE_TOP = re.compile(r"Subcommand '\w+' does not accept option '(checkpointing|strategy|callbacks)[.']")
_TRAINER_KEYS = {
    "checkpointing": "it belongs to the strategy: put it under `trainer.strategy.init_args.checkpointing`",
    "strategy": "it is the Trainer's: put it under `trainer.strategy`",
    "callbacks": "they are the Trainer's: put them under `trainer.callbacks`",
}
_NAME_AS_CLASS_PATH = re.compile(r"Expected a dot import path string: (\w+)")
_ARGUMENT_OVER_A_NAME = re.compile(r"NestedArg\(key='([\w.]+)'")


def _registered_name_given_arguments(text: str) -> str | None:
    """One line for a strategy's registered name given arguments (``class_path: ddp_checkpointing`` with
    ``init_args``, or ``--trainer.strategy.checkpointing.classes`` over ``strategy: ddp_checkpointing``): a name takes
    none, its class does."""
    if 'Parser key "trainer.strategy"' not in text:
        return None
    as_class_path, over_a_name = _NAME_AS_CLASS_PATH.search(text), _ARGUMENT_OVER_A_NAME.search(text)
    if as_class_path is None:
        return None
    name = as_class_path[1]
    argument = f" (`{over_a_name[1]}` here)" if over_a_name is not None else ""
    if name in REGISTERED:
        return (
            f"`trainer.strategy`: `{name}` is a registered name, which takes no arguments{argument}: to configure it,"
            f" give its class as `class_path:` `lightning_ckpt_determinism.{REGISTERED[name].__name__}`, with the"
            " arguments under `init_args:`."
        )
    # A stock name (`ddp`) given the package's arguments: the package's strategy built on it takes them. (jsonargparse
    # says the same of any word it tried as a class path: `checkpointing: auto` is told elsewhere.)
    ours = registered_name(name) if name in StrategyRegistry else None
    if ours is None:
        return None
    return (
        f"`trainer.strategy`: `{name}` is a strategy's name, which takes no arguments{argument}: give"
        f" `lightning_ckpt_determinism.{REGISTERED[ours].__name__}` as `class_path:`, with the arguments under"
        " `init_args:`."
    )


_NOT_A_STRATEGY = re.compile(r"Import path ([\w.]+) does not correspond to a subclass of Strategy")


def _not_a_strategy(text: str) -> str | None:
    """One line for a class that is not a strategy given as ``trainer.strategy``'s ``class_path``: the package's
    config or monitor put in the strategy's place, say."""
    found = _NOT_A_STRATEGY.search(text) if 'Parser key "trainer.strategy"' in text else None
    if found is None:
        return None
    path = found[1]
    where = {
        "CheckpointingConfig": "it is the strategy's `checkpointing`: write it under `init_args: {checkpointing: ...}`"
        " of one of this package's strategies",
        "RecomputationMonitor": "it is a callback: list it under `trainer.callbacks`, and give `trainer.strategy` one"
        " of this package's strategies",
    }.get(path.rsplit(".", 1)[-1], "give one of this package's strategies")
    return f"`trainer.strategy`: `{path}` is not a strategy (a subclass of Lightning's `Strategy`); {where}."


def _belongs_elsewhere(text: str) -> str | None:
    """``; `x` is an argument of ...`` for a monitor's argument given to the checkpointing config or the strategy, or
    a checkpointing field given to the monitor: a close name on the wrong side would change what the setting means
    (`every_n_steps` is not `every_n`)."""
    refused = _REFUSED.search(text)
    if refused is None:
        return None
    # A strategy refuses `checkpointing.<field>`; the config and the monitor refuse `<field>`.
    path = refused[1].split(".")
    under_checkpointing = path[0] == "checkpointing" or 'Parser key "checkpointing"' in text
    name = path[1] if path[0] == "checkpointing" and len(path) > 1 else path[0]
    monitor = set(inspect.signature(RecomputationMonitor).parameters)
    config = {field.name for field in dataclasses.fields(CheckpointingConfig)}
    under_strategy = under_checkpointing or 'Parser key "trainer.strategy"' in text
    if under_strategy and name in monitor - config:
        return (
            f"; `{name}` is an argument of `RecomputationMonitor`: put it under the monitor's `init_args` in"
            " `trainer.callbacks`"
        )
    if "trainer.callbacks" in text and name in config - monitor:
        return (
            f"; `{name}` is a field of `CheckpointingConfig`: put it under `trainer.strategy.init_args.checkpointing`"
        )
    return None


def _class_path_meant(text: str) -> str:
    """``; did you mean `module.Class`?`` for a ``class_path`` whose module has no such name but a close one, or
    whose module has the class itself where the path goes through a submodule it does not have
    (``lightning_ckpt_determinism.strategies.SingleDeviceCheckpointingStrategy``)."""
    missing = _NO_ATTRIBUTE.search(text)
    if missing is None:
        return ""
    meant = class_path_meant(missing[1], missing[2])
    # The class path that goes through the missing name (not another class path the text names: a callback's
    # whose `loss_fn` is the missing name).
    given = [path for path in _GIVEN_CLASS_PATH.findall(text) if path.startswith(f"{missing[1]}.{missing[2]}.")]
    last = given[0].rsplit(".", 1)[-1] if given else missing[2]
    if meant is None and last != missing[2]:
        meant = class_path_meant(missing[1], last) or _imported_holder(missing[1], last)
    return f"; did you mean `{meant}`?" if meant else ""


def _imported_holder(package: str, name: str) -> str | None:
    """``package.sub.name`` for the one module already imported under ``package`` that defines ``name`` (a class path
    through the wrong submodule: ``examples.models.GPTModule`` for ``examples.gpt.GPTModule``); nothing is imported."""
    holders = sorted(
        module_name
        for module_name, module in list(sys.modules.items())
        if module_name.startswith(f"{package}.")
        and getattr(getattr(module, name, None), "__module__", None) == module_name
    )
    return f"{holders[0]}.{name}" if len(holders) == 1 else None


def _option_meant(text: str) -> str:
    """``; did you mean `classes`?`` for an option a class does not take that is close to one it takes."""
    refused = class_refusing(text)
    if refused is None:
        return ""
    try:
        accepted = list(inspect.signature(resolve_class_path(refused[0])).parameters)
    except (CheckpointingConfigError, TypeError, ValueError):
        return ""
    close = difflib.get_close_matches(refused[1].split(".")[0], accepted, n=1)
    return f"; did you mean `{close[0]}`?" if close else ""


def _checkpointing_dropped(configs: list[Any], trainer: Any) -> str | None:
    """One line for a ``checkpointing`` a config file gives its strategy that the parsed config no longer holds: the
    command line replaced the strategy's ``class_path`` by one that takes none, and jsonargparse drops the
    ``init_args`` it does not take without a word. ``None`` where nothing was dropped.

    Args:
        configs: The loaded ``--config`` files.
        trainer: The parsed config's ``trainer`` (a namespace or a mapping).

    Example::

        >>> config = {"trainer": {"strategy": {"init_args": {"checkpointing": {"classes": "auto"}}}}}
        >>> parsed = {"strategy": {"class_path": "lightning.pytorch.strategies.SingleDeviceStrategy", "init_args": {}}}
        >>> _checkpointing_dropped([config], parsed).split(" (")[0].split(": ")[1]
        'lightning.pytorch.strategies.SingleDeviceStrategy takes no `checkpointing`, which the config gives it'
    """
    given = any(
        isinstance(strategy := _at(config, "trainer", "strategy"), dict)
        and isinstance(strategy.get("init_args"), dict)
        and "checkpointing" in strategy["init_args"]
        for config in configs
    )
    strategy = _at(trainer, "strategy")
    if given and isinstance(strategy, str):
        return _dropped_by_a_name(strategy)
    class_path = _at(strategy, "class_path")
    if not given or not isinstance(class_path, str) or _at(strategy, "init_args", "checkpointing") is not None:
        return None
    if class_path.startswith("lightning_ckpt_determinism."):
        return None  # the package's own strategy: its `checkpointing` is checked where it is built
    name = registered_name(class_path.rsplit(".", 1)[-1])
    use = (
        f"use `class_path: lightning_ckpt_determinism.{REGISTERED[name].__name__}`"
        if name is not None
        else "use one of this package's strategies"
    )
    return (
        f"`trainer.strategy`: {class_path} takes no `checkpointing`, which the config gives it (the command line"
        f" replaced the strategy's class and dropped it); {use}, whose `init_args` take it."
    )


def _dropped_by_a_name(strategy: str) -> str:
    """The line for a config's ``checkpointing`` that a strategy given by name (``ddp``, ``ddp_checkpointing``)
    replaced: a name takes no arguments, so the strategy runs without the config's ``checkpointing``."""
    if "." in strategy:
        return _CLASS_PATH_AS_A_NAME.format(given=strategy)
    name = registered_name(strategy)
    if strategy.lower() not in _strategy_names():  # Lightning reads names in any case
        if name is not None and "_" not in strategy and strategy.lower().endswith("strategy"):  # `DDPStrategy`
            return (
                f"`trainer.strategy`: {strategy!r} is a class's name, not a strategy's; to train with the config's"
                f" `checkpointing`, use `class_path: lightning_ckpt_determinism.{REGISTERED[name].__name__}`, whose"
                " `init_args` take it."
            )
        meant = _strategy_name_meant(strategy)
        return (
            f"`trainer.strategy`: {strategy!r} is not a strategy's name{f'; did you mean `{meant}`?' if meant else ''}"
            " (a name takes no `checkpointing`: to keep the config's, give one of this package's strategies as"
            " `class_path`)."
        )
    keep = (
        f"`class_path: lightning_ckpt_determinism.{REGISTERED[name].__name__}`"
        if name is not None
        else "one of this package's strategies as `class_path`"
    )
    return (
        f"`trainer.strategy`: {strategy!r} is a strategy's name, which takes no `checkpointing`, and the config gives"
        f" one (a later `--config` or the command line replaced the strategy, dropping it); to train with it, use"
        f" {keep}, whose `init_args` take it."
    )


_CLASS_PATH_AS_A_NAME = (
    "`trainer.strategy`: {given!r} is a class path written where a strategy's name goes: write it as `class_path:`,"
    " with its arguments under `init_args:` (`class_path: lightning_ckpt_determinism.SingleDeviceCheckpointingStrategy`"
    " and `init_args: {{checkpointing: {{classes: [Block]}}}}`)."
)
_INVALID_NAME = re.compile(r"strategy='([^']+)'")


_CLASS_AS_A_NAME = (
    "`trainer.strategy`: {given!r} is this package's {name}, written where a strategy's name goes: write it as"
    " `class_path: lightning_ckpt_determinism.{name}`, with its arguments under `init_args:` (`init_args:"
    " {{checkpointing: {{classes: [Block]}}}}`), or `strategy: {registered}` for `classes: auto`."
)


def _class_path_as_a_name(err: BaseException) -> str | None:
    """One line for Lightning's "invalid strategy name" where the name is a dotted class path, or one of the package's
    strategy classes by its bare name (Lightning lowercases it)."""
    found = _INVALID_NAME.search(str(err))
    if found is None:
        return None
    if "." in found[1]:
        return _CLASS_PATH_AS_A_NAME.format(given=found[1])
    bare = {strategy.__name__.lower(): (registered, strategy.__name__) for registered, strategy in REGISTERED.items()}
    if found[1].lower() not in bare:
        meant = _strategy_name_meant(found[1])
        return (
            None
            if meant is None
            else f"`trainer.strategy`: {found[1]!r} is not a strategy's name; did you mean `{meant}`?"
        )
    registered, name = bare[found[1].lower()]
    return _CLASS_AS_A_NAME.format(given=found[1], name=name, registered=registered)


def _strategy_names() -> list[str]:
    """Every name ``Trainer(strategy=...)`` takes: Lightning's registry, with the package's names, and ``auto``."""
    register_strategies()
    return [*StrategyRegistry.available_strategies(), "auto"]


def _strategy_name_meant(given: str) -> str | None:
    """The strategy name closest to ``given``, where ``given`` is none and one is close (``ddp`` for ``dpp``)."""
    names = _strategy_names()
    given = given.lower()
    close = difflib.get_close_matches(given, names, n=1, cutoff=0.6) if given not in names else []
    return close[0] if close else None


def _at(node: Any, *keys: str) -> Any:
    """``node[keys[0]][keys[1]]...`` of mappings or namespaces, ``None`` where one is missing."""
    for key in keys:
        if node is None:
            return None
        node = node.get(key) if hasattr(node, "get") else getattr(node, key, None)
    return node


def _stock_strategy_given_checkpointing(text: str) -> str | None:
    """One line for a stock Lightning strategy given ``checkpointing``, naming the package's strategy to use."""
    refused = class_refusing(text)
    if refused is None or refused[1].split(".")[0] != "checkpointing":
        return None
    name = registered_name(refused[0].rsplit(".", 1)[-1])
    if name is None:
        return None
    ours = REGISTERED[name].__name__
    return (
        f"`trainer.strategy`: {refused[0]} takes no `checkpointing`; use `class_path:"
        f" lightning_ckpt_determinism.{ours}` with the same `init_args`, or `strategy: {name}` for `classes: auto`."
    )


def _in_package_words(rejected: str) -> str:
    """A value outside a ``Literal`` said as the package says it of its own choices (the value as a string, as
    jsonargparse prints it); anything else as jsonargparse says it."""
    found = _KEY_AND_REASON.fullmatch(rejected)
    single = list_expected(found[2]) if found else None
    if found is not None and single is not None:
        if single.startswith("{"):
            keys = _mapping_keys(single)
            if keys is not None:
                listed = _as_yaml_list(keys)
                return (
                    f"`{found[1]}` must be a list, got a mapping {single}, whose values nothing reads; list the names"
                    f" alone: {listed}."
                )
            example = _LIST_EXAMPLES.get(found[1].rsplit(".", 1)[-1], "[first, second]")
            return f"`{found[1]}` must be a list, got a mapping {single}; write its items as a list: {example}."
        if not found[1].endswith("classes"):
            return f"`{found[1]}` must be a list, got {single}; write {_as_yaml_list([single])}."
        if difflib.get_close_matches(single.lower(), [AUTO_CLASSES], cutoff=0.75):
            return f"`{found[1]}` must be auto or a list, got {single}: did you mean auto? A class name goes in a list."
        return (
            f"`{found[1]}` must be auto or a list, got {single}; write {_as_yaml_list([single])}, or auto for a"
            " transformer's layers."
        )
    flag = bool_expected(found[2]) if found else None
    if found is not None and flag is not None:
        return f"`{found[1]}` must be true or false, got {flag}."
    config = (_config_not_a_mapping(found[1], found[2]) or _function_not_a_path(found[1], found[2])) if found else None
    if config is not None:
        return config
    budget = _budget_of_another_type(found[1], found[2]) if found else None
    if budget is not None:
        return budget
    if found is not None and "to be a function that returns" in found[2]:
        return f"{rejected} Annotate its return type, as `def loss(module, batch, batch_idx) -> torch.Tensor:`."
    choice = literal_rejection(found[2]) if found else None
    if found is None or choice is None:
        return rejected
    choices, value = choice
    return choice_message(found[1], value, choices) + _yaml_boolean(value, choices)


def _as_yaml_list(names: list[str]) -> str:
    """``names`` as a YAML flow list, each quoted where YAML would read it otherwise (``'*.attn'``: unquoted, YAML
    reads an alias)."""
    return str(yaml.safe_dump(names, default_flow_style=True, allow_unicode=True, width=1 << 16)).strip()


def _mapping_keys(printed: str) -> list[str] | None:
    """The keys of a mapping as jsonargparse prints it (``{'Block': 2}``), as YAML writes them; ``None`` where it does
    not read back as a non-empty mapping of names."""
    try:
        value = ast.literal_eval(printed)
    except (ValueError, SyntaxError):
        return None
    if not isinstance(value, dict) or not value or not all(isinstance(key, str) for key in value):
        return None
    return list(value)


_PATH_EXPECTED = re.compile(r"- Expected a path but (.+?) either not accessible or invalid")
_MAPPING_EXPECTED = re.compile(r"expected a mapping of CheckpointingConfig arguments, got (.+)")


_TYPE_EXPECTED = re.compile(r"Expected a <class '\w+'>, got (.+)")


# How each of the config's list fields is written, for a mapping given in its place.
_LIST_EXAMPLES = {"save_ops": "[aten.mm, aten.convolution]", "names": "[layers.0, layers.1]"}


def _budget_of_another_type(key: str, reason: str) -> str | None:
    """A ``memory_budget`` of a type it does not take (a list, a mapping), said as the package says it."""
    found = _TYPE_EXPECTED.search(reason)
    if not key.endswith("memory_budget") or found is None:
        return None
    try:
        check_memory_budget(yaml.safe_load(found[1]), 1)
    except CheckpointingConfigError as err:
        return f"`{key}`{str(err).removeprefix('`memory_budget`')}"
    except yaml.YAMLError:
        return None
    return None


def _config_not_a_mapping(key: str, reason: str) -> str | None:
    """One line for a ``checkpointing`` given a value that is not a mapping of its fields (``checkpointing: auto``,
    which jsonargparse reads as a config file's path, or a list of classes), with the mapping meant."""
    if not key.endswith("checkpointing"):
        return None
    found = _PATH_EXPECTED.search(reason) or _MAPPING_EXPECTED.search(reason)
    if found is None:
        return None
    value = found[1].strip()
    names = re.findall(r"[\w.]+", value)
    meant = "auto" if value == AUTO_CLASSES else f"[{', '.join(names)}]"
    return (
        f"`{key}` takes the fields of `CheckpointingConfig` as a mapping, got {value}; write `checkpointing:"
        f" {{classes: {meant}}}` to select modules by class."
    )


def _function_not_a_path(key: str, reason: str) -> str | None:
    """One line for a ``loss_fn`` given a name that is not a dotted import path (``loss_fn: my_loss``)."""
    found = _PATH_EXPECTED.search(reason)
    if not key.endswith("loss_fn") or found is None:
        return None
    return (
        f"`{key}` must be a function's import path, as `my_package.losses.my_loss`, got {found[1]!r}: define it in a"
        " module Python can import, as `def my_loss(module, batch, batch_idx) -> torch.Tensor:`."
    )


def _yaml_boolean(value: object, choices: Sequence[object]) -> str:
    """What to write where YAML read a bare ``off`` (``no``, ``on``, ``yes``) as a boolean the ``Literal`` refuses."""
    if str(value) not in ("False", "True"):
        return ""
    quoted = "'off'" if "off" in choices and str(value) == "False" else "the choice"
    words = "off or no" if str(value) == "False" else "on or yes"
    return f" YAML reads a bare {words} as {str(value).lower()}: write {quoted} in quotes."
