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


def _chunk_logits(x, weight, start, true_vocab):
    """fp32 logits of a chunk of tokens against this rank's vocabulary rows, padding rows -inf;
    computed in the weight's dtype and then widened, as the unfused path does."""
    logits = torch.nn.functional.linear(x, weight).float()
    if true_vocab is not None and start + logits.size(-1) > true_vocab:
        logits[:, max(0, true_vocab - start) :] = float("-inf")
    return logits


class _LinearCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy of x W^T, a chunk of tokens at a time: the forward keeps only
    each token's log-sum-exp, the backward computes each chunk's logits again."""

    @staticmethod
    def forward(ctx, x, weight, target, chunk_tokens, true_vocab):
        group = parallel_state.get_tensor_model_parallel_group()
        world = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        rows = weight.size(0)
        start, end = vocab_range(rows * world, rank, world)
        outside = (target < start) | (target >= end)
        local_target = (target - start).masked_fill(outside, 0)
        lse = torch.empty(x.size(0), dtype=torch.float32, device=x.device)
        target_logit = torch.empty_like(lse)
        for c in range(0, x.size(0), chunk_tokens):
            logits = _chunk_logits(x[c : c + chunk_tokens], weight, start, true_vocab)
            picked = logits.gather(1, local_target[c : c + chunk_tokens, None]).squeeze(1)
            target_logit[c : c + chunk_tokens] = picked
            lse[c : c + chunk_tokens] = logits.logsumexp(-1)
        target_logit.masked_fill_(outside, 0.0)
        if world > 1:
            # The ranks' log-sum-exps combine as a log-sum-exp: two all-reduces for all chunks.
            top = lse.clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            both = torch.stack([(lse - top).exp(), target_logit])
            dist.all_reduce(both, group=group)
            lse = top + both[0].log()
            target_logit = both[1]
        ctx.save_for_backward(x, weight, lse, outside, local_target)
        ctx.chunk_tokens, ctx.start, ctx.true_vocab = chunk_tokens, start, true_vocab
        return lse - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        x, weight, lse, outside, local_target = ctx.saved_tensors
        step = ctx.chunk_tokens
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        # Summed over chunks in fp32 whatever the weight's dtype, as one GEMM would sum them.
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for c in range(0, x.size(0), step):
            xc = x[c : c + step]
            grad = _chunk_logits(xc, weight, ctx.start, ctx.true_vocab)
            grad.sub_(lse[c : c + step, None]).exp_()  # the softmax
            inside = (~outside[c : c + step]).to(grad.dtype)
            grad.scatter_add_(1, local_target[c : c + step, None], -inside[:, None])
            grad.mul_(grad_loss[c : c + step, None])
            grad = grad.to(x.dtype)
            if grad_x is not None:
                grad_x[c : c + step] = grad @ weight
            if grad_w is None:
                continue
            if grad.dtype == torch.float32:
                grad_w.addmm_(grad.t(), xc)
            else:
                grad_w += (grad.t() @ xc).float()
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        return grad_x, grad_w, None, None, None


def linear_vocab_parallel_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    true_vocab_size: int | None = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Per-token loss of the output layer and cross entropy in one: never holds the [tokens,
    vocab / tp] logits, only a chunk of tokens' worth of them.

    `x` [..., h] is the output layer's input as this rank sees it (after the layer's input
    mapping: copied into, or gathered from the sequence-parallel, tensor-parallel region),
    `weight` [vocab / tp, h] this rank's rows, `target` [...] global vocabulary ids; the ids
    at and above `true_vocab_size` are padding, never predicted.  The forward keeps each
    token's log-sum-exp (combined over TP ranks by two all-reduces for all chunks); the
    backward computes each chunk's logits again (one more output-layer GEMM, cut-cross-entropy's
    trade) and turns them into the input and weight gradients at once.  Equal to
    `vocab_parallel_cross_entropy(F.linear(x, weight).float(), target)` in value and gradient.
    `chunk_tokens`: tokens per chunk (None: about 2^26 fp32 logits a chunk).
    """
    if x.shape[:-1] != target.shape or weight.size(-1) != x.size(-1):
        raise ValueError(
            "linear_vocab_parallel_cross_entropy: x shape "
            f"{tuple(x.shape)}, weight {tuple(weight.shape)} and target {tuple(target.shape)} "
            "must be [..., h], [vocab / tp, h] and [...]"
        )
    if chunk_tokens is None:
        chunk_tokens = max(256, 2**26 // weight.size(0))
    if chunk_tokens < 1:
        raise ValueError(f"linear_vocab_parallel_cross_entropy: chunk_tokens={chunk_tokens} < 1")
    flat = x.reshape(-1, x.size(-1))
    losses = _LinearCrossEntropy.apply(
        flat, weight, target.reshape(-1), chunk_tokens, true_vocab_size
    )
    return losses.view(target.shape)
