"""The sentinel's step-level cost now and at an earlier commit, side by side in one process.

The package at ``--ref`` is exported from git into a temporary folder under another name (``lcd_previous``: every
``lightning_ckpt_determinism`` in its files renamed, its ``determinism_check`` names included, so that the two never
share torch's registry) and imported beside the package of the working tree. Two GPTs with the same weights, one
checkpointed by each package, train single steps with each package's sentinel tiers and without, interleaved
round-robin in one process: each ratio is a package's own tier over its own plain step, both measured in the same
rounds, so that the machine's drift hits both alike.

``python -m benchmarks.previous --ref 66cdc0b --dims 128 --rounds 21`` prints one row per package and width.
"""

import argparse
import importlib
import subprocess
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from benchmarks.common import (
    ModelSize,
    Variant,
    build_model,
    interleaved_times,
    make_batch,
    make_optimizer,
    paired_ratios,
    summary,
    torch_threads,
    train_step,
)
from benchmarks.sentinel import THREADS, TIERS
from lightning_ckpt_determinism.checkpointing.wrapper import checkpointed_modules

PACKAGE = "lightning_ckpt_determinism"
RENAMED = "lcd_previous"


def load_previous(ref: str, folder: Path) -> ModuleType:
    """The package as it was at ``ref``, exported into ``folder`` and imported as ``lcd_previous``.

    Args:
        ref: A git commit of this repository.
        folder: Where to put it (kept for the process's life).
    """
    archive = subprocess.run(["git", "archive", ref, PACKAGE], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    (folder / PACKAGE).rename(folder / RENAMED)
    for path in (folder / RENAMED).rglob("*.py"):
        path.write_text(path.read_text().replace(PACKAGE, RENAMED))
    sys.path.insert(0, str(folder))
    return importlib.import_module(RENAMED)


def _step_functions(
    package: Any,
    wrappers_of: Callable[[torch.nn.Module], list[Any]],
    size: ModelSize,
    label: str,
    device: torch.device,
) -> dict[str, Callable[[], object]]:
    """Each tier's step and the plain step of a GPT checkpointed by ``package`` (its own config and sentinel)."""
    torch.manual_seed(0)
    model = build_model(size, Variant("plain"), device)
    package.apply_activation_checkpointing(model, package.CheckpointingConfig(classes=["Block"]))
    optimizer = make_optimizer(model)
    inputs, targets = make_batch(size, device)
    step = partial(train_step, model, optimizer, inputs, targets)
    wrappers = wrappers_of(model)

    def watched(sentinel: Any) -> None:
        for wrapper in wrappers:
            wrapper.saved_observer = sentinel
        try:
            sentinel.next_step()
            step()
            record = sentinel.end_step()
            sentinel.read(record, clean=not bool(record.mismatch_counts(device.type).any()))
        finally:
            for wrapper in wrappers:
                wrapper.saved_observer = None

    functions: dict[str, Callable[[], object]] = {f"{label} step": step}
    for tier in TIERS:
        functions[f"{label} {tier}"] = partial(watched, package.RecomputationSentinel(model, mode=tier))
    return functions


def compare(
    previous: ModuleType, size: ModelSize, rounds: int, device: torch.device | None = None
) -> dict[str, dict[str, float]]:
    """Median tier/step ratios of the current and the previous package, measured in the same rounds, and each
    package's plain step (the sentinel off) over the previous package's.

    Args:
        previous: The earlier package (from :func:`load_previous`).
        size: The model's shape.
        rounds: Interleaved rounds.
        device: Where the models train (the CPU by default).
    """
    device = device or torch.device("cpu")
    previous_modules = importlib.import_module(f"{RENAMED}.checkpointing.wrapper").checkpointed_modules
    current = sys.modules[PACKAGE]
    functions = {
        **_step_functions(current, lambda model: _wrappers(checkpointed_modules(model)), size, "now", device),
        **_step_functions(previous, lambda model: _wrappers(previous_modules(model)), size, "before", device),
    }
    with torch_threads(THREADS):
        times = interleaved_times(functions, rounds, warmup=3, device=device)
    found: dict[str, dict[str, float]] = {}
    for label in ("now", "before"):
        base = times[f"{label} step"]
        found[label] = {"step_ms": summary(base)["median"] * 1e3}
        for tier in TIERS:
            found[label][f"{tier}/step"] = summary(paired_ratios(times[f"{label} {tier}"], base))["median"]
        found[label]["step/before"] = summary(paired_ratios(base, times["before step"]))["median"]
    return found


def _wrappers(regions: dict[str, torch.nn.Module]) -> list[Any]:
    return [module.__dict__["forward"] for module in regions.values()]


def main(argv: list[str] | None = None) -> int:
    """Print the sentinel's tier/step ratios now and at ``--ref``.

    Example::

        python -m benchmarks.previous --ref 66cdc0b --dims 128 --rounds 21
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.previous", description=main.__doc__)
    parser.add_argument("--ref", required=True, help="the earlier commit")
    parser.add_argument("--dims", default="128", help="model widths, comma-separated (sequence = width / 2)")
    parser.add_argument("--rounds", type=int, default=21, help="interleaved rounds of each variant")
    parser.add_argument("--device", default="cpu", help="where the models train (cpu, cuda)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        previous = load_previous(args.ref, Path(folder))
        print("package  dim  step ms  light/step  sampled/step  exact/step  step/before's")
        for dim in (int(text) for text in args.dims.split(",")):
            size = ModelSize(layers=4, dim=dim, heads=4, seq_len=dim // 2, batch_size=8, vocab_size=256)
            for label, row in compare(previous, size, args.rounds, torch.device(args.device)).items():
                print(
                    f"{label:<8} {dim:<4} {row['step_ms']:7.1f}  {row['light/step']:10.3f}"
                    f"  {row['sampled/step']:12.3f}  {row['exact/step']:10.3f}  {row['step/before']:13.3f}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
