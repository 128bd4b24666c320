"""Tests for `lightning_ckpt_determinism.config`: the fields, their validation and the op and class resolvers.

Also that every configuration check of the package, wherever it sits, raises `CheckpointingConfigError`.
"""

import copy
import dataclasses
import inspect
import io
import pickle
import re
import sys
import typing
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import yaml
from jsonargparse import ArgumentParser
from jsonargparse.typing import NonNegativeFloat, NotEmptyStr, PositiveInt
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import lightning_ckpt_determinism
from lightning_ckpt_determinism import (
    CheckpointingCLI,
    CheckpointingConfig,
    CheckpointingConfigError,
    FSDPCheckpointingStrategy,
    LightningCkptDeterminismWarning,
    RecomputationMonitor,
    SingleDeviceCheckpointingStrategy,
    apply_activation_checkpointing,
    check_recomputation,
)
from lightning_ckpt_determinism import config as config_module
from lightning_ckpt_determinism.checkpointing import select_modules
from lightning_ckpt_determinism.checkpointing.determinism_check import DETERMINISM_CHECKS
from lightning_ckpt_determinism.checkpointing.wrapper import KEPT_OUTPUT_WRITTEN_HINT
from lightning_ckpt_determinism.config import parse_memory_budget, resolve_class_path, resolve_ops
from tests.helpers import (
    DIM,
    REPO,
    DropoutBlock,
    PlainBlock,
    ScaledLinear,
    Stack,
    StackModule,
    make_stack,
    step_gradients,
    trainer_kwargs,
)

GPT_CONFIG = REPO / "examples" / "configs" / "gpt_blocks_by_class.yaml"


def test_defaults_checkpoint_everything_matched_with_full_recomputation() -> None:
    config = CheckpointingConfig(classes=["Block"])
    assert config.classes == ["Block"]
    assert config.names == []
    assert config.every_n == 1
    assert config.save_ops == []
    assert config.preserve_rng_state is True
    assert config.preserve_host_rng is False
    assert config.protect_buffers is True
    assert config.determinism_check == "default"


def test_sequences_become_lists() -> None:
    # jsonargparse and users may hand tuples; the config stores lists so it compares and serialises alike.
    config = CheckpointingConfig(classes=("Block",), names=("model.blocks.*",), save_ops=("aten.mm",))
    assert config.classes == ["Block"]
    assert config.names == ["model.blocks.*"]
    assert config.save_ops == ["aten.mm"]


def test_empty_config_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"selects nothing: set `classes` .* or `names`"):
        CheckpointingConfig()


@pytest.mark.parametrize("every_n", [0, -1, True, 1.5])
def test_every_n_must_be_a_positive_integer(every_n: object) -> None:
    with pytest.raises(ValueError, match=rf"`every_n` must be an integer >= 1, got {every_n!r}"):
        CheckpointingConfig(classes=["Block"], every_n=every_n)  # type: ignore[arg-type]


def test_every_n_above_one_is_kept() -> None:
    assert CheckpointingConfig(names=["blocks.*"], every_n=3).every_n == 3


def test_unknown_determinism_check_lists_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match=r"`determinism_check` can be default, none, got 'strict'\.$"):
        CheckpointingConfig(classes=["Block"], determinism_check="strict")


def test_determinism_check_none_is_accepted() -> None:
    assert CheckpointingConfig(classes=["Block"], determinism_check="none").determinism_check == "none"


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("torch.nn.NoSuchLayer", r"`classes` entry 'torch.nn.NoSuchLayer' cannot be imported"),
        ("no_such_package.Block", r"`classes` entry 'no_such_package.Block' cannot be imported"),
        ("math.pi", r"`classes` entry 'math.pi' is not a class, got float"),
        ("torch.Tensor", r"`classes` entry 'torch.Tensor' is not a module class \(`torch.nn.Module`\), so it would"),
    ],
)
def test_unknown_class_path_is_rejected(path: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CheckpointingConfig(classes=[path])


def test_bare_class_names_are_not_imported() -> None:
    # A bare name is matched against class names at apply time, so one that exists nowhere is not an error here.
    assert CheckpointingConfig(classes=["NoSuchBlock"]).classes == ["NoSuchBlock"]


def test_resolve_class_path_returns_the_class() -> None:
    assert resolve_class_path("torch.nn.TransformerEncoderLayer") is nn.TransformerEncoderLayer
    assert resolve_class_path("tests.helpers.DropoutBlock").__name__ == "DropoutBlock"


def test_a_module_given_for_a_class_is_named_by_its_class_in_one_line() -> None:
    block = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(CheckpointingConfigError) as raised:
        CheckpointingConfig(classes=[block])
    assert str(raised.value) == (
        "`classes` must be a list of class names, dotted paths or classes, got a Sequential module; give its class,"
        " Sequential (or 'Sequential'), or select modules by name with `names`."
    )


@pytest.mark.parametrize(
    ("op", "message"),
    [
        ("aten.no_such_op", r"`save_ops` entry 'aten.no_such_op' is not an op torch knows"),
        ("no_such_namespace.mm", r"`save_ops` entry 'no_such_namespace.mm' is not an op torch knows"),
        ("mm", r"`save_ops` entry 'mm' is not an op name: use 'namespace.op'"),
        ("aten.mm.default.extra", r"`save_ops` entry 'aten.mm.default.extra' is not an op name"),
        ("aten..default", r"`save_ops` entry 'aten..default' is not an op name"),
        ("aten.mm.no_such_overload", r"`save_ops` entry 'aten.mm.no_such_overload' names an unknown overload"),
        (" aten.mm", r"`save_ops` entry ' aten.mm' holds spaces: write 'aten.mm'\.$"),
        ("torch.mm", r"`save_ops` entry 'torch.mm' names a torch function; .* write 'aten.mm'\.$"),
        ("aten.mm.out", r"`save_ops` entry 'aten.mm.out' is an `out=` overload, which autograd never runs, .*"),
        ("aten.sort.values", r"`save_ops` entry 'aten.sort.values' returns only what it writes into its arguments"),
    ],
)
def test_unknown_save_op_is_rejected(op: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CheckpointingConfig(classes=["Block"], save_ops=[op])


class _OpsRun(TorchDispatchMode):
    """The op packets that run below autograd: what selective checkpointing's policy sees."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.seen.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


_X = torch.randn(2, 4, 8, requires_grad=True)
_W = torch.randn(8, 8, requires_grad=True)


@pytest.mark.parametrize(
    ("entry", "call", "named"),
    [
        ("aten.matmul", lambda: torch.matmul(_X, _W), "'aten.mm'"),
        ("aten.linear", lambda: F.linear(_X, _W, _W[0]), "'aten.addmm'"),
        ("aten.einsum", lambda: torch.einsum("bij,jk->bik", _X, _W), "'aten.bmm'"),
        ("aten.layer_norm.default", lambda: F.layer_norm(_X, (8,)), "'aten.native_layer_norm'"),
        ("aten.softmax", lambda: _X.softmax(-1), "'aten._softmax'"),
        ("aten.rms_norm", lambda: F.rms_norm(_X, (8,)), "a `TorchDispatchMode` or the profiler lists"),
    ],
)
def test_a_composite_save_op_is_refused_naming_the_ops_autograd_runs_for_it(entry: str, call, named: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=f"^`save_ops` entry '{re.escape(entry)}' is a composite op: ") as raised:
        CheckpointingConfig(classes=["Block"], save_ops=[entry])
    message = str(raised.value)
    assert message.endswith(f"{named}.") or f": {named}" in message
    # Ground truth: the entry never reaches the ops checkpointing sees, and the op the message names does.
    ops = _OpsRun()
    with ops:
        call()
    packet = ".".join(entry.split(".")[:2])
    assert packet not in ops.seen
    if named.startswith("'"):
        assert named.strip("'") in ops.seen
        CheckpointingConfig(classes=["Block"], save_ops=[named.strip("'")])


@pytest.mark.parametrize("entry", ["aten.bernoulli", "aten.native_dropout", "aten.rrelu_with_noise.default"])
def test_a_random_save_op_is_refused_in_one_line(entry: str) -> None:
    with pytest.raises(CheckpointingConfigError) as raised:
        CheckpointingConfig(classes=["Block"], save_ops=[entry])
    assert str(raised.value) == (
        f"`save_ops` entry {entry!r} is a random op: a kept one is not run again in recomputation, which shifts what"
        " every later random op there draws; remove it (`preserve_rng_state` replays random ops exactly)."
    )


@torch.library.custom_op("lightning_ckpt_determinism_tests::fill_state", mutates_args=("state",))
def _fill_state(x: torch.Tensor, state: torch.Tensor) -> None:
    """Writes ``x`` into ``state`` and returns nothing: in place, with no name ending in an underscore."""
    state.copy_(x)


@pytest.mark.parametrize("entry", ["lightning_ckpt_determinism_tests.fill_state", "aten.__iand__"])
def test_an_in_place_op_without_an_out_of_place_twin_is_refused_without_naming_one(entry: str) -> None:
    # The hint dropped a trailing underscore: the custom op was told to write itself, `__iand__` to write `__iand`.
    with pytest.raises(CheckpointingConfigError) as raised:
        CheckpointingConfig(classes=["Block"], save_ops=[entry])
    assert str(raised.value).endswith("refuses to keep; write the op that computes what it writes or the op before it.")


@pytest.mark.parametrize(
    ("entry", "meant"),
    [
        ("aten.relu_", "aten.relu"),
        ("aten.add_.Tensor", "aten.add"),
        ("aten.add_", "aten.add"),  # its list overload returns its input without the schema marking it
        ("aten._foreach_mul_", "aten._foreach_mul"),  # returns nothing: kept, its gradients were a plain twin's no more
    ],
)
def test_an_in_place_save_op_is_refused_naming_its_out_of_place_op(entry: str, meant: str) -> None:
    # torch's selective checkpointing refuses to keep an in-place op's output; accepted, the config failed at the
    # first backward with a hint about a later op writing the kept output.
    with pytest.raises(CheckpointingConfigError) as raised:
        CheckpointingConfig(classes=["Block"], save_ops=[entry])
    assert str(raised.value) == (
        f"`save_ops` entry {entry!r} is an in-place op: its output is its input written over, which torch's selective"
        f" checkpointing refuses to keep; write the out-of-place op ({meant!r}) or the op before it."
    )
    assert CheckpointingConfig(classes=["Block"], save_ops=[meant]).save_ops == [meant]
    # An op that writes state and returns new tensors (a fused fake-quantize updating its observer) is kept as any.
    # Nor are functional ops with `out=` forms named otherwise (`topk.values`, `div.out_mode`) or list overloads.
    for kept in ("aten._fused_moving_avg_obs_fq_helper", "aten.topk", "aten.sort", "aten.div", "aten.max"):
        assert CheckpointingConfig(classes=["Block"], save_ops=[kept]).save_ops == [kept]


class ReluInPlaceAfterLinear(nn.Module):
    """``Linear -> ReLU(inplace=True) -> Linear``: the first linear's `addmm` output is written in place."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU(inplace=True), nn.Linear(DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.net(x)


def test_an_output_save_ops_keeps_that_is_written_in_place_later_is_named_with_the_fix() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(ReluInPlaceAfterLinear(), nn.Linear(DIM, 1))
    model, fixed = copy.deepcopy(plain), copy.deepcopy(plain)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0"], save_ops=["aten.addmm"]))
    x = torch.randn(4, DIM)
    with pytest.raises(RuntimeError) as raised:  # a `RuntimeError`, as torch's own was
        model(x).sum().backward()
    kept = "region `0` keeps op outputs by `save_ops` ['aten.addmm']."
    assert str(raised.value) == f"lightning_ckpt_determinism: {kept} {KEPT_OUTPUT_WRITTEN_HINT}"
    report = check_recomputation(model, lambda: model(x).sum(), attribution=True)
    (region,) = report.regions
    assert (region.cause, region.hint) == ("recompute_error", KEPT_OUTPUT_WRITTEN_HINT)
    # Without that entry the same block trains checkpointed as it does plainly.
    apply_activation_checkpointing(fixed, CheckpointingConfig(names=["0"]))
    plain(x).sum().backward()
    fixed(x).sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), fixed.parameters(), strict=True))


@pytest.mark.parametrize(
    "entry",
    [
        "aten._scaled_dot_product_flash_attention",
        "aten._scaled_dot_product_efficient_attention",
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
    ],
)
def test_an_attention_kernel_random_only_through_its_dropout_p_is_a_save_op(entry: str) -> None:
    # Tagged random for `dropout_p`; the usual selective-checkpointing lists keep them.
    assert CheckpointingConfig(classes=["Block"], save_ops=[entry]).save_ops == [entry]


def test_resolve_ops_expands_packets_to_every_overload_without_duplicates() -> None:
    ops = resolve_ops(["aten.mm", "aten.mm.default", "aten.addmm.default"])
    # The `out=` forms (`mm.out`, `mm.dtype_out`) are left out: torch cannot keep what an op wrote into.
    assert ops == [torch.ops.aten.mm.default, torch.ops.aten.mm.dtype, torch.ops.aten.addmm.default]


def test_resolve_ops_keeps_a_single_overload() -> None:
    assert resolve_ops(["aten.bmm.default"]) == [torch.ops.aten.bmm.default]
    assert resolve_ops([]) == []


@pytest.mark.parametrize("field_name", ["classes", "names", "save_ops"])
def test_a_string_for_a_list_field_is_rejected(field_name: str) -> None:
    kwargs = {"classes": ["Block"], field_name: "aten.mm"}
    allowed = "a list of strings or 'auto'" if field_name == "classes" else "a list of strings"
    with pytest.raises(CheckpointingConfigError, match=rf"^`{field_name}` must be {allowed}, got 'aten.mm'; use"):
        CheckpointingConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("field_name", ["classes", "names", "save_ops"])
def test_none_for_a_list_field_is_one_line_saying_to_write_an_empty_list(field_name: str) -> None:
    # A YAML key left empty (`save_ops:`) reads as null.
    kwargs = {"classes": ["Block"], "names": ["model.*"], field_name: None}
    with pytest.raises(CheckpointingConfigError) as raised:
        CheckpointingConfig(**kwargs)  # type: ignore[arg-type]
    assert str(raised.value) == (
        f"`{field_name}` must be a list, got None; write `[]` for none, or leave `{field_name}` out."
    )


@pytest.mark.parametrize(("field_name", "entry"), [("classes", "Block"), ("names", "model.*"), ("save_ops", "aten.mm")])
def test_a_mapping_for_a_list_field_is_refused_since_its_values_would_be_dropped(field_name: str, entry: str) -> None:
    kwargs = {"classes": ["Block"], field_name: {entry: 2}}
    with pytest.raises(CheckpointingConfigError) as raised:
        CheckpointingConfig(**kwargs)  # type: ignore[arg-type]
    assert str(raised.value) == (
        f"`{field_name}` must be a list, got a mapping {{{entry!r}: 2}}, whose values nothing reads; list the names"
        f" alone: [{entry!r}]."
    )


def test_numpys_numbers_are_taken_as_the_plain_numbers_they_are() -> None:
    # A sweep computes its settings with NumPy: `np.int64(2)` is an integer, `np.float32(0.5)` a fraction.
    config = CheckpointingConfig(classes=["Block"], every_n=np.int64(2))  # type: ignore[arg-type]
    assert (config.every_n, type(config.every_n)) == (2, int)
    assert CheckpointingConfig(classes=["Block"], memory_budget=np.int64(2**20)).memory_budget == 2**20  # type: ignore[arg-type]
    budget = CheckpointingConfig(classes=["Block"], memory_budget=np.float32(0.5)).memory_budget  # type: ignore[arg-type]
    assert (budget, type(budget)) == (0.5, float)
    monitor = RecomputationMonitor(
        every_n_steps=np.int64(50),  # type: ignore[arg-type]
        sentinel_every_n_steps=np.int64(2),  # type: ignore[arg-type]
        tolerance=np.float32(0.25),  # type: ignore[arg-type]
    )
    assert (monitor.every_n_steps, monitor.sentinel_every_n_steps, monitor.tolerance) == (50, 2, 0.25)
    assert (type(monitor.every_n_steps), type(monitor.tolerance)) == (int, float)
    with pytest.raises(CheckpointingConfigError, match=r"^`every_n` must be an integer >= 1, got np.True_\.$"):
        CheckpointingConfig(classes=["Block"], every_n=np.bool_(True))  # type: ignore[arg-type]


def test_config_error_is_a_value_error_exported_from_the_package_root() -> None:
    assert issubclass(CheckpointingConfigError, ValueError)
    assert lightning_ckpt_determinism.CheckpointingConfigError is CheckpointingConfigError
    assert "CheckpointingConfigError" in lightning_ckpt_determinism.__all__


# Each message starts with the argument in backticks: `examples/train.py` relies on it to find them in jsonargparse's.
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, r"`CheckpointingConfig` selects nothing"),
        ({"classes": ["Block"], "every_n": 0}, r"`every_n` must be an integer >= 1, got 0\."),
        ({"classes": ["Block"], "determinism_check": "strict"}, r"`determinism_check` can be default, none"),
        ({"classes": ["no_such_package.Block"]}, r"`classes` entry 'no_such_package.Block' cannot be imported"),
        ({"classes": ["math.pi"]}, r"`classes` entry 'math.pi' is not a class"),
        ({"classes": ["Block"], "save_ops": ["aten.nosuchop"]}, r"`save_ops` entry 'aten.nosuchop' is not an op"),
        ({"classes": ["Block", ""]}, r"`classes` holds an empty entry \(\['Block', ''\]\): remove it\.$"),
        ({"names": [" "]}, r"`names` holds an empty entry \(\[' '\]\): remove it\.$"),
    ],
)
def test_config_checks_raise_the_config_error(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(CheckpointingConfigError, match=f"^{message}"):
        CheckpointingConfig(**kwargs)  # type: ignore[arg-type]


def test_a_class_path_to_a_module_that_does_not_export_it_advises_the_bare_name_not_a_far_one() -> None:
    # `torch` has no `Linear` (it lives in `torch.nn`): no name of `torch` is close enough to be the one meant.
    with pytest.raises(CheckpointingConfigError) as raised:
        resolve_class_path("torch.Linear")
    assert str(raised.value) == (
        "`classes` entry 'torch.Linear' cannot be imported (module 'torch' has no attribute 'Linear'). Use a bare"
        " class name such as 'Linear' or a dotted path to an importable class."
    )


def test_none_where_a_choice_is_the_string_none_or_off_says_to_write_the_string() -> None:
    with pytest.raises(CheckpointingConfigError, match=r"got None \(a string: write 'none'\)\.$"):
        CheckpointingConfig(classes=["Linear"], determinism_check=None)  # type: ignore[arg-type]
    with pytest.raises(CheckpointingConfigError, match=r"got None \(a string: write 'off'\)\.$"):
        RecomputationMonitor(sentinel=None)  # type: ignore[arg-type]


def test_resolvers_raise_the_config_error() -> None:
    with pytest.raises(CheckpointingConfigError, match=r"^`classes` entry 'torch.nn.NoSuchLayer' cannot be imported"):
        resolve_class_path("torch.nn.NoSuchLayer")
    with pytest.raises(CheckpointingConfigError, match=r"^`save_ops` entry 'mm' is not an op name"):
        resolve_ops(["mm"])


def test_monitor_without_loss_fn_under_manual_optimization_raises_the_config_error(tmp_path: object) -> None:
    module = StackModule()
    module.automatic_optimization = False
    trainer = pl.Trainer(**trainer_kwargs(tmp_path))  # type: ignore[arg-type]
    with pytest.raises(CheckpointingConfigError, match=r"^`RecomputationMonitor` needs `loss_fn` with manual"):
        RecomputationMonitor().on_fit_start(trainer, module)
    # Under `CheckpointingCLI` the fix is written as the YAML writes it: a lambda has no YAML spelling.
    monitor = RecomputationMonitor()
    monitor.hint_syntax = "yaml"
    with pytest.raises(CheckpointingConfigError, match=r"Set `loss_fn: your_package\.your_module\.loss_fn` under"):
        monitor.on_fit_start(trainer, module)


def test_selections_that_wrap_nothing_raise_the_config_error() -> None:
    model = make_stack(n=3)
    with pytest.raises(
        CheckpointingConfigError, match=r"^`CheckpointingConfig` matches no module of Stack: classes=\['NoSuchBlock'\]"
    ):
        select_modules(model, CheckpointingConfig(classes=["NoSuchBlock"]))
    with pytest.raises(CheckpointingConfigError, match=r"^`every_n`=4 selects none of the 3 matched modules of Stack"):
        apply_activation_checkpointing(model, CheckpointingConfig(classes=["DropoutBlock"], every_n=4))


def test_a_regular_expression_in_names_is_told_names_are_globs_with_the_glob_meant() -> None:
    model = make_stack(n=3)
    regex = r"blocks\.\d+"
    with pytest.raises(CheckpointingConfigError) as raised:
        select_modules(model, CheckpointingConfig(names=[regex]))
    meant = f" Names are globs (`*`, `?`, `[0-9]`), not regular expressions: did you mean 'blocks.*' for {regex!r}?"
    assert meant in str(raised.value)
    assert select_modules(model, CheckpointingConfig(names=["blocks.*"])).keys() == {"blocks.0", "blocks.1", "blocks.2"}
    with pytest.raises(CheckpointingConfigError) as raised:
        select_modules(model, CheckpointingConfig(names=["layers.(0|1)"]))
    assert " Names are globs (`*`, `?`, `[0-9]`), not regular expressions ('layers.(0|1)')." in str(raised.value)


@pytest.mark.parametrize(
    ("written", "meant"),
    [("model.blocks.*", "blocks.*"), ("blokcs.*", "blocks.*"), ("blocks.1.linaer", "blocks.1.linear")],
)
def test_a_name_with_a_leading_name_too_many_or_misspelt_is_told_the_name_meant(written: str, meant: str) -> None:
    model = make_stack(n=3)
    with pytest.raises(CheckpointingConfigError) as raised:
        select_modules(model, CheckpointingConfig(names=[written]))
    assert f" Did you mean {meant!r} for {written!r}? The model's module classes" in str(raised.value)
    assert select_modules(model, CheckpointingConfig(names=[meant]))


def test_a_misspelt_name_beside_one_that_matches_is_warned_with_the_name_meant() -> None:
    with pytest.warns(
        LightningCkptDeterminismWarning,
        match=r"entries \['blokcs\.1'\] match no module of Stack; check their spelling\. Did you mean 'blocks\.1' for"
        r" 'blokcs\.1'\?$",
    ):
        selected = select_modules(make_stack(n=3), CheckpointingConfig(names=["blocks.0", "blokcs.1"]))
    assert list(selected) == ["blocks.0"]


@pytest.mark.parametrize("written", ["model.*", "blocks.3", "blocks.-1", "blocks.30", "model.blocks.[a-z]*"])
def test_a_name_no_module_name_is_close_to_is_told_no_name_meant(written: str) -> None:
    # Not a glob matching everything, nor another block's index for one out of range.
    with pytest.raises(CheckpointingConfigError) as raised:
        select_modules(make_stack(n=3), CheckpointingConfig(names=[written]))
    assert "Did you mean" not in str(raised.value)


@pytest.mark.parametrize("written", ["blocks.3", "blocks.30"])
def test_an_index_past_a_containers_last_is_told_its_range(written: str) -> None:
    with pytest.raises(CheckpointingConfigError) as raised:
        select_modules(make_stack(n=3), CheckpointingConfig(names=[written]))
    assert f" 'blocks' holds 0 to 2: {written!r} is past its last. The model's module classes" in str(raised.value)


def test_a_regular_expression_is_told_so_not_respelt() -> None:
    with pytest.raises(CheckpointingConfigError) as raised:
        select_modules(make_stack(n=3), CheckpointingConfig(names=["blocks.*.linear|dropout"]))
    assert " Names are globs (`*`, `?`, `[0-9]`), not regular expressions ('blocks.*.linear|dropout')." in str(
        raised.value
    )
    assert "Did you mean" not in str(raised.value)


def test_strategy_without_a_config_raises_the_config_error_saying_how_to_give_one() -> None:
    for error in (CheckpointingConfigError, TypeError):
        with pytest.raises(
            error,
            match=r"^`checkpointing` is missing: `SingleDeviceCheckpointingStrategy` needs one\. Build it with"
            r" `CheckpointingConfig\(classes=\[\.\.\.\]\)`, or in YAML give the strategy"
            r" `init_args: \{checkpointing: \{classes: \[Block\]\}\}`\.$",
        ):
            SingleDeviceCheckpointingStrategy(checkpointing=None)


@pytest.mark.parametrize("checkpointing", [["Block"], {"classes": ["Block"]}])
def test_strategy_with_another_type_of_config_raises_the_config_error_naming_the_mapping(checkpointing: object) -> None:
    with pytest.raises(
        CheckpointingConfigError, match=r"give a mapping such as `checkpointing: \{classes: \[Block\]\}`"
    ):
        SingleDeviceCheckpointingStrategy(checkpointing=checkpointing)  # type: ignore[arg-type]
    # It raised `TypeError` before, and still is one.
    with pytest.raises(
        TypeError, match=rf"`checkpointing` must be a `CheckpointingConfig`, got {type(checkpointing).__name__}"
    ):
        SingleDeviceCheckpointingStrategy(checkpointing=checkpointing)  # type: ignore[arg-type]


def test_fsdp_strategy_with_fsdps_own_checkpointing_raises_the_config_error() -> None:
    with pytest.raises(CheckpointingConfigError, match=r"^`activation_checkpointing_policy` is FSDP's own"):
        FSDPCheckpointingStrategy(
            checkpointing=CheckpointingConfig(classes=["Block"]), activation_checkpointing_policy={nn.Linear}
        )


def test_signatures_carry_the_types_that_say_what_a_field_takes() -> None:
    # The package's own, which LightningCLI hands over to the constructor's check (jsonargparse's checked themselves,
    # in other words than the constructor's).
    fields = {field.name: field.type for field in dataclasses.fields(CheckpointingConfig)}
    assert fields["every_n"] is config_module.PositiveInt
    assert typing.get_args(fields["determinism_check"]) == tuple(DETERMINISM_CHECKS)
    monitor = inspect.signature(RecomputationMonitor).parameters
    assert monitor["every_n_steps"].annotation is config_module.PositiveInt
    assert monitor["tolerance"].annotation is config_module.NonNegativeFloat
    assert monitor["log_prefix"].annotation is config_module.NotEmptyStr
    assert monitor["history_size"].annotation is config_module.PositiveInt
    strategy = inspect.signature(SingleDeviceCheckpointingStrategy).parameters
    assert strategy["checkpointing"].annotation == CheckpointingConfig | None
    assert strategy["checkpointing"].default is inspect.Parameter.empty


def test_values_of_restricted_types_are_stored_as_plain_ones() -> None:
    config = CheckpointingConfig(classes=["Block"], every_n=PositiveInt(2))
    assert type(config.every_n) is int
    assert config == CheckpointingConfig(classes=["Block"], every_n=2)
    assert yaml.safe_load(yaml.safe_dump(dataclasses.asdict(config)))["every_n"] == 2
    monitor = RecomputationMonitor(
        every_n_steps=PositiveInt(5),
        tolerance=NonNegativeFloat(0.5),
        log_prefix=NotEmptyStr("check"),
        history_size=PositiveInt(3),
    )
    assert (type(monitor.every_n_steps), type(monitor.tolerance), type(monitor.log_prefix)) == (int, float, str)
    assert monitor.state_key == RecomputationMonitor(every_n_steps=5, log_prefix="check").state_key
    assert monitor.history.maxlen == 3
    assert pickle.loads(pickle.dumps(monitor)).every_n_steps == 5


def test_a_model_wrapped_with_a_config_of_restricted_types_saves_and_loads() -> None:
    model = make_stack(n=2)
    apply_activation_checkpointing(model, CheckpointingConfig(classes=["DropoutBlock"], every_n=PositiveInt(2)))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert list(select_modules(loaded, CheckpointingConfig(classes=["DropoutBlock"], every_n=2))) == ["blocks.1"]
    assert loaded.state_dict().keys() == model.state_dict().keys()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"classes": ["Linear", 3]},
            r"`classes` must be a list of class names, dotted paths or classes, got the entry 3 \(int\)",
        ),
        ({"classes": torch.nn.Linear}, r"`classes` must be a list, got the class Linear; use \[Linear\]"),
        (
            {"classes": ["Linear"], "names": [3]},
            r"`names` must be a list of strings, got the entry 3 \(int\); write module names as globs \('model",
        ),
        (
            {"classes": ["Linear"], "save_ops": [torch.ops.aten.mm.default]},
            r"`save_ops` must be a list of strings, got .*; write ops as strings \('aten.mm'\)\.$",
        ),
        (
            {"classes": ["Linear"], "keep_data_dependent": "no"},
            r"`keep_data_dependent` must be True or False, got 'no'",
        ),
        ({"classes": ["Linear"], "protect_buffers": 0}, r"`protect_buffers` must be True or False, got 0"),
    ],
)
def test_entries_that_are_not_strings_and_switches_that_are_not_bools_raise_the_config_error(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(CheckpointingConfigError, match=message):
        CheckpointingConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("given", "stored", "parsed"),
    [
        (1000, 1000, 1000),
        (2**40, 2**40, 2**40),
        ("512MiB", "512MiB", 512 * 2**20),
        ("2GB", "2GB", 2 * 10**9),
        ("1.5GiB", "1.5GiB", 3 * 2**29),
        ("300KiB", "300KiB", 300 * 1024),
        (0.5, 0.5, 0.5),
        (1.0, 1.0, 1.0),
        ("50%", "50%", 0.5),
        ("0.25", 0.25, 0.25),
        ("4096", 4096, 4096),
        ("auto", "auto", "auto"),
        (None, None, None),
    ],
)
def test_memory_budget_takes_bytes_units_and_fractions(given: object, stored: object, parsed: object) -> None:
    config = CheckpointingConfig(classes=["Block"], memory_budget=given)  # type: ignore[arg-type]
    assert config.memory_budget == stored
    assert type(config.memory_budget) is type(stored)
    assert parse_memory_budget(config.memory_budget) == parsed


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, r"`memory_budget` must be more than 0 bytes, got 0\.$"),
        (-5, r"`memory_budget` must be more than 0 bytes, got -5\.$"),
        ("0MiB", r"`memory_budget` must be more than 0 bytes, got '0MiB'\.$"),
        ("0.5B", r"`memory_budget` '0\.5B' is less than a byte: give at least 1 byte, or a fraction without a unit"),
        (0.0, r"`memory_budget` as a fraction must be in \(0, 1\], got 0\.0;"),
        (-0.5, r"`memory_budget` as a fraction must be in \(0, 1\], got -0\.5;"),
        (1.5, r"`memory_budget` as a fraction must be in \(0, 1\], got 1\.5;"),
        ("1.5", r"`memory_budget` as a fraction must be in \(0, 1\], got 1\.5;"),
        ("150%", r"`memory_budget` as a percentage must be in \(0, 100\], got '150%'\.$"),
        ("3XB", r"`memory_budget` '3XB' has an unknown unit 'XB'; use one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"),
        ("lots", r"`memory_budget` 'lots' is not a size; give bytes"),
        ("-5MiB", r"`memory_budget` '-5MiB' is not a size; give bytes"),
        ("none", r"`memory_budget` 'none' is not a size: for no budget write `null` \(`None` in Python\), or leave"),
        ("Off", r"`memory_budget` 'Off' is not a size: for no budget write `null`"),
        (True, r"`memory_budget` must be a size, got True; give bytes"),
        ([1], r"`memory_budget` must be a size, got \[1\]; give bytes"),
    ],
)
def test_bad_memory_budgets_are_one_line_errors_naming_the_field(value: object, message: str) -> None:
    with pytest.raises(CheckpointingConfigError, match=f"^{message}") as raised:
        CheckpointingConfig(classes=["Block"], memory_budget=value)  # type: ignore[arg-type]
    assert "\n" not in str(raised.value)


def test_memory_budget_with_every_n_above_one_is_an_error() -> None:
    with pytest.raises(
        CheckpointingConfigError,
        match=r"^`memory_budget` chooses which matched modules to checkpoint and cannot be combined with `every_n`=2;"
        r" set `every_n` to 1 or remove `memory_budget`\.$",
    ):
        CheckpointingConfig(classes=["Block"], every_n=2, memory_budget="1GB")


@pytest.mark.parametrize(("value", "stored"), [("512MiB", "512MiB"), (0.5, 0.5), (1000000, 1000000), ("50%", "50%")])
def test_lightning_cli_yaml_takes_a_memory_budget_and_help_explains_it(
    value: object, stored: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    monkeypatch.setattr(sys, "argv", ["examples/train.py"])
    config = yaml.safe_load(GPT_CONFIG.read_text())
    config["trainer"]["strategy"]["init_args"]["checkpointing"]["memory_budget"] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = CheckpointingCLI(subclass_mode_model=True, subclass_mode_data=True, args=["--config", str(path)], run=False)
    assert cli.trainer.strategy.checkpointing.memory_budget == stored
    # The strategy's `checkpointing` is one argument in LightningCLI's help; jsonargparse reads each field's text
    # from the docstring, as a parser of the config itself shows.
    parser = ArgumentParser()
    parser.add_class_arguments(CheckpointingConfig, "checkpointing")
    parser.print_help()
    assert "The most activation memory the matched modules may keep" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(
    ("field", "value"),
    [("budget_granularity", "module"), ("budget_granularity", "op")]
    + [("budget_cost", cost) for cost in ("roofline", "calibrated", "flops")],
)
def test_lightning_cli_yaml_and_python_take_each_budget_choice(
    field: str, value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    monkeypatch.setattr(sys, "argv", ["examples/train.py"])
    config = yaml.safe_load(GPT_CONFIG.read_text())
    checkpointing = config["trainer"]["strategy"]["init_args"]["checkpointing"]
    checkpointing.update({"memory_budget": "50%", field: value})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = CheckpointingCLI(subclass_mode_model=True, subclass_mode_data=True, args=["--config", str(path)], run=False)
    from_yaml = cli.trainer.strategy.checkpointing
    from_python = CheckpointingConfig(classes=from_yaml.classes, memory_budget="50%", **{field: value})  # type: ignore[arg-type]
    assert getattr(from_yaml, field) == getattr(from_python, field) == value
    assert from_yaml == from_python
    assert pickle.loads(pickle.dumps(from_python)) == from_python


@pytest.mark.parametrize(
    ("field", "choices"),
    [
        ("budget_granularity", config_module.BUDGET_GRANULARITIES),
        ("budget_cost", config_module.BUDGET_COSTS),
    ],
)
def test_each_budget_choice_defaults_to_its_first_and_its_type_lists_the_choices(
    field: str, choices: tuple[str, ...]
) -> None:
    assert {
        "budget_granularity": ("module", "op"),
        "budget_cost": ("roofline", "calibrated", "flops"),
    }[field] == choices
    assert getattr(CheckpointingConfig(classes=["Block"]), field) == choices[0]
    fields = {entry.name: entry.type for entry in dataclasses.fields(CheckpointingConfig)}
    assert typing.get_args(fields[field]) == choices


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"budget_granularity": "layer", "memory_budget": "50%"},
            r"^`budget_granularity` can be module, op, got 'layer'\.$",
        ),
        ({"budget_granularity": None, "memory_budget": "50%"}, r"^`budget_granularity` can be module, op, got None\.$"),
        (
            {"budget_granularity": "op"},
            r"^`budget_granularity`='op' chooses what to keep under a memory budget; set `memory_budget`"
            r" \(e\.g\. '50%'\) or leave `budget_granularity` at 'module'\.$",
        ),
        (
            {"budget_cost": "fast", "memory_budget": "50%"},
            r"^`budget_cost` can be roofline, calibrated, flops, got 'fast'\.$",
        ),
        (
            {"budget_cost": None, "memory_budget": "50%"},
            r"^`budget_cost` can be roofline, calibrated, flops, got None\.$",
        ),
        (
            {"budget_cost": "flops"},
            r"^`budget_cost`='flops' is the recompute cost a memory budget minimises; set `memory_budget`"
            r" \(e\.g\. '50%'\) or leave `budget_cost` at 'roofline'\.$",
        ),
    ],
)
def test_bad_budget_choices_are_one_line_errors_naming_the_field(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(CheckpointingConfigError, match=message) as raised:
        CheckpointingConfig(classes=["Block"], **kwargs)  # type: ignore[arg-type]
    assert "\n" not in str(raised.value)


# Classes given as objects.


class _Outer:
    class InnerBlock(DropoutBlock):
        """A block class nested in another: its path is the module and its qualified name."""


def _linears() -> Stack:
    torch.manual_seed(0)
    return Stack([ScaledLinear(8, 8), nn.Linear(8, 8), PlainBlock()])


def _local_block_class() -> type[nn.Module]:
    class LocalBlock(DropoutBlock):
        """Defined inside a function: its path imports nothing."""

    return LocalBlock


@pytest.mark.parametrize(
    ("given", "as_strings", "stored"),
    [
        (DropoutBlock, ["DropoutBlock"], "tests.helpers.DropoutBlock"),
        (nn.Linear, ["torch.nn.Linear"], "torch.nn.modules.linear.Linear"),
        (_Outer.InnerBlock, ["tests.test_config._Outer.InnerBlock"], "tests.test_config._Outer.InnerBlock"),
    ],
)
def test_a_class_given_as_an_object_wraps_what_its_name_or_path_wraps_and_is_stored_as_its_path(
    given: type[nn.Module], as_strings: list[str], stored: str
) -> None:
    def model() -> Stack:
        return _linears() if given is nn.Linear else make_stack(given, n=3)

    by_object, by_string = model(), model()
    wrapped = apply_activation_checkpointing(by_object, CheckpointingConfig(classes=[given]))
    assert wrapped == apply_activation_checkpointing(by_string, CheckpointingConfig(classes=as_strings))
    # `isinstance`, as a dotted path matches: the Linear subclass too.
    linears = ["inp", "blocks.0", "blocks.1", "blocks.2.linear", "head"]
    assert wrapped == (linears if given is nn.Linear else ["blocks.0", "blocks.1", "blocks.2"])
    config = CheckpointingConfig(classes=[given])
    assert config.classes == [stored] and type(config.classes[0]) is str
    assert config == CheckpointingConfig(classes=[stored])


def test_a_config_of_class_objects_pickles_saves_to_yaml_and_selects_the_same_modules_after() -> None:
    config = CheckpointingConfig(classes=[DropoutBlock, "PlainBlock"], every_n=2)
    loaded = pickle.loads(pickle.dumps(config))
    assert loaded == config and loaded.classes == ["tests.helpers.DropoutBlock", "PlainBlock"]
    assert CheckpointingConfig(**yaml.safe_load(yaml.safe_dump(dataclasses.asdict(config)))) == config
    model = Stack([DropoutBlock(), PlainBlock(), DropoutBlock(), PlainBlock()])
    assert list(select_modules(model, loaded)) == list(select_modules(model, config)) == ["blocks.1", "blocks.3"]


def test_a_class_defined_in_a_function_is_matched_in_this_process_and_refuses_to_pickle() -> None:
    local = _local_block_class()
    with pytest.warns(
        LightningCkptDeterminismWarning,
        match=r"`classes` entry LocalBlock \(tests\.test_config\."
        r"_local_block_class\.<locals>\.LocalBlock\) cannot be imported by its path.*`strategy=\"ddp_spawn\"`",
    ):
        config = CheckpointingConfig(classes=[local])
    assert config.classes == ["tests.test_config._local_block_class.<locals>.LocalBlock"]
    # Training with it in this process is training without checkpointing, as for any class.
    torch.manual_seed(0)
    checkpointed = Stack([local(), PlainBlock(), local()])
    plain = copy.deepcopy(checkpointed)
    assert apply_activation_checkpointing(checkpointed, config) == ["blocks.0", "blocks.2"]
    assert _unequal(step_gradients(checkpointed), step_gradients(plain)) == []
    # A changed copy keeps the class, without warning again; another class of the same path is another entry.
    again = dataclasses.replace(config, every_n=2)
    assert list(select_modules(Stack([local(), local()]), again)) == ["blocks.1"]
    with pytest.warns(LightningCkptDeterminismWarning, match="cannot be imported by its path"):
        assert CheckpointingConfig(classes=[_local_block_class()]) != config
    with pytest.raises(
        pickle.PicklingError,
        match=r"^lightning_ckpt_determinism: the `classes` entry LocalBlock .*"
        r"cannot be pickled.*Define it at module level, or give its name 'LocalBlock' as a string\.",
    ):
        pickle.dumps(config)


def test_messages_name_a_class_given_as_an_object_by_its_name() -> None:
    with pytest.raises(CheckpointingConfigError, match=r"matches no module of Stack: classes=\['PlainBlock'\],"):
        select_modules(make_stack(n=2), CheckpointingConfig(classes=[PlainBlock]))
    with pytest.warns(LightningCkptDeterminismWarning, match=r"entries \['PlainBlock'\] match no module of Stack"):
        select_modules(make_stack(n=2), CheckpointingConfig(classes=[DropoutBlock, PlainBlock]))


def _unequal(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> list[str]:
    return [name for name in first if not torch.equal(first[name], second[name])]
