"""Loading what the audit checks from LightningCLI configs: the model, the data and the checkpointing strategy, parsed
by LightningCLI's own ``fit`` subcommand."""

import argparse
import contextlib
import importlib
import logging
import os
import re
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import FSDPStrategy, ParallelStrategy, Strategy

from lightning_ckpt_determinism.audit.arguments import UsageError
from lightning_ckpt_determinism.lightning.cli import (
    callback_indexed,
    configuration_error,
    misplaced_arguments,
    yaml_error,
)
from lightning_ckpt_determinism.lightning.cli_values import check_parsed_config
from lightning_ckpt_determinism.lightning.monitor import RecomputationMonitor, given_twice
from lightning_ckpt_determinism.lightning.strategies import ActivationCheckpointingMixin

__all__ = [
    "build",
    "configs_text",
    "fit_notes",
    "monitor_settings",
    "one_process_notes",
    "quiet_lightning",
    "train_dataloader",
]

_QUIET_LOGGERS = ("lightning.pytorch", "lightning.fabric")
_MISSING_MODULE = re.compile(r"No module named '([^']+)'")


class _ParsedFit(LightningCLI):
    """LightningCLI's own ``fit`` subcommand, parsed and instantiated as for training, without training: its
    ``fit`` (which LightningCLI calls in place of ``Trainer.fit`` when the CLI defines one) keeps the arguments."""

    fit_arguments: dict[str, Any]

    def before_instantiate_classes(self) -> None:
        # The package's values, checked as `CheckpointingCLI` checks them: the same message, naming the key.
        super().before_instantiate_classes()
        check_parsed_config(self.config[self.subcommand])

    def fit(self, model: Any, datamodule: Any = None, **arguments: Any) -> None:
        self.fit_arguments = arguments


def build(args: argparse.Namespace) -> _ParsedFit:
    """The CLI built from ``args.config`` (one or several files) and ``args.overrides`` as ``fit`` builds it.

    Raises:
        UsageError: For a file that cannot be read or parsed, a config LightningCLI rejects (one line, as
            :class:`~lightning_ckpt_determinism.CheckpointingCLI` reports it), or a strategy without checkpointing.
    """
    sections = [_read_config(path) for path in args.config]
    _require_class_paths(args, sections)
    where = configs_text(args.config)
    model_class = _option_class("--model", args.model)
    data_class = _option_class("--data", args.data)
    try:
        with warnings.catch_warnings():
            # The audit's own command line is not LightningCLI's; `args` is all it should read.
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
            cli = _ParsedFit(
                model_class,
                data_class,
                subclass_mode_model=model_class is None,
                subclass_mode_data=data_class is None,
                args=["fit", *(f"--config={path}" for path in args.config), *args.overrides],
                save_config_callback=None,
                seed_everything_default=0,
                parser_kwargs={"exit_on_error": False},
            )
    except Exception as err:
        message = misplaced_arguments(sections) or callback_indexed(
            configuration_error(err) or " ".join(str(err).split()), sections, args.overrides
        )
        if message.startswith("unrecognized arguments:"):
            raise UsageError(
                f"{message}: on the audit's command line, neither its own option (see `--help`) nor a dotted"
                " LightningCLI override such as --trainer.max_steps=3"
            ) from err
        given = f"{where} with {' '.join(args.overrides)}" if args.overrides else where
        raise UsageError(f"{given} cannot be loaded: {import_hint(message)}") from err
    strategy = cli.trainer.strategy
    given = cli.config[cli.subcommand].trainer.strategy
    if isinstance(given, str) and given.lower() == "auto":  # Lightning reads names in any case
        overridden = any(str(override).startswith("--trainer.strategy") for override in args.overrides)
        written = any(
            isinstance(section, dict) and isinstance(section.get("trainer"), dict) and "strategy" in section["trainer"]
            for section in sections
        )
        says = (
            f"with `--trainer.strategy={given}` leaves the strategy to Lightning,"
            if overridden
            else "sets `trainer.strategy: auto`, Lightning's choice,"
            if written
            else "sets no `trainer.strategy`,"
        )
        raise UsageError(
            f"{where} {says} so nothing is checkpointed; give it one of this package's"
            " strategies with `checkpointing`, e.g. `class_path:"
            " lightning_ckpt_determinism.SingleDeviceCheckpointingStrategy` with `init_args: {checkpointing:"
            " {classes: auto}}` (a transformer's layers) or `{classes: [YourBlock]}`"
        )
    if not isinstance(strategy, ActivationCheckpointingMixin):
        raise UsageError(
            f"`trainer.strategy` in {where} is {type(strategy).__name__}, which applies no activation"
            " checkpointing; use one of this package's strategies (e.g."
            " lightning_ckpt_determinism.SingleDeviceCheckpointingStrategy) with `checkpointing`"
        )
    _require_runnable_here(strategy, where)
    if not cli.model.automatic_optimization:
        raise UsageError(
            f"{type(cli.model).__name__} uses manual optimization: its `training_step` steps the optimizers, so the"
            " audit cannot rerun it; use `RecomputationMonitor(loss_fn=...)` during training instead"
        )
    cli.model.configure_model()
    return cli


def import_hint(message: str) -> str:
    """``message`` with, when it says a module is missing, where the audit imports from and how to change it.

    Example::

        >>> import_hint("`model`: No module named 'mymodel'")[:67]
        "`model`: No module named 'mymodel' (the audit imports from the work"
    """
    missing = _MISSING_MODULE.search(message)
    if missing is None:
        return message
    return (
        f"{message} (the audit imports from the working directory {os.getcwd()} and PYTHONPATH: run it from the"
        f" directory that holds {missing[1].split('.')[0]}, or add that directory to PYTHONPATH)"
    )


def _option_class(option: str, path: str | None) -> type | None:
    """The class ``--model`` or ``--data`` names, or ``None`` when the option is not given."""
    if path is None:
        return None
    module_path, _, name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_path), name) if module_path else None
    except AttributeError:
        found = None
    except Exception as err:  # the module itself fails to import (a missing module, an error in its code)
        raise UsageError(f"`{option}` {path!r} cannot be imported: {import_hint(str(err))}") from err
    if not isinstance(found, type):
        raise UsageError(f"`{option}` {path!r} names no class; give its dotted path, such as package.module.Class")
    return found


def configs_text(configs: list[Path]) -> str:
    """The config files as messages name them.

    Example::

        >>> configs_text([Path("a.yaml"), Path("b.yaml")])
        'a.yaml + b.yaml'
    """
    return " + ".join(str(path) for path in configs)


def fit_notes(arguments: dict[str, Any]) -> list[str]:
    """What the audit leaves out of ``fit``'s own arguments: the checkpoint to resume from.

    Example::

        >>> fit_notes({"ckpt_path": "last.ckpt"})
        ['note: `ckpt_path` last.ckpt is not loaded: the audit checks the model as the config builds it']
    """
    path = arguments.get("ckpt_path")
    if not path:
        return []
    return [f"note: `ckpt_path` {path} is not loaded: the audit checks the model as the config builds it"]


def monitor_settings(args: argparse.Namespace, callbacks: Sequence[object]) -> list[str]:
    """Give ``args`` what the config's :class:`~lightning_ckpt_determinism.RecomputationMonitor` compares with,
    as the fit's checks do: its ``tolerance`` unless ``--tolerance`` is given, ``calibrate_noise`` where either asks
    for it, and its ``exclude_attributes``; and the note saying what was taken.

    Example::

        >>> args = argparse.Namespace(tolerance=None, calibrate_noise=False)
        >>> monitor_settings(args, [RecomputationMonitor(tolerance=1e-6, exclude_attributes=["stamp"])])
        ["note: compared as the config's RecomputationMonitor compares (tolerance 1e-06, exclude_attributes ['stamp'])"]
        >>> args.tolerance, args.exclude_attributes
        (1e-06, ['stamp'])
    """
    monitors = [callback for callback in callbacks if isinstance(callback, RecomputationMonitor)]
    if len(monitors) > 1:  # the fit refuses them as it starts: so does its audit
        raise UsageError(f"`trainer.callbacks`: {given_twice(len(monitors))}")
    monitor = monitors[0] if monitors else None
    taken = []
    if args.tolerance is None:
        args.tolerance = monitor.tolerance if monitor is not None else 0.0
        if args.tolerance:
            taken.append(f"tolerance {args.tolerance:g}")
    if monitor is not None and monitor.calibrate_noise and not args.calibrate_noise:
        args.calibrate_noise = True
        taken.append("calibrate_noise")
    args.exclude_attributes = list(monitor.exclude_attributes) if monitor is not None else []
    if args.exclude_attributes:
        taken.append(f"exclude_attributes {args.exclude_attributes}")
    if not taken:
        return []
    return [f"note: compared as the config's RecomputationMonitor compares ({', '.join(taken)})"]


def _require_runnable_here(strategy: Strategy, config: str) -> None:
    """Refuse a strategy that cannot train on this machine, which the audit's single unwrapped process would hide.

    Lightning's accelerator connector demands a CUDA accelerator of FSDP, but only of ``FSDPStrategy`` itself and
    its registered names (``type(strategy) is FSDPStrategy``): a subclass such as ``FSDPCheckpointingStrategy``
    passes the Trainer's construction and fails in ``fit``, where torch's FSDP finds no accelerator device. Here the
    same rule holds for every subclass, and the accelerator says whether the machine could follow it.
    """
    if not isinstance(strategy, FSDPStrategy) or isinstance(strategy.accelerator, CUDAAccelerator):
        return
    accelerator = type(strategy.accelerator).__name__
    fix = (
        "set `trainer.accelerator: cuda`"
        if CUDAAccelerator.is_available()
        else "this machine has none: audit with lightning_ckpt_determinism.SingleDeviceCheckpointingStrategy and"
        " the same `checkpointing`, or on a machine with a GPU"
    )
    raise UsageError(
        f"`trainer.strategy` {type(strategy).__name__} in {config} needs a CUDA accelerator (Lightning's FSDP"
        f" shards on GPUs only), got {accelerator}; {fix}"
    )


def one_process_notes(strategy: Strategy) -> list[str]:
    """The audit runs the unwrapped model on one process; say so when training would run several."""
    if not isinstance(strategy, ParallelStrategy):
        return []
    devices, nodes = len(strategy.parallel_devices or []), getattr(strategy, "num_nodes", 1)
    if devices * nodes <= 1:
        return []
    where = f"{devices} devices" + (f" on each of {nodes} nodes" if nodes > 1 else "")
    return [
        f"note: {type(strategy).__name__} with {where} is audited on one process with the same checkpointing config"
    ]


def _read_config(path: Path) -> dict[str, Any]:
    """The mapping in one ``--config`` file, or a one-line usage error about the file."""
    if not path.is_file():
        raise UsageError(f"`--config` {str(path)!r} is not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise UsageError(f"`--config` {str(path)!r} cannot be read: {err.strerror or err}") from err
    except UnicodeDecodeError as err:
        raise UsageError(
            f"`--config` {str(path)!r} is no UTF-8 text (byte {err.start}: {err.reason}); save it as UTF-8"
        ) from err
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise UsageError(yaml_error(path, text, err)) from err
    if not isinstance(config, dict):
        raise UsageError(f"{path} holds no LightningCLI config (a mapping with `model`, `trainer` ...)")
    return config


def _require_class_paths(args: argparse.Namespace, configs: list[dict[str, Any]]) -> None:
    """A YAML written for ``LightningCLI(MyModule, MyData)`` does not name its classes: the audit must be told."""
    where = configs_text(args.config)
    for key, option, example in (("model", args.model, "Module"), ("data", args.data, "DataModule")):
        named = any(override.startswith(f"--{key}") for override in args.overrides)
        sections = [config[key] for config in configs if isinstance(config.get(key), dict)]
        if option is None and not named and sections and not any("class_path" in section for section in sections):
            raise UsageError(
                f"`{key}` in {where} names no class: give it `class_path: package.{example}` with its"
                f" settings under `init_args`, or pass `--{key} package.{example}`"
            )
    named_model = any(override.startswith("--model") for override in args.overrides)
    if args.model is None and not named_model and not any("model" in config for config in configs):
        raise UsageError(f"{where} has no `model`: add one with a `class_path`, or pass `--model`")


def train_dataloader(cli: LightningCLI) -> Any:
    try:
        if cli.datamodule is not None:
            cli.datamodule.prepare_data()
            cli.datamodule.setup("fit")
            return cli.datamodule.train_dataloader()
        return cli.model.train_dataloader()
    except Exception as err:
        raise UsageError(f"no training data: {type(err).__name__}: {err}") from err


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Keep Lightning's informational lines (seed, accelerators, tips) out of the audit's output."""
    loggers = [logging.getLogger(name) for name in _QUIET_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
