"""What the benchmarks share: the model size, the GPT variants, one training step and timing statistics."""

import gc
import random
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from examples.gpt import GPT
from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing
from lightning_ckpt_determinism.checkpointing.wrapper import checkpointed_modules


@dataclass(frozen=True)
class ModelSize:
    """The GPT's shape and the batch it trains on.

    Args:
        layers: Transformer blocks.
        dim: Width of the residual stream (``h`` in Korthikanti et al.).
        heads: Attention heads (``a``).
        seq_len: Tokens per sequence (``s``).
        batch_size: Sequences per batch (``b``).
        vocab_size: Distinct tokens.
        dropout: Dropout probability everywhere in the model.
    """

    layers: int
    dim: int
    heads: int
    seq_len: int
    batch_size: int
    vocab_size: int
    dropout: float = 0.1


@dataclass(frozen=True)
class Variant:
    """One way to run the blocks: plainly, checkpointed by hand, or by this package with ``config``.

    Args:
        name: The name the table and the JSON use.
        hand: Checkpoint every block with a hand-written loop (:class:`HandCheckpointedGPT`).
        config: Apply this package's checkpointing with this config.
    """

    name: str
    hand: bool = False
    config: CheckpointingConfig | None = None


class HandCheckpointedGPT(GPT):
    """:class:`examples.gpt.GPT` whose forward checkpoints each block by hand, as one writes it without the package."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(self.ln_f(x))


def build_model(size: ModelSize, variant: Variant, device: torch.device, layers: int | None = None) -> GPT:
    """A GPT of ``size`` on ``device`` set up as ``variant`` says, with the same weights for every variant.

    Args:
        size: The model's shape.
        variant: How to checkpoint its blocks.
        device: Where the model lives.
        layers: Override ``size.layers`` (``0`` gives the model without blocks that memory figures subtract).
    """
    torch.manual_seed(0)
    model_class = HandCheckpointedGPT if variant.hand else GPT
    depth = size.layers if layers is None else layers
    model = model_class(size.vocab_size, size.seq_len, size.dim, size.heads, depth, size.dropout).to(device)
    if variant.config is not None:
        apply_activation_checkpointing(model, variant.config)
    return model


def make_batch(size: ModelSize, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One seeded batch of input tokens and next-token targets."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(size.vocab_size, (size.batch_size, size.seq_len + 1), generator=generator)
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)


def lm_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``model`` on one batch."""
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer every timed step uses."""
    return torch.optim.AdamW(model.parameters(), lr=3e-4)


def train_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, targets: torch.Tensor
) -> None:
    """Forward, backward and optimizer step."""
    lm_loss(model, inputs, targets).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a timer reads the time the work took."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


Named = TypeVar("Named")


def round_orders(names: Sequence[Named], rounds: int) -> Iterator[list[Named]]:
    """The order of each of ``rounds`` rounds in which every one of ``names`` runs once: a fresh shuffle each round,
    seeded, so that every variant runs right after every other one in some round (a rotation would keep each right
    after the same one, whose caches, allocator state and model it inherits) and every process of a distributed
    benchmark takes the same orders.

    Args:
        names: The variants.
        rounds: How many orders.

    Example::

        >>> orders = list(round_orders("abc", 20))
        >>> all(sorted(order) == ["a", "b", "c"] for order in orders), orders == list(round_orders("abc", 20))
        (True, True)
    """
    order, shuffled = random.Random(0), list(names)
    for _ in range(rounds):
        order.shuffle(shuffled)
        yield list(shuffled)


def interleaved_times(
    functions: Mapping[str, Callable[[], object]],
    rounds: int,
    warmup: int,
    device: torch.device,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Time each function once per round, in a fresh order every round (:func:`round_orders`).

    Interleaving makes slow drift of a shared machine hit every variant alike. Round ``r`` of each list is measured
    within seconds of round ``r`` of the others, so per-round ratios pair them.

    Args:
        functions: What to time, by name.
        rounds: Timed rounds.
        warmup: Untimed rounds first (allocator, kernels, optimizer state).
        device: Synchronized before and after each call.
        clock: What measures a call: wall time by default; ``time.thread_time`` counts only this thread's CPU time,
            which other processes on the machine do not inflate (for work that runs on this thread alone).

    Returns:
        Seconds per call, by name, one entry per timed round.
    """
    times: dict[str, list[float]] = {name: [] for name in functions}
    for index, names in enumerate(round_orders(list(functions), warmup + rounds)):
        gc.collect(1)  # the young generations, where a step's garbage cycles are, outside the timed calls
        for name in names:
            synchronize(device)
            start = clock()
            functions[name]()
            synchronize(device)
            elapsed = clock() - start
            if index >= warmup:
                times[name].append(elapsed)
    return times


class Regions:
    """A model's region wrappers, found once, and a block that plugs one saved-tensor observer into them: the monitor
    registers its sentinel once per fit, so an interleaved benchmark that switches observers between variants must
    not walk the model at every step either.

    Args:
        model: The model, its regions checkpointed.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._wrappers = [sub.__dict__["forward"] for sub in checkpointed_modules(model).values()]

    @contextmanager
    def observed_by(self, observer: Any) -> Iterator[None]:
        """Plug ``observer`` into every region inside this block."""
        for wrapper in self._wrappers:
            wrapper.saved_observer = observer
        try:
            yield
        finally:
            for wrapper in self._wrappers:
                wrapper.saved_observer = None


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run with ``count`` torch threads, then put the previous number back."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def summary(samples: Sequence[float]) -> dict[str, float]:
    """Median, quartiles, extremes and count of ``samples``."""
    if len(samples) == 1:
        q1 = median = q3 = samples[0]
    else:
        q1, median, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return {"median": median, "q1": q1, "q3": q3, "min": min(samples), "max": max(samples), "n": len(samples)}


def paired_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """Round-by-round ratios of two interleaved series."""
    return [a / b for a, b in zip(numerator, denominator, strict=True)]
