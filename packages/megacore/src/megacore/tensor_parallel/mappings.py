"""Autograd operators that move tensors in and out of the tensor-parallel region.

The paper's pair (section 3, Fig. 3):

- f = `copy_to_tensor_model_parallel_region`: identity forward, all-reduce backward;
- g = `reduce_from_tensor_model_parallel_region`: all-reduce forward, identity backward.

Scatter/gather along the last (hidden) dimension, and the sequence-parallel pair
along the first (sequence) dimension.  Activations are [sequence, batch, hidden]
as in Megatron, so a sequence shard is a contiguous block and the collectives
need no copies.  With one tensor-parallel rank every operator is the identity
and issues no communication.

`gather_from_sequence_parallel_region` takes another group too: context parallelism
(megacore.context_parallel) all-gathers K and V over its CP group with it, the
gradients reduce-scattered back the same way.
"""

import torch
import torch.distributed as dist

from megacore import parallel_state
from megacore.collectives import all_gather_flat, reduce_scatter_flat

_all_gather_flat = all_gather_flat  # module attributes, so tests can count the calls
_reduce_scatter_flat = reduce_scatter_flat


def _tp():
    return (
        parallel_state.get_tensor_model_parallel_group(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
    )


def _reduce(x: torch.Tensor) -> torch.Tensor:
    group, world, _ = _tp()
    if world == 1:
        return x
    # Reduce a copy: the caller's tensor (or a gradient autograd also hands to another
    # branch, as an addition's backward does) must not change under it.
    x = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(x, group=group)
    return x


def _group(group: dist.ProcessGroup | None):
    """(group, its size, this rank in it): the given group, or the tensor-parallel one."""
    if group is None:
        return _tp()
    return group, dist.get_world_size(group), dist.get_rank(group)


def _split_last(x: torch.Tensor) -> torch.Tensor:
    _, world, rank = _tp()
    if world == 1:
        return x
    size = x.size(-1)
    if size % world:
        raise ValueError(f"cannot split last dimension {size} over {world} tensor-parallel ranks")
    return x.narrow(-1, rank * (size // world), size // world).contiguous()


def _gather_last(x: torch.Tensor) -> torch.Tensor:
    _, world, _ = _tp()
    if world == 1:
        return x
    # Gather along dim 0 (contiguous blocks), then move the rank blocks to the last dim.
    return torch.cat(_gather_first(x).chunk(world, dim=0), dim=-1)


def _split_first(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    _, world, rank = _group(group)
    if world == 1:
        return x
    size = x.size(0)
    if size % world:
        raise ValueError(
            f"sequence parallelism: sequence length {size} is not divisible by "
            f"tensor_model_parallel_size ({world})"
        )
    return x.narrow(0, rank * (size // world), size // world).contiguous()


def _gather_first(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    group, world, _ = _group(group)
    if world == 1:
        return x
    out = torch.empty((world * x.size(0), *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_flat(out, x.contiguous(), group=group)
    return out


def _reduce_scatter_first(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    group, world, _ = _group(group)
    if world == 1:
        return x
    size = x.size(0)
    if size % world:
        raise ValueError(
            f"sequence parallelism: sequence length {size} is not divisible by "
            f"tensor_model_parallel_size ({world})"
        )
    out = torch.empty((size // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_flat(out, x.contiguous(), group=group)
    return out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return _reduce(grad)


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _split_last(x)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad)


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _gather_last(x)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad)


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _split_first(x)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad)


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tensor_parallel_output_grad, group):
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        ctx.group = group
        return _gather_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        # Inside the TP region each rank's gradient is a partial sum: reduce-scatter it.
        # If the consumer was replicated (same gradient on every rank), just take our part.
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_first(grad, ctx.group), None, None
        return _split_first(grad, ctx.group), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.group), None


def copy_to_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """f: identity forward, all-reduce of the gradient over the TP group backward."""
    return _CopyToTP.apply(x)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """g: all-reduce over the TP group forward, identity backward."""
    return _ReduceFromTP.apply(x)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Keep this rank's block of the last dimension; backward gathers it."""
    return _ScatterToTP.apply(x)


def gather_from_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's block along the last dimension; backward splits."""
    return _GatherFromTP.apply(x)


def scatter_to_sequence_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Keep this rank's block of the sequence (first) dimension; backward all-gathers."""
    return _ScatterToSP.apply(x)


def gather_from_sequence_parallel_region(
    x: torch.Tensor,
    tensor_parallel_output_grad: bool = True,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """All-gather along the sequence dimension; backward reduce-scatters (or splits, see above).

    `group`: the ranks to gather over (default: the tensor-parallel group), in their
    group-rank order along the first dimension.
    """
    return _GatherFromSP.apply(x, tensor_parallel_output_grad, group)


def reduce_scatter_to_sequence_parallel_region(
    x: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Sum over the TP group (or `group`) and keep this rank's sequence block; backward
    all-gathers."""
    return _ReduceScatterToSP.apply(x, group)
