"""Two-process CPU training with the monitor under DDP, FSDP2 or FSDP1, run by ``tests/test_monitor_distributed.py``.

Usage: ``python tests/distributed_monitor_script.py ddp|fsdp2|fsdp1 OUT_DIR``. Lightning's launcher starts rank 1 by
running this script again; both ranks run every scenario in order. Each run writes ``OUT_DIR/<run>/rank{N}.json`` (the
monitor's history, what it warned or raised) and ``OUT_DIR/<run>/rank{N}.pt`` (this rank's trained parameters,
buffers and optimizer state: shards under FSDP2), and logs through a CSVLogger under ``OUT_DIR/<run>``.
"""

import json
import logging
import sys
import warnings
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckpt_determinism import (
    CheckpointingConfig,
    CheckpointingConfigError,
    DDPCheckpointingStrategy,
    FSDPCheckpointingStrategy,
    LightningCkptDeterminismWarning,
    ModelParallelCheckpointingStrategy,
    RecomputationDivergenceError,
    RecomputationMonitor,
    apply_activation_checkpointing,
)
from lightning_ckpt_determinism.checkpointing.contexts import KEPT_BUFFER_BYTES
from lightning_ckpt_determinism.lightning import monitor as monitor_module
from lightning_ckpt_determinism.lightning.watch import SentinelWatch
from lightning_ckpt_determinism.verify.gradients import local_tensor
from lightning_ckpt_determinism.verify.sentinel import RecomputationSentinel
from lightning_ckpt_determinism.verify.sentinel.calls import RegionCall
from tests.helpers import (
    DIM,
    DropoutBlock,
    ManualModule,
    ShardedStackModule,
    StackModule,
    failing_from,
    manual_loss,
    run_rank,
    trainer_kwargs,
)


class RankOneCounterBlock(torch.nn.Module):
    """Exact on rank 0; on rank 1 reads a count of calls it keeps in a list (which recomputation does not replay), so
    its recomputation differs there only."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(DIM, DIM)
        self.calls: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() != 1:
            return x + torch.tanh(self.linear(x))
        self.calls.append(1)
        scale = float(len(self.calls))
        return x + torch.tanh(self.linear(x) * scale)


class RankOneBufferBlock(torch.nn.Module):
    """Counts its calls in a buffer on rank 1 only: recomputation counts once more there, unless buffers are
    protected; the output does not depend on it, so the gradients stay exact."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(DIM, DIM)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 1:
            self.count += 1
        return x + torch.tanh(self.linear(x))


class RankOneShiftsALargeTable(torch.nn.Module):
    """On rank 1 only, shifts a table over 1 MiB in forward from step 2 on, then reads it: the region copies no table
    that large before it knows a forward changes it, so that call recomputes from the shifted values there."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(DIM, DIM)
        self.register_buffer("table", torch.zeros((KEPT_BUFFER_BYTES // 4 + DIM) // DIM, DIM))
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 1 and self.step >= 2:
            with torch.no_grad():
                self.table.add_(0.5)
        return x + torch.tanh(self.linear(x) + self.table[0])


class RankOneLargeTableModule(StackModule):
    """A stack whose second block is :class:`RankOneShiftsALargeTable`, told the step."""

    def __init__(self, block: str = "PlainBlock") -> None:
        super().__init__(block=block)
        self.model.blocks[1] = RankOneShiftsALargeTable()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.model.blocks[1].step = self.global_step


class SometimesBranchBlock(torch.nn.Module):
    """Uses its branch only on even batches (``odd`` is set by :class:`BranchingModule`): a parameter some steps
    leave unused, which DDP's ``find_unused_parameters=True`` exists for. With ``noisy``, NumPy noise (a defect)."""

    def __init__(self, noisy: bool = False) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(DIM, DIM)
        self.branch = torch.nn.Linear(DIM, DIM)
        self.odd = False
        self.noisy = noisy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.linear(x) if self.odd else self.linear(x) + self.branch(x)
        if self.noisy:
            hidden = hidden * (1 + torch.from_numpy(np.random.standard_normal(hidden.shape).astype(np.float32)))
        return x + torch.tanh(hidden)


class SparseTableBlock(torch.nn.Module):
    """Adds rows of an ``nn.Embedding(sparse=True)``, looked up by ids made from its input and dropped at random: a
    sparse gradient, which DDP all-reduces itself, outside its buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(DIM, DIM)
        self.table = torch.nn.Embedding(16, DIM, sparse=True)
        self.dropout = torch.nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x[:, 0].abs() * 4).long().clamp(max=15)
        return x + torch.tanh(self.linear(x) + self.dropout(self.table(ids)))


class BranchingModule(StackModule):
    """Tells its branching block whether the batch is odd, in ``training_step``."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.model.blocks[1].odd = batch_idx % 2 == 1
        return super().training_step(batch, batch_idx)


class RankOneCheckpointedModule(StackModule):
    """Checkpoints its blocks in ``configure_model`` on rank 1 only: rank 0 has nothing for the monitor to check."""

    def configure_model(self) -> None:
        if dist.get_rank() == 1:
            apply_activation_checkpointing(self, CheckpointingConfig(classes=["DropoutBlock"]))


class UnevenEpochsModule(StackModule):
    """Reads a dataset of its own on each rank: three batches an epoch on rank 0, two on rank 1 (Lightning's
    distributed sampler off), so that the ranks' epochs end at different steps."""

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(2 + dist.get_rank())
        x = torch.randn(8 * (3 - dist.get_rank()), DIM, generator=generator)
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)


class RankZeroAsksToStopModule(StackModule):
    """Sets ``trainer.should_stop`` on rank 0 alone at its second batch (a stop decided from its own loss); under
    ``min_steps`` Lightning trains on, both ranks in step."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if batch_idx == 1 and dist.get_rank() == 0:
            self.trainer.should_stop = True
        return super().training_step(batch, batch_idx)


_TRAINING_STEPS = [0]


class RankOneSkipsItsRerunModule(StackModule):
    """Returns None from every second ``training_step`` on rank 1 (after its forward, as a step that skips a loss it
    finds bad does), counted in a global the check does not put back: the check's rerun of the step is skipped there,
    not on rank 0."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        _TRAINING_STEPS[0] += 1
        loss = super().training_step(batch, batch_idx)
        return None if dist.get_rank() == 1 and _TRAINING_STEPS[0] % 2 == 0 else loss


class ShardedRankOneSkipsItsRerunModule(RankOneSkipsItsRerunModule, ShardedStackModule):
    """:class:`RankOneSkipsItsRerunModule` sharded with FSDP2."""


class PowerSGDModule(StackModule):
    """Registers PowerSGD as DDP's communication hook (as Lightning's ``ddp_comm_hook`` does on CUDA): a hook whose
    state (error feedback, iteration count, warm-start factors) advances at every backward through DDP."""

    def on_train_start(self) -> None:
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2, warm_start=True, random_seed=0
        )
        self.trainer.strategy.model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def _fsdp1_on_the_cpu() -> None:
    """Let Lightning's ``FSDPStrategy`` run on CPU processes: it passes ``device_id=None`` there, which torch's FSDP1
    refuses without an accelerator; given the CPU device, FSDP1 shards and reduces over gloo as it does over NCCL.
    ``FSDPCheckpointingStrategy``'s refusal of a CPU device, which tells users so, is lifted with it."""
    wrap = FullyShardedDataParallel.__init__
    FSDPCheckpointingStrategy.setup_environment = FSDPStrategy.setup_environment  # type: ignore[method-assign]

    def on_the_cpu(self: FullyShardedDataParallel, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("device_id") is None:
            kwargs["device_id"] = torch.device("cpu")
        wrap(self, module, *args, **kwargs)

    FullyShardedDataParallel.__init__ = on_the_cpu  # type: ignore[method-assign]


def _strategy(kind: str, checkpointing: CheckpointingConfig | None, **ddp_options: Any) -> Any:
    if kind == "fsdp1":
        options = {"process_group_backend": "gloo", **ddp_options}
        if checkpointing is None:
            return FSDPStrategy(**options)
        return FSDPCheckpointingStrategy(checkpointing=checkpointing, **options)
    if kind == "ddp":
        if checkpointing is None:
            return DDPStrategy(process_group_backend="gloo", **ddp_options)
        return DDPCheckpointingStrategy(checkpointing=checkpointing, process_group_backend="gloo", **ddp_options)
    sizes = {"data_parallel_size": 2, "tensor_parallel_size": 1, "process_group_backend": "gloo"}
    if checkpointing is None:
        return ModelParallelStrategy(**sizes)
    return ModelParallelCheckpointingStrategy(checkpointing=checkpointing, **sizes)


def _local(state: dict[str, Any]) -> dict[str, Any]:
    """A state dict with every tensor (and nested one) as this rank's local, detached copy."""
    result: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            result[key] = local_tensor(value).detach().clone()
        elif isinstance(value, dict):
            result[key] = _local(value)
        else:
            result[key] = value
    return result


class _Summaries(logging.Handler):
    """The monitor's summary lines of a fit (logged on rank zero alone)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "RecomputationMonitor ran" in record.getMessage():
            self.messages.append(record.getMessage())


def _run(
    kind: str,
    out_dir: Path,
    name: str,
    block: str,
    monitor: RecomputationMonitor | None,
    checkpointing: dict[str, Any] | None,
    setup: dict[str, Any],
    replace_block: Callable[[], torch.nn.Module] | None = None,
    module_class: type[StackModule] | None = None,
    ddp_options: dict[str, Any] | None = None,
) -> None:
    pl.seed_everything(0, verbose=False)
    np.random.seed(0)
    module = (module_class or (ShardedStackModule if kind == "fsdp2" else StackModule))(block=block)
    if replace_block is not None:
        module.model.blocks[1] = replace_block()
    config = None if checkpointing is None else CheckpointingConfig(**checkpointing)
    run_dir = out_dir / name
    callbacks = [monitor] if monitor is not None else []
    kwargs = trainer_kwargs(
        run_dir, devices=2, callbacks=callbacks, logger=CSVLogger(run_dir), **{"log_every_n_steps": 1, **setup}
    )
    trainer = pl.Trainer(**{**kwargs, "strategy": _strategy(kind, config, **(ddp_options or {}))})
    error = None
    summaries = _Summaries()
    lightning_logger = logging.getLogger("lightning.pytorch")
    level = lightning_logger.level
    lightning_logger.addHandler(summaries)
    lightning_logger.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", LightningCkptDeterminismWarning)
            try:
                trainer.fit(module)
            except (RecomputationDivergenceError, CheckpointingConfigError) as err:
                error = str(err)
    finally:
        lightning_logger.removeHandler(summaries)
        lightning_logger.setLevel(level)
    rank = trainer.global_rank
    result = {
        "global_step": trainer.global_step,
        "history": [asdict(record) for record in monitor.history] if monitor is not None else [],
        "warnings": [str(w.message) for w in caught if issubclass(w.category, LightningCkptDeterminismWarning)],
        "error": error,
        "sharded": any(local_tensor(param) is not param for param in module.parameters()),
        "compared": monitor.sentinel_report.compared if monitor and monitor.sentinel_report else None,
        "summaries": summaries.messages,
        "regions": [
            [region.name, region.cause]
            for region in (monitor.last_report.regions if monitor and monitor.last_report else [])
        ],
    }
    (run_dir / f"rank{rank}.json").write_text(json.dumps(result))
    optimizer = trainer.optimizers[0].state_dict()["state"] if trainer.optimizers else {}
    torch.save(
        {"module": _local(module.state_dict()), "optimizer": _local({str(k): v for k, v in optimizer.items()})},
        run_dir / f"rank{rank}.pt",
    )


def _fp16() -> dict[str, Any]:
    return {"plugins": [MixedPrecision("16-mixed", "cpu")]}


def main(kind: str, out_dir: Path) -> None:
    def every_step(**kwargs: Any) -> RecomputationMonitor:
        return RecomputationMonitor(every_n_steps=1, **kwargs)

    ignore = {"on_divergence": "ignore"}
    run = _run
    if kind == "fsdp1":
        _fsdp1_on_the_cpu()
        _fsdp1_scenarios(out_dir, every_step, ignore)
        return
    run(kind, out_dir, "clean_dropout", "DropoutBlock", every_step(), {"classes": ["DropoutBlock"]}, {})
    run(kind, out_dir, "clean_batchnorm", "BatchNormBlock", every_step(), {"classes": ["BatchNormBlock"]}, {})
    run(
        kind,
        out_dir,
        "clean_bf16",
        "DropoutBlock",
        every_step(),
        {"classes": ["DropoutBlock"]},
        {"precision": "bf16-mixed"},
    )
    dropout_without_rng = {"classes": ["DropoutBlock"], "preserve_rng_state": False}
    run(kind, out_dir, "rng_not_preserved", "DropoutBlock", every_step(**ignore), dropout_without_rng, {})
    run(kind, out_dir, "numpy_noise", "NumpyNoiseBlock", every_step(**ignore), {"classes": ["NumpyNoiseBlock"]}, {})
    run(kind, out_dir, "numpy_last", "NumpyLastBlock", every_step(**ignore), {"classes": ["NumpyLastBlock"]}, {})
    # A buffer updated again by recomputation on rank 1 only: the decision is reduced, so both ranks record it.
    unprotected = {"classes": ["PlainBlock", "RankOneBufferBlock"], "protect_buffers": False}
    monitor = RecomputationMonitor(every_n_steps=2, sentinel="off")
    run(kind, out_dir, "buffer_rank_one", "PlainBlock", monitor, unprotected, {}, RankOneBufferBlock)
    monitor = RecomputationMonitor(every_n_steps=2, sentinel="off", attribution="never")
    run(kind, out_dir, "buffer_rank_one_live", "PlainBlock", monitor, unprotected, {}, RankOneBufferBlock)
    # The check's rerun of `training_step` skipped on rank 1 alone, by the live check and by the two-pass check:
    # skipped on both ranks before its backward.
    for attribution in ("on_divergence", "always"):
        monitor = every_step(sentinel="off", attribution=attribution, **ignore)
        skips = ShardedRankOneSkipsItsRerunModule if kind == "fsdp2" else RankOneSkipsItsRerunModule
        options = {"module_class": skips}
        name = f"rerun_skipped_on_rank_one_{attribution}"
        run(kind, out_dir, name, "DropoutBlock", monitor, {"classes": ["DropoutBlock"]}, {}, **options)  # type: ignore[arg-type]
    # Bit-identical training: checked every step, checkpointed without the monitor, and neither.
    setups = {"accumulate_2_clipping": lambda: {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}}
    if kind == "ddp":
        setups.update({"bf16_mixed": lambda: {"precision": "bf16-mixed"}, "fp16_grad_scaler": _fp16})
    for setup_name, setup in setups.items():
        checkpointing = {"classes": ["DropoutBlock"]}
        run(kind, out_dir, f"{setup_name}_monitored", "DropoutBlock", every_step(), checkpointing, setup())
        run(kind, out_dir, f"{setup_name}_checkpointed", "DropoutBlock", None, checkpointing, setup())
        run(kind, out_dir, f"{setup_name}_plain", "DropoutBlock", None, None, setup())
    if kind == "ddp":
        # DDP writes every gradient into its buckets: the live gradients are set aside as copies.
        bucket_views = {"gradient_as_bucket_view": True}
        checkpointing = {"classes": ["DropoutBlock"]}
        setup = {"accumulate_grad_batches": 2}
        run(
            kind,
            out_dir,
            "bucket_view_monitored",
            "DropoutBlock",
            every_step(),
            checkpointing,
            setup,
            ddp_options=bucket_views,
        )
        run(kind, out_dir, "bucket_view_plain", "DropoutBlock", None, None, setup, ddp_options=bucket_views)
        # Manual optimization: the reference of the first `manual_backward` goes through DDP's all-reduce too.
        monitor = every_step(loss_fn=manual_loss)
        run(
            kind,
            out_dir,
            "manual_monitored",
            "DropoutBlock",
            monitor,
            {"classes": ["DropoutBlock"]},
            {},
            module_class=ManualModule,
        )
        run(kind, out_dir, "manual_plain", "DropoutBlock", None, None, {}, module_class=ManualModule)
        # A sentinel finding on rank 1 alone whose follow-up check finds the step exact: rank 0 names rank 1's buffer.
        monitor = RecomputationMonitor(every_n_steps=100, sentinel="exact")
        tables = {"names": ["model.blocks.*"]}
        run(kind, out_dir, "table_rank_one", "PlainBlock", monitor, tables, {}, module_class=RankOneLargeTableModule)
        checkpointing = {"classes": ["PlainBlock", "RankOneCounterBlock"]}
        for mode in ("warn", "raise"):
            monitor = RecomputationMonitor(every_n_steps=2, on_divergence=mode, sentinel="off")  # type: ignore[arg-type]
            run(kind, out_dir, f"rank_one_{mode}", "PlainBlock", monitor, checkpointing, {}, RankOneCounterBlock)
        # A branch used on some steps only, under `find_unused_parameters=True`: the two-pass check (attribution
        # "always", and the follow-up of any finding) must leave DDP's reducer as it found it.
        unused = {"find_unused_parameters": True}
        branching = {"classes": ["PlainBlock", "SometimesBranchBlock"]}
        for name, noisy in (("unused_always_clean", False), ("unused_always_defect", True)):
            monitor = every_step(attribution="always", **ignore)
            branch = partial(SometimesBranchBlock, noisy=noisy)
            options = {"module_class": BranchingModule, "ddp_options": unused}
            run(kind, out_dir, name, "PlainBlock", monitor, branching, {}, branch, **options)  # type: ignore[arg-type]
        dropout = {"classes": ["DropoutBlock"]}
        # `reference_regions="auto"` where the ranks have room for different numbers of regions (on CUDA their free
        # memory differs; here rank 0 has room for one region, rank 1 for all): regions holding a collective run
        # plainly on every rank alike.
        real_free_memory = monitor_module.free_memory
        monitor_module.free_memory = lambda device: 1 if dist.get_rank() == 0 else 1 << 40
        try:
            sync = {"classes": ["SyncNormBlock"]}
            run(kind, out_dir, "auto_reference_monitored", "SyncNormBlock", every_step(), sync, {})
        finally:
            monitor_module.free_memory = real_free_memory
        run(kind, out_dir, "auto_reference_plain", "SyncNormBlock", None, None, {})
        # A stateful communication hook: the check's reference starts from the hook's state at the step's start,
        # and the state the live step left is put back.
        options = {"module_class": PowerSGDModule}
        run(kind, out_dir, "powersgd_monitored", "PlainBlock", every_step(), {"classes": ["PlainBlock"]}, {}, **options)  # type: ignore[arg-type]
        run(kind, out_dir, "powersgd_plain", "PlainBlock", None, None, {}, **options)  # type: ignore[arg-type]
        # A stop asked on rank 0 alone, which Lightning logs at: the sentinel is read at the logging interval alone,
        # on both ranks alike.
        options = {"module_class": RankZeroAsksToStopModule}
        setup = {"log_every_n_steps": 50, "min_steps": 4}
        monitor = RecomputationMonitor(every_n_steps=50)
        run(kind, out_dir, "stop_on_rank_zero", "DropoutBlock", monitor, dropout, setup, **options)  # type: ignore[arg-type]
        # Epochs of different lengths on the two ranks (each reads its own data): the sentinel is read at steps
        # every rank reads it at, not at one rank's epoch end.
        uneven = {"use_distributed_sampler": False, "log_every_n_steps": 50}
        options = {"module_class": UnevenEpochsModule}
        monitor = RecomputationMonitor(every_n_steps=50)
        run(kind, out_dir, "uneven_epochs_monitored", "DropoutBlock", monitor, dropout, uneven, **options)  # type: ignore[arg-type]
        run(kind, out_dir, "uneven_epochs_plain", "DropoutBlock", None, None, uneven, **options)  # type: ignore[arg-type]
        # A sparse gradient (SGD's momentum buffer sparse too), checked every step: bit-identical training.
        sparse = {"classes": ["PlainBlock", "SparseTableBlock"]}
        run(kind, out_dir, "sparse_monitored", "PlainBlock", every_step(), sparse, {}, SparseTableBlock)
        run(kind, out_dir, "sparse_checkpointed", "PlainBlock", None, sparse, {}, SparseTableBlock)
        run(kind, out_dir, "sparse_plain", "PlainBlock", None, None, {}, SparseTableBlock)
        # Nothing checkpointed on rank 0 only: every rank stops at fit start, none waits for the others.
        monitor = every_step()
        options = {"module_class": RankOneCheckpointedModule}
        run(kind, out_dir, "nothing_on_rank_zero", "DropoutBlock", monitor, None, {}, **options)  # type: ignore[arg-type]
        # The sentinel on every step, the defect on rank 1 only: seen at step 0 and named with its rank on rank 0.
        monitor = RecomputationMonitor(every_n_steps=50)
        run(kind, out_dir, "sentinel_rank_one", "PlainBlock", monitor, checkpointing, {}, RankOneCounterBlock)
        # The same, the sentinel watching every other step: both ranks watch and read the same steps.
        monitor = RecomputationMonitor(every_n_steps=50, sentinel_every_n_steps=2)
        run(kind, out_dir, "sentinel_every_other", "PlainBlock", monitor, checkpointing, {}, RankOneCounterBlock)
        # The same under the two-pass check, which compares each rank's own gradients: whether step 0's check named
        # the cause, and so whether the sentinel's finding asks for a check of step 1, is decided alike on both ranks.
        monitor = RecomputationMonitor(every_n_steps=2, attribution="always")
        run(kind, out_dir, "sentinel_rank_one_two_pass", "PlainBlock", monitor, checkpointing, {}, RankOneCounterBlock)
        # The sentinel failing to read a clean record on rank 1 only: the failure joins the next read's reduced
        # flag (no record is added on rank 1 alone, which would change the length every rank reduces).
        real_read = RecomputationSentinel.read
        RecomputationSentinel.read = failing_from(  # type: ignore[method-assign]
            1, real_read, when=lambda: dist.get_rank() == 1
        )
        try:
            dropout = {"classes": ["DropoutBlock"]}
            run(kind, out_dir, "sentinel_read_fails_on_rank_one", "DropoutBlock", RecomputationMonitor(), dropout, {})
        finally:
            RecomputationSentinel.read = real_read  # type: ignore[method-assign]
        # The sentinel's own code failing on rank 1 only, at its second region forward, as its second step starts, or
        # turning its second step's counts into metrics: both ranks stop it alike.
        for name, owner, method in (
            ("sentinel_fails_on_rank_one", RegionCall, "forward_done"),
            ("sentinel_fails_starting_a_step_on_rank_one", RecomputationSentinel, "next_step"),
            ("sentinel_metrics_fail_on_rank_one", SentinelWatch, "metrics"),
        ):
            real = getattr(owner, method)
            setattr(owner, method, failing_from(2, real, when=lambda: dist.get_rank() == 1))
            try:
                run(kind, out_dir, name, "DropoutBlock", every_step(), {"classes": ["DropoutBlock"]}, {})
            finally:
                setattr(owner, method, real)


def _fsdp1_scenarios(out_dir: Path, every_step: Callable[..., RecomputationMonitor], ignore: dict[str, Any]) -> None:
    """FSDP1 sharding over both ranks, with the original parameters kept (Lightning's default) and without: checks at
    zero when clean, the defect found and named, and training bit-identical to a fit without the monitor, accumulating
    (without reducing at the first batch: Lightning runs it under FSDP1's ``no_sync``; it clips no gradient there)."""
    dropout = {"classes": ["DropoutBlock"]}
    for orig in (True, False):
        prefix = "orig" if orig else "flat"
        options = {"ddp_options": {"use_orig_params": orig}}
        run = partial(_run, "fsdp1", out_dir, block="DropoutBlock", **options)
        run(name=f"{prefix}_clean", monitor=every_step(), checkpointing=dropout, setup={})
        without_rng = {**dropout, "preserve_rng_state": False}
        run(name=f"{prefix}_rng_not_preserved", monitor=every_step(**ignore), checkpointing=without_rng, setup={})
    # Each block an FSDP1 unit of its own (`auto_wrap_policy`), one selected by name: named as users write it.
    options = {"ddp_options": {"auto_wrap_policy": {DropoutBlock}}}
    run = partial(_run, "fsdp1", out_dir, block="DropoutBlock", setup={}, **options)
    run(name="units_clean", monitor=every_step(), checkpointing=dropout)
    one_without_rng = {"names": ["model.blocks.1"], "preserve_rng_state": False}
    run(name="units_rng_not_preserved", monitor=every_step(**ignore), checkpointing=one_without_rng)
    accumulating = {"accumulate_grad_batches": 2}
    run = partial(_run, "fsdp1", out_dir, block="DropoutBlock", setup=accumulating)
    run(name="accumulate_2_monitored", monitor=every_step(), checkpointing=dropout)
    # Every check the two-pass one, its passes through FSDP1's root wrapper.
    run(name="accumulate_2_always", monitor=every_step(attribution="always"), checkpointing=dropout)
    run(name="accumulate_2_checkpointed", monitor=None, checkpointing=dropout)


if __name__ == "__main__":
    run_rank(main, sys.argv[1], Path(sys.argv[2]))
