"""Gradient clipping by the global norm of a model split over tensor and pipeline ranks.

The norm is that of the unsplit model's gradients: every rank adds the p-th
powers of the gradients it owns, summed over the model-parallel group (TP x PP).
A parameter replicated over TP ranks (LayerNorm weights, row-parallel biases)
counts only on TP rank 0, and the tied word embeddings only on the first stage
(the last stage's copy is marked `shared_embedding`).  So the result equals
`torch.nn.utils.clip_grad_norm_` on the gathered model.  The distributed
optimizer passes its fp32 shards, which carry the same marks, and adds the
data-parallel group to `groups`, since each DP rank then holds a different piece.
"""

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from megacore import parallel_state as ps
from megacore.tensor_parallel import param_is_not_tensor_parallel_duplicate


def _grad(p: torch.Tensor) -> torch.Tensor | None:
    main = getattr(p, "main_grad", None)
    return p.grad if main is None else main


def counts_once(p: torch.Tensor) -> bool:
    """Whether p's gradient enters the global norm on this rank (so each element counts once)."""
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


def get_grad_norm(
    parameters: Iterable[torch.Tensor], norm_type: float = 2.0, *, groups: list | None = None
) -> float:
    """Global norm of the gradients of the whole model, the same on every rank of `groups`.

    `groups` defaults to the model-parallel group (TP x PP).
    """
    params = [p for p in parameters if _grad(p) is not None]
    grads = [_grad(p).detach().float() for p in params if counts_once(p)]
    device = comm_device(grads)
    groups = [ps.get_model_parallel_group()] if groups is None else groups
    if norm_type == math.inf:
        local = max((g.abs().max() for g in grads), default=torch.tensor(0.0))
        op = dist.ReduceOp.MAX
    else:
        local = sum((g.norm(norm_type) ** norm_type for g in grads), torch.tensor(0.0))
        op = dist.ReduceOp.SUM
    total = torch.as_tensor(local, dtype=torch.float32, device=device).reshape(1)
    for group in groups:
        dist.all_reduce(total, op=op, group=group)
    return total.item() if norm_type == math.inf else total.item() ** (1.0 / norm_type)


def clip_grad_norm(
    parameters: Iterable[torch.Tensor],
    max_norm: float = 1.0,
    norm_type: float = 2.0,
    *,
    groups: list | None = None,
) -> float:
    """Scale every gradient by max_norm / total_norm when the total exceeds max_norm.

    Returns the total norm before clipping (inf or nan when a gradient is).
    """
    params = [p for p in parameters if _grad(p) is not None]
    total = get_grad_norm(params, norm_type, groups=groups)
    coeff = max_norm / (total + 1e-6)
    if coeff < 1.0:
        for p in params:
            _grad(p).detach().mul_(coeff)
    return total
