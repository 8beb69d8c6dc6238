"""Cross entropy over vocabulary-parallel logits, without gathering the full logits.

Each TP rank holds logits for its slice of the vocabulary.  Three all-reduces
of per-token scalars replace a gather of [tokens, vocab]: the max logit (for
stability), the target's logit (only the rank owning the id contributes), and
the sum of exp(logit - max).  Backward is softmax minus one-hot, computed on the
local slice from what the forward kept.
"""

import torch
import torch.distributed as dist

from megacore import parallel_state
from megacore.tensor_parallel.utils import vocab_range


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target):
        group = parallel_state.get_tensor_model_parallel_group()
        world = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        # Work in fp32 whatever the logits' dtype: exp and sums over 50k entries need it.
        ctx.logits_dtype = logits.dtype
        logits = logits.float()

        logits_max = logits.max(dim=-1).values
        if world > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)

        partition = logits.size(-1)
        start, end = vocab_range(partition * world, rank, world)
        outside = (target < start) | (target >= end)
        local_target = (target - start).masked_fill(outside, 0)
        flat = shifted.view(-1, partition)
        rows = torch.arange(flat.size(0), device=flat.device)
        target_logit = flat[rows, local_target.reshape(-1)].view(target.shape)
        target_logit = target_logit.masked_fill(outside, 0.0)

        exp = shifted.exp_()  # in place: `shifted` is not needed again
        sum_exp = exp.sum(dim=-1)
        if world > 1:
            both = torch.stack([target_logit, sum_exp])
            dist.all_reduce(both, group=group)
            target_logit, sum_exp = both.unbind(0)
        loss = sum_exp.log() - target_logit

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, outside, local_target = ctx.saved_tensors
        grad = softmax  # reuse the saved buffer: backward runs once
        flat = grad.view(-1, grad.size(-1))
        rows = torch.arange(flat.size(0), device=flat.device)
        flat[rows, local_target.reshape(-1)] -= (~outside).reshape(-1).to(flat.dtype)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    """Per-token loss -log softmax(logits)[target], logits split along the last dim over TP.

    `vocab_parallel_logits` is [..., vocab / tp] (this rank's slice), `target` is
    [...] of global vocabulary ids.  Returns fp32 [...] (no reduction: the caller
    applies its loss mask).  Equal to `torch.nn.functional.cross_entropy` on the
    gathered logits, in value and gradient.
    """
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(
            "vocab_parallel_cross_entropy: logits shape "
            f"{tuple(vocab_parallel_logits.shape)} is not target shape {tuple(target.shape)} "
            "plus a vocabulary dimension"
        )
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target)
