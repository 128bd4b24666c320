"""Host time per region call of the package's wrapper against a hand-written non-reentrant checkpoint.

A tiny region (so that the host's work dominates), one torch thread, this thread's CPU time, every variant timed in
the same round (order shuffled), many rounds, medians. The forward (``region(x)``) and the backward (the recomputation
and the region's backward, ``torch.autograd.backward(y, grad)``) are timed apart. No sentinel, no observer: the
wrapper as a plain user gets it.

Run ``python -m benchmarks.wrapper_overhead --rounds 4000``.
"""

import argparse
import copy
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from benchmarks.common import round_orders, torch_threads
from examples.gpt import Block
from lightning_ckpt_determinism import CheckpointingConfig
from lightning_ckpt_determinism.checkpointing.wrapper import checkpoint_module

_WIDTH = 16
_BATCH = 4


class Tiny(nn.Module):
    """``Linear(16, 16)`` then GELU: no buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(_WIDTH, _WIDTH)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.linear(x))


class Buffered(nn.Module):
    """LayerNorm, ``Linear(16, 16)``, GELU, times a registered buffer: a region that holds a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(_WIDTH)
        self.linear = nn.Linear(_WIDTH, _WIDTH)
        self.act = nn.GELU()
        self.register_buffer("scale", torch.ones(_WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.linear(self.norm(x))) * self.scale


def _hand(block: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    def call(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(block, x, use_reentrant=False)
        return out

    return call


def _package(block: nn.Module, **options: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    checkpoint_module(block, "region", CheckpointingConfig(classes=[type(block).__name__], **options))
    return block


def variants() -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], nn.Module]]:
    """Every timed variant, by name: the callable and the module whose parameters' gradients are reset. ``block`` is
    the example GPT's block (13 modules, 28 saved tensors) at width 16, run on a ``(1, 4, 16)`` input."""
    torch.manual_seed(0)
    tiny, buffered, gpt_block = Tiny(), Buffered(), Block(_WIDTH, 2, 0.1)
    made: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], nn.Module]] = {}
    for name, original, make in (
        ("tiny hand", tiny, _hand),
        ("tiny pkg default", tiny, _package),
        ("tiny pkg host_rng", tiny, lambda b: _package(b, preserve_host_rng=True)),
        ("buffered hand", buffered, _hand),
        ("buffered pkg default (protect_buffers)", buffered, _package),
        ("buffered pkg protect_buffers=False", buffered, lambda b: _package(b, protect_buffers=False)),
        ("block hand", gpt_block, _hand),
        ("block pkg default", gpt_block, _package),
    ):
        module = copy.deepcopy(original)
        made[name] = (make(module), module)
    return made


def measure(rounds: int, warmup: int) -> dict[str, dict[str, list[int]]]:
    """Nanoseconds of thread CPU time per forward and per backward of each variant, one sample per round."""
    made = variants()
    names = list(made)
    times: dict[str, dict[str, list[int]]] = {name: {"forward": [], "backward": []} for name in names}
    shapes = {name: (1, _BATCH, _WIDTH) if name.startswith("block") else (_BATCH, _WIDTH) for name in names}
    x = {name: torch.randn(shape) for name, shape in shapes.items()}
    grad = {name: torch.ones(shape) for name, shape in shapes.items()}
    clock = time.thread_time_ns
    gc.disable()
    try:
        for index, order in enumerate(round_orders(names, warmup + rounds)):
            if index % 100 == 0:
                gc.collect()
            for name in order:
                call, module = made[name]
                for parameter in module.parameters():
                    parameter.grad = None
                inputs = x[name].detach().requires_grad_()
                start = clock()
                out = call(inputs)
                middle = clock()
                torch.autograd.backward(out, grad[name])
                end = clock()
                if index >= warmup:
                    times[name]["forward"].append(middle - start)
                    times[name]["backward"].append(end - middle)
    finally:
        gc.enable()
    return times


def main() -> None:
    """Print µs per call (median) of each variant, and the package's paired excess over the hand-written call (median
    and quartiles of the per-round differences)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=4000)
    parser.add_argument("--warmup", type=int, default=200)
    args = parser.parse_args()
    with torch_threads(1):
        times = measure(args.rounds, args.warmup)
    hand_of = {name: name.split(" ")[0] + " hand" for name in times}
    print(f"{'variant':<40} {'fwd µs':>7} {'bwd µs':>7} {'total':>7}   paired excess over hand: fwd, bwd, total (IQR)")
    for name, parts in times.items():
        medians = {part: statistics.median(samples) / 1000 for part, samples in parts.items()}
        hand = times[hand_of[name]]
        excess = {
            part: [(mine - theirs) / 1000 for mine, theirs in zip(parts[part], hand[part], strict=True)]
            for part in ("forward", "backward")
        }
        excess["total"] = [f + b for f, b in zip(excess["forward"], excess["backward"], strict=True)]
        quartiles = {part: statistics.quantiles(values, n=4) for part, values in excess.items()}
        print(
            f"{name:<40} {medians['forward']:7.1f} {medians['backward']:7.1f}"
            f" {medians['forward'] + medians['backward']:7.1f}   "
            + ", ".join(f"{q[1]:+6.1f} ({q[0]:+.1f}..{q[2]:+.1f})" for q in quartiles.values())
        )


if __name__ == "__main__":
    main()
