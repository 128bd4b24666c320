"""Tiny seeded models shared by the tests, each with one way recomputation can differ from the forward."""

import contextlib
import gc
import itertools
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import traceback
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar, NoReturn

import lightning.pytorch as pl
import numpy as np
import torch
import torchmetrics
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.flop_counter import FlopCounterMode

from examples.broken import BrokenModule, unordered_row_sum
from examples.gpt import shard_blocks_then_model
from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing, checkpointed_modules

DIM = 8
REPO = Path(__file__).resolve().parents[1]


def twins(build: Callable[[], nn.Module], names: list[str]) -> tuple[nn.Module, nn.Module]:
    """``build()`` twice with the same weights: a plain module, and one whose modules ``names`` are checkpointed."""
    torch.manual_seed(0)
    plain, model = build(), build()
    model.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(model, CheckpointingConfig(names=names))
    return plain, model


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child Python process: the repository first on ``PYTHONPATH``, ahead of what
    the path already holds (packages installed outside site-packages), and ``extra``."""
    path = os.pathsep.join(part for part in (str(REPO), os.environ.get("PYTHONPATH", "")) if part)
    return {**os.environ, "PYTHONPATH": path, **extra}


class DropoutBlock(nn.Module):
    """Linear, ReLU, dropout, residual: recomputation differs unless torch's RNG is replayed."""

    def __init__(self, dim: int = DIM, p: float = 0.5) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(torch.relu(self.linear(x)))


class BatchNormBlock(nn.Module):
    """Linear then BatchNorm: recomputation updates the running statistics again unless buffers are protected."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.norm = nn.BatchNorm1d(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(torch.relu(self.linear(x)))


class NumpyNoiseBlock(nn.Module):
    """Adds noise drawn from NumPy's global RNG: recomputation differs unless host RNG is replayed."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.from_numpy(np.random.standard_normal(x.shape).astype(np.float32))
        return x + torch.tanh(self.linear(x)) * (1 + noise)


class NumpyLastBlock(nn.Module):
    """Scales by a fresh NumPy draw at its last op: the product saves the draw as its input, and torch's early stop
    ends the recomputation there, so only a saved tensor differs, no recomputed op."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) * torch.from_numpy(np.random.rand(x.shape[-1]).astype(np.float32))


class PythonRandomBlock(nn.Module):
    """Scales by a factor drawn from Python's ``random``: recomputation differs unless host RNG is replayed."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Inside tanh, so the drawn factor reaches a tensor saved for backward (tanh's output).
        return x + torch.tanh(self.linear(x) * random.uniform(0.5, 1.5))


class CounterBlock(nn.Module):
    """Reads a count of its calls it keeps in a list, which recomputation does not replay (it replays scalar
    attributes only): recomputation sees another value."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.calls: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(1)
        return x + torch.tanh(self.linear(x)) * len(self.calls)


class RoutingBlock(nn.Module):
    """Routes a number of rows that depends on a count of calls kept in a list (not replayed): a saved shape changes
    on recomputation."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.calls: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(1)
        routed = 1 + len(self.calls) % (x.shape[0] - 1)
        out = x.clone()
        out[:routed] = x[:routed] + torch.tanh(self.linear(x[:routed]))
        return out


class RampBlock(nn.Module):
    """Linear and tanh over a ramp the forward makes without a dtype: it takes torch's default dtype."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x) + torch.linspace(0, 1, x.shape[-1]))


class PlainBlock(nn.Module):
    """Linear and tanh with a residual: nothing in it can differ on recomputation."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class NoiseOption(nn.Module):
    """A block that can be made defective: ``noise = True`` adds NumPy noise to what it returns."""

    noise = False

    def noisy(self, out: torch.Tensor) -> torch.Tensor:
        if not self.noise:
            return out
        return out * (1 + torch.from_numpy(np.random.standard_normal(out.shape).astype(np.float32)))


class SyncNormBlock(NoiseOption):
    """Normalises with the batch statistics of every rank, all-reduced in forward (a hand-written SyncBatchNorm):
    a collective inside the region, recomputed in backward."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.nn.functional import all_reduce

        hidden = self.linear(x)
        size = torch.distributed.get_world_size()
        mean = all_reduce(hidden.mean(dim=0)) / size
        var = all_reduce((hidden - mean).square().mean(dim=0)) / size
        return x + self.noisy(torch.tanh((hidden - mean) / (var + 1e-5).sqrt()))


class FunctionalSyncNormBlock(SyncNormBlock):
    """:class:`SyncNormBlock` with torch's functional collectives, whose results are waited for where they are used."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed import _functional_collectives as functional

        group = torch.distributed.group.WORLD
        hidden = self.linear(x)
        size = torch.distributed.get_world_size()
        mean = functional.all_reduce(hidden.mean(dim=0), "sum", group) / size
        var = functional.all_reduce((hidden - mean).square().mean(dim=0), "sum", group) / size
        return x + self.noisy(torch.tanh((hidden - mean) / (var + 1e-5).sqrt()))


class AllToAllBlock(NoiseOption):
    """Exchanges rows between ranks with an all-to-all, as expert parallelism sends tokens to their experts."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.nn.functional import all_to_all_single

        exchanged = all_to_all_single(torch.empty_like(x), self.linear(x))
        return x + self.noisy(torch.tanh(exchanged))


class MLPBlock(NoiseOption):
    """An up and a down projection, as tensor parallelism shards them (``up`` by columns, ``down`` by rows)."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.noisy(torch.tanh(self.up(x))))


class SquaredMLPBlock(MLPBlock):
    """Squares its down projection: under tensor parallelism it saves the all-reduce's result (``RowwiseParallel``),
    a collective's output not waited for yet when it is saved."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.down(torch.tanh(self.up(x)))
        return x + hidden * hidden


class TrailingAllReduceBlock(nn.Module):
    """Ends in an all-reduce after the last tensor it saves (a synchronised statistic); ``detour`` adds a sine before
    it, another code path."""

    detour = False

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.nn.functional import all_reduce

        hidden = self.linear(x)
        if self.detour:
            hidden = torch.sin(hidden)
        return x + all_reduce(torch.tanh(hidden)) / torch.distributed.get_world_size()


def parallelize_blocks(model: nn.Module, mesh: Any) -> None:
    """Shard every :class:`MLPBlock` of ``model`` over ``mesh`` with tensor parallelism (``parallelize_module``)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model.modules():
        if isinstance(block, MLPBlock):
            parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


class RecomputeOnlyBlock(nn.Module):
    """Exact in its forward; its recomputation (every second call) changes ``tanh``'s input, which ``tanh`` saves.

    Args:
        change: ``"rows"`` moves rows to other places (the same values), ``"element"`` changes one element by 1.0.
    """

    def __init__(self, dim: int = 32, change: str = "rows") -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, dim)
        self.out = nn.Linear(dim, DIM)
        self.change = change
        self.calls: list[int] = []  # a list: recomputation replays scalar attributes only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(1)
        hidden = self.linear(x)
        if len(self.calls) % 2 == 0:
            if self.change == "rows":
                hidden = hidden.roll(1, dims=0)
            else:
                bump = torch.zeros_like(hidden)
                bump[0, 5] = 1.0
                hidden = hidden + bump
        return x + self.out(torch.tanh(hidden))


class KeywordTupleBlock(nn.Module):
    """Takes a keyword tensor and returns ``(out, {"aux": ..., "tag": ...})``."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> tuple[torch.Tensor, dict[str, object]]:
        hidden = torch.tanh(self.linear(x)) * scale
        return x + hidden, {"aux": hidden.square().mean(), "tag": "keyword"}


class ArmedBlock(PlainBlock):
    """Exact, except in the recomputation of one step's forward (``armed``, counted from 0), which scales ``tanh``'s
    input: a defect that shows at one step only. It counts its calls (a forward, then its recomputation) in a list,
    which recomputation does not replay."""

    def __init__(self, dim: int = DIM, armed: int = 5) -> None:
        super().__init__(dim)
        self.armed = armed
        self.calls: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(1)
        scale = 1.5 if len(self.calls) == 2 * self.armed + 2 else 1.0
        return x + torch.tanh(self.linear(x) * scale)


class AttentionPoolBlock(nn.Module):
    """Pools its features as a sequence of scalars with attention weights: ``bmm`` saves the (B, 1, T) transpose of
    the (B, T, 1) weights, contiguous with stride 1 on its dimension of size one."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.score = nn.Linear(1, 1)
        self.proj = nn.Linear(1, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sequence = x.unsqueeze(-1)
        weights = torch.softmax(self.score(sequence), dim=1)
        return x + torch.bmm(weights.transpose(1, 2), self.proj(sequence)).squeeze(1)


class SavesItsBuffer(torch.autograd.Function):
    """Saves a buffer for backward and increments it there (``TestAutograd``'s saved-object identity)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(counter)
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (counter,) = ctx.saved_tensors
        counter.add_(1)
        return grad * 2, None


class BufferCounter(nn.Module):
    """A linear layer through :class:`SavesItsBuffer`, which saves the module's ``counter`` buffer and increments it
    in backward: recomputation must hand it the buffer itself, not a copy."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.register_buffer("counter", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return SavesItsBuffer.apply(self.linear(x), self.counter)


class PartsBlock(nn.Module):
    """Its parts in order (a linear layer and an identity), then tanh: a module list people add parts to, or swap parts
    of, after wrapping."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.parts = nn.ModuleList([nn.Linear(dim, dim), nn.Identity()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for part in self.parts:
            x = part(x)
        return torch.tanh(x)


class _GradEnabledOps(TorchDispatchMode):
    """Records the op calls dispatched with grad enabled (``detach`` left out): in a forward, all of them; in a
    backward, the recomputed ones (and torch's own few around them)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if torch.is_grad_enabled() and func is not torch.ops.aten.detach.default:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def recomputation(
    block: nn.Module, x: torch.Tensor, checkpointed: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> tuple[int, int]:
    """What ``checkpointed`` (``block`` checkpointed; torch's own non-reentrant checkpoint of it by default) runs again
    in backward on ``x``: how many of ``block``'s forward's first op calls (``detach`` left out: the longest start of
    the forward's calls that the backward runs with grad enabled, last), and their FLOPs (the backward's, counted by
    ``FlopCounterMode``, with checkpointing less without). torch's early stop ends a recomputation once it has saved
    the forward's last saved tensor again: the op calls after it do not run again."""
    inputs = x.detach().requires_grad_()
    forward = _GradEnabledOps()
    with forward:
        loss = block(inputs).sum()
    flops = []
    for run in (block, checkpointed or (lambda value: checkpoint(block, value, use_reentrant=False))):
        loss = run(inputs).sum()
        counter, backward = FlopCounterMode(display=False), _GradEnabledOps()
        with counter, backward:
            loss.backward()
        flops.append(counter.get_total_flops())
    block.zero_grad(set_to_none=True)
    ops = forward.ops[:-1]  # the forward's calls, its `sum` left out
    rerun = max(count for count in range(len(ops) + 1) if backward.ops[len(backward.ops) - count :] == ops[:count])
    return rerun, flops[1] - flops[0]


class Stack(nn.Module):
    """An input projection, the given blocks in order, and an output head."""

    def __init__(self, blocks: list[nn.Module], dim: int = DIM) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_stack(block: type[nn.Module] = DropoutBlock, n: int = 3, seed: int = 0) -> Stack:
    """A :class:`Stack` of ``n`` blocks of one class, with weights from ``seed``."""
    torch.manual_seed(seed)
    return Stack([block() for _ in range(n)])


def batch(seed: int = 1, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and regression targets from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, DIM, generator=generator), torch.randn(size, 1, generator=generator)


class StackModule(pl.LightningModule):
    """A LightningModule regressing with a :class:`Stack`; logs ``train/loss``.

    Args:
        block: Block class name in this module.
        n: Number of blocks.
        lr: SGD learning rate.
        momentum: SGD momentum (optimizer state to compare).
    """

    def __init__(self, block: str = "DropoutBlock", n: int = 3, lr: float = 0.1, momentum: float = 0.9) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = make_stack(globals()[block], n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=self.hparams["momentum"])

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(2)
        x = torch.randn(64, DIM, generator=generator)
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)


def failing_from(call: int, real: Callable[..., Any], when: Callable[[], bool] = lambda: True) -> Callable[..., Any]:
    """``real``, raising ``RuntimeError("injected")`` from its ``call``-th call on; only calls made while ``when()``
    holds (on one rank, say) count and fail."""
    calls = itertools.count(1)

    def fails(*args: Any, **kwargs: Any) -> Any:
        if when() and next(calls) >= call:
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    return fails


def trained_state(module: nn.Module, trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    """Copies of what a fit ends with: every tensor of ``module``'s state dict and of each optimizer's state."""
    found = {key: value.detach().clone() for key, value in module.state_dict().items()}
    for index, optimizer in enumerate(trainer.optimizers):
        for param, state in optimizer.state_dict()["state"].items():
            found.update(
                {f"optimizer {index}: {param}.{key}": v.clone() for key, v in state.items() if torch.is_tensor(v)}
            )
    return found


def trainer_kwargs(tmp_path: object, **overrides: object) -> dict[str, object]:
    """A minimal CPU Trainer: a few steps, no progress bar, no summary, no checkpoints, logs under ``tmp_path``."""
    kwargs: dict[str, object] = {
        "max_steps": 4,
        "accelerator": "cpu",
        "devices": 1,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "logger": False,
        "default_root_dir": str(tmp_path),
    }
    kwargs.update(overrides)
    return kwargs


class KeywordBlock(nn.Module):
    """Takes a keyword tensor and a keyword float: both must reach the forward when it is checkpointed."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor, shift: float = 0.0) -> torch.Tensor:
        return x + torch.tanh(self.linear(x)) * scale + shift


class TupleOutputBlock(nn.Module):
    """Returns a tuple mixing tensors and non-tensors: ``(out, aux, tag, count)``."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str, int]:
        hidden = self.linear(x)
        return torch.tanh(hidden), hidden.square().mean(), "tuple", 3


class DictOutputBlock(nn.Module):
    """Returns a dict mixing tensors and non-tensors: ``{"out", "aux", "tag"}``."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        hidden = self.linear(x)
        return {"out": torch.sigmoid(hidden), "aux": hidden.abs().sum(), "tag": "dict"}


class CheckpointedModulesRecorder(pl.Callback):
    """Records the names of the LightningModule's checkpointed modules at every training step's backward (what that
    step's forward ran checkpointed, after the strategy's batch-start hook) and at every checkpoint save."""

    def __init__(self) -> None:
        self.seen: list[list[str]] = []
        self.saved: list[list[str]] = []

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self.seen.append(list(checkpointed_modules(pl_module)))

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        self.saved.append(list(checkpointed_modules(pl_module)))


class ScaledLinear(nn.Linear):
    """A ``Linear`` subclass, to tell matching a class by its own name from matching it by a base's name."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


def step_gradients(model: nn.Module, seed: int = 7) -> dict[str, torch.Tensor]:
    """Gradients by parameter name after one MSE forward and backward on :func:`batch`, torch seeded with ``seed``."""
    x, y = batch()
    torch.manual_seed(seed)
    F.mse_loss(model(x), y).backward()
    return {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}


class CounterScaleBlock(nn.Module):
    """Scales its pre-activation by a count of calls it keeps in a list (not replayed): recomputation sees another
    scale."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.calls: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(1)
        return x + torch.tanh(self.linear(x) * (1.0 + 0.1 * len(self.calls)))


class RowSumBlock(nn.Module):
    """Adds the batch mean of its input, by :func:`unordered_row_sum` or, with ``deterministic``, ``torch.sum``."""

    def __init__(self, dim: int = DIM, deterministic: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.deterministic = deterministic

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = x.sum(dim=0) if self.deterministic else unordered_row_sum(x)
        return x + torch.tanh(self.linear(x) + total / x.shape[0])


class FailingRecomputeBlock(PlainBlock):
    """Raises on every second call, counted in a list (not replayed): checkpointed, its forward runs and its
    recomputation fails (a check puts the list back between its passes, so each pass is a first call)."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__(dim)
        self.calls: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(1)
        if len(self.calls) % 2 == 0:
            raise RuntimeError(f"call {len(self.calls)} of FailingRecomputeBlock")
        return super().forward(x)


def stack_with(block: Callable[[], nn.Module], position: int = 1, n: int = 3, seed: int = 0) -> Stack:
    """A :class:`Stack` of ``n`` plain blocks, the one at ``position`` made by ``block``; weights from ``seed``."""
    torch.manual_seed(seed)
    return Stack([block() if index == position else PlainBlock() for index in range(n)])


class FlagBlock(nn.Module):
    """Flips a flag it keeps in a dict on every call and takes ``tanh`` or ``sigmoid`` by it: recomputation, which
    replays scalar attributes but not what a dict holds, runs another op."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.state = {"flag": False}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.state["flag"] = not self.state["flag"]
        hidden = self.linear(x)
        return x + (torch.tanh(hidden) if self.state["flag"] else torch.sigmoid(hidden))


class InPlaceReluBlock(nn.Module):
    """Starts with an in-place ReLU on its input: fine without checkpointing, but the input checkpointing saved for
    recomputation has changed by then, so recomputation fails with torch's version-counter error."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(self.act(x)))


class GradientPenaltyModule(StackModule):
    """A :class:`StackModule` whose loss adds a gradient penalty on the input (as WGAN-GP and R1 do): every
    checkpointed region is recomputed twice per step, by the penalty's ``autograd.grad`` and by the backward."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        x = x.clone().requires_grad_(True)
        out = self.model(x)
        (input_grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        loss = F.mse_loss(out, y) + 0.1 * input_grad.square().sum(dim=1).mean()
        self.log("train/loss", loss)
        return loss


class OddStepsSkippedModule(BrokenModule):
    """A :class:`~examples.broken.BrokenModule` whose ``training_step`` returns no loss on odd batches (skips them)."""

    # Lightning's `training_step` may return None; BrokenModule's narrower annotation never does.
    def training_step(  # type: ignore[override]
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor | None:
        return None if batch_idx % 2 else super().training_step(batch, batch_idx)


class BatchOnlyBrokenModule(BrokenModule):
    """A :class:`~examples.broken.BrokenModule` whose ``training_step`` takes no ``batch_idx``, as Lightning allows."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        return super().training_step(batch, 0)


class MaskingModule(StackModule):
    """Masks part of its batch in place in ``training_step``, as masked-language-model code does."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        x[torch.rand(x.shape) < 0.25] = 0.0
        return super().training_step((x, y), batch_idx)


class WarmupModule(StackModule):
    """Scales its loss by a warmup factor from a step counter it increments in ``training_step``."""

    def __init__(self, block: str = "DropoutBlock") -> None:
        super().__init__(block=block)
        self.steps_seen = 0

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.steps_seen += 1
        return super().training_step(batch, batch_idx) * min(1.0, self.steps_seen / 3)


class CollectingModule(StackModule):
    """Collects every step's loss in a list, as code that averages them at epoch end does."""

    def __init__(self, block: str = "DropoutBlock") -> None:
        super().__init__(block=block)
        self.collected: list[torch.Tensor] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.collected.append(loss.detach())
        return loss


class HeldNoiseModule(StackModule):
    """Augments its batch with noise from generators it holds (torch's, NumPy's, Python's) and centres it by a running
    mean kept in a plain tensor attribute, updated in place: state outside the checkpointed regions, which a check's
    rerun reads again."""

    def __init__(self, block: str = "DropoutBlock") -> None:
        super().__init__(block=block)
        self.torch_noise = torch.Generator().manual_seed(1)
        self.numpy_noise = np.random.default_rng(2)
        self.python_noise = random.Random(3)
        self.running_mean = torch.zeros(DIM)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.running_mean.mul_(0.9).add_(0.1 * x.mean(dim=0))
        noise = torch.rand(x.shape, generator=self.torch_noise)
        scale = float(self.numpy_noise.uniform(0.9, 1.1)) * self.python_noise.uniform(0.9, 1.1)
        return super().training_step(((x - self.running_mean) * (1 + 0.1 * noise) * scale, y), batch_idx)


class OwnBackwardModule(StackModule):
    """Overrides ``backward`` (the loss doubled, as a loss scale of the user's would) and counts its calls and those of
    its ``on_before_backward`` hook."""

    def __init__(self, block: str = "DropoutBlock") -> None:
        super().__init__(block=block)
        self.backward_calls = 0
        self.hooks_seen = 0

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self.hooks_seen += 1

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.backward_calls += 1
        (loss * 2.0).backward(*args, **kwargs)


class BatchOnlyModule(StackModule):
    """``training_step(self, batch)`` without ``batch_idx``, which Lightning allows."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        return super().training_step(batch, 0)


class ReentrantHeadModule(StackModule):
    """Runs the model's head under reentrant checkpointing of its own, beside the package's checkpointed blocks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        model = self.model
        x = model.inp(x)
        for block in model.blocks:
            x = block(x)
        return torch.utils.checkpoint.checkpoint(model.head, x, use_reentrant=True)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train/loss", loss)
        return loss


class ShardedStackModule(StackModule):
    """A :class:`StackModule` that shards each block and then its model with FSDP2 under ``ModelParallelStrategy``."""

    def configure_model(self) -> None:
        shard_blocks_then_model(self)


class InnerUnitsStackModule(StackModule):
    """A :class:`StackModule` whose checkpointed blocks hold FSDP2 units of their own: each linear layer inside a block
    is sharded, then the model (FSDP2 gathers and frees their parameters inside the block's forward, and gathers them
    again for its recomputation)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            for layer in block.modules():
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class TensorParallelStackModule(StackModule):
    """A :class:`StackModule` of :class:`MLPBlock` sharded with tensor parallelism under ``ModelParallelStrategy``."""

    def __init__(self, block: str = "MLPBlock", n: int = 3, lr: float = 0.1, momentum: float = 0.9) -> None:
        super().__init__(block=block, n=n, lr=lr, momentum=momentum)

    def configure_model(self) -> None:
        parallelize_blocks(self.model, self.device_mesh["tensor_parallel"])


class ManualModule(StackModule):
    """Manual optimization: ``training_step`` zeroes the gradients, calls ``manual_backward`` and steps."""

    def __init__(self, block: str = "DropoutBlock") -> None:
        super().__init__(block=block)
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        optimizer.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(loss)
        optimizer.step()  # type: ignore[union-attr]
        return loss


def manual_loss(module: pl.LightningModule, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
    """The loss :class:`ManualModule` backpropagates, as the monitor's ``loss_fn``."""
    x, y = batch
    return F.mse_loss(module(x), y)


class LiveStorages(TorchDispatchMode):
    """Keeps a weak reference to the storage of every tensor an op creates, to sum those still alive later.

    Unlike a saved-tensors hook this also sees what selective checkpointing keeps in its own cache.
    """

    def __init__(self) -> None:
        super().__init__()
        self._storages: list[weakref.ref[torch.UntypedStorage]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self._storages += [weakref.ref(t.untyped_storage()) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out

    def live_bytes(self) -> int:
        gc.collect()
        live = [ref() for ref in self._storages]
        return sum({id(storage): storage.nbytes() for storage in live if storage is not None}.values())


class LazyBlock(nn.Module):
    """A lazy linear layer, then tanh: its parameters get their values at its first forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.LazyLinear(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inp(x))


class PerChannelQuantBlock(nn.Module):
    """Quantization-aware training: a per-channel fake quantizer between two linear layers (the second's gradient
    reads the quantized values). Its observer's statistics are empty until its first update sizes them."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.quant = torch.ao.quantization.FakeQuantize(
            observer=torch.ao.quantization.MovingAveragePerChannelMinMaxObserver,
            quant_min=0,
            quant_max=255,
            ch_axis=1,
            dtype=torch.quint8,
            qscheme=torch.per_channel_affine,
        )
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(self.quant(torch.tanh(self.linear(x))))


class LazyNormBlock(nn.Module):
    """A linear layer, then a lazy batch norm without affine parameters: only its statistics, buffers, get their
    values at its first forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.norm = nn.LazyBatchNorm1d(affine=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(self.inp(x)))


class InferenceCacheBlock(nn.Module):
    """Adds a positional table built at its first forward and again for longer inputs (a cache); ``trainer.validate``
    run first (under ``torch.inference_mode()``) makes it an inference tensor, which ``+`` reads without saving."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.table: torch.Tensor | None
        self.register_buffer("table", None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is None or self.table.shape[0] < x.shape[-1]:
            self.table = torch.arange(x.shape[-1], dtype=x.dtype, device=x.device) / x.shape[-1]
        return torch.tanh(self.linear(x)) + self.table[: x.shape[-1]]


class WrittenAfterItsForward(nn.Module):
    """A checkpointed ``block`` (a linear layer, a batch norm, and a shift it reads from a buffer) whose buffers code
    outside it writes between its forward and its recomputation, as ``writer`` says:

    - ``"caller"``: this module adds to the shift after the block's call;
    - ``"shared"``: the block's batch norm runs again after the block, outside it (a module shared), updating its
      statistics;
    - ``"statistics"``: the block only reads the norm's running statistics (whitening with them), and the norm trains
      after the block;
    - ``"replaced"``: the shift is a table of 1.2 MB, which this module replaces by a new one after the block's call.
    """

    def __init__(self, writer: str) -> None:
        super().__init__()
        self.writer = writer
        self.norm = nn.BatchNorm1d(DIM)
        reads = Whiten(self.norm) if writer == "statistics" else self.norm
        shift = ShiftBlock(300_000 if writer == "replaced" else DIM)
        self.block = nn.Sequential(nn.Linear(DIM, DIM), reads, shift)
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(x)
        shift = self.block[2]
        if self.writer == "caller":
            with torch.no_grad():
                shift.shift.add_(1.0)
        elif self.writer == "replaced":
            shift.shift = shift.shift + 0.5
        else:
            return self.head(h + self.norm(2 * h))
        return self.head(h)


class ShiftBlock(nn.Module):
    """``tanh(x + shift[:DIM])``, ``shift`` a buffer of ``size`` values it only reads."""

    def __init__(self, size: int = DIM) -> None:
        super().__init__()
        self.register_buffer("shift", torch.linspace(-1.0, 1.0, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x + self.shift[:DIM])


class Whiten(nn.Module):
    """Normalises with ``norm``'s running statistics, which it only reads."""

    def __init__(self, norm: nn.BatchNorm1d) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.norm.running_mean) / (self.norm.running_var + 1e-5).sqrt()  # type: ignore[operator]


class ValidatedStackModule(StackModule):
    """A :class:`StackModule` with a validation loop on its training data."""

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val/loss", F.mse_loss(self.model(x), y))

    def val_dataloader(self) -> DataLoader:
        return self.train_dataloader()


class MomentumTeacherModule(StackModule):
    """Updates a momentum teacher (a frozen copy of the model) in place at the start of ``training_step``."""

    def __init__(self, block: str = "DropoutBlock") -> None:
        super().__init__(block=block)
        self.teacher = make_stack(globals()[block], 3, seed=1).requires_grad_(False)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        with torch.no_grad():
            for teacher, student in zip(self.teacher.parameters(), self.model.parameters(), strict=True):
                teacher.mul_(0.9).add_(student, alpha=0.1)
        return super().training_step(batch, batch_idx) + 0.0 * self.teacher(batch[0]).sum()


class PlainMetricsModule(StackModule):
    """Keeps a torchmetrics metric in a plain dict attribute (not a submodule) and updates it in ``training_step``."""

    def __init__(self, block: str = "DropoutBlock") -> None:
        super().__init__(block=block)
        self.metrics = {"mse": torchmetrics.MeanSquaredError()}

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.metrics["mse"].update(self.model(x).detach(), y)
        return super().training_step(batch, batch_idx)


class SkipsOnItsSecondCallModule(StackModule):
    """Returns no loss from the second ``training_step`` call on (from call ``skips_from``), counted in a module-level
    list no check restores."""

    calls: ClassVar[list[int]] = []
    skips_from: ClassVar[int] = 2

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        type(self).calls.append(batch_idx)
        return None if len(type(self).calls) >= type(self).skips_from else super().training_step(batch, batch_idx)


class OpCounter(TorchDispatchMode):
    """Counts the ops run while it is active, by op name (``"aten.addmm"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def gradients_of(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, twice: str | None = None
) -> dict[str, torch.Tensor]:
    """Gradients of an MSE step on ``(x, y)``. ``twice`` recomputes every checkpointed region twice: by a gradient
    penalty on the input (``"gradient_penalty"``, as WGAN-GP and R1) or by a second backward through the retained
    graph (``"retain_graph"``)."""
    x = x.clone().requires_grad_(twice == "gradient_penalty")
    out = model(x)
    loss = F.mse_loss(out, y)
    if twice == "gradient_penalty":
        (input_grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        loss = loss + input_grad.square().sum()
    loss.backward(retain_graph=twice == "retain_graph")
    if twice == "retain_graph":
        loss.backward()
    return {name: param.grad.clone() for name, param in model.named_parameters()}


def launch_ranks(script: Path, *args: str, timeout: float, world_size: int = 2) -> None:
    """Run ``script`` as ``world_size`` ranks on this machine (gloo over 127.0.0.1), each started here with the
    variables ``torch.distributed`` and Lightning read, so that Lightning starts no process of its own.

    Raises:
        AssertionError: If a rank fails or runs past ``timeout`` seconds, with the end of every rank's stderr.
    """
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env["WORLD_SIZE"] = str(world_size)
    ranks = []
    for rank in range(world_size):
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0"}
        ranks.append(
            subprocess.Popen(
                [sys.executable, str(script), *args],
                cwd=REPO,
                env=rank_env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outcomes = []
    for rank, process in enumerate(ranks):
        try:
            _, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in ranks:
                other.kill()
            _, stderr = process.communicate()
            outcomes.append(f"rank {rank} ran past {timeout} s:\n{stderr[-4000:]}")
            continue
        if process.returncode != 0:
            outcomes.append(f"rank {rank} exited with {process.returncode}:\n{stderr[-4000:]}")
    assert not outcomes, "\n\n".join(outcomes)


def run_launcher(command: list[str], outputs: list[Path], timeout: float, env: dict[str, str] | None = None) -> None:
    """Run ``command``, a script whose rank zero starts the other ranks through Lightning's launcher, wait for every
    rank (they share its stdout and stderr), and check that each wrote its ``outputs``: rank zero's exit status is the
    only one this process sees.

    Raises:
        AssertionError: If rank zero exits with an error, the ranks run past ``timeout`` seconds (every rank is then
            killed) or one of ``outputs`` is missing, with the end of the ranks' stderr.
    """
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env=child_env() if env is None else env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        _, stderr = process.communicate()
        raise AssertionError(f"the ranks ran past {timeout} s:\n{stderr[-6000:]}") from None
    assert process.returncode == 0, f"rank zero exited with {process.returncode}:\n{stderr[-6000:]}"
    missing = [str(path) for path in outputs if not path.exists()]
    assert not missing, f"a rank did not write {', '.join(missing)}:\n{stderr[-6000:]}"


@contextlib.contextmanager
def one_process_group(tmp_path: Path) -> Iterator[None]:
    """A default process group of this process alone (gloo), destroyed after; one an in-process Trainer test left
    behind serves as well, and is left as it was."""
    owned = not torch.distributed.is_initialized()
    if owned:
        store = f"file://{tmp_path / 'store'}"
        torch.distributed.init_process_group("gloo", init_method=store, rank=0, world_size=1)
    assert torch.distributed.get_world_size() == 1
    try:
        yield
    finally:
        if owned:
            torch.distributed.destroy_process_group()


def fsdp1_unit_on_the_cpu(module: nn.Module) -> nn.Module:
    """``module`` wrapped as an FSDP1 unit on the CPU, inside :func:`one_process_group`."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "FSDP is switching to use `NO_SHARD`", UserWarning)
        return FullyShardedDataParallel(module, device_id=torch.device("cpu"))


def run_rank(main: Callable[..., object], *args: Any) -> NoReturn:
    """Run a multi-process test script's ``main(*args)`` as this rank, then end the process at once, its exit status
    0 if ``main`` returned and 1 (its traceback on stderr) if it raised.

    On success the process group is destroyed first, with every object that still holds it (an FSDP1 unit, a
    Trainer) collected, so that gloo's worker threads stop while the interpreter is whole. The process then ends
    without the interpreter's teardown: gloo work a thread still holds at that teardown aborts the process (SIGABRT,
    "terminate called without an active exception") after its work is done. A rank that raised ends at once, without
    waiting on its peers, which then fail on the closed connection instead of waiting for gloo's timeout.
    """
    code = 0
    try:
        main(*args)
    except SystemExit as ended:
        code = 0 if ended.code in (None, 0) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    if code == 0:
        gc.collect()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def logged_lines(*names: str) -> Iterator[list[str]]:
    """The messages the loggers ``names`` log inside the block, whatever their level and propagation."""
    lines = _Lines()
    loggers = [logging.getLogger(name) for name in names]
    for logger in loggers:
        logger.addHandler(lines)
    try:
        yield lines.lines
    finally:
        for logger in loggers:
            logger.removeHandler(lines)
