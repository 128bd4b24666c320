"""The scan of compiled backward graphs for recomputed random ops drawn afresh (aot_eager only: compiles are cheap).

The real compiler bug, inductor under an activation memory budget below 1, is scanned in tests/test_compile.py.
"""

from collections.abc import Iterator

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from examples.compiled import redrawing_aot_eager
from lightning_ckpt_determinism import CheckpointingConfig, apply_activation_checkpointing, checkpointed_modules
from lightning_ckpt_determinism.verify.compiled.graph_scan import scanned
from tests.helpers import DropoutBlock, PlainBlock, Stack, step_gradients

DROPOUT_REDRAWN = "`aten.native_dropout.default` draws in the backward"


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def dropout_plain_dropout() -> Stack:
    torch.manual_seed(0)
    model = Stack([DropoutBlock(), PlainBlock(), DropoutBlock()])
    apply_activation_checkpointing(model, CheckpointingConfig(classes=["DropoutBlock", "PlainBlock"]))
    return model


def redrawn(scan: object, model: torch.nn.Module) -> dict[str, list[str]]:
    regions = scan.regions(checkpointed_modules(model))  # type: ignore[attr-defined]
    return {name: [redraw.describe() for redraw in found] for name, found in regions.items()}


@pytest.mark.parametrize("budget", [1.0, 0.5])
def test_aot_eager_replays_recomputed_dropout_from_the_forwards_state_at_any_budget(budget: float) -> None:
    model = dropout_plain_dropout()
    compiled = torch.compile(model, backend="aot_eager")
    with torch._functorch.config.patch(activation_memory_budget=budget):
        with scanned(compiled) as scan:
            scanned_grads = step_gradients(compiled)
        grads = step_gradients(torch.compile(dropout_plain_dropout(), backend="aot_eager"))
    assert scan.scanned_graphs == 1
    assert scan.redraws == []
    assert scan.unscanned == []
    # The scanning backend compiles as the configured one does.
    assert all(torch.equal(grads[name], scanned_grads[name]) for name in grads)


def test_a_redrawn_dropout_is_named_with_its_region_and_the_configured_code_comes_back() -> None:
    model = dropout_plain_dropout()
    compiled = torch.compile(model, backend=redrawing_aot_eager)
    configured = compiled.dynamo_ctx
    with scanned(compiled) as scan:
        step_gradients(compiled)
    assert redrawn(scan, compiled) == {"blocks.0": [DROPOUT_REDRAWN], "blocks.2": [DROPOUT_REDRAWN]}
    assert [redraw.path for redraw in scan.redraws] == [
        "L['self'].blocks.2.forward.module.dropout",
        "L['self'].blocks.0.forward.module.dropout",
    ]
    assert scan.redraws[0].module is model.blocks[2].dropout
    assert compiled.dynamo_ctx is configured


def test_blocks_compiled_one_by_one_are_scanned_each() -> None:
    model = dropout_plain_dropout()
    for block in model.blocks:
        block.compile(backend=redrawing_aot_eager)
    configured = [block._compiled_call_impl for block in model.blocks]
    with scanned(model) as scan:
        step_gradients(model)
    assert redrawn(scan, model) == {"blocks.0": [DROPOUT_REDRAWN], "blocks.2": [DROPOUT_REDRAWN]}
    assert scan.scanned_graphs == 3
    assert [block._compiled_call_impl for block in model.blocks] == configured


def test_a_scan_inside_a_scan_compiles_nothing_more_and_a_later_scan_reuses_the_graphs() -> None:
    model = dropout_plain_dropout()
    compiled = torch.compile(model, backend=redrawing_aot_eager)
    with scanned(compiled) as outer:
        step_gradients(compiled)
        graphs = counters["stats"]["unique_graphs"]
        with scanned(compiled) as inner:
            step_gradients(compiled)
        assert counters["stats"]["unique_graphs"] == graphs
    assert inner.redraws == outer.redraws and len(inner.redraws) == 2
    with scanned(compiled) as later:
        step_gradients(compiled)
    assert counters["stats"]["unique_graphs"] == graphs
    assert later.redraws == outer.redraws


def test_a_backend_without_aot_autograd_is_listed_as_unscanned() -> None:
    model = dropout_plain_dropout()
    compiled = torch.compile(model, backend="eager")
    configured = compiled.dynamo_ctx
    with scanned(compiled) as scan:
        step_gradients(compiled)
    assert scan.unscanned == ["Stack compiled with backend eager"]
    assert scan.scanned_graphs == 0 and scan.redraws == []
    assert compiled.dynamo_ctx is configured
