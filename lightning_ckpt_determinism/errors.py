"""The package's own exception and warning types."""

__all__ = [
    "CheckpointingConfigError",
    "CheckpointingTypeError",
    "LightningCkptDeterminismWarning",
    "RecomputationDivergenceError",
]


class CheckpointingConfigError(ValueError):
    """Raised by every configuration check of this package, whether at construction or when the model is set up.

    The checks cover values out of range, class paths and ops that cannot be found, and selections that match
    nothing in the model (raised when the strategy sets the model up). It is a ``ValueError``, so code that
    catches ``ValueError`` keeps working; catch this type to tell a configuration mistake apart from a failure
    during training.

    Example::

        >>> from lightning_ckpt_determinism import CheckpointingConfig
        >>> CheckpointingConfig(classes=["Block"], every_n=0)
        Traceback (most recent call last):
        ...
        lightning_ckpt_determinism.errors.CheckpointingConfigError: `every_n` must be an integer >= 1, got 0.
    """


class CheckpointingTypeError(CheckpointingConfigError, TypeError):
    """A configuration value of the wrong type; still a ``TypeError``, which these checks raised before.

    Example::

        >>> issubclass(CheckpointingTypeError, TypeError)
        True
    """


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
