"""The causes as one type: each member is today's string, carries its hint in every syntax, and travels as that
string through JSON, pickles and text."""

import json
import pickle
from dataclasses import asdict
from pathlib import Path

import pytest

from lightning_ckpt_determinism import CAUSE_HINTS, Cause, RecomputationReport, RegionReport
from lightning_ckpt_determinism.lightning.findings import Findings, divergence_message
from lightning_ckpt_determinism.verify.attribution.evidence import CallEvidence
from lightning_ckpt_determinism.verify.attribution.region_cause import region_reports
from lightning_ckpt_determinism.verify.cause import PROTECTED_BUFFERS_HINT, respelt
from lightning_ckpt_determinism.verify.outcome import region_outcome, worse
from lightning_ckpt_determinism.verify.reports import COMPILED_NOISE_NOTE, ROUTING_HINT, buffer_hint

# The strings reports, metrics, JSON files and configs held before causes were a type, in the catalogue's order: each
# stays its member's value. A cause added since is checked from `Cause` alone.
STRINGS = [
    "rng_not_preserved",
    "host_rng",
    "buffer_mutation",
    "shape_change",
    "python_state",
    "parameter_write",
    "outside_state",
    "attribute_mutation",
    "nondeterministic_kernel",
    "recompute_error",
    "compiler_recompute",
    "metric_update",
]
CONFIG_FIELDS = {
    Cause.RNG_NOT_PRESERVED: "preserve_rng_state",
    Cause.HOST_RNG: "preserve_host_rng",
    Cause.BUFFER_MUTATION: "protect_buffers",
}

CAUSES_PAGE = Path(__file__).resolve().parents[1] / "docs" / "causes.md"


def test_the_values_are_the_strings_reports_always_held() -> None:
    assert [cause.value for cause in Cause if cause.value in STRINGS] == STRINGS
    assert all(Cause(text).value == text for text in STRINGS)
    assert all(Cause(cause.value) is cause and cause == cause.name.lower() for cause in Cause)
    assert list(CAUSE_HINTS) == [cause.value for cause in Cause]


@pytest.mark.parametrize("cause", list(Cause), ids=str)
def test_every_cause_has_its_hint_in_every_syntax(cause: Cause) -> None:
    hints = cause.hints
    assert all(text and text.endswith(".") for text in (hints.python, hints.yaml, hints.audit))
    assert cause.hint == hints.python == hints.spelt("python") == CAUSE_HINTS[cause]
    assert (hints.spelt("yaml"), hints.spelt("audit")) == (hints.yaml, hints.audit)
    # YAML and the audit never show Python's spelling of a setting.
    assert "=True`" not in hints.yaml and "=True`" not in hints.audit
    assert "`CheckpointingConfig`" not in hints.yaml
    # The page of causes says when each is given, from the enum alone.
    assert cause.when.endswith(".") and f"## `{cause}`\n\n**When:** {cause.when}" in CAUSES_PAGE.read_text()


@pytest.mark.parametrize("cause", list(CONFIG_FIELDS), ids=str)
def test_a_checkpointing_setting_is_spelt_as_each_syntax_writes_it(cause: Cause) -> None:
    field = CONFIG_FIELDS[cause]
    assert f"`{field}=True` in the `CheckpointingConfig`" in cause.hints.python
    assert f"`{field}: true` under `trainer.strategy.init_args.checkpointing`" in cause.hints.yaml
    assert cause.hints.audit == cause.hints.yaml  # the audit reads the training YAML


def test_the_monitor_and_trainer_settings_are_spelt_for_yaml_and_for_the_audits_flag() -> None:
    kernel = Cause.NONDETERMINISTIC_KERNEL.hints
    assert "`torch.use_deterministic_algorithms(True)`" in kernel.python and "`calibrate_noise=True`" in kernel.python
    assert "`deterministic: true` under `trainer`" in kernel.yaml and "`calibrate_noise: true`" in kernel.yaml
    assert "`--calibrate-noise`" in kernel.audit and "`--calibrate-noise`" in Cause.OUTSIDE_STATE.hints.audit


@pytest.mark.parametrize("cause", list(Cause), ids=str)
def test_a_hint_in_python_form_is_respelt_into_each_syntax_exactly_as_written_for_it(cause: Cause) -> None:
    hints = cause.hints
    assert respelt(hints.python, "python") == hints.python
    assert respelt(hints.python, "yaml") == hints.yaml
    assert respelt(hints.python, "audit") == hints.audit


def test_hints_built_from_several_parts_and_the_likely_causes_are_respelt_whole() -> None:
    buffers = respelt(buffer_hint(["norm.running_mean"]), "yaml")
    assert buffers == f"{Cause.BUFFER_MUTATION.hints.yaml} Changed: norm.running_mean."
    routing = respelt(ROUTING_HINT.format(op="`aten.topk.default`"), "yaml")
    assert "set `keep_data_dependent: true` under `trainer.strategy.init_args.checkpointing` to keep" in routing
    assert respelt(COMPILED_NOISE_NOTE, "audit").endswith("with a `tolerance`, or with `--calibrate-noise`.")
    # A check that diverged without attribution lists the usual suspects, each switch written as YAML writes it.
    findings = Findings(grad_divergence=0.5, max_abs_diff=0.1, noise_floor=0.0, diverged=True)
    message = respelt(
        divergence_message(3, findings, RecomputationReport(0.5, 0.1, diverged=True, tolerance=0.0), "never"), "yaml"
    )
    assert "dropout with `preserve_rng_state: false`, NumPy or `random` without `preserve_host_rng: true`" in message
    assert "buffers without `protect_buffers: true`" in message and "=True`" not in message


def test_a_cause_round_trips_through_json_as_its_string() -> None:
    region = RegionReport("blocks.1", diverged=True, cause=Cause.HOST_RNG, hint=Cause.HOST_RNG.hint)
    text = json.dumps(asdict(region))
    assert json.loads(text)["cause"] == "host_rng"
    assert Cause(json.loads(text)["cause"]) is Cause.HOST_RNG
    names = [cause.name.lower() for cause in Cause]
    assert json.dumps({cause: cause for cause in Cause}) == json.dumps(dict(zip(names, names, strict=True)))


def test_a_cause_prints_pickles_and_formats_as_its_string() -> None:
    cause = Cause.BUFFER_MUTATION
    assert (str(cause), f"{cause}", f"{cause:>16}", repr([cause])) == (
        "buffer_mutation",
        "buffer_mutation",
        " buffer_mutation",
        "['buffer_mutation']",
    )
    assert pickle.loads(pickle.dumps(cause)) is cause


def test_a_region_outcome_reads_a_cause_given_as_its_string() -> None:
    outcome = region_outcome(RegionReport("blocks.1", ops_compared=3, cause="buffer_mutation", hint="Set it."))
    assert (outcome.verdict, outcome.cause) == ("noise", Cause.BUFFER_MUTATION)
    assert outcome.finding == (
        "Region `blocks.1` updated its buffers a second time, or read them otherwise, in recomputation: Set it."
    )
    assert region_outcome(RegionReport("blocks.2")).verdict == "unchecked"
    assert worse("noise", "unchecked") == "noise"


@pytest.mark.parametrize("protected", [False, True])
def test_a_buffer_mutation_asks_for_protect_buffers_only_where_the_region_does_not_protect_them(
    protected: bool,
) -> None:
    call = CallEvidence("blocks.1", compared=3, recomputations=1, protects_buffers=protected)
    mutated = {"blocks.1": ["blocks.1.norm.running_mean"]}
    (region,) = region_reports(["blocks.1"], [call], mutated, gradients_diverged=False, host_rng_explained=frozenset())
    hint = PROTECTED_BUFFERS_HINT if protected else Cause.BUFFER_MUTATION.hint
    assert (region.cause, region.hint) == ("buffer_mutation", f"{hint} Changed: blocks.1.norm.running_mean.")
    assert respelt(region.hint, "yaml").startswith(
        "Recomputation updates the region's buffers a second time"
        + (", yet `protect_buffers: true` under `trainer.strategy.init_args.checkpointing` is set" if protected else "")
    )
