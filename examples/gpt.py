"""A small GPT-style transformer with dropout, trained on synthetic token sequences made in code."""

import math

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with dropout on the attention weights and the output."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"`dim` must be divisible by `heads`, got dim={dim}, heads={heads}.")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(dim // self.heads)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
        weights = self.attn_dropout(scores.masked_fill(~causal, float("-inf")).softmax(dim=-1))
        out = (weights @ v).transpose(1, 2).reshape(batch, seq, dim)
        return self.resid_dropout(self.proj(out))


class Block(nn.Module):
    """A pre-norm transformer block: attention and an MLP, each with a residual connection and dropout."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final norm and a language-model head."""

    def __init__(self, vocab_size: int, seq_len: int, dim: int, heads: int, layers: int, dropout: float) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, dim)
        self.position_embedding = nn.Embedding(seq_len, dim)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def shard_blocks_then_model(module: pl.LightningModule) -> None:
    """``fully_shard`` each of ``module.model.blocks``, then ``module.model``, over the data-parallel dimension of the
    module's device mesh, as FSDP2 wants it; nothing under strategies that give no device mesh.

    Args:
        module: A LightningModule whose ``model`` has ``blocks``, in its ``configure_model``.
    """
    if module.device_mesh is None:
        return
    from torch.distributed.fsdp import fully_shard

    mesh = module.device_mesh["data_parallel"]
    for block in module.model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(module.model, mesh=mesh)


class GPTModule(pl.LightningModule):
    """Next-token prediction with :class:`GPT`.

    Args:
        vocab_size: Number of distinct tokens.
        seq_len: Tokens per sequence.
        dim: Width of the residual stream.
        heads: Attention heads per block.
        layers: Number of transformer blocks.
        dropout: Dropout probability everywhere.
        lr: AdamW learning rate.
    """

    def __init__(
        self,
        vocab_size: int = 64,
        seq_len: int = 32,
        dim: int = 64,
        heads: int = 4,
        layers: int = 4,
        dropout: float = 0.1,
        lr: float = 3e-3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(vocab_size, seq_len, dim, heads, layers, dropout)

    def configure_model(self) -> None:
        """Shard the model with FSDP2 when the strategy gives a device mesh (``ModelParallelStrategy``)."""
        shard_blocks_then_model(self)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])


class SyntheticTokens(Dataset):
    """Sequences that follow a fixed random bigram table, so there is something to learn; made in code."""

    def __init__(self, size: int, seq_len: int, vocab_size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        transitions = torch.randint(vocab_size, (vocab_size,), generator=generator)
        noise = torch.randint(vocab_size, (size, seq_len + 1), generator=generator)
        keep = torch.rand(size, seq_len + 1, generator=generator) < 0.8
        tokens = torch.empty(size, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = noise[:, 0]
        for position in range(1, seq_len + 1):
            follow = transitions[tokens[:, position - 1]]
            tokens[:, position] = torch.where(keep[:, position], follow, noise[:, position])
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.tokens[index]


class SyntheticTokensDataModule(pl.LightningDataModule):
    """Training batches of :class:`SyntheticTokens`.

    Args:
        size: Number of sequences.
        seq_len: Tokens per sequence (the model sees ``seq_len`` inputs and targets).
        vocab_size: Number of distinct tokens; must match the model's.
        batch_size: Sequences per batch.
        seed: Seed of the synthetic data.
    """

    def __init__(
        self, size: int = 512, seq_len: int = 32, vocab_size: int = 64, batch_size: int = 16, seed: int = 0
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        hp = self.hparams
        self.dataset = SyntheticTokens(hp["size"], hp["seq_len"], hp["vocab_size"], hp["seed"])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.hparams["batch_size"], shuffle=True)
