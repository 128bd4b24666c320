"""The layers the folders show: ``checkpointing`` and ``verify`` work without Lightning; the root imports the
Lightning layer only when one of its names is used."""

import subprocess
import sys
import textwrap

import pytest

import lightning_ckpt_determinism
from tests.helpers import REPO

WITHOUT_LIGHTNING = textwrap.dedent(
    """
    import sys

    sys.modules["lightning"] = None  # any import of Lightning fails
    sys.modules["lightning.pytorch"] = None
    import numpy as np
    import torch

    from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing, check_recomputation
    from lightning_ckpt_determinism.checkpointing import checkpointed_modules, checkpointing_disabled
    from lightning_ckpt_determinism.verify.live_step import check_live_step
    from lightning_ckpt_determinism.verify.state import StepState


    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.tanh(self.linear(x)) * (1 + torch.from_numpy(np.random.rand(4).astype("float32")))


    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), Noisy(), torch.nn.Linear(4, 1))
    apply_activation_checkpointing(model, CheckpointingConfig(names=["1", "2"]))
    x = torch.randn(3, 4)
    report = check_recomputation(model, lambda: model(x).sum(), attribution=True)
    print("regions", [(region.name, region.cause) for region in report.regions])
    entry = StepState(model)
    model(x).sum().backward()

    def reference():
        with checkpointing_disabled():
            loss = model(x).sum()
        loss.backward()
        return float(loss)

    print("live", check_live_step(model, reference, entry).grad_divergence > 0.0)
    print("checkpointed", list(checkpointed_modules(model)))
    print("lightning loaded", any(name.split(".")[0] == "lightning" and sys.modules[name] for name in sys.modules))
    """
)


def test_checkpointing_and_verify_work_where_lightning_cannot_be_imported() -> None:
    ran = subprocess.run(
        [sys.executable, "-c", WITHOUT_LIGHTNING], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.splitlines() == [
        "regions [('1', None), ('2', 'host_rng')]",
        "live True",
        "checkpointed ['1', '2']",
        "lightning loaded False",
    ]


def test_the_root_gives_the_lightning_layer_on_first_use() -> None:
    from lightning_ckpt_determinism.lightning.monitor import RecomputationMonitor

    assert lightning_ckpt_determinism.RecomputationMonitor is RecomputationMonitor
    assert {"RecomputationMonitor", "SingleDeviceCheckpointingStrategy"} <= set(dir(lightning_ckpt_determinism))
    assert set(lightning_ckpt_determinism.__all__) <= set(dir(lightning_ckpt_determinism))
    with pytest.raises(AttributeError, match=r"has no attribute 'RecomputationMonitr'"):
        lightning_ckpt_determinism.RecomputationMonitr  # noqa: B018
