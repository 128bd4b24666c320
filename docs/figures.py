"""Draw the pictures under ``docs/images/`` from real runs: the example fits' logged metrics and the benchmark's JSON.

Usage: ``python docs/figures.py`` (from the repository root, about a minute on 2 cores). It trains the clean example
GPT (``examples/configs/gpt_blocks_by_class.yaml``) and a broken model (``broken_host_rng.yaml``: one block draws
NumPy noise that recomputation draws again) for 40 steps each, the monitor checking every second step and the
sentinel on every step, logs them with a ``CSVLogger``, and plots what was logged:

- ``divergence.png``: ``recompute/grad_divergence`` of both fits;
- ``sentinel.png``: ``recompute/sentinel/mismatches`` of both fits;
- ``check_cost.png``: the throughput with the monitor against ``every_n_steps``, 1 / (1 + c / n) from the check's
  cost c measured by ``python benchmarks/run.py`` (``docs/benchmark-cpu.json``), with the throughput measured at
  n = 50.
"""

import csv
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "docs" / "images"
BENCHMARK = ROOT / "docs" / "benchmark-cpu.json"
FITS = {
    "clean: examples/configs/gpt_blocks_by_class.yaml": ROOT / "examples" / "configs" / "gpt_blocks_by_class.yaml",
    "broken: examples/configs/broken_host_rng.yaml": ROOT / "examples" / "configs" / "broken_host_rng.yaml",
}
STEPS = 40
OVERRIDE = """\
trainer:
  max_steps: {steps}
  log_every_n_steps: 1
  enable_progress_bar: false
  enable_model_summary: false
  logger:
    class_path: lightning.pytorch.loggers.CSVLogger
    init_args:
      save_dir: {save_dir}
      name: run
  callbacks:
    - class_path: lightning_ckpt_determinism.RecomputationMonitor
      init_args:
        every_n_steps: 2
        on_divergence: ignore
"""


def fit_metrics(config: Path, work: Path) -> dict[str, list[tuple[int, float]]]:
    """Train ``config`` with the override above; every logged column as ``(step, value)`` pairs."""
    sys.path.insert(0, str(ROOT))
    from examples import train

    override = work / "override.yaml"
    override.write_text(OVERRIDE.format(steps=STEPS, save_dir=work))
    os.environ.pop("PL_GLOBAL_SEED", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train.main(["fit", "--config", str(config), "--config", str(override)])
    (metrics,) = work.glob("run/version_*/metrics.csv")
    columns: dict[str, list[tuple[int, float]]] = {}
    with metrics.open() as file:
        for row in csv.DictReader(file):
            for key, value in row.items():
                if key != "step" and value:
                    columns.setdefault(key, []).append((int(row["step"]), float(value)))
    return columns


def _plot_metric(runs: dict[str, dict[str, list[tuple[int, float]]]], key: str, ylabel: str, path: Path) -> None:
    figure, axes = plt.subplots(figsize=(7, 3.2), dpi=120)
    for (label, columns), marker in zip(runs.items(), ("o", "s"), strict=True):
        points = columns.get(key, [])
        axes.plot([step for step, _ in points], [value for _, value in points], marker=marker, label=label)
    axes.set_xlabel("training step")
    axes.set_ylabel(ylabel)
    axes.grid(alpha=0.3)
    axes.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, fontsize=8, frameon=False)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def _plot_check_cost(result: dict[str, Any], path: Path) -> None:
    cost = result["check_cost"]["check/step"]
    attributed = result["check_cost"]["two-pass attribution/step"]["median"]
    measured = result["lightning"]["ratios"]["monitor"]["in_run"]["median"]
    every = result["lightning"]["every_n_steps"]
    periods = [1, 2, 5, 10, 20, 50, 100, 200, 500]
    figure, axes = plt.subplots(figsize=(7, 3.2), dpi=120)
    label = f"default monitor (check = {cost['median']:.2f} steps)"
    axes.plot(periods, [1 / (1 + cost["median"] / n) for n in periods], marker="o", label=label)
    axes.fill_between(
        periods,
        [1 / (1 + cost["q3"] / n) for n in periods],
        [1 / (1 + cost["q1"] / n) for n in periods],
        alpha=0.2,
        label="check cost IQR",
    )
    axes.plot(
        periods,
        [1 / (1 + attributed / n) for n in periods],
        marker="s",
        label=f"attribution: always (check = {attributed:.1f} steps)",
    )
    axes.plot([every], [measured], marker="*", markersize=12, linestyle="none", label=f"measured in a fit, n={every}")
    axes.set_xscale("log")
    axes.set_xlabel("every_n_steps")
    axes.set_ylabel("throughput / without monitor")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def main() -> int:
    IMAGES.mkdir(parents=True, exist_ok=True)
    runs = {}
    with tempfile.TemporaryDirectory() as directory:
        for index, (label, config) in enumerate(FITS.items()):
            work = Path(directory) / str(index)
            work.mkdir()
            runs[label] = fit_metrics(config, work)
    _plot_metric(runs, "recompute/grad_divergence", "recompute/grad_divergence", IMAGES / "divergence.png")
    _plot_metric(runs, "recompute/sentinel/mismatches", "sentinel mismatches per step", IMAGES / "sentinel.png")
    _plot_check_cost(json.loads(BENCHMARK.read_text()), IMAGES / "check_cost.png")
    for name in ("divergence.png", "sentinel.png", "check_cost.png"):
        print(f"wrote docs/images/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
