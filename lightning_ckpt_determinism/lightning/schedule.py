"""Which training steps the monitor checks."""

from dataclasses import dataclass

__all__ = ["CheckSchedule"]


@dataclass
class CheckSchedule:
    """The steps the monitor checks: the first of a fit, every ``every_n_steps``-th global step, the step after a
    skipped check (a retry) and the global step after a sentinel finding (a follow-up, with attribution); never a
    global step already checked (the next micro-batch of a step under gradient accumulation).

    Attributes:
        every_n_steps: Check every this many optimizer steps.
        last_checked: The global step last checked, or ``-1``.
        checked_this_fit: Whether a check ran (or was skipped for a reason) in this fit.
        follow_up: The global step from which a sentinel finding asks for a check with attribution, or ``None``.
        retry: The global step from which a skipped check is retried, or ``None``.
        checked_in_fit: The global step last checked in this fit, or ``-1``: a second fit of the same monitor (a new
            model from step 0) checks its first step even where the last fit's last check was at that step.

    Example::

        >>> schedule = CheckSchedule(every_n_steps=10)
        >>> schedule.due(3)  # the fit's first step
        True
        >>> schedule.checking(3)
        >>> schedule.checked_this_fit = True
        >>> schedule.due(4), schedule.due(10)
        (False, True)
    """

    every_n_steps: int
    last_checked: int = -1
    checked_this_fit: bool = False
    follow_up: int | None = None
    retry: int | None = None
    checked_in_fit: int = -1

    def start_fit(self) -> None:
        """A fit starts: its first step is checked; nothing is pending from an earlier fit."""
        self.checked_this_fit = False
        self.follow_up = self.retry = None
        self.checked_in_fit = -1

    def due(self, step: int) -> bool:
        """Whether the training batch starting at global ``step`` is checked (a due retry is then taken).

        Args:
            step: The global step at the batch's start.
        """
        follow_up = self.follow_up is not None and step >= self.follow_up and step != self.checked_in_fit
        retry = self.retry is not None and step >= self.retry and step != self.checked_in_fit
        if step == self.checked_in_fit and not follow_up:
            return False
        if self.checked_this_fit and step % self.every_n_steps and not (follow_up or retry):
            return False
        self.retry = None
        return True

    def checking(self, step: int) -> None:
        """The check of global ``step`` runs now.

        Args:
            step: The global step checked.
        """
        self.last_checked = self.checked_in_fit = step

    def skipped(self, step: int) -> None:
        """The check of ``step`` was skipped for something the next check captures: that one is due next step.

        Args:
            step: The global step whose check was skipped.
        """
        self.checked_this_fit = True
        self.retry = step + 1

    def attribution(self, step: int, default: str) -> str:
        """``"always"`` for a follow-up due at ``step`` (which it takes), else ``default``: a step after the sentinel
        saw a mismatch is checked with attribution, so the cause is named.

        Args:
            step: The global step checked.
            default: The monitor's ``attribution``.
        """
        if self.follow_up is not None and step >= self.follow_up:
            self.follow_up = None
            return "always"
        return default
