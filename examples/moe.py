"""A small mixture-of-experts model: a top-k router sends each token to some of its experts.

Routing is what activation checkpointing most often breaks: the router's logits come out a few ulps different when a
block is recomputed, a top-k tie flips, and other tokens go to other experts than in the forward, which either
crashes backward (``CheckpointError: ... different metadata``) or silently changes the gradients. The package's
``keep_data_dependent`` (on by default) keeps the top-k choice from the forward. Train and audit::

    python -m examples.train fit --config examples/configs/moe_blocks.yaml
    python -m lightning_ckpt_determinism audit --config examples/configs/moe_blocks.yaml
    python -m lightning_ckpt_determinism audit --config examples/configs/broken_routing.yaml

``broken_routing.yaml`` uses :class:`DriftingRouterMoEBlock`, whose router logits drift slightly in recomputation
only, and turns ``keep_data_dependent`` off, so its routing flips. Data are the synthetic regression targets of
:class:`examples.broken.SyntheticRegression`.
"""

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F


@torch.library.custom_op("lckd_examples::recompute_drift", mutates_args=())
def recompute_drift(logits: torch.Tensor) -> torch.Tensor:
    """Return ``logits`` unchanged, except inside backward, where recomputation runs: there each logit
    grows by 1e-6 times its expert's index.

    A stand-in, on the CPU, for what makes recomputed router logits differ by a few ulps on real hardware: another
    reduction order, a non-deterministic kernel, a ZeRO/FSDP gather. Ties between experts, broken one way in the
    forward, are broken towards the last expert in recomputation.
    """
    if torch._C._current_graph_task_id() == -1:
        return logits.clone()
    ramp = torch.arange(logits.shape[-1], dtype=logits.dtype, device=logits.device)
    return logits + 1e-6 * ramp


@recompute_drift.register_fake
def _(logits: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(logits)


def _recompute_drift_backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
    return grad


recompute_drift.register_autograd(_recompute_drift_backward)


class MoEBlock(nn.Module):
    """A residual mixture-of-experts block: ``x + moe(layer_norm(x))``, each token sent to its ``top_k`` experts.

    The router's logits are rounded to quarters (a straight-through estimator keeps their gradient), as a
    low-precision router does, so that experts often tie: which of two tied experts ``topk`` picks is exactly what
    recomputation must not change. Each expert is a two-layer MLP; its tokens are found with ``torch.where`` and its
    outputs added back weighted by the token's renormalised router probability.

    Args:
        dim: Width of the tokens.
        experts: Number of experts.
        top_k: Experts per token.
        hidden: Hidden width of each expert.

    Example::

        >>> block = MoEBlock(dim=8, experts=4, top_k=2, hidden=16)
        >>> block(torch.randn(5, 8)).shape
        torch.Size([5, 8])
    """

    def __init__(self, dim: int, experts: int = 4, top_k: int = 2, hidden: int = 32) -> None:
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"`top_k` must be in [1, {experts}] (the number of experts), got {top_k}.")
        self.top_k = top_k
        self.norm = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, dim)) for _ in range(experts)
        )

    def router_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.router(tokens)
        return logits + (torch.round(logits * 4) / 4 - logits).detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.norm(x)
        logits = self.router_logits(tokens)
        probabilities = logits.softmax(dim=-1)
        _, chosen = logits.topk(self.top_k, dim=-1)
        weights = probabilities.gather(-1, chosen)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == index)
            out = out.index_add(0, token, expert(tokens[token]) * weights[token, slot, None])
        return x + out


class DriftingRouterMoEBlock(MoEBlock):
    """A :class:`MoEBlock` whose router logits drift slightly in recomputation (:func:`recompute_drift`)."""

    def router_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        return recompute_drift(super().router_logits(tokens))


class MoEModule(pl.LightningModule):
    """Regression with a stack of mixture-of-experts blocks and a linear head.

    Args:
        blocks: Number of blocks.
        dim: Width of the tokens; must match the data's.
        experts: Experts per block.
        top_k: Experts per token.
        hidden: Hidden width of each expert.
        drifting_router: Build :class:`DriftingRouterMoEBlock` blocks, whose router drifts in recomputation.
        lr: SGD learning rate.

    Example::

        >>> model = MoEModule(blocks=2, drifting_router=True)
        >>> [type(block).__name__ for block in model.blocks]
        ['DriftingRouterMoEBlock', 'DriftingRouterMoEBlock']
    """

    def __init__(
        self,
        blocks: int = 2,
        dim: int = 16,
        experts: int = 4,
        top_k: int = 2,
        hidden: int = 32,
        drifting_router: bool = False,
        lr: float = 0.01,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        block = DriftingRouterMoEBlock if drifting_router else MoEBlock
        self.blocks = nn.ModuleList(block(dim, experts, top_k, hidden) for _ in range(blocks))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"])
