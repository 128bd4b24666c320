"""Step time without checkpointing, with hand-written checkpointing and with this package's, side by side."""

from functools import partial
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
    train_step,
)
from lightning_ckpt_determinism import CheckpointingConfig

NONE = "none"
HAND = "hand-written"
PACKAGE = "package"
PACKAGE_HOST_RNG = "package +host_rng"

VARIANTS = (
    Variant(NONE),
    Variant(HAND, hand=True),
    Variant(PACKAGE, config=CheckpointingConfig(classes=["Block"])),
    Variant(
        PACKAGE_HOST_RNG, config=CheckpointingConfig(classes=["Block"], preserve_host_rng=True, protect_buffers=True)
    ),
)
"""What is timed. ``package`` is the default config (``protect_buffers=True``, ``preserve_host_rng=False``). The
example GPT's blocks hold no buffers, and the package skips buffer protection for a region without buffers, so
``package`` adds nothing to torch's checkpoint but the wrapper itself, and ``package +host_rng`` only the capture
and replay of Python's and NumPy's RNG."""


def run(size: ModelSize, device: torch.device, rounds: int, warmup: int) -> dict[str, Any]:
    """Time one training step (forward, backward, AdamW) of every variant, interleaved.

    Each variant is its own model with the same initial weights, trained on the same batch by its own optimizer.

    Args:
        size: The model's shape.
        device: Where to run.
        rounds: Timed steps per variant.
        warmup: Untimed rounds first.

    Returns:
        ``{"variants": {name: summary of seconds}, "ratios": {"a/b": summary of per-round ratios}}``.
    """
    inputs, targets = make_batch(size, device)
    steps = {}
    for variant in VARIANTS:
        model = build_model(size, variant, device)
        optimizer = make_optimizer(model)
        steps[variant.name] = partial(train_step, model, optimizer, inputs, targets)
    times = interleaved_times(steps, rounds, warmup, device)
    pairs = [(name, NONE) for name in (HAND, PACKAGE, PACKAGE_HOST_RNG)]
    pairs += [(name, HAND) for name in (PACKAGE, PACKAGE_HOST_RNG)]
    return {
        "variants": {name: summary(samples) for name, samples in times.items()},
        "ratios": {f"{a}/{b}": summary(paired_ratios(times[a], times[b])) for a, b in pairs},
    }
