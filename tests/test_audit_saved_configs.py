"""The audit reads what LightningCLI reads: the config a run saved, `fit --print_config`, several `--config` files and
dotted overrides, parsed by LightningCLI's own `fit` subcommand."""

import sys
from pathlib import Path

import pytest
import yaml

from examples import train
from lightning_ckpt_determinism.audit import main

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "examples" / "configs").glob("*.yaml"))
CLEAN = REPO / "examples" / "configs" / "gpt_blocks_by_class.yaml"
HOST_RNG = REPO / "examples" / "configs" / "broken_host_rng.yaml"
QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


@pytest.fixture(autouse=True)
def _cli_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # LightningCLI exports the seed it sets, and warns when it is given `args` next to pytest's own argv.
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    monkeypatch.setattr(sys, "argv", ["examples/train.py"])


def printed_config(path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """The config ``fit --print_config`` prints for ``path``, written to a file."""
    with pytest.raises(SystemExit, match=r"^0$"):
        train.main(["fit", "--config", str(path), "--print_config"])
    saved = tmp_path / f"printed_{path.name}"
    saved.write_text(capsys.readouterr().out)
    return saved


def saved_config(path: Path, tmp_path: Path) -> Path:
    """The ``config.yaml`` a one-step fit of ``path`` saves in its log directory."""
    cli = train.main(
        ["fit", "--config", str(path), "--trainer.max_steps=1", f"--trainer.default_root_dir={tmp_path}", *QUIET]
    )
    saved = Path(cli.trainer.log_dir) / "config.yaml"
    assert saved.is_file()
    return saved


def audit(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["audit", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("path", CONFIGS, ids=[path.name for path in CONFIGS])
def test_the_printed_config_of_each_example_audits_as_the_example_does(
    path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    printed = printed_config(path, tmp_path, capsys)
    # LightningCLI's own keys, which a loader of its own would reject.
    assert {"seed_everything", "ckpt_path", "trainer", "model"} <= set(yaml.safe_load(printed.read_text()))
    code, out, err = audit(capsys, "--config", str(printed))
    assert code == (1 if path.name.startswith("broken_") else 0), err + out
    assert "error" not in err


@pytest.mark.filterwarnings("ignore::lightning_ckpt_determinism.LightningCkptDeterminismWarning")
@pytest.mark.parametrize(("path", "code"), [(CLEAN, 0), (HOST_RNG, 1)], ids=["clean", "host_rng"])
def test_the_config_yaml_a_fit_saved_audits_with_the_fits_verdict(
    path: Path, code: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = saved_config(path, tmp_path)
    capsys.readouterr()
    found, out, err = audit(capsys, "--config", str(saved))
    assert found == code, err + out
    assert out.splitlines()[-1].startswith("result: 1 of 4" if code else "result: none of the")


def test_several_configs_merge_and_dotted_overrides_apply(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert audit(capsys, "--config", str(HOST_RNG))[0] == 1
    fix = tmp_path / "fix.yaml"
    fix.write_text(
        "trainer:\n  strategy:\n    init_args:\n      checkpointing:\n        classes: [Block]\n"
        "        preserve_host_rng: true\n"
    )
    code, out, err = audit(capsys, "--config", str(HOST_RNG), "--config", str(fix))
    assert code == 0, err + out
    override = "--trainer.strategy.init_args.checkpointing.preserve_host_rng=true"
    code, out, err = audit(capsys, "--config", str(HOST_RNG), override, "--batches", "2")
    assert code == 0, err + out
    assert " over 2 batches (tolerance 0)" in out


def test_a_checkpoint_to_resume_from_is_named_in_a_note(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = audit(capsys, "--config", str(CLEAN), f"--ckpt_path={tmp_path / 'last.ckpt'}")
    assert code == 0
    assert f"note: `ckpt_path` {tmp_path / 'last.ckpt'} is not loaded: the audit checks the model as the config" in out


def test_an_unknown_override_is_a_one_line_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = audit(capsys, "--config", str(CLEAN), "--trainer.strategy.init_args.checkpointing.every_nn=2")
    assert code == 2
    assert err.splitlines() == [
        f"lightning-ckpt-determinism audit: error: {CLEAN} with --trainer.strategy.init_args.checkpointing.every_nn=2"
        " cannot be loaded: `trainer.strategy.checkpointing`: Option 'every_nn' is not accepted; did you mean"
        " `every_n`?"
    ]
