"""Find, in the compiled backward graphs, the random ops that recomputation draws afresh instead of replaying.

Under ``torch.compile`` a checkpointed region's recomputation is part of the compiled backward graph, and a random
op in it must reproduce its forward's draw. The partitioner does that by replaying state its forward graph saved:

- RNG functionalization (``aot_eager``, inductor with ``fallback_random``): the forward runs the op under
  ``run_and_save_rng_state`` and hands the state to the backward, which runs it under ``run_with_rng_state`` with that
  state, a placeholder of the backward graph;
- inductor's own random lowering: ``inductor_random(size, seed)`` draws from a seed, looked up from the one
  ``inductor_seeds`` call of the forward graph; a correct backward receives that seed (or the mask) as a placeholder.

The compiler's recomputation bug (pytorch#190717, ``activation_memory_budget`` below 1 under inductor) shows as an
``inductor_seeds`` call in the backward graph itself: the recomputed ``inductor_random`` gets a new seed and a new
mask. So a random op of a backward graph is *redrawn* when the generator state it draws from is not saved by the
forward: a seeded op (``torch.Tag.nondeterministic_seeded``: ``native_dropout``, ``bernoulli``, ``rand*`` ...) or
``run_and_save_rng_state`` run in the backward, or ``inductor_random``/``inductor_randint``/``run_with_rng_state``
whose seed or state is computed from such a draw in the backward rather than received from the forward. Only ops
that the forward ran, recomputed as part of a checkpointed region (torch tags their nodes with ``recompute``), are
findings; a backward that draws random numbers of its own is not recomputation.

Each finding is placed in its module through the node's ``nn_module_stack``, the attribute path dynamo traced from
the compiled module; :meth:`GraphScan.regions` names the checkpointed region that holds it.

:func:`scanned` recompiles the compiled parts of a model through a backend of this module, which hands every graph
the configured backend compiles to the scan, after that backend's own compiler ran on it (so the scan sees what
runs). The inductor backend and ``aot_autograd`` backends (``aot_eager`` and its variants) are scanned; other
backends are listed in :attr:`GraphScan.unscanned` and compile as configured.
"""

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from lightning_ckpt_determinism._torch_compat import (
    OpOverload,
    OptimizedModule,
    aot_backends,
    compile_options,
    compiled_call,
    compiled_inner,
    dynamo_context,
    dynamo_context_key,
    functorch_config,
    graphsafe_run_with_rng_state,
    inductor_compilers,
    innermost_backend,
    is_compiled_module,
    module_call,
    module_path_steps,
    run_and_save_rng_state,
    run_with_rng_state,
    set_compiled_call,
    set_dynamo_context,
)
from lightning_ckpt_determinism.checkpointing.routing import is_random_op

__all__ = ["GraphScan", "scanned"]

_Compiler = Callable[..., Any]

AotAutograd, aot_eager, boxed_nop = aot_backends()
_RUN_AND_SAVE = run_and_save_rng_state
# Ops that draw from a seed or a state they are given, and where that argument is.
_SEEDED_BY: dict[Any, Callable[[fx.Node], Any]] = {
    run_with_rng_state: lambda node: node.args[0],
    graphsafe_run_with_rng_state: lambda node: node.kwargs.get("rng_state"),
}


@dataclass(frozen=True)
class RandomRedraw:
    """A random op that a compiled backward graph draws afresh instead of replaying its forward's draw.

    Attributes:
        op: The random op, as torch names it (``"prims.inductor_random.default"``, ``"aten.native_dropout.default"``).
        source: The op that drew the new numbers in the backward: ``op`` itself, or the seed op it takes its seed
            from (``"prims.inductor_seeds.default"``).
        path: The module path dynamo traced, as it wrote it (``"L['self'].blocks.1.forward.module.dropout"``).
        module: The module ``path`` leads to from the compiled module, when it could be followed.
    """

    op: str
    source: str
    path: str
    module: nn.Module | None = None

    def describe(self) -> str:
        """One clause for a hint: which op the backward draws afresh, and from what.

        Example::

            >>> RandomRedraw("prims.inductor_random.default", "prims.inductor_seeds.default", "").describe()
            '`prims.inductor_random.default` takes a seed from `prims.inductor_seeds.default` run in the backward'
        """
        if self.source == self.op:
            return f"`{self.op}` draws in the backward"
        return f"`{self.op}` takes a seed from `{self.source}` run in the backward"


def find_redraws(graph: fx.GraphModule, root: nn.Module | None = None) -> list[RandomRedraw]:
    """The recomputed random ops of a backward graph that do not replay their forward's draw, in graph order.

    Args:
        graph: A backward graph, as the partitioner hands it to the backend's backward compiler.
        root: The module that was compiled, for following each node's module path; ``None`` leaves
            :attr:`RandomRedraw.module` unset.

    Example::

        >>> graph = fx.symbolic_trace(lambda x: torch.nn.functional.dropout(x))
        >>> find_redraws(graph)  # a draw, but no recomputation of a forward's op (no `recompute` tag)
        []
    """
    drawn: dict[fx.Node, str] = {}  # node -> the op that drew in this graph and reaches it
    redraws: list[RandomRedraw] = []
    for node in graph.graph.nodes:
        if node.op != "call_function":
            continue
        source = _drawn_from(node, drawn)
        if source is not None:
            drawn[node] = source
        op = _random_op(node)
        if op is None:
            continue
        reading = _fresh_draw(node) or (_seed_of(node) is not None and drawn.get(_seed_of(node)))  # type: ignore[arg-type]
        meta = _recompute_meta(node)
        if reading and meta is not None:
            path = _innermost_path(meta)
            redraws.append(RandomRedraw(op, reading if isinstance(reading, str) else op, path, _follow(root, path)))
    return redraws


def _target_name(target: Any) -> str:
    return str(target) if isinstance(target, OpOverload) else getattr(target, "__name__", str(target))


def _fresh_draw(node: fx.Node) -> bool:
    """Whether the node reads the generator itself (not a seed or a state it is given)."""
    return node.target is _RUN_AND_SAVE or is_random_op(node.target)


def _drawn_from(node: fx.Node, drawn: dict[fx.Node, str]) -> str | None:
    """The op that drew in this graph and whose numbers (or seed) reach ``node``, if any."""
    if _fresh_draw(node):
        return _target_name(node.args[0] if node.target is _RUN_AND_SAVE else node.target)
    return next((drawn[arg] for arg in node.all_input_nodes if arg in drawn), None)


def _random_op(node: fx.Node) -> str | None:
    """The random op a node runs, by name; ``None`` for a pure seed op (``inductor_seeds``) or a non-random node."""
    if node.target in _SEEDED_BY or node.target is _RUN_AND_SAVE:
        return _target_name(node.args[1] if node.target in _SEEDED_BY else node.args[0])
    if node.target in (torch.ops.prims.inductor_random.default, torch.ops.prims.inductor_randint.default):
        return _target_name(node.target)
    if is_random_op(node.target) and not _target_name(node.target).startswith("prims.inductor_"):
        return _target_name(node.target)
    return None


def _seed_of(node: fx.Node) -> fx.Node | None:
    """The seed or state argument a random op draws from, when it takes one."""
    if node.target in _SEEDED_BY:
        seed = _SEEDED_BY[node.target](node)
    elif node.target is torch.ops.prims.inductor_random.default:
        seed = node.args[1]
    elif node.target is torch.ops.prims.inductor_randint.default:
        seed = node.args[3]
    else:
        return None
    return seed if isinstance(seed, fx.Node) else None


def _recompute_meta(node: fx.Node) -> dict[str, Any] | None:
    """The metadata of a recomputed node; torch's RNG wrappers leave it on the ``getitem`` nodes that unpack them."""
    for candidate in (node, *node.users):
        if "recompute" in candidate.meta or "ac_graph_id" in candidate.meta:
            return candidate.meta
    return None


def _innermost_path(meta: Mapping[str, Any]) -> str:
    stack = meta.get("nn_module_stack") or {}
    return str(list(stack.values())[-1][0]) if stack else ""


def _follow(root: nn.Module | None, path: str) -> nn.Module | None:
    """The innermost module along dynamo's attribute path (``L['self'].blocks.0.forward.module.dropout``)."""
    steps = module_path_steps(path)
    if root is None or steps is None:
        return None
    obj: Any = root
    found: nn.Module = root
    for attribute, index, key in steps:
        try:
            if index:
                obj = obj[int(index)]
            elif attribute in ("_modules", "_parameters", "_buffers"):
                continue
            else:
                obj = getattr(obj, attribute or key)
        except (AttributeError, IndexError, KeyError, TypeError):
            return found
        if isinstance(obj, OptimizedModule):
            obj = compiled_inner(obj)
        if isinstance(obj, nn.Module):
            found = obj
    return found


class _PartScan:
    """The findings of one compiled part's scanning backend, kept as long as that backend."""

    def __init__(self) -> None:
        self.redraws: list[RandomRedraw] = []
        self.graphs = 0

    def add(self, graph: fx.GraphModule, root: nn.Module) -> None:
        self.graphs += 1
        for redraw in find_redraws(graph, root):
            if redraw not in self.redraws:
                self.redraws.append(redraw)


@dataclass
class GraphScan:
    """What the scan found in the backward graphs its compiled parts compiled (see :func:`scanned`).

    Attributes:
        unscanned: Descriptions of the compiled parts whose backend the scan cannot hook into.

    Example::

        >>> scan = GraphScan()
        >>> scan.redraws, scan.scanned_graphs
        ([], 0)
    """

    unscanned: list[str] = field(default_factory=list)
    _parts: list[_PartScan] = field(default_factory=list, repr=False)

    @property
    def redraws(self) -> list[RandomRedraw]:
        """Each recomputed random op drawn afresh, once, in the order found."""
        return list(dict.fromkeys(redraw for part in self._parts for redraw in part.redraws))

    @property
    def scanned_graphs(self) -> int:
        """How many backward graphs were scanned."""
        return sum(part.graphs for part in self._parts)

    def regions(self, checkpointed: Mapping[str, nn.Module]) -> dict[str, list[RandomRedraw]]:
        """The redraws by checkpointed region, in the order of ``checkpointed``; a nested region takes its own.

        Args:
            checkpointed: The checkpointed regions by name (``checkpointed_modules(model)``).

        Example::

            >>> GraphScan().regions({"blocks.0": torch.nn.Linear(2, 2)})
            {}
        """
        owner: dict[int, str] = {}
        for name, region in checkpointed.items():
            for sub in region.modules():
                owner[id(sub)] = name
        found: dict[str, list[RandomRedraw]] = {}
        for redraw in self.redraws:
            region_name = owner.get(id(redraw.module)) if redraw.module is not None else None
            if region_name is not None:
                found.setdefault(region_name, []).append(redraw)
        return {name: found[name] for name in checkpointed if name in found}


class _ScanningBackend:
    """A compile backend that compiles as ``backend`` does and scans each backward graph after it compiled it."""

    def __init__(self, backend: Any, root: nn.Module, scan: _PartScan) -> None:
        self._backend = backend
        self._root = weakref.ref(root)
        self._scan = scan
        self.__name__ = f"scanning_{getattr(backend, 'compiler_name', type(backend).__name__)}"

    def __call__(self, graph: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        # A graph served from AOTAutograd's cache would skip the compilers this backend hooks into.
        with functorch_config.patch(enable_autograd_cache=False):
            return _compile_scanned(self._backend, graph, example_inputs, self._scanned)

    def _scanned(self, compiler: _Compiler) -> _Compiler:
        @functools.wraps(compiler)
        def compile_backward(graph: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
            compiled = compiler(graph, *args, **kwargs)
            root = self._root()
            if root is not None:
                self._scan.add(graph, root)
            return compiled

        return compile_backward


def _compile_scanned(
    backend: Any, graph: fx.GraphModule, inputs: Sequence[Any], scanned: Callable[[_Compiler], _Compiler]
) -> Any:
    """Compile ``graph`` as ``backend`` would, with its backward compiler wrapped by ``scanned``."""
    compile_fx, compile_fx_inner = inductor_compilers()

    if getattr(backend, "compiler_name", None) == "inductor":
        inner = scanned(compile_fx_inner)

        def inner_compile(graph: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
            if kwargs.get("is_backward"):
                return inner(graph, example_inputs, **kwargs)
            return compile_fx_inner(graph, example_inputs, **kwargs)

        return compile_fx(graph, list(inputs), inner_compile=inner_compile, config_patches=backend.config)
    compiler_fn, kwargs = _aot_parts(backend)
    if compiler_fn is aot_eager:
        bw_compiler = kwargs.pop("bw_compiler", None) or boxed_nop
        return aot_eager(graph, list(inputs), bw_compiler=scanned(bw_compiler), **kwargs)
    if isinstance(compiler_fn, AotAutograd):
        options = {**compiler_fn.kwargs, **kwargs}
        options["bw_compiler"] = scanned(options.get("bw_compiler") or options["fw_compiler"])
        return AotAutograd(**options)(graph, inputs)
    # Unreachable: `_scannable` admitted only the backends above.
    raise AssertionError(f"lightning_ckpt_determinism: no scanning compile for backend {backend!r}")


def _aot_parts(backend: Any) -> tuple[Any, dict[str, Any]]:
    """The compiler function of ``backend`` and the keywords bound to it (a ``functools.partial``'s)."""
    compiler_fn = getattr(backend, "compiler_fn", backend)  # `torch.compile(backend="aot_eager")` wraps the name
    kwargs: dict[str, Any] = dict(getattr(backend, "kwargs", {}) if compiler_fn is not backend else {})
    while isinstance(compiler_fn, functools.partial):
        kwargs = {**compiler_fn.keywords, **kwargs}
        compiler_fn = compiler_fn.func
    return compiler_fn, kwargs


def _scannable(backend: Any) -> bool:
    if getattr(backend, "compiler_name", None) == "inductor":
        return True
    compiler_fn, _ = _aot_parts(backend)
    return compiler_fn is aot_eager or isinstance(compiler_fn, AotAutograd)


# The scanning recompile of each compiled part, kept while the part lives: a second scan reuses its graphs instead
# of compiling again, and dynamo's cache holds one more entry per part, not one per scan. Weak caches of compiled
# code, keyed by the compiled parts themselves (never by name), read and filled only inside `scanned`.
_SCANNING: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
# Each scanning recompile's findings, by the recompiled context or call: a scan inside a scan reads the outer one's.
_SCANS: "weakref.WeakKeyDictionary[Any, _PartScan]" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def scanned(module: nn.Module) -> Iterator[GraphScan]:
    """Run the compiled parts of ``module`` through scanning backends inside this block.

    Each ``torch.compile`` wrapper in ``module`` (and ``module`` itself, if it is one) and each ``Module.compile()``
    compiles again, once per part, through a backend that compiles as the configured one does and hands every
    backward graph to the scan; on exit the configured compiled code is back in place. The yielded scan holds
    every redraw found in the graphs the parts compiled through it, now or in an earlier scan of the same part.

    Args:
        module: The model.

    Example::

        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout())
        >>> compiled = torch.compile(model, backend="aot_eager")
        >>> with scanned(compiled) as scan:
        ...     compiled(torch.ones(2, 2, requires_grad=True)).sum().backward()
        >>> scan.redraws, scan.scanned_graphs
        ([], 1)
    """
    scan = GraphScan()
    restores: list[Callable[[], None]] = []
    try:
        for sub in module.modules():
            if is_compiled_module(sub):
                restores.append(_install(sub, scan))
        yield scan
    finally:
        for restore in reversed(restores):
            restore()


def _install(sub: nn.Module, scan: GraphScan) -> Callable[[], None]:
    """Put the scanning recompile of one compiled part in place; return what puts the configured one back."""
    if isinstance(sub, OptimizedModule):
        wrapper, context = sub, dynamo_context_key(sub)
        recompiled = _scanning_recompile(wrapper, wrapper, compiled_inner(wrapper), compiled_inner(wrapper), scan)
        if recompiled is None:
            return lambda: None
        set_dynamo_context(wrapper, dynamo_context_key(recompiled))

        def restore() -> None:
            set_dynamo_context(wrapper, context)

        return restore
    call: Any = compiled_call(sub)
    recompiled = _scanning_recompile(call, call, sub, module_call(sub), scan)
    if recompiled is None:
        return lambda: None
    set_compiled_call(sub, recompiled)

    def restore_call() -> None:
        set_compiled_call(sub, call)

    return restore_call


def _scanning_recompile(current: Any, compiled: Any, root: nn.Module, target: Any, scan: GraphScan) -> Any:
    """``target`` compiled as ``compiled`` is but through a scanning backend, made once per compiled part; ``None``
    where an enclosing scan has put it in place already (``current``) or the backend cannot be scanned."""
    if dynamo_context_key(current) in _SCANS:  # an enclosing scan's
        scan._parts.append(_SCANS[dynamo_context_key(current)])
        return None
    context = dynamo_context(compiled)
    backend = innermost_backend(context.callback) if context is not None and callable(context.callback) else None
    if context is None or not _scannable(backend):
        name = getattr(backend, "compiler_name", None) or getattr(backend, "__name__", type(backend).__name__)
        scan.unscanned.append(f"{type(root).__name__} compiled with backend {name}")
        return None
    if current not in _SCANNING:
        own = _PartScan()
        fullgraph, dynamic = compile_options(context)
        recompiled: Any = torch.compile(
            target, backend=_ScanningBackend(backend, root, own), fullgraph=fullgraph, dynamic=dynamic
        )
        _SCANNING[current] = recompiled
        _SCANS[dynamo_context_key(recompiled)] = own
    recompiled = _SCANNING[current]
    scan._parts.append(_SCANS[dynamo_context_key(recompiled)])
    return recompiled
