"""The sentinel (`lightning_ckpt_determinism.verify.sentinel`): each region's recomputed saved tensors compared with
the forward's through digests, without Lightning."""

import copy
import random
from collections.abc import Callable
from typing import Any, get_args

import numpy as np
import pytest
import torch
import torch._dynamo
from torch import nn
from torch.nn import functional as F

from examples.moe import MoEModule
from lightning_ckpt_determinism import (
    CheckpointingConfig,
    SentinelRegion,
    apply_activation_checkpointing,
    recomputation_sentinel,
)
from lightning_ckpt_determinism.verify import digest as digest_module
from lightning_ckpt_determinism.verify.digest import SAMPLE_STRIDE, DigestPlans, DigestTier
from tests.helpers import (
    DIM,
    BatchNormBlock,
    CounterScaleBlock,
    DropoutBlock,
    KeywordTupleBlock,
    MLPBlock,
    NumpyNoiseBlock,
    PartsBlock,
    PlainBlock,
    PythonRandomBlock,
    RecomputeOnlyBlock,
    Stack,
    batch,
    make_stack,
    stack_with,
    step_gradients,
)

REGIONS = ["blocks.0", "blocks.1", "blocks.2"]
MODES = get_args(DigestTier)


def checkpointed(model: nn.Module, **config: Any) -> nn.Module:
    apply_activation_checkpointing(model, CheckpointingConfig(names=["blocks.*"], **config))
    return model


def watched_steps(
    model: nn.Module, steps: int = 3, mode: str = "sampled", loss: Callable[[], Any] | None = None
) -> Any:
    """The sentinel's report over ``steps`` forward and backward passes of ``model``."""
    with recomputation_sentinel(model, mode=mode) as sentinel:
        for step in range(steps):
            if loss is None:
                step_gradients(model, seed=step)
            else:
                loss().backward()
            sentinel.next_step()
    return sentinel.report()


CLEAN = {
    "dropout": (DropoutBlock, {}),
    "batchnorm": (BatchNormBlock, {}),
    "save_ops": (DropoutBlock, {"save_ops": ["aten.addmm"]}),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CLEAN))
def test_a_clean_model_compares_every_region_and_finds_nothing(name: str, mode: str) -> None:
    block, config = CLEAN[name]
    report = watched_steps(checkpointed(make_stack(block), **config), mode=mode)
    assert list(report.regions) == REGIONS
    assert report.mismatches == 0
    assert all(region.compared > 0 and region.first_mismatch is None for region in report.regions.values())
    assert report.compared == sum(region.compared for region in report.regions.values())


class KeywordModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([KeywordTupleBlock(), KeywordTupleBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x, extra = block(x, scale=torch.full_like(x, 0.5))
            x = x + extra["aux"]
        return x


@pytest.mark.parametrize("mode", MODES)
def test_a_block_with_keyword_inputs_and_a_tuple_and_dict_output_is_compared_clean(mode: str) -> None:
    model = checkpointed(KeywordModel())
    x, _ = batch()
    report = watched_steps(model, mode=mode, loss=lambda: model(x).square().mean())
    assert report.mismatches == 0 and all(region.compared > 0 for region in report.regions.values())


@pytest.mark.parametrize("mode", MODES)
def test_a_top_k_mixture_of_experts_with_its_routing_kept_is_compared_clean(mode: str) -> None:
    torch.manual_seed(0)
    module = MoEModule(blocks=2, dim=8)
    apply_activation_checkpointing(module, CheckpointingConfig(classes=["MoEBlock"], keep_data_dependent=True))
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    report = watched_steps(module, mode=mode, loss=lambda: module(x).square().mean())
    assert report.mismatches == 0 and all(region.compared > 0 for region in report.regions.values())


DEFECTS = {
    "rng_not_preserved": (DropoutBlock, {"preserve_rng_state": False}),
    "numpy_noise": (NumpyNoiseBlock, {}),
    "python_random": (PythonRandomBlock, {}),
    "counter": (CounterScaleBlock, {}),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(DEFECTS))
def test_a_defect_shows_in_its_region_only(name: str, mode: str) -> None:
    block, config = DEFECTS[name]
    report = watched_steps(checkpointed(stack_with(block), **config), mode=mode)
    assert [region.mismatches > 0 for region in report.regions.values()] == [False, True, False]
    first = report.regions["blocks.1"].first_mismatch
    assert first is not None and first.startswith("the ") and " tensor the region saved (" in first
    assert first.endswith(", float32)")
    assert report.mismatches == report.regions["blocks.1"].mismatches


@pytest.mark.parametrize("mode", MODES)
def test_buffers_recomputation_updates_again_are_mismatches_with_their_cause_unless_protected(mode: str) -> None:
    report = watched_steps(checkpointed(stack_with(BatchNormBlock), protect_buffers=False), mode=mode)
    region = report.regions["blocks.1"]
    # Three buffers a step (two statistics and the count), every step, in the region that holds them.
    assert [other.mismatches for other in report.regions.values()] == [0, 9, 0]
    assert (region.first_mismatch, region.cause) == (
        "buffer `blocks.1.norm.running_mean` changed by recomputation",
        "buffer_mutation",
    )
    protected = watched_steps(checkpointed(stack_with(BatchNormBlock)), mode=mode)
    assert protected.mismatches == 0


def stepped_before_backward(model: nn.Module, mode: str = "light") -> Any:
    """A GAN's bug: the discriminator's optimizer steps between its forward and the generator's backward through it.
    The sentinel's report."""
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(1), requires_grad=True)
    optimizer = torch.optim.SGD(model.blocks.parameters(), lr=0.5)
    with recomputation_sentinel(model, mode=mode) as sentinel:
        out = model(x)
        out.square().sum().backward(retain_graph=True)
        optimizer.step()  # the weights the graph of `out` was built from, written in place
        model(x)  # the regions run again at the new weights (a forward on the real batch) before the backward
        out.sum().backward()
        sentinel.next_step()
    return sentinel.report()


@pytest.mark.parametrize("mode", MODES)
def test_parameters_an_optimizer_writes_between_forward_and_recomputation_are_named_as_the_cause(mode: str) -> None:
    plain = make_stack(PlainBlock)  # a GAN's discriminator
    model = checkpointed(copy.deepcopy(plain))
    # Without checkpointing, torch refuses the backward through the stepped weights; with it, the gradients are wrong.
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        stepped_before_backward(plain)
    report = stepped_before_backward(model, mode)
    assert report.mismatches > 0
    for name in REGIONS:
        region = report.regions[name]
        assert region.cause == "parameter_write"
        assert region.first_mismatch is not None
        assert region.first_mismatch.endswith(
            f"recomputed after `{name}.linear.weight`, `{name}.linear.bias` changed in place since the region's"
            " forward (by its forward, or by code between the forward and this backward, such as an optimizer step)"
        )


def test_a_mismatch_with_the_parameters_untouched_since_the_forward_has_no_cause_of_the_sentinels() -> None:
    report = watched_steps(checkpointed(stack_with(NumpyNoiseBlock)), mode="exact")
    region = report.regions["blocks.1"]
    assert region.mismatches > 0 and region.cause is None
    assert region.first_mismatch is not None and "changed in place" not in region.first_mismatch


@pytest.mark.parametrize("mode", MODES)
def test_modules_swapped_into_a_watched_region_are_watched_as_the_region_holds_them(mode: str) -> None:
    model = checkpointed(make_stack(PartsBlock))
    found = []
    with recomputation_sentinel(model, mode=mode) as sentinel:
        for step in range(6):
            if step == 1:  # a norm whose statistics its forward updates in place, which recomputation puts back
                model.blocks[1].parts[1] = nn.BatchNorm1d(DIM)
            if step == 3:  # a part drawing NumPy noise, which recomputation draws again
                model.blocks[2].parts[1] = NumpyNoiseBlock()
            step_gradients(model, seed=step)
            sentinel.next_step()
            found.append([region.mismatches for region in sentinel.report().regions.values()])
    # The norm's statistics are buffers: never compared, never a mismatch; the noise is one from its first step on.
    assert [counts[:2] for counts in found] == [[0, 0]] * 6
    assert [counts[2] > 0 for counts in found] == [False, False, False, True, True, True]


def test_rows_moved_to_other_places_in_recomputation_are_caught_by_the_default_digest() -> None:
    report = watched_steps(checkpointed(stack_with(lambda: RecomputeOnlyBlock(change="rows"))), steps=1, mode="sampled")
    # tanh's output, saved by tanh and by the linear layer after it; the region's input and weights are exact.
    assert [region.mismatches for region in report.regions.values()] == [0, 2, 0]
    assert report.regions["blocks.1"].compared == 3
    assert (
        report.regions["blocks.1"].first_mismatch
        == "the 3rd tensor the region saved (made by `TanhBackward0`, shape (16, 32), float32)"
    )


def test_one_changed_element_is_caught_exactly_and_by_the_sample_once_its_offset_reads_it() -> None:
    model = checkpointed(stack_with(lambda: RecomputeOnlyBlock(change="element")))
    assert watched_steps(model, steps=1, mode="exact").regions["blocks.1"].mismatches == 2
    # The sample reads the window `offset` of each row, two of its 32 columns: the changed column 5 at offset 2.
    with recomputation_sentinel(model, mode="sampled") as sentinel:
        found = []
        for _ in range(SAMPLE_STRIDE):
            step_gradients(model)
            found.append(sentinel.settle()["blocks.1"].mismatches)
            sentinel.next_step()
    assert found == [0] * 2 + [2] + [0] * (SAMPLE_STRIDE - 3)


def test_every_region_is_reported_even_with_nothing_compared_and_the_report_lasts_after_the_block() -> None:
    model = checkpointed(make_stack(PlainBlock))
    with recomputation_sentinel(model) as sentinel:
        pass
    assert sentinel.report().regions == dict.fromkeys(REGIONS, SentinelRegion())
    step_gradients(model)  # outside the block: nothing digested
    assert sentinel.report().compared == 0


def _state_after_a_step(watch: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor, Any, Any]:
    model = checkpointed(make_stack(DropoutBlock))
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    with recomputation_sentinel(model) if watch else torch.enable_grad():
        grads = step_gradients(model)
    return grads, torch.get_rng_state(), np.random.get_state()[1], random.getstate()


def test_the_sentinel_changes_no_gradient_and_no_random_stream() -> None:
    watched, plain = _state_after_a_step(watch=True), _state_after_a_step(watch=False)
    assert watched[0].keys() == plain[0].keys()
    assert all(torch.equal(watched[0][name], plain[0][name]) for name in plain[0])
    assert torch.equal(watched[1], plain[1])
    assert np.array_equal(watched[2], plain[2]) and watched[3] == plain[3]


def test_parameters_and_buffers_saved_by_reference_are_left_out() -> None:
    model = checkpointed(make_stack(BatchNormBlock))
    with recomputation_sentinel(model, mode="exact") as sentinel:
        step_gradients(model)
        saved = sentinel.saved_bytes
    activations = sum(value for value in saved.values())
    # A BatchNorm block on a (16, 8) batch saves activations of a few (16, 8) tensors and (8,) statistics; its
    # weights (8 x 8 and 8) and running statistics are saved by reference and not counted.
    assert 0 < activations < 3 * 12 * 16 * 8 * 4
    assert sentinel.report().mismatches == 0


class GraphBreakingPlainBlock(PlainBlock):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return super().forward(x)


def test_compiled_regions_are_not_compared_and_those_that_graph_break_are() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = checkpointed(Stack([PlainBlock(), GraphBreakingPlainBlock(), PlainBlock()]))
    compiled = torch.compile(model, backend="aot_eager")
    with recomputation_sentinel(compiled) as sentinel:
        x, y = batch()
        F.mse_loss(compiled(x), y).backward()
    report = sentinel.report()
    torch._dynamo.reset()
    assert report.compiled == REGIONS
    assert [region.compared > 0 for region in report.regions.values()] == [False, True, False]
    assert report.mismatches == 0


class SummingBlock(PlainBlock):
    """A block whose forward sums rows, an op a selective-checkpointing policy may save."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.linear(x))
        return torch.tanh(h * h.sum(dim=-1, keepdim=True))


@pytest.mark.parametrize("mode", MODES)
def test_the_sentinels_own_ops_never_enter_the_regions_selective_checkpointing_cache(mode: str) -> None:
    # With `aten.sum` saved by the policy, a digest's row sums taken at the forward would be served to the
    # recomputation's own sums, were the cache's dispatch mode to see them.
    def gradients(watch: bool) -> tuple[dict[str, torch.Tensor], int]:
        torch.manual_seed(0)
        model = checkpointed(make_stack(SummingBlock), save_ops=["aten.sum"])
        if not watch:
            return step_gradients(model), 0
        with recomputation_sentinel(model, mode=mode) as sentinel:
            grads = step_gradients(model)
        assert sentinel.report().mismatches == 0
        return grads, sentinel.report().compared

    (watched, compared), (plain, _) = gradients(watch=True), gradients(watch=False)
    assert compared > 0
    assert watched.keys() == plain.keys() and all(torch.equal(watched[name], plain[name]) for name in plain)


class TwoHeadedBlock(nn.Module):
    """Returns two outputs; the second, computed last, is left unused by the caller, so the holders of what it saved
    are freed before backward and torch's comparison skips them."""

    def __init__(self, noisy: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.noisy = noisy

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        used = torch.tanh(self.linear(x) * (float(np.random.rand()) if self.noisy else 1.0))
        return used, torch.sigmoid(used * 2)


class UsingFirstHead(nn.Module):
    def __init__(self, noisy: bool) -> None:
        super().__init__()
        self.block = TwoHeadedBlock(noisy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        used, _ = self.block(x)
        return used


@pytest.mark.parametrize("noisy", [False, True], ids=["clean", "noisy"])
def test_a_recomputation_whose_last_saved_tensor_was_freed_is_still_compared(noisy: bool) -> None:
    model = UsingFirstHead(noisy)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["block"]))
    with recomputation_sentinel(model, mode="exact") as sentinel:
        x, y = batch()
        F.mse_loss(model(x).sum(-1, keepdim=True), y).backward()
        report = sentinel.report()
    # The input and tanh's output are compared; the sigmoid's output, saved last, was never recomputed in time.
    assert report.regions["block"].compared == 2
    assert report.regions["block"].mismatches == (1 if noisy else 0)


def test_a_sentinel_counts_only_its_own_models_regions_when_another_has_the_same_names() -> None:
    # Ground truth: the clean model watched alone. The other model's regions have the same names and a host-RNG
    # defect; its forwards and backwards interleave with the watched model's.
    alone = watched_steps(checkpointed(make_stack(DropoutBlock)), mode="exact")
    model, other = checkpointed(make_stack(DropoutBlock)), checkpointed(stack_with(NumpyNoiseBlock))
    with recomputation_sentinel(model, mode="exact") as sentinel:
        for step in range(3):
            x, y = batch(seed=step)
            loss = F.mse_loss(model(x), y)
            other_loss = F.mse_loss(other(x), y)
            other_loss.backward()
            loss.backward()
            sentinel.next_step()
    assert alone.compared > 0 and alone.mismatches == 0
    assert sentinel.report() == alone
    assert watched_steps(other, mode="exact").regions["blocks.1"].mismatches > 0


def _by_row_and_column_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every digest is weighed from its matrix's row and column sums, none in one pass (the ground truth of the
    one-pass digests)."""
    monkeypatch.setattr(digest_module, "ONE_PASS_WORDS", -1)
    monkeypatch.setattr(digest_module, "ONE_PASS_WORDS_OFF_CPU", -1)


def _counting_weighings(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many tensors each weighing of several tensors' sums into digests took, in order."""
    counted: list[int] = []
    weighed = DigestPlans.combined

    def counting(self: DigestPlans, found: Any) -> torch.Tensor:
        counted.append(len(found))
        return weighed(self, found)

    monkeypatch.setattr(DigestPlans, "combined", counting)
    return counted


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block", [DropoutBlock, CounterScaleBlock], ids=["clean", "counter"])
def test_each_tier_reports_with_one_pass_digests_what_it_reports_with_digests_weighed_from_sums(
    block: Callable[[], nn.Module], mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    weighings = _counting_weighings(monkeypatch)
    one_pass = watched_steps(checkpointed(stack_with(block)), mode=mode)
    # This stack's saved tensors are small: each is digested in one pass, and none weighed with others.
    assert weighings == []
    _by_row_and_column_sums(monkeypatch)
    from_sums = watched_steps(checkpointed(stack_with(block)), mode=mode)
    # From sums, each region call's forward and each recomputation weighs its tensors' together (three regions,
    # three steps).
    assert len(weighings) == 3 * 3 * 2
    assert one_pass == from_sums and one_pass.compared > 0
    assert [region.mismatches > 0 for region in one_pass.regions.values()] == [False, block is CounterScaleBlock, False]


class NoisyMLPBlock(MLPBlock):
    """An MLP block whose hidden activation gets NumPy noise, drawn again by recomputation."""

    noise = True


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block", [MLPBlock, NoisyMLPBlock], ids=["clean", "noise"])
def test_a_call_whose_tensors_are_digested_some_in_one_pass_some_from_sums_reports_the_same(
    block: Callable[[], nn.Module], mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def report(one_pass_words: int) -> Any:
        monkeypatch.setattr(digest_module, "ONE_PASS_WORDS", one_pass_words)
        np.random.seed(0)
        return watched_steps(checkpointed(stack_with(block)), mode=mode)

    weighings = _counting_weighings(monkeypatch)
    # The MLP block saves tensors of its width and of twice its width (64 and 128 words): a bound between them digests
    # the first in one pass and weighs the others from their sums, in one call (its forward and its recomputation,
    # three steps), while the plain blocks' calls keep a digest each: the step compares both kinds together.
    mixed = report(100)
    assert len(weighings) == 3 * 2
    assert mixed == report(digest_module.ONE_PASS_WORDS) == report(-1)
    assert mixed.compared > 0
    assert [region.mismatches > 0 for region in mixed.regions.values()] == [False, block is NoisyMLPBlock, False]


def test_a_recomputation_that_compares_only_the_forwards_small_tensors_is_compared_with_the_forwards_weighed_digests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(digest_module, "ONE_PASS_WORDS", 100)
    every = watched_steps(checkpointed(stack_with(MLPBlock)), steps=1, mode="exact")
    # The recomputation fails to read the MLP block's large tensors (128 words): it compares its small ones, each
    # digested in one pass, against the forward's, which weighed its large and small ones into one vector.
    digest_or_sums = DigestPlans.digest_or_sums

    def failing_large_recomputed(self: DigestPlans, matrix: torch.Tensor) -> Any:
        if recomputing and matrix.numel() > 100:
            raise RuntimeError("injected")
        return digest_or_sums(self, matrix)

    recomputing = False
    monkeypatch.setattr(DigestPlans, "digest_or_sums", failing_large_recomputed)
    model = checkpointed(stack_with(MLPBlock))
    with recomputation_sentinel(model, mode="exact") as sentinel:
        loss = F.mse_loss(*_outputs_and_targets(model))
        recomputing = True
        loss.backward()
    report = sentinel.report()
    assert sentinel.failure is None
    left_out = every.regions["blocks.1"].compared - report.regions["blocks.1"].compared
    assert left_out > 0 and report.regions["blocks.1"].not_compared == left_out
    assert report.regions["blocks.1"].compared > 0 and report.compared == every.compared - left_out
    # The same values in the two forms compare equal: a digest each, stacked, against the forward's vector.
    assert report.mismatches == 0


def _outputs_and_targets(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(seed=0)
    return model(x), y


@pytest.mark.parametrize("mode", ["light", "exact"])
@pytest.mark.parametrize("block", [DropoutBlock, CounterScaleBlock], ids=["clean", "counter"])
def test_a_call_recomputed_twice_in_a_step_is_compared_at_each_recomputation(
    block: Callable[[], nn.Module], mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def backward_twice() -> Any:
        model = checkpointed(stack_with(block))
        x, y = batch()
        with recomputation_sentinel(model, mode=mode) as sentinel:
            loss = F.mse_loss(model(x), y)
            loss.backward(retain_graph=True)
            loss.backward()
        return sentinel.report()

    once = watched_steps(checkpointed(stack_with(block)), steps=1, mode=mode)
    by_step = backward_twice()
    _by_row_and_column_sums(monkeypatch)
    assert backward_twice() == by_step
    assert by_step.compared == 2 * once.compared > 0
    assert by_step.regions["blocks.1"].mismatches == 2 * once.regions["blocks.1"].mismatches
    assert (by_step.mismatches > 0) == (block is CounterScaleBlock)


@pytest.mark.parametrize("mode", ["light", "exact"])
@pytest.mark.parametrize("block", [DropoutBlock, CounterScaleBlock], ids=["clean", "counter"])
def test_a_recomputation_after_its_forwards_step_ended_is_counted_in_the_step_it_runs_in(
    block: Callable[[], nn.Module], mode: str
) -> None:
    once = watched_steps(checkpointed(stack_with(block)), steps=1, mode=mode).regions["blocks.1"]
    assert once.compared > 0
    model = checkpointed(stack_with(block))
    x, y = batch()
    with recomputation_sentinel(model, mode=mode) as sentinel:
        loss = F.mse_loss(model(x), y)
        loss.backward(retain_graph=True)
        first = sentinel.settle()["blocks.1"]
        sentinel.next_step()
        loss.backward()  # the graph kept: recomputed again, in the next step
        second = sentinel.settle()["blocks.1"]
        sentinel.next_step()
        late = F.mse_loss(model(x), y)
        before = sentinel.settle()["blocks.1"]
        late.backward()  # a forward in one step, its backward in the next
        after = sentinel.settle()["blocks.1"]
    counted = [first, second, after]
    assert [(region.compared > 0, region.mismatches > 0) for region in counted] == [
        (True, block is CounterScaleBlock)
    ] * 3
    if mode == "exact":  # the light tier's targets rotate from step to step
        assert first == second == once and after.compared == once.compared
    assert (before.compared, before.mismatches) == (0, 0)
    assert sentinel.report().regions["blocks.1"].compared == sum(region.compared for region in counted)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block", [DropoutBlock, CounterScaleBlock], ids=["clean", "counter"])
def test_on_cuda_each_tier_finds_what_it_finds_on_the_cpu_in_one_pass_or_from_sums(
    block: Callable[[], nn.Module], mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def report_on(device: str) -> Any:
        model = checkpointed(stack_with(block).to(device))
        x, y = (tensor.to(device) for tensor in batch())
        return watched_steps(model, mode=mode, loss=lambda: F.mse_loss(model(x), y))

    on_cpu = report_on("cpu")
    by_step = report_on("cuda")
    _by_row_and_column_sums(monkeypatch)
    assert report_on("cuda") == by_step
    assert [region.mismatches for region in by_step.regions.values()] == [
        region.mismatches for region in on_cpu.regions.values()
    ]
    assert [region.mismatches > 0 for region in by_step.regions.values()] == [False, block is CounterScaleBlock, False]
    # Every saved tensor is compared on both devices; the light tier's fixed targets differ where the devices save
    # different dtypes (CUDA's dropout saves a boolean mask, the CPU's a floating-point one).
    assert by_step.compared > 0 and (mode == "light" or by_step.compared == on_cpu.compared)


class NormedBlock(nn.Module):
    """A linear layer, a BatchNorm (which saves its running statistics for backward), tanh."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.norm = nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(self.linear(x)))


def _new_statistics(model: nn.Module) -> None:
    norm = model[1].norm
    norm.running_mean, norm.running_var = norm.running_mean.clone(), norm.running_var.clone()


@pytest.mark.parametrize("how", ["reassigned", "cast"])
@pytest.mark.parametrize("mode", ["sampled", "exact"])
def test_buffers_given_new_tensors_between_steps_are_still_state_for_a_sentinel_left_open(how: str, mode: str) -> None:
    # `model.double()`, `load_state_dict(assign=True)` or an assignment give the statistics new tensors: the
    # sentinel, open across steps as the monitor's is, must find them as buffers again, not digest them as activations.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 16), NormedBlock(), nn.Linear(16, 4))
    model = copy.deepcopy(plain)
    apply_activation_checkpointing(model, CheckpointingConfig(classes=["NormedBlock"]))
    xs = torch.randn(5, 6, 8, generator=torch.Generator().manual_seed(1))
    with recomputation_sentinel(model, mode=mode) as sentinel:  # type: ignore[arg-type]
        for step, x in enumerate(xs):
            if step == 2:
                for net in (model, plain):
                    net.double() if how == "cast" else _new_statistics(net)
            grads = []
            for net in (model, plain):
                net.zero_grad()
                net(x.to(next(net.parameters()).dtype)).square().mean().backward()
                grads.append([param.grad for param in net.parameters()] + list(net.buffers()))
            assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))  # ground truth: exact throughout
            sentinel.next_step()
        report = sentinel.report()
    assert report.mismatches == 0 < report.compared
