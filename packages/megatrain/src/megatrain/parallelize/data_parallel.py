"""Data parallelism on built chunks: megacore's DDP (and the distributed optimizer's buffers), or
fully sharded through torch's FSDP2."""

import contextlib
import itertools
import warnings
from functools import partial

import torch
import torch.distributed as dist

from megacore import parallel_state as ps
from megacore.distributed import DistributedDataParallel
from megatrain.models.moe import GroupedExperts


def apply_fsdp(
    chunk,
    group,
    param_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    *,
    sum_then_divide: bool = True,
    reduce_every_microbatch: bool = False,
    expert_group=None,
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
    - Experts split over ranks (expert_model_parallel_size > 1 or etp != tp): each MoE layer's
      routed experts (`GroupedExperts`) are a unit of their own, sharded over `expert_group`
      (megacore's expert-data-parallel group: the ranks holding the same experts), before
      their layer's unit takes the rest over `group` (torchtitan's DeepSeek-V3 and
      Qwen3-MoE runs): `_shard_experts`.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if next(chunk.parameters(), None) is None:
        # A middle pipeline stage of no layer (parallel.pipeline_model_parallel_layout), which
        # passes its input on: nothing to shard, nor a device to read off a parameter.
        chunk.no_sync, chunk.fully_sharded_group = contextlib.nullcontext, group
        return chunk
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
    shard = partial(fully_shard, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    experts = _shard_experts(chunk, expert_group, shard)
    units = [shard(layer, mesh=mesh) for layer in chunk.transformer_layers()]
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
    for unit, force_sum in experts:
        # The experts' gradients divided by the dense size, as megacore's DDP divides them
        # (megacore.moe's gradient-scale rule: the expert-data-parallel sum covers every token
        # of the global batch once, the loss its mean over the dense replicas' batches).
        unit.set_gradient_divide_factor(float(dist.get_world_size(group)))
        unit.set_force_sum_reduction_for_comms(force_sum)
    chunk.fully_sharded_group = group  # for the optimizer's gradient norm
    return chunk


def _shard_experts(chunk, expert_group, shard) -> list:
    """With experts split over ranks: each `GroupedExperts` of `chunk` `fully_shard`-ed (by
    `shard`) over `expert_group` (default megacore's expert-data-parallel group); returns
    [(unit, whether its reduction must be forced to SUM)].  None is sharded where the expert
    layout is the dense one: the experts then go with their layer over the dense group.

    At an expert-data-parallel size of 1 the experts are wrapped all the same (one path for
    every size: their gradients still need the dense divide, and FSDP's 1-rank unit does it
    with no communication), but without forcing SUM: torch 2.13's 1-rank path divides by the
    factor when it copies the gradient and again after it when the reduction is forced to SUM
    (the factor squared); unforced, it divides once and sends nothing."""
    from torch.distributed.device_mesh import DeviceMesh

    modules = [m for m in chunk.modules() if isinstance(m, GroupedExperts)]
    if not modules or ps.expert_layout_is_dense_layout():
        return []
    expert_group = expert_group or ps.get_expert_data_parallel_group()
    device = next(modules[0].parameters()).device.type
    mesh = DeviceMesh.from_group(expert_group, device)
    many = dist.get_world_size(expert_group) > 1
    return [(shard(m, mesh=mesh), many) for m in modules]


@contextlib.contextmanager
def _fsdp_no_sync(chunk):
    """Gradients accumulate unreduced inside (every microbatch but the last)."""
    chunk.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        chunk.set_requires_gradient_sync(True)


def apply_ddp(chunk, parallel, gradient_accumulation_fusion: bool, dtype: torch.dtype, group):
    """`chunk` in megacore's DDP over the data-parallel `group` (the distributed optimizer's
    buffers with `parallel.use_distributed_optimizer`), as the [parallel] section `parallel`
    says; gradients reduced in fp32 unless the model is fp32."""
    p = parallel
    return DistributedDataParallel(
        chunk,
        grad_reduce_in_fp32=dtype != torch.float32,
        overlap_grad_reduce=p.overlap_grad_reduce,
        use_distributed_optimizer=p.use_distributed_optimizer,
        overlap_param_gather=p.overlap_param_gather,
        bucket_size=p.bucket_size,
        gradient_accumulation_fusion=gradient_accumulation_fusion,
        data_parallel_group=group,
    )


def reshard_after_forward(parallel) -> bool:
    """FSDP's reshard_after_forward: as configured, else off under pipeline parallelism."""
    if parallel.reshard_after_forward is not None:
        return parallel.reshard_after_forward
    return parallel.pipeline_model_parallel_size == 1
