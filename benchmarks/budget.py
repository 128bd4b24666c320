"""A memory budget at both granularities, on the benchmark GPT and on a small residual conv net: for budgets of 25, 50
and 75 % of what the blocks keep plainly, each granularity's plan, its recompute cost in one cost model (the roofline
model of ``checkpointing/cost.py``, for both), the activation bytes the planned model keeps (measured as ``memory.py``
measures them, independently of the plan's own figures) against the planned bytes and the budget, and the step time,
every variant interleaved in one process, with the planning step timed against a training step in the same rounds.
``python -m benchmarks.budget`` prints the cost model alone on the GPT at several widths (:func:`recompute_by_width`).
On the CPU the timed rounds run on one torch thread and are timed in that thread's CPU time (``time.thread_time``),
which other processes on a busy machine do not inflate as they do wall time.

Both granularities plan in one cost model, the fixed roofline (``budget_cost="roofline"``), and each plan's
``recompute_share`` is in it.
"""

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from benchmarks.common import (
    ModelSize,
    Variant,
    build_model,
    interleaved_times,
    lm_loss,
    make_batch,
    make_optimizer,
    paired_ratios,
    summary,
    torch_threads,
    train_step,
)
from benchmarks.memory import forward_bytes
from lightning_ckpt_determinism import (
    CheckpointingConfig,
    CheckpointingPlan,
    apply_activation_checkpointing,
    plan_activation_checkpointing,
)
from lightning_ckpt_determinism.checkpointing.budget_plan import plan_from_figures

SHARES = (0.25, 0.5, 0.75)
GRANULARITIES = ("module", "op")
EVERY_BLOCK = "every block"
PLAIN = "no checkpointing"
PLANNED_SHARE = 0.5
"""The budget whose planning step is timed (at each granularity) and whose figures the goals judge."""
ARITHMETIC_OPS = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.", "aten.convolution.")
"""The op calls whose cost is mostly arithmetic (matrix products and convolutions); the others move memory."""


class ConvBlock(nn.Module):
    """A residual block: two 3x3 convolutions, each with batch norm, and ReLUs."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(x + self.norm2(self.conv2(hidden)))


class ConvNet(nn.Module):
    """A stem convolution, ``layers`` :class:`ConvBlock` s, global average pooling and a linear classifier."""

    def __init__(self, channels: int, classes: int, layers: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList(ConvBlock(channels) for _ in range(layers))
        self.head = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


@dataclasses.dataclass(frozen=True)
class Architecture:
    """A model to plan on: how to build it (same weights each time), its batch, and the class of its blocks.

    Args:
        name: The name the table and the JSON use.
        block_class: The class name ``classes`` matches.
        build: The model on the device with the given number of blocks (``None``: the size's).
        inputs: The batch's inputs.
        targets: The batch's class (or next-token) targets, for ``lm_loss``.
    """

    name: str
    block_class: str
    build: Callable[[int | None], nn.Module]
    inputs: torch.Tensor
    targets: torch.Tensor


def architectures(size: ModelSize, device: torch.device) -> list[Architecture]:
    """The benchmark GPT of ``size``, and a conv net derived from it: ``dim / 4`` channels, images of ``seq_len / 4``
    pixels square, as many blocks and a batch as large, ``vocab_size`` classes.

    Args:
        size: The GPT's shape.
        device: Where to run.
    """
    inputs, targets = make_batch(size, device)
    gpt = Architecture(
        "GPT", "Block", lambda layers: build_model(size, Variant("none"), device, layers=layers), inputs, targets
    )
    channels, side = max(4, size.dim // 4), max(4, size.seq_len // 4)
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(size.batch_size, 3, side, side, generator=generator).to(device)
    labels = torch.randint(size.vocab_size, (size.batch_size,), generator=generator).to(device)

    def conv_net(layers: int | None) -> nn.Module:
        torch.manual_seed(0)
        return ConvNet(channels, size.vocab_size, size.layers if layers is None else layers).to(device)

    return [gpt, Architecture(f"conv net ({channels} channels, {side}x{side})", "ConvBlock", conv_net, images, labels)]


def run(size: ModelSize, device: torch.device, rounds: int, warmup: int) -> dict[str, Any]:
    """Plan each budget at each granularity on each architecture, measure what the planned model keeps, and time its
    step and the planning step, interleaved per architecture.

    Args:
        size: The GPT's shape (the conv net's is derived from it, see :func:`architectures`).
        device: Where to run.
        rounds: Timed interleaved rounds.
        warmup: Untimed rounds first.

    Returns:
        ``{architecture: run_architecture's result}``.
    """
    return {arch.name: run_architecture(arch, rounds, warmup, device) for arch in architectures(size, device)}


def run_architecture(arch: Architecture, rounds: int, warmup: int, device: torch.device) -> dict[str, Any]:
    """The budgets of :data:`SHARES` at both granularities on one architecture.

    Returns:
        ``{"plain_bytes": measured, "candidates_plain_bytes": the plan's figures added up, "block": the first block's
        op calls by kind, "plans": {"<granularity> <share>": {"granularity", "share", "checkpointed", "budget_bytes",
        "planned_bytes", "measured_bytes", "recompute_share", "recomputed_flops_share", "kept_ops",
        "kept_output_bytes"}}, "variants": {name: step times}, "ratios": {"<plan>/every block", "op/module <share>",
        "planning, <granularity>/step"}}``.
    """
    without_blocks = _held(arch, arch.build(0))
    made: dict[str, CheckpointingPlan] = {}
    plans: dict[str, dict[str, Any]] = {}
    steps: dict[str, Callable[[], object]] = {}
    for granularity in GRANULARITIES:
        for share in SHARES:
            model = arch.build(None)
            name = f"{granularity} {share:.0%}"
            made[name] = plan = _plan(arch, model, share, granularity)
            model.zero_grad(set_to_none=True)
            plan.apply(model)
            plans[name] = _figures(plan, granularity, share, _held(arch, model) - without_blocks)
            steps[name] = _step(arch, model)
    measured = made[f"op {SHARES[0]:.0%}"]
    times = _timed(arch, steps, rounds, warmup, device)
    ratios = {f"{name}/{EVERY_BLOCK}": paired_ratios(times[name], times[EVERY_BLOCK]) for name in plans}
    for share in SHARES:
        ratios[f"op/module {share:.0%}"] = paired_ratios(times[f"op {share:.0%}"], times[f"module {share:.0%}"])
    for granularity in GRANULARITIES:
        ratios[f"planning, {granularity}/step"] = paired_ratios(times[f"planning, {granularity}"], times[EVERY_BLOCK])
    return {
        "plain_bytes": _held(arch, arch.build(None)) - without_blocks,
        "candidates_plain_bytes": sum(entry.plain_bytes for entry in measured.candidates),
        "block": _block_anatomy(measured),
        "plans": plans,
        "variants": {name: summary(samples) for name, samples in times.items()},
        "ratios": {name: summary(samples) for name, samples in ratios.items()},
    }


def _timed(
    arch: Architecture, steps: dict[str, Callable[[], object]], rounds: int, warmup: int, device: torch.device
) -> dict[str, list[float]]:
    """The planned models' steps, with every block checkpointed, without checkpointing, and the planning step at each
    granularity, interleaved (on the CPU in one thread's CPU time)."""
    every = arch.build(None)
    apply_activation_checkpointing(every, CheckpointingConfig(classes=[arch.block_class]))
    steps = {**steps, EVERY_BLOCK: _step(arch, every), PLAIN: _step(arch, arch.build(None))}
    for granularity in GRANULARITIES:
        steps[f"planning, {granularity}"] = _planning(arch, granularity)
    # One torch thread on the CPU, so that the work runs on this thread and its CPU time is what it costs.
    with torch_threads(1 if device.type == "cpu" else torch.get_num_threads()):
        clock = time.thread_time if device.type == "cpu" else time.perf_counter
        return interleaved_times(steps, rounds, warmup, device, clock=clock)


def _plan(arch: Architecture, model: nn.Module, share: float, granularity: str) -> CheckpointingPlan:
    config = CheckpointingConfig(
        classes=[arch.block_class],
        memory_budget=share,
        budget_granularity=granularity,  # type: ignore[arg-type]
        budget_cost="roofline",
    )
    return plan_activation_checkpointing(model, config, lambda: lm_loss(model, arch.inputs, arch.targets).backward())


def _figures(plan: CheckpointingPlan, granularity: str, share: float, measured: int) -> dict[str, Any]:
    return {
        "granularity": granularity,
        "share": share,
        "checkpointed": plan.checkpointed,
        "budget_bytes": plan.budget_bytes,
        "planned_bytes": plan.kept_bytes,
        "measured_bytes": measured,
        "recompute_share": plan.recompute_share,
        "recomputed_flops_share": plan.recomputed_flops_share,
        "kept_ops": sorted(op for calls in plan.saved_ops.values() for _, op in calls),
        "kept_output_bytes": _kept_output_bytes(plan),
    }


def _kept_output_bytes(plan: CheckpointingPlan) -> int:
    """The planned bytes of kept op calls that are their region's last (in these blocks, the one whose output the
    block returns): the next block keeps that output as its checkpointed input, or the final norm saves it, anyway,
    so the plan counts it twice and the model keeps that much less than planned."""
    total = 0
    for entry in plan.candidates:
        kept = {index for index, _ in plan.saved_ops.get(entry.name, ())}
        total += sum(op.bytes for op in entry.ops if op.index in kept and op.index == len(entry.ops) - 1)
    return total


def _block_anatomy(plan: CheckpointingPlan) -> dict[str, dict[str, int]]:
    """The first block's op calls that own an output, by kind: how many, their bytes and their recompute cost; and
    what every call of the block costs to recompute."""
    kinds = {kind: {"calls": 0, "bytes": 0, "cost": 0} for kind in ("arithmetic", "memory")}
    first = plan.candidates[0]
    for op in first.ops:
        if op.bytes:
            kind = kinds["arithmetic" if op.op.startswith(ARITHMETIC_OPS) else "memory"]
            kind["calls"] += 1
            kind["bytes"] += op.bytes
            kind["cost"] += op.cost
    kinds["block"] = {"calls": len(first.ops), "bytes": first.plain_bytes, "cost": first.cost}
    return kinds


def _held(arch: Architecture, model: nn.Module) -> int:
    """The bytes the loss's graph holds alive after one forward (``memory.py``'s 'held (live)')."""
    return forward_bytes(model, arch.inputs, arch.targets)[1]


def _step(arch: Architecture, model: nn.Module) -> Callable[[], None]:
    optimizer = make_optimizer(model)
    return lambda: train_step(model, optimizer, arch.inputs, arch.targets)


def _planning(arch: Architecture, granularity: str) -> Callable[[], None]:
    """One planning at :data:`PLANNED_SHARE` (its measured forward and backward, and the solve) on a model of its own,
    its gradients dropped after."""
    model = arch.build(None)

    def planning() -> None:
        _plan(arch, model, PLANNED_SHARE, granularity)
        model.zero_grad(set_to_none=True)

    return planning


def recompute_by_width(size: ModelSize, dims: Sequence[int], device: torch.device) -> dict[int, dict[str, float]]:
    """The cost model alone, on the GPT at each width of ``dims`` (the rest of ``size`` kept): from one measured step
    each, both granularities' recompute cost at :data:`PLANNED_SHARE`, and what a block's matmul outputs and its other
    op outputs cost to recompute per byte kept. No step is timed.

    Args:
        size: The GPT's shape; its ``dim`` is replaced.
        dims: The widths.
        device: Where to run.

    Returns:
        ``{dim: {"module", "op", "op/module", "matmul cost per byte", "other cost per byte"}}``.
    """
    found = {}
    for dim in dims:
        arch = architectures(dataclasses.replace(size, dim=dim), device)[0]
        plan = _plan(arch, arch.build(None), PLANNED_SHARE, "op")
        module = plan_from_figures(plan.candidates, dataclasses.replace(plan.config, budget_granularity="module"))
        kinds = _block_anatomy(plan)
        found[dim] = {
            "module": module.recompute_share,
            "op": plan.recompute_share,
            "op/module": plan.recompute_share / module.recompute_share,
            "matmul cost per byte": kinds["arithmetic"]["cost"] / kinds["arithmetic"]["bytes"],
            "other cost per byte": kinds["memory"]["cost"] / kinds["memory"]["bytes"],
        }
    return found


def main(argv: Sequence[str] | None = None) -> int:
    """Print :func:`recompute_by_width` as a markdown table.

    Args:
        argv: Command-line arguments without the program name; ``None`` reads ``sys.argv``.

    Returns:
        ``0``.
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.budget", description=recompute_by_width.__doc__)
    parser.add_argument("--widths", default="128,256,512,1024", help="The GPT's widths (default: 128,256,512,1024).")
    args = parser.parse_args(argv)
    size = ModelSize(layers=4, dim=128, heads=4, seq_len=64, batch_size=8, vocab_size=256)
    found = recompute_by_width(size, [int(dim) for dim in args.widths.split(",")], torch.device("cpu"))
    print("| width | module | op | op / module | matmul outputs, cost per byte | other outputs, cost per byte |")
    print("|---|---|---|---|---|---|")
    for dim, row in found.items():
        print(
            f"| {dim} | {row['module']:.1%} | {row['op']:.1%} | {row['op/module']:.3f}"
            f" | {row['matmul cost per byte']:.2f} | {row['other cost per byte']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
