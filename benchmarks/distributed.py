"""What the monitor's check costs under DDP: a checked step against a training step on two CPU processes (gloo).

Each process runs the benchmark GPT wrapped in ``DistributedDataParallel`` with one thread (two processes share the
machine's cores). A training step is a forward through the DDP wrapper, a backward (the gradients all-reduced in
buckets) and an optimizer step. A checked step is what the monitor does on a check step under DDP: the live step,
then :func:`check_live_step` with one reference pass through the same wrapper, checkpointing off (so its gradients
are all-reduced too, to compare with the live ones), then the optimizer step. To tell where the extra time goes, the
check is also timed in parts: the state captured at the step's start (``StepState``), and the reference pass with
DDP's gradient all-reduce left out (``no_sync``: not a valid check, only a measure of that all-reduce's share).
"""

import contextlib
import json
import socket
import tempfile
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, get_args

import torch
import torch.distributed as dist
from torch.multiprocessing import spawn
from torch.nn.parallel import DistributedDataParallel

from benchmarks.common import (
    ModelSize,
    Regions,
    Variant,
    build_model,
    interleaved_times,
    lm_loss,
    make_batch,
    make_optimizer,
    paired_ratios,
    summary,
    train_step,
)
from lightning_ckpt_determinism import CheckpointingConfig, RecomputationSentinel
from lightning_ckpt_determinism.verify.compiled import reference_pass
from lightning_ckpt_determinism.verify.live_step import check_live_step
from lightning_ckpt_determinism.verify.sentinel import SentinelMode, SentinelStep
from lightning_ckpt_determinism.verify.state import StepState

STEP = "step"
CHECKED = "checked step"
CHECKED_WITHOUT_SYNC = "checked step, reference without all-reduce"
CAPTURE = "state capture"


def run_sentinel(size: ModelSize, rounds: int, warmup: int, world_size: int = 2) -> dict[str, Any]:
    """Time DDP training steps with each sentinel tier against steps without it, interleaved, on ``world_size`` CPU
    processes; as the monitor runs it, each step's comparisons are closed on the device and read (one all-reduce and
    one host read) every ``SENTINEL_READ_EVERY`` steps, and, in ``"light, read every step"``, at every step (what
    ``on_divergence="raise"`` does).

    Args:
        size: The model's shape.
        rounds: Timed rounds.
        warmup: Untimed rounds first.
        world_size: Processes.

    Returns:
        Rank zero's summaries of seconds by variant and the per-round ratios ``"<variant>/off"``.
    """
    return _spawned(partial(_measure_sentinel, size, rounds, warmup), world_size)


SENTINEL_READ_EVERY = 10
"""How many steps the DDP sentinel benchmark reads the counts after (Lightning logs every 50 by default)."""


def run(size: ModelSize, rounds: int, warmup: int, world_size: int = 2) -> dict[str, Any]:
    """Time training steps and checked steps under DDP, interleaved, on ``world_size`` CPU processes.

    Args:
        size: The model's shape.
        rounds: Timed rounds.
        warmup: Untimed rounds first.
        world_size: Processes.

    Returns:
        Rank zero's summaries of seconds by variant, and per-round ratios: ``"check/step"`` (the extra time of a
        checked step over a step, in steps), ``"check without all-reduce/step"`` and ``"capture/step"``; with
        ``"max_grad_divergence"`` over every check (``0.0`` when exact) and ``"world_size"``.
    """
    return _spawned(partial(_measure, size, rounds, warmup), world_size)


def _spawned(measure: Callable[[], dict[str, Any]], world_size: int) -> dict[str, Any]:
    """What ``measure`` (picklable: a module-level function or a partial of one) returns on rank zero, run on
    ``world_size`` spawned processes in one gloo group."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "rank0.json"
        spawn(_in_group, args=(world_size, port, str(out), measure), nprocs=world_size)
        return json.loads(out.read_text())


def _in_group(rank: int, world_size: int, port: int, out: str, measure: Callable[[], dict[str, Any]]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timedelta(minutes=5)
    )
    try:
        result = measure()
        if rank == 0:
            Path(out).write_text(json.dumps({**result, "world_size": world_size}))
    finally:
        dist.destroy_process_group()


def _measure_sentinel(size: ModelSize, rounds: int, warmup: int) -> dict[str, Any]:
    device = torch.device("cpu")
    model = build_model(size, Variant("package", config=CheckpointingConfig(classes=["Block"])), device)
    ddp = DistributedDataParallel(model)
    optimizer = make_optimizer(model)
    inputs, targets = make_batch(size, device)
    step = partial(train_step, ddp, optimizer, inputs, targets)
    tiers: dict[str, SentinelMode] = {
        **{tier: tier for tier in get_args(SentinelMode)},
        "light, read every step": "light",
    }
    sentinels = {name: RecomputationSentinel(model, mode=tier) for name, tier in tiers.items()}
    pending: dict[str, list[SentinelStep]] = {name: [] for name in sentinels}
    regions = Regions(model)

    def watched(name: str) -> None:
        sentinel = sentinels[name]
        with regions.observed_by(sentinel):
            sentinel.next_step()
            step()
            pending[name].append(sentinel.end_step())
        if name.endswith("every step") or len(pending[name]) == SENTINEL_READ_EVERY:
            _read(sentinel, pending[name])
            pending[name] = []

    functions = {"off": step, **{name: partial(watched, name) for name in sentinels}}
    times = interleaved_times({name: _started_together(f) for name, f in functions.items()}, rounds, warmup, device)
    result: dict[str, Any] = {name: summary(samples) for name, samples in times.items()}
    result["ratios"] = {f"{name}/off": summary(paired_ratios(times[name], times["off"])) for name in sentinels}
    result["read_every"] = SENTINEL_READ_EVERY
    return result


def _read(sentinel: RecomputationSentinel, steps: list[SentinelStep]) -> None:
    """What the monitor's read does: every unread step's counts all-reduced and read back once."""
    counts = torch.cat([step.mismatch_counts("cpu") for step in steps] + [torch.zeros(1, dtype=torch.int64)])
    dist.all_reduce(counts)
    for step in steps:
        sentinel.read(step, clean=not any(counts.tolist()))


def _measure(size: ModelSize, rounds: int, warmup: int) -> dict[str, Any]:
    device = torch.device("cpu")
    model = build_model(size, Variant("package", config=CheckpointingConfig(classes=["Block"])), device)
    ddp = DistributedDataParallel(model)
    optimizer = make_optimizer(model)
    inputs, targets = make_batch(size, device)
    divergences: list[float] = []

    def checked(sync: bool) -> None:
        entry = StepState(model)
        lm_loss(ddp, inputs, targets).backward()

        def reference() -> float:
            with reference_pass(), contextlib.nullcontext() if sync else ddp.no_sync():
                loss = lm_loss(ddp, inputs, targets)
                loss.backward()
            return float(loss.detach())

        report = check_live_step(model, reference, entry, all_reduce=_all_reduce)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        assert report is not None
        if sync:
            divergences.append(report.grad_divergence)

    functions = {
        STEP: partial(train_step, ddp, optimizer, inputs, targets),
        CHECKED: partial(checked, True),
        CHECKED_WITHOUT_SYNC: partial(checked, False),
        CAPTURE: partial(StepState, model),
    }
    # The capture is local; the others hold collectives, and start on every rank together.
    timed = {name: function if name == CAPTURE else _started_together(function) for name, function in functions.items()}
    times = interleaved_times(timed, rounds, warmup, device)
    step = times[STEP]
    result: dict[str, Any] = {name: summary(samples) for name, samples in times.items()}
    for key, name in (("check/step", CHECKED), ("check without all-reduce/step", CHECKED_WITHOUT_SYNC)):
        extra = [with_ - without for with_, without in zip(times[name], step, strict=True)]
        result[key] = summary(paired_ratios(extra, step))
    result["capture/step"] = summary(paired_ratios(times[CAPTURE], step))
    result["max_grad_divergence"] = max(divergences)
    return result


def _started_together(function: Any) -> Any:
    """``function`` started on every rank together, so that no rank's time includes waiting for another."""

    def started_together() -> None:
        dist.barrier()
        function()

    return started_together


def _all_reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor
