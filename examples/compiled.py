"""A compiled model whose compiler redraws recomputed dropout, so the audit's ``compiler_recompute`` can be seen.

Under ``torch.compile`` a checkpointed region is recomputed inside the compiled backward graph, and the compiler must
replay the random state its forward used. Inductor does not under an activation memory budget below 1
(pytorch#190717): the backward graph draws a new seed and recomputes dropout with another mask. Reproducing that takes
inductor, which compiles for seconds; :func:`redrawing_aot_eager` is a cheap stand-in, the ``aot_eager`` backend with
the same defect put into its backward graphs. ``examples/configs/broken_compiler_recompute.yaml`` runs::

    python -m lightning_ckpt_determinism audit --config examples/configs/broken_compiler_recompute.yaml
"""

import functools
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import fx, nn
from torch._dynamo.backends.debugging import aot_eager, boxed_nop
from torch._prims.rng_prims import run_with_rng_state

from examples.broken import BrokenModule


def redraw_recomputed_random_ops(graph: fx.GraphModule) -> None:
    """The defect: each random op recomputed in ``graph`` (a backward graph) draws fresh numbers instead of replaying
    the state its forward saved, as the partitioner's recomputation does under a memory budget below 1.

    Args:
        graph: A backward graph, as ``aot_autograd`` hands it to the backward compiler; rewritten in place.
    """
    for node in graph.graph.nodes:
        if node.target is run_with_rng_state:
            node.target, node.args = node.args[1], node.args[2:]
    graph.recompile()


def _redrawing_backward(graph: fx.GraphModule, inputs: list[torch.Tensor]) -> Callable[..., Any]:
    redraw_recomputed_random_ops(graph)
    return boxed_nop(graph, inputs)


redrawing_aot_eager = functools.partial(aot_eager, bw_compiler=_redrawing_backward)
"""The ``aot_eager`` backend with :func:`redraw_recomputed_random_ops` applied to its backward graphs.

Example::

    >>> model = torch.compile(torch.nn.Linear(2, 1), backend=redrawing_aot_eager)
    >>> model(torch.ones(1, 2)).shape
    torch.Size([1, 1])
"""

_BACKENDS: dict[str, str | Callable[..., Any]] = {"aot_eager": "aot_eager", "redrawing_aot_eager": redrawing_aot_eager}


class CompiledBrokenModule(BrokenModule):
    """A :class:`~examples.broken.BrokenModule` with dropout in one block, whose blocks compile in ``configure_model``.

    Args:
        backend: ``"redrawing_aot_eager"`` (:func:`redrawing_aot_eager`, recomputed dropout redrawn) or
            ``"aot_eager"`` (correct).
        dropout_block: Position of the block with dropout.
        blocks: Number of blocks.
        dim: Width of the blocks.
        lr: SGD learning rate.

    Example::

        >>> model = CompiledBrokenModule(backend="aot_eager", blocks=3)
        >>> model.configure_model()
        >>> [name for name, _ in model.named_children()]
        ['blocks', 'head']
    """

    def __init__(
        self,
        backend: Literal["aot_eager", "redrawing_aot_eager"] = "redrawing_aot_eager",
        dropout_block: int = 1,
        blocks: int = 4,
        dim: int = 16,
        lr: float = 0.01,
    ) -> None:
        super().__init__(defect="rng_not_preserved", blocks=blocks, defective_block=dropout_block, dim=dim, lr=lr)
        self.save_hyperparameters()

    def configure_model(self) -> None:
        if isinstance(self.blocks, nn.ModuleList):
            # One graph for the stack: the blocks keep their names (`blocks.1`), as the wrapper's `_orig_mod` is
            # left out of region names.
            self.blocks = torch.compile(nn.Sequential(*self.blocks), backend=_BACKENDS[self.hparams["backend"]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))
