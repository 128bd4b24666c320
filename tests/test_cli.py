"""Tests for `CheckpointingCLI`: each configuration mistake ends in one short message and exit code 2."""

import subprocess
import sys
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import yaml
from jsonargparse import ArgumentParser

from examples import train
from examples.broken import BrokenModule, SyntheticRegression
from examples.gpt import GPTModule
from lightning_ckpt_determinism import (
    CheckpointingCLI,
    CheckpointingConfig,
    CheckpointingConfigError,
    LightningCkptDeterminismWarning,
    RecomputationDivergenceError,
    RecomputationMonitor,
    SingleDeviceCheckpointingStrategy,
)
from tests.helpers import child_env, logged_lines

REPO = Path(__file__).resolve().parents[1]
BASE_CONFIG = REPO / "examples" / "configs" / "gpt_blocks_by_class.yaml"

# (where the value goes, key, bad value, what the message must say)
MISTAKES = {
    "every_n": (
        "checkpointing",
        "every_n",
        0,
        "`trainer.strategy.checkpointing.every_n` must be an integer >= 1, got 0.",
    ),
    "tolerance": (
        "monitor",
        "tolerance",
        -1,
        "`trainer.callbacks[0].tolerance` must be a non-negative float, got -1.",
    ),
    "every_n_steps": (
        "monitor",
        "every_n_steps",
        0,
        "`trainer.callbacks[0].every_n_steps` must be an integer >= 1, got 0.",
    ),
    "save_ops": (
        "checkpointing",
        "save_ops",
        ["aten.nosuchop"],
        "`trainer.strategy.checkpointing.save_ops` entry 'aten.nosuchop' is not an op torch knows.",
    ),
    "classes": (
        "checkpointing",
        "classes",
        ["no_such_package.Block"],
        "`trainer.strategy.checkpointing.classes` entry 'no_such_package.Block' cannot be imported (No module named"
        " 'no_such_package').",
    ),
    "determinism_check": (
        "checkpointing",
        "determinism_check",
        "strict",
        "`trainer.strategy.checkpointing.determinism_check` can be default, none, got 'strict'.",
    ),
    "history_size": (
        "monitor",
        "history_size",
        0,
        "`trainer.callbacks[0].history_size` must be an integer >= 1, got 0.",
    ),
    "log_prefix": (
        "monitor",
        "log_prefix",
        "",
        "`trainer.callbacks[0].log_prefix` must be a non-empty string, got ''.",
    ),
    "reference_regions": (
        "monitor",
        "reference_regions",
        0,
        "`trainer.callbacks[0].reference_regions` must be None, 'auto' or an integer >= 1, got 0.",
    ),
    "checkpointing_null": (
        "strategy",
        "checkpointing",
        None,
        "`checkpointing` is missing: `SingleDeviceCheckpointingStrategy` needs one. Build it with"
        " `CheckpointingConfig(classes=[...])`, or in YAML give the strategy"
        " `init_args: {checkpointing: {classes: [Block]}}`.",
    ),
    "checkpointing_list": (
        "strategy",
        "checkpointing",
        ["Block"],
        "`trainer.strategy.checkpointing` takes the fields of `CheckpointingConfig` as a mapping, got ['Block'];"
        " write `checkpointing: {classes: [Block]}`",
    ),
    "selection_matches_nothing": (
        "checkpointing",
        "classes",
        ["NoSuchBlock"],
        "`trainer.strategy.checkpointing`: `CheckpointingConfig` matches no module of GPTModule:"
        " classes=['NoSuchBlock'], names=[].",
    ),
}


def _config_with(tmp_path: Path, where: str, key: str, value: object) -> Path:
    """The shipped GPT config with ``value`` at ``key`` of the strategy, its ``checkpointing`` or the monitor."""
    config = yaml.safe_load(BASE_CONFIG.read_text())
    strategy_args = config["trainer"]["strategy"]["init_args"]
    sections: dict[str, dict[str, Any]] = {
        "strategy": strategy_args,
        "checkpointing": strategy_args["checkpointing"],
        "monitor": config["trainer"]["callbacks"][0]["init_args"],
    }
    sections[where][key] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _argv(config: Path, tmp_path: Path, *extra: str) -> list[str]:
    return [
        "fit",
        "--config",
        str(config),
        "--trainer.max_steps=1",
        f"--trainer.default_root_dir={tmp_path / 'run'}",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        *extra,
    ]


def _error_lines(stderr: str) -> list[str]:
    """The lines from the first ``error:`` on (what came before is Lightning's own logging)."""
    lines = stderr.splitlines()
    starts = [index for index, line in enumerate(lines) if line.startswith("error: ")]
    assert starts, stderr
    return lines[starts[0] :]


def _refused(capsys: pytest.CaptureFixture[str], config: Path, tmp_path: Path, *extra: str) -> list[str]:
    """The error lines of ``examples/train.py fit`` on ``config`` (see :func:`_argv`), which must exit with code 2."""
    with pytest.raises(SystemExit, match=r"^2$"):
        train.main(_argv(config, tmp_path, *extra))
    return _error_lines(capsys.readouterr().err)


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    # LightningCLI seeds through `seed_everything`, which exports the seed, and warns about pytest's own argv.
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    monkeypatch.setattr(sys, "argv", ["examples/train.py"])


@pytest.mark.usefixtures("in_process")
@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_each_configuration_mistake_is_one_line_naming_the_field_and_exit_code_2(
    mistake: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    where, key, value, message = MISTAKES[mistake]
    with pytest.raises(SystemExit, match=r"^2$"):
        train.main(_argv(_config_with(tmp_path, where, key, value), tmp_path))
    stderr = capsys.readouterr().err
    assert "Traceback" not in stderr
    (line,) = _error_lines(stderr)
    assert line.startswith(f"error: {message}"), line
    assert key in message


# A mistake in each restricted field of `CheckpointingConfig` and `RecomputationMonitor`: (where, field, value).
BOTH_ROUTES = [
    ("checkpointing", "every_n", 0),
    ("checkpointing", "every_n", "two"),
    ("checkpointing", "determinism_check", "strict"),
    ("checkpointing", "memory_budget", "lots"),
    ("checkpointing", "budget_granularity", "layer"),
    ("checkpointing", "budget_cost", "fast"),
    ("checkpointing", "save_ops", ["aten.nosuchop"]),
    ("monitor", "every_n_steps", 0),
    ("monitor", "tolerance", -1),
    ("monitor", "on_divergence", "stop"),
    ("monitor", "attribution", "sometimes"),
    ("monitor", "sentinel", "always"),
    ("monitor", "log_prefix", ""),
    ("monitor", "history_size", 0),
    ("monitor", "reference_regions", 0),
]
KEYS = {"checkpointing": "trainer.strategy.checkpointing", "monitor": "trainer.callbacks[0]"}


def _python_error(where: str, field: str, value: object) -> str:
    build = partial(CheckpointingConfig, classes=["Block"]) if where == "checkpointing" else RecomputationMonitor
    with pytest.raises(CheckpointingConfigError, match=f"^`{field}` ") as raised:
        build(**{field: value})
    return str(raised.value)


@pytest.mark.usefixtures("in_process")
@pytest.mark.parametrize(("where", "field", "value"), BOTH_ROUTES)
def test_a_mistake_reads_the_same_from_python_and_from_yaml_with_the_fields_key(
    where: str, field: str, value: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    python = _python_error(where, field, value)
    (line,) = _refused(capsys, _config_with(tmp_path, where, field, value), tmp_path)
    assert line == f"error: `{KEYS[where]}.{field}`" + python.removeprefix(f"`{field}`")


@pytest.mark.usefixtures("in_process")
@pytest.mark.parametrize(("written", "said"), [("off", "False"), ("yes", "True")])
def test_a_bare_off_that_yaml_reads_as_a_boolean_says_to_quote_it(
    written: str, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _config_with(tmp_path, "monitor", "sentinel", "light")
    path.write_text(path.read_text().replace("sentinel: light", f"sentinel: {written}"))
    assert f"sentinel: {written}\n" in path.read_text()
    quoted = "'off'" if written == "off" else "the choice"
    words = "off or no" if written == "off" else "on or yes"
    assert _refused(capsys, path, tmp_path) == [
        f"error: `trainer.callbacks[0].sentinel` can be light, sampled, exact, off, got '{said}'. YAML reads a bare"
        f" {words} as {said.lower()}: write {quoted} in quotes."
    ]


@pytest.mark.usefixtures("in_process")
@pytest.mark.parametrize(("written", "meant"), [("auto", "auto"), (["Block"], "[Block]"), ("Block", "[Block]")])
def test_a_checkpointing_given_no_mapping_says_which_mapping_to_write(
    written: object, meant: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # jsonargparse reads a string there as a config file's path: "Expected a path but auto ...".
    path = _config_with(tmp_path, "strategy", "checkpointing", written)
    (line,) = _refused(capsys, path, tmp_path)
    assert line == (
        f"error: `trainer.strategy.checkpointing` takes the fields of `CheckpointingConfig` as a mapping, got"
        f" {written}; write `checkpointing: {{classes: {meant}}}` to select modules by class."
    )


@pytest.mark.usefixtures("in_process")
def test_a_strategy_class_swapped_on_the_command_line_does_not_drop_checkpointing_without_a_word(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    swapped = "--trainer.strategy.class_path=lightning.pytorch.strategies.SingleDeviceStrategy"
    assert _refused(capsys, BASE_CONFIG, tmp_path, swapped, "--trainer.callbacks=null") == [
        "error: `trainer.strategy`: lightning.pytorch.strategies.SingleDeviceStrategy takes no `checkpointing`, which"
        " the config gives it (the command line replaced the strategy's class and dropped it); use `class_path:"
        " lightning_ckpt_determinism.SingleDeviceCheckpointingStrategy`, whose `init_args` take it."
    ]


@pytest.mark.usefixtures("in_process")
@pytest.mark.parametrize(
    ("name", "keep"),
    [
        ("ddp", "`class_path: lightning_ckpt_determinism.DDPCheckpointingStrategy`"),
        ("ddp_checkpointing", "`class_path: lightning_ckpt_determinism.DDPCheckpointingStrategy`"),
        ("auto", "one of this package's strategies as `class_path`"),
    ],
)
def test_a_strategy_name_given_on_the_command_line_does_not_drop_checkpointing_without_a_word(
    name: str, keep: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A name takes no arguments: the strategy would train without the config's `checkpointing` (`ddp_checkpointing`
    # with its own defaults).
    assert _refused(capsys, BASE_CONFIG, tmp_path, f"--trainer.strategy={name}", "--trainer.callbacks=null") == [
        f"error: `trainer.strategy`: {name!r} is a strategy's name, which takes no `checkpointing`, and the config"
        " gives one (a later `--config` or the command line replaced the strategy, dropping it); to train with it,"
        f" use {keep}, whose `init_args` take it."
    ]


@pytest.mark.usefixtures("in_process")
def test_a_memory_budget_of_another_type_is_said_as_the_package_says_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _config_with(tmp_path, "checkpointing", "memory_budget", [1])
    assert _refused(capsys, path, tmp_path) == [
        "error: `trainer.strategy.checkpointing.memory_budget` must be a size, got [1]; give bytes (1073741824,"
        " '512MiB', '2GB'), a fraction in (0, 1] (0.5, '50%'), 'auto' or None."
    ]


@pytest.mark.usefixtures("in_process")
def test_two_alike_monitors_are_one_line_not_lightnings_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Lightning refuses them before any hook of the monitor runs: two stateful callbacks with one `state_key`.
    path = _edited(tmp_path, lambda config: config["trainer"]["callbacks"].append(config["trainer"]["callbacks"][0]))
    assert _refused(capsys, path, tmp_path) == [
        "error: `trainer.callbacks`: `RecomputationMonitor` is in the Trainer's callbacks more than once: give it"
        " once. One monitor checks every checkpointed region; several would check each step again, and only the last"
        " one's sentinel would see the regions."
    ]


@pytest.mark.usefixtures("in_process")
def test_a_mistake_of_the_whole_config_is_named_by_the_configs_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(CheckpointingConfigError, match=r"^`CheckpointingConfig` selects nothing") as raised:
        CheckpointingConfig(classes=[])
    assert _refused(capsys, _config_with(tmp_path, "checkpointing", "classes", []), tmp_path) == [
        f"error: `trainer.strategy.checkpointing`: {raised.value}"
    ]


@pytest.mark.usefixtures("in_process")
def test_a_command_line_value_reads_as_the_same_value_in_yaml(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    python = _python_error("checkpointing", "every_n", 0)
    located = f"error: `{KEYS['checkpointing']}.every_n`" + python.removeprefix("`every_n`")
    assert _refused(capsys, BASE_CONFIG, tmp_path, "--trainer.strategy.checkpointing.every_n=0") == [located]
    # A number on the command line is a number, as in YAML.
    cli = train.main(_argv(BASE_CONFIG, tmp_path, "--trainer.strategy.checkpointing.every_n=2")[1:], run=False)
    assert cli.trainer.strategy.checkpointing.every_n == 2


@pytest.mark.usefixtures("in_process")
def test_help_names_what_each_field_takes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match=r"^0$"):
        train.main(["fit", "--trainer.callbacks.help", "lightning_ckpt_determinism.RecomputationMonitor"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(type: PositiveInt, default: 100)" in text
    assert "(type: NonNegativeFloat, default: 0.0)" in text
    assert "(type: NotEmptyStr, default: recompute)" in text
    assert "--trainer.callbacks.on_divergence {warn,raise,ignore}" in text


@pytest.mark.usefixtures("in_process")
def test_a_command_line_override_is_named_by_its_full_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _refused(capsys, BASE_CONFIG, tmp_path, "--trainer.strategy.checkpointing.every_nn=2") == [
        "error: `trainer.strategy.checkpointing`: Option 'every_nn' is not accepted; did you mean `every_n`?"
    ]


@pytest.mark.usefixtures("in_process")
def test_an_error_that_is_no_configuration_error_keeps_its_traceback(tmp_path: Path) -> None:
    # torch's own message, not one in the package's style: the CLI leaves it alone.
    with pytest.raises(ValueError, match=r"dropout probability has to be between 0 and 1, but got 2\.0"):
        train.main(_argv(BASE_CONFIG, tmp_path, "--model.init_args.dropout=2.0"))


@pytest.mark.usefixtures("in_process")
def test_values_parsed_into_restricted_types_train_save_and_load_as_plain_ones(tmp_path: Path) -> None:
    config = _config_with(tmp_path, "monitor", "every_n_steps", 1)
    cli = train.main(_argv(config, tmp_path, "--trainer.max_steps=2", "--trainer.enable_checkpointing=true"))
    assert cli.trainer.global_step == 2
    checkpointing = cli.trainer.strategy.checkpointing
    assert type(checkpointing.every_n) is int
    (monitor,) = [callback for callback in cli.trainer.callbacks if isinstance(callback, RecomputationMonitor)]
    assert (type(monitor.every_n_steps), type(monitor.tolerance), type(monitor.log_prefix)) == (int, float, str)
    assert [entry.step for entry in monitor.history] == [0, 1]
    assert [entry.grad_divergence for entry in monitor.history] == [0.0, 0.0]
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["trainer"]["strategy"]["init_args"]["checkpointing"]["every_n"] == 1
    assert saved["trainer"]["callbacks"][0]["init_args"]["every_n_steps"] == 1
    (checkpoint,) = (tmp_path / "run" / "checkpoints").glob("*.ckpt")
    loaded = torch.load(checkpoint, weights_only=True)
    assert loaded["callbacks"][monitor.state_key]["last_checked_step"] == 1


def _run_subprocess(argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = child_env()
    env.pop("PL_GLOBAL_SEED", None)
    return subprocess.run(
        [sys.executable, "-m", "examples.train", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.parametrize("mistake", ["every_n", "selection_matches_nothing"])
def test_the_command_line_prints_one_line_without_traceback_and_exits_2(mistake: str, tmp_path: Path) -> None:
    where, key, value, message = MISTAKES[mistake]
    result = _run_subprocess(_argv(_config_with(tmp_path, where, key, value), tmp_path))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = _error_lines(result.stderr)
    assert line.startswith(f"error: {message}"), line
    assert result.stdout == ""


def _cli_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """The one error line of the package's `CheckpointingCLI`, used as a plain script would use it."""
    with pytest.raises(SystemExit, match=r"^2$"):
        CheckpointingCLI(subclass_mode_model=True, subclass_mode_data=True, args=argv)
    stderr = capsys.readouterr().err
    assert "Traceback" not in stderr
    (line,) = _error_lines(stderr)
    return line


def _edited(tmp_path: Path, edit: Any) -> Path:
    config = yaml.safe_load(BASE_CONFIG.read_text())
    edit(config)
    path = tmp_path / "edited.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _monitor_flat(config: dict[str, Any]) -> None:
    config["trainer"]["callbacks"][0].update(config["trainer"]["callbacks"][0].pop("init_args"))


def _strategy_flat(config: dict[str, Any]) -> None:
    config["trainer"]["strategy"].update(config["trainer"]["strategy"].pop("init_args"))


def _checkpointing_under_trainer(config: dict[str, Any]) -> None:
    config["trainer"]["checkpointing"] = config["trainer"]["strategy"]["init_args"].pop("checkpointing")


@pytest.mark.usefixtures("in_process")
@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (
            _monitor_flat,
            "`trainer.callbacks[0]`: `{first}` sits beside `class_path`; put the arguments under `init_args:`.",
        ),
        (
            _strategy_flat,
            "`trainer.strategy`: `checkpointing` sits beside `class_path`; put the arguments under `init_args:`.",
        ),
        (
            _checkpointing_under_trainer,
            "`trainer.checkpointing`: a `checkpointing` config belongs to the strategy; put it under"
            " `trainer.strategy.init_args.checkpointing`.",
        ),
    ],
)
def test_arguments_out_of_their_init_args_are_named_where_they_sit(
    edit: Any, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = next(iter(yaml.safe_load(BASE_CONFIG.read_text())["trainer"]["callbacks"][0]["init_args"]))
    line = _cli_error(capsys, _argv(_edited(tmp_path, edit), tmp_path))
    assert line == "error: " + said.format(first=first)


def _strategy_class(class_path: str) -> Any:
    def edit(config: dict[str, Any]) -> None:
        config["trainer"]["strategy"]["class_path"] = class_path

    return edit


@pytest.mark.usefixtures("in_process")
@pytest.mark.parametrize(
    ("class_path", "said"),
    [
        (
            "ddp",
            "`ddp` is a strategy's name, which takes no arguments: give"
            " `lightning_ckpt_determinism.DDPCheckpointingStrategy` as `class_path:`, with the arguments under"
            " `init_args:`.",
        ),
        (
            "lightning_ckpt_determinism.CheckpointingConfig",
            "`lightning_ckpt_determinism.CheckpointingConfig` is not a strategy (a subclass of Lightning's `Strategy`);"
            " it is the strategy's `checkpointing`: write it under `init_args: {checkpointing: ...}` of one of this"
            " package's strategies.",
        ),
        (
            "lightning_ckpt_determinism.RecomputationMonitor",
            "`lightning_ckpt_determinism.RecomputationMonitor` is not a strategy (a subclass of Lightning's"
            " `Strategy`); it is a callback: list it under `trainer.callbacks`, and give `trainer.strategy` one of this"
            " package's strategies.",
        ),
    ],
)
def test_what_is_not_a_strategy_class_in_the_strategys_place_is_named_with_where_it_goes(
    class_path: str, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # jsonargparse's own line was "Expected a <class 'str'>, got {'class_path': ...}".
    line = _cli_error(capsys, _argv(_edited(tmp_path, _strategy_class(class_path)), tmp_path))
    assert line == f"error: `trainer.strategy`: {said}"


@pytest.mark.usefixtures("in_process")
@pytest.mark.parametrize(
    ("key", "said"),
    [
        ("checkpointing", "it belongs to the strategy: put it under `trainer.strategy.init_args.checkpointing`."),
        ("strategy", "it is the Trainer's: put it under `trainer.strategy`."),
        ("callbacks", "they are the Trainer's: put them under `trainer.callbacks`."),
    ],
)
def test_a_trainer_key_at_the_top_of_the_config_is_told_where_it_goes(
    key: str, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The subcommand's own line was "Subcommand 'fit' does not accept option 'checkpointing.classes'".
    def to_the_top(config: dict[str, Any]) -> None:
        config[key] = config["trainer"].pop(key) if key != "checkpointing" else {"classes": ["Block"]}

    line = _cli_error(capsys, _argv(_edited(tmp_path, to_the_top), tmp_path))
    assert line == f"error: `{key}` sits at the top of the config; {said}"


def _strategy_as_a_string(config: dict[str, Any]) -> None:
    config["trainer"]["strategy"] = "lightning_ckpt_determinism.SingleDeviceCheckpointingStrategy"


@pytest.mark.usefixtures("in_process")
@pytest.mark.parametrize("how", ["in the config", "over the config's strategy"])
def test_a_class_path_written_where_a_strategy_name_goes_is_told_to_be_a_class_path(
    how: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Lightning read it as a name, lowercased, and listed its registered names.
    given = "lightning_ckpt_determinism.SingleDeviceCheckpointingStrategy"
    if how == "in the config":
        config, extra = _edited(tmp_path, _strategy_as_a_string), ()
    else:
        config, extra = BASE_CONFIG, (f"--trainer.strategy={given}",)
    expected = given if how != "in the config" else given.lower()
    assert _refused(capsys, config, tmp_path, *extra) == [
        f"error: `trainer.strategy`: {expected!r} is a class path written where a strategy's name goes: write it as"
        " `class_path:`, with its arguments under `init_args:` (`class_path:"
        " lightning_ckpt_determinism.SingleDeviceCheckpointingStrategy` and `init_args: {checkpointing: {classes:"
        " [Block]}}`)."
    ]


@pytest.mark.usefixtures("in_process")
def test_a_strategy_class_written_by_its_bare_name_where_a_name_goes_is_told_its_class_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Lightning's own line lowercased it and listed its registered names, without a fix.
    def bare(config: dict[str, Any]) -> None:
        config["trainer"]["strategy"] = "DDPCheckpointingStrategy"

    assert _refused(capsys, _edited(tmp_path, bare), tmp_path) == [
        "error: `trainer.strategy`: 'ddpcheckpointingstrategy' is this package's DDPCheckpointingStrategy, written"
        " where a strategy's name goes: write it as `class_path: lightning_ckpt_determinism.DDPCheckpointingStrategy`,"
        " with its arguments under `init_args:` (`init_args: {checkpointing: {classes: [Block]}}`), or `strategy:"
        " ddp_checkpointing` for `classes: auto`."
    ]


@pytest.mark.usefixtures("in_process")
@pytest.mark.parametrize("typed", ["SingleDeviceCheckpointingStrateg", "DDPStrategyy"])
def test_a_mistyped_bare_class_path_is_not_called_a_strategys_name(
    typed: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _cli_error(capsys, _argv(_edited(tmp_path, _strategy_class(typed)), tmp_path))
    assert line.startswith("error: `trainer.strategy`")
    assert typed in line and "strategy's name" not in line


@pytest.mark.usefixtures("in_process")
def test_a_stock_strategy_name_given_the_packages_arguments_names_the_class_that_takes_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = ("--trainer.strategy=ddp", "--trainer.strategy.init_args.checkpointing.classes=[Block]")
    assert _refused(capsys, BASE_CONFIG, tmp_path, *extra) == [
        "error: `trainer.strategy`: `ddp` is a strategy's name, which takes no arguments (`checkpointing.classes`"
        " here): give `lightning_ckpt_determinism.DDPCheckpointingStrategy` as `class_path:`, with the arguments"
        " under `init_args:`."
    ]


@pytest.mark.usefixtures("in_process")
def test_a_flag_given_another_value_in_yaml_is_said_as_python_says_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _edited(tmp_path, lambda config: config["trainer"]["callbacks"][0]["init_args"].update(prog_bar=2))
    line = _cli_error(capsys, _argv(config, tmp_path))
    assert line == "error: `trainer.callbacks[0].prog_bar` must be true or false, got 2."


def _return_annotation_required() -> bool:
    """Whether the installed jsonargparse refuses a function without a return annotation for a ``Callable`` returning
    a tensor, as `RecomputationMonitor.loss_fn` is typed (4.53 does)."""
    from collections.abc import Callable

    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--loss_fn", type=Callable[[Any, Any, int], torch.Tensor])
    try:
        parser.parse_object({"loss_fn": "tests.test_cli.loss_without_annotation"})
    except Exception:
        return True
    return False


def loss_without_annotation(module: Any, batch: Any, batch_idx: int):  # type: ignore[no-untyped-def]
    """A `loss_fn` as the docs write it, without its return annotation."""
    return module.training_step(batch, batch_idx)


def loss_of_two(module: Any, batch: Any) -> torch.Tensor:
    """A `loss_fn` that forgets `batch_idx`."""
    return module.training_step(batch, 0)


@pytest.mark.usefixtures("in_process")
@pytest.mark.parametrize(
    ("value", "said"),
    [
        (
            "tests.test_cli.loss_without_annotation",
            "Expected 'tests.test_cli.loss_without_annotation' to be a function that returns <class 'Tensor'>."
            " Annotate its return type, as `def loss(module, batch, batch_idx) -> torch.Tensor:`.",
        ),
        ("tests.test_cli.no_such_loss", "module 'tests.test_cli' has no attribute 'no_such_loss'"),
    ],
)
def test_a_loss_fn_the_cli_refuses_says_why_in_one_line(
    value: str, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if value.endswith("without_annotation") and not _return_annotation_required():
        pytest.skip("this jsonargparse takes a function without its return annotation (4.51 does)")
    config = _edited(tmp_path, lambda config: config["trainer"]["callbacks"][0]["init_args"].update(loss_fn=value))
    line = _cli_error(capsys, _argv(config, tmp_path))
    assert line == f"error: `trainer.callbacks[0].loss_fn`: {said}"


@pytest.mark.usefixtures("in_process")
def test_a_loss_fn_given_as_a_bare_name_is_told_to_be_an_import_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _edited(tmp_path, lambda config: config["trainer"]["callbacks"][0]["init_args"].update(loss_fn="my_loss"))
    assert _cli_error(capsys, _argv(config, tmp_path)) == (
        "error: `trainer.callbacks[0].loss_fn` must be a function's import path, as `my_package.losses.my_loss`, got"
        " 'my_loss': define it in a module Python can import, as `def my_loss(module, batch, batch_idx) ->"
        " torch.Tensor:`."
    )


@pytest.mark.usefixtures("in_process")
@pytest.mark.parametrize(
    ("field", "name", "listed"),
    [
        ("save_ops", "aten.mm", "[aten.mm]"),
        ("names", "blocks.*", "[blocks.*]"),
        ("names", "*.attn", "['*.attn']"),  # unquoted, YAML reads `*` as an alias
        ("classes", "Block", "[Block]"),
    ],
)
def test_a_list_field_given_a_mapping_is_shown_as_the_list_of_its_names_in_yaml(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, name: str, listed: str
) -> None:
    # `classes` was told to write [{'Block': 2}], which does not load either.
    def give_a_mapping(config: dict[str, Any]) -> None:
        config["trainer"]["strategy"]["init_args"]["checkpointing"][field] = {name: 2}

    assert _cli_error(capsys, _argv(_edited(tmp_path, give_a_mapping), tmp_path)) == (
        f"error: `trainer.strategy.checkpointing.{field}` must be a list, got a mapping {{'{name}': 2}}, whose values"
        f" nothing reads; list the names alone: {listed}."
    )
    assert yaml.safe_load(listed) == [name]


@pytest.mark.usefixtures("in_process")
def test_a_list_field_given_one_name_that_yaml_would_misread_is_shown_quoted_in_a_list(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def give_a_name(config: dict[str, Any]) -> None:
        config["trainer"]["strategy"]["init_args"]["checkpointing"]["names"] = "*.attn"

    assert _cli_error(capsys, _argv(_edited(tmp_path, give_a_name), tmp_path)) == (
        "error: `trainer.strategy.checkpointing.names` must be a list, got *.attn; write ['*.attn']."
    )


@pytest.mark.usefixtures("in_process")
def test_a_loss_fn_of_another_signature_is_one_line_naming_its_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _edited(
        tmp_path,
        lambda config: config["trainer"]["callbacks"][0]["init_args"].update(loss_fn="tests.test_cli.loss_of_two"),
    )
    assert _cli_error(capsys, _argv(config, tmp_path)) == (
        "error: `trainer.callbacks[0].loss_fn` must take (module, batch, batch_idx), got a function of"
        " (module: Any, batch: Any) -> torch.Tensor."
    )


@pytest.mark.usefixtures("in_process")
def test_an_unknown_class_path_names_the_missing_attribute(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _edited(tmp_path, lambda config: config["model"].update(class_path="examples.gpt.GPTModul"))
    line = _cli_error(capsys, _argv(config, tmp_path))
    assert line == (
        "error: `model`: module 'examples.gpt' has no attribute 'GPTModul'; did you mean `examples.gpt.GPTModule`?"
    )


@pytest.mark.usefixtures("in_process")
def test_a_misspelt_strategy_class_gets_its_own_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def misspell(config: dict[str, Any]) -> None:
        config["trainer"]["strategy"]["class_path"] = "lightning_ckpt_determinism.SingleDeviceCheckpointingStrateg"

    line = _cli_error(capsys, _argv(_edited(tmp_path, misspell), tmp_path))
    assert line == (
        "error: `trainer.strategy`: module 'lightning_ckpt_determinism' has no attribute"
        " 'SingleDeviceCheckpointingStrateg'; did you mean"
        " `lightning_ckpt_determinism.SingleDeviceCheckpointingStrategy`?"
    )


@pytest.mark.usefixtures("in_process")
@pytest.mark.parametrize(
    ("given", "meant"), [("dpp", "ddp"), ("single_device_checkpointin", "single_device_checkpointing")]
)
def test_a_misspelt_strategy_name_gets_the_name_meant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], given: str, meant: str
) -> None:
    config = _edited(tmp_path, lambda config: config["trainer"].update(strategy=given))
    line = _cli_error(capsys, _argv(config, tmp_path))
    assert line == f"error: `trainer.strategy`: {given!r} is not a strategy's name; did you mean `{meant}`?"


@pytest.mark.usefixtures("in_process")
def test_a_strategy_name_that_is_close_to_none_keeps_lightnings_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _edited(tmp_path, lambda config: config["trainer"].update(strategy="qqqqq"))
    line = _cli_error(capsys, _argv(config, tmp_path))
    assert line.startswith("error: You selected an invalid strategy name: `strategy='qqqqq'`. It must be either")


@pytest.mark.usefixtures("in_process")
@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("dpp", "'dpp' is not a strategy's name; did you mean `ddp`? (a name"),
        ("ddp_spwan", "'ddp_spwan' is not a strategy's name; did you mean `ddp_spawn`? (a name"),
        ("ddp_strategy", "'ddp_strategy' is not a strategy's name (a name"),
        ("qqqqq", "'qqqqq' is not a strategy's name (a name"),
    ],
)
def test_a_misspelt_strategy_name_over_a_config_with_checkpointing_is_not_called_a_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], given: str, said: str
) -> None:
    line = _cli_error(capsys, _argv(BASE_CONFIG, tmp_path, f"--trainer.strategy={given}"))
    assert line == (
        f"error: `trainer.strategy`: {said} takes no `checkpointing`: to keep the config's, give one of this"
        " package's strategies as `class_path`)."
    )


@pytest.mark.usefixtures("in_process")
@pytest.mark.parametrize("given", ["DDP", "Ddp_Checkpointing"])
def test_a_strategy_name_in_another_case_over_a_config_with_checkpointing_keeps_its_class_path_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], given: str
) -> None:
    # Lightning reads strategy names in any case: these are names, whose class takes the config's `checkpointing`.
    line = _cli_error(capsys, _argv(BASE_CONFIG, tmp_path, f"--trainer.strategy={given}"))
    assert line.startswith(f"error: `trainer.strategy`: {given!r} is a strategy's name, which takes no")
    assert line.endswith(
        "use `class_path: lightning_ckpt_determinism.DDPCheckpointingStrategy`, whose `init_args` take it."
    )


@pytest.mark.usefixtures("in_process")
def test_a_strategy_class_name_over_a_config_with_checkpointing_is_told_its_class_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Lightning refuses `DDPStrategy` as a name (it reads 'ddpstrategy'): it is a class's name.
    line = _cli_error(capsys, _argv(BASE_CONFIG, tmp_path, "--trainer.strategy=DDPStrategy"))
    assert line == (
        "error: `trainer.strategy`: 'DDPStrategy' is a class's name, not a strategy's; to train with the config's"
        " `checkpointing`, use `class_path: lightning_ckpt_determinism.DDPCheckpointingStrategy`, whose `init_args`"
        " take it."
    )


@pytest.mark.usefixtures("in_process")
@pytest.mark.parametrize(
    ("where", "given", "meant"),
    [
        (
            "trainer.strategy",
            "lightning_ckpt_determinism.strategies.SingleDeviceCheckpointingStrategy",
            "module 'lightning_ckpt_determinism' has no attribute 'strategies'; did you mean"
            " `lightning_ckpt_determinism.SingleDeviceCheckpointingStrategy`?",
        ),
        (
            "trainer.callbacks[0]",
            "lightning_ckpt_determinism.monitor.RecomputationMonitor",
            "module 'lightning_ckpt_determinism' has no attribute 'monitor'; did you mean"
            " `lightning_ckpt_determinism.RecomputationMonitor`?",
        ),
        (
            "model",
            "examples.models.GPTModule",
            "module 'examples' has no attribute 'models'; did you mean `examples.gpt.GPTModule`?",
        ),
    ],
    ids=["the strategy", "the monitor", "the model, through an imported module"],
)
def test_a_class_path_through_a_wrong_submodule_gets_the_path_meant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str, given: str, meant: str
) -> None:
    def misplace(config: dict[str, Any]) -> None:
        node = {
            "trainer.strategy": config["trainer"]["strategy"],
            "trainer.callbacks[0]": config["trainer"]["callbacks"][0],
            "model": config["model"],
        }[where]
        node["class_path"] = given

    assert _cli_error(capsys, _argv(_edited(tmp_path, misplace), tmp_path)) == f"error: `{where}`: {meant}"


@pytest.mark.usefixtures("in_process")
@pytest.mark.parametrize("first", [True, False], ids=["in the first file", "in the second file"])
def test_a_monitor_mistake_with_callbacks_listed_in_two_config_files_names_its_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], first: bool
) -> None:
    # jsonargparse refuses a file as it loads it; the file whose callbacks hold the field is the one.
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(
        "trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.LearningRateMonitor\n"
        "    - class_path: lightning_ckpt_determinism.RecomputationMonitor\n      init_args:\n        sentinel: heavy\n"
    )
    other = tmp_path / "other.yaml"
    other.write_text("trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.LearningRateMonitor\n")
    configs = [wrong, other] if first else [other, wrong]
    argv = [*_argv(BASE_CONFIG, tmp_path), "--config", str(configs[0]), "--config", str(configs[1])]
    assert _cli_error(capsys, argv) == (
        "error: `trainer.callbacks[1].sentinel` can be light, sampled, exact, off, got 'heavy'."
    )


@pytest.mark.usefixtures("in_process")
def test_a_strategy_without_checkpointing_gets_its_own_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _edited(tmp_path, lambda config: config["trainer"]["strategy"].pop("init_args"))
    line = _cli_error(capsys, _argv(config, tmp_path))
    assert line == "error: " + MISTAKES["checkpointing_null"][3]


@pytest.mark.usefixtures("in_process")
def test_a_yaml_syntax_error_keeps_its_file_line_and_column(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "broken.yaml"
    config.write_text("trainer:\n  max_steps: 3\n   devices: [1\n")
    line = _cli_error(capsys, _argv(config, tmp_path))
    assert line == (f"error: {config}:3:11: invalid YAML: mapping values are not allowed here; correct the file there")
    override = _cli_error(capsys, ["fit", f"--config={config}"])
    assert override == line


@pytest.mark.usefixtures("in_process")
def test_a_correct_config_builds_through_the_package_cli(tmp_path: Path) -> None:
    cli = CheckpointingCLI(
        subclass_mode_model=True, subclass_mode_data=True, args=["--config", str(BASE_CONFIG)], run=False
    )
    assert type(cli.model) is GPTModule


# The fix hints, as the route a fit takes writes them.

YAML_HINT = "set `preserve_host_rng: true` under `trainer.strategy.init_args.checkpointing`, or draw from torch's RNG"
PYTHON_HINT = "set `preserve_host_rng=True` in the `CheckpointingConfig`, or draw from torch's RNG"


def _said(fit: Callable[[], list[RecomputationMonitor]]) -> tuple[list[RecomputationMonitor], list[str], list[str]]:
    """The monitors ``fit`` ran, its divergence warnings and its fit summaries."""
    # The sentinel warns too, at the same step: every warning is recorded, and those of the check are kept.
    with logged_lines("lightning.pytorch") as lines, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitors = fit()
    ours = [str(warning.message) for warning in caught if warning.category is LightningCkptDeterminismWarning]
    warned = [message for message in ours if "recomputation diverged at step 0" in message]
    return monitors, warned, [line for line in lines if "RecomputationMonitor ran" in line]


@pytest.mark.usefixtures("in_process")
def test_a_fit_under_the_package_cli_writes_its_fix_as_the_yaml_does_and_a_python_fit_as_python_does(
    tmp_path: Path,
) -> None:
    broken = REPO / "examples" / "configs" / "broken_host_rng.yaml"

    def from_yaml() -> list[RecomputationMonitor]:
        cli = train.main(_argv(broken, tmp_path / "yaml"))
        return [callback for callback in cli.trainer.callbacks if isinstance(callback, RecomputationMonitor)]

    monitors, warned, summaries = _said(from_yaml)
    assert [monitor.hint_syntax for monitor in monitors] == ["yaml"]
    assert len(warned) == 1 and YAML_HINT in warned[0] and "=True`" not in warned[0]
    assert len(summaries) == 1 and "Cause host_rng in blocks.2: The forward reads" in summaries[0]
    assert YAML_HINT in summaries[0] and "=True`" not in summaries[0]

    # The same model, strategy and monitor built in Python, after the YAML run: nothing carries over.
    def from_python() -> list[RecomputationMonitor]:
        monitor = RecomputationMonitor(every_n_steps=10)
        trainer = pl.Trainer(
            max_steps=1,
            accelerator="cpu",
            devices=1,
            strategy=SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=["Block"])),
            callbacks=[monitor],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            default_root_dir=tmp_path / "python",
        )
        trainer.fit(BrokenModule(defect="host_rng", defective_block=2), datamodule=SyntheticRegression())
        return [monitor]

    monitors, warned, summaries = _said(from_python)
    assert [monitor.hint_syntax for monitor in monitors] == ["python"]
    assert len(warned) == 1 and PYTHON_HINT in warned[0] and YAML_HINT not in warned[0]
    assert len(summaries) == 1 and PYTHON_HINT in summaries[0]


@pytest.mark.usefixtures("in_process")
def test_the_sentinels_warning_under_the_package_cli_writes_its_fix_as_the_yaml_does(tmp_path: Path) -> None:
    broken = REPO / "examples" / "configs" / "broken_buffer_mutation.yaml"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train.main(_argv(broken, tmp_path))
    sentinel = [str(warning.message) for warning in caught if "the sentinel saw" in str(warning.message)]
    assert len(sentinel) == 1 and "Cause buffer_mutation: " in sentinel[0]
    assert "set `protect_buffers: true` under `trainer.strategy.init_args.checkpointing`." in sentinel[0]


def test_the_monitors_hint_syntax_is_checked_at_fit_start(tmp_path: Path) -> None:
    monitor = RecomputationMonitor()
    monitor.hint_syntax = "toml"  # type: ignore[assignment]
    trainer = pl.Trainer(max_steps=1, logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=r"^`hint_syntax` can be python, yaml, got 'toml'\.$"):
        monitor.on_fit_start(trainer, BrokenModule())


@pytest.mark.usefixtures("in_process")
def test_a_monitor_without_a_checkpointing_strategy_stops_the_fit_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _edited(tmp_path, lambda config: config["trainer"].pop("strategy"))
    (line,) = _refused(capsys, config, tmp_path)
    assert line.startswith(
        "error: `RecomputationMonitor` has nothing to check: no module of GPTModule is checkpointed at fit start"
        " under SingleDeviceStrategy. Add a checkpointing strategy (e.g."
    )
    # The fix as the YAML writes it.
    assert line.endswith(
        " `strategy: single_device_checkpointing` or `ddp_checkpointing`, which checkpoint `classes: auto`, or"
        " `class_path: lightning_ckpt_determinism.DDPCheckpointingStrategy` with `init_args: {checkpointing:"
        " {classes: [YourBlock]}}`) under `trainer`, or remove the monitor."
    )


@pytest.mark.slow
def test_a_spawned_process_stopped_by_a_configuration_mistake_is_one_line_and_exit_2(tmp_path: Path) -> None:
    def spawn_without_checkpointing(config: dict[str, Any]) -> None:
        config["trainer"].update(strategy="ddp_spawn", devices=2, max_steps=1, default_root_dir=str(tmp_path))

    result = _run_subprocess(_argv(_edited(tmp_path, spawn_without_checkpointing), tmp_path), timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    (line,) = _error_lines(result.stderr)
    assert line.startswith(
        "error: `RecomputationMonitor` has nothing to check: no module of GPTModule is checkpointed at fit start"
        " under DDPStrategy. Add a checkpointing strategy (e.g."
    ), result.stderr


def _raising_config(tmp_path: Path) -> Path:
    tmp_path.mkdir(exist_ok=True)
    config = tmp_path / "raise.yaml"
    config.write_text(
        f"trainer:\n  default_root_dir: {tmp_path}\n  accelerator: cpu\n  max_steps: 4\n  logger: false\n"
        "  enable_checkpointing: false\n  enable_progress_bar: false\n  enable_model_summary: false\n"
        "  strategy:\n    class_path: lightning_ckpt_determinism.SingleDeviceCheckpointingStrategy\n"
        "    init_args:\n      checkpointing:\n        classes: [DropoutBlock]\n        preserve_rng_state: false\n"
        "  callbacks:\n    - class_path: lightning_ckpt_determinism.RecomputationMonitor\n"
        "      init_args:\n        on_divergence: raise\n"
        "model:\n  class_path: tests.helpers.StackModule\n"
    )
    return config


def test_a_fit_stopped_by_on_divergence_raise_is_one_line_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LIGHTNING_CKPT_DETERMINISM_TRACEBACK", raising=False)
    with pytest.raises(SystemExit, match=r"^1$"):
        CheckpointingCLI(args=["fit", "--config", str(_raising_config(tmp_path))])
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert line.startswith("error: lightning_ckpt_determinism: ")
    assert "at step 0" in line and "model.blocks.0" in line and "rng_not_preserved" in line
    assert "preserve_rng_state: true" in line  # the fix as the YAML writes it
    # The traceback, when asked for.
    monkeypatch.setenv("LIGHTNING_CKPT_DETERMINISM_TRACEBACK", "1")
    with pytest.raises(RecomputationDivergenceError, match="at step 0"):
        CheckpointingCLI(args=["fit", "--config", str(_raising_config(tmp_path / "again"))])


@pytest.mark.usefixtures("in_process")
@pytest.mark.parametrize(
    ("entry", "meant"),
    [
        ("tests.helpers.DropoutBlok", "tests.helpers.DropoutBlock"),
        ("tests.helprs.DropoutBlock", "tests.helpers.DropoutBlock"),
        ("torch.nn.TransformerEncoderLayr", "torch.nn.TransformerEncoderLayer"),
    ],
)
def test_a_misspelt_class_path_is_one_line_with_the_path_it_meant(
    entry: str, meant: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def misspell(config: dict[str, Any]) -> None:
        config["trainer"]["strategy"]["init_args"]["checkpointing"]["classes"] = [entry]

    line = _cli_error(capsys, _argv(_edited(tmp_path, misspell), tmp_path))
    assert line.startswith(f"error: `trainer.strategy.checkpointing.classes` entry {entry!r} cannot be imported (")
    bare = meant.rpartition(".")[2]
    assert line.endswith(f"). Did you mean {meant!r}? Its bare class name, {bare!r}, matches it too.")


_SINGLE_DEVICE = (
    "  strategy:\n    class_path: lightning_ckpt_determinism.SingleDeviceCheckpointingStrategy\n"
    "    init_args:\n      checkpointing:\n"
)


def _yaml_error_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], trainer_tail: str, arguments: Sequence[str] = ()
) -> list[str]:
    """The lines from the first ``error:`` on of `CheckpointingCLI` given one YAML file: a one-step Trainer whose
    entries end with ``trainer_tail`` (indented under ``trainer:``), and the `StackModule`; then ``arguments``."""
    config = tmp_path / "run.yaml"
    config.write_text(
        f"trainer:\n  default_root_dir: {tmp_path}\n  accelerator: cpu\n  max_steps: 1\n  logger: false\n"
        f"{trainer_tail}model:\n  class_path: tests.helpers.StackModule\n"
    )
    with pytest.raises(SystemExit, match=r"^2$"):
        CheckpointingCLI(args=["fit", "--config", str(config), *arguments])
    return _error_lines(capsys.readouterr().err)


def test_a_misspelt_class_is_one_line_with_the_class_it_meant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (line,) = _yaml_error_lines(tmp_path, capsys, _SINGLE_DEVICE + "        classes: [DropoutBlok]\n")
    assert line.startswith(
        "error: `trainer.strategy.checkpointing`: `CheckpointingConfig` matches no module of StackModule:"
        " classes=['DropoutBlok']"
    )
    assert "names=[]. Did you mean 'DropoutBlock' for 'DropoutBlok'? The model's module classes" in line


def test_a_single_class_where_a_list_is_expected_is_one_line_with_the_yaml_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _yaml_error_lines(tmp_path, capsys, _SINGLE_DEVICE + "        classes: DropoutBlock\n") == [
        "error: `trainer.strategy.checkpointing.classes` must be auto or a list, got DropoutBlock; write"
        " [DropoutBlock], or auto for a transformer's layers."
    ]


def test_a_misspelt_option_is_one_line_with_the_option_it_meant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _yaml_error_lines(tmp_path, capsys, _SINGLE_DEVICE + "        clases: [DropoutBlock]\n") == [
        "error: `trainer.strategy.checkpointing`: Option 'clases' is not accepted; did you mean `classes`?"
    ]


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        (
            "        classes: [DropoutBlock]\n        every_n_steps: 5\n",
            "error: `trainer.strategy.checkpointing`: Option 'every_n_steps' is not accepted; `every_n_steps` is an"
            " argument of `RecomputationMonitor`: put it under the monitor's `init_args` in `trainer.callbacks`",
        ),
        (
            "        classes: [DropoutBlock]\n"
            "  callbacks:\n    - class_path: lightning_ckpt_determinism.RecomputationMonitor\n"
            "      init_args:\n        every_n: 2\n",
            "error: `trainer.callbacks[0]`: Option 'every_n' is not accepted; `every_n` is a field of"
            " `CheckpointingConfig`: put it under `trainer.strategy.init_args.checkpointing`",
        ),
        (
            "        classes: [DropoutBlock]\n      every_n_steps: 5\n",
            "error: `trainer.strategy`: Option 'every_n_steps' is not accepted; `every_n_steps` is an argument of"
            " `RecomputationMonitor`: put it under the monitor's `init_args` in `trainer.callbacks`",
        ),
    ],
    ids=[
        "a monitor's argument under checkpointing",
        "a checkpointing field under the monitor",
        "a monitor's argument under the strategy",
    ],
)
def test_an_argument_on_the_wrong_side_is_one_line_saying_where_it_belongs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str, expected: str
) -> None:
    # The close names on the other side (`every_n` and `every_n_steps`) mean something else: no "did you mean".
    assert _yaml_error_lines(tmp_path, capsys, _SINGLE_DEVICE + where) == [expected]


@pytest.mark.parametrize(
    ("argument", "expected"),
    [
        ("sentinel: heavy", "`trainer.callbacks[1].sentinel` can be light, sampled, exact, off, got 'heavy'."),
        ("every_n_steps: 0", "`trainer.callbacks[1].every_n_steps` must be an integer >= 1, got 0."),
        (
            "every_n_stps: 2",
            "`trainer.callbacks[1]`: Option 'every_n_stps' is not accepted; did you mean `every_n_steps`?",
        ),
    ],
    ids=["a choice", "a value its constructor refuses", "an option it does not take"],
)
def test_a_mistake_of_a_monitor_listed_second_names_its_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argument: str, expected: str
) -> None:
    # jsonargparse names the list alone (`trainer.callbacks`); where several callbacks are listed the index says which.
    callbacks = (
        "  callbacks:\n    - class_path: lightning.pytorch.callbacks.LearningRateMonitor\n"
        f"    - class_path: lightning_ckpt_determinism.RecomputationMonitor\n      init_args:\n        {argument}\n"
    )
    assert _yaml_error_lines(tmp_path, capsys, _SINGLE_DEVICE + "        classes: [DropoutBlock]\n" + callbacks) == [
        f"error: {expected}"
    ]


@pytest.mark.parametrize(
    ("argument", "expected"),
    [
        (
            "--trainer.callbacks.init_args.sentinel=heavy",
            "`--trainer.callbacks.init_args.sentinel` can be light, sampled, exact, off, got 'heavy'.",
        ),
        (
            "--trainer.callbacks.init_args.every_n_stps=2",
            "`--trainer.callbacks.init_args.every_n_stps`: Option 'every_n_stps' is not accepted; did you mean"
            " `every_n_steps`?",
        ),
    ],
    ids=["a choice", "an option it does not take"],
)
def test_a_monitor_argument_set_on_the_command_line_is_named_as_typed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argument: str, expected: str
) -> None:
    # jsonargparse sets it on the last callback listed and names the list alone: the argument typed says which.
    callbacks = (
        "  callbacks:\n    - class_path: lightning.pytorch.callbacks.LearningRateMonitor\n"
        "    - class_path: lightning_ckpt_determinism.RecomputationMonitor\n"
    )
    trainer_tail = _SINGLE_DEVICE + "        classes: [DropoutBlock]\n" + callbacks
    assert _yaml_error_lines(tmp_path, capsys, trainer_tail, [argument]) == [f"error: {expected}"]


def test_a_callback_whose_init_args_are_a_list_is_named_by_its_index_whatever_the_form_of_its_class_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    callbacks = (
        "  callbacks:\n    - class_path: lightning.pytorch.callbacks.LearningRateMonitor\n"
        "    - class_path: RecomputationMonitor\n      init_args:\n        - 2\n"
    )
    (line,) = _yaml_error_lines(tmp_path, capsys, _SINGLE_DEVICE + "        classes: [DropoutBlock]\n" + callbacks)
    assert line.startswith("error: `trainer.callbacks[1]`: the `init_args` of `"), line


def test_a_callbacks_mistake_is_named_by_the_list_alone_where_two_config_files_list_callbacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Either file's list may hold the value jsonargparse refused: an index could point into the wrong one.
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    monitor = (
        "    - class_path: lightning_ckpt_determinism.RecomputationMonitor\n      init_args:\n        sentinel: {}\n"
    )
    first.write_text("trainer:\n  callbacks:\n" + monitor.format("heavy"))
    second.write_text(
        "trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.LearningRateMonitor\n"
        + monitor.format("light")
    )
    with pytest.raises(SystemExit, match=r"^2$"):
        CheckpointingCLI(args=["fit", "--config", str(first), "--config", str(second)])
    assert _error_lines(capsys.readouterr().err) == [
        "error: `trainer.callbacks.sentinel` can be light, sampled, exact, off, got 'heavy'."
    ]


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        (
            "  strategy:\n    class_path: single_device_checkpointing\n"
            "    init_args:\n      checkpointing:\n        classes: [DropoutBlock]\n",
            "error: `trainer.strategy`: `single_device_checkpointing` is a registered name, which takes no arguments:"
            " to configure it, give its class as `class_path:`"
            " `lightning_ckpt_determinism.SingleDeviceCheckpointingStrategy`, with the arguments under `init_args:`.",
        ),
        (
            _SINGLE_DEVICE + "        classes: [DropoutBlock]\n"
            "  callbacks:\n    - class_path: lightning_ckpt_determinism.RecomputationMonitor\n"
            "      init_args:\n        - 2\n",
            "error: `trainer.callbacks[0]`: the `init_args` of `lightning_ckpt_determinism.RecomputationMonitor` are a"
            " list; write them as `name: value` lines, one argument each",
        ),
    ],
    ids=["a registered name given arguments", "init_args as a list"],
)
def test_a_class_written_in_the_wrong_form_is_one_line_with_the_form_to_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], strategy: str, expected: str
) -> None:
    assert _yaml_error_lines(tmp_path, capsys, strategy) == [expected]


def test_a_field_refused_when_the_strategy_sets_the_model_up_is_named_by_its_full_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tail = _SINGLE_DEVICE + "        classes: [DropoutBlock]\n        every_n: 5\n"
    (line,) = _yaml_error_lines(tmp_path, capsys, tail)
    assert line.startswith("error: `trainer.strategy.checkpointing.every_n`=5 selects none of the 3 matched modules")


def test_a_memory_budget_set_to_null_on_the_command_line_removes_the_budget() -> None:
    # jsonargparse hands `null` over as the string 'None' where it overrides a field of the strategy's nested config.
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(SingleDeviceCheckpointingStrategy, "strategy")
    given = [
        "--strategy=lightning_ckpt_determinism.SingleDeviceCheckpointingStrategy",
        "--strategy.init_args.checkpointing.classes=[Block]",
        "--strategy.init_args.checkpointing.memory_budget=50%",
        "--strategy.init_args.checkpointing.memory_budget=null",
    ]
    strategy = parser.instantiate_classes(parser.parse_args(given)).strategy
    assert strategy.checkpointing.memory_budget is None
    assert CheckpointingConfig(classes=["Block"], memory_budget="None") == CheckpointingConfig(classes=["Block"])
