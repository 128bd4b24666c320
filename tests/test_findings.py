from lightning_ckpt_determinism.lightning.findings import Findings, RankFindings, divergence_message
from lightning_ckpt_determinism.verify.reports import RecomputationReport


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
