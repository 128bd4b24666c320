"""Collectives inside checkpointed regions and tensor parallelism, on two CPU processes (gloo).

A hand-written SyncBatchNorm (an all-reduce in forward) and an all-to-all, as expert parallelism exchanges tokens,
run inside checkpointed regions: recomputation in backward runs their collectives again. The check and the monitor
must neither hang nor see a difference the collective itself makes, and must still name a real defect. Tensor
parallelism gives DTensor parameters, which the attribution compares shard by shard. One launch runs every
scenario; each rank's process group times out after a minute.
"""

import json
from typing import Any

import pytest

from tests.helpers import REPO, launch_ranks

SCRIPT = REPO / "tests" / "distributed_regions_script.py"
pytestmark = pytest.mark.slow
BLOCKS = ["SyncNormBlock", "AllToAllBlock"]
REGIONS = [f"model.blocks.{index}" for index in range(3)]
BLOCKS_OF_A_STACK = ["blocks.0", "blocks.1", "blocks.2"]
DEFECT_IN_BLOCK_1 = [["blocks.0", None], ["blocks.1", "host_rng"], ["blocks.2", None]]


@pytest.fixture(scope="module")
def found(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("regions")
    launch_ranks(SCRIPT, str(out_dir), timeout=420)
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def clean_regions(names: list[str]) -> list[list[Any]]:
    return [[name, None] for name in names]


@pytest.mark.parametrize("block", BLOCKS)
def test_check_recomputation_with_a_collective_in_each_region_is_exact_and_attributed(found, block):
    for rank in found:
        clean, defect = rank[f"check_{block}_clean"], rank[f"check_{block}_numpy_noise"]
        assert (clean["grad_divergence"], clean["error"]) == (0.0, None)
        assert [[name, cause] for name, cause, _ in clean["regions"]] == clean_regions(BLOCKS_OF_A_STACK)
        assert all(compared > 0 for _, _, compared in clean["regions"])
        assert defect["grad_divergence"] > 0.0 and defect["error"] is None
        assert [[name, cause] for name, cause, _ in defect["regions"]] == DEFECT_IN_BLOCK_1


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
@pytest.mark.parametrize("block", BLOCKS)
def test_the_monitor_with_a_collective_in_each_region_is_exact_and_names_the_defect(found, kind, block):
    rank0, rank1 = found
    clean, defect = rank0[f"{kind}_{block}_clean"], rank0[f"{kind}_{block}_numpy_noise"]
    assert clean == rank1[f"{kind}_{block}_clean"]
    assert clean["history"] == [[0, 0.0, False], [1, 0.0, False]]
    assert clean["regions"] == clean_regions(REGIONS)
    assert clean["warnings"] == []
    assert [step for step, divergence, diverged in defect["history"] if diverged and divergence > 0.0] == [0, 1]
    assert defect["regions"] == [[REGIONS[0], None], [REGIONS[1], "host_rng"], [REGIONS[2], None]]


def test_regions_holding_fsdp2_units_of_their_own_train_exactly_and_name_only_the_defect(found):
    # Each block's linear layers are FSDP2 units: they gather their parameters inside the block's forward, free them
    # after it, and gather them again for its recomputation. Neither the gathering ops nor the freed parameters
    # count as the block's (they crashed the first forward's probe, and were blamed as Python state in every block).
    rank0, rank1 = found
    clean, defect = rank0["fsdp2_inner_units_clean"], rank0["fsdp2_inner_units_numpy_noise"]
    assert clean == rank1["fsdp2_inner_units_clean"]
    assert clean["history"] == [[0, 0.0, False], [1, 0.0, False]]
    assert clean["regions"] == clean_regions(REGIONS)
    assert clean["warnings"] == []
    assert defect["history"] == rank1["fsdp2_inner_units_numpy_noise"]["history"]
    assert all(diverged and divergence > 0.0 for _, divergence, diverged in defect["history"])
    assert defect["regions"] == [[REGIONS[0], None], [REGIONS[1], "host_rng"], [REGIONS[2], None]]
    # FSDP2 gathers the parameters again for recomputation, into the tensors it gathered them into for the forward:
    # their versions move, their values do not, and the sentinel names no parameter write at any step.
    for rank in found:
        assert rank["inner_units_sentinel"] == [[[False, None], [True, None], [False, None]]] * 3


def test_check_recomputation_under_tensor_parallelism_compares_shards_and_names_the_defect(found):
    for rank in found:
        clean, defect = rank["tp_check_clean"], rank["tp_check_numpy_noise"]
        assert (clean["grad_divergence"], clean["error"]) == (0.0, None)
        assert [[name, cause] for name, cause, _ in clean["regions"]] == clean_regions(BLOCKS_OF_A_STACK)
        assert defect["grad_divergence"] > 0.0 and defect["error"] is None
        assert [[name, cause] for name, cause, _ in defect["regions"]] == DEFECT_IN_BLOCK_1


def test_the_monitor_under_tensor_parallelism_is_exact_and_names_the_defect(found):
    rank0, rank1 = found
    clean, defect = rank0["tp_fit_clean"], rank0["tp_fit_numpy_noise"]
    assert clean == rank1["tp_fit_clean"]
    assert clean["history"] == [[0, 0.0, False], [1, 0.0, False]]
    assert clean["regions"] == clean_regions(REGIONS)
    assert defect["history"] == rank1["tp_fit_numpy_noise"]["history"]
    assert all(diverged and divergence > 0.0 for _, divergence, diverged in defect["history"])
    assert defect["regions"] == [[REGIONS[0], None], [REGIONS[1], "host_rng"], [REGIONS[2], None]]


def test_a_path_one_rank_takes_alone_keeps_its_collectives_in_step_and_its_gradients_exact(found):
    # The regions end in an all-reduce after their last saved tensor; rank 1 alone takes a new path at steps 2 and 9,
    # and probes for it alone at the steps after each. Were that rank alone to recompute to the regions' end, it would
    # run the all-reduce again, out of step with rank 0.
    for rank in found:
        assert rank["path_of_one_rank"] == [0.0] * 12


def test_the_sentinel_reads_an_all_reduce_result_once_it_is_done(found):
    # Tensor parallelism's all-reduce returns before its values are in; the regions save that result.
    for rank in found:
        compared, mismatches = rank["tp_sentinel"]
        assert compared > 0 and mismatches == 0
