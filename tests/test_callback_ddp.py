import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "ddp_monitor_script.py"


def run_ddp(out_dir: Path, mode: str) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, str(SCRIPT), str(out_dir), mode], cwd=REPO, env=env, check=True, timeout=240)
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def test_ddp_logs_the_maximum_over_ranks_and_all_ranks_agree(tmp_path):
    rank0, rank1 = run_ddp(tmp_path, "warn")
    assert rank0["global_step"] == rank1["global_step"] == 4
    assert rank0["local_divergence"] == 0.0
    assert rank1["local_divergence"] > 0.0
    assert rank0["history"] == rank1["history"]
    assert [(entry["step"], entry["diverged"]) for entry in rank0["history"]] == [(0, True), (2, True)]
    assert rank0["history"][0]["grad_divergence"] == pytest.approx(rank1["history"][0]["grad_divergence"])
    assert rank0["checksum"] == rank1["checksum"]
    with open(tmp_path / "lightning_logs" / "version_0" / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    logged = [float(row["recompute/grad_divergence"]) for row in rows if row.get("recompute/grad_divergence")]
    assert logged == [entry["grad_divergence"] for entry in rank0["history"]]
    assert all(value > 0.0 for value in logged)


def test_ddp_raise_mode_stops_every_rank_without_hanging(tmp_path):
    rank0, rank1 = run_ddp(tmp_path, "raise")
    for result in (rank0, rank1):
        assert result["error"] is not None
        assert result["error"].startswith("lightning_ckpt_determinism: recomputation diverged at step 0")
        assert result["global_step"] == 0
    assert "another rank diverged" in rank0["error"]
    assert "the worst parameters on this rank" in rank1["error"]
