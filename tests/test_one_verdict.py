"""One verdict: the same defect gets the same cause and the same region through ``check_recomputation`` and through
the monitor's check of the live step, and both are the defect's own (ground truth: the block built with it)."""

import contextlib
from collections.abc import Callable
from dataclasses import replace
from typing import Literal

import numpy as np
import pytest
import torch
from lightning.pytorch import Trainer
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from examples.broken import DEFECTIVE_BLOCKS, BrokenModule
from lightning_ckpt_determinism import (
    Cause,
    CheckpointingConfig,
    LightningCkptDeterminismWarning,
    RecomputationMonitor,
    RecomputationReport,
    RegionReport,
    SingleDeviceCheckpointingStrategy,
    apply_activation_checkpointing,
    check_recomputation,
)
from lightning_ckpt_determinism.verify.core import blame, step_cause, with_attribution
from lightning_ckpt_determinism.verify.reports import attribute_hint, buffer_hint

DIM = 16
DEFECTIVE = 1
# The checkpointing settings that make a cause of the config (not of the model) show.
SETTINGS = {
    Cause.RNG_NOT_PRESERVED: {"preserve_rng_state": False},
    Cause.BUFFER_MUTATION: {"protect_buffers": False},
}
# The causes only one engine can give, and why.
ONE_ENGINE = {
    # A kernel that differs run to run differs by chance: neither engine can be held to give it on a given step.
    Cause.NONDETERMINISTIC_KERNEL: "by chance",
    # Recomputation raises in the live step's own backward: training stops before the monitor checks anything.
    Cause.SHAPE_CHANGE: "the live step raises",
    Cause.RECOMPUTE_ERROR: "the live step raises",
}
# Every cause the example zoo builds a defect for, less those.
CAUSES = [cause for cause in Cause if cause.value in DEFECTIVE_BLOCKS and cause not in ONE_ENGINE]


def _config(cause: Cause | None) -> CheckpointingConfig:
    return CheckpointingConfig(classes=["Block"], **SETTINGS.get(cause, {}) if cause is not None else {})


def _model(cause: Cause | None) -> BrokenModule:
    # `None`: the zoo's standard blocks only.
    torch.manual_seed(0)
    return BrokenModule(defect=None if cause is None else cause.value, blocks=3, defective_block=DEFECTIVE, dim=DIM)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(8, DIM, generator=generator), torch.randn(8, 1, generator=generator)


def _seed_host_rng() -> None:
    np.random.seed(2)
    torch.manual_seed(3)


def _two_pass(
    cause: Cause | None, attribution: bool = True, config: CheckpointingConfig | None = None
) -> RecomputationReport:
    model = _model(cause)
    apply_activation_checkpointing(model, config or _config(cause))
    x, y = _batch()
    _seed_host_rng()

    def closure() -> torch.Tensor:
        # The step's own loss; `outside_state`'s defect is in `training_step`, which logs (a no-op without a
        # Trainer).
        if cause == Cause.OUTSIDE_STATE:
            return model.training_step((x, y), 0)
        return F.mse_loss(model(x), y)

    return check_recomputation(model, closure, attribution=attribution)


def _monitored(
    cause: Cause | None,
    attribution: Literal["on_divergence", "always", "never"] = "on_divergence",
    config: CheckpointingConfig | None = None,
) -> RecomputationReport:
    model = _model(cause)
    monitor = RecomputationMonitor(every_n_steps=1, on_divergence="ignore", sentinel="off", attribution=attribution)
    trainer = Trainer(
        # A parameter written in `training_step` skips the first check, which copies it from then on.
        max_steps=2 if cause == Cause.PARAMETER_WRITE else 1,
        accelerator="cpu",
        devices=1,
        strategy=SingleDeviceCheckpointingStrategy(checkpointing=config or _config(cause)),
        callbacks=[monitor],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    _seed_host_rng()
    skipped = cause == Cause.PARAMETER_WRITE
    with pytest.warns(LightningCkptDeterminismWarning, match="skipped") if skipped else contextlib.nullcontext():
        trainer.fit(model, DataLoader(TensorDataset(*_batch()), batch_size=8))
    assert monitor.last_report is not None
    return monitor.last_report


@pytest.mark.parametrize("cause", CAUSES, ids=str)
def test_both_engines_blame_the_defect_with_the_same_cause_and_region(cause: Cause) -> None:
    expected = (cause, None if cause.blames == "step" else f"blocks.{DEFECTIVE}")
    two_pass = _two_pass(cause)
    monitored = _monitored(cause)
    assert blame(two_pass) == expected
    assert blame(monitored) == expected
    # The same report-level verdict: a state change the twin would not have is a divergence in both engines.
    assert (two_pass.diverged, two_pass.cause, two_pass.buffer_mutations) == (
        monitored.diverged,
        monitored.cause,
        monitored.buffer_mutations,
    )
    # Whatever the engine, a step's cause blames no region.
    for report in (two_pass, monitored):
        assert (step_cause(report) is not None) == (cause.blames == "step")
        assert not [region.name for region in report.regions if region.diverged] or cause.blames == "region"


@pytest.mark.parametrize(
    ("cause", "field", "names", "hint"),
    [
        # Block 1 appends its batch size to `batch_sizes` in forward, and recomputation appends again.
        (Cause.ATTRIBUTE_MUTATION, "attribute_mutations", [f"blocks.{DEFECTIVE}.batch_sizes"], attribute_hint),
        # Block 1's BatchNorm, its buffers not protected, updates its statistics again when recomputed.
        (
            Cause.BUFFER_MUTATION,
            "buffer_mutations",
            [f"blocks.{DEFECTIVE}.norm.{name}" for name, _ in torch.nn.BatchNorm1d(DIM).named_buffers()],
            buffer_hint,
        ),
    ],
    ids=str,
)
def test_with_attribution_off_both_engines_give_the_step_its_state_change(
    cause: Cause, field: str, names: list[str], hint: Callable[[list[str]], str]
) -> None:
    # Ground truth: the defect above; without attribution no region report places the state, so the step carries
    # the cause.
    two_pass = _two_pass(cause, attribution=False)
    monitored = _monitored(cause, attribution="never")
    found = [
        (report.diverged, report.cause, report.hint, getattr(report, field), report.regions, blame(report))
        for report in (two_pass, monitored)
    ]
    expected = (True, cause, hint(names), names, [], (cause, None))
    assert found == [expected, expected]
    # The gradients are exact: the state is the whole finding.
    assert (two_pass.grad_divergence, monitored.grad_divergence) == (0.0, 0.0)


@pytest.mark.parametrize(
    ("cause", "config"),
    [
        # BatchNorm in training mode inside every region, its buffers protected (the default).
        (Cause.BUFFER_MUTATION, CheckpointingConfig(classes=["Block"])),
        # The same BatchNorm outside the regions, buffers not protected: nothing recomputes it.
        (Cause.BUFFER_MUTATION, CheckpointingConfig(names=["blocks.0", "blocks.2"], protect_buffers=False)),
        # The zoo's standard blocks, with and without protected buffers.
        (None, CheckpointingConfig(classes=["Block"])),
        (None, CheckpointingConfig(classes=["Block"], protect_buffers=False)),
    ],
    ids=["batchnorm-protected", "batchnorm-outside-unprotected", "standard-protected", "standard-unprotected"],
)
def test_a_standard_layer_gives_no_buffer_mutation_through_either_engine(
    cause: Cause | None, config: CheckpointingConfig
) -> None:
    # Ground truth: each pass updates every buffer once, as a step without checkpointing does.
    reports = [
        _two_pass(cause, attribution=False, config=config),
        _two_pass(cause, attribution=True, config=config),
        _monitored(cause, attribution="never", config=config),
        _monitored(cause, config=config),
    ]
    found = [(report.diverged, report.cause, report.buffer_mutations, report.grad_divergence) for report in reports]
    assert found == [(False, None, [], 0.0)] * len(reports)
    assert not [region.name for report in reports for region in report.regions if region.buffer_mutations]


def test_only_the_step_causes_blame_the_step() -> None:
    assert {cause for cause in Cause if cause.blames == "step"} == {Cause.OUTSIDE_STATE, Cause.COMPILER_RECOMPUTE}


def test_a_provisional_step_cause_gives_way_to_the_attributions_where_it_finds_one_and_a_region_cause_stays() -> None:
    live = RecomputationReport(0.1, 0.1, diverged=True, tolerance=0.0, cause=Cause.OUTSIDE_STATE, hint="outside")
    region = RegionReport("blocks.1", diverged=True, cause=Cause.NONDETERMINISTIC_KERNEL, max_abs_diff=0.5)
    attributed = RecomputationReport(0.1, 0.1, diverged=True, tolerance=0.0, regions=[region])
    joined = with_attribution(live, attributed)
    assert (joined.cause, joined.hint, blame(joined)) == (None, None, (Cause.NONDETERMINISTIC_KERNEL, "blocks.1"))
    # Attribution found every region exact and no cause: the live step differed from its rerun outside them.
    exact = RecomputationReport(0.0, 0.0, diverged=False, tolerance=0.0, regions=[RegionReport("blocks.1")])
    stays = with_attribution(live, exact)
    assert (stays.cause, stays.hint, blame(stays)) == (Cause.OUTSIDE_STATE, "outside", (Cause.OUTSIDE_STATE, None))
    # An attribution that diverged without naming a region, or that failed, proves nothing: it gives way as before.
    for unsure in (replace(exact, diverged=True), replace(exact, error="attribution failed")):
        assert with_attribution(live, unsure).cause is None
    buffers = RecomputationReport(0.0, 0.0, diverged=True, tolerance=0.0, cause=Cause.BUFFER_MUTATION, hint="b")
    kept = with_attribution(buffers, RecomputationReport(0.0, 0.0, diverged=False, tolerance=0.0))
    assert (kept.cause, kept.hint, blame(kept)) == (Cause.BUFFER_MUTATION, "b", (Cause.BUFFER_MUTATION, None))


def test_every_cause_is_held_to_one_verdict_or_says_why_not() -> None:
    # The compiled-only cause has its defect in a compiled config, not in the eager zoo.
    assert set(Cause) - set(CAUSES) - set(ONE_ENGINE) == {Cause.COMPILER_RECOMPUTE}
