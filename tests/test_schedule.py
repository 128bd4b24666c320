"""Tests for `lightning_ckpt_determinism.lightning.schedule`: which training steps the monitor checks."""

from lightning_ckpt_determinism.lightning.schedule import CheckSchedule


def _checked(schedule: CheckSchedule, steps: list[int]) -> list[int]:
    """The steps of ``steps`` (one batch each) that are checked, each check completing."""
    checked = []
    for step in steps:
        if schedule.due(step):
            schedule.checking(step)
            schedule.checked_this_fit = True
            checked.append(step)
    return checked


def test_the_first_step_of_a_fit_then_every_n_steps_are_checked() -> None:
    schedule = CheckSchedule(every_n_steps=3)
    assert _checked(schedule, [1, 2, 3, 4, 5, 6, 7]) == [1, 3, 6]
    schedule.start_fit()
    assert _checked(schedule, [8, 9]) == [8, 9]


def test_a_global_step_is_checked_once_under_gradient_accumulation() -> None:
    schedule = CheckSchedule(every_n_steps=2)
    assert _checked(schedule, [0, 0, 1, 1, 2, 2]) == [0, 2]


def test_a_skipped_check_is_retried_at_the_next_step() -> None:
    schedule = CheckSchedule(every_n_steps=10)
    assert schedule.due(0)
    schedule.checking(0)
    schedule.skipped(0)
    assert _checked(schedule, [0, 1, 2]) == [1]


def test_a_follow_up_is_checked_once_with_attribution() -> None:
    schedule = CheckSchedule(every_n_steps=10)
    assert _checked(schedule, [0, 1]) == [0]
    schedule.follow_up = 2
    assert schedule.due(2)
    schedule.checking(2)
    assert schedule.attribution(2, "never") == "always"
    assert schedule.attribution(2, "never") == "never"
    assert schedule.follow_up is None
    assert not schedule.due(2)
