"""The sentinel's light tier (`lightning_ckpt_determinism.verify.sentinel.light_layout`): what it must see at the step
of a defect, and what within its rotation, held against the exact tier as ground truth."""

import numpy as np
import pytest
import torch
from torch import nn

from lightning_ckpt_determinism import (
    CheckpointingConfig,
    RecomputationSentinel,
    apply_activation_checkpointing,
    recomputation_sentinel,
)
from lightning_ckpt_determinism.verify.digest import DigestMode
from lightning_ckpt_determinism.verify.sentinel.light_layout import SavedLayout
from tests.helpers import DIM, Stack, batch, step_gradients

STEPS = 6


class BranchedBlock(nn.Module):
    """Six saved activations: a side branch ``sigmoid(linear(x))`` first, whose saved output no later saved tensor
    depends on (it is added at the end, which saves nothing), then a main path ``linear -> gelu -> linear -> tanh``
    (ending in dropout when ``dropout``).

    Its recomputation at step ``armed``, or at every step when ``armed`` is ``None`` (its calls are counted in a
    list, which recomputation does not replay), has the defect ``defect``:

    - ``"scale"``: the region's input scaled by 1.01 in its first op;
    - ``"rows"``: the input's rows moved by one at the region's start;
    - ``"host_noise"``: NumPy noise (not replayed: host RNG is off) added in the first op, at every call;
    - ``"counter"``: the input scaled by its count of calls, at every call;
    - ``"side"``: the side branch's pre-activation scaled by 1.01, nothing else;
    - ``""``: none.
    """

    def __init__(self, defect: str = "", armed: int | None = -1, dropout: bool = False) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)
        self.side = nn.Linear(DIM, DIM)
        self.dropout = nn.Dropout(0.5) if dropout else nn.Identity()
        self.defect = defect
        self.armed = armed
        self.calls: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(1)
        calls = len(self.calls)
        recomputing_armed = calls % 2 == 0 if self.armed is None else calls == 2 * self.armed + 2
        if self.defect == "host_noise":
            x = x + torch.from_numpy(np.random.standard_normal(x.shape).astype(np.float32))
        elif self.defect == "counter":
            x = x * (1.0 + 0.01 * len(self.calls))
        elif recomputing_armed and self.defect == "scale":
            x = x * 1.01
        elif recomputing_armed and self.defect == "rows":
            x = x.roll(1, dims=0)
        side = self.side(x)
        if recomputing_armed and self.defect == "side":
            side = side * 1.01
        side = torch.sigmoid(side)
        main = self.dropout(torch.tanh(self.down(nn.functional.gelu(self.up(x)))))
        return x + main + side


def model_with(block: BranchedBlock, **config: object) -> nn.Module:
    torch.manual_seed(0)
    model = Stack([BranchedBlock(), block, BranchedBlock()])
    with torch.no_grad():
        block.load_state_dict(BranchedBlock(dropout=isinstance(block.dropout, nn.Dropout)).state_dict())
    apply_activation_checkpointing(model, CheckpointingConfig(names=["blocks.*"], **config))  # type: ignore[arg-type]
    return model


def mismatches_by_step(model: nn.Module, mode: str, steps: int = STEPS) -> list[int]:
    """The middle region's mismatches at each step, read step by step."""
    found = []
    with recomputation_sentinel(model, mode=mode) as sentinel:  # type: ignore[arg-type]
        for step in range(steps):
            sentinel.next_step()
            step_gradients(model, seed=step)
            found.append(sentinel.settle()["blocks.1"].mismatches)
    return found


AT_ITS_STEP = {
    "a redrawn dropout mask at the region's end": (BranchedBlock(dropout=True), {"preserve_rng_state": False}),
    "host noise in the region's first op": (BranchedBlock("host_noise"), {"preserve_host_rng": False}),
    # The last saved tensor is dropout's noise, which no value upstream reaches: the computed one before it does.
    "host noise in the first op of a region ending in dropout": (
        BranchedBlock("host_noise", dropout=True),
        {"preserve_host_rng": False},
    ),
    "a counter read in forward, the region ending in dropout": (BranchedBlock("counter", dropout=True), {}),
    "a counter read in forward": (BranchedBlock("counter"), {}),
}


@pytest.mark.parametrize("name", list(AT_ITS_STEP))
def test_the_light_tier_sees_a_defect_that_reaches_the_last_saved_tensors_at_every_step(name: str) -> None:
    block, config = AT_ITS_STEP[name]
    found = mismatches_by_step(model_with(block, **config), "light")
    assert all(count > 0 for count in found), found


@pytest.mark.parametrize("defect", ["scale", "rows"])
@pytest.mark.parametrize("armed", [1, 2, 3])
def test_the_light_tier_sees_a_one_step_defect_at_its_step_whatever_the_rotation(defect: str, armed: int) -> None:
    found = mismatches_by_step(model_with(BranchedBlock(defect, armed=armed)), "light")
    exact = mismatches_by_step(model_with(BranchedBlock(defect, armed=armed)), "exact")
    assert [count > 0 for count in found] == [count > 0 for count in exact] == [s == armed for s in range(STEPS)]


def test_a_change_confined_to_a_side_branch_is_seen_within_the_rotation_and_only_when_it_comes_round() -> None:
    # Ground truth for the rotation's length: the saved activations the sampled tier compares at one call.
    clean = model_with(BranchedBlock())
    with recomputation_sentinel(clean, mode="sampled") as sampled:
        step_gradients(clean, seed=0)
    activations = sampled.report().regions["blocks.1"].compared
    assert activations == 6
    steps = 2 * activations
    found = mismatches_by_step(model_with(BranchedBlock("side", armed=None)), "light", steps=steps)
    # Seen once per turn of the rotation, when the rotating position comes to the sigmoid's output.
    first = next(step for step, count in enumerate(found) if count)
    assert first < activations
    assert [step for step, count in enumerate(found) if count] == [first, first + activations]
    assert mismatches_by_step(model_with(BranchedBlock("side", armed=None)), "exact", steps=2) == [1, 1]


def test_clean_models_stay_at_zero_and_the_light_tier_compares_a_few_tensors_per_call() -> None:
    sampled = mismatches_by_step(model_with(BranchedBlock(dropout=True)), "sampled")
    assert sampled == [0] * STEPS
    model = model_with(BranchedBlock(dropout=True))
    with recomputation_sentinel(model, mode="light") as sentinel:
        for step in range(STEPS):
            sentinel.next_step()
            step_gradients(model, seed=step)
    report = sentinel.report()
    assert report.mismatches == 0
    # At most three per call (the last, the last floating-point one and the rotating one), at least one.
    assert all(STEPS <= region.compared <= 3 * STEPS for region in report.regions.values())


def test_a_call_on_another_code_path_is_compared_where_it_can_and_its_layout_learned_again() -> None:
    layout = SavedLayout(saved=4, compared=(0, 1, 3), floating=(0, 1))
    light = DigestMode("light", 0)
    assert layout.targets(light) == {3: light, 1: light, 0: light}
    # The rotating position's window moves on once per turn of the rotation.
    assert layout.targets(DigestMode("light", offset=5))[3] == DigestMode("light", 5)
    assert layout.targets(DigestMode("light", offset=6))[0] == DigestMode("light", 2)

    class TwoPaths(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(DIM, DIM)
            self.long = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.linear(x))
            return x + (torch.sigmoid(h) if self.long else h)

    torch.manual_seed(0)
    model = Stack([TwoPaths()])
    apply_activation_checkpointing(model, CheckpointingConfig(names=["blocks.*"]))
    x, _ = batch()
    with recomputation_sentinel(model, mode="light") as sentinel:
        for long in (False, True, True, False):
            model.blocks[0].long = long
            sentinel.next_step()
            model(x).sum().backward()
            assert sentinel.settle()["blocks.0"].mismatches == 0
    assert sentinel.report().regions["blocks.0"].compared >= 4


def test_exact_keeps_working_for_a_release_with_a_deprecation_warning_and_modes_are_checked() -> None:
    model = model_with(BranchedBlock())
    with pytest.warns(FutureWarning, match=r"`exact=` is deprecated .* `mode=\"exact\"`"):
        assert RecomputationSentinel(model, exact=True).tier == "exact"
    with pytest.warns(FutureWarning, match="`exact=` is deprecated"), recomputation_sentinel(model, exact=False) as old:
        assert old.tier == "sampled"
    assert RecomputationSentinel(model).tier == "light"
    with pytest.raises(ValueError, match="`mode` can be light, sampled, exact, got 'every'"):
        RecomputationSentinel(model, mode="every")  # type: ignore[arg-type]


class WeightLast(nn.Module):
    """Host noise in its first op (not replayed: host RNG is off), then a linear layer whose saved weight autograd
    computed from parameters alone: its cast to bfloat16 under ``torch.autocast``, or a weight-norm weight. The weight
    is saved last, and no value of the call reaches it."""

    def __init__(self, weight: str) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        if weight == "weight norm":
            nn.utils.parametrizations.weight_norm(self.linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.tanh(x * float(1 + np.random.rand())))


@pytest.mark.parametrize("weight", ["autocast cast", "weight norm"])
def test_the_light_tier_never_spends_a_fixed_target_on_a_weight_computed_from_parameters_alone(weight: str) -> None:
    def found_by_step(mode: str) -> list[tuple[int, int]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(DIM, DIM), WeightLast(weight))
        apply_activation_checkpointing(model, CheckpointingConfig(names=["1"], preserve_host_rng=False))
        found = []
        with recomputation_sentinel(model, mode=mode) as sentinel:  # type: ignore[arg-type]
            for step in range(STEPS):
                sentinel.next_step()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=weight == "autocast cast"):
                    out = model(batch(seed=step)[0])
                out.float().pow(2).sum().backward()
                region = sentinel.settle()["1"]
                found.append((region.compared, region.mismatches))
        return found

    # Ground truth: the exact tier sees the noise at every step.
    assert all(mismatches > 0 for _, mismatches in found_by_step("exact"))
    assert all(mismatches > 0 for _, mismatches in found_by_step("light"))


class FlippingBranched(BranchedBlock):
    """:class:`BranchedBlock`, its input first through one more op while ``long`` (``cos`` saves its input: one more
    saved tensor, ahead of the others and independent of the side branch)."""

    long = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x + torch.cos(x) if self.long else x)


def test_a_side_branch_change_is_seen_in_a_region_whose_path_flips_every_step() -> None:
    # The region never keeps one layout (its calls alternate paths), so no layout's rotation reaches the side
    # branch: each call digests one more position drawn in turn by a hash instead.
    steps = 48
    # Every step but the first on the new path, which is learned, not compared (`on_new_paths`).
    for mode, least in (("sampled", steps - 1), ("light", 4)):
        model = model_with(FlippingBranched("side", armed=None))
        found = []
        with recomputation_sentinel(model, mode=mode) as sentinel:  # type: ignore[arg-type]
            for step in range(steps):
                model.blocks[1].long = step % 2 == 1
                sentinel.next_step()
                step_gradients(model, seed=step)
                found.append(sentinel.settle()["blocks.1"].mismatches)
        seen = [step for step, count in enumerate(found) if count]
        assert len(seen) >= least, (mode, seen)
        assert {step % 2 for step in seen} == {0, 1}  # on both paths
    clean = model_with(FlippingBranched())
    with recomputation_sentinel(clean, mode="light") as sentinel:
        for step in range(steps):
            clean.blocks[1].long = step % 2 == 1
            sentinel.next_step()
            step_gradients(clean, seed=step)
    assert sentinel.report().mismatches == 0
