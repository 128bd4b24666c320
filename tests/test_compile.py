"""Checkpointing and the recomputation check under ``torch.compile``.

Compiling costs seconds per graph, so the models are tiny and every test uses ``aot_eager`` except the two that need
inductor (its float noise, and the memory-budget bug of its partitioner).
"""

import csv
import json
import logging
import re
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch._dynamo
from lightning.pytorch.loggers import CSVLogger
from packaging.version import Version
from torch import fx, nn
from torch._dynamo.backends.debugging import aot_eager, boxed_nop
from torch._dynamo.utils import counters
from torch.nn import functional as F

from examples.compiled import redraw_recomputed_random_ops, redrawing_aot_eager
from lightning_ckpt_determinism import (
    CAUSE_HINTS,
    CheckpointingConfig,
    LightningCkptDeterminismWarning,
    RecomputationMonitor,
    SingleDeviceCheckpointingStrategy,
    apply_activation_checkpointing,
    check_recomputation,
    checkpoint_module,
    checkpointed_modules,
    checkpointing_disabled,
)
from lightning_ckpt_determinism.audit import main
from lightning_ckpt_determinism.checkpointing import select_modules
from lightning_ckpt_determinism.checkpointing.wrapper import _SWITCH
from lightning_ckpt_determinism.verify.compiled import is_compiled, reference_pass
from lightning_ckpt_determinism.verify.compiled.graph_scan import scanned
from tests.helpers import (
    DIM,
    BatchNormBlock,
    DropoutBlock,
    PartsBlock,
    PlainBlock,
    Stack,
    StackModule,
    batch,
    child_env,
    launch_ranks,
    make_stack,
    step_gradients,
    trainer_kwargs,
)

REPO = Path(__file__).resolve().parents[1]
DDP_SCRIPT = REPO / "tests" / "ddp_compile_script.py"


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    """Each test compiles from scratch and counts its own graphs."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def mixed_stack(checkpointed: bool) -> Stack:
    """Three blocks, checkpointed three ways: the default config, ``save_ops`` on the matmul, and a BatchNorm block
    (buffer protection applies to it eagerly)."""
    torch.manual_seed(0)
    model = Stack([DropoutBlock(), DropoutBlock(), BatchNormBlock()])
    if checkpointed:
        apply_activation_checkpointing(model, CheckpointingConfig(names=["blocks.0"]))
        apply_activation_checkpointing(model, CheckpointingConfig(names=["blocks.1"], save_ops=["aten.addmm"]))
        apply_activation_checkpointing(model, CheckpointingConfig(classes=["BatchNormBlock"]))
    return model


def compiled_step(model: nn.Module, backend: Any, **options: Any) -> tuple[dict[str, torch.Tensor], dict]:
    """Gradients and the state after one compiled training step."""
    grads = step_gradients(torch.compile(model, backend=backend, **options))
    return grads, {name: value.clone() for name, value in model.state_dict().items()}


class BackwardGraphs:
    """The ``aot_eager`` backend, keeping the backward graphs it compiles and rewriting them first if asked."""

    def __init__(self, rewrite: Callable[[fx.GraphModule], None] | None = None) -> None:
        self.graphs: list[fx.GraphModule] = []
        self._rewrite = rewrite
        self.backend = partial(aot_eager, bw_compiler=self._backward)

    def _backward(self, graph: fx.GraphModule, inputs: list[torch.Tensor]) -> Callable[..., Any]:
        if self._rewrite is not None:
            self._rewrite(graph)
        self.graphs.append(graph)
        return boxed_nop(graph, inputs)

    def count(self, op: Any) -> int:
        return sum(node.target is op for graph in self.graphs for node in graph.graph.nodes)


def test_a_compiled_model_checkpoints_in_one_graph_with_the_same_gradients(
    caplog: pytest.LogCaptureFixture,
) -> None:
    plain_grads, plain_state = compiled_step(mixed_stack(checkpointed=False), "aot_eager")
    counters.clear()
    recorded = BackwardGraphs()
    with caplog.at_level(logging.INFO, logger="lightning_ckpt_determinism"):
        grads, state = compiled_step(mixed_stack(checkpointed=True), recorded.backend, fullgraph=True)
    assert all(torch.equal(grads[name], plain_grads[name]) for name in plain_grads)
    # BatchNorm's running statistics were updated once, as without checkpointing.
    assert all(torch.equal(state[name], plain_state[name]) for name in plain_state)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
    # Recomputed in backward: the matmuls of blocks.0 and of the BatchNorm block; blocks.1 saved its own.
    assert recorded.count(torch.ops.aten.addmm.default) == 2
    noted = [record.getMessage() for record in caplog.records if "not applied to compiled" in record.getMessage()]
    assert len(noted) == 1
    assert noted[0].startswith("lightning_ckpt_determinism: `protect_buffers` not applied")
    assert "(classes ['BatchNormBlock'])" in noted[0]


def test_inductor_gradients_match_within_float_noise() -> None:
    plain_grads, plain_state = compiled_step(mixed_stack(checkpointed=False), "inductor")
    grads, state = compiled_step(mixed_stack(checkpointed=True), "inductor")
    for name, expected in plain_grads.items():
        torch.testing.assert_close(grads[name], expected, rtol=1e-5, atol=1e-7)
    assert all(torch.equal(state[name], plain_state[name]) for name in plain_state)


@pytest.mark.parametrize("compile_first", [True, False], ids=["compiled-then-wrapped", "wrapped-then-compiled"])
def test_per_block_compile_gives_eager_checkpointing_gradients(compile_first: bool) -> None:
    config = CheckpointingConfig(classes=["DropoutBlock"])
    eager = make_stack(DropoutBlock)
    apply_activation_checkpointing(eager, config)
    model = make_stack(DropoutBlock)
    if not compile_first:
        apply_activation_checkpointing(model, config)
    for block in model.blocks:
        block.compile(backend="aot_eager")
    if compile_first:
        apply_activation_checkpointing(model, config)
    expected, grads = step_gradients(eager), step_gradients(model)
    assert all(torch.equal(grads[name], expected[name]) for name in expected)
    assert counters["stats"]["unique_graphs"] >= 1
    assert not counters["graph_break"]


class CountingBackend:
    """``aot_eager``, counting the graphs it compiles and the calls of the compiled code."""

    def __init__(self) -> None:
        self.graphs = 0
        self.calls = 0

    def __call__(self, graph: fx.GraphModule, inputs: list[torch.Tensor]) -> Callable[..., Any]:
        self.graphs += 1
        compiled = aot_eager(graph, inputs)

        def counted(*args: Any) -> Any:
            self.calls += 1
            return compiled(*args)

        return counted


def hand_checkpointed(block: nn.Module) -> None:
    """Checkpoint ``block`` by hand, as torchtitan's blocks are: ``checkpoint`` around its own forward."""
    forward = block.forward
    block.forward = lambda x: torch.utils.checkpoint.checkpoint(forward, x, use_reentrant=False)  # type: ignore[method-assign]


def per_block_compiled_steps(n: int, hand: bool, reference: bool) -> CountingBackend:
    """Compile each of ``n`` dropout blocks on its own, checkpointed by the package (default config) or by hand, and
    run a training step (and the monitor's reference variant, checkpointing off, when ``reference``)."""
    model = make_stack(DropoutBlock, n)
    if hand:
        for block in model.blocks:
            hand_checkpointed(block)
    else:
        apply_activation_checkpointing(model, CheckpointingConfig(classes=["DropoutBlock"]))
    backend = CountingBackend()
    for block in model.blocks:
        block.compile(backend=backend)
    x, _ = batch()
    model(x).sum().backward()
    if reference:
        with checkpointing_disabled():
            model(x).sum().backward()
    return backend


@pytest.mark.parametrize("n", [12, 48])
def test_blocks_compiled_one_by_one_share_their_graphs_as_hand_written_checkpointing_does(n: int) -> None:
    hand = per_block_compiled_steps(n, hand=True, reference=False)
    torch._dynamo.reset()
    ours = per_block_compiled_steps(n, hand=False, reference=False)
    assert ours.graphs == hand.graphs == 1
    assert ours.calls == hand.calls == n  # every block ran compiled
    torch._dynamo.reset()
    with_reference = per_block_compiled_steps(n, hand=False, reference=True)
    # The reference variant is one more graph, shared by every block, and runs compiled too.
    assert with_reference.graphs == hand.graphs + 1
    assert with_reference.calls == 2 * n


def test_blocks_given_equal_configs_share_their_graphs_too() -> None:
    model = make_stack(DropoutBlock, 12)
    for index, block in enumerate(model.blocks):
        checkpoint_module(block, f"blocks.{index}", CheckpointingConfig(classes=["DropoutBlock"]))
    backend = CountingBackend()
    for block in model.blocks:
        block.compile(backend=backend)
    model(batch()[0]).sum().backward()
    assert (backend.graphs, backend.calls) == (1, 12)


def test_a_checkpointed_region_past_the_recompile_limit_is_warned() -> None:
    model = make_stack(DropoutBlock, 4)
    for index, block in enumerate(model.blocks):
        # Configs that differ: each block is its own graph.
        config = CheckpointingConfig(classes=["DropoutBlock"], save_ops=["aten.addmm"] if index % 2 else [])
        checkpoint_module(block, f"blocks.{index}", replace(config, preserve_host_rng=index > 1))
    backend = CountingBackend()
    for block in model.blocks:
        block.compile(backend=backend)
    limit = torch._dynamo.config.patch(recompile_limit=2)
    with limit, pytest.warns(LightningCkptDeterminismWarning, match="hit its recompile limit on a checkpointed region"):
        model(batch()[0]).sum().backward()
    assert backend.graphs == 2
    assert backend.calls == 2  # the last two blocks ran eagerly


_FILTER_LIFETIME = """
import gc, logging
import torch
from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing
from lightning_ckpt_determinism import remove_activation_checkpointing
from lightning_ckpt_determinism._torch_compat import RECOMPILE_LOGGER

def filters():
    return [type(each).__name__ for each in logging.getLogger(RECOMPILE_LOGGER).filters]

seen = [filters()]
models = [torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh()) for _ in range(2)]
for model in models:
    apply_activation_checkpointing(model, CheckpointingConfig(classes=["Linear"]))
seen.append(filters())
for model in list(models):
    remove_activation_checkpointing(model)
    models.remove(model)
    gc.collect()
    seen.append(filters())
print(seen)
"""


def test_the_recompile_limit_filter_is_on_dynamos_logger_only_while_a_region_exists() -> None:
    env = child_env()
    done = subprocess.run(
        [sys.executable, "-c", _FILTER_LIFETIME], cwd=REPO, env=env, check=True, capture_output=True, text=True
    )
    # Not at import; one for both models' regions; still there while the second model's region lives.
    filters = ["RecompileLimitFilter"]
    assert done.stdout.strip() == str([[], filters, filters, []])


class GraphBreakingBatchNormBlock(BatchNormBlock):
    """A BatchNorm block dynamo cannot trace whole: torch's checkpoint runs it eagerly."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return super().forward(x)


class GraphBreakingPartsBlock(PartsBlock):
    """A module list people swap parts of, which dynamo cannot trace whole."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return super().forward(x)


def test_a_norm_swapped_into_a_region_that_graph_breaks_has_its_statistics_updated_once() -> None:
    torch.manual_seed(0)
    plain, model = Stack([GraphBreakingPartsBlock()]), Stack([GraphBreakingPartsBlock()])
    model.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(model, CheckpointingConfig(classes=["GraphBreakingPartsBlock"]))
    compiled = {id(net): torch.compile(net, backend="aot_eager") for net in (plain, model)}
    for step in range(3):
        if step == 1:
            for net in (plain, model):
                net.blocks[0].parts[1] = nn.BatchNorm1d(DIM)
        expected, got = (step_gradients(compiled[id(net)], seed=step) for net in (plain, model))
        assert all(torch.equal(expected[name], got[name]) for name in expected)
    assert counters["graph_break"]
    assert int(model.blocks[0].parts[1].num_batches_tracked) == int(plain.blocks[0].parts[1].num_batches_tracked) == 2
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), model.state_dict().values(), strict=True))


@pytest.mark.parametrize("protect_buffers", [True, False])
def test_a_region_that_graph_breaks_keeps_its_eager_contexts(protect_buffers: bool) -> None:
    torch.manual_seed(0)
    plain = Stack([PlainBlock(), GraphBreakingBatchNormBlock()])
    _, plain_state = compiled_step(plain, "aot_eager")
    torch.manual_seed(0)
    model = Stack([PlainBlock(), GraphBreakingBatchNormBlock()])
    apply_activation_checkpointing(
        model, CheckpointingConfig(classes=["GraphBreakingBatchNormBlock"], protect_buffers=protect_buffers)
    )
    _, state = compiled_step(model, "aot_eager")
    assert counters["graph_break"]
    statistics = ["blocks.1.norm.running_mean", "blocks.1.norm.running_var", "blocks.1.norm.num_batches_tracked"]
    updated_once = [torch.equal(state[name], plain_state[name]) for name in statistics]
    # Buffer protection reached the eager recomputation; without it the statistics are updated a second time.
    assert updated_once == [protect_buffers] * 3


def test_switching_checkpointing_off_compiles_one_more_graph_at_any_depth() -> None:
    model = make_stack(PlainBlock)
    apply_activation_checkpointing(model, CheckpointingConfig(classes=["PlainBlock"]))
    compiled = torch.compile(model, backend="aot_eager")
    x, _ = batch()
    compiled(x).sum().backward()
    with checkpointing_disabled():
        compiled(x).sum().backward()
        with checkpointing_disabled():
            compiled(x).sum().backward()
    compiled(x).sum().backward()
    assert counters["stats"]["unique_graphs"] == 2
    assert _SWITCH.disabled is False and _SWITCH.depth == 0


def test_names_without_orig_mod_select_the_blocks_of_a_compiled_model() -> None:
    module = StackModule(block="PlainBlock")
    module.model = torch.compile(module.model, backend="aot_eager")  # type: ignore[assignment]
    names = apply_activation_checkpointing(module, CheckpointingConfig(names=["model.blocks.*"]))
    assert names == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]
    assert list(checkpointed_modules(module)) == names
    assert checkpointed_modules(module)["model.blocks.1"] is module.model._orig_mod.blocks[1]
    assert is_compiled(module)


def test_a_compile_wrapper_is_never_selected_the_module_it_compiles_is() -> None:
    model = make_stack(PlainBlock)
    model.blocks[1] = torch.compile(model.blocks[1], backend="aot_eager")  # type: ignore[call-overload]
    selected = select_modules(model, CheckpointingConfig(names=["blocks.*"]))
    assert list(selected) == ["blocks.0", "blocks.1", "blocks.2"]
    assert selected["blocks.1"] is model.blocks[1]._orig_mod


def test_the_reference_pass_forces_the_memory_budget_to_one() -> None:
    with torch._functorch.config.patch(activation_memory_budget=0.5):
        with reference_pass():
            assert torch._functorch.config.activation_memory_budget == 1.0
            assert _SWITCH.disabled
        assert torch._functorch.config.activation_memory_budget == 0.5
    assert not _SWITCH.disabled


def mse_check(model: nn.Module, **options: Any) -> Any:
    x, y = batch()
    return check_recomputation(model, lambda: F.mse_loss(model(x), y), **options)


def test_check_on_a_clean_compiled_model_is_exact_and_attributes_eagerly() -> None:
    model = mixed_stack(checkpointed=True)
    compiled = torch.compile(model, backend="aot_eager")
    report = mse_check(compiled, attribution=True)
    assert report.compiled
    assert report.grad_divergence == 0.0
    assert not report.diverged
    assert report.cause is None and report.hint is None
    assert report.checked_regions == ["blocks.0", "blocks.1", "blocks.2"]
    assert [(region.name, region.cause) for region in report.regions] == [
        ("blocks.0", None),
        ("blocks.1", None),
        ("blocks.2", None),
    ]
    assert all(region.ops_compared > 0 for region in report.regions)


def test_check_catches_a_compiler_that_redraws_a_recomputed_random_op_and_names_its_regions() -> None:
    faulty = BackwardGraphs(rewrite=redraw_recomputed_random_ops)
    torch.manual_seed(0)
    model = Stack([DropoutBlock(), PlainBlock(), DropoutBlock()])
    apply_activation_checkpointing(model, CheckpointingConfig(classes=["DropoutBlock", "PlainBlock"]))
    compiled = torch.compile(model, backend=faulty.backend)
    report = mse_check(compiled)
    assert report.diverged
    assert report.grad_divergence > 0.01
    assert report.cause is None  # decided by the eager rerun, which only attribution runs
    assert report.regions == []
    attributed = mse_check(compiled, attribution=True)
    assert attributed.diverged
    assert attributed.cause == "compiler_recompute"
    assert "activation_memory_budget` below 1" in (attributed.hint or "")
    # The scan found the redrawn dropout in the backward graph; the plain block recomputes nothing random.
    assert [(region.name, region.diverged, region.cause) for region in attributed.regions] == [
        ("blocks.0", True, "compiler_recompute"),
        ("blocks.1", False, None),
        ("blocks.2", True, "compiler_recompute"),
    ]
    assert attributed.regions[0].hint == (
        f"{CAUSE_HINTS['compiler_recompute']} In its compiled backward graph, `aten.native_dropout.default` draws in"
        " the backward."
    )
    # The configured compiled code is back in place: the check's own passes did not change it.
    assert mse_check(compiled).grad_divergence == report.grad_divergence


def test_the_memory_budget_bug_of_the_partitioner_is_caught() -> None:
    model = make_stack(DropoutBlock, n=2)
    apply_activation_checkpointing(model, CheckpointingConfig(classes=["DropoutBlock"]))
    compiled = torch.compile(model)
    with torch._functorch.config.patch(activation_memory_budget=0.5):
        report = mse_check(compiled, attribution=True)
    if not report.diverged and Version(torch.__version__).release >= (2, 14):
        pytest.skip(
            f"pytorch#190717 (dropout redrawn under an activation memory budget) is fixed in {torch.__version__}"
        )
    assert report.diverged
    assert report.grad_divergence > 0.01
    assert report.cause == "compiler_recompute"
    # The backward graph runs inductor_seeds itself: each block's recomputed dropout gets a new seed.
    redrawn = "`prims.inductor_random.default` takes a seed from `prims.inductor_seeds.default` run in the backward"
    assert [(region.name, region.cause) for region in report.regions] == [
        ("blocks.0", "compiler_recompute"),
        ("blocks.1", "compiler_recompute"),
    ]
    assert all((region.hint or "").endswith(f"In its compiled backward graph, {redrawn}.") for region in report.regions)
    torch._dynamo.reset()
    # A new compile of the same model: a scan keeps what it found in every graph compiled through it.
    compiled = torch.compile(model)
    with scanned(compiled) as scan:
        clean = mse_check(compiled, attribution=True)
    assert clean.grad_divergence == 0.0
    assert not clean.diverged and clean.cause is None
    # Under budget 1.0 the backward replays the forward's seed: scanned, and nothing redrawn.
    assert scan.scanned_graphs >= 1
    assert scan.redraws == []


class CompiledStackModule(StackModule):
    """Compiles its model in ``configure_model``, as the README recommends."""

    def configure_model(self) -> None:
        if not is_compiled(self.model):
            self.model = torch.compile(self.model, backend="aot_eager")  # type: ignore[assignment]


def test_a_lightning_module_compiling_its_model_trains_with_the_monitor_at_zero(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    module = CompiledStackModule()
    monitor = RecomputationMonitor(every_n_steps=2)
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["model.blocks.*"]))
    logger = CSVLogger(tmp_path)
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, strategy=strategy, callbacks=[monitor], logger=logger))
    # The compiler recomputes the regions out of the sentinel's sight: it says so, once, rather than log a 0.
    with pytest.warns(LightningCkptDeterminismWarning, match="the sentinel compared nothing .* every checkpointed"):
        trainer.fit(module)
    assert trainer.global_step == 4
    assert monitor.last_report is not None and monitor.last_report.compiled
    assert monitor.last_report.checked_regions == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]
    with open(Path(logger.log_dir) / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    assert [float(row["recompute/grad_divergence"]) for row in rows if row["recompute/grad_divergence"]] == [0.0, 0.0]
    assert [float(row["recompute/sentinel/compared"]) for row in rows if row["recompute/sentinel/compared"]] == [0.0]
    assert not any(row.get("recompute/sentinel/mismatches") for row in rows)


def test_a_model_compiled_in_configure_model_trains_bit_identically_with_the_sentinel(tmp_path: Path) -> None:
    weights = {}
    for sentinel in ("sampled", "off"):
        torch._dynamo.reset()
        pl.seed_everything(0, verbose=False)
        module = CompiledStackModule()
        monitor = RecomputationMonitor(every_n_steps=50, sentinel=sentinel)  # type: ignore[arg-type]
        strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["model.blocks.*"]))
        trainer = pl.Trainer(**trainer_kwargs(tmp_path / sentinel, strategy=strategy, callbacks=[monitor]))
        trainer.fit(module)
        weights[sentinel] = {name: value.clone() for name, value in module.state_dict().items()}
        if sentinel == "sampled":
            report = monitor.sentinel_report
            assert report is not None
            assert report.compiled == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]
            assert report.compared == 0  # the compiler recomputes them, out of the sentinel's sight
    assert all(torch.equal(weights["sampled"][name], value) for name, value in weights["off"].items())


@pytest.mark.slow
def test_compile_with_ddp_trains_with_the_monitor_at_zero(tmp_path: Path) -> None:
    launch_ranks(DDP_SCRIPT, str(tmp_path), timeout=240)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [result["global_step"] for result in ranks] == [4, 4]
    assert ranks[0]["history"] == ranks[1]["history"]
    assert [(entry["step"], entry["grad_divergence"]) for entry in ranks[0]["history"]] == [(0, 0.0), (2, 0.0)]
    assert all(result["compiled"] for result in ranks)
    assert ranks[0]["checksum"] == ranks[1]["checksum"]


class FaultyCompiledStackModule(StackModule):
    """Compiles its model through a backend that redraws recomputed random ops."""

    def configure_model(self) -> None:
        if not is_compiled(self.model):
            faulty = BackwardGraphs(rewrite=redraw_recomputed_random_ops)
            self.model = torch.compile(self.model, backend=faulty.backend)  # type: ignore[assignment]


def test_the_monitor_warns_of_the_compilers_recomputation(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    # The check alone: the sentinel does not see compiled regions (and says so, tested above).
    monitor = RecomputationMonitor(every_n_steps=100, sentinel="off")
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["model.blocks.*"]))
    kwargs = trainer_kwargs(tmp_path, max_steps=1, strategy=strategy, callbacks=[monitor], logger=CSVLogger(tmp_path))
    trainer = pl.Trainer(**kwargs)
    with pytest.warns(LightningCkptDeterminismWarning, match="the same step run eagerly does not") as caught:
        trainer.fit(FaultyCompiledStackModule())
    assert monitor.last_report is not None and monitor.last_report.cause == "compiler_recompute"
    (message,) = [str(w.message) for w in caught if issubclass(w.category, LightningCkptDeterminismWarning)]
    assert message.startswith("lightning_ckpt_determinism: recomputation diverged at step 0")
    assert "activation_memory_budget` below 1" in message
    # The graph scan of the attributed rerun names the regions, with the op their backward graph redraws.
    named = re.findall(r"Region `([\w.]+)` diverged, cause compiler_recompute: ", message)
    assert named == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]
    assert message.count("In its compiled backward graph, `aten.native_dropout.default` draws in the backward.") == 3


def test_the_audit_of_a_compiled_model_says_its_regions_were_compared_eagerly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    config = tmp_path / "compiled.yaml"
    config.write_text(
        "trainer:\n"
        "  accelerator: cpu\n"
        "  strategy:\n"
        "    class_path: lightning_ckpt_determinism.SingleDeviceCheckpointingStrategy\n"
        "    init_args:\n"
        "      checkpointing:\n"
        '        names: ["model.blocks.*"]\n'
        "model:\n"
        "  class_path: tests.test_compile.CompiledStackModule\n"
    )
    assert main(["audit", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].split()[:3] == ["model.blocks.0", "ok", "-"]
    assert "compiled: both passes ran compiled; the regions were compared with eager semantics" in out
    assert "note: 2 compiled backward graphs scanned for random ops" in out
    assert "is not scanned" not in out
    assert out.splitlines()[-1] == "result: none of the 3 checkpointed regions diverged"


class FlickeringBackward:
    """Compiled backwards whose gradients differ from run to run in their last bits, as inductor's accumulations can:
    a stand-in for kernels that are not bitwise reproducible (every run of any of its graphs scales a little more)."""

    def __init__(self) -> None:
        self.runs = 0
        self.backend = partial(aot_eager, bw_compiler=self._backward)

    def _backward(self, graph: fx.GraphModule, inputs: list[torch.Tensor]) -> Callable[..., Any]:
        compiled = boxed_nop(graph, inputs)

        def run(args: list[Any]) -> Any:
            self.runs += 1
            scale = 1.0 + 1e-6 * (self.runs % 3)
            return [None if out is None else out * scale for out in compiled(args)]

        run._boxed_call = True  # type: ignore[attr-defined]
        return run


def test_compiled_kernels_that_differ_run_to_run_are_not_blamed_on_the_compilers_recomputation() -> None:
    model = make_stack(PlainBlock, n=2)
    apply_activation_checkpointing(model, CheckpointingConfig(classes=["PlainBlock"]))
    compiled = torch.compile(model, backend=FlickeringBackward().backend)
    report = mse_check(compiled, attribution=True)
    assert report.diverged
    assert report.cause == "nondeterministic_kernel"
    assert report.hint is not None and "differs from itself run to run" in report.hint
    assert all(region.cause is None for region in report.regions)


class LazyBlock(nn.Module):
    """A lazy linear layer, then tanh."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.LazyLinear(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inp(x))


def test_lazy_blocks_initialised_before_compiling_one_by_one_share_one_graph_without_recompiles() -> None:
    # The eager check of lazy modules is never traced: a guard on it would fail once eager calls prune it.
    torch.manual_seed(0)
    model = nn.Sequential(*[LazyBlock() for _ in range(6)])
    apply_activation_checkpointing(model, CheckpointingConfig(classes=["LazyBlock"]))
    x = torch.randn(4, 8)
    with torch.no_grad():
        model(x)  # initialises them, as a model summary or a dry run does
    graphs: list[fx.GraphModule] = []

    def backend(graph: fx.GraphModule, inputs: list[torch.Tensor]) -> Callable[..., Any]:
        graphs.append(graph)
        return aot_eager(graph, inputs)

    for block in model:
        block.compile(backend=backend)
    compiled = []
    for _ in range(3):
        model(x).sum().backward()
        compiled.append(len(graphs))
    # One graph for the first block, whose input needs no grad, one shared by the five others; no recompile after.
    assert compiled == [2, 2, 2]
    assert not counters["graph_break"]


class UnloggedStack(StackModule):
    """A :class:`StackModule` that logs nothing in its step (dynamo cannot trace `self.log` there)."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.model(x), y)


def test_a_module_lightning_compiles_is_checked_at_every_step(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # `trainer.fit(torch.compile(module))` compiles the module's step and forward as functions: its regions are
    # recomputed inside the compiled backward, where the package counts nothing, and every step is checked.
    pl.seed_everything(0, verbose=False)
    module = UnloggedStack(block="PlainBlock")
    monitor = RecomputationMonitor(every_n_steps=1)
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=["PlainBlock"]))
    trainer = pl.Trainer(
        **trainer_kwargs(tmp_path, callbacks=[monitor], strategy=strategy, max_steps=2, log_every_n_steps=1)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LightningCkptDeterminismWarning)
        trainer.fit(torch.compile(module, backend="aot_eager"))
    assert [(record.step, record.skipped, record.grad_divergence) for record in monitor.history] == [
        (0, None, 0.0),
        (1, None, 0.0),
    ]
    # Said at fit start: a divergence would be named without its region or cause.
    said = [
        str(warning.message) for warning in caught if "compiles the LightningModule's steps" in str(warning.message)
    ]
    assert said == [
        "lightning_ckpt_determinism: `trainer.fit(torch.compile(module))` compiles the LightningModule's steps as"
        " functions, inside which neither the sentinel nor attribution sees: the checks still compare gradients, but"
        " a divergence is named without its region or cause. Compile the model or its blocks in `configure_model`"
        " instead to have them named."
    ]
    # The sentinel's silence is put down to the compiled steps, which hide every region from it.
    silent = [str(warning.message) for warning in caught if "compared nothing" in str(warning.message)]
    assert len(silent) == 1
    assert "at step 0: the LightningModule's steps are compiled (`trainer.fit(torch.compile(module))`)" in silent[0]
    assert (
        "The sentinel compared no recomputed saved tensor. It does not see 3 compiled regions (model.blocks.0,"
        " model.blocks.1, model.blocks.2), which the compiler recomputes." in caplog.text
    )


def test_a_divergence_in_steps_lightning_compiles_is_not_called_exact_for_want_of_a_region(tmp_path: Path) -> None:
    # The compiler draws dropout's mask anew in the backward: the gradients differ, and attribution, which sees no
    # region inside the compiled steps, compared no op; no region was seen to recompute exactly.
    pl.seed_everything(0, verbose=False)
    monitor = RecomputationMonitor(every_n_steps=1)
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(classes=["DropoutBlock"]))
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, callbacks=[monitor], strategy=strategy, max_steps=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LightningCkptDeterminismWarning)
        trainer.fit(torch.compile(UnloggedStack(block="DropoutBlock"), backend=redrawing_aot_eager))
    assert monitor.history[0].grad_divergence > 0
    assert monitor.last_report is not None
    assert [region.ops_compared for region in monitor.last_report.regions] == [0, 0, 0]
    (said,) = [str(warning.message) for warning in caught if "diverged at step 0" in str(warning.message)]
    assert "Every checkpointed region recomputed exactly" not in said
    assert (
        " No region is named: the LightningModule's steps are compiled (`trainer.fit(torch.compile(module))`), and"
        " attribution sees no region inside them; the difference may be the compiler's own recomputation"
        " (`compiler_recompute`) as well as a cause below. Compile the model or its blocks in `configure_model`"
        " instead to have the region and cause named. " in said
    )


class BreakingBatchNormBlock(BatchNormBlock):
    """A BatchNorm block that graph-breaks: compiled, it runs (and is checkpointed) eagerly."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return super().forward(x)


def test_a_compiled_models_region_updating_its_buffers_again_is_named_with_them_as_users_write_them() -> None:
    torch.manual_seed(0)
    model = make_stack(BreakingBatchNormBlock, n=1)
    apply_activation_checkpointing(
        model, CheckpointingConfig(classes=["BreakingBatchNormBlock"], protect_buffers=False)
    )
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(4, DIM)
    report = check_recomputation(compiled, lambda: compiled(x).pow(2).mean(), attribution=True)
    named = ["blocks.0.norm.running_mean", "blocks.0.norm.running_var", "blocks.0.norm.num_batches_tracked"]
    ((region_name, cause, buffers),) = [
        (region.name, region.cause, region.buffer_mutations) for region in report.regions
    ]
    assert (region_name, cause, buffers) == ("blocks.0", "buffer_mutation", named)
    assert (
        report.cause == "buffer_mutation" and report.hint is not None and report.hint.endswith(f"{', '.join(named)}.")
    )


class BreakingBlock(PlainBlock):
    """A block that graph-breaks: compiled, it runs eagerly, where the sentinel compares it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return super().forward(x)


class BlocksCompiledOneByOne(StackModule):
    """Compiles each block in ``configure_model``; the middle one graph-breaks."""

    def __init__(self) -> None:
        super().__init__(block="PlainBlock")
        self.model.blocks[1] = BreakingBlock()

    def configure_model(self) -> None:
        for block in self.model.blocks:
            block.compile(backend="aot_eager")


def test_the_summary_names_the_compiled_regions_the_sentinel_did_not_see(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torch._dynamo.reset()
    pl.seed_everything(0, verbose=False)
    monitor = RecomputationMonitor(every_n_steps=100)
    strategy = SingleDeviceCheckpointingStrategy(checkpointing=CheckpointingConfig(names=["model.blocks.*"]))
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, strategy=strategy, callbacks=[monitor], max_steps=2))
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        trainer.fit(BlocksCompiledOneByOne())
    report = monitor.sentinel_report
    assert report is not None
    assert {name: region.compared > 0 for name, region in report.regions.items()} == {
        "model.blocks.0": False,
        "model.blocks.1": True,
        "model.blocks.2": False,
    }
    (summary,) = [record.getMessage() for record in caplog.records if "RecomputationMonitor ran" in record.getMessage()]
    assert summary.endswith(
        "It does not see 2 compiled regions (model.blocks.0, model.blocks.2), which the compiler recomputes."
    )
