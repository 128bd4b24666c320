"""What every test gets: the process environment put back after it, and no process group left behind."""

import os
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _environment_put_back() -> Iterator[None]:
    """Put the process environment back after each test. An in-process Trainer leaves what Lightning's launcher set
    (``LOCAL_RANK``, ``MASTER_PORT``, ``PL_GLOBAL_SEED`` ...) in ``os.environ``, and a later test's child process that
    launches its own ranks would take the first for its own identity and never start the others."""
    saved = dict(os.environ)
    yield
    for name in [name for name in os.environ if name not in saved]:
        del os.environ[name]
    for name, value in saved.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def _no_process_group_left_behind() -> Iterator[None]:
    """Destroy the default process group a test's in-process Trainer left initialised (``ModelParallelStrategy`` on
    one process starts a gloo group and keeps it): with one, Lightning evaluates under ``no_grad`` instead of
    ``inference_mode``, and a later test would run otherwise than alone."""
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
