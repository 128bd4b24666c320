"""What a check does differently for compiled models: the reference pass, eager semantics and, imported where it is
used (it imports the compilers), the scan of compiled backward graphs in ``graph_scan``."""

from lightning_ckpt_determinism.verify.compiled.reference import eager_semantics, is_compiled, reference_pass

__all__ = ["eager_semantics", "is_compiled", "reference_pass"]
