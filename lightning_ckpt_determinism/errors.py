"""The package's own exception and warning types."""

__all__ = ["LightningCkptDeterminismWarning", "RecomputationDivergenceError"]


class LightningCkptDeterminismWarning(UserWarning):
    """Warned by this package: a configuration that does less than asked, or a recomputation that diverged.

    Example::

        >>> import warnings
        >>> warnings.simplefilter("error", LightningCkptDeterminismWarning)
    """


class RecomputationDivergenceError(RuntimeError):
    """Raised by ``RecomputationMonitor(on_divergence="raise")`` when recomputation changed the gradients.

    Example::

        >>> raise RecomputationDivergenceError("lightning_ckpt_determinism: ...")
        Traceback (most recent call last):
        ...
        lightning_ckpt_determinism.errors.RecomputationDivergenceError: lightning_ckpt_determinism: ...
    """
