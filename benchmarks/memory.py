"""Activation memory per block, measured two ways, beside the analytical figure of Korthikanti et al. 2022.

What counts as a block's activation memory is decided here, so the figures mean one thing everywhere:

* **Distinct storages, counted once.** A saved tensor is charged the bytes of its whole storage
  (``untyped_storage().nbytes()``), and a storage that several saved tensors share (views, a tensor saved by two
  ops) is charged once. Parameters and buffers are never counted (a matmul saves its weight, a batch norm updates its
  running statistics in place, but that memory exists anyway).
* **Per block, by difference.** Each figure is ``(bytes(model with L blocks) - bytes(same model with 0 blocks)) /
  L``. The zero-block model has the same embedding, final norm, head and loss, so they cancel, and no block needs
  to be told apart from its neighbours; this works for checkpointing by hand (whose saved inputs are taken before
  the block is entered) as well as for the package. With ``every_n=2`` it is the mean of a checkpointed and a
  plain block.
* **saved (hooks)**: bytes of the tensors that an outer ``torch.autograd.graph.saved_tensors_hooks`` pack hook,
  entered around the whole forward, receives. Only the innermost pair of hooks runs, so inside a checkpointed
  region torch's own checkpoint hook takes over and turns the region's saved tensors into holders that this hook
  never sees; what it does see of a checkpointed block is the region's inputs, which non-reentrant checkpointing
  saves outside its hook. This is exactly "what checkpointing keeps", except that selective checkpointing
  (``save_ops``) keeps the outputs of the chosen ops in its own cache, not through saved-tensor hooks, so this
  column misses them.
* **held (live)**: bytes of every storage that an op created during the forward and that is still alive when the
  forward has returned and only the loss is kept: everything the graph holds for backward, whoever holds it
  (autograd, checkpoint's saved inputs, the selective-checkpointing cache). It is recorded by a dispatch mode that
  keeps a weak reference to each op output's storage. It equals the hook column wherever no cache is involved.
* Neither counts the RNG states torch's checkpoint stashes for each region (5056 bytes for the CPU generator,
  a few bytes per CUDA device), which are made outside the dispatcher and are not saved through hooks.

The analytical figure converts Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(2022), Section 4.1: ``s*b*h*(34 + 5*a*s/h)`` bytes per layer in 16-bit with 1-byte dropout masks. Split into what
is stored per element: ``16*s*b*h + 2*a*s*s*b`` activation elements (``2`` bytes each) plus ``2*s*b*h + a*s*s*b``
dropout-mask elements (``1`` byte each). The example GPT has the paper's layout term by term (pre-norm
LayerNorms saving their inputs, a QKV projection, ``Q K^T`` materialising ``a*s*s*b`` scores, softmax, attention
dropout, ``softmax @ V``, output projection and dropout, a ``4h`` MLP with GELU and dropout), so only the bytes per
element change: ``E`` for an activation (4 in float32) and ``M`` for a mask element. ``M`` is 1 on CUDA, whose
fused dropout saves a bool mask, and ``E`` on the CPU, where dropout is ``x * (bernoulli(1-p) / (1-p))`` and
autograd saves that scaled noise tensor in the activation dtype. Two small terms the paper leaves out are counted
too: each LayerNorm's mean and reciprocal std (``2 * 2 * s*b`` float32 values per block) and the ``s*s`` bool
causal mask that ``masked_fill`` saves. With full recomputation a block keeps only its input, ``E*s*b*h`` (the
paper's ``2*s*b*h``). Saving the outputs of the six matmuls (QKV, ``Q K^T``, ``softmax @ V``, output projection,
both MLP linears) keeps ``E*(11*s*b*h + a*s*s*b)``: the block input, ``3h + h + h + 4h + h`` wide outputs and the
scores.
"""

import gc
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import ModelSize, Variant, build_model, lm_loss, make_batch, make_optimizer, train_step
from lightning_ckpt_determinism import CheckpointingConfig

_MATMUL_OPS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm")
_ATTENTION_OP_PREFIX = "aten._scaled_dot_product"
_LAYER_NORMS_PER_BLOCK = 2
_STATISTICS_PER_LAYER_NORM = 2  # mean and reciprocal standard deviation, float32 whatever the input dtype
_STATISTIC_BYTES = 4


def run(size: ModelSize, device: torch.device) -> dict[str, Any]:
    """Measure the activation memory of each variant and put the analytical figures beside it.

    Args:
        size: The model's shape; needs at least two layers so ``every_n=2`` checkpoints something.
        device: Where to run; on CUDA the peak of ``torch.cuda.max_memory_allocated`` over one step is added.

    Returns:
        ``{"save_ops": the matmul ops a block runs, "element_bytes", "mask_element_bytes",
        "layout_extra_bytes_per_block", "variants": {name:
        {"saved_bytes_per_block", "held_bytes_per_block", "analytical_bytes_per_block"[,
        "cuda_step_peak_bytes"]}}, "korthikanti_16bit_bytes_per_layer": {"none", "full"}}``.
    """
    inputs, targets = make_batch(size, device)
    save_ops = block_matmul_ops(size, device)
    element = torch.get_default_dtype().itemsize
    mask = 1 if device.type == "cuda" else element
    none = bytes_without_recomputation(size, element, mask) + layout_extra_bytes(size)
    full = bytes_with_full_recomputation(size, element)
    checkpointed_every_2 = size.layers // 2
    every_2 = (checkpointed_every_2 * full + (size.layers - checkpointed_every_2) * none) / size.layers
    variants = (
        (Variant("none"), none),
        (Variant("hand-written full", hand=True), full),
        (Variant("full", config=CheckpointingConfig(classes=["Block"])), full),
        (Variant("every_n=2", config=CheckpointingConfig(classes=["Block"], every_n=2)), every_2),
        (
            Variant(f"save_ops={','.join(save_ops)}", config=CheckpointingConfig(classes=["Block"], save_ops=save_ops)),
            bytes_saving_matmuls(size, element),
        ),
    )
    baseline = forward_bytes(build_model(size, Variant("none"), device, layers=0), inputs, targets)
    results: dict[str, dict[str, float]] = {}
    for variant, analytical in variants:
        model = build_model(size, variant, device)
        saved, held = forward_bytes(model, inputs, targets)
        entry = {
            "saved_bytes_per_block": (saved - baseline[0]) / size.layers,
            "held_bytes_per_block": (held - baseline[1]) / size.layers,
            "analytical_bytes_per_block": analytical,
        }
        if device.type == "cuda":
            entry["cuda_step_peak_bytes"] = _cuda_step_peak(model, inputs, targets)
        results[variant.name] = entry
    s, b, h, a = size.seq_len, size.batch_size, size.dim, size.heads
    return {
        "save_ops": save_ops,
        "element_bytes": element,
        "mask_element_bytes": mask,
        "layout_extra_bytes_per_block": layout_extra_bytes(size),
        "variants": results,
        "korthikanti_16bit_bytes_per_layer": {"none": s * b * h * (34 + 5 * a * s / h), "full": 2 * s * b * h},
    }


def bytes_without_recomputation(size: ModelSize, element_bytes: int, mask_element_bytes: int) -> int:
    """Korthikanti et al.'s per-layer activation bytes without recomputation, in the given element sizes.

    With ``element_bytes=2`` and ``mask_element_bytes=1`` this is the paper's ``s*b*h*(34 + 5*a*s/h)``.

    Example::

        >>> size = ModelSize(layers=1, dim=64, heads=4, seq_len=32, batch_size=2, vocab_size=8)
        >>> bytes_without_recomputation(size, 2, 1) == 32 * 2 * 64 * (34 + 5 * 4 * 32 / 64)
        True
    """
    sbh, scores = _sbh(size), _scores(size)
    return element_bytes * (16 * sbh + 2 * scores) + mask_element_bytes * (2 * sbh + scores)


def bytes_with_full_recomputation(size: ModelSize, element_bytes: int) -> int:
    """Per-layer bytes with full recomputation: the block's input only (the paper's ``2*s*b*h`` in 16-bit)."""
    return element_bytes * _sbh(size)


def bytes_saving_matmuls(size: ModelSize, element_bytes: int) -> int:
    """Per-layer bytes when a checkpointed block keeps its input and the outputs of its six matmuls."""
    return element_bytes * (11 * _sbh(size) + _scores(size))


def layout_extra_bytes(size: ModelSize) -> int:
    """Bytes per block the paper leaves out: LayerNorm statistics and the bool causal mask."""
    per_position = _LAYER_NORMS_PER_BLOCK * _STATISTICS_PER_LAYER_NORM * _STATISTIC_BYTES
    return per_position * size.seq_len * size.batch_size + size.seq_len**2


def block_matmul_ops(size: ModelSize, device: torch.device) -> list[str]:
    """The matmul-like aten ops one block really runs on ``device``, sorted, as ``save_ops`` names them."""
    block = build_model(size, Variant("none"), device, layers=1).blocks[0]
    x = torch.randn(size.batch_size, size.seq_len, size.dim, device=device)
    with _OpRecorder() as recorder:
        block(x)
    return sorted(name for name in recorder.ops if name in _MATMUL_OPS or name.startswith(_ATTENTION_OP_PREFIX))


def _sbh(size: ModelSize) -> int:
    return size.seq_len * size.batch_size * size.dim


def _scores(size: ModelSize) -> int:
    return size.heads * size.seq_len**2 * size.batch_size


def forward_bytes(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[int, int]:
    """Bytes the loss's graph keeps after one forward: ``(saved through hooks, held alive)``."""
    state = {p.untyped_storage().data_ptr() for p in (*model.parameters(), *model.buffers())}
    saved: dict[tuple[torch.device, int], int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        found = _counted_storage(tensor, state)
        if found is not None:
            saved[found[1]] = found[2]
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, _unpack), _LiveStorages(state) as live:
        loss = lm_loss(model, inputs, targets)
    held = live.held_bytes()
    del loss
    return sum(saved.values()), held


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _counted_storage(
    tensor: torch.Tensor, excluded: set[int]
) -> tuple[torch.UntypedStorage, tuple[torch.device, int], int] | None:
    """``(storage, key, bytes)`` of ``tensor``'s storage, or ``None`` if it is empty or a parameter's."""
    storage = tensor.untyped_storage()
    if not storage.nbytes() or storage.data_ptr() in excluded:
        return None
    return storage, (tensor.device, storage.data_ptr()), storage.nbytes()


class _LiveStorages(TorchDispatchMode):
    """Keeps a weak reference to the storage of every op output, to sum those still alive later."""

    def __init__(self, excluded: set[int]) -> None:
        super().__init__()
        self._excluded = excluded
        self._outputs: list[tuple[StorageWeakRef, tuple[torch.device, int], int]] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in pytree.tree_leaves(out):
            found = _counted_storage(leaf, self._excluded) if isinstance(leaf, torch.Tensor) else None
            if found is not None:
                storage, key, nbytes = found
                self._outputs.append((StorageWeakRef(storage), key, nbytes))
        return out

    def held_bytes(self, also: dict[tuple[torch.device, int], int] | None = None) -> int:
        """Bytes of the distinct recorded storages that are still alive, and of ``also`` (storages the mode could not
        see, by key), each counted once."""
        alive = {key: nbytes for ref, key, nbytes in self._outputs if not ref.expired()}
        return sum({**alive, **(also or {})}.values())


def python_tensor_storages(excluded: set[int]) -> dict[tuple[torch.device, int], int]:
    """The storages of every tensor the garbage collector knows (tensors Python holds, not those autograd holds), by
    key, with their bytes: what code running below every dispatch mode (the routing guard's kept outputs) allocates
    shows here only."""
    found = {}
    for candidate in gc.get_objects():
        if type(candidate) is torch.Tensor and not candidate.is_meta and candidate.layout == torch.strided:
            counted = _counted_storage(candidate, excluded)
            if counted is not None:
                found[counted[1]] = counted[2]
    return found


class _OpRecorder(TorchDispatchMode):
    """Records the names of the aten ops that run, as ``"aten.addmm"``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        self.ops.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _cuda_step_peak(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> int:
    """Peak of ``torch.cuda.max_memory_allocated`` over one training step, above what was allocated before it."""
    optimizer = make_optimizer(model)
    train_step(model, optimizer, inputs, targets)  # creates the optimizer state outside the measured step
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    train_step(model, optimizer, inputs, targets)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start
