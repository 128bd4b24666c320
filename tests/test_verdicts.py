"""Verdicts against ground truth: standard layers and transformers blocks, each held against a plain twin (the same
weights and seeds, trained side by side for three steps, configured as checkpointing needs), under the sentinel and
the check at every step. Each case ends one of two ways: weights, buffers and gradients bit-identical to the twin,
with nothing from the sentinel nor the check; or a finding naming the region and the cause, for parameters
recomputation writes and side effects the package does not replay."""

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_args

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_ckpt_determinism import (
    CheckpointingConfig,
    RecomputationReport,
    SentinelReport,
    apply_activation_checkpointing,
    check_recomputation,
    recomputation_sentinel,
)
from lightning_ckpt_determinism.checkpointing.profile import OPAQUE_WORKSPACES
from lightning_ckpt_determinism.verify.digest import DigestTier

WIDTH = 8
STEPS = 3


def tokens(step: int) -> torch.Tensor:
    """A batch of (batch, sequence, width) features, its values seeded by the step."""
    return torch.randn(4, 6, WIDTH, generator=torch.Generator().manual_seed(100 + step))


class Head(nn.Module):
    """``region`` applied to the features, then a linear head: the region is the model's ``body``."""

    def __init__(self, region: nn.Module, width: int = WIDTH) -> None:
        super().__init__()
        self.body = region
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        return self.head(out[0] if isinstance(out, tuple) else out)


class Around(nn.Module):
    """A linear layer, then ``layer``, then (unless ``last``) another linear layer: ``layer`` mid-region or last."""

    def __init__(self, layer: nn.Module, last: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.layer = layer
        self.out = nn.Identity() if last else nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.layer(self.inp(x)))


class Recurrent(nn.Module):
    """An RNN's output features (its final states dropped)."""

    def __init__(self, rnn: nn.RNNBase) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


class Channels(nn.Module):
    """``layer`` over (batch, channels = sequence, width) features, reshaped to as many dimensions as it wants."""

    def __init__(self, layer: nn.Module, dims: int) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.layer = layer
        self.dims = dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        shaped = {3: h, 4: h.unflatten(-1, (2, 4)), 5: h.unflatten(-1, (2, 2, 2))}[self.dims]
        return self.layer(shaped).flatten(2)


class AttentionPooling(nn.Module):
    """Weights the sequence by a softmax score and sums it: ``bmm`` saves a (B, 1, T) view with stride 1 on its
    dimension of size one."""

    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Linear(WIDTH, 1)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.score(x), dim=1)
        return torch.bmm(weights.transpose(1, 2), self.proj(x))


class ZeroSized(nn.Module):
    """Multiplies an empty slice of its input, saved for backward, into the output."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        empty = h[:, :0] * h[:, :0]
        return torch.tanh(h) + empty.sum()


class MaxNormEmbedding(nn.Module):
    """Looks rows up in an ``nn.Embedding`` with ``max_norm``, which renormalises its weight in place."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(10, WIDTH, max_norm=1.0)
        self.inp = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = (x[..., 0].abs() * 4).long().clamp(max=9)
        return torch.tanh(self.inp(x)) * self.table(rows)


class EmaGain(nn.Module):
    """Updates a running gain (a buffer) from its activations, then reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("gain", torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        with torch.no_grad():
            self.gain.mul_(0.9).add_(0.1 * h.abs().mean(dim=(0, 1)))
        return torch.tanh(h * self.gain)


class WarmupCount(nn.Module):
    """Counts its steps in a buffer and scales by a warm-up factor read from it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return torch.tanh(self.inp(x) * torch.clamp(self.steps / 2, max=1.0))


class HeldGenerator(nn.Module):
    """Draws multiplicative noise from a ``torch.Generator`` it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.noise = torch.Generator().manual_seed(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return torch.tanh(h * (1 + torch.rand(h.shape, generator=self.noise)))


class NoisyOutside(nn.Module):
    """A checkpointed block (``body``) after input noise drawn from generators the model holds outside it: a torch
    ``Generator`` and a NumPy ``Generator``."""

    def __init__(self) -> None:
        super().__init__()
        self.torch_noise = torch.Generator().manual_seed(4)
        self.numpy_noise = np.random.default_rng(5)
        self.body = Around(nn.Tanh())
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.rand(x.shape, generator=self.torch_noise)
        scale = float(self.numpy_noise.uniform(0.5, 1.5))
        return self.head(self.body(x * (1 + noise) * scale))


class CtcLoss(nn.Module):
    """A linear layer's log-probabilities and their CTC loss, one sample shorter than the sequence: CTC's kernel
    saves its ``log_alpha``, uninitialised memory it fills only up to each sample's input and target lengths."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, 5)
        self.ctc = nn.CTCLoss()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length = x.shape[:2]
        targets = torch.arange(2 * batch).reshape(batch, 2) % 4 + 1
        inputs = torch.full((batch,), length, dtype=torch.long)
        inputs[-1] = length // 2
        target_lengths = torch.full((batch,), 2, dtype=torch.long)
        target_lengths[-1] = 1
        log_probs = self.inp(x).log_softmax(-1).transpose(0, 1)
        return self.ctc(log_probs, targets, inputs, target_lengths)


class AdaptiveSoftmaxLoss(nn.Module):
    """``nn.AdaptiveLogSoftmaxWithLoss`` over the features, with targets made from them (every cluster): it fills a
    tensor of ``new_empty`` in pieces, by ``index_copy_``, cluster by cluster."""

    def __init__(self) -> None:
        super().__init__()
        self.asm = nn.AdaptiveLogSoftmaxWithLoss(WIDTH, 30, cutoffs=[5, 15], div_value=2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(0, 1)
        return self.asm(flat, (flat[:, 0].abs() * 12).long().clamp(max=29)).loss


class Loss(nn.Module):
    """``region`` is the whole model, its output the loss."""

    def __init__(self, region: nn.Module) -> None:
        super().__init__()
        self.body = region

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class CallCounter(nn.Module):
    """Scales by a call counter it increments in forward (a scalar attribute, replayed in recomputation)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.inp(x) * (1.0 + 0.1 * self.calls))


class WordRoll(nn.Module):
    """Rolls its features by two float32 (one 64-bit word) on every second call, counted in a list: recomputation,
    which does not replay lists, reads the features moved within each row."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.calls: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(1)
        h = self.inp(x)
        return torch.tanh(h.roll(2, -1) if len(self.calls) % 2 == 0 else h)


def transformer(name: str) -> nn.Module:
    """A tiny transformers model, built from a config (no download), with no key-value cache in any (sub-)config."""
    import transformers

    small = {"vocab_size": 32, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    if name == "GPT2Block":
        config: Any = transformers.GPT2Config(n_layer=2, n_embd=WIDTH * 2, n_head=2, n_positions=16, **small)
        model: nn.Module = transformers.GPT2LMHeadModel(config)
    elif name == "LlamaDecoderLayer":
        config = transformers.LlamaConfig(
            num_hidden_layers=2,
            hidden_size=WIDTH * 2,
            intermediate_size=WIDTH * 4,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=16,
            **small,
        )
        model = transformers.LlamaForCausalLM(config)
    elif name == "BertLayer":
        config = transformers.BertConfig(
            num_hidden_layers=2, hidden_size=WIDTH * 2, num_attention_heads=2, intermediate_size=WIDTH * 4, **small
        )
        model = transformers.BertForMaskedLM(config)
    else:
        config = transformers.T5Config(
            num_layers=2, d_model=WIDTH * 2, d_kv=4, d_ff=WIDTH * 4, num_heads=2, decoder_start_token_id=0, **small
        )
        model = transformers.T5ForConditionalGeneration(config)
    for sub in model.modules():
        if getattr(sub, "config", None) is not None and hasattr(sub.config, "use_cache"):
            sub.config.use_cache = False
    return model


class LanguageModel(nn.Module):
    """A transformers model trained on token ids made from the features, its loss as the output."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.model = transformer(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x[..., 0].abs() * 8).long().clamp(max=31)
        return self.model(input_ids=ids, labels=ids).loss


@dataclass(frozen=True)
class Case:
    """A model to build, which of its modules to checkpoint, and what the verdicts must be.

    ``finding`` is ``None`` for an exact case, else ``(cause, what)``: the sentinel's first mismatch in the region
    starts with ``what`` and the check attributes ``cause`` to the region (``None``: the sentinel alone sees it).
    """

    build: Callable[[], nn.Module]
    names: tuple[str, ...] = ("body",)
    classes: tuple[str, ...] = ()
    finding: tuple[str | None, str] | None = None


def head(make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    return lambda: Head(make())


ZOO: dict[str, Case] = {
    "RReLU mid-region": Case(head(lambda: Around(nn.RReLU()))),
    "RReLU last": Case(head(lambda: Around(nn.RReLU(), last=True))),
    "LSTM": Case(head(lambda: Recurrent(nn.LSTM(WIDTH, WIDTH, batch_first=True)))),
    "LSTM, 2 layers, bidirectional": Case(
        lambda: Head(Recurrent(nn.LSTM(WIDTH, WIDTH, 2, batch_first=True, bidirectional=True)), WIDTH * 2)
    ),
    "GRU": Case(head(lambda: Recurrent(nn.GRU(WIDTH, WIDTH, batch_first=True)))),
    "GRU, 2 layers, bidirectional": Case(
        lambda: Head(Recurrent(nn.GRU(WIDTH, WIDTH, 2, batch_first=True, bidirectional=True)), WIDTH * 2)
    ),
    "BatchNorm": Case(head(lambda: Channels(nn.BatchNorm1d(6), 3))),
    "GroupNorm": Case(head(lambda: Channels(nn.GroupNorm(2, 6), 3))),
    "Dropout": Case(head(lambda: Around(nn.Dropout(0.3)))),
    "Dropout1d": Case(head(lambda: Channels(nn.Dropout1d(0.3), 3))),
    "Dropout2d": Case(head(lambda: Channels(nn.Dropout2d(0.3), 4))),
    "Dropout3d": Case(head(lambda: Channels(nn.Dropout3d(0.3), 5))),
    "AlphaDropout": Case(head(lambda: Around(nn.AlphaDropout(0.3)))),
    "FeatureAlphaDropout": Case(head(lambda: Channels(nn.FeatureAlphaDropout(0.3), 4))),
    "weight_norm": Case(head(lambda: nn.utils.parametrizations.weight_norm(nn.Linear(WIDTH, WIDTH)))),
    "in-place ReLU": Case(head(lambda: Around(nn.ReLU(inplace=True)))),
    "attention pooling": Case(head(AttentionPooling)),
    "a zero-size intermediate": Case(head(ZeroSized)),
    # Recomputation renormalises the rows the forward already brought within `max_norm`: a write of the same values.
    "Embedding(max_norm)": Case(head(MaxNormEmbedding)),
    "an EMA buffer": Case(head(EmaGain)),
    "a step-count buffer": Case(head(WarmupCount)),
    "a generator inside a region": Case(head(HeldGenerator)),
    "generators outside a region": Case(NoisyOutside),
    "a call counter": Case(head(CallCounter)),
    "CTCLoss, a sample shorter than the sequence": Case(lambda: Loss(CtcLoss())),
    "AdaptiveLogSoftmaxWithLoss": Case(lambda: Loss(AdaptiveSoftmaxLoss())),
    "a roll by whole words": Case(
        head(WordRoll), finding=("python_state", "the 2nd tensor the region saved (made by `TanhBackward0`")
    ),
    "GPT2Block": Case(lambda: LanguageModel("GPT2Block"), names=(), classes=("GPT2Block",)),
    "LlamaDecoderLayer": Case(lambda: LanguageModel("LlamaDecoderLayer"), names=(), classes=("LlamaDecoderLayer",)),
    "BertLayer": Case(lambda: LanguageModel("BertLayer"), names=(), classes=("BertLayer",)),
    "T5Block": Case(lambda: LanguageModel("T5Block"), names=(), classes=("T5Block",)),
}


@dataclass
class Trial:
    """Steps of a plain twin and its checkpointed copy, the sentinel on the copy, the check before each step."""

    plain: nn.Module
    checkpointed: nn.Module
    regions: list[str]
    sentinel: SentinelReport
    checks: list[RecomputationReport]
    equal_steps: list[bool]

    @property
    def gradients_equal(self) -> bool:
        """Whether the twins' gradients were bit-identical at every step."""
        return all(self.equal_steps)


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out if out.dim() == 0 else F.mse_loss(out, torch.zeros_like(out))


def seeded(step: int) -> None:
    torch.manual_seed(step)
    np.random.seed(step)


def trial(
    case: Case,
    mode: str,
    device: str = "cpu",
    *,
    steps: int = STEPS,
    before: Callable[[nn.Module, int], object] = lambda model, step: None,
) -> Trial:
    """``steps`` steps of ``case``'s model and its checkpointed copy; ``before`` sets both up before each step (a
    mode, a new generator)."""
    torch.manual_seed(0)
    plain = case.build().to(device)
    checkpointed = copy.deepcopy(plain)
    config = CheckpointingConfig(names=list(case.names), classes=list(case.classes))
    regions = apply_activation_checkpointing(checkpointed, config)
    assert regions
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1) for model in (plain, checkpointed)]
    checks, equal_steps = [], []
    with recomputation_sentinel(checkpointed, mode=mode) as sentinel:  # type: ignore[arg-type]
        for step in range(steps):
            for model in (plain, checkpointed):
                before(model, step)
            x = tokens(step).to(device)
            seeded(step)
            checks.append(check_recomputation(checkpointed, lambda x=x: loss_of(checkpointed, x), attribution=True))
            grads = []
            for model, optimizer in zip((plain, checkpointed), optimizers, strict=True):
                seeded(step)
                optimizer.zero_grad()
                loss_of(model, x).backward()
                grads.append([param.grad for param in model.parameters()])
                optimizer.step()
            equal_steps.append(
                all(
                    (a is None and b is None) or (a is not None and b is not None and same_tensor(a, b))
                    for a, b in zip(*grads, strict=True)
                )
            )
            sentinel.next_step()
    return Trial(plain, checkpointed, regions, sentinel.report(), checks, equal_steps)


def same_tensor(first: torch.Tensor, second: torch.Tensor) -> bool:
    """``torch.equal`` in one layout; sparse gradients (``nn.Embedding(sparse=True)``) compared by their dense forms."""
    return first.layout == second.layout and torch.equal(first.to_dense(), second.to_dense())


def same_state(first: nn.Module, second: nn.Module) -> bool:
    one, other = first.state_dict(), second.state_dict()
    return one.keys() == other.keys() and all(torch.equal(one[key], other[key]) for key in one)


@pytest.mark.parametrize("mode", get_args(DigestTier))
@pytest.mark.parametrize("name", list(ZOO))
def test_every_case_is_exact_or_names_its_region_and_cause(name: str, mode: str) -> None:
    case = ZOO[name]
    result = trial(case, mode)
    if case.finding is None:
        assert result.gradients_equal
        assert same_state(result.plain, result.checkpointed)
        assert result.sentinel.mismatches == 0, result.sentinel.regions
        assert result.sentinel.compared > 0
        for report in result.checks:
            assert (report.diverged, report.grad_divergence, report.error) == (False, 0.0, None)
            assert [region.cause for region in report.regions] == [None] * len(result.regions)
            assert report.buffer_mutations == report.attribute_mutations == []
        return
    cause, what = case.finding
    region = result.regions[0]
    found = result.sentinel.regions[region]
    assert found.mismatches > 0
    assert found.first_mismatch is not None and found.first_mismatch.startswith(what), found
    assert [name for name, other in result.sentinel.regions.items() if other.mismatches] == [region]
    if cause is not None:
        named = [(r.name, r.cause) for r in result.checks[0].regions if r.cause is not None]
        assert named == [(region, cause)]


def test_rnn_workspaces_are_left_out_and_counted_as_not_compared() -> None:
    result = trial(ZOO["LSTM, 2 layers, bidirectional"], "exact")
    # One oneDNN workspace per layer and direction at each region call, none compared: two calls a step, the
    # check's checkpointed pass and the training step's.
    assert result.sentinel.not_compared == 4 * 2 * STEPS
    assert result.sentinel.mismatches == 0


def test_ctc_loss_log_alpha_is_left_out_and_counted_as_not_compared() -> None:
    # CTC's `log_alpha` is uninitialised memory beyond each sample's lengths: its leftovers differ between a forward
    # and its recomputation wherever the allocator hands them other memory, while the gradients never read them.
    result = trial(ZOO["CTCLoss, a sample shorter than the sequence"], "exact")
    assert result.gradients_equal
    # One `log_alpha` at each region call, none compared: two calls a step, the check's checkpointed pass and the
    # training step's.
    assert result.sentinel.not_compared == 2 * STEPS
    assert result.sentinel.mismatches == 0
    assert "aten._ctc_loss" in OPAQUE_WORKSPACES


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_lstm_reserve_space_is_left_out_and_the_steps_are_exact() -> None:
    # Whether cuDNN's reserve space is the opaque workspace `OPAQUE_WORKSPACES` says it is: unverified until this runs.
    deterministic = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True
    try:
        result = trial(ZOO["LSTM, 2 layers, bidirectional"], "exact", device="cuda")
    finally:
        torch.backends.cudnn.deterministic = deterministic
    assert result.gradients_equal and same_state(result.plain, result.checkpointed)
    assert result.sentinel.mismatches == 0, result.sentinel.regions
    assert result.sentinel.not_compared > 0


def test_the_last_op_filling_what_it_saved_is_recomputed_where_torch_alone_reads_garbage() -> None:
    torch.manual_seed(0)
    model = Head(Around(nn.RReLU(), last=True))
    x = tokens(0)

    def gradients(forward: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        torch.manual_seed(1)
        out = forward(x)
        return list(torch.autograd.grad(F.mse_loss(out, torch.zeros_like(out)), list(model.parameters())))

    def by_hand(x: torch.Tensor) -> torch.Tensor:
        return model.head(torch.utils.checkpoint.checkpoint(model.body, x, use_reentrant=False))

    deterministic = torch.are_deterministic_algorithms_enabled()
    # Deterministic mode fills uninitialised memory with NaN: what an unfilled `noise` holds is then known.
    torch.use_deterministic_algorithms(True)
    try:
        reference = gradients(model)
        hand = gradients(by_hand)
        apply_activation_checkpointing(model, CheckpointingConfig(names=["body"]))
        ours = gradients(model)
        again = gradients(model)  # a later call: the region's profile keeps torch's early stop off
    finally:
        torch.use_deterministic_algorithms(deterministic)
    # torch's early stop ends the recomputation before `rrelu_with_noise` fills the noise it saved.
    assert any(grad.isnan().any() for grad in hand)
    assert all(torch.equal(a, b) for a, b in zip(reference, ours, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(reference, again, strict=True))
