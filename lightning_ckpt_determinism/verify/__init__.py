"""The checks: comparing gradients, the two-pass and live-step engines, attribution, and the state they restore.

This layer imports no Lightning: it runs on plain PyTorch (and the checkpointing layer below it).
"""

from lightning_ckpt_determinism.verify.cause import Cause
from lightning_ckpt_determinism.verify.compare import gradient_divergence
from lightning_ckpt_determinism.verify.reports import CAUSE_HINTS, RecomputationReport, RegionReport
from lightning_ckpt_determinism.verify.sentinel import (
    RecomputationSentinel,
    SentinelRegion,
    SentinelReport,
    recomputation_sentinel,
)
from lightning_ckpt_determinism.verify.two_pass import check_recomputation

__all__ = [
    "CAUSE_HINTS",
    "Cause",
    "RecomputationReport",
    "RecomputationSentinel",
    "RegionReport",
    "SentinelRegion",
    "SentinelReport",
    "check_recomputation",
    "gradient_divergence",
    "recomputation_sentinel",
]
