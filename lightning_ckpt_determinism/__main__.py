"""``python -m lightning_ckpt_determinism audit --config CONFIG.yaml``: see :mod:`lightning_ckpt_determinism.audit`."""

import sys

from lightning_ckpt_determinism.audit import main

sys.exit(main())
