"""Gradient clipping by the global norm of a model split over tensor and pipeline ranks.

The norm is that of the unsplit model's gradients: every rank adds the p-th
powers of the gradients it owns, summed over the model-parallel group (TP x PP).
A parameter replicated over TP ranks (LayerNorm weights, row-parallel biases)
counts only on TP rank 0, and the tied word embeddings only on the first stage
(the last stage's copy is marked `shared_embedding`).  So the result equals
`torch.nn.utils.clip_grad_norm_` on the gathered model.  The distributed
optimizer passes its fp32 shards, which carry the same marks, and adds the
data-parallel group to `groups`, since each DP rank then holds a different piece.

Expert parameters of a mixture of experts (`allreduce = False`) are laid out by the expert
groups, not the dense ones: each expert element lives on exactly one rank of the
ETP x EP x PP group (and, sharded, of the expert data-parallel group too), so where that
layout differs from the dense one their p-th powers are summed over those groups
(`expert_groups`) apart from the dense sum and the two added: Megatron-LM PR #5916's fix
(summing experts over the dense model-parallel group undercounts at ep > 1 with tp > 1).

By default (`foreach=True`) the per-tensor norms come from one `torch._foreach_norm`
call, the local sum and a count of non-finite gradients travel in one 2-element
tensor, with one all-reduce per group and one host sync (`grad_stats`, which the
optimizer also reads its inf/nan check from).  `foreach=False` is the plain
per-tensor path, kept as the reference the tests compare with.
"""

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from megacore import parallel_state as ps
from megacore.distributed.data_parallel import is_expert_param
from megacore.tensor_parallel import param_is_not_tensor_parallel_duplicate


def _grad(p: torch.Tensor) -> torch.Tensor | None:
    main = getattr(p, "main_grad", None)
    return p.grad if main is None else main


def counts_once(p: torch.Tensor) -> bool:
    """Whether p's gradient enters the global norm on this rank (so each element counts once);
    part of megacore.moe's gradient-scale rule."""
    if is_expert_param(p):  # split over ETP (no expert parts replicated there) and EP
        return True
    if not param_is_not_tensor_parallel_duplicate(p):
        return False
    if getattr(p, "shared_embedding", False):
        return ps.is_pipeline_first_stage(ignore_virtual=True)
    return True


def comm_device(tensors: list[torch.Tensor]) -> torch.device:
    """Where a scalar to all-reduce must live: the current GPU under NCCL, else the tensors'."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return tensors[0].device if tensors else torch.device("cpu")


def grad_stats(
    counted: Sequence[torch.Tensor],
    others: Sequence[torch.Tensor] = (),
    norm_type: float = 2.0,
    *,
    groups: list,
) -> torch.Tensor:
    """[sum of |g|^p over `counted` (the max |g| for the inf norm), number of gradients in
    `counted` or `others` holding inf or nan], reduced over `groups`; no host sync.

    `counted`: the fp32 gradients that enter the norm on this rank (`counts_once`);
    `others`: the rest (TP duplicates), which only the inf/nan count looks at.
    """
    grads = [*counted, *others]
    device = comm_device(grads)
    if grads:
        # One pass over every gradient; the norm of a tensor holding inf or nan is inf or nan.
        norms = torch.stack(torch._foreach_norm(grads, norm_type)).to(device)
        mine = norms[: len(counted)]
        if norm_type == math.inf:
            value = mine.max() if counted else norms.new_zeros(())
        else:
            value = mine.pow(norm_type).sum()
        stats = torch.stack([value, (~torch.isfinite(norms)).sum().to(value.dtype)])
    else:
        stats = torch.zeros(2, device=device)
    # Both entries reduce with the same op (a count's max is > 0 iff its sum is): one collective.
    op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
    for group in groups:
        dist.all_reduce(stats, op=op, group=group)
    return stats


def expert_norm_groups(sharded_over_data: bool) -> list | None:
    """The groups expert parameters' norm terms are summed over (ETP x EP x PP, and expert DP
    when the optimizer shards them there), or None when the expert layout is the dense one
    (ep 1, etp = tp: expert parameters then count with the dense ones).  Part of megacore.moe's
    gradient-scale rule: each expert element lives on one rank of ETP x EP x PP."""
    if not ps.model_parallel_is_initialized() or ps.expert_layout_is_dense_layout():
        return None
    groups = [ps.get_expert_tensor_model_pipeline_parallel_group()]
    return [*groups, ps.get_expert_data_parallel_group()] if sharded_over_data else groups


def split_grad_stats(
    counted: Sequence[torch.Tensor],
    others: Sequence[torch.Tensor],
    expert: Sequence[bool],
    norm_type: float = 2.0,
    *,
    groups: list,
    expert_groups: list | None,
) -> torch.Tensor:
    """`grad_stats` with expert gradients (`expert`: a flag per gradient of counted + others)
    reduced over `expert_groups` apart, the two results combined (None: one reduction)."""
    if expert_groups is None:
        return grad_stats(counted, others, norm_type, groups=groups)
    flags = iter(expert)
    parts = {False: ([], []), True: ([], [])}
    for i, grads in enumerate((counted, others)):
        for g in grads:
            parts[next(flags)][i].append(g)
    dense = grad_stats(*parts[False], norm_type, groups=groups)
    experts = grad_stats(*parts[True], norm_type, groups=expert_groups)
    if norm_type == math.inf:
        return torch.maximum(dense, experts)
    return dense + experts


def norm_of(value: float, norm_type: float) -> float:
    """The global norm from `grad_stats`' first entry."""
    return value if norm_type == math.inf else value ** (1.0 / norm_type)


def _plain_norm_value(grads: list[torch.Tensor], norm_type: float, groups: list) -> float:
    """The per-tensor reference: one norm and one reduction term per gradient."""
    if norm_type == math.inf:
        local = max((g.abs().max() for g in grads), default=torch.tensor(0.0))
        op = dist.ReduceOp.MAX
    else:
        local = sum((g.norm(norm_type) ** norm_type for g in grads), torch.tensor(0.0))
        op = dist.ReduceOp.SUM
    total = torch.as_tensor(local, dtype=torch.float32, device=comm_device(grads)).reshape(1)
    for group in groups:
        dist.all_reduce(total, op=op, group=group)
    return total.item()


def get_grad_norm(
    parameters: Iterable[torch.Tensor],
    norm_type: float = 2.0,
    *,
    groups: list | None = None,
    foreach: bool = True,
    expert_groups: list | None = None,
) -> float:
    """Global norm of the gradients of the whole model, the same on every rank of `groups`.

    `groups` defaults to the model-parallel group (TP x PP); `expert_groups` (see
    `expert_norm_groups`): what expert parameters' terms are summed over, apart.
    """
    params = [p for p in parameters if _grad(p) is not None and counts_once(p)]
    groups = [ps.get_model_parallel_group()] if groups is None else groups
    kinds = [(params, groups)]
    if expert_groups is not None:
        kinds = [
            ([p for p in params if not is_expert_param(p)], groups),
            ([p for p in params if is_expert_param(p)], expert_groups),
        ]
    values = []
    for members, over in kinds:
        grads = [_grad(p).detach().float() for p in members]
        if foreach:
            values.append(grad_stats(grads, (), norm_type, groups=over)[0].item())
        else:
            values.append(_plain_norm_value(grads, norm_type, over))
    value = max(values) if norm_type == math.inf else sum(values)
    return norm_of(value, norm_type)


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """What to multiply the gradients by (>= 1 means: leave them)."""
    return max_norm / (total_norm + 1e-6)


def clip_grad_norm(
    parameters: Iterable[torch.Tensor],
    max_norm: float = 1.0,
    norm_type: float = 2.0,
    *,
    groups: list | None = None,
    foreach: bool = True,
    expert_groups: list | None = None,
) -> float:
    """Scale every gradient by max_norm / total_norm when the total exceeds max_norm.

    Returns the total norm before clipping (inf or nan when a gradient is).
    """
    params = [p for p in parameters if _grad(p) is not None]
    total = get_grad_norm(
        params, norm_type, groups=groups, foreach=foreach, expert_groups=expert_groups
    )
    coeff = clip_coefficient(total, max_norm)
    if coeff < 1.0:
        grads = [_grad(p).detach() for p in params]
        if foreach:
            torch._foreach_mul_(grads, coeff)
        else:
            for g in grads:
                g.mul_(coeff)
    return total
