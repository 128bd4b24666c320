"""What ``keep_data_dependent`` costs on the mixture-of-experts example: memory held for backward and step time.

Run from the repository root::

    python benchmarks/moe.py                 # 4 blocks, dim 128, 8 experts, top-2, 1024 tokens
    python benchmarks/moe.py --size tiny     # in seconds

Variants: no checkpointing, every block checkpointed with ``keep_data_dependent: false`` (the routing recomputed)
and with ``true`` (the default: the routing kept from the forward). Memory is ``held (live)`` as in
``benchmarks/memory.py``: the bytes of every storage an op created in the forward that is still alive when only the
loss is kept, parameters excluded; the routing outputs are the bytes of every data-dependent op's outputs in one
forward. Step times are interleaved rounds, ratios medians of per-round ratios, as in ``benchmarks/run.py``.
"""

import argparse
import json
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.nn import functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import interleaved_times, paired_ratios, summary
from benchmarks.memory import _LiveStorages, python_tensor_storages
from examples.moe import MoEModule
from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing
from lightning_ckpt_determinism.checkpointing.routing import is_data_dependent

NONE = "none"
RECOMPUTED = "checkpointed, keep_data_dependent: false"
KEPT = "checkpointed, keep_data_dependent: true"
KEEP = {NONE: None, RECOMPUTED: False, KEPT: True}

SIZES: dict[str, dict[str, int]] = {
    "default": {"blocks": 4, "dim": 128, "experts": 8, "top_k": 2, "hidden": 512, "tokens": 1024, "rounds": 30},
    "tiny": {"blocks": 2, "dim": 16, "experts": 4, "top_k": 2, "hidden": 32, "tokens": 64, "rounds": 3},
}


def build(size: dict[str, int], keep: bool | None) -> MoEModule:
    """The seeded MoE example at ``size``, its blocks checkpointed with ``keep_data_dependent=keep`` (``None``: not)."""
    torch.manual_seed(0)
    shape = {key: size[key] for key in ("blocks", "dim", "experts", "top_k", "hidden")}
    model = MoEModule(**shape)
    if keep is not None:
        apply_activation_checkpointing(model, CheckpointingConfig(classes=["MoEBlock"], keep_data_dependent=keep))
    return model


def run(size: dict[str, int]) -> dict[str, Any]:
    """Memory held for backward and step time of each variant, and the bytes of the routing outputs.

    Args:
        size: An entry of :data:`SIZES`.

    Returns:
        ``{"held_bytes": {variant: bytes}, "routing_bytes", "variants": {variant: summary of seconds},
        "ratios": {"a/b": summary}}``.
    """
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(size["tokens"], size["dim"], generator=generator)
    y = torch.randn(size["tokens"], 1, generator=generator)
    held = {name: _held_bytes(build(size, keep), x, y) for name, keep in KEEP.items()}
    with _RoutingBytes() as routing:
        build(size, None)(x)
    steps = {}
    for name, keep in KEEP.items():
        model = build(size, keep)
        steps[name] = partial(_train_step, model, torch.optim.AdamW(model.parameters(), lr=1e-3), x, y)
    times = interleaved_times(steps, size["rounds"], 3, torch.device("cpu"))
    pairs = [(RECOMPUTED, NONE), (KEPT, NONE), (KEPT, RECOMPUTED)]
    return {
        "size": size,
        "held_bytes": held,
        "routing_bytes": routing.bytes,
        "variants": {name: summary(samples) for name, samples in times.items()},
        "ratios": {f"{a}/{b}": summary(paired_ratios(times[a], times[b])) for a, b in pairs},
    }


def _held_bytes(model: MoEModule, x: torch.Tensor, y: torch.Tensor) -> int:
    """The bytes a forward leaves held for backward: storages its ops created that are still alive, and those Python
    holds that were not there before (the routing guard copies what it keeps below every dispatch mode)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    before = python_tensor_storages(parameters)
    with _LiveStorages(parameters) as live:
        loss = F.mse_loss(model(x), y)
    new = {key: nbytes for key, nbytes in python_tensor_storages(parameters).items() if key not in before}
    held = live.held_bytes(also=new)
    del loss
    return held


def _train_step(model: MoEModule, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    F.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class _RoutingBytes(TorchDispatchMode):
    """Sums the bytes of the tensor outputs of every data-dependent op."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if is_data_dependent(func, args):
            self.bytes += sum(
                leaf.numel() * leaf.element_size() for leaf in pytree.tree_leaves(out) if isinstance(leaf, torch.Tensor)
            )
        return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the MoE benchmark, print it, and write JSON if asked.

    Args:
        argv: Command-line arguments without the program name; ``None`` reads ``sys.argv``.

    Returns:
        ``0``.
    """
    parser = argparse.ArgumentParser(prog="python benchmarks/moe.py", description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="default", help="model and batch size")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    args = parser.parse_args(argv)
    size = SIZES[args.size]
    result = run(size)
    shape = ", ".join(f"{key} {value}" for key, value in size.items())
    print(f"MoE example ({shape}), CPU, torch {torch.__version__}")
    for name, held in result["held_bytes"].items():
        print(f"  held for backward, {name:<42}{held / 1024:>10.1f} KiB")
    print(f"  routing outputs (data-dependent ops) of one forward{result['routing_bytes'] / 1024:>20.1f} KiB")
    for name, stats in result["variants"].items():
        print(f"  step, {name:<56}{stats['median'] * 1e3:>8.1f} ms")
    for name, stats in result["ratios"].items():
        print(f"  {name:<62}{stats['median']:>8.3f}  (IQR {stats['q1']:.3f}-{stats['q3']:.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
