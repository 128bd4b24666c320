"""Importing the package root changes nothing outside it: torch's determinism-check registry, Lightning's strategy
registry, every logger's handlers and filters, the warning filters and the profile and trace functions are what they
were before, in a fresh process. (Importing ``lightning_ckpt_determinism.lightning`` registers the strategies'
names, by design: tests/test_registry.py.)"""

import subprocess
import sys

from tests.helpers import REPO

# The libraries the package imports are imported first: what they do to the process on import is their own.
SCRIPT = """
import logging, sys, warnings
import jsonargparse, numpy, torch, torch.utils.checkpoint
from lightning.pytorch.strategies import StrategyRegistry


def loggers():
    found = {"": logging.getLogger()}
    made = logging.Logger.manager.loggerDict.items()
    found.update((name, log) for name, log in made if isinstance(log, logging.Logger))
    return found


def snapshot():
    return {
        "determinism checks": dict(torch.utils.checkpoint._allowed_determinism_checks_to_fns),
        "strategies": sorted(StrategyRegistry),
        "loggers": {
            name: (list(log.handlers), list(log.filters), log.level, log.propagate, log.disabled)
            for name, log in loggers().items()
        },
        "warning filters": list(warnings.filters),
        "profile": sys.getprofile(),
        "trace": sys.gettrace(),
    }


before = snapshot()
import lightning_ckpt_determinism

after = snapshot()
assert lightning_ckpt_determinism.__file__.startswith(sys.argv[1]), lightning_ckpt_determinism.__file__
# A logger the import created starts as logging makes it: no handler, no filter, level unset, propagating.
fresh = ([], [], logging.NOTSET, True, False)
after_loggers = after.pop("loggers")
changed = [name for name, state in after_loggers.items() if before["loggers"].get(name, fresh) != state]
changed += [key for key, value in after.items() if before[key] != value]
print(changed, len(after_loggers) > len(before["loggers"]))
"""


def test_importing_the_package_changes_nothing_in_torch_lightning_logging_or_warnings() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(REPO)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # Nothing changed, and the import did create loggers of its own (the comparison saw them).
    assert done.stdout.strip() == "[] True"
