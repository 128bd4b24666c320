"""Tests for `lightning_ckpt_determinism.checkpointing`: selection, in-place wrapping, and what recomputation
reproduces."""

import copy
import pickle
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointError

from examples.gpt import GPT, Block
from lightning_ckpt_determinism import (
    CheckpointingConfig,
    CheckpointingConfigError,
    LightningCkptDeterminismWarning,
    apply_activation_checkpointing,
    checkpoint_module,
    checkpointed_modules,
    checkpointing_disabled,
    remove_activation_checkpointing,
)
from lightning_ckpt_determinism.checkpointing import select_modules
from lightning_ckpt_determinism.checkpointing import wrapper as wrapping_module
from lightning_ckpt_determinism.checkpointing.determinism_check import DETERMINISM_CHECKS
from lightning_ckpt_determinism.errors import CheckpointingTypeError
from tests.helpers import (
    DIM,
    BatchNormBlock,
    CounterBlock,
    DictOutputBlock,
    DropoutBlock,
    KeywordBlock,
    LiveStorages,
    NumpyNoiseBlock,
    OpCounter,
    PerChannelQuantBlock,
    PlainBlock,
    RoutingBlock,
    ScaledLinear,
    Stack,
    StackModule,
    TupleOutputBlock,
    batch,
    gradients_of,
    make_stack,
    step_gradients,
)

BLOCKS = ["blocks.0", "blocks.1", "blocks.2"]
SAVE_MATMULS = ["aten.mm", "aten.addmm", "aten.bmm"]

DEFAULT_CHECK, NONE_CHECK = DETERMINISM_CHECKS["default"], DETERMINISM_CHECKS["none"]


def _unequal(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> list[str]:
    assert first.keys() == second.keys()
    return [name for name in first if not torch.equal(first[name], second[name])]


def _checkpointed(model: nn.Module, config: CheckpointingConfig) -> nn.Module:
    apply_activation_checkpointing(model, config)
    return model


def _calls_per_step(model: nn.Module) -> list[int]:
    """Forward calls of each ``CounterBlock`` of a stack during one forward and backward."""
    for block in model.blocks:
        block.calls = []
    x, y = batch()
    F.mse_loss(model(x), y).backward()
    return [len(block.calls) for block in model.blocks]


# Dropout: torch's RNG replay.


def test_checkpointed_dropout_gradients_equal_unchecked_bit_for_bit() -> None:
    reference = step_gradients(make_stack(DropoutBlock))
    model = make_stack(DropoutBlock)
    assert apply_activation_checkpointing(model, CheckpointingConfig(classes=["DropoutBlock"])) == BLOCKS
    assert _unequal(reference, step_gradients(model)) == []


def test_dropout_gradients_differ_without_rng_preservation() -> None:
    reference = step_gradients(make_stack(DropoutBlock))
    config = CheckpointingConfig(classes=["DropoutBlock"], preserve_rng_state=False)
    differing = _unequal(reference, step_gradients(_checkpointed(make_stack(DropoutBlock), config)))
    # The head sees the block outputs of the original forward; everything before it sees new dropout masks.
    assert differing == [name for name in reference if not name.startswith("head.")]


# Memory: bytes saved for backward.


def _gpt(layers: int = 6) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=32, seq_len=16, dim=32, heads=4, layers=layers, dropout=0.1)


def _tokens() -> torch.Tensor:
    return torch.randint(32, (4, 16), generator=torch.Generator().manual_seed(0))


def _bytes_saved_for_backward(model: nn.Module) -> int:
    """Bytes the forward hands autograd to keep; tensors saved inside a checkpointed region never reach this hook."""
    packed: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(_tokens())
    return sum(packed)


def test_checkpointing_blocks_reduces_bytes_saved_and_every_second_block_saves_half() -> None:
    unchecked = _bytes_saved_for_backward(_gpt())
    every_block = _bytes_saved_for_backward(_checkpointed(_gpt(), CheckpointingConfig(classes=["Block"])))
    every_second = _bytes_saved_for_backward(_checkpointed(_gpt(), CheckpointingConfig(classes=["Block"], every_n=2)))
    assert unchecked > every_second > every_block
    assert every_block < unchecked // 10
    # The six blocks are identical, so checkpointing three of them saves exactly half of what six save.
    assert unchecked - every_second == (unchecked - every_block) // 2


# Selective checkpointing: `save_ops`.


@dataclass
class _GPTStep:
    live_bytes: int
    backward_ops: Counter[str]
    gradients: dict[str, torch.Tensor]


def _gpt_step(config: CheckpointingConfig | None) -> _GPTStep:
    model = _gpt()
    if config is not None:
        apply_activation_checkpointing(model, config)
    torch.manual_seed(3)
    with LiveStorages() as storages:
        logits = model(_tokens())
    live_bytes = storages.live_bytes()
    with OpCounter() as ops:
        logits.square().mean().backward()
    gradients = {name: param.grad for name, param in model.named_parameters()}
    return _GPTStep(live_bytes, ops.counts, gradients)


def test_example_block_runs_its_matmuls_as_addmm_and_bmm_on_cpu() -> None:
    block = _gpt(layers=1).blocks[0]
    with OpCounter() as ops:
        block(torch.randn(2, 16, 32))
    linears = sum(isinstance(sub, nn.Linear) for sub in block.modules())
    assert linears == 4
    assert (ops.counts["aten.addmm"], ops.counts["aten.bmm"], ops.counts["aten.mm"]) == (linears, 2, 0)


def test_save_ops_keeps_matmul_outputs_instead_of_recomputing_them() -> None:
    unchecked = _gpt_step(None)
    full = _gpt_step(CheckpointingConfig(classes=["Block"]))
    selective = _gpt_step(CheckpointingConfig(classes=["Block"], save_ops=SAVE_MATMULS))
    block_linears = 6 * 4

    assert full.backward_ops["aten.addmm"] == block_linears
    assert full.backward_ops["aten.bmm"] == unchecked.backward_ops["aten.bmm"] + 6 * 2
    for op in SAVE_MATMULS:
        assert selective.backward_ops[op] == unchecked.backward_ops[op], op
    # Only the cheap ops run again, e.g. one GELU per block.
    assert (unchecked.backward_ops["aten.gelu"], selective.backward_ops["aten.gelu"]) == (0, 6)
    assert sum(selective.backward_ops.values()) < sum(full.backward_ops.values())

    assert unchecked.live_bytes > selective.live_bytes > full.live_bytes
    assert _unequal(unchecked.gradients, full.gradients) == []
    assert _unequal(unchecked.gradients, selective.gradients) == []


class _MatmulIntoABuffer(nn.Module):
    """A block that multiplies its input by a fixed matrix with `torch.mm(..., out=...)` before its linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("mix", torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixed = torch.empty(x.shape[0], 8)
        torch.mm(x, self.mix, out=mixed)
        return torch.sin(self.linear(mixed))


def test_save_ops_recomputes_what_a_forward_calls_in_its_out_form() -> None:
    torch.manual_seed(0)
    plain = _MatmulIntoABuffer()
    model = copy.deepcopy(plain)
    checkpoint_module(model, "block", CheckpointingConfig(classes=["_MatmulIntoABuffer"], save_ops=["aten.mm"]))
    x = torch.randn(4, 8)
    for twin in (plain, model):
        twin(x).sum().backward()
    gradients = {name: parameter.grad for name, parameter in plain.named_parameters()}
    assert _unequal(gradients, {name: parameter.grad for name, parameter in model.named_parameters()}) == []


@torch.library.custom_op("lightning_ckpt_determinism_tests::tracked_tanh", mutates_args=("state",))
def _tracked_tanh(x: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
    """tanh, with a running mean of its input kept in ``state`` when given: writes state, returns a new tensor."""
    if state is not None:
        state.mul_(0.9).add_(0.1 * x.mean(0))
    return torch.tanh(x)


class _TrackedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("state", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        return torch.tanh(h) * _tracked_tanh(h.detach(), self.state)


def test_save_ops_keeps_an_op_that_writes_an_optional_state_and_returns_a_new_tensor() -> None:
    # Its written argument is an optional tensor: it was taken for an `out=` form and the entry refused.
    torch.manual_seed(0)
    plain = _TrackedBlock()
    model = copy.deepcopy(plain)
    config = CheckpointingConfig(classes=["_TrackedBlock"], save_ops=["lightning_ckpt_determinism_tests.tracked_tanh"])
    checkpoint_module(model, "block", config)
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        with OpCounter() as ops:
            for twin in (plain, model):
                twin.zero_grad()
                twin(x).sum().backward()
        # Kept: run once by each twin's forward, never again by the recomputation.
        assert ops.counts["lightning_ckpt_determinism_tests.tracked_tanh"] == 2
        grads = [{name: p.grad for name, p in twin.named_parameters()} for twin in (plain, model)]
        assert _unequal(*grads) == []
        assert torch.equal(plain.state, model.state)


# Buffers: BatchNorm running statistics.


def _buffers_after_step(model: nn.Module) -> dict[str, torch.Tensor]:
    step_gradients(model)
    return {name: buffer.clone() for name, buffer in model.named_buffers()}


def test_protected_buffers_update_once_per_step_as_without_checkpointing() -> None:
    reference = _buffers_after_step(make_stack(BatchNormBlock))
    model = _checkpointed(make_stack(BatchNormBlock), CheckpointingConfig(classes=["BatchNormBlock"]))
    buffers = _buffers_after_step(model)
    assert [reference[f"{block}.norm.num_batches_tracked"].item() for block in BLOCKS] == [1, 1, 1]
    assert _unequal(reference, buffers) == []


def test_unprotected_buffers_are_updated_again_by_recomputation() -> None:
    reference = _buffers_after_step(make_stack(BatchNormBlock))
    config = CheckpointingConfig(classes=["BatchNormBlock"], protect_buffers=False)
    buffers = _buffers_after_step(_checkpointed(make_stack(BatchNormBlock), config))
    assert [buffers[f"{block}.norm.num_batches_tracked"].item() for block in BLOCKS] == [2, 2, 2]
    assert all(
        not torch.equal(reference[f"{block}.norm.running_mean"], buffers[f"{block}.norm.running_mean"])
        for block in BLOCKS
    )


# Names and state_dict keys.


def test_names_and_state_dict_keys_are_unchanged_by_apply_and_remove() -> None:
    model = make_stack(BatchNormBlock)
    keys = list(model.state_dict())
    parameters = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    modules = dict(model.named_modules())

    apply_activation_checkpointing(model, CheckpointingConfig(classes=["BatchNormBlock"]))
    assert list(model.state_dict()) == keys
    assert dict(model.named_parameters()) == parameters
    assert dict(model.named_buffers()) == buffers
    assert dict(model.named_modules()) == modules

    assert remove_activation_checkpointing(model) == BLOCKS
    assert list(model.state_dict()) == keys
    assert dict(model.named_modules()) == modules


def test_state_dict_loads_strictly_across_checkpointing() -> None:
    checkpointed = _checkpointed(make_stack(PlainBlock, seed=1), CheckpointingConfig(classes=["PlainBlock"]))
    plain = make_stack(PlainBlock, seed=2)
    loaded = plain.load_state_dict(checkpointed.state_dict(), strict=True)
    assert (loaded.missing_keys, loaded.unexpected_keys) == ([], [])
    target = _checkpointed(make_stack(PlainBlock, seed=3), CheckpointingConfig(classes=["PlainBlock"]))
    loaded = target.load_state_dict(plain.state_dict(), strict=True)
    assert (loaded.missing_keys, loaded.unexpected_keys) == ([], [])
    assert _unequal(dict(checkpointed.state_dict()), dict(plain.state_dict())) == []
    assert _unequal(dict(checkpointed.state_dict()), dict(target.state_dict())) == []


# Selection.


def test_only_the_outermost_of_nested_matches_is_wrapped() -> None:
    model = make_stack(DropoutBlock)
    names = apply_activation_checkpointing(model, CheckpointingConfig(classes=["DropoutBlock", "Linear"]))
    assert names == ["inp", *BLOCKS, "head"]
    assert list(checkpointed_modules(model)) == names


def test_applying_twice_wraps_nothing_twice() -> None:
    model = make_stack(CounterBlock)
    config = CheckpointingConfig(classes=["CounterBlock"])
    first = apply_activation_checkpointing(model, config)
    second = apply_activation_checkpointing(model, CheckpointingConfig(classes=["CounterBlock"]))
    assert first == second == BLOCKS
    assert list(checkpointed_modules(model)) == BLOCKS
    # One forward and one recomputation; a doubly wrapped block would recompute its inner region once more.
    assert _calls_per_step(model) == [2, 2, 2]


def test_applying_twice_keeps_every_n_selection() -> None:
    model = make_stack(PlainBlock, n=4)
    config = CheckpointingConfig(classes=["PlainBlock"], every_n=2)
    assert apply_activation_checkpointing(model, config) == ["blocks.1", "blocks.3"]
    assert apply_activation_checkpointing(model, config) == ["blocks.1", "blocks.3"]
    assert list(checkpointed_modules(model)) == ["blocks.1", "blocks.3"]


def test_applying_another_config_over_one_is_refused_until_it_is_removed() -> None:
    model = make_stack(PlainBlock, n=4)
    reference = copy.deepcopy(model)
    apply_activation_checkpointing(model, CheckpointingConfig(classes=["PlainBlock"]))
    halved = CheckpointingConfig(classes=["PlainBlock"], every_n=2)
    with pytest.raises(
        CheckpointingConfigError,
        match=r"^`blocks\.1`, `blocks\.3` are checkpointed already with another `CheckpointingConfig`, which applying"
        r" this one would not change: call `remove_activation_checkpointing\(model\)` first, then apply this one\.$",
    ):
        apply_activation_checkpointing(model, halved)
    # Nothing half-applied: the first config stands, and the step is the plain twin's.
    assert list(checkpointed_modules(model)) == [f"blocks.{index}" for index in range(4)]
    assert _unequal(step_gradients(reference), step_gradients(model)) == []
    remove_activation_checkpointing(model)
    assert apply_activation_checkpointing(model, halved) == ["blocks.1", "blocks.3"]
    assert list(checkpointed_modules(model)) == ["blocks.1", "blocks.3"]


def test_a_mapping_for_a_config_is_refused_in_one_line_saying_how_to_build_one() -> None:
    model = make_stack(PlainBlock)
    with pytest.raises(
        CheckpointingTypeError,
        match=r"^`config` must be a `CheckpointingConfig`, got dict: build one with `CheckpointingConfig\(classes=",
    ):
        apply_activation_checkpointing(model, {"classes": ["PlainBlock"]})  # type: ignore[arg-type]
    assert checkpointed_modules(model) == {}


def test_remove_restores_the_plain_forward() -> None:
    model = make_stack(CounterBlock)
    apply_activation_checkpointing(model, CheckpointingConfig(classes=["CounterBlock"]))
    assert _calls_per_step(model) == [2, 2, 2]
    assert remove_activation_checkpointing(model) == BLOCKS
    assert checkpointed_modules(model) == {}
    assert all("forward" not in block.__dict__ for block in model.blocks)
    assert _calls_per_step(model) == [1, 1, 1]
    assert remove_activation_checkpointing(model) == []


def test_remove_restores_an_instance_forward_set_before_wrapping() -> None:
    block = PlainBlock()
    x = torch.randn(4, DIM)

    def doubled(inputs: torch.Tensor) -> torch.Tensor:
        return 2 * PlainBlock.forward(block, inputs)

    block.forward = doubled  # type: ignore[method-assign]
    checkpoint_module(block, "block", CheckpointingConfig(classes=["PlainBlock"]))
    assert torch.equal(block(x), 2 * PlainBlock.forward(block, x))
    assert remove_activation_checkpointing(block) == [""]
    assert block.forward is doubled


@pytest.mark.parametrize(
    ("every_n", "expected"),
    [(1, [f"blocks.{i}" for i in range(6)]), (2, ["blocks.1", "blocks.3", "blocks.5"]), (3, ["blocks.2", "blocks.5"])],
)
def test_every_n_picks_the_nth_2nth_and_so_on(every_n: int, expected: list[str]) -> None:
    model = make_stack(PlainBlock, n=6)
    assert (
        apply_activation_checkpointing(model, CheckpointingConfig(classes=["PlainBlock"], every_n=every_n)) == expected
    )
    assert list(checkpointed_modules(model)) == expected


def test_every_n_counts_matches_in_module_order_across_classes() -> None:
    model = make_stack(PlainBlock, n=3)
    # Matches in order: inp, blocks.0, blocks.1, blocks.2, head.
    config = CheckpointingConfig(classes=["PlainBlock", "Linear"], every_n=2)
    assert apply_activation_checkpointing(model, config) == ["blocks.0", "blocks.2"]


def test_every_n_above_the_number_of_matches_is_rejected_and_wraps_nothing() -> None:
    model = make_stack(PlainBlock, n=3)
    with pytest.raises(ValueError, match=r"`every_n`=4 selects none of the 3 matched modules of Stack"):
        apply_activation_checkpointing(model, CheckpointingConfig(classes=["PlainBlock"], every_n=4))
    assert checkpointed_modules(model) == {}


def test_bare_class_name_matches_class_and_bases_dotted_path_matches_isinstance() -> None:
    def model() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(DIM, DIM), ScaledLinear(DIM, DIM), nn.ReLU())

    assert apply_activation_checkpointing(model(), CheckpointingConfig(classes=["Linear"])) == ["0", "1"]
    assert apply_activation_checkpointing(model(), CheckpointingConfig(classes=["ScaledLinear"])) == ["1"]
    assert apply_activation_checkpointing(model(), CheckpointingConfig(classes=["torch.nn.Linear"])) == ["0", "1"]
    assert apply_activation_checkpointing(model(), CheckpointingConfig(classes=["tests.helpers.ScaledLinear"])) == ["1"]


def test_dotted_path_selects_the_outermost_instances() -> None:
    model = make_stack(DropoutBlock)
    names = apply_activation_checkpointing(model, CheckpointingConfig(classes=["torch.nn.Linear"]))
    assert names == ["inp", *(f"{block}.linear" for block in BLOCKS), "head"]


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (["blocks.*"], BLOCKS),
        (["blocks.1"], ["blocks.1"]),
        (["*.linear"], [f"{block}.linear" for block in BLOCKS]),
        (["inp", "blocks.2"], ["inp", "blocks.2"]),
    ],
)
def test_name_globs_are_relative_to_the_root(names: list[str], expected: list[str]) -> None:
    model = make_stack(DropoutBlock)
    assert apply_activation_checkpointing(model, CheckpointingConfig(names=names)) == expected


def test_name_globs_follow_the_module_the_config_is_applied_to() -> None:
    module = StackModule()
    assert apply_activation_checkpointing(module, CheckpointingConfig(names=["model.blocks.*"])) == [
        f"model.{block}" for block in BLOCKS
    ]
    assert apply_activation_checkpointing(StackModule().model.blocks, CheckpointingConfig(names=["1"])) == ["1"]
    with pytest.raises(ValueError, match=r"matches no module of StackModule: classes=\[\], names=\['blocks\.\*'\]"):
        apply_activation_checkpointing(StackModule(), CheckpointingConfig(names=["blocks.*"]))


def test_select_modules_selects_without_wrapping() -> None:
    model = make_stack(DropoutBlock)
    selected = select_modules(model, CheckpointingConfig(classes=["DropoutBlock"]))
    assert list(selected) == BLOCKS
    assert list(selected.values()) == list(model.blocks)
    assert checkpointed_modules(model) == {}


def test_checkpoint_module_wraps_the_module_itself_once() -> None:
    block = CounterBlock()
    config = CheckpointingConfig(classes=["Unused"])
    checkpoint_module(block, "solo", config)
    checkpoint_module(block, "solo", config)
    assert checkpointed_modules(block) == {"": block}
    x = torch.randn(4, DIM, requires_grad=True)
    block(x).sum().backward()
    assert len(block.calls) == 2


def test_checkpoint_module_refuses_another_config_and_arguments_out_of_order() -> None:
    # Given another config, it kept the first silently: a NumPy draw stayed unreplayed with `preserve_host_rng=True`.
    block = NumpyNoiseBlock()
    checkpoint_module(block, "block", CheckpointingConfig(classes=["Unused"]))
    with pytest.raises(CheckpointingConfigError, match=r"^`block` is checkpointed already with another"):
        checkpoint_module(block, "block", CheckpointingConfig(classes=["Unused"], preserve_host_rng=True))
    assert wrapping_module.checkpointing_config(block) == CheckpointingConfig(classes=["Unused"])
    checkpoint_module(block, "block", CheckpointingConfig(names=["other"]))  # selection fields alone: as it is
    with pytest.raises(CheckpointingTypeError, match=r"^`region` must be a str, got CheckpointingConfig: call"):
        checkpoint_module(PlainBlock(), CheckpointingConfig(classes=["Unused"]), "block")  # type: ignore[arg-type]


# Inputs and outputs pass through.


def _twin(factory: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
    """The module from ``factory`` and a checkpointed copy of it with the same weights."""
    torch.manual_seed(0)
    plain = factory()
    checkpointed = copy.deepcopy(plain)
    checkpoint_module(checkpointed, "region", CheckpointingConfig(classes=["Unused"]))
    return plain, checkpointed


def _leaf_gradients(module: nn.Module, *inputs: torch.Tensor) -> list[torch.Tensor]:
    return [param.grad for param in module.parameters()] + [tensor.grad for tensor in inputs]


def test_keyword_arguments_reach_the_checkpointed_forward() -> None:
    plain, checkpointed = _twin(KeywordBlock)
    results = []
    for module in (plain, checkpointed):
        x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(1), requires_grad=True)
        scale = torch.full((DIM,), 0.5, requires_grad=True)
        out = module(x, scale=scale, shift=0.25)
        out.square().sum().backward()
        results.append((out.detach(), _leaf_gradients(module, x, scale)))
    (plain_out, plain_grads), (out, grads) = results
    assert torch.equal(plain_out, out)
    assert all(grad is not None for grad in grads)
    assert all(torch.equal(expected, got) for expected, got in zip(plain_grads, grads, strict=True))


def test_tuple_outputs_with_non_tensors_pass_through() -> None:
    plain, checkpointed = _twin(TupleOutputBlock)
    results = []
    for module in (plain, checkpointed):
        x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(1), requires_grad=True)
        out, aux, tag, count = module(x)
        assert (tag, count) == ("tuple", 3)
        (out.sum() + aux).backward()
        results.append(((out.detach(), aux.detach()), _leaf_gradients(module, x)))
    (plain_outs, plain_grads), (outs, grads) = results
    assert all(torch.equal(expected, got) for expected, got in zip(plain_outs, outs, strict=True))
    assert all(torch.equal(expected, got) for expected, got in zip(plain_grads, grads, strict=True))


def test_dict_outputs_with_non_tensors_pass_through() -> None:
    plain, checkpointed = _twin(DictOutputBlock)
    results = []
    for module in (plain, checkpointed):
        x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(1), requires_grad=True)
        out = module(x)
        assert sorted(out) == ["aux", "out", "tag"]
        assert out["tag"] == "dict"
        (out["out"].sum() * out["aux"]).backward()
        results.append((out["out"].detach(), _leaf_gradients(module, x)))
    (plain_out, plain_grads), (out, grads) = results
    assert torch.equal(plain_out, out)
    assert all(torch.equal(expected, got) for expected, got in zip(plain_grads, grads, strict=True))


# When the plain forward runs instead.


def test_checkpointing_disabled_recomputes_nothing_and_restores_after_an_exception() -> None:
    model = _checkpointed(make_stack(CounterBlock), CheckpointingConfig(classes=["CounterBlock"]))
    with checkpointing_disabled():
        assert _calls_per_step(model) == [1, 1, 1]
        with checkpointing_disabled():
            assert _calls_per_step(model) == [1, 1, 1]
        assert _calls_per_step(model) == [1, 1, 1]
    assert _calls_per_step(model) == [2, 2, 2]
    with pytest.raises(RuntimeError, match="raised inside"), checkpointing_disabled():
        raise RuntimeError("raised inside checkpointing_disabled")
    assert _calls_per_step(model) == [2, 2, 2]


def test_a_region_under_torch_func_grad_says_to_run_it_plainly_and_then_matches_the_plain_twin() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Linear(4, 1))
    model = copy.deepcopy(plain)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0"]))
    x = torch.randn(3, 4)

    def loss_of(module: nn.Module) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
        return lambda parameters: torch.func.functional_call(module, parameters, (x,)).sum()

    parameters = dict(plain.named_parameters())
    with pytest.raises(RuntimeError, match="saved tensor hooks") as raised:
        torch.func.grad(loss_of(model))(parameters)
    assert raised.value.__notes__ == [
        "lightning_ckpt_determinism: the checkpointed Sequential cannot run here: activation checkpointing needs "
        "saved-tensor hooks, and they are disabled (torch.func's grad, vjp, jacrev and hessian disable them). Run "
        "this call inside `with lightning_ckpt_determinism.checkpointing_disabled():`, where checkpointed modules "
        "run their plain forward."
    ]
    with checkpointing_disabled():
        grads = torch.func.grad(loss_of(model))(parameters)
    expected = torch.func.grad(loss_of(plain))(parameters)
    assert grads.keys() == expected.keys()
    assert all(torch.equal(grads[name], expected[name]) for name in expected)


def test_an_error_under_enabled_saved_tensor_hooks_gets_no_note() -> None:
    model = _checkpointed(make_stack(CounterBlock), CheckpointingConfig(classes=["CounterBlock"]))
    with pytest.raises(RuntimeError) as raised:
        model(torch.ones(2, 3, requires_grad=True))
    assert not getattr(raised.value, "__notes__", [])


@pytest.fixture
def checkpoint_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The keyword arguments of every call the wrapped modules make to torch's ``checkpoint``."""
    calls: list[dict[str, Any]] = []
    original = wrapping_module.checkpoint

    def spy(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return original(function, *args, **kwargs)

    monkeypatch.setattr(wrapping_module, "checkpoint", spy)
    return calls


def test_no_grad_runs_the_plain_forward(checkpoint_calls: list[dict[str, Any]]) -> None:
    reference = make_stack(PlainBlock)
    model = _checkpointed(make_stack(PlainBlock), CheckpointingConfig(classes=["PlainBlock"]))
    x, _ = batch()
    with torch.no_grad():
        out = model(x)
    assert checkpoint_calls == []
    assert torch.equal(out, reference(x))
    model(x)
    assert len(checkpoint_calls) == 3


def test_torch_checkpoint_is_called_non_reentrant_with_the_configured_settings(
    checkpoint_calls: list[dict[str, Any]],
) -> None:
    config = CheckpointingConfig(classes=["PlainBlock"], preserve_rng_state=False, determinism_check="none")
    model = _checkpointed(make_stack(PlainBlock, n=1), config)
    model(batch()[0]).sum().backward()
    model(batch()[0]).sum().backward()
    assert len(checkpoint_calls) == 2
    first, second = ({key: value for key, value in call.items() if key != "context_fn"} for call in checkpoint_calls)
    expected = {"use_reentrant": False, "preserve_rng_state": False}
    # Every call keeps torch's default early stop, the learning one too: a call that must recompute to its end (a
    # saved tensor filled late) says so after its forward, by an end marker, not through `early_stop`. The learning
    # call passes the package's name for the configured check, the next one (nothing learns from it nor reads it)
    # torch's own.
    assert first == {**expected, "determinism_check": NONE_CHECK}
    assert second == {**expected, "determinism_check": "none"}


def test_the_package_determinism_checks_behave_as_torchs_while_nothing_observes() -> None:
    checks = torch.utils.checkpoint._allowed_determinism_checks_to_fns
    tensor = torch.ones(2, 3, dtype=torch.float64)
    assert checks[DEFAULT_CHECK](tensor) == checks["default"](tensor)
    assert checks[NONE_CHECK](tensor) is None


def test_default_determinism_check_catches_a_shape_change_on_recomputation() -> None:
    model = _checkpointed(make_stack(RoutingBlock, n=1), CheckpointingConfig(classes=["RoutingBlock"]))
    x, y = batch()
    loss = F.mse_loss(model(x), y)
    with pytest.raises(CheckpointError, match="Recomputed values for the following tensors have different metadata"):
        loss.backward()


# Copies.


@pytest.mark.parametrize("save_ops", [[], SAVE_MATMULS], ids=["full", "save_ops"])
@pytest.mark.parametrize(
    "clone", [copy.deepcopy, lambda model: pickle.loads(pickle.dumps(model))], ids=["deepcopy", "pickle"]
)
def test_copies_of_a_wrapped_model_stay_wrapped_around_their_own_modules(
    clone: Callable[[nn.Module], nn.Module], save_ops: list[str]
) -> None:
    original = _checkpointed(make_stack(CounterBlock), CheckpointingConfig(classes=["CounterBlock"], save_ops=save_ops))
    copied = clone(original)
    assert list(checkpointed_modules(copied)) == BLOCKS
    assert _calls_per_step(copied) == [2, 2, 2]
    assert [len(block.calls) for block in original.blocks] == [0, 0, 0]


@pytest.mark.parametrize(
    "clone", [copy.deepcopy, lambda model: pickle.loads(pickle.dumps(model))], ids=["deepcopy", "pickle"]
)
def test_copies_of_a_wrapped_model_reproduce_unchecked_gradients(clone: Callable[[nn.Module], nn.Module]) -> None:
    reference = step_gradients(make_stack(DropoutBlock))
    config = CheckpointingConfig(classes=["DropoutBlock"], save_ops=SAVE_MATMULS)
    copied = clone(_checkpointed(make_stack(DropoutBlock), config))
    assert _unequal(reference, step_gradients(copied)) == []


@pytest.mark.parametrize(
    "clone", [copy.deepcopy, lambda model: pickle.loads(pickle.dumps(model))], ids=["deepcopy", "pickle"]
)
def test_a_copy_made_while_its_regions_run_plainly_is_checkpointed(clone: Callable[[nn.Module], nn.Module]) -> None:
    # A target network copied inside a check's plain rerun (`run_plainly`) must not stay plain for good.
    original = _checkpointed(make_stack(CounterBlock), CheckpointingConfig(classes=["CounterBlock"]))
    with wrapping_module.run_plainly(list(original.blocks)):
        copied = clone(original)
    assert _calls_per_step(copied) == [2, 2, 2]
    assert _calls_per_step(original) == [2, 2, 2]


# Bad input.


def test_config_matching_nothing_lists_classes_and_names_and_wraps_nothing() -> None:
    model = make_stack(DropoutBlock)
    message = (
        r"`CheckpointingConfig` matches no module of Stack: classes=\['Block'\], names=\['layers\.\*'\]\."
        r" The model's module classes are \['Dropout', 'DropoutBlock', 'Linear', 'ModuleList', 'Stack'\];"
        r" its module names include \['inp', 'blocks', 'blocks\.0', 'blocks\.0\.linear', .*'head'\]"
    )
    with pytest.raises(ValueError, match=message):
        apply_activation_checkpointing(model, CheckpointingConfig(classes=["Block"], names=["layers.*"]))
    assert checkpointed_modules(model) == {}


def test_a_container_named_is_refused_with_its_children_s_pattern_and_a_glob_takes_its_children() -> None:
    model = make_stack(PlainBlock)
    with pytest.raises(
        ValueError,
        match=r"`names` entry 'blocks' matches `blocks`, a ModuleList, which has no forward of its own and is never"
        r" called: .* Select the modules it holds, as 'blocks\.\*'\.",
    ):
        apply_activation_checkpointing(model, CheckpointingConfig(names=["blocks"]))
    assert checkpointed_modules(model) == {}
    # A glob matching the container and its children selects the children, which run.
    assert apply_activation_checkpointing(model, CheckpointingConfig(names=["blocks*"])) == BLOCKS


@pytest.mark.parametrize(
    ("written", "meant", "selected"),
    [
        # Missing its parent: offered with it first.
        ("blocks.*", "model.blocks.*", [f"model.{name}" for name in BLOCKS]),
        # Python's indexing: offered as the module name.
        ("blocks[1]", "model.blocks.1", ["model.blocks.1"]),
    ],
)
def test_a_name_pattern_that_matches_nothing_offers_the_one_meant(
    written: str, meant: str, selected: list[str]
) -> None:
    root = nn.Module()
    root.model = make_stack(PlainBlock)
    with pytest.raises(
        ValueError,
        match=rf"names=\[{re.escape(repr(written))}\]\. Did you mean {re.escape(repr(meant))} for"
        rf" {re.escape(repr(written))}\? The model's module classes",
    ):
        apply_activation_checkpointing(root, CheckpointingConfig(names=[written]))
    assert apply_activation_checkpointing(root, CheckpointingConfig(names=[meant])) == selected


def test_the_class_of_the_module_applied_to_is_named_as_never_a_region() -> None:
    model = make_stack(PlainBlock)
    with pytest.raises(
        ValueError,
        match=r"classes=\['Stack'\], names=\[\]\. Stack is the module the config is applied to, never a region"
        r" itself: name the blocks inside it\. The model's",
    ):
        apply_activation_checkpointing(model, CheckpointingConfig(classes=["Stack"]))
    assert checkpointed_modules(model) == {}


def test_no_match_message_samples_twelve_names_of_a_large_model() -> None:
    with pytest.raises(ValueError, match=r"its module names include \['inp', .*'blocks\.4\.linear', '\.\.\.'\]"):
        apply_activation_checkpointing(make_stack(PlainBlock, n=10), CheckpointingConfig(classes=["Block"]))


def test_entries_matching_nothing_warn_while_the_others_apply() -> None:
    model = make_stack(DropoutBlock)
    config = CheckpointingConfig(classes=["DropoutBlock", "NoSuchBlock", "torch.nn.Conv2d"], names=["layers.*"])
    with pytest.warns(
        LightningCkptDeterminismWarning,
        # Each entry as written: the dotted one by its path, which says what was looked for.
        match=r"entries \['NoSuchBlock', 'torch\.nn\.Conv2d', 'layers\.\*'\] match no module of Stack",
    ):
        names = apply_activation_checkpointing(model, config)
    assert names == BLOCKS
    with pytest.raises(ValueError, match=r"matches no module of Stack: classes=\['torch\.nn\.Conv2d'\], names=\[\]\."):
        apply_activation_checkpointing(make_stack(DropoutBlock), CheckpointingConfig(classes=["torch.nn.Conv2d"]))


def test_config_matching_the_gpt_blocks_by_class_and_by_path() -> None:
    for classes in (["Block"], ["examples.gpt.Block"]):
        model = _gpt(layers=2)
        assert apply_activation_checkpointing(model, CheckpointingConfig(classes=classes)) == ["blocks.0", "blocks.1"]
        assert all(isinstance(module, Block) for module in checkpointed_modules(model).values())


# Recomputation that runs more than once: a gradient penalty, or a second backward through a retained graph.


def _twice(model: nn.Module, twice: str, seed: int = 7) -> dict[str, torch.Tensor]:
    """Gradients of a step that recomputes every region twice (see :func:`gradients_of`), torch and NumPy seeded."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    return gradients_of(model, *batch(), twice)


TWICE = ["gradient_penalty", "retain_graph"]
REENTERED = {
    "batchnorm_protected_buffers": (BatchNormBlock, {}),
    "numpy_noise_host_rng": (NumpyNoiseBlock, {"preserve_host_rng": True}),
    "dropout": (DropoutBlock, {}),
    # torch's selective checkpointing serves what it kept to one recomputation: a second failed with "Trying to
    # backward an extra time" before the package served its copy to every one.
    "dropout_save_ops": (DropoutBlock, {"save_ops": SAVE_MATMULS}),
    "batchnorm_save_ops": (BatchNormBlock, {"save_ops": SAVE_MATMULS}),
}


@pytest.mark.parametrize("twice", TWICE)
@pytest.mark.parametrize("case", sorted(REENTERED))
def test_a_region_recomputed_twice_gives_the_gradients_and_buffers_of_no_checkpointing(case: str, twice: str) -> None:
    block, options = REENTERED[case]
    reference = make_stack(block)
    model = _checkpointed(make_stack(block), CheckpointingConfig(classes=[block.__name__], **options))
    live_numpy = np.random.get_state()
    expected = _twice(reference, twice)
    got = _twice(model, twice)
    assert _unequal(expected, got) == []
    # Each recomputation put the live streams back: NumPy continues as without checkpointing.
    np.random.set_state(live_numpy)
    assert _unequal(dict(reference.named_buffers()), dict(model.named_buffers())) == []


class _StateRecordingBlock(nn.Module):
    """NumPy noise and a BatchNorm; records, at every call, the next NumPy draw and the BatchNorm's statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.norm = nn.BatchNorm1d(DIM)
        self.seen: list[tuple[float, torch.Tensor, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = np.random.get_state()
        self.seen.append((float(np.random.rand()), self.norm.running_mean.clone(), int(self.norm.num_batches_tracked)))
        np.random.set_state(state)
        noise = torch.from_numpy(np.random.standard_normal(x.shape).astype(np.float32))
        return x + torch.tanh(self.norm(self.linear(x))) * (1 + noise)


def test_every_recomputation_of_a_region_replays_the_same_host_rng_and_buffers() -> None:
    torch.manual_seed(0)
    model = Stack([_StateRecordingBlock()])
    # The recorded count is an `.item()`, whose forward value `keep_data_dependent` would serve to recomputation.
    _checkpointed(model, CheckpointingConfig(names=["blocks.0"], preserve_host_rng=True, keep_data_dependent=False))
    _twice(model, "gradient_penalty")
    forward, *recomputations = model.blocks[0].seen
    # Recomputed under `autograd.grad(..., create_graph=True)`, then again by the backward through the penalty.
    assert len(recomputations) == 2
    assert all(draw == forward[0] for draw, _, _ in recomputations)
    # Both read the statistics the forward read (before its update), never what an earlier recomputation wrote.
    assert all(torch.equal(mean, forward[1]) for _, mean, _ in recomputations)
    assert [count for _, _, count in model.blocks[0].seen] == [0, 0, 0]
    # The live statistics are those of one update, as without checkpointing.
    assert int(model.blocks[0].norm.num_batches_tracked) == 1
    assert not torch.equal(model.blocks[0].norm.running_mean, forward[1])


class _LateCountBlock(nn.Module):
    """Scales by a buffer it never changes; once ``armed``, counts its calls in a second buffer, in place, and scales
    by the count too: a region holding buffers that its first calls leave alone."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.armed = False
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM))
        self.register_buffer("count", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.count += 1
        return torch.tanh(self.linear(x) * self.scale * self.count)


@pytest.mark.parametrize("twice", TWICE)
def test_buffers_a_region_leaves_alone_and_one_it_changes_later_train_as_without_checkpointing(twice: str) -> None:
    reference = make_stack(_LateCountBlock, n=2)
    model = _checkpointed(copy.deepcopy(reference), CheckpointingConfig(classes=["_LateCountBlock"]))
    equal = []
    for step in range(5):
        if step == 2:
            for block in (*reference.blocks, *model.blocks):
                block.armed = True
        reference.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        equal.append(_unequal(_twice(reference, twice, seed=step), _twice(model, twice, seed=step)) == [])
        # Each recomputation gives every buffer back: changed once per call, as without checkpointing.
        assert _unequal(dict(reference.named_buffers()), dict(model.named_buffers())) == []
    assert float(model.blocks[0].count) == 4.0
    # Step 1 replays nothing learned (its small buffers are only copied as it starts); step 2 first changes the count,
    # and its recomputations start from the copy its forward started from; from step 3 on the count is replayed as
    # learned.
    assert equal == [True, True, True, True, True]


class _FakeQuantBlock(nn.Module):
    """Quantization-aware training: a fake quantizer whose observer updates its statistics in forward, when enabled,
    between two linear layers (the second's gradient reads the quantized values)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.quant = torch.ao.quantization.FakeQuantize(
            observer=torch.ao.quantization.MovingAverageMinMaxObserver, quant_min=0, quant_max=255
        )
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.quant(torch.tanh(self.linear(x))))


@pytest.mark.parametrize("twice", [None, *TWICE])
def test_a_buffer_its_forward_resizes_is_recomputed_as_it_started_and_trains_as_without_checkpointing(
    twice: str | None,
) -> None:
    # The first forward sizes the observer's statistics (empty to one value a channel): the recomputation starts from
    # the empty values the forward started from, which the sized buffers cannot take in place.
    torch.manual_seed(0)
    reference = make_stack(PerChannelQuantBlock, n=2)
    model = _checkpointed(copy.deepcopy(reference), CheckpointingConfig(classes=["PerChannelQuantBlock"]))
    for step in range(3):
        gradients = [gradients_of(twin, *batch(seed=step), twice) for twin in (reference, model)]
        assert _unequal(*gradients) == [], step
        assert _unequal(dict(reference.named_buffers()), dict(model.named_buffers())) == [], step
    assert model.blocks[0].quant.activation_post_process.min_val.shape == (DIM,)


class _ExpandedBiasBlock(nn.Module):
    """Adds a bias buffer registered as one value expanded to the width: its elements share one memory location."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.register_buffer("bias", torch.full((1,), 0.25).expand(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x) + self.bias)


def test_a_buffer_whose_elements_share_memory_is_protected_and_trains_as_without_checkpointing() -> None:
    # An in-place copy into such a buffer is refused ("more than one element of the written-to tensor refers to a
    # single memory location"): the first call, which replays every buffer, crashed its backward.
    torch.manual_seed(0)
    reference = make_stack(_ExpandedBiasBlock, n=2)
    model = _checkpointed(copy.deepcopy(reference), CheckpointingConfig(classes=["_ExpandedBiasBlock"]))
    for step in range(2):
        gradients = [gradients_of(twin, *batch(seed=step)) for twin in (reference, model)]
        assert _unequal(*gradients) == [], step
    assert model.blocks[0].bias.stride() == (0,)


def test_a_quantizer_whose_observer_is_enabled_after_a_warm_up_trains_as_without_checkpointing() -> None:
    # Calibrated, then its observer frozen for two steps and enabled again: its statistics first change in a later
    # call, whose recomputation must start from the values that call started from.
    torch.manual_seed(0)
    reference = make_stack(_FakeQuantBlock, n=2)
    reference(batch()[0])
    reference.apply(torch.ao.quantization.disable_observer)
    model = _checkpointed(copy.deepcopy(reference), CheckpointingConfig(classes=["_FakeQuantBlock"]))
    for step in range(4):
        if step == 2:
            for twin in (reference, model):
                twin.apply(torch.ao.quantization.enable_observer)
        gradients = [gradients_of(twin, *batch(seed=step)) for twin in (reference, model)]
        assert _unequal(*gradients) == [], step
        assert _unequal(dict(reference.named_buffers()), dict(model.named_buffers())) == [], step


def test_a_region_without_extra_contexts_takes_torchs_default_context_fn(
    checkpoint_calls: list[dict[str, Any]],
) -> None:
    model = _checkpointed(make_stack(PlainBlock, n=1), CheckpointingConfig(classes=["PlainBlock"]))
    model(batch()[0])
    model(batch()[0])
    # The first forward looks for data-dependent ops under the guard; it found none, so the next call is plain.
    assert "context_fn" in checkpoint_calls[0]
    assert "context_fn" not in checkpoint_calls[1]


def test_save_ops_alone_gives_torch_its_own_pair_of_dispatch_modes(checkpoint_calls: list[dict[str, Any]]) -> None:
    config = CheckpointingConfig(classes=["PlainBlock"], save_ops=SAVE_MATMULS)
    model = _checkpointed(make_stack(PlainBlock, n=1), config)
    model(batch()[0])
    model(batch()[0])
    forward, recompute = checkpoint_calls[1]["context_fn"]()
    assert isinstance(forward, TorchDispatchMode)
    # torch's recompute mode, inside a context that names a kept output written in place after the forward (torch's
    # error is bare): re-enterable as the mode is, once per recomputation (a gradient penalty recomputes twice).
    for _ in range(2):
        with recompute:
            pass


class LazyDropoutBlock(nn.Module):
    """A lazy linear layer, then dropout: its initialisation draws from torch's RNG before the dropout mask, in the
    forward only."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.drop = nn.LazyLinear(8), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.tanh(self.inp(x)))


@pytest.mark.parametrize("dry_run", [False, True], ids=["initialised by the first step", "by a dry run"])
def test_a_call_that_initialises_lazy_modules_runs_plainly_and_trains_as_the_twin(dry_run: bool):
    torch.manual_seed(0)
    model = nn.Sequential(LazyDropoutBlock(), nn.Linear(8, 1))
    twin = copy.deepcopy(model)
    apply_activation_checkpointing(model, CheckpointingConfig(classes=["LazyDropoutBlock"]))
    x = torch.randn(4, 6)
    if dry_run:  # without grad, as a model summary runs it: the region runs plainly and initialises
        for net in (model, twin):
            torch.manual_seed(9)
            with torch.no_grad():
                net(x)
    for step in range(3):
        for net in (model, twin):
            net.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            net(x).sum().backward()
        for (name, ours), theirs in zip(model.named_parameters(), twin.parameters(), strict=True):
            assert torch.equal(ours.grad, theirs.grad), (step, name)
        # The initialising call ran plainly; each later one is checkpointed and recomputed once.
        assert wrapping_module.recomputations(model) == step + dry_run


@pytest.mark.parametrize("first", ["outer", "inner"])
def test_another_config_naming_modules_inside_or_around_checkpointed_ones_is_refused(first: str) -> None:
    # A config whose modules sit inside (or hold) modules another config checkpointed: selection skips them, and
    # the call must not return as if it had applied anything.
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(PlainBlock(), nn.Tanh()) for _ in range(2)), nn.Linear(DIM, 1))
    reference = copy.deepcopy(model)
    outer, inner = CheckpointingConfig(names=["0", "1"]), CheckpointingConfig(classes=["PlainBlock"])
    applied, refused = (outer, inner) if first == "outer" else (inner, outer)
    before = apply_activation_checkpointing(model, applied)
    held = ["0", "1"] if first == "outer" else ["0.0", "1.0"]
    assert before == held
    with pytest.raises(
        CheckpointingConfigError,
        match=rf"^`{held[0]}`, `{held[1]}` are checkpointed already with another `CheckpointingConfig`",
    ):
        apply_activation_checkpointing(model, refused)
    # Nothing half-applied: the first config stands, and the step is the plain twin's.
    assert list(checkpointed_modules(model)) == held
    assert _unequal(step_gradients(reference), step_gradients(model)) == []


def test_another_config_that_also_names_modules_of_its_own_wraps_those() -> None:
    # Blocks checkpointed, then every linear layer: those inside the blocks are skipped (a region holds no region),
    # the head outside them is new and wrapped with the second config; the blocks keep the first.
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(PlainBlock(), nn.Tanh()) for _ in range(2)), nn.Linear(DIM, 1))
    reference = copy.deepcopy(model)
    blocks, linear = CheckpointingConfig(names=["0", "1"]), CheckpointingConfig(classes=["Linear"])
    apply_activation_checkpointing(model, blocks)
    assert apply_activation_checkpointing(model, linear) == ["0", "1", "2"]
    assert wrapping_module.checkpointing_config(model[0]) == blocks
    assert wrapping_module.checkpointing_config(model[2]) == linear
    assert _unequal(step_gradients(reference), step_gradients(model)) == []


def test_applying_such_a_config_again_changes_nothing() -> None:
    # As a LightningModule's `configure_model` does at every stage (fit, then validate).
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(PlainBlock(), nn.Tanh()) for _ in range(2)), nn.Linear(DIM, 1))
    blocks, linear = CheckpointingConfig(names=["0", "1"]), CheckpointingConfig(classes=["Linear"])
    for _ in range(2):
        apply_activation_checkpointing(model, blocks)
        assert apply_activation_checkpointing(model, linear) == ["0", "1", "2"]
    assert list(checkpointed_modules(model)) == ["0", "1", "2"]
