"""The ``audit`` command: arguments, loading through LightningCLI, the run, rendering and files.

``python -m lightning_ckpt_determinism audit --config run.yaml`` checks a training configuration's recomputation
before a long run: see :func:`main`.
"""

from lightning_ckpt_determinism.audit.running import main

__all__ = ["main"]
