import dataclasses
import errno
import io
import json
import math
import os
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.pytorch.plugins.precision import HalfPrecision, Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch.utils.data import DataLoader

from examples.gpt import GPTModule
from lightning_ckpt_determinism import (
    CAUSE_HINTS,
    Cause,
    CheckpointingConfig,
    checkpointed_modules,
    plan_activation_checkpointing,
)
from lightning_ckpt_determinism.audit import files, loading, main, rendering, running
from lightning_ckpt_determinism.verify.reports import RecomputationReport, RegionReport
from tests.helpers import trainer_kwargs

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "examples" / "configs"
GPT_CONFIG = CONFIGS / "gpt_blocks_by_name.yaml"
GPT_CLASSES = ["--model", "examples.gpt.GPTModule", "--data", "examples.gpt.SyntheticTokensDataModule"]
# The causes with a broken example config (`broken_<cause>.yaml`): an example is welcome, not required.
BROKEN = [cause for cause in Cause if (CONFIGS / f"broken_{cause}.yaml").is_file()]
HEADER = ["region", "verdict", "cause", "max diff", "first divergent op", "hint"]


@pytest.fixture(autouse=True)
def _no_exported_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    # The audit seeds through LightningCLI, which exports the seed to the environment.
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)


def audit(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["audit", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def table(out: str) -> dict[str, dict[str, str]]:
    """The printed table as ``{region: {column: cell}}``, after checking its header."""
    lines = out.splitlines()
    assert re.split(r"\s{2,}", lines[0]) == HEADER
    rows = {}
    for line in lines[1:]:
        if line.startswith("gradients:"):
            break
        cells = re.split(r"\s{2,}", line)
        rows[cells[0]] = dict(zip(HEADER, cells, strict=True))
    return rows


def test_subprocess_audit_of_a_broken_config_prints_the_table_writes_json_and_exits_1(tmp_path):
    report = tmp_path / "audit.json"
    command = ["-m", "lightning_ckpt_determinism", "audit", "--config", "examples/configs/broken_host_rng.yaml"]
    result = subprocess.run(
        [sys.executable, *command, "--json", str(report)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    rows = table(result.stdout)
    assert list(rows) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert rows["blocks.2"]["verdict"] == "diverged"
    assert rows["blocks.2"]["cause"] == "host_rng"
    assert rows["blocks.2"]["first divergent op"] == "aten.mul.Tensor (op 3)"
    # Written as the YAML writes the setting; the JSON's checks keep the reports' own Python spelling.
    assert rows["blocks.2"]["hint"] == Cause.HOST_RNG.hints.audit
    assert "`preserve_host_rng: true` under `trainer.strategy.init_args.checkpointing`" in rows["blocks.2"]["hint"]
    assert [rows[name]["verdict"] for name in ("blocks.0", "blocks.1", "blocks.3")] == ["ok"] * 3
    assert result.stdout.splitlines()[-1] == "result: 1 of 4 checkpointed regions diverged: blocks.2"
    written = json.loads(report.read_text())
    assert written["config"] == "examples/configs/broken_host_rng.yaml"
    assert (written["device"], written["batches"], written["diverged"]) == ("cpu", 1, True)
    assert [region["verdict"] for region in written["regions"]] == ["ok", "ok", "diverged", "ok"]
    assert written["regions"][2]["first_divergent_op"] == ["aten.mul.Tensor", 3]
    assert written["checks"][0]["regions"][2]["cause"] == "host_rng"
    assert written["regions"][2]["hint"] == Cause.HOST_RNG.hints.audit
    assert written["checks"][0]["regions"][2]["hint"] == Cause.HOST_RNG.hints.python
    # docs/audit.md's table names every key the report holds, at each level.
    documented = json_report_keys_documented()
    assert list(documented) == list(written)
    check_keys, region_keys = documented["checks"]
    assert check_keys == list(written["checks"][0])
    assert region_keys == list(written["checks"][0]["regions"][0])


def json_report_keys_documented() -> dict[str, tuple[list[str], list[str]]]:
    """docs/audit.md's JSON table: each row's keys, with the names it lists and those of its regions in brackets."""
    text = (REPO / "docs" / "audit.md").read_text().split("## The JSON report", 1)[1]
    keys: dict[str, tuple[list[str], list[str]]] = {}
    for row in re.findall(r"^\| (`.*?`(?:, `.*?`)?) \| (.*) \|$", text, re.M):
        names, held = row
        outer = re.sub(r"\(each `RegionReport`: [^)]*\)", "", held)
        inner = re.search(r"\(each `RegionReport`: ([^)]*)\)", held)
        listed = re.findall(r"`(\w+)`", outer.split(":", 1)[1]) if ":" in outer else []
        for name in re.findall(r"`(\w+)`", names):
            keys[name] = (listed, re.findall(r"`(\w+)`", inner.group(1)) if inner else [])
    return keys


def test_the_console_script_is_the_cli_main():
    (script,) = [entry for entry in entry_points(group="console_scripts") if entry.name == "lightning-ckpt-determinism"]
    assert script.load() is main


def broken_region(lines: list[str], cause: Cause) -> str | None:
    """The region a broken config's header says the audit names for ``cause`` (``None``: the whole step)."""
    said = lines[lines.index(next(line for line in lines if not line.startswith("#"))) - 1]
    found = re.fullmatch(rf"# .*names (blocks\.\d+|no region)\b.*, cause {cause}\b.*", said)
    assert found is not None, f"broken_{cause}.yaml's header names no region and cause: {said!r}"
    return None if found[1] == "no region" else found[1]


def test_every_broken_config_but_the_routing_example_is_named_after_a_cause() -> None:
    named = {path.name.removeprefix("broken_").removesuffix(".yaml") for path in CONFIGS.glob("broken_*.yaml")}
    assert named - set(BROKEN) == {"routing"} and BROKEN


@pytest.mark.parametrize("cause", BROKEN, ids=str)
def test_each_broken_config_names_its_region_and_cause_and_exits_1(cause, capsys):
    path = CONFIGS / f"broken_{cause}.yaml"
    lines = path.read_text().splitlines()
    region = broken_region(lines, cause)
    assert lines[0] == f"# python -m lightning_ckpt_determinism audit --config examples/configs/broken_{cause}.yaml"
    assert lines[1].startswith(
        f"# Train it: python -m examples.train fit --config examples/configs/broken_{cause}.yaml"
    )
    assert lines[2].startswith("# Broken ")
    code, out, err = audit(capsys, "--config", str(path))
    assert code == 1, err
    rows = table(out)
    diverged = [name for name, row in rows.items() if row["verdict"] == "diverged"]
    if region is None:
        assert diverged == []
        assert out.splitlines()[-1] == f"result: diverged: {cause}: {cause.hints.audit}"
        return
    assert diverged == [region]
    row = rows[region]
    assert row["cause"] == cause
    # The in-place case of `recompute_error` has a hint of its own; `buffer_mutation` names the buffers after it.
    hint = cause.hints.audit if cause != "recompute_error" else "An input the region received"
    assert row["hint"].startswith(hint)
    assert all(other["cause"] == "-" for name, other in rows.items() if name not in diverged)
    assert out.splitlines()[-1] == f"result: 1 of 4 checkpointed regions diverged: {region}"


def test_the_audit_of_a_compiled_config_scans_its_backward_graphs_and_writes_the_region_to_json(capsys, tmp_path):
    report = tmp_path / "compiled.json"
    code, out, err = audit(capsys, "--config", str(CONFIGS / "broken_compiler_recompute.yaml"), "--json", str(report))
    assert code == 1, err
    rows = table(out)
    assert rows["blocks.1"]["hint"] == (
        f"{CAUSE_HINTS['compiler_recompute']} In its compiled backward graph, `aten.native_dropout.default` draws in"
        " the backward."
    )
    # The reference and the checkpointed step compiled through the scan; its rerun compiled nothing more.
    assert "note: 2 compiled backward graphs scanned for random ops that recomputation draws afresh" in out
    assert "; compiler_recompute regions were found in the compiled backward graphs" in out
    written = json.loads(report.read_text())
    assert [(region["name"], region["verdict"], region["cause"]) for region in written["regions"]] == [
        ("blocks.0", "ok", None),
        ("blocks.1", "diverged", "compiler_recompute"),
        ("blocks.2", "ok", None),
        ("blocks.3", "ok", None),
    ]
    assert written["checks"][0]["cause"] == "compiler_recompute"
    assert written["checks"][0]["regions"][1]["cause"] == "compiler_recompute"


def test_a_clean_config_exits_0_and_its_json_replaces_the_old_report(capsys, tmp_path):
    report, link = tmp_path / "clean.json", tmp_path / "link.json"
    report.write_text("old report\n")
    report.chmod(0o640)
    old_inode = report.stat().st_ino
    link.symlink_to(report)
    code, out, err = audit(capsys, "--config", str(GPT_CONFIG), "--json", str(link))
    assert code == 0, err
    # Written beside the report and moved onto it: a new file, the old one's permissions, through the link.
    assert sorted(path.name for path in tmp_path.iterdir()) == ["clean.json", "link.json"]
    assert link.is_symlink() and link.resolve() == report
    assert report.stat().st_ino != old_inode
    assert report.stat().st_mode & 0o777 == 0o640
    rows = table(out)
    # every_n: 2 checkpoints blocks 1 and 3; their selective checkpointing keeps the matmuls.
    assert {name: row["verdict"] for name, row in rows.items()} == {"model.blocks.1": "ok", "model.blocks.3": "ok"}
    assert "grad_divergence up to 0 over 1 batch (tolerance 0)" in out
    assert out.splitlines()[-1] == "result: none of the 2 checkpointed regions diverged"
    written = json.loads(report.read_text())
    assert (written["diverged"], written["batches"], written["buffer_mutations"]) == (False, 1, [])
    assert written["checks"][0]["grad_divergence"] == 0.0
    assert all(region["ops_compared"] > 0 and region["cause"] is None for region in written["regions"])


def test_an_audit_run_inside_python_leaves_the_callers_seed_and_no_checkpointed_model(capsys, monkeypatch):
    # The audit's LightningCLI seeds everything with 0: a script that audited, then trained, trained on seed 0.
    audited = []
    set_up = running._set_up

    def recorded(model: Any, strategy: Any) -> Any:
        audited.append(set_up(model, strategy))
        return audited[-1]

    monkeypatch.setattr(running, "_set_up", recorded)
    torch.manual_seed(1234)
    monkeypatch.setenv("PL_GLOBAL_SEED", "1234")
    monkeypatch.setenv("PL_SEED_WORKERS", "0")
    expected = torch.rand(3)
    torch.manual_seed(1234)
    code, _, err = audit(capsys, "--config", str(GPT_CONFIG))
    assert code == 0, err
    assert torch.equal(torch.rand(3), expected)
    assert (os.environ["PL_GLOBAL_SEED"], os.environ["PL_SEED_WORKERS"]) == ("1234", "0")
    (model,) = audited
    assert checkpointed_modules(model) == {}


def test_batches_are_checked_in_turn_and_summed_up_per_region(capsys, tmp_path):
    report = tmp_path / "three.json"
    config = str(CONFIGS / "broken_python_state.yaml")
    code, out, err = audit(capsys, "--config", config, "--batches", "3", "--json", str(report))
    assert code == 1
    assert "audit:" not in err  # no progress bar off a terminal
    assert " over 3 batches (tolerance 0)" in out
    written = json.loads(report.read_text())
    assert len(written["checks"]) == written["batches"] == 3
    assert [region["batches_diverged"] for region in written["regions"]] == [0, 0, 0, 3]
    per_batch = [check["regions"][3]["max_abs_diff"] for check in written["checks"]]
    assert written["regions"][3]["max_abs_diff"] == max(per_batch) > 0.0
    per_check = [check["regions"][3]["ops_compared"] for check in written["checks"]]
    # Every batch recomputes the region up to its last saved tensor (torch's early stop, its first call too).
    assert per_check[0] == per_check[1] == per_check[2] > 0
    assert written["regions"][3]["ops_compared"] == sum(per_check)


def test_calibrated_noise_tolerates_the_non_deterministic_kernel(capsys):
    config = CONFIGS / "broken_nondeterministic_kernel.yaml"
    code, out, err = audit(capsys, "--config", str(config), "--calibrate-noise")
    assert code == 0, err
    row = table(out)["blocks.0"]
    assert (row["verdict"], row["cause"]) == ("noise", "nondeterministic_kernel")
    # The hint says the difference is tolerated, and no longer asks for the calibration the audit ran.
    assert row["hint"].startswith("Within the noise floor measured, so tolerated. A kernel returned other values")
    assert "--calibrate-noise" not in row["hint"]
    floor = float(re.search(r"noise floor ([0-9.e+-]+)\)", out).group(1))  # type: ignore[union-attr]
    assert 0.0 < floor < 1e-5
    assert out.splitlines()[-1] == (
        "result: none of the 4 checkpointed regions diverged (1 differ within the noise floor)"
    )


def _with_monitor_arguments(tmp_path: Path, name: str, **arguments: object) -> Path:
    """The example config ``name`` with ``arguments`` given to its ``RecomputationMonitor``."""
    config = yaml.safe_load((CONFIGS / name).read_text())
    (monitor,) = config["trainer"]["callbacks"]
    monitor.setdefault("init_args", {}).update(arguments)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_audit_compares_as_the_configs_monitor_does(capsys, tmp_path):
    # The fit of these configs finds nothing: the monitor leaves the attribute out and tolerates the kernel's noise.
    excluded = _with_monitor_arguments(tmp_path, "broken_attribute_mutation.yaml", exclude_attributes=["batch_sizes"])
    code, out, err = audit(capsys, "--config", str(excluded), "--json", str(tmp_path / "audit.json"))
    assert code == 0, err
    assert table(out)["blocks.2"]["verdict"] == "ok"
    report = json.loads((tmp_path / "audit.json").read_text())
    assert (report["tolerance"], report["exclude_attributes"]) == (0.0, ["batch_sizes"])
    assert "note: compared as the config's RecomputationMonitor compares (exclude_attributes ['batch_sizes'])" in out
    tolerant = _with_monitor_arguments(tmp_path, "broken_nondeterministic_kernel.yaml", tolerance=1e-3)
    code, out, err = audit(capsys, "--config", str(tolerant))
    assert code == 0 and "(tolerance 0.001)" in out, err
    # `--tolerance` given on the command line is the audit's own.
    code, out, _ = audit(capsys, "--config", str(tolerant), "--tolerance", "0")
    assert code == 1 and "(tolerance 0)" in out


def test_a_config_whose_fit_refuses_two_monitors_is_refused_by_its_audit_alike(capsys, tmp_path):
    # Two monitors with other `every_n_steps` (other `state_key`s): Lightning takes them, the fit refuses them as it
    # starts.
    config = yaml.safe_load((CONFIGS / "gpt_blocks_by_class.yaml").read_text())
    (monitor,) = config["trainer"]["callbacks"]
    config["trainer"]["callbacks"].append(
        {**monitor, "init_args": {**monitor.get("init_args", {}), "every_n_steps": 7}}
    )
    path = tmp_path / "two_monitors.yaml"
    path.write_text(yaml.safe_dump(config))
    code, out, err = audit(capsys, "--config", str(path))
    assert (code, out) == (2, "")
    assert err.strip().endswith(
        "`trainer.callbacks`: `RecomputationMonitor` is in the Trainer's callbacks 2 times: give it once. One monitor"
        " checks every checkpointed region; several would check each step again, and only the last one's sentinel"
        " would see the regions."
    )


def test_json_reports_buffer_mutations_errors_and_infinities(capsys, tmp_path):
    report = tmp_path / "buffers.json"
    code, out, _ = audit(capsys, "--config", str(CONFIGS / "broken_buffer_mutation.yaml"), "--json", str(report))
    assert code == 1
    buffers = ["blocks.1.norm.running_mean", "blocks.1.norm.running_var", "blocks.1.norm.num_batches_tracked"]
    assert f"buffers changed by recomputation: {', '.join(buffers)}" in out
    written = json.loads(report.read_text())
    assert written["buffer_mutations"] == buffers
    assert written["checks"][0]["grad_divergence"] == 0.0
    # The running statistics end the step otherwise than a plain twin's: the step diverged, with exact gradients.
    assert (written["checks"][0]["diverged"], written["checks"][0]["cause"]) == (True, "buffer_mutation")

    report = tmp_path / "shape.json"
    code, out, _ = audit(capsys, "--config", str(CONFIGS / "broken_shape_change.yaml"), "--json", str(report))
    assert code == 1
    assert table(out)["blocks.0"]["verdict"] == "unchecked"  # backward stopped where torch raised
    written = json.loads(report.read_text())
    assert written["checks"][0]["grad_divergence"] == "inf"
    assert written["regions"][1]["max_abs_diff"] == "inf"
    assert written["checks"][0]["error"].startswith("CheckpointError: torch.utils.checkpoint")
    assert math.isinf(float(written["checks"][0]["max_abs_diff"]))


def write_config(tmp_path: Path, name: str, strategy: str | None, model: str = "examples.broken.BrokenModule") -> Path:
    """A config for ``model`` under ``strategy`` (YAML lines under `trainer.strategy`), or under none."""
    path = tmp_path / f"{name}.yaml"
    given = "" if strategy is None else f"  strategy:\n{strategy}\n"
    path.write_text(
        f"trainer:\n  accelerator: cpu\n{given}model:\n  class_path: {model}\n"
        "data:\n  class_path: examples.broken.SyntheticRegression\n"
    )
    return path


def _with_auto_strategy(config: Path) -> Path:
    """``config`` with ``strategy: auto`` written under ``trainer``."""
    config.write_text(config.read_text().replace("  accelerator: cpu\n", "  accelerator: cpu\n  strategy: auto\n"))
    return config


CHECKPOINTING = (
    "    class_path: lightning_ckpt_determinism.SingleDeviceCheckpointingStrategy\n"
    "    init_args:\n      checkpointing:\n        classes: [{classes}]"
)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", r"error: `--config` 'missing\.yaml' is not a file"),
        ("no_class_path", r"error: `model` in .*classless\.yaml names no class: give it `class_path"),
        ("plain_strategy", r"is SingleDeviceStrategy, which applies no activation checkpointing"),
        (
            "no_strategy",
            r"error: .*no_strategy\.yaml sets no `trainer\.strategy`, so nothing is checkpointed; give it one of this"
            r" package's strategies with `checkpointing`, e\.g\. `class_path:"
            r" lightning_ckpt_determinism\.SingleDeviceCheckpointingStrategy` with `init_args: \{checkpointing:"
            r" \{classes: auto\}\}` \(a transformer's layers\) or `\{classes: \[YourBlock\]\}`\n$",
        ),
        (
            "auto_strategy",
            r"error: .*auto_strategy\.yaml sets `trainer\.strategy: auto`, Lightning's choice, so nothing is",
        ),
        (
            "auto_override",
            r"error: .*no_strategy\.yaml with `--trainer\.strategy=AUTO` leaves the strategy to Lightning, so nothing",
        ),
        ("unknown_model", r"cannot be loaded: `model`: module 'examples\.broken' has no attribute 'Nope'$"),
        # Named by the config's key, as `CheckpointingCLI` names it.
        (
            "selects_nothing",
            r"error: `trainer\.strategy\.checkpointing`: `CheckpointingConfig` matches no module of BrokenModule",
        ),
        ("bad_json_path", r"error: `--json` '.*no_dir/out\.json' cannot be written"),
        # One line, not argparse's usage block first.
        (
            "zero_batches",
            r"^lightning-ckpt-determinism audit: error: argument --batches: must be an integer >= 1, got '0' \(see"
            r" `lightning-ckpt-determinism audit --help`\)\n$",
        ),
        # As `CheckpointingConfig(every_n=0)` says it, and `CheckpointingCLI`: with the field's key.
        (
            "every_n_zero",
            r"cannot be loaded: `trainer\.strategy\.checkpointing\.every_n` must be an integer >= 1, got 0\.$",
        ),
        (
            "auto_budget_on_cpu",
            r"error: `trainer\.strategy\.checkpointing\.memory_budget`='auto' needs a CUDA device, the model is on cpu",
        ),
        ("no_command", r"the following arguments are required: command"),
        # An argument that is neither an audit option nor a dotted override is the command line's, not the YAML's.
        (
            "unknown_option",
            r"^lightning-ckpt-determinism audit: error: unrecognized arguments: --foo 3: on the audit's command line,"
            r" neither its own option \(see `--help`\) nor a dotted LightningCLI override such as"
            r" --trainer\.max_steps=3\n$",
        ),
        # An override the config refuses is named with the file.
        (
            "misspelt_override",
            r"error: .*broken_python_state\.yaml with --trainer\.strategy\.init_args\.checkpointing\.evry_n=2"
            r" cannot be loaded: `trainer\.strategy\.checkpointing`: Option 'evry_n' is not accepted; did you mean"
            r" `every_n`\?\n$",
        ),
        # An argument beside its class_path is named where it sits.
        (
            "flat_monitor",
            r"flat\.yaml cannot be loaded: `trainer\.callbacks\[0\]`: `every_n_steps` sits beside `class_path`; put"
            r" the arguments under `init_args:`\.\n$",
        ),
        # A monitor's field is named by the callback's index, as `CheckpointingCLI` names it.
        (
            "bad_monitor_choice",
            r"bad_monitor\.yaml cannot be loaded: `trainer\.callbacks\[0\]\.attribution` can be on_divergence,"
            r" always, never, got 'sometimes'\.\n$",
        ),
        # A typo of the audit's own option is named as one, not handed to the YAML's parser to blame the config.
        (
            "misspelt_option",
            r"^lightning-ckpt-determinism audit: error: unknown option --batch: did you mean --batches\? \(see"
            r" `lightning-ckpt-determinism audit --help`\)\n$",
        ),
    ],
)
def test_usage_and_configuration_errors_exit_2_with_the_error_not_a_traceback(case, message, capsys, tmp_path):
    broken = str(CONFIGS / "broken_python_state.yaml")
    argv = {
        "missing": ["audit", "--config", "missing.yaml"],
        "no_class_path": ["audit", "--config", str(write_classless_config(tmp_path))],
        "plain_strategy": [
            "audit",
            "--config",
            str(write_config(tmp_path, "plain", "    class_path: SingleDeviceStrategy")),
        ],
        "no_strategy": ["audit", "--config", str(write_config(tmp_path, "no_strategy", None))],
        "auto_strategy": [
            "audit",
            "--config",
            str(_with_auto_strategy(write_config(tmp_path, "auto_strategy", None))),
        ],
        "auto_override": [
            "audit",
            "--config",
            str(write_config(tmp_path, "no_strategy", None)),
            "--trainer.strategy=AUTO",
        ],
        "unknown_model": [
            "audit",
            "--config",
            str(write_config(tmp_path, "unknown", CHECKPOINTING.format(classes="Block"), model="examples.broken.Nope")),
        ],
        "selects_nothing": [
            "audit",
            "--config",
            str(write_config(tmp_path, "nothing", CHECKPOINTING.format(classes="Conv2d"))),
        ],
        "bad_json_path": ["audit", "--config", broken, "--json", str(tmp_path / "no_dir" / "out.json")],
        "zero_batches": ["audit", "--config", broken, "--batches", "0"],
        "every_n_zero": ["audit", "--config", broken, "--trainer.strategy.init_args.checkpointing.every_n=0"],
        "auto_budget_on_cpu": [
            "audit",
            "--config",
            broken,
            "--trainer.strategy.init_args.checkpointing.memory_budget=auto",
        ],
        "no_command": [],
        "misspelt_option": ["audit", "--config", broken, "--batch", "2"],
        "flat_monitor": ["audit", "--config", str(_flat_monitor(Path(broken), tmp_path))],
        "bad_monitor_choice": ["audit", "--config", str(_bad_monitor_choice(Path(broken), tmp_path))],
        "unknown_option": ["audit", "--config", broken, "--foo", "3"],
        "misspelt_override": ["audit", "--config", broken, "--trainer.strategy.init_args.checkpointing.evry_n=2"],
    }[case]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert "Traceback" not in err


def _flat_monitor(config: Path, tmp_path: Path) -> Path:
    """``config`` with its monitor's arguments beside its ``class_path``, not under ``init_args``."""
    path = tmp_path / "flat.yaml"
    path.write_text(config.read_text().replace("      init_args:\n        every_n_steps", "      every_n_steps"))
    assert "    - class_path: lightning_ckpt_determinism.RecomputationMonitor\n      every_n_steps: 10\n" in (
        path.read_text()
    )
    return path


def _bad_monitor_choice(config: Path, tmp_path: Path) -> Path:
    """``config`` with its monitor given an `attribution` it does not take."""
    path = tmp_path / "bad_monitor.yaml"
    path.write_text(config.read_text().replace("every_n_steps: 10", "attribution: sometimes"))
    assert "attribution: sometimes" in path.read_text()
    return path


def write_classless_config(tmp_path: Path) -> Path:
    """A YAML for `LightningCLI(GPTModule, SyntheticTokensDataModule)`: `model` and `data` name no class."""
    path = tmp_path / "classless.yaml"
    path.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 1\n  strategy:\n"
        + CHECKPOINTING.format(classes="Block")
        + "\nmodel:\n  layers: 2\n  dim: 16\ndata:\n  batch_size: 4\n"
    )
    return path


def test_model_and_data_options_name_the_classes_a_config_leaves_out(capsys, tmp_path):
    code, out, err = audit(capsys, "--config", str(write_classless_config(tmp_path)), *GPT_CLASSES)
    assert code == 0, err
    assert out.splitlines()[-1] == "result: none of the 2 checkpointed regions diverged"


def test_help_exits_0(capsys):
    assert main(["audit", "--help"]) == 0
    assert "--calibrate-noise" in capsys.readouterr().out


def permissions_are_ignored(tmp_path: Path) -> bool:
    """Whether this process may write a read-only file, as root may (unless its capabilities were dropped)."""
    probe = tmp_path / "probe"
    probe.touch(mode=0o444)
    try:
        return os.access(probe, os.W_OK)
    finally:
        probe.unlink()


def fail_if_the_audit_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    def build(args: object) -> None:
        pytest.fail("the audit started although `--json` cannot be written")

    monkeypatch.setattr(running, "build", build)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("directory", r"`--json` '.*reports' is a directory; give the path of a file in it for the report$"),
        ("dev_full", r"`--json` '/dev/full' is a character device; the report goes to a new or an existing regular"),
        ("pipe", r"`--json` '.*pipe\.json' is a pipe; the report goes to a new or an existing regular file"),
        ("read_only", r"`--json` '.*read_only\.json' is read-only \(mode 444\); make it writable \(chmod u\+w\)"),
        ("read_only_directory", r"no new file can be made in '.*locked' \(Permission denied\); give a path in a"),
        ("config", r"`--json` '.*broken_python_state\.yaml' is the `--config` file; give another path for the report"),
    ],
)
def test_a_json_path_that_cannot_take_the_report_exits_2_before_the_audit_starts(
    case, message, capsys, tmp_path, monkeypatch
):
    if case == "dev_full" and not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    if case.startswith("read_only") and permissions_are_ignored(tmp_path):
        pytest.skip("root writes to read-only files and directories; the pipe case checks the up-front refusal")
    paths = {
        "directory": tmp_path / "reports",
        "dev_full": Path("/dev/full"),
        "pipe": tmp_path / "pipe.json",
        "read_only": tmp_path / "read_only.json",
        "read_only_directory": tmp_path / "locked" / "report.json",
        "config": CONFIGS / "broken_python_state.yaml",
    }
    path = paths[case]
    if case == "directory":
        path.mkdir()
    elif case == "pipe":
        os.mkfifo(path)
    elif case == "read_only":
        path.write_text("kept\n")
        path.chmod(0o444)
    elif case == "read_only_directory":
        path.parent.mkdir(mode=0o555)
    before = sorted(tmp_path.rglob("*"))
    fail_if_the_audit_starts(monkeypatch)
    code, out, err = audit(capsys, "--config", str(CONFIGS / "broken_python_state.yaml"), "--json", str(path))
    assert (code, out) == (2, "")
    assert len(err.splitlines()) == 1
    assert re.search(message, err), err
    assert sorted(tmp_path.rglob("*")) == before  # the probe left nothing behind
    if case == "read_only":
        assert path.read_text() == "kept\n"


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_a_full_disk_at_the_final_write_exits_2_after_the_verdict_and_leaves_no_file(
    failing, capsys, tmp_path, monkeypatch
):
    report = tmp_path / "report.json"
    report.write_text("previous report\n")

    def full_disk(*args: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files.os, failing, full_disk)
    code, out, err = audit(capsys, "--config", str(CONFIGS / "broken_python_state.yaml"), "--json", str(report))
    assert code == 2
    assert table(out)["blocks.3"]["verdict"] == "diverged"
    assert out.splitlines()[-1] == "result: 1 of 4 checkpointed regions diverged: blocks.3"
    assert err.splitlines()[-1] == (
        f"lightning-ckpt-determinism audit: error: `--json` {str(report)!r} cannot be written: No space left on"
        " device; the verdict above stands, but no report was written (an existing file is unchanged)"
    )
    assert [path.name for path in tmp_path.iterdir()] == ["report.json"]  # no temporary left
    assert report.read_text() == "previous report\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            b"trainer:\n  accelerator: cpu\n   devices: 1\n",
            r"bad\.yaml:3:11: invalid YAML: mapping values are not allowed here; correct the file there$",
        ),
        (
            b'model:\n  class_path: "examples.broken.BrokenModule\n',
            r"bad\.yaml:3:1: invalid YAML: found unexpected end of stream while scanning a quoted scalar; correct",
        ),
        (
            b"trainer:\n  accelerator: c\x01pu\n",
            r"bad\.yaml:2:17: invalid YAML: unacceptable character #x0001: special characters are not allowed; ",
        ),
        (b"model: \xff\n", r"`--config` '.*bad\.yaml' is no UTF-8 text \(byte 7: invalid start byte\); save it as"),
    ],
)
def test_a_config_that_is_no_yaml_is_named_with_line_and_column_in_one_line(text, message, capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_bytes(text)
    code, out, err = audit(capsys, "--config", str(path))
    assert (code, out) == (2, "")
    assert len(err.splitlines()) == 1
    assert re.search(message, err), err
    assert "<unicode string>" not in err


def test_a_yaml_error_without_a_position_still_names_the_file_in_one_line(capsys, tmp_path, monkeypatch):
    def fail(text: str) -> None:
        raise loading.yaml.YAMLError("no position\n  known")

    monkeypatch.setattr(loading.yaml, "safe_load", fail)
    code, _, err = audit(capsys, "--config", str(CONFIGS / "broken_python_state.yaml"))
    assert code == 2
    assert err == (
        f"lightning-ckpt-determinism audit: error: {CONFIGS / 'broken_python_state.yaml'} is no valid YAML: no"
        " position known; correct the file\n"
    )


def test_an_fsdp_config_without_cuda_exits_2_saying_why(capsys, tmp_path):
    strategy = CHECKPOINTING.format(classes="Block").replace("SingleDevice", "FSDP")
    path = write_config(tmp_path, "fsdp", strategy)
    code, out, err = audit(capsys, "--config", str(path))
    assert (code, out) == (2, "")
    fix = (
        "set `trainer.accelerator: cuda`"
        if torch.cuda.is_available()
        else "this machine has none: audit with lightning_ckpt_determinism.SingleDeviceCheckpointingStrategy and the"
        " same `checkpointing`, or on a machine with a GPU"
    )
    assert err == (
        f"lightning-ckpt-determinism audit: error: `trainer.strategy` FSDPCheckpointingStrategy in {path} needs a CUDA"
        f" accelerator (Lightning's FSDP shards on GPUs only), got CPUAccelerator; {fix}\n"
    )


def forbid_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail at once, instead of hanging for peers, if anything launches workers or joins a process group."""

    def forbidden(*args: object, **kwargs: object) -> None:
        pytest.fail("the audit started processes or a process group")

    monkeypatch.setattr(_SubprocessScriptLauncher, "launch", forbidden)
    monkeypatch.setattr(torch.multiprocessing, "start_processes", forbidden)
    monkeypatch.setattr(torch.distributed, "init_process_group", forbidden)


@pytest.mark.parametrize(
    ("trainer", "where"), [("devices: 2", "2 devices"), ("devices: 2\n  num_nodes: 2", "2 devices on each of 2 nodes")]
)
def test_a_multi_process_ddp_config_is_audited_on_one_process_and_says_so(
    trainer, where, capsys, tmp_path, monkeypatch
):
    text = (CONFIGS / "broken_python_state.yaml").read_text()
    path = tmp_path / "ddp.yaml"
    path.write_text(text.replace("devices: 1", trainer).replace("SingleDeviceCheckpointing", "DDPCheckpointing"))
    report = tmp_path / "ddp.json"
    forbid_processes(monkeypatch)
    code, out, err = audit(capsys, "--config", str(path), "--json", str(report))
    assert code == 1, err  # as for the single-device config
    note = f"note: DDPCheckpointingStrategy with {where} is audited on one process with the same checkpointing config"
    gradients, *rest = out.splitlines()[-3:]
    assert re.fullmatch(r"gradients: grad_divergence up to [0-9.e-]+ over 1 batch \(tolerance 0\)", gradients)
    assert rest == [note, "result: 1 of 4 checkpointed regions diverged: blocks.3"]
    assert table(out)["blocks.3"]["cause"] == "python_state"
    assert json.loads(report.read_text())["notes"] == [note]
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize(
    ("model", "checked", "note"),
    [
        ("examples.broken.BrokenModule", 3, "note: checked 3 batches: the training data has only 3 (asked for 5)"),
        (
            "tests.helpers.OddStepsSkippedModule",
            2,
            "note: checked 2 batches: the training data has only 3, and `training_step` returned no loss for 1 (asked"
            " for 5)",
        ),
    ],
)
def test_more_batches_than_the_data_has_says_how_many_were_checked(model, checked, note, capsys, tmp_path):
    path = tmp_path / "short.yaml"
    path.write_text(
        f"trainer:\n  accelerator: cpu\n  strategy:\n{CHECKPOINTING.format(classes='Block')}\nmodel:\n"
        f"  class_path: {model}\ndata:\n  class_path: examples.broken.SyntheticRegression\n"
        "  init_args:\n    size: 48\n"  # 3 batches of 16
    )
    report = tmp_path / "short.json"
    code, out, err = audit(capsys, "--config", str(path), "--batches", "5", "--json", str(report))
    assert code == 0, err
    lines = out.splitlines()
    assert lines[-3].endswith(f" over {checked} batches (tolerance 0)")
    assert lines[-2:] == [note, "result: none of the 4 checkpointed regions diverged"]
    written = json.loads(report.read_text())
    assert (written["batches_asked"], written["batches"], len(written["checks"])) == (5, checked, checked)
    assert written["notes"] == [note]


def test_a_training_step_without_batch_idx_is_audited_as_lightning_calls_it(capsys, tmp_path):
    path = tmp_path / "batch_only.yaml"
    path.write_text(
        f"trainer:\n  accelerator: cpu\n  strategy:\n{CHECKPOINTING.format(classes='Block')}\nmodel:\n"
        "  class_path: tests.helpers.BatchOnlyBrokenModule\n  init_args:\n    defect: python_state\n"
        "    defective_block: 3\ndata:\n  class_path: examples.broken.SyntheticRegression\n"
    )
    code, out, err = audit(capsys, "--config", str(path))
    assert code == 1, err
    assert out.splitlines()[-1] == "result: 1 of 4 checkpointed regions diverged: blocks.3"


def test_a_config_with_a_memory_budget_prints_its_trade_off_and_the_plan_before_auditing_every_candidate(capsys):
    code, out, _ = audit(capsys, "--config", str(CONFIGS / "gpt_memory_budget.yaml"))
    assert code == 0
    # Ground truth: the same model planned directly on a batch of the config's shape (16 sequences of 33 tokens;
    # bytes and FLOPs depend on shapes only).
    model = GPTModule(layers=4)
    batch = torch.randint(64, (16, 33))

    def step() -> None:
        logits = model.model(batch[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).backward()

    plan = plan_activation_checkpointing(model, CheckpointingConfig(classes=["Block"], memory_budget="50%"), step)
    assert plan.checkpointed == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]
    # The trade-off's row for the config's budget: the module plan (3 of the 4 identical blocks, whose share of the
    # roofline cost is their share of the FLOPs) and the op plan at the same budget.
    (marked,) = [re.split(r"\s{2,}", line) for line in out.splitlines() if line.endswith("planned at module level")]
    assert marked[:4] == ["6.0 MiB", "3 of 4", "3.4 MiB", "75.0%"]
    assert marked[4] == "3 of 4" and float(marked[7].rstrip("%")) < 75.0
    assert str(plan) in out
    # Every candidate is audited: any of them may be checkpointed.
    assert list(table(out.split(str(plan), 1)[1].lstrip("\n"))) == [f"model.blocks.{index}" for index in range(4)]


def test_a_module_outside_the_working_directory_is_named_with_where_the_audit_imports_from(
    capsys, tmp_path, monkeypatch
):
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / "audit_elsewhere_model.py").write_text("from examples.broken import BrokenModule as Module\n")
    config = write_config(tmp_path, "elsewhere", CHECKPOINTING.format(classes="Block"), "audit_elsewhere_model.Module")
    monkeypatch.chdir(elsewhere)
    hint = (
        f"No module named 'audit_elsewhere_model' (the audit imports from the working directory {elsewhere} and"
        " PYTHONPATH: run it from the directory that holds audit_elsewhere_model, or add that directory to"
        " PYTHONPATH)"
    )
    code, _, err = audit(capsys, "--config", str(config))
    assert (code, err) == (2, f"lightning-ckpt-determinism audit: error: {config} cannot be loaded: `model`: {hint}\n")
    code, _, err = audit(capsys, "--config", str(config), "--model", "audit_elsewhere_model.Module")
    option = "`--model` 'audit_elsewhere_model.Module'"
    assert (code, err) == (2, f"lightning-ckpt-determinism audit: error: {option} cannot be imported: {hint}\n")
    # What the hint says works.
    monkeypatch.syspath_prepend(str(project))
    try:
        code, out, err = audit(capsys, "--config", str(config))
    finally:
        sys.modules.pop("audit_elsewhere_model", None)
    assert code == 0, err
    assert out.splitlines()[-1] == "result: none of the 4 checkpointed regions diverged"


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal, as tqdm asks."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("batches", "shown"), [("1", False), ("2", True)])
def test_a_progress_bar_shows_on_a_terminal_for_several_batches_only(batches, shown, monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert main(["audit", "--config", str(CONFIGS / "broken_python_state.yaml"), "--batches", batches]) == 1
    assert (f"audit:   0%|          | 0/{batches}" in terminal.getvalue()) is shown


@pytest.mark.filterwarnings("default::lightning_ckpt_determinism.LightningCkptDeterminismWarning")
def test_a_warning_of_the_package_is_printed_as_its_one_line_as_a_fit_prints_it(capsys, tmp_path):
    argv = ["audit", "--config", str(CONFIGS / "broken_python_state.yaml")]
    main([*argv, "--trainer.strategy.init_args.checkpointing.memory_budget=50"])
    lines = capsys.readouterr().err.splitlines()
    said = [line for line in lines if "`memory_budget` of 50 bytes" in line]
    assert len(said) == 1 and said[0].startswith("lightning_ckpt_determinism: `memory_budget` of 50 bytes (50 B)")


def test_a_training_step_that_fails_without_checkpointing_is_named_where_your_code_raised(capsys):
    # The data's width does not match the model's: `nn.Linear` raises inside torch, called from the example's block.
    code, _, err = audit(capsys, "--config", str(CONFIGS / "broken_python_state.yaml"), "--data.init_args.dim=8")
    assert code == 2
    found = re.fullmatch(
        r"lightning-ckpt-determinism audit: error: the training step fails without checkpointing: RuntimeError: .*,"
        r" raised at (?P<path>.+):(?P<line>\d+) in (?P<name>\w+)\n",
        err,
    )
    assert found is not None, err
    assert (Path(found["path"]).name, found["name"]) == ("broken.py", "forward")
    assert "self.linear(x)" in Path(found["path"]).read_text().splitlines()[int(found["line"]) - 1]


@pytest.mark.parametrize("precision", ["bf16-true", "64-true"])
def test_a_true_precision_audit_gives_training_step_its_batch_converted_as_fit_does(capsys, tmp_path, precision):
    strategy = (
        "    class_path: lightning_ckpt_determinism.SingleDeviceCheckpointingStrategy\n"
        "    init_args:\n      checkpointing:\n        classes: [Block]"
    )
    config = write_config(tmp_path, "true_precision", strategy)
    # Float features: the model's weights are in the precision's dtype, and so must its batch be, as `fit` makes it.
    code, out, err = audit(capsys, "--config", str(config), f"--trainer.precision={precision}")
    assert code == 0, err
    assert out.splitlines()[-1] == "result: none of the 4 checkpointed regions diverged"


@dataclasses.dataclass(frozen=True)
class _FrozenBatch:
    features: torch.Tensor


def test_a_batch_the_precision_cannot_convert_is_a_usage_error_naming_it() -> None:
    strategy = SimpleNamespace(precision_plugin=HalfPrecision("bf16-true"), root_device=torch.device("cpu"))
    # As `fit` fails before `training_step` under this precision: Lightning cannot rebuild a frozen dataclass.
    message = r"^a batch of _FrozenBatch cannot be prepared as `fit` prepares it for `training_step`"
    with pytest.raises(running.UsageError, match=message):
        running._prepared(GPTModule(), strategy, _FrozenBatch(torch.ones(2)))
    converted = running._prepared(GPTModule(), strategy, (torch.ones(2), torch.ones(2, dtype=torch.long)))
    assert [tensor.dtype for tensor in converted] == [torch.bfloat16, torch.long]


class _HookedData(pl.LightningDataModule):
    """Dicts of features, doubled after the transfer: the datamodule's hook, which `fit` prefers to the model's."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader([{"x": torch.full((4,), float(i))} for i in range(4)], batch_size=2)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch[0] * (2 if self.trainer.training else 1), batch[1]


class _HookedModule(pl.LightningModule):
    """Turns a dict batch into features and targets before the transfer; records what `training_step` is given."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.seen: list[Any] = []

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch["x"], batch["x"].sum(dim=1, keepdim=True)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch[0] + (100 if self.trainer.training else 0), batch[1]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append(batch)
        return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.filterwarnings("ignore:You have overridden `on_after_batch_transfer`")
def test_the_audit_gives_training_step_its_batch_through_the_batch_hooks_as_fit_does(tmp_path: Path) -> None:
    data, fitted = _HookedData(), _HookedModule()
    pl.Trainer(**trainer_kwargs(tmp_path, max_steps=1)).fit(fitted, datamodule=data)
    strategy = SimpleNamespace(precision_plugin=Precision(), root_device=torch.device("cpu"))
    raw = next(iter(data.train_dataloader()))
    # The hooks read `self.trainer.training`, as a hook that augments only in training does: the audit's model and
    # datamodule are attached to the config's Trainer while they run, and detached after.
    trainer, model, fresh = pl.Trainer(**trainer_kwargs(tmp_path)), _HookedModule(), _HookedData()
    prepared = running._prepared(model, strategy, raw, fresh, trainer)
    assert len(prepared) == 2
    assert all(torch.equal(mine, fits) for mine, fits in zip(prepared, fitted.seen[0], strict=True))
    assert fresh.trainer is None and (trainer.state.fn, trainer.state.stage) == (None, None)
    with pytest.raises(RuntimeError, match="not attached to a `Trainer`"):
        model.trainer  # noqa: B018
    # Without a datamodule, the model's own hook is the one `fit` runs.
    alone = running._prepared(_HookedModule(), strategy, raw, trainer=trainer)
    assert torch.equal(alone[0], raw["x"] + 100)


def test_the_table_names_the_call_of_a_region_called_several_times_that_diverged() -> None:
    cell = RegionReport(
        "cell", 12, 0.5, ("aten.mul.Tensor", 0), True, "python_state", "Fix it.", calls=8, first_divergent_call=5
    )
    head = RegionReport("head", 3, 0.5, ("aten.add.Tensor", 2), True, "python_state", "Fix it.", calls=1)
    summaries = rendering.summarize([RecomputationReport(0.1, 0.1, True, 0.0, regions=[cell, head])])
    rows = table(rendering.table(summaries))
    assert rows["cell"]["first divergent op"] == "aten.mul.Tensor (op 0, call 5 of 8)"
    assert rows["head"]["first divergent op"] == "aten.add.Tensor (op 2)"
