"""What a region's first checkpointed forward teaches its wrapper (`checkpointing/profile.py`), and the replay of a
forward's state in recomputation (`checkpointing/contexts.py`): buffers, plain attributes and generators."""

import logging
import pickle

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing
from lightning_ckpt_determinism.checkpointing.profile import OPAQUE_WORKSPACES
from tests.helpers import DIM, BatchNormBlock, BufferCounter, PlainBlock, batch


def checkpointed(module: nn.Module) -> nn.Module:
    apply_activation_checkpointing(module, CheckpointingConfig(names=["0"]))
    return module


def step(model: nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x, y = batch()
    torch.manual_seed(seed)
    out = model(x)
    F.mse_loss(out.flatten(1)[:, :1], y).backward()
    return {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}


class RReLUAtTheEnd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.act = nn.RReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.linear(x))


def test_the_first_call_learns_which_saved_tensors_are_filled_after_they_are_saved() -> None:
    model = checkpointed(nn.Sequential(RReLUAtTheEnd()))
    wrapper = model[0].forward
    assert wrapper.profile is None
    step(model)
    profile = wrapper.profile
    # addmm saves the input (the weight is a parameter), rrelu_with_noise its noise, then its input.
    assert profile is not None and profile.saved == 3
    assert profile.filled_late == frozenset({1})
    assert profile.workspaces == frozenset()


class PrefilledNoise(nn.Module):
    """``rrelu_with_noise`` given a noise tensor that already holds the values the op writes into it, as the caching
    allocator can hand an uninitialised one (the memory of the same draw, just freed)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.ones_like(x)
        return torch.ops.aten.rrelu_with_noise(self.linear(x), noise, 1.0, 1.0, True) * 2


def test_a_saved_tensor_an_op_writes_after_saving_it_is_filled_late_even_if_its_values_already_matched() -> None:
    model = checkpointed(nn.Sequential(PrefilledNoise()))
    step(model)
    # addmm saves the input, rrelu_with_noise its noise (written in place after it is saved), then its input.
    assert model[0].forward.profile.filled_late == frozenset({1})


def test_an_lstm_workspace_is_found_among_the_saved_tensors() -> None:
    lstm = nn.LSTM(DIM, DIM, batch_first=True)

    class Features(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = lstm

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lstm(x.unsqueeze(1))[0].squeeze(1)

    model = checkpointed(nn.Sequential(Features()))
    step(model)
    profile = model[0].forward.profile
    assert "aten.mkldnn_rnn_layer" in OPAQUE_WORKSPACES
    assert profile is not None and len(profile.workspaces) == 1
    assert profile.filled_late == frozenset()


def test_the_buffers_and_attributes_a_forward_changes_are_learned_and_generators_found() -> None:
    block = BatchNormBlock()
    block.calls = 0
    block.label = "constant"
    block.noise = torch.Generator().manual_seed(0)
    original = block.forward

    def counting(x: torch.Tensor) -> torch.Tensor:
        block.calls += 1
        return original(x)

    block.forward = counting  # type: ignore[method-assign]
    model = checkpointed(nn.Sequential(block))
    step(model)
    profile = model[0].forward.profile
    assert profile is not None
    assert profile.buffers == frozenset({"norm.running_mean", "norm.running_var", "norm.num_batches_tracked"})
    # The count the forward rebound was put back for its recomputation, which counted from where the forward did (the
    # wrapper finds rebound attributes at each call, `contexts.AttributeReplay`, rather than in the profile).
    assert block.calls == 1
    assert [name for name, _ in profile.generators] == ["noise"]


class LateBuffer(nn.Module):
    """Updates a count buffer in place once ``armed``: a buffer the first call did not change."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.armed = False
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.count += 1
        return torch.tanh(self.linear(x) * (1 + self.count))


class ReplacedBuffer(nn.Module):
    """Replaces its step buffer by assignment in forward, and reads the new one."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps = self.steps + 1
        return torch.tanh(self.linear(x) / self.steps)


def test_a_buffer_replaced_by_assignment_is_replayed_and_the_live_one_kept() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(ReplacedBuffer())
    model = nn.Sequential(ReplacedBuffer())
    model.load_state_dict(plain.state_dict())
    checkpointed(model)
    for seed in range(3):
        expected, got = step(plain, seed), step(model, seed)
        assert all(torch.equal(expected[name], got[name]) for name in expected)
    assert int(model[0].steps) == int(plain[0].steps) == 3


def test_a_buffer_first_changed_after_the_first_call_is_replayed_from_the_next_forward(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(LateBuffer())
    model = nn.Sequential(LateBuffer())
    model.load_state_dict(plain.state_dict())
    checkpointed(model)
    with caplog.at_level(logging.INFO, logger="lightning_ckpt_determinism"):
        step(plain), step(model)
        assert model[0].forward.profile.buffers == frozenset()
        plain[0].armed = model[0].armed = True
        step(plain), step(model)  # the forward changes the count for the first time: noted
        assert model[0].forward.profile.buffers == frozenset({"count"})
    (line,) = [record.getMessage() for record in caplog.records if "for the first time" in record.getMessage()]
    assert "region `0` changed its buffer `count` in forward for the first time after its first call" in line
    # That step's recomputation started from the count the forward left and gave it back: counted once, as without
    # checkpointing. From the next forward on, it sees the count the forward started from.
    assert (int(model[0].count), int(plain[0].count)) == (1, 1)
    expected, got = step(plain, 1), step(model, 1)
    assert all(torch.equal(expected[name], got[name]) for name in expected)
    assert int(model[0].count) == int(plain[0].count) == 2


@pytest.mark.parametrize("protect_buffers", [True, False])
def test_recomputation_hands_out_the_buffers_themselves(protect_buffers: bool) -> None:
    model = nn.Sequential(BufferCounter())
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0"], protect_buffers=protect_buffers))
    step(model)
    # torch's own checkpoint gives [1, 1, 1]: the backward's update lands on the buffer itself, not on a copy.
    assert model[0].counter.tolist() == [1.0, 1.0, 1.0]


def test_a_region_pickled_after_its_first_call_learns_again_in_its_copy() -> None:
    model = checkpointed(nn.Sequential(PlainBlock()))
    step(model)
    assert model[0].forward.profile is not None
    copied = pickle.loads(pickle.dumps(model))
    assert copied[0].forward.profile is None
    assert all(torch.equal(a, b) for a, b in zip(step(model).values(), step(copied).values(), strict=True))
    assert copied[0].forward.profile is not None
