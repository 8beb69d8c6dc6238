"""Cross entropy over vocabulary-parallel logits, without gathering the full logits.

Each TP rank holds logits for its slice of the vocabulary.  Three all-reduces
of per-token scalars replace a gather of [tokens, vocab]: the max logit (for
stability), the target's logit (only the rank owning the id contributes), and
the sum of exp(logit - max).  Backward is softmax minus one-hot, computed on the
local slice from what the forward kept.

`linear_vocab_parallel_cross_entropy` folds the output layer in as well: it never holds
the logits of more than a chunk of tokens, and returns the mean loss with its gradients
already made.
"""

import torch
import torch.distributed as dist

from megacore import parallel_state
from megacore.collectives import all_gather_flat
from megacore.tensor_parallel.utils import vocab_range
from megacore.tensor_parallel.weight_grad import accumulate_gemm


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


def _global_log_sum_exp(lse, target_logit, group, world):
    """Each token's log-sum-exp and target logit over every rank's vocabulary slice: one
    all-gather of both (the target's logit is 0 on the ranks that do not own it)."""
    mine = torch.stack([lse, target_logit])
    every = mine.new_empty(world * 2, mine.size(1))
    all_gather_flat(every, mine, group=group)
    every = every.view(world, 2, -1)
    return every[:, 0].logsumexp(0), every[:, 1].sum(0)


class _LinearCrossEntropyMean(torch.autograd.Function):
    """The mean cross entropy of x W^T over tokens, a chunk of tokens at a time, its gradients
    made in the forward: each chunk's logits become, in place, softmax minus one-hot, and
    then the chunk's input gradient and its share of the weight gradient.  The backward only
    scales them by the loss's upstream gradient (a scalar: why the op returns the mean)."""

    @staticmethod
    def forward(ctx, x, weight, target, chunk_tokens, true_vocab, need_x, need_w):
        group = parallel_state.get_tensor_model_parallel_group()
        world = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        start, _ = vocab_range(weight.size(0) * world, rank, world)
        tokens = x.size(0)
        losses = torch.empty(tokens, dtype=torch.float32, device=x.device)
        grad_x = torch.empty_like(x) if need_x else None
        # Summed over chunks in fp32 whatever the weight's dtype, as one GEMM would sum them.
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if need_w else None
        for c in range(0, tokens, chunk_tokens):
            xc, tc = x[c : c + chunk_tokens], target[c : c + chunk_tokens]
            inside = (tc >= start) & (tc < start + weight.size(0))
            local = (tc - start).masked_fill(~inside, 0)[:, None]
            logits = _chunk_logits(xc, weight, start, true_vocab)
            picked = logits.gather(1, local).squeeze(1).masked_fill_(~inside, 0.0)
            # A slice of nothing but padding has max -inf: shift by a finite number instead.
            top = logits.amax(-1).clamp_min_(torch.finfo(torch.float32).min)
            exp = logits.sub_(top[:, None]).exp_()  # in place: the logits are not needed again
            lse = top + exp.sum(-1).log()
            if world > 1:
                lse, picked = _global_log_sum_exp(lse, picked, group, world)
            losses[c : c + chunk_tokens] = lse - picked
            if grad_x is None and grad_w is None:
                continue
            # d mean / d logits: (the softmax over the whole vocabulary - one-hot) / tokens.
            grad = exp.mul_((top - lse).exp_().div_(tokens)[:, None])
            grad.scatter_add_(1, local, inside[:, None].to(grad.dtype).mul_(-1.0 / tokens))
            grad = grad.to(x.dtype)
            if grad_x is not None:
                torch.mm(grad, weight, out=grad_x[c : c + chunk_tokens])
            if grad_w is not None:
                accumulate_gemm(grad_w, grad.t(), xc)
        ctx.save_for_backward(grad_x, grad_w)
        ctx.weight_dtype = weight.dtype
        return losses.mean()

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w = ctx.saved_tensors
        if grad_x is not None:
            grad_x = grad_x * grad_loss.to(grad_x.dtype)
        if grad_w is not None:
            grad_w = (grad_w * grad_loss).to(ctx.weight_dtype)
        return grad_x, grad_w, None, None, None, None, None


def default_chunk_tokens(rows: int, device: torch.device) -> int:
    """Tokens per chunk of `rows` logits each: about 2^26 fp32 logits (256 MiB) a chunk on a
    GPU, 2^21 (8 MiB, in the caches) elsewhere, but never under 1024 tokens.  The floor: each
    chunk adds its share into the [rows, h] fp32 weight gradient, a read and write of all of
    it that the chunk's GEMMs must outweigh (on the CPU at vocabulary 50304, hidden 1024,
    64-token chunks made the op 1.5x slower than F.linear and the loss; 1024, as fast)."""
    budget = 2**26 if device.type == "cuda" else 2**21
    return max(1024, budget // rows)


def linear_vocab_parallel_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    true_vocab_size: int | None = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """The output layer and the mean cross entropy over tokens in one (0-d fp32): never holds
    the [tokens, vocab / tp] logits, only a chunk of tokens' worth of them.

    `x` [..., h] is the output layer's input as this rank sees it (after the layer's input
    mapping: copied into, or gathered from the sequence-parallel, tensor-parallel region),
    `weight` [vocab / tp, h] this rank's rows, `target` [...] global vocabulary ids; the ids
    at and above `true_vocab_size` are padding, never predicted.  Each chunk's log-sum-exp
    is combined over TP ranks by one all-gather.  When a gradient is wanted (grad mode on,
    `x` or `weight` requiring it), the forward also makes the input and weight gradients
    (Liger-Kernel's trade: no second output-layer GEMM, as cut-cross-entropy's recompute
    needs, but the gradients are held from forward to backward: [tokens, h] in x's dtype
    and [vocab / tp, h] in fp32).  Their rounding in a 16-bit dtype happens before the loss
    scale is known, so fp16 training (its loss scale keeps small gradients representable)
    must not use it.  Equal to `vocab_parallel_cross_entropy(F.linear(x, weight).float(),
    target).mean()` in value and gradient.
    `chunk_tokens`: tokens per chunk (None: `default_chunk_tokens`).
    """
    if x.shape[:-1] != target.shape or weight.size(-1) != x.size(-1):
        raise ValueError(
            "linear_vocab_parallel_cross_entropy: x shape "
            f"{tuple(x.shape)}, weight {tuple(weight.shape)} and target {tuple(target.shape)} "
            "must be [..., h], [vocab / tp, h] and [...]"
        )
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(weight.size(0), x.device)
    if chunk_tokens < 1:
        raise ValueError(f"linear_vocab_parallel_cross_entropy: chunk_tokens={chunk_tokens} < 1")
    grad = torch.is_grad_enabled()
    return _LinearCrossEntropyMean.apply(
        x.reshape(-1, x.size(-1)),
        weight,
        target.reshape(-1),
        chunk_tokens,
        true_vocab_size,
        grad and x.requires_grad,
        grad and weight.requires_grad,
    )
