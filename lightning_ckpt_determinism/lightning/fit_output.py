"""What the package writes during a fit, and only then: its warnings on lines of their own, its notes on rank zero.

**Warnings.** Lightning sets ``warnings.formatwarning`` when it is imported, and its format starts a warning with
the file and line of any file whose path contains "lightning", which the package's files do; and a warning written
while Lightning's TQDM progress bar is drawn sticks to the bar's line. While a fit runs, the package's own warnings
(:class:`~lightning_ckpt_determinism.LightningCkptDeterminismWarning`) are formatted as their message alone, after
clearing the trainer's TQDM bars, which draw themselves again at their next update (Rich's bar already moves what
is written to stderr above itself). Every other warning is formatted as before, and nothing else changes: filters,
``pytest.warns`` and ``warnings.catch_warnings(record=True)`` see the same warnings.

**Notes.** The layers below Lightning log through ``logging.getLogger(__name__)`` and know nothing of ranks.
Lightning shows its own info lines on rank zero through a handler on its ``lightning.pytorch`` logger; while a fit
runs, the package's ``lightning_ckpt_determinism`` logger gets such a handler too (info lines and warnings on
stderr, rank zero only), unless it or the root logger has a handler already: the application configured logging,
the records reach its handlers on every rank, and it decides (the package's logger then only lets INFO through).

**Each fit's warnings.** Python shows a warning once per message and line under its default filter, remembering
those shown in the registry of the module that warned, for the life of the process. A fit that finds what an earlier
fit in the same process found (a notebook cell run again, a sweep, a retry) would then show none of its findings. When
a fit starts, the package forgets which of its own warnings were shown (from every module's registry, whatever
the filter's action); other warnings are left alone.

Both last from the strategy's ``setup`` or the monitor's ``on_fit_start`` until the end of the fit, whether it
ends or raises, each part of a fit (the strategy, each monitor) holding them through its own :class:`FitOutput`.
When the last part of the last fit lets go, the warning format and the logger's handlers, level and ``propagate``
are what they were before the first took hold.
"""

import logging
import sys
import types
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_ckpt_determinism.errors import LightningCkptDeterminismWarning

__all__ = ["FitOutput"]

_PACKAGE = "lightning_ckpt_determinism"


@dataclass(frozen=True)
class _Notes:
    """The package logger's settings before the first fit took hold, and the handler that fit gave it, if any."""

    level: int
    propagate: bool
    handler: logging.Handler | None


# The fits held, each with how many of its parts (strategy, monitors) hold it; the warning format found when the
# first took hold (kept while something that replaced the format since may still pass warnings to it) and the
# logger's settings then; and the format to fall back to, the one found at import.
_fits: "weakref.WeakKeyDictionary[pl.Trainer, int]" = weakref.WeakKeyDictionary()
_previous: list[Any] = []
_notes: list[_Notes] = []
_AT_IMPORT = warnings.formatwarning


def _forget_shown_warnings() -> None:
    """Drop the package's own warnings from every warning registry (each module's, and the one of the "once" action),
    so that a new fit shows its findings even where an earlier fit in this process showed the same words from the same
    line. Other warnings stay where they are."""
    # The "once" action's registry is the `warnings` module's own (not in its type stubs).
    registries = [getattr(warnings, "onceregistry", None)]
    registries += [_registry_of(module) for module in list(sys.modules.values())]
    for registry in registries:
        if isinstance(registry, dict):
            for key in [key for key in list(registry) if _is_own(key)]:
                registry.pop(key, None)


def _registry_of(module: object) -> object:
    """A module's warning registry, read without running anything of it: a module imported lazily
    (`importlib.util.LazyLoader`) imports itself at its first attribute read, which may fail or have effects."""
    if not isinstance(module, types.ModuleType):
        return None
    try:
        return object.__getattribute__(module, "__dict__").get("__warningregistry__")
    except Exception:  # a module type of its own whose namespace is out of reach
        return None


def _is_own(key: object) -> bool:
    """Whether a warning registry's key (``(text, category, lineno)``, or ``(text, category)`` for the "module" and
    "once" actions) is one of the package's warnings."""
    return (
        isinstance(key, tuple)
        and len(key) in (2, 3)
        and isinstance(key[1], type)
        and issubclass(key[1], LightningCkptDeterminismWarning)
    )


class FitOutput:
    """One part of a fit's hold on the package's output (warnings on lines of their own, notes on rank zero).

    The strategy and the monitor each own one: :meth:`hold` when their part of the fit starts, :meth:`release`
    when it ends or raises. The output lasts while any part of any fit holds it.

    Example::

        >>> import lightning.pytorch as pl
        >>> before = warnings.formatwarning
        >>> output = FitOutput()
        >>> output.hold(pl.Trainer(logger=False, enable_progress_bar=False))
        >>> warnings.formatwarning("block 2 differs", LightningCkptDeterminismWarning, "results.py", 9)
        'lightning_ckpt_determinism: block 2 differs\\n'
        >>> output.release()
        >>> warnings.formatwarning is before
        True
    """

    def __init__(self) -> None:
        self._trainer: pl.Trainer | None = None

    def hold(self, trainer: "pl.Trainer") -> None:
        """Hold the output for ``trainer``'s fit (letting go of a previous hold first).

        Args:
            trainer: The Trainer whose fit starts.
        """
        self.release()
        self._trainer = trainer
        if trainer not in _fits:
            _forget_shown_warnings()
        _fits[trainer] = _fits.get(trainer, 0) + 1
        if not _notes:
            _notes.append(_show_notes())
        if not _previous:
            _previous.append(warnings.formatwarning)
            warnings.formatwarning = _format

    def release(self) -> None:
        """Let go of the hold, if any; the last one of the last fit puts the format and the logger back (the format
        unless something replaced it since, which then keeps passing warnings to the previous one)."""
        trainer, self._trainer = self._trainer, None
        if trainer is None:
            return
        left = _fits.pop(trainer, 0) - 1
        if left > 0:
            _fits[trainer] = left
        if _fits:
            return
        if _notes:
            _hide_notes(_notes.pop())
        if _previous and warnings.formatwarning is _format:
            warnings.formatwarning = _previous.pop()


class _RankZero(logging.Filter):
    """Lets records through on rank zero only (Lightning's ``rank_zero_only.rank``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(rank_zero_only, "rank", 0) == 0


def _show_notes() -> _Notes:
    """Show the package's info lines and warnings on stderr on rank zero, or only let INFO through to the handlers
    the application configured; return what to put back."""
    logger = logging.getLogger(_PACKAGE)
    before = _Notes(level=logger.level, propagate=logger.propagate, handler=None)
    if logger.handlers or logging.getLogger().handlers:
        logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))
        return before
    handler = logging.StreamHandler()
    handler.addFilter(_RankZero())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return _Notes(level=before.level, propagate=before.propagate, handler=handler)


def _hide_notes(notes: _Notes) -> None:
    logger = logging.getLogger(_PACKAGE)
    if notes.handler is not None:
        logger.removeHandler(notes.handler)
    logger.setLevel(notes.level)
    logger.propagate = notes.propagate


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
