"""A memory budget on the benchmark GPT: for budgets of 25, 50, 75 and 100 % of what its blocks keep plainly, the
plan, the activation bytes the planned model keeps (measured as ``memory.py`` measures them, independently of the
plan's own figures) against the budget, and the step time against checkpointing every block, interleaved."""

from typing import Any

import torch

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
    train_step,
)
from benchmarks.memory import forward_bytes
from lightning_ckpt_determinism import CheckpointingConfig, plan_activation_checkpointing

SHARES = (0.25, 0.5, 0.75, 1.0)
EVERY_BLOCK = "every block"


def run(size: ModelSize, device: torch.device, rounds: int, warmup: int) -> dict[str, Any]:
    """Plan each budget, measure what the planned model keeps, and time its step against every block checkpointed.

    Args:
        size: The model's shape.
        device: Where to run.
        rounds: Timed interleaved rounds.
        warmup: Untimed rounds first.

    Returns:
        ``{"budgets": {share: {"checkpointed", "budget_bytes", "planned_bytes", "measured_bytes",
        "recomputed_flops_share"}}, "plain_bytes", "variants": {name: times summary}, "ratios": {name: summary of
        step time over every block checkpointed}}``.
    """
    inputs, targets = make_batch(size, device)
    without_blocks = forward_bytes(build_model(size, Variant("none"), device, layers=0), inputs, targets)[1]
    plain = forward_bytes(build_model(size, Variant("none"), device), inputs, targets)[1] - without_blocks
    budgets: dict[str, dict[str, Any]] = {}
    steps = {}
    for share in SHARES:
        model = build_model(size, Variant("none"), device)
        config = CheckpointingConfig(classes=["Block"], memory_budget=share)
        plan = plan_activation_checkpointing(
            model, config, lambda model=model: lm_loss(model, inputs, targets).backward()
        )
        model.zero_grad(set_to_none=True)
        plan.apply(model)
        name = f"{share:.0%}"
        budgets[name] = {
            "checkpointed": plan.checkpointed,
            "budget_bytes": plan.budget_bytes,
            "planned_bytes": plan.kept_bytes,
            "measured_bytes": forward_bytes(model, inputs, targets)[1] - without_blocks,
            "recomputed_flops_share": plan.recomputed_flops_share,
        }
        steps[name] = _step(model, inputs, targets)
    every = build_model(size, Variant(EVERY_BLOCK, config=CheckpointingConfig(classes=["Block"])), device)
    steps[EVERY_BLOCK] = _step(every, inputs, targets)
    times = interleaved_times(steps, rounds, warmup, device)
    return {
        "plain_bytes": plain,
        "budgets": budgets,
        "variants": {name: summary(samples) for name, samples in times.items()},
        "ratios": {name: summary(paired_ratios(times[name], times[EVERY_BLOCK])) for name in budgets},
    }


def _step(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> Any:
    optimizer = make_optimizer(model)
    return lambda: train_step(model, optimizer, inputs, targets)
