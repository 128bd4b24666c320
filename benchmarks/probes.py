"""How often regions whose code paths vary are probed, and what a probed call costs.

Run from the repository root::

    python -m benchmarks.probes               # 200 steps of each router, 21 timed rounds
    python -m benchmarks.probes --steps 50    # in seconds

A region learns a profile per code path from a probed call (:mod:`~lightning_ckpt_determinism.checkpointing.profile`):
a call on a path it has not learned makes the next calls of its kind probe until one takes that path, 8 calls at first
and half as many after each time the region gave up. Counted here: the probes of two mixture-of-experts regions (eight
experts, each run only on the tokens routed to it, so that a batch where an expert gets none takes another path) over
``--steps`` training steps, at several batch sizes (the fewer tokens, the more paths), and of a LayerDrop region that
skips its layer every other step. Timed: a training step whose every region is probed over one whose regions are
not, interleaved rounds, the median of per-round ratios.
"""

import argparse
import json
import statistics
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn

from benchmarks.common import interleaved_times, paired_ratios, torch_threads
from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing
from lightning_ckpt_determinism.checkpointing import wrapper as wrapper_module
from lightning_ckpt_determinism.checkpointing.profile import FirstForwardProbe

WIDTH = 32
TOKENS = (4, 8, 16, 64)


class Experts(nn.Module):
    """Eight linear experts, each run on the tokens an argmax router sends it; an expert without tokens is skipped."""

    def __init__(self, width: int = WIDTH, experts: int = 8) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            rows = (choice == index).nonzero().squeeze(-1)
            if rows.numel():
                out = out.index_add(0, rows, torch.tanh(expert(x[rows])))
        return x + out


class LayerDrop(nn.Module):
    """A layer skipped when ``skip`` is set."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.layer = nn.Linear(width, width)
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0 if self.skip else x + torch.tanh(self.layer(x))


class Block(nn.Module):
    """A layer norm and a two-layer MLP with a residual: a region with one path, for the timing."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


@contextmanager
def counted_probes() -> Iterator[list[int]]:
    """Count the probes made inside the block (one entry a probe)."""
    made: list[int] = []

    class Counting(FirstForwardProbe):
        def __init__(self, module: nn.Module) -> None:
            super().__init__(module)
            made.append(1)

    real = wrapper_module.FirstForwardProbe
    wrapper_module.FirstForwardProbe = Counting  # type: ignore[misc]
    try:
        yield made
    finally:
        wrapper_module.FirstForwardProbe = real  # type: ignore[misc]


def expert_probes(tokens: int, steps: int) -> int:
    """Probes of two checkpointed expert regions over ``steps`` steps of ``tokens`` tokens each."""
    torch.manual_seed(0)
    model = nn.Sequential(Experts(), Experts())
    apply_activation_checkpointing(model, CheckpointingConfig(classes=["Experts"]))
    with counted_probes() as made:
        for step in range(steps):
            x = torch.randn(tokens, WIDTH, generator=torch.Generator().manual_seed(step))
            model(x).sum().backward()
    return len(made)


def layer_drop_probes(steps: int) -> int:
    """Probes of a checkpointed LayerDrop region skipping its layer every other step."""
    torch.manual_seed(0)
    model = nn.Sequential(LayerDrop())
    apply_activation_checkpointing(model, CheckpointingConfig(classes=["LayerDrop"]))
    with counted_probes() as made:
        for step in range(steps):
            model[0].skip = step % 2 == 0
            x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step), requires_grad=True)
            model(x).sum().backward()
    return len(made)


def probed_step_ratio(width: int, rounds: int, warmup: int = 3) -> float:
    """The median ratio of a training step whose four regions are all probed over one whose regions are not."""
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(width) for _ in range(4)))
    apply_activation_checkpointing(model, CheckpointingConfig(classes=["Block"]))
    x = torch.randn(8, 32, width)

    def step(probed: bool) -> None:
        if probed:
            for block in model:
                block.forward._profiles.clear()  # what the region learned is forgotten: the call is probed
        model(x).sum().backward()

    times = interleaved_times(
        {"plain": lambda: step(False), "probed": lambda: step(True)}, rounds, warmup, torch.device("cpu")
    )
    return statistics.median(paired_ratios(times["probed"], times["plain"]))


def run(steps: int, rounds: int, widths: Sequence[int] = (64, 256)) -> dict[str, Any]:
    """Every figure of the module's description."""
    with torch_threads(1):
        return {
            "steps": steps,
            "expert_probes": {tokens: expert_probes(tokens, steps) for tokens in TOKENS},
            "layer_drop_probes": layer_drop_probes(steps),
            "probed_step": {width: probed_step_ratio(width, rounds) for width in widths},
        }


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table, and write the result as JSON if asked."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes", description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps of each router")
    parser.add_argument("--rounds", type=int, default=21, help="interleaved timing rounds")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    args = parser.parse_args(argv)
    result = run(args.steps, args.rounds)
    calls = 2 * args.steps
    for tokens, probes in result["expert_probes"].items():
        print(f"experts, {tokens:3d} tokens: {probes:4d} probes in {calls} region calls")
    print(f"LayerDrop every other step: {result['layer_drop_probes']:4d} probes in {args.steps} region calls")
    for width, ratio in result["probed_step"].items():
        print(f"width {width}: a step with every region probed costs {ratio:.2f} times one without")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
