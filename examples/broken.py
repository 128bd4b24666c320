"""Small models that each break recomputation in one way, so the audit's findings can be seen on purpose.

A :class:`BrokenModule` is a stack of residual blocks; the block at ``defective_block`` carries ``defect``, the
others are plain. Each ``examples/configs/broken_<cause>.yaml`` checkpoints every block and runs::

    python -m lightning_ckpt_determinism audit --config examples/configs/broken_<cause>.yaml

Some defects live in the model (host RNG, Python state, a data-dependent shape, a non-deterministic kernel, an
in-place op on a block's input, a parameter decayed in place, a list appended to, a metric updated, a global read
in ``training_step``), two in the checkpointing config (dropout with ``preserve_rng_state: false``, BatchNorm with
``protect_buffers: false``). Data are synthetic regression targets made in code.
"""

import itertools
from typing import Literal

import lightning.pytorch as pl
import numpy as np
import torch
import torchmetrics
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

Defect = Literal[
    "rng_not_preserved",
    "host_rng",
    "buffer_mutation",
    "shape_change",
    "python_state",
    "nondeterministic_kernel",
    "recompute_error",
    "parameter_write",
    "attribute_mutation",
    "outside_state",
    "metric_update",
]

_accumulation_orders = itertools.count()
# Drawn from by `BrokenModule.training_step` with the `outside_state` defect: a global the check cannot put back.
_input_scales = itertools.count()


@torch.library.custom_op("lckd_examples::unordered_row_sum", mutates_args=())
def unordered_row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum the rows of ``x``, first to last on one call and last to first on the next, as a GPU reduction with
    atomic adds accumulates in whatever order threads finish.

    Float addition is not associative, so the result differs in its last bits from call to call although the
    input is the same: a stand-in, on the CPU, for kernels whose accumulation order depends on thread scheduling.
    """
    rows = list(range(x.shape[0]))
    total = torch.zeros_like(x[0])
    for row in rows if next(_accumulation_orders) % 2 else reversed(rows):
        total = total + x[row]
    return total


@unordered_row_sum.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[1:])


def _unordered_row_sum_backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
    return grad.expand(ctx.input_shape).clone()  # type: ignore[attr-defined]


def _unordered_row_sum_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
    ctx.input_shape = inputs[0].shape  # type: ignore[attr-defined]


unordered_row_sum.register_autograd(_unordered_row_sum_backward, setup_context=_unordered_row_sum_setup)


class Block(nn.Module):
    """A residual block, ``x + tanh(linear(x))``: nothing in it can differ on recomputation.

    Args:
        dim: Width of the block.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class DropoutBlock(Block):
    """Dropout after the activation: broken only when the config sets ``preserve_rng_state: false``."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.dropout = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(torch.tanh(self.linear(x)))


class NumpyNoiseBlock(Block):
    """Multiplicative noise from NumPy's global RNG, which torch does not replay in recomputation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.from_numpy(np.random.uniform(0.9, 1.1, size=x.shape).astype(np.float32)).to(x.device)
        return x + torch.tanh(self.linear(x) * noise)


class BatchNormBlock(Block):
    """BatchNorm: broken only when the config sets ``protect_buffers: false`` (its statistics update twice)."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.norm = nn.BatchNorm1d(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.norm(self.linear(x)))


class RoutingBlock(Block):
    """Updates as many rows as a capacity that grows with every call, counted in a list of the calls' batch sizes,
    so recomputation routes more rows (the package replays scalar attributes, not lists)."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.shape[0])
        capacity = 1 + len(self.seen) % (x.shape[0] - 1)
        out = x.clone()
        out[:capacity] = x[:capacity] + torch.tanh(self.linear(x[:capacity]))
        return out


class HistoryBlock(Block):
    """Keeps the batch size of every input it sees in a list and scales its pre-activation by the list's length:
    recomputation appends once more and sees another scale. The package replays a region's scalar attributes (a
    counter ``self.calls += 1`` is exact), not what a forward appends to a list."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.history: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.history.append(x.shape[0])
        return x + torch.tanh(self.linear(x) * (1.0 + 0.1 * len(self.history)))


class UnorderedSumBlock(Block):
    """Adds the batch mean computed by :func:`unordered_row_sum`, a kernel that differs from itself run to run."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x) + unordered_row_sum(x) / x.shape[0])


class InPlaceReluBlock(Block):
    """Starts with an in-place ReLU on its input, as pre-activation blocks often do: fine without checkpointing, but
    the input checkpointing saved for recomputation has changed by then, so recomputing the block fails."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(self.act(x)))


class DecayBlock(Block):
    """Scales its activation by a gain it decays in place in forward, under ``no_grad`` (a decay written by hand):
    recomputation reads the decayed gain and decays it a second time."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.gain = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.gain.mul_(0.99)
        return x + torch.tanh(self.linear(x)) * self.gain


class RowCount(torchmetrics.Metric):
    """How many rows it was updated with."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("rows", torch.zeros(()), dist_reduce_fx="sum")

    def update(self, x: torch.Tensor) -> None:
        self.rows += x.shape[0]

    def compute(self) -> torch.Tensor:
        return self.rows


class MetricBlock(Block):
    """Counts the rows it sees in a torchmetrics metric and damps its activation by the count so far: recomputation
    updates the metric a second time and reads a count that moved on."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.seen = RowCount()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.update(x)
        return x + torch.tanh(self.linear(x)) / (1.0 + 0.01 * self.seen.rows)


class LoggingBlock(Block):
    """Logs its batch size to a list in forward and never reads it: the gradients are exact, but recomputation logs
    every batch twice."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.batch_sizes: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.batch_sizes.append(x.shape[0])
        return super().forward(x)


DEFECTIVE_BLOCKS: dict[str, type[Block]] = {
    "rng_not_preserved": DropoutBlock,
    "host_rng": NumpyNoiseBlock,
    "buffer_mutation": BatchNormBlock,
    "shape_change": RoutingBlock,
    "python_state": HistoryBlock,
    "nondeterministic_kernel": UnorderedSumBlock,
    "recompute_error": InPlaceReluBlock,
    "parameter_write": DecayBlock,
    "attribute_mutation": LoggingBlock,
    "outside_state": Block,
    "metric_update": MetricBlock,
}


class BrokenModule(pl.LightningModule):
    """Regression with a stack of residual blocks, one of which carries ``defect``.

    Args:
        defect: Which defect the block at ``defective_block`` has; ``None`` builds plain blocks only.
        blocks: Number of blocks.
        defective_block: Position of the defective block.
        dim: Width of the blocks.
        lr: SGD learning rate.

    Example::

        >>> model = BrokenModule(defect="host_rng", blocks=3)
        >>> [type(block).__name__ for block in model.blocks]
        ['Block', 'NumpyNoiseBlock', 'Block']
    """

    def __init__(
        self,
        defect: Defect | None = None,
        blocks: int = 4,
        defective_block: int = 1,
        dim: int = 16,
        lr: float = 0.01,
    ) -> None:
        super().__init__()
        if not 0 <= defective_block < blocks:
            raise ValueError(f"`defective_block` must be in [0, {blocks}), got {defective_block}.")
        self.save_hyperparameters()
        self.blocks = nn.ModuleList(
            DEFECTIVE_BLOCKS[defect](dim) if defect is not None and index == defective_block else Block(dim)
            for index in range(blocks)
        )
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.hparams.get("defect") == "outside_state":
            # Every other call scales the batch, counted by a module-level counter: state outside the checkpointed
            # blocks, which a rerun of the step reads anew.
            x = x * (1.0 + 0.1 * (next(_input_scales) % 2))
        loss = F.mse_loss(self(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"])


class SyntheticRegression(pl.LightningDataModule):
    """Random inputs and a smooth target of them, made in code.

    Args:
        size: Number of samples.
        dim: Input width; must match the model's.
        batch_size: Samples per batch.
        seed: Seed of the data.

    Example::

        >>> data = SyntheticRegression(size=8, dim=4, batch_size=4)
        >>> data.setup("fit")
        >>> [tuple(t.shape) for t in next(iter(data.train_dataloader()))]
        [(4, 4), (4, 1)]
    """

    def __init__(self, size: int = 256, dim: int = 16, batch_size: int = 16, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        generator = torch.Generator().manual_seed(self.hparams["seed"])
        x = torch.randn(self.hparams["size"], self.hparams["dim"], generator=generator)
        self.dataset = TensorDataset(x, torch.sin(x).sum(dim=1, keepdim=True))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.hparams["batch_size"])
