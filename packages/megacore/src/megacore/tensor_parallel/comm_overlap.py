"""Sequence parallelism's collectives overlapped with the GEMMs they feed (Megatron-LM's
`--tp-comm-overlap`, the "collective matmul" decomposition of torch's async TP).

Under sequence parallelism a column-parallel linear all-gathers its input [s/t, b, h] over
the t tensor-parallel ranks and then multiplies it; a row-parallel linear multiplies and
then reduce-scatters its output.  Here each collective becomes a ring of t - 1
point-to-point steps (`batch_isend_irecv`: send to the next rank, receive from the
previous), and each step's transfer runs while the GEMM of the chunk in hand does:

- `all_gather_matmul(x, w)` = gather(x) w^T: at each step multiply the sequence chunk in
  hand by the weight shard, writing that chunk's rows of the output in place, while
  passing the chunk on and receiving the next.  Its backward's input gradient is a GEMM +
  reduce-scatter (below); its weight gradient takes the gathered input, which the forward
  keeps (the plain path's `F.linear` keeps the same tensor), so nothing is gathered again.
- `matmul_reduce_scatter(x, w)` = reduce_scatter(x w^T): at each step compute the partial
  product of the chunk whose sum travels on next and add it to the accumulator received
  from the previous rank; after t - 1 steps each rank holds its own chunk's full sum.  Its
  backward's input gradient is a ring all-gather of the output gradient with the GEMM
  (as above), and the gathered output gradient gives the weight gradient; it keeps its
  input, as `F.linear` does.

The weight gradients go where `tensor_parallel.linear`'s do: into `main_grad`
(gradient-accumulation fusion, `accumulate=True` on a layer's own weight) or deferred to
the W step under `split_backward()`.  The sums differ from NCCL's only in their order.  On
the CPU (gloo) the steps run one after another: correct, no faster.
"""

import torch
import torch.distributed as dist

from megacore.tensor_parallel.mappings import _group
from megacore.tensor_parallel.weight_grad import linear, take_weight_grad, weight_grad_route


def _shift(send: torch.Tensor, recv: torch.Tensor, group, world: int, rank: int) -> list:
    """Start sending `send` to the next rank of `group` and receiving `recv` from the
    previous one; the requests to wait on."""
    next_rank = dist.get_global_rank(group, (rank + 1) % world)
    prev_rank = dist.get_global_rank(group, (rank - 1) % world)
    ops = [
        dist.P2POp(dist.isend, send, next_rank, group),
        dist.P2POp(dist.irecv, recv, prev_rank, group),
    ]
    return dist.batch_isend_irecv(ops)


def _chunk_size(x: torch.Tensor, world: int) -> int:
    if x.size(0) % world:
        raise ValueError(
            f"tensor-parallel communication overlap: sequence length {x.size(0)} is not "
            f"divisible by tensor_model_parallel_size ({world})"
        )
    return x.size(0) // world


def _ring_all_gather_matmul(x, rhs, group, world, rank):
    """(gather(x) along dim 0, gather(x) @ rhs), each chunk's GEMM overlapped with the
    transfer of the next chunk; chunks land straight in the gathered buffer."""
    c = x.size(0)
    gathered = x.new_empty((world * c, *x.shape[1:]))
    out = x.new_empty((world * c, *x.shape[1:-1], rhs.size(-1)))
    gathered[rank * c : (rank + 1) * c].copy_(x)
    for step in range(world):
        j = (rank - step) % world  # the chunk in hand
        requests = []
        if step < world - 1:
            k = (j - 1) % world  # the previous rank holds it now
            requests = _shift(
                gathered[j * c : (j + 1) * c], gathered[k * c : (k + 1) * c], group, world, rank
            )
        torch.matmul(gathered[j * c : (j + 1) * c], rhs, out=out[j * c : (j + 1) * c])
        for request in requests:
            request.wait()
    return gathered, out


def _ring_matmul_reduce_scatter(x, rhs, group, world, rank):
    """This rank's chunk of the sum over ranks of x @ rhs: each step's partial GEMM overlapped
    with the transfer of the accumulator, which starts at the rank after its owner."""
    c = _chunk_size(x, world)

    def partial(j):
        return torch.matmul(x[j * c : (j + 1) * c], rhs)

    total = partial((rank - 1) % world)
    for step in range(1, world):
        incoming = torch.empty_like(total)
        requests = _shift(total, incoming, group, world, rank)
        # The chunk whose accumulator arrives now: the previous rank's chunk of the last step.
        product = partial((rank - step - 1) % world)
        for request in requests:
            request.wait()
        total = incoming.add_(product)
    return total


class _RingLinear(torch.autograd.Function):
    """x weight^T with sequence parallelism's collective as a ring: `gather` (column-parallel:
    all-gather, then GEMM) or not (row-parallel: GEMM, then reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, weight, held, gather, ring):
        x = x.contiguous()
        if gather:  # what is saved is the gathered input, for the weight gradient
            x, out = _ring_all_gather_matmul(x, weight.t(), *ring)
        else:
            out = _ring_matmul_reduce_scatter(x, weight.t(), *ring)
        ctx.save_for_backward(x, weight)
        ctx.held, ctx.gather, ctx.ring = held, gather, ring
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        needs_x, needs_weight = ctx.needs_input_grad[:2]
        grad = grad.contiguous()
        if ctx.gather:  # the input gradient reduce-scattered
            grad_x = _ring_matmul_reduce_scatter(grad, weight, *ctx.ring) if needs_x else None
        else:  # the output gradient all-gathered, for both gradients
            grad, grad_x = _ring_all_gather_matmul(grad, weight, *ctx.ring)
        grad_weight = take_weight_grad(ctx.held, needs_weight, x, grad)
        return grad_x if needs_x else None, grad_weight, None, None, None


def _ring_linear(x, weight, accumulate, group, gather):
    group, world, rank = _group(group)
    if world == 1:
        return linear(x, weight, accumulate=accumulate)
    weight_in, held = weight_grad_route(weight, accumulate)
    return _RingLinear.apply(x, weight_in, held, gather, (group, world, rank))


def all_gather_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    accumulate: bool = False,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """gather(x) weight^T for a sequence shard x [s/t, b, h] and weight [n, h]: [s, b, n], the
    all-gather over `group` (default: tensor-parallel) overlapped with the GEMM (module doc).
    Backward: the input gradient reduce-scattered the same way.  `accumulate` as
    `tensor_parallel.linear`'s."""
    return _ring_linear(x, weight, accumulate, group, gather=True)


def matmul_reduce_scatter(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    accumulate: bool = False,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """reduce_scatter(x weight^T) along the sequence for x [s, b, k] and weight [n, k]:
    [s/t, b, n], the sum over `group` (default: tensor-parallel) overlapped with the GEMM
    (module doc).  Backward: the output gradient all-gathered the same way.  `accumulate` as
    `tensor_parallel.linear`'s."""
    return _ring_linear(x, weight, accumulate, group, gather=False)
