"""The package's notes (``logging`` records of its ``lightning_ckpt_determinism`` loggers), shown on rank zero.

The layers below Lightning log through ``logging.getLogger(__name__)`` and know nothing of ranks. Lightning shows its
own info lines on rank zero through a handler on its ``lightning.pytorch`` logger; :func:`show_notes` does the same
for the package's logger, once, when Lightning is in use and the application has configured no logging of its own.
"""

import logging

from lightning.pytorch.utilities.rank_zero import rank_zero_only

__all__ = ["show_notes"]

_PACKAGE = "lightning_ckpt_determinism"


class _RankZero(logging.Filter):
    """Lets records through on rank zero only (Lightning's ``rank_zero_only.rank``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(rank_zero_only, "rank", 0) == 0


def show_notes() -> None:
    """Show the package's info lines and warnings on stderr, on rank zero only, as Lightning shows its own.

    Nothing changes if the package's logger has a handler already, or if the root logger has one (the application
    configured logging: the records reach it, on every rank, and it decides).

    Example::

        >>> show_notes()
        >>> logging.getLogger("lightning_ckpt_determinism").level == logging.INFO
        True
    """
    logger = logging.getLogger(_PACKAGE)
    if logger.handlers or logging.getLogger().handlers:
        logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))
        return
    handler = logging.StreamHandler()
    handler.addFilter(_RankZero())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
