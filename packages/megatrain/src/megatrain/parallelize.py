"""Parallelism, recompute and compile applied to a plain model from outside.

The model classes (`models/`) compute one chunk of the transformer; what layout they run in
reaches them as a `ParallelContext` (tensor- and pipeline-parallel rank and size, virtual
stages), never by reading or changing process-group globals.  This module builds a rank's
chunks for a layout (`build_chunks`) and changes built chunks in place: activation
recompute (`apply_recompute`), context parallelism (`apply_context_parallel`, with
`split_batch_for_context_parallel` for the batch), tensor-parallel communication overlapped
with the GEMMs (`apply_tp_comm_overlap`), float8 GEMMs (`apply_float8`), torch.compile
(`apply_compile`), CUDA graphs (`apply_cuda_graphs`) and fully sharded data parallelism
through torch's FSDP2 (`apply_fsdp`), in the spirit of
torchtitan's `parallelize_*` functions.  The tensor-parallel layers themselves are
megacore's Megatron layers (column/row-parallel linear, vocabulary-parallel embedding),
which take their groups from megacore's process-group state.
"""

import contextlib
import itertools
import warnings
from dataclasses import dataclass
from functools import lru_cache, partial

import torch
import torch.distributed as dist
from torch.cuda import make_graphed_callables

from megacore import parallel_state, pipeline_parallel
from megacore import tensor_parallel as tp
from megatrain.config import RECOMPUTE_CHOICES


@dataclass(frozen=True)
class ParallelContext:
    """Where one rank sits in the layout: its tensor- and pipeline-parallel rank and size, the
    virtual pipeline size (None: no interleaving), and in the expert layout its
    expert-parallel rank and size (which experts it holds) and expert-tensor-parallel rank
    and size (which slice of each)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    vpp_size: int | None = None
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1

    @classmethod
    def from_process_groups(cls) -> "ParallelContext":
        """This rank's place as megacore's process groups say (one process when none are set
        up)."""
        if not parallel_state.model_parallel_is_initialized():
            return cls()
        return cls(
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
            tp_size=parallel_state.get_tensor_model_parallel_world_size(),
            pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
            pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
            vpp_size=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
            ep_rank=parallel_state.get_expert_model_parallel_rank(),
            ep_size=parallel_state.get_expert_model_parallel_world_size(),
            etp_rank=parallel_state.get_expert_tensor_parallel_rank(),
            etp_size=parallel_state.get_expert_tensor_parallel_world_size(),
        )

    def chunk_places(self, num_layers: int) -> list[tuple[list[int], bool, bool]]:
        """Per chunk of this rank (one, or vpp_size under interleaving): its layer ids, whether
        it holds the embeddings (the very first chunk of the model) and whether it holds the
        output (the very last)."""
        virtual = self.vpp_size or 1
        return [
            (
                pipeline_parallel.layers_for(
                    num_layers, self.pp_rank, self.pp_size, self.vpp_size, virtual_rank=v
                ),
                self.pp_rank == 0 and v == 0,
                self.pp_rank == self.pp_size - 1 and v == virtual - 1,
            )
            for v in range(virtual)
        ]


def build_chunks(
    model_class: type,
    cfg,
    seed: int = 1234,
    parallel: ParallelContext | None = None,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    initialize: bool = True,
) -> list:
    """This rank's chunks of a `LanguageModel` (one, or vpp under interleaving), tied
    embeddings synced.

    Built directly on `device` (the CPU when None) in `dtype`, so the sync, a collective
    over the embedding group, runs where the parameters stay (NCCL needs them on the GPU).
    `initialize=False`: no weights drawn, for a model a checkpoint is about to fill.
    `parallel`: where this rank sits (None: read from megacore's process groups, which
    `initialize_model_parallel` must then have set up).  Each chunk is told its place; no
    global state is read by the model or changed here.  The config's recompute is applied to
    each chunk (`apply_recompute`).
    """
    parallel = parallel or ParallelContext.from_process_groups()
    chunks = [
        model_class(
            cfg,
            layer_ids,
            pre_process=first,
            post_process=last,
            seed=seed,
            device=device,
            dtype=dtype,
            initialize=initialize,
            parallel=parallel,
        )
        for layer_ids, first, last in parallel.chunk_places(cfg.num_layers)
    ]
    pipeline_parallel.sync_shared_embeddings(chunks)
    for chunk in chunks:
        apply_recompute(chunk, cfg.recompute, cfg.distribute_saved_activations)
        apply_expert_parallel(chunk)
        if cfg.tp_comm_overlap:
            apply_tp_comm_overlap(chunk)
    return chunks


def _moe_layers(chunk) -> list:
    from megatrain.models.moe import MoELayer  # models import this module

    return [m for m in chunk.modules() if isinstance(m, MoELayer)]


def apply_expert_parallel(chunk) -> None:
    """A chunk's MoE layers set for megacore's process groups: where its experts lie in the
    whole expert weights (`expert_layout`, which checkpoints read), the token dispatcher of the
    expert layout (`megacore.moe.token_dispatcher`, by model.moe_token_dispatcher_type) and,
    where the tokens of one sequence are spread over TP (sequence parallelism) or CP ranks,
    that group for the router's load-balancing and z losses, whose token counts and
    averages must cover the whole sequence to be one process's numbers (Megatron-LM #1652,
    #3672).  Nothing changes without process groups (one process)."""
    if not parallel_state.model_parallel_is_initialized():
        return
    from megacore.moe.token_dispatcher import build_token_dispatcher
    from megatrain.checkpoint.dcp import expert_layout

    spread = parallel_state.get_tensor_and_context_parallel_world_size() > 1
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    for layer in _moe_layers(chunk):
        cfg = layer.cfg
        # Where this rank's experts lie in the whole [E, ...] weights (the checkpoint's).
        experts, E = layer.experts, cfg.num_moe_experts
        for w, dim, halves in ((experts.weight1, 2, 2 if cfg.swiglu else 1),
                               (experts.weight2, 1, 1)):  # fmt: skip
            w.expert_layout = expert_layout(w.shape, E, experts.first, etp_rank, etp, dim, halves)
        dropless = cfg.moe_expert_capacity_factor is None
        layer.dispatcher = build_token_dispatcher(
            cfg.num_moe_experts, cfg.moe_token_dispatcher_type, dropless
        )
        if spread:
            layer.router.aux_loss_group = parallel_state.get_tensor_and_context_parallel_group()


def aux_loss_over_layout(chunks, cfg, device) -> torch.Tensor | None:
    """The step's load-balancing loss (without its coefficient) as one process reports it: each
    MoE layer's mean over the step's microbatches, its ranks' shares summed over TP x CP (each
    rank's loss is its share of its sequences', `megacore.moe.switch_load_balancing_loss`),
    averaged over DP, then the mean over every MoE layer of the model (the stages' layers
    summed over PP).  None when the model computes no such loss (the config says so on every
    rank alike); else every rank must call it."""
    from megatrain.models.moe import moe_layers

    if not (cfg.num_moe_experts and cfg.moe_aux_loss_coeff):
        return None
    if cfg.moe_router_load_balancing_type == "none":
        return None
    means = [torch.stack(m.aux_losses).mean() for m in moe_layers(chunks) if m.aux_losses]
    value = torch.stack(means).sum().reshape(1) if means else torch.zeros(1, device=device)
    value = value.to(device, torch.float32)
    if parallel_state.model_parallel_is_initialized():
        dist.all_reduce(value, group=parallel_state.get_tensor_and_data_parallel_group(True))
        value /= parallel_state.get_data_parallel_world_size()
    layers = torch.tensor([float(len(means))], device=device)
    stats = torch.cat([value, layers])
    if parallel_state.model_parallel_is_initialized():
        dist.all_reduce(stats, group=parallel_state.get_pipeline_model_parallel_group())
    return stats[0] / stats[1].clamp(min=1)


def sum_expert_loads(chunks) -> None:
    """Each MoE layer's step load (tokens per expert, dropped choices) summed over the ranks
    of its pipeline stage (TP x DP x CP, which together saw the step's tokens), so the
    expert-bias update and the logged load are one process's.  Call after the step's
    microbatches, before `update_expert_biases`; every rank of the stage must call it."""
    if not parallel_state.model_parallel_is_initialized():
        return
    group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    if dist.get_world_size(group) == 1:
        return
    layers = [layer for chunk in chunks for layer in _moe_layers(chunk)]
    if not layers:
        return
    # One all-reduce for every layer of the rank (a step of a 64-layer MoE would otherwise
    # issue 128 latency-bound collectives over a group of up to tp x dp x cp ranks).
    loads = [t for layer in layers for t in (layer.tokens_per_expert, layer.dropped)]
    flat = torch.cat([t.reshape(-1) for t in loads])
    dist.all_reduce(flat, group=group)
    for t, summed in zip(loads, flat.split([t.numel() for t in loads]), strict=True):
        t.copy_(summed.view_as(t))
    for layer in layers:
        # Every rank of a stage routes as many tokens (the same microbatch shape).
        layer.choices *= dist.get_world_size(group)


@dataclass(frozen=True)
class ContextParallel:
    """A chunk's context parallelism (`apply_context_parallel`): this rank's place in the CP
    group and how attention talks to the other ranks ("p2p" ring or "allgather")."""

    rank: int
    size: int
    comm_type: str
    group: object = None  # the CP process group (None: megacore's)

    def positions(self, local_len: int, device) -> torch.Tensor:
        """Global sequence positions of this rank's `local_len` tokens (made once per length
        and device: every layer of every microbatch asks)."""
        return _cp_positions(local_len, self.rank, self.size, torch.device(device))


@lru_cache(maxsize=16)
def _cp_positions(local_len: int, rank: int, size: int, device: torch.device) -> torch.Tensor:
    from megacore.context_parallel import cp_chunk_indices

    return cp_chunk_indices(local_len * size, rank, size).to(device)


def apply_context_parallel(chunk, comm_type: str, cp: ContextParallel | None = None):
    """Context parallelism on a built chunk, in place; returns it.  Each sequence arrives
    split over the CP ranks (`split_batch_for_context_parallel`); every layer's attention
    then attends over the whole sequence through megacore.context_parallel, and positions
    are the global ones.  Everything else in the model is per token and runs unchanged."""
    if cp is None:
        cp = ContextParallel(
            parallel_state.get_context_parallel_rank(),
            parallel_state.get_context_parallel_world_size(),
            comm_type,
            parallel_state.get_context_parallel_group(),
        )
    if cp.size == 1:
        return chunk
    chunk.context_parallel = cp
    for layer in chunk.layers.values():
        layer.attention.context_parallel = cp
    return chunk


def split_batch_for_context_parallel(batch: dict, rank: int, size: int) -> dict:
    """This CP rank's part of a GPT microbatch: chunks r and 2cp-1-r of every [b, s] array
    (tokens, labels, positions, documents, loss mask), the positions made global first."""
    from megacore.context_parallel import split_for_context_parallel

    if size == 1:
        return batch
    batch = dict(batch)
    if "position_ids" not in batch:
        b, s = batch["tokens"].shape
        batch["position_ids"] = torch.arange(s, device=batch["tokens"].device).expand(b, s)
    return {k: split_for_context_parallel(v, 1, rank, size) for k, v in batch.items()}


def apply_recompute(chunk, mode: str, distribute_saved_activations: bool = False):
    """Activation recompute on a built chunk, in place; returns it.

    - "none": every activation kept for the backward.
    - "selective" (Korthikanti et al. 2022): each attention core (QK^T, softmax, dropout,
      scores x V) is run again in the backward instead of keeping its s x s activations,
      which are cheap to redo and costly to keep.
    - "full": each layer keeps only its input and runs again in the backward;
      `distribute_saved_activations` splits that input over the tensor-parallel ranks.
    Recompute replays the dropout masks (megacore's checkpoint restores the generators), so
    every mode computes the same numbers."""
    if mode not in RECOMPUTE_CHOICES:
        raise ValueError(f"model.recompute must be one of {RECOMPUTE_CHOICES}, not {mode!r}")
    for layer in chunk.layers.values():
        attention = layer.attention
        attention.core_attention = (
            partial(tp.checkpoint, attention._core, False)
            if mode == "selective"
            else attention._core
        )
    chunk.checkpointed_layer = (
        partial(_checkpointed_layer, distribute_saved_activations) if mode == "full" else None
    )
    return chunk


def _checkpointed_layer(distribute_saved_activations: bool, layer, x, mask):
    return tp.checkpoint(layer, distribute_saved_activations, x, mask)


def apply_compile(chunk):
    """torch.compile each TransformerLayer of `chunk` in place (`training.compile`).

    Per layer, not the whole model: the graph is one block (LayerNorms, bias + GeLU, bias +
    dropout + residual fused; the matmuls and attention stay library kernels), compiled once
    and reused by every layer, and full recompute's `tp.checkpoint` stays outside it, calling
    the compiled layer in forward and again in backward.  Dynamo breaks the graph at what it
    cannot trace, the RNG tracker's fork (generator state swaps: at tp > 1 without sequence
    parallelism; with it the fork is around the layer, outside the graph), selective
    recompute's checkpoint, and runs those eagerly, so the dropout masks and the recompute
    are the eager ones.  With tp > 1 the tensor-parallel collectives sit in the same graph.
    `Module.compile` keeps the parameter names (no `_orig_mod.` prefix), so checkpoints do
    not change.  `fallback_random`: dropout draws from torch's generators as in eager, so a
    seed gives the same masks with compile on or off (inductor's own in-kernel random
    numbers would be a little faster and draw other masks).
    """
    for layer in chunk.layers.values():
        layer.compile(options={"fallback_random": True})
    return chunk


def apply_tp_comm_overlap(chunk):
    """Every sequence-parallel column- and row-parallel linear inside `chunk` (the layers' and
    the output layer) with its all-gather or reduce-scatter overlapped with its GEMM
    (`parallel.tp_comm_overlap`, megacore's `tensor_parallel.comm_overlap`), in place; returns
    it.  Linears without sequence parallelism (the experts' own, BERT's head) keep theirs."""
    for module in chunk.modules():
        if isinstance(module, tp.ColumnParallelLinear | tp.RowParallelLinear):
            module.tp_comm_overlap = module.sequence_parallel
    return chunk


def apply_float8(chunk, recipe: "tp.Float8Recipe"):
    """The GEMMs of every column- and row-parallel linear inside `chunk`'s transformer layers in
    float8 (`training.precision = "fp8"`), in place; returns it.

    The layers only, as torchtitan's float8 converter leaves the output layer: the logits
    (and the tied embeddings they share a weight with) stay bf16, where float8's few
    mantissa bits would cost the most.  A linear whose dimensions are not multiples of 16
    keeps bf16 (`Float8Recipe.applies_to`)."""
    for layer in chunk.layers.values():
        for module in layer.modules():
            if isinstance(module, tp.ColumnParallelLinear | tp.RowParallelLinear):
                module.float8 = recipe
    return chunk


def check_cuda_graphs(device: torch.device) -> None:
    """`training.cuda_graphs` needs a CUDA device: refused before any weight is built."""
    if device.type != "cuda":
        raise ValueError(
            f"training.cuda_graphs = true needs a CUDA device; this run is on {device.type}: "
            "set training.cuda_graphs = false"
        )


class _AfterBackward(torch.autograd.Function):
    """Identity; its backward calls `done()` first.  Put on a graphed layer's input, it runs
    once the layer's backward graph has replayed (the input's gradient comes out of it)."""

    @staticmethod
    def forward(ctx, x, done):
        ctx.done = done
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.done()
        return grad, None


def apply_cuda_graphs(ddp_chunk, seq_length: int, micro_batch_size: int, dtype: torch.dtype):
    """Capture every transformer layer of a DDP-wrapped chunk as CUDA graphs, forward and
    backward (`training.cuda_graphs`), with torch.cuda.make_graphed_callables, all in one
    memory pool; returns the chunk.

    A layer's input is [s, b, h] (s / tp under sequence parallelism); a bidirectional model
    (BERT) also takes its key-padding mask [b, 1, 1, s].  The layers' Python runs at
    capture only, so what must run on every pass stays outside the graphs:

    - gradient-accumulation fusion adds the weight gradients into `main_grad` inside the
      captured backward, but the data-parallel buffer's "written" callback, which starts a
      bucket's reduction, is Python: inside the graph it only records which parameters the
      graph writes, and `_AfterBackward` on the layer's input makes the real calls once the
      layer's backward graph has replayed (so reductions still overlap the backward);
    - other parameters get their gradients from the graph's backward through autograd and
      the buffer's usual hook.

    Warm-up and capture run the layers' forward and backward on samples (after the caller
    seeded the generators): their gradients are cleared from the buffer after, and the
    caller seeds the generators again, so the first step draws what it would have without
    graphs.  A layer in eval mode, under no_grad, or asked for a KV cache runs its own eager
    forward.
    """
    chunk = ddp_chunk.module
    cfg, layers = chunk.config, list(chunk.layers.values())
    written: set = set()
    callbacks = {}
    for layer in layers:
        for p in layer.parameters():
            if getattr(p, "main_grad_written", None) is not None:
                callbacks[p] = p.main_grad_written
                p.main_grad_written = written.add
    device = next(chunk.parameters()).device
    local = seq_length // chunk.parallel.tp_size if cfg.sequence_parallel else seq_length
    shape = (local, micro_batch_size, cfg.hidden_size)
    mask = torch.ones(micro_batch_size, 1, 1, seq_length, device=device, dtype=torch.bool)

    def sample() -> tuple:
        x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
        return (x,) if cfg.causal else (x, mask.clone())

    # The layers' draws all per rank (sequence parallelism): captured inside the fork that
    # `in_rank_stream` puts around each graphed layer in training, so none swaps inside.
    forked = chunk.in_rank_stream(layers[0]) is not layers[0]
    with (
        ddp_chunk.no_sync(),  # the warm-up's gradients start no reduction
        tp.get_rng_tracker().fork() if forked else contextlib.nullcontext(),
    ):
        make_graphed_callables(
            tuple(layers), tuple(sample() for _ in layers), allow_unused_input=True
        )
    ddp_chunk.zero_grad_buffer()
    for layer in layers:
        fused = [(p, callbacks[p]) for p in layer.parameters() if p in written]
        layer.forward = _graphed_layer_forward(layer, layer.forward, fused)
    return ddp_chunk


def _graphed_layer_forward(layer, graphed, fused: list):
    """The forward a graphed layer gets: the graph in training, with the fused parameters'
    "written" callbacks after its backward; the layer's own forward otherwise."""
    eager = type(layer).forward.__get__(layer)

    def done() -> None:
        for p, callback in fused:
            callback(p)

    def forward(x, mask=None, cache=None, layer_id=0):
        if cache is not None or not (layer.training and torch.is_grad_enabled()):
            return eager(x, mask, cache, layer_id)
        if fused:
            x = _AfterBackward.apply(x, done)
        # The graph takes its sample's arguments exactly (None would count as one).
        return graphed(x) if mask is None else graphed(x, mask)

    return forward


def apply_fsdp(
    chunk,
    group,
    param_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    *,
    sum_then_divide: bool = True,
    reduce_every_microbatch: bool = False,
):
    """Fully shard `chunk` over the data-parallel process group `group` with torch's FSDP2
    (`parallel.data_parallel_sharding = "full"`), as torchtitan does: `fully_shard` on each
    transformer layer, then on the chunk itself (its embeddings, final norm and output
    layer, kept together so that tied embeddings stay one parameter); returns the chunk.

    - The mesh is the existing group (`DeviceMesh.from_group`): no new global group.
    - Megatron's tensor-parallel layers stay plain tensors: each rank's TP shard is what
      FSDP shards again, along dim 0, over `group` (megatron-core's torch-FSDP2 path).
    - The parameters FSDP keeps are fp32 (the masters, sharded); with `param_dtype` bf16 the
      `MixedPrecisionPolicy` gathers them as bf16 for compute and reduces gradients in fp32.
    - Gradients are summed and then divided by the group's size (`sum_then_divide`): FSDP's
      own choice there is ReduceOp.AVG, which gloo does not honour (pytorch#162338: silently
      wrong gradients); NCCL's SUM with a division costs one scale of the shard.
      `sum_then_divide=False` is FSDP's default, kept for the test that shows the trap.
    - `reshard_after_forward`: the layers free their gathered parameters after the forward
      (ZeRO-3) or keep them for the backward (ZeRO-2 in memory); the chunk's own parameters
      (embeddings, output layer: needed first in the backward) are kept, as torchtitan.
    - The marks megacore reads off parameters (`tensor_model_parallel`, `sequence_parallel`,
      `shared_embedding`, ...) move onto FSDP's sharded parameters.
    - Prefetch: each layer's all-gather starts before the layer ahead of it computes (the
      next layer's in the forward, the previous one's in the backward).
    - Microbatches accumulate without communication: `chunk.no_sync()` (which the pipeline
      schedules call) turns FSDP's gradient sync off, so the last microbatch's backward
      reduce-scatters the step's gradients once, every parameter's unsharded fp32 gradient
      held until then.  `reduce_every_microbatch` (`parallel.reduce_every_microbatch`):
      `no_sync()` does nothing, and every microbatch's backward reduce-scatters each layer's
      gradient into the shards, which accumulate there (torchtitan's and Composer's way: a
      reduce-scatter a microbatch, one layer's unsharded gradient at a time).
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = DeviceMesh.from_group(group, next(chunk.parameters()).device.type)
    policy = MixedPrecisionPolicy(
        param_dtype=None if param_dtype == torch.float32 else param_dtype,
        reduce_dtype=torch.float32,
    )
    marks = {
        (module, name): dict(vars(p))
        for module in chunk.modules()
        for name, p in module.named_parameters(recurse=False)
        if vars(p)
    }
    with torch.no_grad():
        for p in chunk.parameters():
            p.data = p.data.float()
    units = [
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        for layer in chunk.layers.values()
    ]
    # Each layer's all-gather is issued before the layer ahead of it computes: the next one's
    # in the forward, the previous one's in the backward (FSDP's own streams overlap them
    # with that compute on a GPU).
    for here, ahead in itertools.pairwise(units):
        here.set_modules_to_forward_prefetch([ahead])
        ahead.set_modules_to_backward_prefetch([here])
    units.append(fully_shard(chunk, mesh=mesh, mp_policy=policy, reshard_after_forward=False))
    for (module, name), values in marks.items():
        for key, value in values.items():
            setattr(getattr(module, name), key, value)
    if sum_then_divide:
        size = float(dist.get_world_size(group))
        for unit in units:
            unit.set_gradient_divide_factor(size)
            unit.set_force_sum_reduction_for_comms(True)
    # The chunk's output (the loss per token, a view) meets no in-place op: the schedules
    # divide it out of place and free a sent activation by swapping its storage.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    chunk.no_sync = (
        contextlib.nullcontext if reduce_every_microbatch else partial(_fsdp_no_sync, chunk)
    )
    chunk.fully_sharded_group = group  # for the optimizer's gradient norm
    return chunk


@contextlib.contextmanager
def _fsdp_no_sync(chunk):
    """Gradients accumulate unreduced inside (every microbatch but the last)."""
    chunk.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        chunk.set_requires_gradient_sync(True)
