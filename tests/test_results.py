"""Tests for `lightning_ckpt_determinism.lightning.results`: the history, the summary and the warnings' cadence."""

import warnings

import pytest

from lightning_ckpt_determinism import LightningCkptDeterminismWarning
from lightning_ckpt_determinism.lightning.results import CheckResults


def test_a_kind_of_finding_warns_again_every_n_steps_checks() -> None:
    results = CheckResults(history_size=2, log_prefix="recompute", every_n_steps=2, on_divergence="warn")
    warned = []
    for _ in range(5):
        results.checks += 1
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            results.warn_once("kind", "lightning_ckpt_determinism: found")
            results.warn_once("other", "lightning_ckpt_determinism: found other")
        assert all(issubclass(item.category, LightningCkptDeterminismWarning) for item in record)
        warned.append([str(item.message) for item in record])
    found = ["lightning_ckpt_determinism: found", "lightning_ckpt_determinism: found other"]
    assert warned == [found, [], found, [], found]


def test_skipped_checks_are_kept_and_counted_and_a_fit_starts_afresh() -> None:
    results = CheckResults(history_size=2, log_prefix="recompute", every_n_steps=1, on_divergence="warn")
    for step in range(3):
        results.skipped(step, "non-finite gradients")
    assert [record.step for record in results.history] == [1, 2]
    assert results.summary.skipped == 3
    results.start_fit()
    assert results.summary.skipped == 0
    assert len(results.history) == 2
    # A fit that checked nothing says so, not "none diverged".
    assert results.text(None) == (
        "lightning_ckpt_determinism: RecomputationMonitor ran no gradient check this fit: no training step was"
        " checked, so nothing is proven about its recomputation."
    )


def test_a_rate_limited_warning_is_said_not_shown_so_nothing_points_to_it() -> None:
    results = CheckResults(history_size=4, log_prefix="recompute", every_n_steps=3, on_divergence="warn")
    with pytest.warns(LightningCkptDeterminismWarning, match="first"):
        assert results.warn_once("kind", "first") is True
    results.checks = 2  # within every_n_steps checks of the last warning: held back
    assert results.warn_once("kind", "again") is False
    results.checks = 3
    with pytest.warns(LightningCkptDeterminismWarning, match="recurs"):
        assert results.warn_once("kind", "recurs") is True
