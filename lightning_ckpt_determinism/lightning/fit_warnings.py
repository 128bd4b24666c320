"""The package's warnings during a fit, as the README shows them: ``lightning_ckpt_determinism: <message>``, on a line
of its own.

Lightning sets ``warnings.formatwarning`` when it is imported, and its format starts a warning with the file and line
of any file whose path contains "lightning", which the package's files do; and a warning written while Lightning's
TQDM progress bar is drawn sticks to the bar's line. While a fit that the package takes part in runs (from the
strategy's ``setup`` or the monitor's ``on_fit_start`` to the end of the fit), :func:`formatting_warnings` formats
the package's own warnings (:class:`~lightning_ckpt_determinism.LightningCkptDeterminismWarning`) as their message
alone, after clearing the trainer's TQDM bars, which draw themselves again at their next update (Rich's bar already
moves what is written to stderr above itself). Every other warning is formatted as before, and nothing else changes:
filters, ``pytest.warns`` and ``warnings.catch_warnings(record=True)`` see the same warnings. The previous format is
put back when the last fit ends.
"""

import warnings
import weakref
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar

from lightning_ckpt_determinism.errors import LightningCkptDeterminismWarning

__all__ = ["formatting_warnings", "warnings_formatted"]

_PACKAGE = "lightning_ckpt_determinism"

# The fits that asked for the format, each with how many of its parts (strategy, monitors) asked; the format found
# when the first asked (kept while something that replaced the format since may still pass warnings to it); and the
# format to fall back to, the one found at import.
_fits: "weakref.WeakKeyDictionary[pl.Trainer, int]" = weakref.WeakKeyDictionary()
_previous: list[Any] = []
_AT_IMPORT = warnings.formatwarning


def formatting_warnings(trainer: "pl.Trainer") -> None:
    """Format the package's warnings as their message alone while ``trainer``'s fit runs, until
    :func:`warnings_formatted` is called as many times for it.

    Args:
        trainer: The Trainer whose fit starts.

    Example::

        >>> import lightning.pytorch as pl
        >>> trainer = pl.Trainer(logger=False, enable_progress_bar=False)
        >>> formatting_warnings(trainer)
        >>> warnings.formatwarning("block 2 differs", LightningCkptDeterminismWarning, "results.py", 9)
        'lightning_ckpt_determinism: block 2 differs\\n'
        >>> warnings_formatted(trainer)
        >>> warnings.formatwarning is _format
        False
    """
    _fits[trainer] = _fits.get(trainer, 0) + 1
    if not _previous:
        _previous.append(warnings.formatwarning)
        warnings.formatwarning = _format


def warnings_formatted(trainer: "pl.Trainer") -> None:
    """Undo one :func:`formatting_warnings` for ``trainer``; the last one of the last fit puts the previous format
    back (unless something replaced the format since, which then keeps passing warnings to the previous one).

    Args:
        trainer: The Trainer whose fit ends.

    Example::

        >>> import lightning.pytorch as pl
        >>> trainer = pl.Trainer(logger=False, enable_progress_bar=False)
        >>> before = warnings.formatwarning
        >>> formatting_warnings(trainer)
        >>> warnings_formatted(trainer)
        >>> warnings.formatwarning is before
        True
    """
    left = _fits.pop(trainer, 0) - 1
    if left > 0:
        _fits[trainer] = left
    if _fits or not _previous:
        return
    if warnings.formatwarning is _format:
        warnings.formatwarning = _previous.pop()


def _format(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
) -> str:
    previous = _previous[0] if _previous else _AT_IMPORT
    if not (_fits and issubclass(category, LightningCkptDeterminismWarning)):
        return str(previous(message, category, filename, lineno, line))
    for trainer in list(_fits):
        _clear_bars(trainer)
    text = str(message)
    return f"{text}\n" if text.startswith(f"{_PACKAGE}:") else f"{_PACKAGE}: {text}\n"


def _clear_bars(trainer: "pl.Trainer") -> None:
    """Clear the TQDM bars ``trainer`` draws, so that what follows starts a line of its own."""
    callback = trainer.progress_bar_callback
    if not isinstance(callback, TQDMProgressBar):
        return
    for name in ("train_progress_bar", "val_progress_bar"):
        try:
            bar = getattr(callback, name)
        except TypeError:  # Lightning's properties raise while the bar does not exist.
            continue
        bar.clear()
        bar.fp.flush()
