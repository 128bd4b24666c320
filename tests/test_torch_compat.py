"""The text matches ``_torch_compat`` makes on torch's messages, pinned on the installed torch's real errors."""

import pytest
import torch
from torch.utils.checkpoint import CheckpointError, checkpoint

from lightning_ckpt_determinism._torch_compat import is_metadata_mismatch


def _backward_error(forward_ops: int, recompute_ops: int, *, widen: bool = False) -> CheckpointError:
    """The ``CheckpointError`` torch raises when a checkpointed function recomputes otherwise than its forward ran."""
    calls = []

    def function(x: torch.Tensor) -> torch.Tensor:
        again = bool(calls)
        calls.append(None)
        if again and widen:
            x = torch.cat([x, x])
        for _ in range(recompute_ops if again else forward_ops):
            x = x.sin()
        return x

    x = torch.ones(3, requires_grad=True)
    out = checkpoint(function, x, use_reentrant=False)
    with pytest.raises(CheckpointError) as raised:
        out.sum().backward()
    return raised.value


def test_torchs_metadata_error_is_recognised() -> None:
    error = _backward_error(2, 2, widen=True)
    assert "different metadata" in str(error)
    assert is_metadata_mismatch(error)


def test_torchs_other_checkpoint_error_and_other_errors_are_not() -> None:
    error = _backward_error(3, 1)
    assert "A different number of tensors was saved" in str(error)
    assert not is_metadata_mismatch(error)
    assert not is_metadata_mismatch(RuntimeError("different metadata"))
