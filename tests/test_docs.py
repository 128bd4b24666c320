"""The README and the docs say what is true: every code block runs or parses, every link resolves, the generated
pages equal what the code and the measurements give, and the quick start is what CI runs."""

import contextlib
import io
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

import lightning_ckpt_determinism
from docs import generate
from lightning_ckpt_determinism import CheckpointingCLI, CheckpointingConfig
from lightning_ckpt_determinism.audit import main as audit_main
from tests.helpers import logged_lines

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
BASE_CONFIG = REPO / "examples" / "configs" / "gpt_blocks_by_class.yaml"


def blocks(language: str) -> list[tuple[str, str]]:
    """``(page:index, code)`` of every fenced block of ``language`` in the README and the docs."""
    found = []
    for page in PAGES:
        for index, match in enumerate(BLOCK.finditer(page.read_text())):
            if match[1] == language:
                found.append((f"{page.relative_to(REPO)}:{index}", match[2]))
    return found


def ids(found: list[tuple[str, str]]) -> list[str]:
    return [where for where, _ in found]


def matches(expected: str, actual: str) -> bool:
    """Whether ``actual`` is ``expected`` with each ``...`` of it standing for any text."""
    pattern = ".*".join(re.escape(part) for part in expected.split("..."))
    return re.fullmatch(pattern, actual) is not None


@pytest.fixture
def cli_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # LightningCLI exports the seed it sets, and warns when it is given `args` next to pytest's own argv.
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    monkeypatch.setattr(sys, "argv", ["docs"])
    monkeypatch.chdir(REPO)


def test_quick_start_is_two_command_lines_and_ci_runs_the_second() -> None:
    section = (REPO / "README.md").read_text().split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert block is not None
    install_and_train, install_and_test = [line for line in block[1].splitlines() if line.strip()]
    assert "python -m examples.train fit --config examples/configs/" in install_and_train
    assert (REPO / install_and_train.rsplit("--config ", 1)[1].split()[0]).is_file()
    assert install_and_test.endswith("python -m pytest")
    assert install_and_test in (REPO / ".ci" / "run").read_text().splitlines()


@pytest.mark.usefixtures("cli_environment")
@pytest.mark.parametrize(("where", "code"), blocks("python"), ids=ids(blocks("python")))
def test_every_python_block_runs(where: str, code: str) -> None:
    exec(compile(code, where, "exec"), {"__name__": "docs"})


@pytest.mark.usefixtures("cli_environment")
@pytest.mark.parametrize(("where", "code"), blocks("yaml"), ids=ids(blocks("yaml")))
def test_every_yaml_block_is_a_config_the_package_cli_accepts(where: str, code: str, tmp_path: Path) -> None:
    snippet = yaml.safe_load(code)
    path = tmp_path / "snippet.yaml"
    path.write_text(code)
    # On top of a complete config, as a second `--config`: the snippet's keys and values are checked as LightningCLI
    # checks them, and they win.
    cli = CheckpointingCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=["--config", str(BASE_CONFIG), "--config", str(path)],
        run=False,
    )
    strategy = snippet["trainer"]["strategy"]
    assert type(cli.trainer.strategy).__name__ == strategy["class_path"].rsplit(".", 1)[1]
    assert cli.trainer.strategy.checkpointing == CheckpointingConfig(**strategy["init_args"]["checkpointing"])


@pytest.mark.parametrize(("where", "code"), blocks("bash"), ids=ids(blocks("bash")))
def test_every_bash_block_parses(where: str, code: str) -> None:
    done = subprocess.run(["bash", "-n"], input=code, text=True, capture_output=True, check=False)
    assert done.returncode == 0, done.stderr


@pytest.mark.usefixtures("cli_environment")
@pytest.mark.parametrize(("where", "code"), blocks("console"), ids=ids(blocks("console")))
def test_every_console_block_parses_and_each_audit_prints_what_it_shows(where: str, code: str) -> None:
    """Commands after ``$ `` parse; an audit is run, and its output and exit code are the ones shown."""
    lines = code.rstrip("\n").splitlines()
    commands = [number for number, line in enumerate(lines) if line.startswith("$ ")]
    assert commands and commands[0] == 0
    code_shown = None
    for start, end in zip(commands, [*commands[1:], len(lines)], strict=True):
        command, shown = lines[start][2:], lines[start + 1 : end]
        done = subprocess.run(["bash", "-n"], input=command, text=True, capture_output=True, check=False)
        assert done.returncode == 0, done.stderr
        if command == "echo $?":
            assert shown == [str(code_shown)]
        elif command.startswith("python -m lightning_ckpt_determinism audit "):
            output = io.StringIO()
            with contextlib.redirect_stdout(output):
                code_shown = audit_main(command.split()[3:])
            printed = output.getvalue().splitlines()
            assert len(printed) == len(shown), printed
            assert all(matches(line, actual) for line, actual in zip(shown, printed, strict=True)), printed


def _fit_output(config: Path, root: Path) -> list[str]:
    """What a one-step fit of ``config`` logs and warns."""
    from examples import train

    argv = ["fit", "--config", str(config), "--trainer.max_steps=1", f"--trainer.default_root_dir={root}"]
    with (
        logged_lines("lightning.pytorch", "lightning_ckpt_determinism") as lines,
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        train.main([*argv, "--trainer.enable_progress_bar=false"])
    return lines + [str(warning.message) for warning in caught]


@pytest.mark.usefixtures("cli_environment")
def test_the_lines_the_readme_shows_are_what_a_fit_prints(tmp_path: Path) -> None:
    broken = REPO / "examples" / "configs" / "broken_host_rng.yaml"
    printed = _fit_output(BASE_CONFIG, tmp_path / "clean") + _fit_output(broken, tmp_path / "broken")
    shown = [code.strip() for where, code in blocks("text") if where.startswith("README.md")]
    assert len(shown) == 2
    for line in shown:
        assert any(matches(line, actual) for actual in printed), (line, printed)


def test_every_relative_link_and_image_resolves() -> None:
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            assert not target.startswith("http://"), (page.name, target)
            if target.startswith("https://"):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path) if path else page
            assert resolved.is_file(), (page.name, target)
            if anchor:
                headings = re.findall(r"^#+ (.+)$", resolved.read_text(), re.MULTILINE)
                slugs = {re.sub(r"[^\w\- ]", "", heading).strip().lower().replace(" ", "-") for heading in headings}
                assert anchor in slugs, (page.name, target, slugs)


# A paragraph (or a list item) a reader takes in at once; longer ones are split.
LONGEST_PARAGRAPH = 150


def paragraphs(text: str) -> list[str]:
    """The prose of a page: its paragraphs and list items, outside code blocks, tables, headings and comments."""
    found = []
    for block in re.split(r"\n\s*\n", BLOCK.sub("", text)):
        for item in re.split(r"\n(?=\s*(?:[-*]|\d+\.) )", block.strip()):
            if item and not item.lstrip().startswith(("|", "#", "<!--", ":::")):
                found.append(item)
    return found


def test_no_paragraph_of_the_readme_or_the_docs_runs_to_150_words() -> None:
    long = [
        (page.name, len(paragraph.split()), paragraph[:60])
        for page in PAGES
        for paragraph in paragraphs(page.read_text())
        if len(paragraph.split()) >= LONGEST_PARAGRAPH
    ]
    assert long == []
    # What counts as one: a list item apart from the item before it, a code block not at all.
    assert paragraphs("Two\nlines.\n\n- an item\n- another\n\n```text\nnot prose\n```\n") == [
        "Two\nlines.",
        "- an item",
        "- another",
    ]


def test_the_causes_page_is_generated_from_cause_hints() -> None:
    assert (REPO / "docs" / "causes.md").read_text() == generate.causes_page()


def test_the_performance_tables_are_made_from_the_benchmark_json() -> None:
    text = (REPO / "docs" / "performance.md").read_text()
    assert text == generate.performance_page(text, json.loads((REPO / "docs" / "benchmark-cpu.json").read_text()))


def test_the_memory_budget_tables_are_made_from_the_budget_benchmark_json() -> None:
    text = (REPO / "docs" / "memory-budget.md").read_text()
    result = json.loads((REPO / "docs" / "benchmark-budget-cpu.json").read_text())
    assert "<!-- budget tables: begin -->" in text
    assert text == generate.budget_page(text, result)


def test_the_api_reference_covers_every_public_name() -> None:
    reference = (REPO / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^::: lightning_ckpt_determinism\.(\w+)$", reference, re.MULTILINE))
    assert documented == set(lightning_ckpt_determinism.__all__) - {"__version__"}


# Constants document themselves in their module; the CLI's example is a training script, shown, not run.
_NOT_RUN = {"__version__", "CAUSE_HINTS", "CheckpointingCLI"}


@pytest.mark.parametrize("name", sorted(set(lightning_ckpt_determinism.__all__) - _NOT_RUN))
def test_every_public_example_runs_as_a_user_copies_it(name: str) -> None:
    # Run with the documented name alone, not in its module's namespace: an example that leans on its module's
    # imports (`torch`, `CheckpointingConfig`) fails when a user copies it.
    import doctest

    documented = getattr(lightning_ckpt_determinism, name)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = doctest.DocTestFinder(recurse=False).find(documented, name, globs={name: documented})
    assert any(test.examples for test in tests), f"{name} has no example"
    for test in tests:
        assert runner.run(test, out=lambda _: None).failed == 0, f"{name}'s example fails in a fresh session"
