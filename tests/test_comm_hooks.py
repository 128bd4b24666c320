"""`CommHookStates` (`lightning/comm_hooks.py`): a DDP communication hook's data restarts from the step's start for
each reference pass, and the state holds its live objects again after the check (the two-process PowerSGD run in
`tests/test_monitor_distributed.py` holds it against a plain twin)."""

from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from lightning_ckpt_determinism.lightning.comm_hooks import CommHookStates
from tests.helpers import one_process_group


class HookState:
    """A hook's state: data it advances (a count, error feedback, an RNG, a log a logger also reads) and objects it
    only refers to (the module, a process group)."""

    def __init__(self, module: nn.Module) -> None:
        self.iteration = 0
        self.error = {0: torch.zeros(2)}
        self.rng = np.random.RandomState(0)
        self.log: list[int] = []
        self.module = module
        self.group = torch.distributed.group.WORLD


def test_the_reference_restarts_from_the_steps_start_and_the_state_keeps_its_live_objects(tmp_path: Path) -> None:
    with one_process_group(tmp_path):
        model = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
        state = HookState(model.module)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        at_start = CommHookStates(model)
        # The live step advances the state.
        state.iteration, state.log = 3, [3]
        state.error[0].add_(1.0)
        drawn = state.rng.rand()
        live = dict(vars(state))
        with at_start.replaying() as start_over:
            for _ in range(2):  # each reference pass (two with `calibrate_noise`)
                start_over()
                assert (state.iteration, state.log) == (0, [])
                assert torch.equal(state.error[0], torch.zeros(2)) and state.rng.rand() == drawn
                assert state.module is model.module and state.group is torch.distributed.group.WORLD
                state.iteration += 1
                state.error[0].add_(5.0)
        assert all(getattr(state, name) is value for name, value in live.items())
        assert (state.iteration, state.log) == (3, [3]) and torch.equal(state.error[0], torch.ones(2))


def test_a_module_without_hooks_has_nothing_to_replay() -> None:
    with CommHookStates(nn.Linear(2, 2)).replaying() as start_over:
        start_over()
