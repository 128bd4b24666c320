"""Compiled step time: this package's checkpointing against hand-written checkpointing, both under ``torch.compile``.

Run from the repository root::

    python benchmarks/compiled.py                       # the default size of benchmarks/run.py, inductor
    python benchmarks/compiled.py --size tiny --backend aot_eager

Each variant is the example GPT compiled whole; the first rounds (compilation) are left out as warm-up. Ratios are
medians of per-round ratios of interleaved steps, as in ``benchmarks/run.py``.
"""

import argparse
import json
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch._dynamo

from benchmarks.common import (
    ModelSize,
    Variant,
    build_model,
    interleaved_times,
    make_batch,
    make_optimizer,
    paired_ratios,
    summary,
    train_step,
)
from benchmarks.run import _PRESETS
from lightning_ckpt_determinism import CheckpointingConfig

NONE = "compiled, none"
HAND = "compiled, hand-written"
PACKAGE = "compiled, package"
GOAL_PACKAGE_OVER_HAND = 1.03

VARIANTS = (
    Variant(NONE),
    Variant(HAND, hand=True),
    Variant(PACKAGE, config=CheckpointingConfig(classes=["Block"])),
)


def run(size: ModelSize, device: torch.device, rounds: int, warmup: int, backend: str) -> dict[str, Any]:
    """Time one compiled training step (forward, backward, AdamW) of every variant, interleaved.

    Args:
        size: The model's shape.
        device: Where to run.
        rounds: Timed steps per variant.
        warmup: Untimed rounds first; the first compiles.
        backend: The ``torch.compile`` backend.

    Returns:
        ``{"backend", "variants": {name: summary of seconds}, "ratios": {"a/b": summary}, "goal"}``.
    """
    torch._dynamo.reset()
    inputs, targets = make_batch(size, device)
    steps = {}
    for variant in VARIANTS:
        model = torch.compile(build_model(size, variant, device), backend=backend)
        steps[variant.name] = partial(train_step, model, make_optimizer(model), inputs, targets)
    times = interleaved_times(steps, rounds, max(warmup, 1), device)
    ratios = {f"{a}/{b}": summary(paired_ratios(times[a], times[b])) for a, b in ((HAND, NONE), (PACKAGE, HAND))}
    package_over_hand = ratios[f"{PACKAGE}/{HAND}"]["median"]
    return {
        "backend": backend,
        "variants": {name: summary(samples) for name, samples in times.items()},
        "ratios": ratios,
        "goal": {"value": package_over_hand, "goal": f"<= {GOAL_PACKAGE_OVER_HAND}"},
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the compiled step-time benchmark, print it, and write JSON if asked.

    Args:
        argv: Command-line arguments without the program name; ``None`` reads ``sys.argv``.

    Returns:
        ``0``; a missed goal is reported, not turned into a failure.
    """
    parser = argparse.ArgumentParser(prog="python benchmarks/compiled.py", description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--size", choices=sorted(_PRESETS), default="default", help="preset of benchmarks/run.py")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default: inductor)")
    parser.add_argument("--rounds", type=int, help="timed rounds (default: the preset's)")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    args = parser.parse_args(argv)
    size, repeats = _PRESETS[args.size]
    rounds = args.rounds or repeats.rounds
    if rounds < 2:
        parser.error(f"`--rounds` must be at least 2, got {rounds}.")
    result = run(size, torch.device("cpu"), rounds, repeats.warmup, args.backend)
    print(f"Compiled step time ({args.backend}, CPU, torch {torch.__version__}), {rounds} interleaved rounds")
    for name, stats in result["variants"].items():
        print(f"  {name:<40}{stats['median'] * 1e3:>10.1f} ms  (IQR {stats['q1'] * 1e3:.1f}-{stats['q3'] * 1e3:.1f})")
    for name, stats in result["ratios"].items():
        print(f"  {name:<40}{stats['median']:>10.3f}     (IQR {stats['q1']:.3f}-{stats['q3']:.3f})")
    goal = result["goal"]
    verdict = "met" if goal["value"] <= GOAL_PACKAGE_OVER_HAND else "MISSED"
    print(f"Goal: package/hand-written {goal['value']:.3f} ({goal['goal']}) {verdict}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
