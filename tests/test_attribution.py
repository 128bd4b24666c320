import copy
import csv
import itertools
import logging
import math
import random
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, ClassVar

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_ckpt_determinism import (
    CAUSE_HINTS,
    CheckpointingConfig,
    LightningCkptDeterminismWarning,
    RecomputationMonitor,
    RecomputationReport,
    RegionReport,
    SingleDeviceCheckpointingStrategy,
    apply_activation_checkpointing,
    check_recomputation,
)
from lightning_ckpt_determinism.checkpointing.modules import storage_pointer
from lightning_ckpt_determinism.checkpointing.wrapper import checkpointed_modules
from lightning_ckpt_determinism.verify.attribution import Attribution, observer
from lightning_ckpt_determinism.verify.attribution.observer import CallRecord
from lightning_ckpt_determinism.verify.outcome import region_outcome, report_diverged
from tests.helpers import (
    DIM,
    AllToAllBlock,
    BatchNormBlock,
    CounterScaleBlock,
    DropoutBlock,
    FailingRecomputeBlock,
    FlagBlock,
    FunctionalSyncNormBlock,
    InPlaceReluBlock,
    NumpyNoiseBlock,
    PlainBlock,
    PythonRandomBlock,
    RoutingBlock,
    RowSumBlock,
    StackModule,
    SyncNormBlock,
    WrittenAfterItsForward,
    batch,
    make_stack,
    stack_with,
    trainer_kwargs,
    twins,
)

REGIONS = ["blocks.0", "blocks.1", "blocks.2"]


def attributed(
    block: Callable[[], nn.Module], position: int = 1, calibrate_noise: bool = False, **config: object
) -> tuple[nn.Module, RecomputationReport]:
    """A three-block stack with ``block`` at ``position``, every block checkpointed, checked with attribution."""
    model = stack_with(block, position=position)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["blocks.*"], **config))  # type: ignore[arg-type]
    x, y = batch()
    report = check_recomputation(
        model, lambda: F.mse_loss(model(x), y), attribution=True, calibrate_noise=calibrate_noise
    )
    return model, report


def only_finding(report: RecomputationReport) -> RegionReport:
    """The one region with a cause, after checking every other region is clean."""
    assert [region.name for region in report.regions] == REGIONS
    found = [region for region in report.regions if region.cause is not None]
    assert len(found) == 1, report.regions
    for region in report.regions:
        if region is not found[0]:
            assert (region.diverged, region.max_abs_diff, region.first_divergent_op, region.hint) == (
                False,
                0.0,
                None,
                None,
            )
    return found[0]


def assert_clean(report: RecomputationReport) -> None:
    assert not report.diverged
    assert report.grad_divergence == 0.0
    assert report.buffer_mutations == []
    assert [region.name for region in report.regions] == REGIONS
    for region in report.regions:
        # One call and one recomputation per region, compared op by op.
        assert region == RegionReport(name=region.name, ops_compared=region.ops_compared, recomputations=1, calls=1)
        assert region.ops_compared > 0


# Each catalogue entry: the defective block, the config that breaks it (or {}), the config or block that fixes it,
# and the first op that must differ.
CATALOGUE = {
    "rng_not_preserved": (DropoutBlock, {"preserve_rng_state": False}, {}, "aten.bernoulli_.float"),
    "host_rng": (NumpyNoiseBlock, {}, {"preserve_host_rng": True}, "aten.add.Tensor"),
    "shape_change": (RoutingBlock, {}, PlainBlock, "aten.slice.Tensor"),
    "python_state": (CounterScaleBlock, {}, PlainBlock, "aten.mul.Tensor"),
    "nondeterministic_kernel": (
        RowSumBlock,
        {},
        lambda: RowSumBlock(deterministic=True),
        "lckd_examples.unordered_row_sum.default",
    ),
}


@pytest.mark.parametrize("position", [0, 2])
@pytest.mark.parametrize("cause", sorted(CATALOGUE))
def test_the_defective_block_is_named_with_its_cause_and_no_other(cause, position):
    block, breaking, _, op = CATALOGUE[cause]
    _, report = attributed(block, position=position, **breaking)
    region = only_finding(report)
    assert region.name == f"blocks.{position}"
    assert (region.cause, region.hint, region.diverged) == (cause, CAUSE_HINTS[cause], True)
    assert region.first_divergent_op is not None
    assert region.first_divergent_op[0] == op
    assert region.max_abs_diff > 0.0
    assert report.diverged
    assert report.buffer_mutations == []


@pytest.mark.parametrize("cause", sorted(CATALOGUE))
def test_the_same_model_without_the_defect_reports_nothing(cause):
    block, breaking, fix, _ = CATALOGUE[cause]
    if isinstance(fix, dict):
        _, report = attributed(block, **fix)
    else:
        _, report = attributed(fix, **breaking)
    assert_clean(report)


def test_ops_are_aligned_on_what_both_passes_ran():
    # Dropout on the CPU: t, addmm, relu, empty_like (never compared as values), bernoulli_, div_, mul, add. Every
    # call keeps torch's early stop, the region's first one too (as torch does): recomputation stops after div_ (the
    # last tensor backward needs), so mul and add are not compared.
    model, report = attributed(DropoutBlock, preserve_rng_state=False)
    region = only_finding(report)
    assert region.first_divergent_op == ("aten.bernoulli_.float", 4)
    assert region.ops_compared == 6
    assert region.max_abs_diff == 2.0  # a kept element scaled by 1 / (1 - p) against a dropped one
    assert [r.ops_compared for r in report.regions] == [3, 6, 3]
    # A later call compares the same ops.
    x, y = batch()
    report = check_recomputation(model, lambda: F.mse_loss(model(x), y), attribution=True)
    assert only_finding(report).ops_compared == 6
    assert [r.ops_compared for r in report.regions] == [3, 6, 3]


def test_python_random_is_host_rng_too():
    _, report = attributed(PythonRandomBlock)
    region = only_finding(report)
    assert (region.name, region.cause) == ("blocks.1", "host_rng")
    _, replayed = attributed(PythonRandomBlock, preserve_host_rng=True)
    assert_clean(replayed)


class RandomLayerBlock(nn.Module):
    """Runs one of two linear layers of the same shape, chosen with Python's ``random`` (a LayerDrop): recomputation
    may run the other one."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.layers[random.randrange(2)](x))


def test_a_layer_chosen_with_python_random_is_host_rng_not_a_parameter_write():
    # The recomputation's `addmm` got the other layer's weight, whose values differ from the forward's: no parameter
    # was written, so the cause is the host RNG, which the replay confirms.
    random.seed(4)  # the forward and the recomputation draw different layers
    _, report = attributed(RandomLayerBlock)
    region = only_finding(report)
    assert (region.name, region.cause, region.first_divergent_op) == ("blocks.1", "host_rng", ("aten.addmm.default", 1))
    random.seed(4)
    _, replayed = attributed(RandomLayerBlock, preserve_host_rng=True)
    assert_clean(replayed)


def test_shape_change_names_the_region_torch_failed_in():
    _, report = attributed(RoutingBlock)
    assert report.error is not None
    assert report.error.startswith("CheckpointError: torch.utils.checkpoint: Recomputed values")
    region = report.regions[1]
    assert (region.cause, region.first_divergent_op, region.max_abs_diff) == (
        "shape_change",
        ("aten.slice.Tensor", 1),
        math.inf,
    )
    # Backward stopped at the failure: the block before it was never recomputed. The block after it was recomputed up
    # to its last saved tensor (torch's early stop, at every call): t, addmm, tanh.
    assert report.regions[0].ops_compared == 0
    assert report.regions[2].ops_compared == 3


def test_batchnorm_buffer_mutation_is_reported_although_gradients_agree():
    _, report = attributed(BatchNormBlock, protect_buffers=False)
    assert report.grad_divergence == 0.0
    # The running statistics end the step otherwise than a plain twin's: a divergence, as the monitor says too.
    assert (report.diverged, report.cause) == (True, "buffer_mutation")
    assert report.buffer_mutations == [
        "blocks.1.norm.running_mean",
        "blocks.1.norm.running_var",
        "blocks.1.norm.num_batches_tracked",
    ]
    region = only_finding(report)
    assert region == RegionReport(
        name="blocks.1",
        ops_compared=6,  # up to the region's last saved tensor (torch's early stop, at every call)
        max_abs_diff=0.0,
        first_divergent_op=None,
        diverged=True,
        cause="buffer_mutation",
        hint=(
            f"{CAUSE_HINTS['buffer_mutation']} Changed: blocks.1.norm.running_mean, blocks.1.norm.running_var,"
            " blocks.1.norm.num_batches_tracked."
        ),
        buffer_mutations=report.buffer_mutations,
        recomputations=1,
        calls=1,
    )
    _, protected = attributed(BatchNormBlock)
    assert_clean(protected)


@pytest.mark.parametrize("writer", ["caller", "replaced", "shared", "statistics"])
def test_buffers_written_outside_a_region_between_its_forward_and_recomputation_are_no_mutation_of_its(writer):
    twin, model = twins(lambda: WrittenAfterItsForward(writer), ["block"])
    x, y = batch()
    for _ in range(2):  # the first call learns, the second watches the buffers it read
        report = check_recomputation(model, lambda: F.mse_loss(model(x), y), attribution=True)
        assert (report.diverged, report.grad_divergence, report.buffer_mutations) == (False, 0.0, [])
        (region,) = report.regions
        assert region == RegionReport(name="block", ops_compared=region.ops_compared, recomputations=1, calls=1)
        # The check puts the state back: the model trains on as its plain twin does.
        for net in (model, twin):
            net.zero_grad(set_to_none=True)
            F.mse_loss(net(x), y).backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), twin.parameters(), strict=True))
        assert all(torch.equal(a, b) for a, b in zip(model.buffers(), twin.buffers(), strict=True))


def test_without_protect_buffers_a_shared_norm_updated_again_by_recomputation_is_the_regions_mutation():
    # The norm also runs after the block, outside it: its write between the forward and the recomputation cannot be
    # told from the recomputation's own, which stays without `protect_buffers`.
    torch.manual_seed(0)
    model = WrittenAfterItsForward("shared")
    apply_activation_checkpointing(model, CheckpointingConfig(names=["block"], protect_buffers=False))
    x, y = batch()
    report = check_recomputation(model, lambda: F.mse_loss(model(x), y), attribution=True)
    (region,) = report.regions
    names = ["block.1.running_mean", "block.1.running_var", "block.1.num_batches_tracked"]
    assert (report.diverged, report.cause, report.grad_divergence) == (True, "buffer_mutation", 0.0)
    assert (region.diverged, region.cause, region.buffer_mutations) == (True, "buffer_mutation", names)


def test_calibrated_noise_floor_tolerates_a_non_deterministic_kernel():
    _, report = attributed(RowSumBlock, calibrate_noise=True)
    assert 0.0 < report.grad_divergence < 1e-6
    assert report.noise_floor > report.grad_divergence
    assert not report.diverged
    region = only_finding(report)
    assert (region.name, region.cause, region.diverged) == ("blocks.1", "nondeterministic_kernel", False)
    # Without calibration the same difference is a divergence.
    _, uncalibrated = attributed(RowSumBlock)
    assert uncalibrated.noise_floor == 0.0
    assert uncalibrated.diverged
    assert only_finding(uncalibrated).diverged


def test_calibration_of_a_deterministic_model_measures_no_noise():
    _, report = attributed(DropoutBlock, calibrate_noise=True)
    assert report.noise_floor == 0.0
    assert_clean(report)


def test_selective_checkpointing_is_observed_without_false_positives():
    save_ops = ["aten.addmm", "aten.mul", "aten.clone", "aten.sum"]
    _, report = attributed(DropoutBlock, save_ops=save_ops)
    assert_clean(report)
    _, broken = attributed(DropoutBlock, save_ops=save_ops, preserve_rng_state=False)
    assert only_finding(broken).cause == "rng_not_preserved"


@torch.library.custom_op("lightning_ckpt_determinism_tests::masked", mutates_args=())
def masked(x: torch.Tensor) -> torch.Tensor:
    """A dropout written as a custom op: it draws from torch's default generator inside, without torch's random tag."""
    return x * (torch.rand(x.shape) > 0.3).to(x.dtype) / 0.7


@masked.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _keep_the_scale(ctx: Any, inputs: tuple[torch.Tensor], output: torch.Tensor) -> None:
    (x,) = inputs
    ctx.save_for_backward(torch.where(x != 0, output / x, torch.zeros_like(x)))


masked.register_autograd(lambda ctx, grad: grad * ctx.saved_tensors[0], setup_context=_keep_the_scale)


class CustomOpDropoutBlock(nn.Module):
    """Linear, tanh and :func:`masked`; with ``on_a_parameter``, :func:`masked` of a parameter too."""

    def __init__(self, on_a_parameter: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.gate = nn.Parameter(torch.ones(8)) if on_a_parameter else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.linear(x))
        return x + masked(hidden * (1.0 if self.gate is None else masked(self.gate)))


@pytest.mark.parametrize("on_a_parameter", [False, True], ids=["on an activation", "on a parameter"])
@pytest.mark.parametrize("preserve_rng_state", [False, True])
def test_a_custom_op_drawing_from_torchs_generator_is_rng_not_preserved(
    preserve_rng_state: bool, on_a_parameter: bool
) -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), CustomOpDropoutBlock(on_a_parameter), nn.Linear(8, 1))
    model = copy.deepcopy(plain)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["1"], preserve_rng_state=preserve_rng_state))
    x, y = batch()
    for twin in (plain, model):  # ground truth: the same seed before each
        torch.manual_seed(3)
        F.mse_loss(twin(x), y).backward()
    differs = any(not torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), model.parameters(), strict=True))
    assert differs is not preserve_rng_state
    report = check_recomputation(model, lambda: F.mse_loss(model(x), y), attribution=True)
    (region,) = report.regions
    assert report.diverged is not preserve_rng_state
    if preserve_rng_state:
        assert (region.diverged, region.cause, report.grad_divergence) == (False, None, 0.0)
        return
    assert (region.name, region.cause) == ("1", "rng_not_preserved")
    assert region.first_divergent_op is not None
    assert region.first_divergent_op[0] == "lightning_ckpt_determinism_tests.masked.default"


def test_a_flag_that_changes_which_ops_run_is_python_state():
    _, report = attributed(FlagBlock)
    region = only_finding(report)
    # The check puts the flag back between its passes: both passes' forwards take tanh, the recomputation sigmoid.
    assert (region.name, region.cause) == ("blocks.1", "python_state")
    assert region.first_divergent_op == ("aten.tanh.default", 2)
    assert region.max_abs_diff == math.inf
    assert report.diverged


def registered_observers(model: nn.Module) -> list[object]:
    """The region observers registered on ``model``'s checkpointed regions."""
    observers = (sub.forward.region_observer for sub in checkpointed_modules(model).values())
    return [observer for observer in observers if observer is not None]


def test_a_failing_recomputation_is_named_and_its_error_kept():
    model, report = attributed(FailingRecomputeBlock)
    assert report.error == "RuntimeError: call 2 of FailingRecomputeBlock"
    region = report.regions[1]
    assert (region.cause, region.hint, region.error) == (
        "recompute_error",
        CAUSE_HINTS["recompute_error"],
        "RuntimeError: call 2 of FailingRecomputeBlock",
    )
    assert region.diverged
    assert registered_observers(model) == []


def test_a_module_called_twice_is_one_region_with_every_call_compared():
    torch.manual_seed(0)
    shared = DropoutBlock()
    model = nn.Sequential(nn.Linear(8, 8), shared, shared, nn.Linear(8, 1))
    apply_activation_checkpointing(model, CheckpointingConfig(names=["1"], preserve_rng_state=False))
    x, y = batch()
    report = check_recomputation(model, lambda: F.mse_loss(model(x), y), attribution=True)
    (region,) = report.regions
    # Each call is recomputed up to its last saved tensor (torch's early stop, the first call too): 6 ops each.
    assert (region.name, region.ops_compared, region.cause) == ("1", 12, "rng_not_preserved")


def test_attribution_leaves_every_stream_and_the_next_step_as_without_it():
    def next_step(attribution: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor, float, float]:
        model = stack_with(NumpyNoiseBlock)
        apply_activation_checkpointing(model, CheckpointingConfig(names=["blocks.*"]))
        torch.manual_seed(3)
        np.random.seed(3)
        random.seed(3)
        x, y = batch()
        report = check_recomputation(model, lambda: F.mse_loss(model(x), y), attribution=attribution)
        assert len(report.regions) == (3 if attribution else 0)
        x, y = batch(seed=4)
        F.mse_loss(model(x), y).backward()
        grads = {name: param.grad for name, param in model.named_parameters() if param.grad is not None}
        return grads, torch.rand(3), float(np.random.rand()), random.random()

    with_grads, *with_streams = next_step(attribution=True)
    without_grads, *without_streams = next_step(attribution=False)
    assert with_grads.keys() == without_grads.keys()
    assert all(torch.equal(with_grads[name], without_grads[name]) for name in with_grads)
    assert torch.equal(with_streams[0], without_streams[0])
    assert with_streams[1:] == without_streams[1:]


def test_buffers_are_restored_after_attribution_found_a_mutation():
    model = stack_with(BatchNormBlock)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["blocks.*"], protect_buffers=False))
    before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    x, y = batch()
    report = check_recomputation(model, lambda: F.mse_loss(model(x), y), attribution=True)
    assert len(report.buffer_mutations) == 3
    assert all(torch.equal(before[name], buffer) for name, buffer in model.named_buffers())


def observed_stack(block: Callable[[], nn.Module]) -> tuple[nn.Module, Attribution]:
    """:func:`stack_with` ``block``, its blocks checkpointed, and an attribution observer of it."""
    model = stack_with(block)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["blocks.*"]))
    return model, Attribution(model)


def test_forward_copies_are_held_only_until_their_region_is_recomputed():
    model, observer = observed_stack(DropoutBlock)
    x, y = batch()
    with observer.observing():
        loss = F.mse_loss(model(x), y)
        held = [out for call in observer.calls for op in call.ops for out in op.outputs if out is not None]
        # Plain blocks: addmm, tanh, add; the dropout block: addmm, relu, bernoulli_, div_, mul, add (t is a view,
        # empty_like uninitialised memory).
        assert len(held) == 3 + 6 + 3
        torch.autograd.grad(loss, list(model.parameters()))
    assert [call.recomputations for call in observer.calls] == [1] * 3
    assert all(op.outputs == [] and op.inputs == [] for call in observer.calls for op in call.ops)
    assert registered_observers(model) == []


def test_the_catalogue_has_a_hint_per_cause():
    # The others have tests of their own: buffer_mutation, attribute_mutation, recompute_error and outside_state
    # here, parameter_write and metric_update in tests/test_causes_named.py, compiler_recompute in
    # tests/test_compile.py.
    others = {
        "buffer_mutation",
        "attribute_mutation",
        "recompute_error",
        "compiler_recompute",
        "parameter_write",
        "outside_state",
        "metric_update",
    }
    assert set(CAUSE_HINTS) == {*CATALOGUE, *others}
    assert all(hint.endswith(".") for hint in CAUSE_HINTS.values())
    fixes = {
        "rng_not_preserved": "`preserve_rng_state=True`",
        "host_rng": "`preserve_host_rng=True`",
        "buffer_mutation": "`protect_buffers=True`",
        "nondeterministic_kernel": "`torch.use_deterministic_algorithms(True)`",
        "compiler_recompute": "activation_memory_budget` below 1",
    }
    assert all(fix in CAUSE_HINTS[cause] for cause, fix in fixes.items())


def fit_monitored(tmp_path, monitor, block="DropoutBlock", **config):
    pl.seed_everything(0, verbose=False)
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=[block], **config))
    logger = CSVLogger(tmp_path)
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_steps=2, callbacks=[monitor], strategy=strategy, logger=logger))
    trainer.fit(StackModule(block=block))
    with open(tmp_path / "lightning_logs" / "version_0" / "metrics.csv") as file:
        return [{key: value for key, value in row.items() if value} for row in csv.DictReader(file)]


def test_monitor_logs_diverging_regions_and_warns_with_region_op_and_hint(tmp_path):
    monitor = RecomputationMonitor(every_n_steps=1, sentinel="off")
    with pytest.warns(LightningCkptDeterminismWarning, match=r"Region `model\.blocks\.\d` diverged at") as record:
        rows = fit_monitored(tmp_path, monitor, preserve_rng_state=False)
    # Checked at every step, the finding recurs at every check, and warns again each time (`every_n_steps` is 1).
    message, again = [str(w.message) for w in record if issubclass(w.category, LightningCkptDeterminismWarning)]
    assert "recomputation diverged at step 0" in message and "recomputation diverged at step 1" in again
    assert "at `aten.bernoulli_.float` (op 4 of the region)" in message
    assert f"cause rng_not_preserved: {CAUSE_HINTS['rng_not_preserved']}" in message
    checked = [row for row in rows if "recompute/grad_divergence" in row]
    assert [row["step"] for row in checked] == ["0", "1"]
    region_metrics = sorted(key for key in checked[0] if key.startswith("recompute/regions/"))
    assert region_metrics == [f"recompute/regions/model.blocks.{i}/max_abs_diff" for i in range(3)]
    assert all(float(checked[0][key]) > 0 for key in region_metrics)
    assert "recompute/noise_floor" not in checked[0]


def test_monitor_reports_buffer_mutations_that_change_no_gradient(tmp_path):
    # The check alone: the sentinel reports the same buffers as a mismatch (tests/test_sentinel.py).
    monitor = RecomputationMonitor(every_n_steps=1, calibrate_noise=True, attribution="always", sentinel="off")
    with pytest.warns(
        LightningCkptDeterminismWarning,
        match=r"changed buffers at step \d: 9 buffers .*; the gradients are exact. Region `model.blocks.0` updated",
    ) as record:
        rows = fit_monitored(tmp_path, monitor, block="BatchNormBlock", protect_buffers=False)
    message = next(str(w.message) for w in record if issubclass(w.category, LightningCkptDeterminismWarning))
    # The warning names the buffers of each region it names.
    assert (
        "Changed: model.blocks.0.norm.running_mean, model.blocks.0.norm.running_var,"
        " model.blocks.0.norm.num_batches_tracked." in message
    )
    assert [entry.diverged for entry in monitor.history] == [True, True]
    assert monitor.last_report is not None
    assert monitor.last_report.grad_divergence == 0.0
    assert "model.blocks.0.norm.running_mean" in monitor.last_report.buffer_mutations
    checked = [row for row in rows if "recompute/grad_divergence" in row]
    assert [float(row["recompute/noise_floor"]) for row in checked] == [0.0, 0.0]
    assert float(checked[0]["recompute/regions/model.blocks.0/max_abs_diff"]) == 0.0
    assert [float(checked[0][f"recompute/regions/model.blocks.{i}/buffer_mutations"]) for i in range(3)] == [3.0] * 3


def test_monitor_by_default_attributes_only_checks_that_diverged(tmp_path):
    clean = RecomputationMonitor(every_n_steps=1)
    fit_monitored(tmp_path / "clean", clean, block="BatchNormBlock")
    assert clean.last_report is not None
    assert clean.last_report.regions == []
    unprotected = RecomputationMonitor(every_n_steps=1, on_divergence="ignore")
    fit_monitored(tmp_path / "unprotected", unprotected, block="BatchNormBlock", protect_buffers=False)
    assert unprotected.last_report is not None
    # The gradients agree, the buffers do not: the check diverges, and the rerun names each region's buffers.
    assert unprotected.last_report.cause == "buffer_mutation"
    assert [region.cause for region in unprotected.last_report.regions] == ["buffer_mutation"] * 3
    diverging = RecomputationMonitor(every_n_steps=1, on_divergence="ignore")
    fit_monitored(tmp_path / "diverging", diverging, preserve_rng_state=False)
    assert diverging.last_report is not None
    assert [region.cause for region in diverging.last_report.regions] == ["rng_not_preserved"] * 3


def test_monitor_without_attribution_sees_buffers_but_names_no_region(tmp_path):
    monitor = RecomputationMonitor(every_n_steps=1, attribution="never", on_divergence="ignore")
    rows = fit_monitored(tmp_path, monitor, block="BatchNormBlock", protect_buffers=False)
    assert [entry.diverged for entry in monitor.history] == [True, True]
    assert monitor.last_report is not None
    assert monitor.last_report.regions == []
    assert monitor.last_report.grad_divergence == 0.0
    assert monitor.last_report.buffer_mutations[:3] == [
        "model.blocks.0.norm.running_mean",
        "model.blocks.0.norm.running_var",
        "model.blocks.0.norm.num_batches_tracked",
    ]
    assert [float(row["recompute/buffer_mutations"]) for row in rows if "recompute/buffer_mutations" in row] == [
        9.0
    ] * 2
    assert not any(key.startswith("recompute/regions/") for row in rows for key in row)


def penalised_loss(model: nn.Module) -> Callable[[], torch.Tensor]:
    """An MSE loss plus a gradient penalty on the input: each region is recomputed by the penalty's
    ``autograd.grad(..., create_graph=True)`` and again by the check's own backward."""
    x, y = batch()

    def closure() -> torch.Tensor:
        inputs = x.clone().requires_grad_(True)
        out = model(inputs)
        (input_grad,) = torch.autograd.grad(out.sum(), inputs, create_graph=True)
        return F.mse_loss(out, y) + input_grad.square().sum()

    return closure


@pytest.mark.parametrize("block", [DropoutBlock, BatchNormBlock])
def test_a_clean_model_under_a_gradient_penalty_is_clean_with_every_recomputation_counted(block):
    model = stack_with(block)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["blocks.*"]))
    report = check_recomputation(model, penalised_loss(model), attribution=True)
    assert (report.diverged, report.grad_divergence, report.error) == (False, 0.0, None)
    assert [(region.cause, region.recomputations) for region in report.regions] == [(None, 2)] * 3
    assert all(region.ops_compared > 0 for region in report.regions)


def test_a_defect_under_a_gradient_penalty_is_named_once_on_its_region():
    model = stack_with(DropoutBlock)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["blocks.*"], preserve_rng_state=False))
    report = check_recomputation(model, penalised_loss(model), attribution=True)
    region = only_finding(report)
    assert (region.name, region.cause, region.recomputations) == ("blocks.1", "rng_not_preserved", 2)
    assert region.first_divergent_op is not None and region.first_divergent_op[0] == "aten.bernoulli_.float"


def test_host_rng_under_a_gradient_penalty_is_its_regions_cause_not_outside_state():
    # The penalty's backward recomputes the region before the loss is computed: the loss differs through
    # recomputation itself, which says nothing of state outside the regions.
    model = stack_with(NumpyNoiseBlock)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["blocks.*"]))
    np.random.seed(0)
    report = check_recomputation(model, penalised_loss(model), attribution=True)
    assert report.diverged and report.grad_divergence > 0
    assert report.cause is None  # the step's cause is its region's
    region = only_finding(report)
    assert (region.name, region.diverged, region.cause) == ("blocks.1", True, "host_rng")


_GLOBAL_CALLS = itertools.count()


class GlobalCountBlock(PlainBlock):
    """Scales by a module-level call count: its recomputation counts once more, and the check's rerun reads the
    count anew, so the rerun's forward differs too."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x) * (1.0 + 0.01 * next(_GLOBAL_CALLS)))


def test_a_global_counted_in_a_regions_forward_is_its_python_state_not_outside_state() -> None:
    plain, model = stack_with(GlobalCountBlock), stack_with(GlobalCountBlock)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["blocks.*"]))
    x, y = batch()
    gradients = []
    for twin in (plain, model):
        F.mse_loss(twin(x), y).backward()
        gradients.append([param.grad for param in twin.parameters()])
    assert not all(map(torch.equal, *gradients))  # ground truth: recomputation reads another count
    report = check_recomputation(model, lambda: F.mse_loss(model(x), y), attribution=True)
    assert report.diverged and report.cause is None
    assert [(region.name, region.diverged, region.cause) for region in report.regions] == [
        ("blocks.0", False, None),
        ("blocks.1", True, "python_state"),
        ("blocks.2", False, None),
    ]


_GLOBAL_GENERATOR = torch.Generator()


class GlobalGeneratorBlock(PlainBlock):
    """Masks with a module-level generator: its recomputation draws another mask, and the check's rerun, which cannot
    restore a generator no module holds, draws another one too."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.linear(x))
        return x + hidden * (torch.rand(hidden.shape, generator=_GLOBAL_GENERATOR) > 0.3)


def test_a_global_generator_drawn_in_a_regions_forward_is_its_rng_not_preserved_not_outside_state() -> None:
    plain, model = stack_with(GlobalGeneratorBlock), stack_with(GlobalGeneratorBlock)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["blocks.*"]))
    x, y = batch()
    gradients = []
    for twin in (plain, model):
        _GLOBAL_GENERATOR.manual_seed(5)
        F.mse_loss(twin(x), y).backward()
        gradients.append([param.grad for param in twin.parameters()])
    assert not all(map(torch.equal, *gradients))  # ground truth: recomputation draws another mask
    report = check_recomputation(model, lambda: F.mse_loss(model(x), y), attribution=True)
    assert report.diverged and report.cause is None
    region = only_finding(report)
    assert (region.name, region.diverged, region.cause) == ("blocks.1", True, "rng_not_preserved")
    assert region.first_divergent_op is not None and region.first_divergent_op[0] == "aten.rand.generator"


class CachingBlock(PlainBlock):
    """Builds a table at its first call and finds it built at its recomputation: other ops, the same values."""

    def __init__(self) -> None:
        super().__init__()
        self.cache: dict[int, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] not in self.cache:
            self.cache[x.shape[-1]] = torch.cos(torch.arange(x.shape[-1], dtype=x.dtype))
        return x + torch.tanh(self.linear(x)) * self.cache[x.shape[-1]]


@pytest.mark.parametrize(("block", "cause"), [(GlobalCountBlock, "python_state"), (CachingBlock, "outside_state")])
def test_beside_outside_state_only_a_region_that_recomputed_other_values_is_blamed(block: type, cause: str) -> None:
    # A counter outside the regions scales the input, read anew by each pass: the step is outside_state, unless a
    # region's recomputation computed other values than its own forward at the same op. A cache its recomputation
    # found built (other ops, the same values) does not stand for that.
    model = stack_with(block)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["blocks.*"]))
    x, y = batch()
    calls = itertools.count()
    report = check_recomputation(
        model, lambda: F.mse_loss(model(x * (1.0 + 0.1 * (next(calls) % 2))), y), attribution=True
    )
    assert report.diverged
    blamed = [(region.name, region.cause) for region in report.regions if region.diverged]
    if cause == "outside_state":
        assert (report.cause, blamed) == ("outside_state", [])
    else:
        assert (report.cause, blamed) == (None, [("blocks.1", "python_state")])


def test_state_outside_the_regions_under_a_gradient_penalty_is_outside_state_where_every_region_is_exact():
    # The penalty recomputes the regions before the loss, but attribution finds each recomputation exact: the loss
    # differs through the counter that scales the input, read anew by each pass.
    model = stack_with(PlainBlock)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["blocks.*"]))
    x, y = batch()
    calls = itertools.count()

    def closure() -> torch.Tensor:
        inputs = (x * (1.0 + 0.1 * (next(calls) % 2))).requires_grad_()
        out = model(inputs)
        (input_grad,) = torch.autograd.grad(out.sum(), inputs, create_graph=True)
        return F.mse_loss(out, y) + input_grad.square().sum()

    report = check_recomputation(model, closure, attribution=True)
    assert report.diverged and report.cause == "outside_state"
    assert [(region.diverged, region.cause) for region in report.regions] == [(False, None)] * 3


def test_where_a_regions_parameters_live_is_learned_again_at_its_recomputation():
    # FSDP2 frees a gathered parameter after the forward and gathers it again, elsewhere, for the backward: a tensor
    # the recomputation writes in place where the parameter lived in the forward is no write to the parameter.
    model, observer = observed_stack(PlainBlock)
    x, y = batch()
    with observer.observing():
        loss = F.mse_loss(model(x), y)
        forward = [dict(call.parameter_storages) for call in observer.calls]
        for param in model.blocks.parameters():
            param.data = param.data.clone()  # moved, as FSDP2's gathering for the backward moves it
        torch.autograd.grad(loss, list(model.parameters()))
    moved = [{storage_pointer(param): name for name, param in block.named_parameters()} for block in model.blocks]
    assert [dict(call.parameter_storages) for call in observer.calls] == moved
    assert all(not set(before) & set(after) for before, after in zip(forward, moved, strict=True))


@pytest.mark.parametrize("position", [0, 2])
def test_an_input_modified_in_place_after_the_forward_is_a_recompute_error_of_its_region(position):
    _, report = attributed(InPlaceReluBlock, position=position)
    assert report.error is not None and "modified by an inplace operation" in report.error
    region = report.regions[position]
    assert (region.name, region.cause, region.diverged, region.max_abs_diff) == (
        f"blocks.{position}",
        "recompute_error",
        True,
        math.inf,
    )
    assert region.error == report.error.splitlines()[0]
    assert region.hint is not None and region.hint.startswith("An input the region received was modified in place")
    assert [other.cause for other in report.regions if other is not region] == [None, None]


@pytest.fixture
def one_process_group(tmp_path) -> Iterator[None]:
    """A gloo process group of this process alone, destroyed after the test: collectives run, and return at once.

    A one-process group that an earlier test's Lightning fit left initialized serves as it is.
    """
    if torch.distributed.is_initialized():
        assert torch.distributed.get_world_size() == 1
        yield
        return
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


class Collectives(TorchDispatchMode):
    """Counts the collective ops (and their waits) that run while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += func.namespace in ("c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("block", [SyncNormBlock, FunctionalSyncNormBlock, AllToAllBlock])
def test_collectives_in_a_region_are_neither_recorded_nor_compared(one_process_group, monkeypatch, block) -> None:
    observed: list[str] = []
    for method in ("record", "compare"):
        real = getattr(CallRecord, method)

        def spy(self: CallRecord, func: Any, *args: Any, real: Callable[..., None] = real) -> None:
            observed.append(func.namespace)
            real(self, func, *args)

        monkeypatch.setattr(CallRecord, method, spy)
    with Collectives() as seen:
        _, report = attributed(block)
    assert seen.count > 0  # the blocks' collectives ran, in the forwards and in the recomputations
    assert set(observed) == {"aten"}
    assert (report.grad_divergence, report.error) == (0.0, None)
    assert [(region.name, region.cause) for region in report.regions] == [(name, None) for name in REGIONS]
    assert all(region.ops_compared > 0 for region in report.regions)


class OpaqueArgument:
    """An argument whose ``==`` raises, as a process group's does."""

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("no comparison for this object")

    __hash__ = object.__hash__


def test_an_argument_that_cannot_be_compared_counts_as_equal_and_is_noted(caplog) -> None:
    call = CallRecord(region="blocks.1", module=nn.Identity())
    opaque = OpaqueArgument()
    assert call.same_inputs([opaque, 2], [opaque, 2])
    assert not call.same_inputs([opaque, 2], [opaque, 3])
    assert call.uncomparable == {"OpaqueArgument"}


def test_a_failure_of_the_observer_stops_observing_the_region_instead_of_the_backward(monkeypatch, caplog) -> None:
    def failing_fingerprint(tensor: torch.Tensor) -> Any:
        raise RuntimeError("the observer's own bug")

    monkeypatch.setattr(observer, "fingerprint", failing_fingerprint)
    with caplog.at_level(logging.WARNING, logger="lightning_ckpt_determinism.verify.attribution.observer"):
        _, report = attributed(NumpyNoiseBlock)
    # The gradients are still compared: the pass ran to its end.
    assert report.error is None and report.grad_divergence > 0.0
    assert all(region.ops_compared == 0 for region in report.regions)
    stopped = [record.getMessage() for record in caplog.records if "stopped observing" in record.getMessage()]
    assert len(stopped) == 3 and "RuntimeError: the observer's own bug" in stopped[0]


class HistoryBlock(PlainBlock):
    """Appends its batch size to a list in forward and never reads it: exact gradients, a side effect repeated."""

    def __init__(self) -> None:
        super().__init__()
        self.history: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.history.append(x.shape[0])
        return super().forward(x)


class _Log:
    """An object of the user's own kind, held by several blocks."""

    def __init__(self) -> None:
        self.sizes: list[int] = []


class SharedLogBlock(PlainBlock):
    """Appends its batch size to a log every block of the stack shares."""

    log = _Log()

    def __init__(self) -> None:
        super().__init__()
        self.shared = SharedLogBlock.log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.shared.sizes.append(x.shape[0])
        return super().forward(x)


def test_an_object_every_region_holds_is_one_changed_attribute() -> None:
    # It was named once per block that holds it: three attributes for one list.
    SharedLogBlock.log = _Log()
    model = make_stack(SharedLogBlock)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["blocks.*"]))
    x, y = batch()
    report = check_recomputation(model, lambda: F.mse_loss(model(x), y))
    assert report.attribute_mutations == ["blocks.0.shared"]
    assert SharedLogBlock.log.sizes == []  # put back


def test_a_side_effect_recomputation_repeats_is_an_attribute_mutation_with_exact_gradients():
    model, report = attributed(HistoryBlock)
    # Exact gradients, but the attribute ends the step otherwise than a plain twin's: a divergence, as the monitor
    # says too.
    assert (report.grad_divergence, report.diverged, report.cause) == (0.0, True, "attribute_mutation")
    assert report.attribute_mutations == ["blocks.1.history"]
    region = only_finding(report)
    assert (region.name, region.cause, region.diverged) == ("blocks.1", "attribute_mutation", True)
    assert region.hint == f"{CAUSE_HINTS['attribute_mutation']} Changed: blocks.1.history."
    assert region.attribute_mutations == ["blocks.1.history"]
    # The check put the list back as it found it.
    assert model.blocks[1].history == []
    # Named as an attribute to leave alone, it is not compared.
    x, y = batch()
    excluded = check_recomputation(
        model, lambda: F.mse_loss(model(x), y), attribution=True, exclude_attributes=["history"]
    )
    assert_clean(excluded)


class StatsBlock(PlainBlock):
    """Keeps the last batch's per-feature mean and deviation (for logging) as a tuple of tensors and in a dict of
    tuples, both rebound at each pass with the same values."""

    def __init__(self) -> None:
        super().__init__()
        self.last_stats: tuple[torch.Tensor, torch.Tensor] | None = None
        self.logged: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last_stats = (x.detach().mean(0), x.detach().std(0))
        self.logged["stats"] = (x.detach().amin(0), x.detach().amax(0))
        return super().forward(x)


def test_tuples_of_tensors_a_pass_rebinds_with_the_same_values_are_no_attribute_mutation():
    _, report = attributed(StatsBlock)
    assert_clean(report)
    assert report.attribute_mutations == []


def cosines(rows: int) -> torch.Tensor:
    return torch.arange(float(rows))[:, None].expand(rows, DIM).cos().contiguous()


class CachedTableBlock(PlainBlock):
    """Keeps a table of cosines as a plain attribute, a row per input row, grown when a larger batch comes (a tensor
    larger than a replayed one): the forward grows it, the recomputation finds it grown and runs fewer ops, with the
    same values."""

    def __init__(self) -> None:
        super().__init__()
        self.table = cosines(10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table.shape[0] < x.shape[0]:
            self.table = cosines(x.shape[0])
        return x + torch.tanh(self.linear(x) * self.table[: x.shape[0]])


def test_a_recomputation_that_runs_other_ops_with_exact_gradients_has_a_cause_but_no_divergence():
    torch.manual_seed(0)
    plain = stack_with(CachedTableBlock, position=1)
    model, report = attributed(lambda: CachedTableBlock(), position=1)
    model.load_state_dict(plain.state_dict())
    x, y = batch()
    for twin in (plain, model):
        twin.blocks[1].table = cosines(10)
        twin.zero_grad()
        F.mse_loss(twin(x), y).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), model.parameters(), strict=True))
    region = only_finding(report)
    # The recomputation skipped the table's ops: a cause of its own, found, but not a divergence of the gradients.
    assert (report.grad_divergence, report.diverged, region.cause, region.diverged) == (
        0.0,
        False,
        "python_state",
        False,
    )
    assert region.first_divergent_op is not None and region.first_divergent_op == ("aten.arange.default", 0)
    assert not report_diverged(report)
    assert region_outcome(region).verdict == "noise"


class CounterOnlyBlock(PlainBlock):
    """Scales by a call counter it increments in forward: recomputation sees the forward's count (it is replayed)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + torch.tanh(self.linear(x) * (1.0 + 0.1 * self.calls))


def test_a_counter_the_forward_increments_is_replayed_and_compares_clean():
    _, report = attributed(CounterOnlyBlock)
    assert_clean(report)
    assert report.attribute_mutations == []


class _TimestepCell(nn.Module):
    """An RNN cell that reads the timestep from a global its caller sets, and scales its input at one timestep."""

    timestep: ClassVar[dict[str, int]] = {"value": 0}

    def __init__(self, scaled_at: int) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.scaled_at = scaled_at

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        scale = 1.5 if self.timestep["value"] == self.scaled_at else 1.0
        return torch.tanh(self.linear(state * scale))


def test_the_report_names_the_call_of_a_region_called_once_a_timestep_that_differed() -> None:
    steps, scaled_at = 8, 5
    torch.manual_seed(0)
    plain, model = _TimestepCell(scaled_at), _TimestepCell(scaled_at)
    model.load_state_dict(plain.state_dict())
    rnn = nn.ModuleDict({"cell": model})
    apply_activation_checkpointing(rnn, CheckpointingConfig(names=["cell"]))
    start = torch.randn(4, DIM)

    def unrolled(cell: nn.Module) -> torch.Tensor:
        state = start
        for step in range(steps):
            _TimestepCell.timestep["value"] = step
            state = cell(state)
        return state.square().sum()  # the global holds the last timestep while backward recomputes every call

    unrolled(plain).backward()
    unrolled(rnn["cell"]).backward()
    assert not torch.equal(plain.linear.weight.grad, model.linear.weight.grad)
    report = check_recomputation(rnn, lambda: unrolled(rnn["cell"]), attribution=True)
    (region,) = report.regions
    # Only the forward at the timestep the branch names took it: that call is the one named, out of every call made.
    assert (region.cause, region.calls, region.first_divergent_call) == ("python_state", steps, scaled_at)
    assert f"at `aten.mul.Tensor` (op 0 of the region's call {scaled_at} of {steps})" in region_outcome(region).finding


class JvpBlock(nn.Module):
    """A block whose forward takes a Jacobian-vector product of its layers (`torch.func.jvp`: forward-mode AD)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, DIM)

    def layers(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value, tangent = torch.func.jvp(self.layers, (x,), (torch.ones_like(x),))
        return x + value + 0.1 * tangent


def test_attribution_leaves_a_call_under_forward_mode_ad_unobserved_and_the_check_answers(caplog) -> None:
    # Reading a dual tensor's values inside a dispatch mode ended the process: the call is left out, with a warning.
    torch.manual_seed(0)
    plain = nn.Sequential(JvpBlock(), nn.Linear(DIM, 1))
    model = copy.deepcopy(plain)
    apply_activation_checkpointing(model, CheckpointingConfig(names=["0"]))
    x = torch.randn(4, DIM)
    plain(x).square().sum().backward()
    model(x).square().sum().backward()
    assert all(map(torch.equal, [p.grad for p in plain.parameters()], [p.grad for p in model.parameters()]))
    with caplog.at_level(logging.WARNING):
        report = check_recomputation(model, lambda: model(x).square().sum(), attribution=True)
    assert (report.diverged, report.grad_divergence, report.error) == (False, 0.0, None)
    assert "ran under a function transform or forward-mode AD" in caplog.text
