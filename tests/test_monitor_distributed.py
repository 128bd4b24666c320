"""The monitor under DDP, FSDP2 and FSDP1 on two CPU processes (gloo): it checks the live, distributed step.

Each strategy's scenarios run in one launch of ``tests/distributed_monitor_script.py`` (one process group, several
fits), shared by the tests of that strategy.
"""

import csv
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_ckpt_determinism.verify.reports import read_otherwise_hint
from tests.helpers import launch_ranks, run_launcher

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "distributed_monitor_script.py"
pytestmark = pytest.mark.slow
KINDS = ["ddp", "fsdp2"]


def _launch(kind: str, out_dir: Path) -> Path:
    launch_ranks(SCRIPT, kind, str(out_dir), timeout=400)
    return out_dir


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each strategy's launch, run once for the module by whichever test needs it first."""

    class Launches(dict):
        def __missing__(self, kind: str) -> Path:
            self[kind] = _launch(kind, tmp_path_factory.mktemp(kind))
            return self[kind]

    return Launches()


@pytest.fixture(params=KINDS)
def runs(request: pytest.FixtureRequest, launched: dict[str, Path]) -> tuple[str, Path]:
    return request.param, launched[request.param]


@pytest.fixture
def ddp(launched: dict[str, Path]) -> Path:
    return launched["ddp"]


@pytest.fixture
def fsdp1(launched: dict[str, Path]) -> Path:
    return launched["fsdp1"]


def result(out_dir: Path, name: str, rank: int) -> dict[str, Any]:
    return json.loads((out_dir / name / f"rank{rank}.json").read_text())


def state(out_dir: Path, name: str, rank: int) -> dict[str, Any]:
    return torch.load(out_dir / name / f"rank{rank}.pt", weights_only=False)


def logged(out_dir: Path, name: str, key: str) -> list[float]:
    with open(out_dir / name / "lightning_logs" / "version_0" / "metrics.csv") as file:
        return [float(row[key]) for row in csv.DictReader(file) if row.get(key)]


def assert_equal_states(first: dict[str, Any], second: dict[str, Any]) -> None:
    assert first.keys() == second.keys()
    for key, value in first.items():
        if isinstance(value, dict):
            assert_equal_states(value, second[key])
        elif isinstance(value, torch.Tensor):
            # Sparse tensors (an embedding's SGD momentum) by layout and dense form.
            assert value.layout == second[key].layout and torch.equal(value.to_dense(), second[key].to_dense()), key
        else:
            assert value == second[key], key


@pytest.mark.parametrize("name", ["clean_dropout", "clean_batchnorm", "clean_bf16"])
def test_a_clean_model_logs_exactly_zero_on_every_rank(runs, name):
    kind, out_dir = runs
    rank0, rank1 = result(out_dir, name, 0), result(out_dir, name, 1)
    assert rank0["sharded"] == rank1["sharded"] == (kind == "fsdp2")
    assert rank0["history"] == rank1["history"]
    assert [(entry["step"], entry["grad_divergence"], entry["diverged"]) for entry in rank0["history"]] == [
        (step, 0.0, False) for step in range(4)
    ]
    assert logged(out_dir, name, "recompute/grad_divergence") == [0.0] * 4


@pytest.mark.parametrize(
    ("name", "cause"),
    [("rng_not_preserved", "rng_not_preserved"), ("numpy_noise", "host_rng"), ("numpy_last", "host_rng")],
)
def test_a_defect_logs_a_positive_divergence_and_is_attributed(runs, name, cause):
    # `numpy_last`: the draw is read by the op where torch's early stop ends the recomputation (a saved tensor differs,
    # no recomputed op).
    _, out_dir = runs
    rank0, rank1 = result(out_dir, name, 0), result(out_dir, name, 1)
    assert rank0["history"] == rank1["history"]
    assert rank0["regions"] == rank1["regions"]
    assert all(entry["diverged"] and entry["grad_divergence"] > 0.0 for entry in rank0["history"])
    assert len(rank0["history"]) == 4
    assert all(value > 0.0 for value in logged(out_dir, name, "recompute/grad_divergence"))
    assert rank0["regions"] == [[f"model.blocks.{index}", cause] for index in range(3)]


def test_training_is_bit_identical_with_the_monitor_and_without_checkpointing(runs):
    kind, out_dir = runs
    setups = ["accumulate_2_clipping"] + (["bf16_mixed", "fp16_grad_scaler"] if kind == "ddp" else [])
    for setup in setups:
        for rank in (0, 1):
            history = result(out_dir, f"{setup}_monitored", rank)["history"]
            checked = [entry for entry in history if entry["skipped"] is None]
            assert checked and all(entry["grad_divergence"] == 0.0 for entry in checked), setup
            monitored = state(out_dir, f"{setup}_monitored", rank)
            assert_equal_states(monitored, state(out_dir, f"{setup}_checkpointed", rank))
            assert_equal_states(monitored, state(out_dir, f"{setup}_plain", rank))


def test_ddp_gradient_bucket_views_are_checked_and_train_bit_identically(ddp):
    out_dir = ddp
    for rank in (0, 1):
        history = result(out_dir, "bucket_view_monitored", rank)["history"]
        assert [(entry["step"], entry["grad_divergence"]) for entry in history] == [(step, 0.0) for step in range(4)]
        assert_equal_states(state(out_dir, "bucket_view_monitored", rank), state(out_dir, "bucket_view_plain", rank))


def test_ddp_a_sparse_gradient_is_checked_at_zero_and_trains_bit_identically(ddp):
    out_dir = ddp
    for rank in (0, 1):
        history = result(out_dir, "sparse_monitored", rank)["history"]
        assert [(entry["step"], entry["grad_divergence"], entry["diverged"]) for entry in history] == [
            (step, 0.0, False) for step in range(4)
        ]
        monitored = state(out_dir, "sparse_monitored", rank)
        momentum = [value["momentum_buffer"] for value in monitored["optimizer"].values()]
        assert any(buffer.layout is torch.sparse_coo for buffer in momentum)  # the table trained on sparse gradients
        assert_equal_states(monitored, state(out_dir, "sparse_checkpointed", rank))
        assert_equal_states(monitored, state(out_dir, "sparse_plain", rank))


def test_ddp_manual_optimization_is_checked_through_the_all_reduce_and_trains_bit_identically(ddp):
    out_dir = ddp
    for rank in (0, 1):
        history = result(out_dir, "manual_monitored", rank)["history"]
        assert [(entry["step"], entry["grad_divergence"]) for entry in history] == [(step, 0.0) for step in range(4)]
        assert_equal_states(state(out_dir, "manual_monitored", rank), state(out_dir, "manual_plain", rank))


def test_ddp_a_defect_on_rank_one_only_is_named_with_its_region_cause_and_rank(ddp):
    out_dir = ddp
    rank0, rank1 = result(out_dir, "rank_one_warn", 0), result(out_dir, "rank_one_warn", 1)
    assert rank0["history"] == rank1["history"]
    assert [(entry["step"], entry["diverged"]) for entry in rank0["history"]] == [(0, True), (2, True)]
    (message,) = rank0["warnings"]
    assert "Region `model.blocks.1` diverged at `aten.mul.Tensor`" in message
    assert "cause python_state" in message
    assert message.endswith("(rank 1).")
    assert rank1["warnings"] == []
    # Rank 0's own rerun is clean; rank 1's names the block.
    assert [cause for _, cause in rank0["regions"]] == [None, None, None]
    assert ["model.blocks.1", "python_state"] in rank1["regions"]
    assert all(
        value > 0.0 for value in logged(out_dir, "rank_one_warn", "recompute/regions/model.blocks.1/max_abs_diff")
    )


def test_ddp_a_follow_up_check_that_finds_the_step_exact_names_the_buffer_read_otherwise_on_another_rank(ddp):
    rank0, rank1 = result(ddp, "table_rank_one", 0), result(ddp, "table_rank_one", 1)
    assert [record["step"] for record in rank0["history"]] == [record["step"] for record in rank1["history"]] == [0, 3]
    said = [line for line in rank0["warnings"] if "which a sentinel finding asked for" in line]
    assert said == [
        "lightning_ckpt_determinism: the full check at step 3, which a sentinel finding asked for, found recomputation"
        " exact in that step: the difference shows at some calls only, so no check names its cause; the sentinel's"
        f" finding and its region stand. A cause seen this fit: {read_otherwise_hint(['model.blocks.1.table'])}"
    ]


@pytest.mark.parametrize("name", ["buffer_rank_one", "buffer_rank_one_live"], ids=["attributed", "live check only"])
def test_a_buffer_updated_again_on_rank_one_only_is_found_on_every_rank(runs, name):
    _, out_dir = runs
    rank0, rank1 = result(out_dir, name, 0), result(out_dir, name, 1)
    assert rank0["history"] == rank1["history"]
    assert [(entry["step"], entry["diverged"], entry["grad_divergence"]) for entry in rank0["history"]] == [
        (0, True, 0.0),
        (2, True, 0.0),
    ]
    assert logged(out_dir, name, "recompute/buffer_mutations") == [1.0, 1.0]
    (message,) = rank0["warnings"]
    assert message.startswith(
        "lightning_ckpt_determinism: recomputation changed buffers at step 0: 1 buffer ended the step otherwise than"
        " in the same step without checkpointing (model.blocks.1.count); the gradients are exact."
    ), message
    # The hint once, naming the buffer rank 1 saw change (not again for rank 0, which saw "buffers of another rank").
    assert message.count("`protect_buffers") == 1 and "another rank" not in message, message
    assert rank1["warnings"] == []


def test_ddp_auto_reference_regions_are_the_same_on_every_rank_whatever_each_has_room_for(ddp):
    first, second = (result(ddp, "auto_reference_monitored", rank) for rank in (0, 1))
    assert first["error"] is None and first["global_step"] == second["global_step"] == 4
    # Rank 0 has room for one region: both ranks run one plainly per check, rotating, and find nothing.
    regions = [entry["checked_regions"] for entry in first["history"]]
    assert regions == [entry["checked_regions"] for entry in second["history"]]
    assert regions == [["model.blocks.0"], ["model.blocks.1"], ["model.blocks.2"], ["model.blocks.0"]]
    assert [entry["grad_divergence"] for entry in first["history"]] == [0.0] * 4
    for rank in (0, 1):
        assert_equal_states(state(ddp, "auto_reference_monitored", rank), state(ddp, "auto_reference_plain", rank))


def test_ddp_a_stateful_communication_hook_is_checked_at_zero_and_trains_bit_identically(ddp):
    for rank in (0, 1):
        monitored = result(ddp, "powersgd_monitored", rank)
        assert [(entry["step"], entry["grad_divergence"]) for entry in monitored["history"]] == [
            (step, 0.0) for step in range(4)
        ]
        assert_equal_states(state(ddp, "powersgd_monitored", rank), state(ddp, "powersgd_plain", rank))


def test_ddp_epochs_of_different_lengths_on_the_ranks_train_on_as_without_the_monitor(ddp):
    first, second = (result(ddp, "uneven_epochs_monitored", rank) for rank in (0, 1))
    assert first["global_step"] == second["global_step"] == 4
    assert first["history"] == second["history"] and [entry["step"] for entry in first["history"]] == [0]
    for rank in (0, 1):
        assert_equal_states(state(ddp, "uneven_epochs_monitored", rank), state(ddp, "uneven_epochs_plain", rank))


def test_ddp_raise_mode_stops_every_rank_alike_with_the_finding(ddp):
    out_dir = ddp
    for rank in (0, 1):
        outcome = result(out_dir, "rank_one_raise", rank)
        assert outcome["global_step"] == 0
        assert outcome["error"].startswith("lightning_ckpt_determinism: recomputation diverged at step 0")
        assert "Region `model.blocks.1`" in outcome["error"] and "(rank 1)." in outcome["error"]


def test_ddp_a_rank_with_nothing_to_check_stops_every_rank_at_fit_start(ddp):
    rank0, rank1 = result(ddp, "nothing_on_rank_zero", 0), result(ddp, "nothing_on_rank_zero", 1)
    assert rank0["global_step"] == rank1["global_step"] == 0
    assert rank0["history"] == rank1["history"] == []
    assert rank0["error"].startswith(
        "`RecomputationMonitor` has nothing to check: no module of RankOneCheckpointedModule is checkpointed at fit"
        " start under DDPStrategy."
    )
    assert rank1["error"] == "`RecomputationMonitor` has nothing to check on another rank; see the error it raised."


def test_fsdp2_example_config_trains_with_the_monitor(tmp_path):
    # Lightning's launcher starts rank one, as for a user; rank zero fails if rank one does in training.
    command = [
        sys.executable,
        "-m",
        "examples.train",
        "fit",
        "--config",
        "examples/configs/fsdp2_gpt_blocks.yaml",
        "--trainer.max_steps=11",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
    ]
    run_launcher(command, [], timeout=300)
    (events,) = (tmp_path / "lightning_logs").glob("version_0")
    accumulator = EventAccumulator(str(events)).Reload()
    assert [(event.step, event.value) for event in accumulator.Scalars("recompute/grad_divergence")] == [
        (0, 0.0),
        (10, 0.0),
    ]


def test_ddp_the_sentinel_sees_a_defect_on_rank_one_only_at_every_step_and_warns_on_rank_zero(ddp):
    out_dir = ddp
    rank0, rank1 = result(out_dir, "sentinel_rank_one", 0), result(out_dir, "sentinel_rank_one", 1)
    # tanh's output differs on rank 1, once a step; summed over ranks and logged at every step on rank 0.
    assert logged(out_dir, "sentinel_rank_one", "recompute/sentinel/mismatches") == [1.0] * 4
    assert logged(out_dir, "sentinel_rank_one", "recompute/sentinel/regions/model.blocks.1/mismatches") == [1.0] * 4
    sentinel = [message for message in rank0["warnings"] if "the sentinel saw" in message]
    assert len(sentinel) == 1
    assert sentinel[0].startswith("lightning_ckpt_determinism: the sentinel saw region `model.blocks.1` recompute")
    assert (
        "at step 0 (rank 1): 1 mismatch, first: the 3rd tensor the region saved (made by `TanhBackward0`" in sentinel[0]
    )
    assert rank1["warnings"] == []
    # The periodic check at step 0 named the cause, so the sentinel's warning points to it and asks for no other.
    assert [(entry["step"], entry["diverged"]) for entry in rank0["history"]] == [(0, True)]
    assert "The check of that step names the cause" in sentinel[0]
    assert rank0["history"] == rank1["history"]
    # What was compared is summed over the same ranks as the mismatches.
    assert rank0["compared"] > 0 and rank1["compared"] > 0
    compared = logged(out_dir, "sentinel_rank_one", "recompute/sentinel/compared")
    assert sum(compared) == rank0["compared"] + rank1["compared"]
    # The fit's summary, on rank zero alone, says what every rank compared and found, as the metrics do.
    (summary,) = rank0["summaries"]
    assert summary.endswith(
        f"The sentinel compared {sum(compared):.0f} recomputed saved tensors with the forward's: 4 differed"
        " (model.blocks.1: 4)."
    )
    assert rank1["summaries"] == []


def test_ddp_a_two_pass_check_that_diverged_on_rank_one_only_asks_no_rank_for_a_follow_up(ddp):
    # Rank 1's own gradients diverged, rank 0's did not: the decision that the check named the cause is reduced, so
    # neither rank checks step 1 (a rank that did alone would wait in a collective the other never enters).
    rank0, rank1 = result(ddp, "sentinel_rank_one_two_pass", 0), result(ddp, "sentinel_rank_one_two_pass", 1)
    assert rank0["global_step"] == rank1["global_step"] == 4
    assert rank0["history"] == rank1["history"]
    assert [(entry["step"], entry["diverged"]) for entry in rank0["history"]] == [(0, True), (2, True)]
    sentinel = [message for message in rank0["warnings"] if "the sentinel saw" in message]
    assert sentinel and all("The check of that step names the cause" in message for message in sentinel)


@pytest.mark.parametrize("attribution", ["on_divergence", "always"])
def test_a_check_whose_rerun_is_skipped_on_one_rank_is_skipped_on_both_before_its_backward(runs, attribution):
    _, out_dir = runs
    first, second = (result(out_dir, f"rerun_skipped_on_rank_one_{attribution}", rank) for rank in (0, 1))
    assert first["error"] is None and first["global_step"] == second["global_step"] == 4
    assert first["history"] == second["history"]
    assert [(entry["step"], entry["grad_divergence"]) for entry in first["history"]] == [
        (step, math.inf) for step in range(4)
    ]


def test_ddp_a_stop_asked_on_rank_zero_alone_reads_the_sentinel_on_both_ranks_alike(ddp):
    first, second = (result(ddp, "stop_on_rank_zero", rank) for rank in (0, 1))
    assert first["error"] is None and first["global_step"] == second["global_step"] == 4
    assert first["history"] == second["history"] and first["compared"] > 0 and second["compared"] > 0


def test_ddp_the_sentinel_watching_every_other_step_sees_the_defect_at_those_steps_alike_on_both_ranks(ddp):
    out_dir = ddp
    every_other, every_step = result(out_dir, "sentinel_every_other", 0), result(out_dir, "sentinel_rank_one", 0)
    # Steps 0 and 2 watched (the check of step 0 named the cause: no step escalated), 1 and 3 run unwatched.
    compared = logged(out_dir, "sentinel_every_other", "recompute/sentinel/compared")
    assert len(compared) == 4 and [count > 0 for count in compared] == [True, False, True, False]
    assert logged(out_dir, "sentinel_every_other", "recompute/sentinel/mismatches") == [1.0, 1.0]
    # Rank 0 warns as when every step is watched: once, at step 0, naming rank 1.
    assert [message for message in every_other["warnings"] if "the sentinel saw" in message] == [
        message for message in every_step["warnings"] if "the sentinel saw" in message
    ]
    assert result(out_dir, "sentinel_every_other", 1)["warnings"] == []


@pytest.mark.parametrize(
    "name",
    ["sentinel_fails_on_rank_one", "sentinel_fails_starting_a_step_on_rank_one", "sentinel_metrics_fail_on_rank_one"],
)
def test_ddp_a_failure_of_the_sentinels_own_on_rank_one_stops_it_on_both_ranks_and_training_is_unchanged(ddp, name):
    rank0, rank1 = result(ddp, name, 0), result(ddp, name, 1)
    assert rank0["global_step"] == rank1["global_step"] == 4
    stopped = [message for message in rank0["warnings"] if "the sentinel stopped" in message]
    assert stopped == [
        "lightning_ckpt_determinism: the sentinel stopped after a failure of its own (on another rank); training goes"
        " on, and the periodic check still runs. Please report it."
    ]
    assert rank1["warnings"] == []
    # The periodic check ran at every step on both ranks, exact; the weights are those of the clean fit.
    assert [(entry["step"], entry["grad_divergence"]) for entry in rank0["history"]] == [(n, 0.0) for n in range(4)]
    assert rank0["history"] == rank1["history"]
    for rank in (0, 1):
        assert_equal_states(state(ddp, name, rank), state(ddp, "clean_dropout", rank))


def test_ddp_a_failure_reading_a_clean_record_on_rank_one_stops_the_sentinel_on_both_ranks_alike(ddp):
    rank0, rank1 = (result(ddp, "sentinel_read_fails_on_rank_one", rank) for rank in (0, 1))
    assert rank0["global_step"] == rank1["global_step"] == 4
    stopped = [message for message in rank0["warnings"] if "the sentinel stopped" in message]
    assert len(stopped) == 1 and "(on another rank)" in stopped[0]
    for rank in (0, 1):
        assert_equal_states(state(ddp, "sentinel_read_fails_on_rank_one", rank), state(ddp, "clean_dropout", rank))


def test_ddp_with_unused_parameters_trains_on_through_two_pass_checks_clean_and_defective(ddp):
    # `attribution="always"` checks every step with the two-pass engine on the bare module; a branch used on even
    # batches only leaves parameters unused under `find_unused_parameters=True`. A backward outside DDP's forward
    # used to fire DDP's reducer hooks there, and the next step's backward failed.
    out_dir = ddp
    for name, diverged in (("unused_always_clean", False), ("unused_always_defect", True)):
        for rank in (0, 1):
            run = result(out_dir, name, rank)
            assert run["global_step"] == 4
            assert [(entry["step"], entry["diverged"]) for entry in run["history"]] == [
                (step, diverged) for step in range(4)
            ]
    clean = result(out_dir, "unused_always_clean", 0)["history"]
    assert [entry["grad_divergence"] for entry in clean] == [0.0] * 4


@pytest.mark.parametrize("kept", ["orig", "flat"])
def test_fsdp1_sharded_over_two_ranks_checks_at_zero_when_clean_and_finds_redrawn_masks(fsdp1, kept):
    # `orig`: `use_orig_params=True`, Lightning's default, where a check's state captured inside FSDP1's forward used
    # to put back the views FSDP1 sets for the original parameters, hiding them: the next check compared none.
    out_dir = fsdp1
    clean = [result(out_dir, f"{kept}_clean", rank) for rank in (0, 1)]
    assert clean[0]["history"] == clean[1]["history"]
    assert [(entry["step"], entry["grad_divergence"], entry["diverged"]) for entry in clean[0]["history"]] == [
        (step, 0.0, False) for step in range(4)
    ]
    assert clean[0]["warnings"] == clean[1]["warnings"] == []
    defect = [result(out_dir, f"{kept}_rng_not_preserved", rank) for rank in (0, 1)]
    assert defect[0]["history"] == defect[1]["history"]
    divergences = [entry["grad_divergence"] for entry in defect[0]["history"]]
    assert len(divergences) == 4 and all(0.0 < value < math.inf for value in divergences)
    # The two-pass check, through FSDP1's root wrapper, names each block and the cause.
    assert defect[0]["regions"] == [[f"model.blocks.{index}", "rng_not_preserved"] for index in range(3)]
    # Both ways of holding the parameters give the same gradients, so the same figures (reduced in another order).
    other = result(out_dir, f"{'flat' if kept == 'orig' else 'orig'}_rng_not_preserved", 0)
    assert divergences == pytest.approx([entry["grad_divergence"] for entry in other["history"]], rel=1e-9)


def test_fsdp1_a_block_wrapped_in_a_unit_of_its_own_is_selected_and_named_as_users_write_it(fsdp1):
    # `auto_wrap_policy={DropoutBlock}`: torch names the block `model.blocks.1._fsdp_wrapped_module`.
    out_dir = fsdp1
    clean = result(out_dir, "units_clean", 0)
    assert [entry["grad_divergence"] for entry in clean["history"]] == [0.0] * 4 and clean["warnings"] == []
    defect = [result(out_dir, "units_rng_not_preserved", rank) for rank in (0, 1)]
    assert defect[0]["history"] == defect[1]["history"]
    assert len(defect[0]["history"]) == 4 and all(entry["diverged"] for entry in defect[0]["history"])
    assert defect[0]["regions"] == defect[1]["regions"] == [["model.blocks.1", "rng_not_preserved"]]


@pytest.mark.parametrize("name", ["accumulate_2_monitored", "accumulate_2_always"])
def test_fsdp1_training_accumulating_and_checked_at_every_step_is_bit_identical_to_a_fit_without_the_monitor(
    fsdp1, name
):
    # `accumulate_2_always`: every check the two-pass one, which names the regions it compared.
    out_dir = fsdp1
    for rank in (0, 1):
        run = result(out_dir, name, rank)
        assert [(entry["step"], entry["grad_divergence"]) for entry in run["history"]] == [
            (step, 0.0) for step in range(4)
        ]
        regions = [[f"model.blocks.{index}", None] for index in range(3)]
        assert run["regions"] == (regions if name == "accumulate_2_always" else [])
        assert_equal_states(state(out_dir, name, rank), state(out_dir, "accumulate_2_checkpointed", rank))
