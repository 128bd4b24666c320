import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def quick_start_lines() -> list[str]:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert block is not None
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_quick_start_is_two_command_lines_and_ci_runs_the_second():
    install_and_train, install_and_test = quick_start_lines()
    assert "python -m examples.train fit --config examples/configs/" in install_and_train
    config = install_and_train.rsplit("--config ", 1)[1].split()[0]
    assert (REPO / config).is_file()
    assert install_and_test.endswith("python -m pytest")
    ci_lines = (REPO / ".ci" / "run").read_text().splitlines()
    assert install_and_test in ci_lines


def test_public_api_is_documented_in_the_readme():
    import lightning_ckpt_determinism

    readme = (REPO / "README.md").read_text()
    missing = [
        name
        for name in lightning_ckpt_determinism.__all__
        if name not in readme and name not in ("__version__", "LightningCkptDeterminismWarning")
    ]
    assert missing == []
