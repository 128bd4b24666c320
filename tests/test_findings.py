from lightning_ckpt_determinism.lightning.findings import Findings, FitSummary, RankFindings, divergence_message
from lightning_ckpt_determinism.verify.reports import RecomputationReport, RegionReport


def _rank(rank: int, worst: list[tuple[str, float]]) -> RankFindings:
    return RankFindings(rank, None, worst, [], attributed=True, hint=None)


def test_the_worst_parameters_of_a_divergence_are_those_of_every_rank_each_at_its_largest() -> None:
    # A two-pass check compares each rank's own gradients: here rank 0's own report found nothing, rank 1 the worst.
    report = RecomputationReport(0.0, 0.0, diverged=False, tolerance=0.0)
    ranks = [
        _rank(0, [("blocks.0.weight", 0.2), ("blocks.1.weight", 0.5)]),
        _rank(1, [("blocks.1.weight", 1.14), ("blocks.1.bias", 0.84)]),
    ]
    findings = Findings(grad_divergence=0.33, max_abs_diff=1.14, noise_floor=0.0, diverged=True, ranks=ranks)
    message = divergence_message(0, findings, report, "always")
    assert (
        "max_abs_diff=1.14. The worst parameters: blocks.1.weight (1.14), blocks.1.bias (0.84), blocks.0.weight (0.2)."
        in message
    )


def test_without_the_ranks_findings_the_reports_own_worst_parameters_are_listed() -> None:
    report = RecomputationReport(0.5, 0.1, diverged=True, tolerance=0.0, worst_parameters=[("w", 0.1)])
    findings = Findings(grad_divergence=0.5, max_abs_diff=0.1, noise_floor=0.0, diverged=True)
    assert "The worst parameters: w (0.1)." in divergence_message(3, findings, report, "never")


def _diverged(name: str, cause: str, op: str) -> RegionReport:
    return RegionReport(name, ops_compared=9, max_abs_diff=0.1, diverged=True, cause=cause, first_divergent_op=(op, 5))


def test_a_rank_whose_region_has_a_cause_an_op_proves_is_named_before_a_rank_with_the_catch_all() -> None:
    # Tensor parallelism with NumPy noise on rank 1 only: rank 0's regions see other inputs arrive through the
    # all-reduce (`python_state`, attribution's last rule); rank 1 names the cause. Rank order put rank 0's first.
    report = RecomputationReport(0.0, 0.0, diverged=False, tolerance=0.0)
    ranks = [
        RankFindings(
            0, None, [], [_diverged(f"layers.{i}", "python_state", "aten.add.Tensor") for i in (0, 1)], True, None
        ),
        RankFindings(
            1, None, [], [_diverged(f"layers.{i}", "host_rng", "aten.mul.Tensor") for i in (0, 1)], True, None
        ),
    ]
    findings = Findings(grad_divergence=0.5, max_abs_diff=0.1, noise_floor=0.0, diverged=True, ranks=ranks)
    message = divergence_message(0, findings, report, "on_divergence")
    named = [part.split("`")[1] + " " + part.split("cause ")[1].split(":")[0] for part in message.split("Region ")[1:]]
    assert named == ["layers.0 host_rng", "layers.1 host_rng", "layers.0 python_state"]
    summary = FitSummary()
    summary.add(0, findings)
    text = summary.text(1, None)
    assert text.index("Cause host_rng") < text.index("Cause python_state")
