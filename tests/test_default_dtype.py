"""A region recomputes with torch's default dtype as its forward ran: Lightning's ``"bf16-true"``, ``"16-true"`` and
``"64-true"`` set it around ``training_step`` only, and backward, where regions are recomputed, runs outside."""

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_ckpt_determinism import CheckpointingConfig, RecomputationMonitor, SingleDeviceCheckpointingStrategy
from lightning_ckpt_determinism.checkpointing.contexts import default_dtype
from tests.helpers import DIM, RampBlock, StackModule, trainer_kwargs, twins


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_region_recomputes_with_the_default_dtype_of_its_forward(dtype: torch.dtype) -> None:
    plain, model = twins(lambda: nn.Sequential(RampBlock(), RampBlock()).to(dtype), ["0", "1"])
    x = torch.randn(4, DIM, dtype=dtype)
    for module in (plain, model):
        with default_dtype(dtype):
            loss = module(x).float().square().mean()
        loss.backward()  # outside, as Lightning's backward runs
    assert torch.get_default_dtype() is torch.float32
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), model.parameters(), strict=True))


@pytest.mark.parametrize("precision", ["bf16-true", "64-true"])
def test_a_fit_in_a_true_precision_trains_as_the_plain_twin_and_its_checks_find_nothing(
    tmp_path: Path, precision: str
) -> None:
    trained = {}
    for name in ("plain", "checkpointed"):
        pl.seed_everything(0, verbose=False)
        module = StackModule(block="RampBlock")
        checkpointed = name == "checkpointed"
        monitor = RecomputationMonitor(every_n_steps=1)
        trainer = pl.Trainer(
            **trainer_kwargs(
                tmp_path / name,
                precision=precision,
                max_steps=3,
                callbacks=[monitor] if checkpointed else [],
                strategy=SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=["RampBlock"]))
                if checkpointed
                else "auto",
            )
        )
        trainer.fit(module)
        trained[name] = module.state_dict()
        if checkpointed:
            assert [(entry.step, entry.grad_divergence) for entry in monitor.history] == [(0, 0.0), (1, 0.0), (2, 0.0)]
    assert all(torch.equal(trained["plain"][key], value) for key, value in trained["checkpointed"].items())


def test_blocks_closed_out_of_order_by_two_threads_put_back_the_dtype_the_first_found() -> None:
    # Two threads' recomputations: the first entered closes first, while the second still runs.
    first, second = default_dtype(torch.float64), default_dtype(torch.bfloat16)
    try:
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        assert torch.get_default_dtype() is torch.bfloat16  # the open one keeps its dtype
        second.__exit__(None, None, None)
        assert torch.get_default_dtype() is torch.float32
    finally:
        torch.set_default_dtype(torch.float32)  # for the tests after this one, should it fail
    # Nested in one thread, each puts back what it found.
    with default_dtype(torch.float64):
        with default_dtype(torch.bfloat16):
            assert torch.get_default_dtype() is torch.bfloat16
        assert torch.get_default_dtype() is torch.float64
    assert torch.get_default_dtype() is torch.float32


def test_a_dtype_torch_refuses_leaves_no_block_open() -> None:
    with default_dtype(torch.float64):
        with pytest.raises(TypeError), default_dtype(torch.int64):
            pass
        assert torch.get_default_dtype() is torch.float64
    assert torch.get_default_dtype() is torch.float32
