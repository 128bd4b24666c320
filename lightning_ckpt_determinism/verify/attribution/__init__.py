"""Attribution: which region's recomputation differed from its forward, at which op, and why."""

from lightning_ckpt_determinism.verify.attribution.observer import Attribution

__all__ = ["Attribution"]
