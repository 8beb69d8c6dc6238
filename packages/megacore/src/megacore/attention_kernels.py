"""Fused attention kernels that return their log-sum-exp, and attention sinks over any of them.

A `FusedKernel` is one fused attention call that returns its output and float32 log-sum-exp
(lse), and the backward of that call given any output and lse.  The context-parallel ring
(`megacore.context_parallel`) merges its steps' partial results by their lse; sinks need the
lse too.  Which one runs (`fused_kernel`): on CPU `aten._scaled_dot_product_flash_attention
_for_cpu` (it takes an additive mask); on CUDA FlashAttention-2 in 16 bits on sm80 and newer
(no mask), else the memory-efficient kernel (an additive bias as the mask).  The CUDA calls
are not run by the CPU tests; `scripts/gpu_check.sh` runs them.

Attention sinks (gpt-oss): a learned logit per head that joins the softmax's denominator and
nothing else, p_j = exp(l_j) / (sum_i exp(l_i) + exp(sink)).  With lse = log sum_i exp(l_i),
the sink output is plain attention's output times exp(lse) / (exp(lse) + exp(sink)) =
sigmoid(lse - sink), and lse' = logaddexp(lse, sink) is the log of the new denominator
(`with_sinks`).  So sinks compose with any kernel that returns the lse, or with partial results
merged by lse (the ring): apply them once to the final output.  Backward: a kernel's backward
given (out', lse') recomputes p_j = exp(l_j - lse') — the sink softmax — and its
D = grad . out', which is the sink softmax's too, so its dq, dk, dv are exact; the sink's own
gradient is -sum over queries of exp(sink - lse') * (grad . out') (`sink_gradient`: the sink
column has a zero value row).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "FusedKernel",
    "additive_mask",
    "attention_with_sinks",
    "fused_kernel",
    "sink_gradient",
    "with_sinks",
]


@dataclass(frozen=True)
class FusedKernel:
    """One fused attention call that returns its log-sum-exp, and its backward.

    forward(q, k, v, causal, scale, mask=None) -> out [b, heads, s_q, d] (q's dtype), lse
    [b, heads, s_q] (float32).  backward(grad, q, k, v, out, lse, causal, scale, mask=None) ->
    dq, dk, dv: the gradient of one call given any out and lse; given the final out and lse of
    a softmax over more keys than this call's (the ring's other blocks, a sink), it is exactly
    this call's share of that softmax's gradient.  causal: SDPA's top-left causal mask
    (s_q = s_k here).  mask: an additive float mask [b or 1, 1 or heads, s_q, s_k] of q's dtype
    (`additive_mask`), only where `masks`.  k, v may have fewer heads (groups).
    """

    name: str
    forward: Callable
    backward: Callable
    masks: bool = False  # whether forward and backward take a mask


def fused_kernel(q, k, v, masked: bool = False) -> FusedKernel | None:
    """The fused kernel for these tensors (one that takes a mask if `masked`), or None where
    none is built (the callers then use float32 torch ops)."""
    if not q.dtype == k.dtype == v.dtype:
        return None
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16):
        return _CPU_FLASH
    if q.device.type != "cuda" or q.size(-1) % 8 or q.size(-1) > 256:
        return None  # the CUDA kernels' head sizes: multiples of 8, at most 256
    half = q.dtype in (torch.float16, torch.bfloat16)
    if half and not masked and torch.cuda.get_device_capability(q.device) >= (8, 0):
        return _CUDA_FLASH  # FlashAttention-2: 16-bit, sm80 and newer
    if half or q.dtype == torch.float32:
        return _CUDA_EFFICIENT  # memory-efficient attention: float32, 16-bit before sm80, masks
    return None


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: attend) as the kernels take it: 0 where seen, -inf elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        ~mask, float("-inf")
    )


def _cpu_flash_forward(q, k, v, causal, scale, mask=None):
    # The CPU kernel takes grouped K/V heads as SDPA's enable_gqa does (head h uses group
    # h // (heads // groups)), forward and backward, so K/V are not expanded here.
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=mask, scale=scale
    )


def _cpu_flash_backward(grad, q, k, v, out, lse, causal, scale, mask=None):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale
    )


def expand_groups(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, groups, s, d] -> [b, heads, s, d], head h holding group h // (heads // groups)
    (the CUDA kernels are called with as many K/V heads as query heads)."""
    groups = kv.size(1)
    return kv if groups == heads else kv.repeat_interleave(heads // groups, dim=1)


def sum_groups(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of `expand_groups`: each group's heads summed."""
    heads = grad.size(1)
    return grad if groups == heads else grad.unflatten(1, (groups, heads // groups)).sum(2)


def _no_dropout_seed() -> torch.Tensor:
    # The CUDA kernels' philox seed and offset, read only with dropout (never here).
    return torch.empty((), dtype=torch.int64)


def _cuda_flash_forward(q, k, v, causal, scale, mask=None):
    heads = q.size(1)
    k, v = expand_groups(k, heads), expand_groups(v, heads)
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale
    )
    return out, lse


def _cuda_flash_backward(grad, q, k, v, out, lse, causal, scale, mask=None):
    heads, groups = q.size(1), k.size(1)
    seed = _no_dropout_seed()
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad, q, expand_groups(k, heads), expand_groups(v, heads), out, lse,
        None, None, q.size(2), k.size(2), 0.0, causal, seed, seed, scale=scale,
    )  # fmt: skip
    return dq, sum_groups(dk, groups), sum_groups(dv, groups)


_EFFICIENT_LSE_ROWS = 32  # the memory-efficient kernel's log-sum-exp is padded to 32 rows


def _efficient_bias(mask, q, k):
    # The kernel wants the bias of every (batch, head) and a key stride that is a multiple of
    # its alignment: expanded views of a mask padded to 16 keys, sliced back.
    if mask is None:
        return None
    b, heads, s_q, s_k = q.size(0), q.size(1), q.size(2), k.size(2)
    padded = F.pad(mask, (0, -s_k % 16))[..., :s_k]
    return padded.expand(b, heads, s_q, s_k)


def _cuda_efficient_forward(q, k, v, causal, scale, mask=None):
    heads = q.size(1)
    bias = _efficient_bias(mask, q, k)
    k, v = expand_groups(k, heads), expand_groups(v, heads)
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, causal, scale=scale
    )
    return out, lse[..., : q.size(2)]


def _cuda_efficient_backward(grad, q, k, v, out, lse, causal, scale, mask=None):
    heads, groups = q.size(1), k.size(1)
    lse = F.pad(lse, (0, -q.size(2) % _EFFICIENT_LSE_ROWS)).contiguous()  # as it gave it
    seed = _no_dropout_seed()
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad, q, expand_groups(k, heads), expand_groups(v, heads), _efficient_bias(mask, q, k),
        out, lse, seed, seed, 0.0, [True, True, True, False], causal, scale=scale,
    )  # fmt: skip
    return dq, sum_groups(dk, groups), sum_groups(dv, groups)


_CPU_FLASH = FusedKernel("cpu flash", _cpu_flash_forward, _cpu_flash_backward, masks=True)
_CUDA_FLASH = FusedKernel("cuda flash", _cuda_flash_forward, _cuda_flash_backward)
_CUDA_EFFICIENT = FusedKernel(
    "cuda efficient", _cuda_efficient_forward, _cuda_efficient_backward, masks=True
)


# --- attention sinks ------------------------------------------------------------------------


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor):
    """Plain attention's output and lse [b, heads, s] -> the sink attention's output (out's
    dtype) and lse (float32), for `sinks` [heads] (module doc).  Differentiable."""
    acc = torch.promote_types(lse.dtype, torch.float32)  # float64 stays float64
    lse = lse.to(acc)
    total = torch.logaddexp(lse, sinks.to(acc)[None, :, None])
    scaled = out.to(acc) * torch.exp(lse - total).unsqueeze(-1)
    return scaled.to(out.dtype), total


def sink_gradient(grad, out, lse, sinks) -> torch.Tensor:
    """d loss / d sinks [heads] given the sink attention's output `out` and lse (module doc)."""
    acc = torch.promote_types(lse.dtype, torch.float32)
    weight = torch.exp(sinks.to(acc)[None, :, None] - lse.to(acc))  # the sink's probability
    return -(weight * (grad.to(acc) * out.to(acc)).sum(-1)).sum((0, 2)).to(sinks.dtype)


class _SinkAttention(torch.autograd.Function):
    """One fused kernel call with sinks: saves q, k, v, the sink output and its lse."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, mask, causal, scale, kernel):
        out, lse = kernel.forward(q, k, v, causal, scale, mask)
        out, lse = with_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.mask, ctx.causal, ctx.scale, ctx.kernel = mask, causal, scale, kernel
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        grad = grad.contiguous()
        dq, dk, dv = ctx.kernel.backward(grad, q, k, v, out, lse, ctx.causal, ctx.scale, ctx.mask)
        return dq, dk, dv, sink_gradient(grad, out, lse, sinks), None, None, None, None


def _attention_and_lse(q, k, v, mask, causal, scale):
    """Attention and its lse in float32 (or float64) torch ops, differentiable: for what no kernel
    takes."""
    acc = torch.promote_types(q.dtype, torch.float32)
    k, v = expand_groups(k, q.size(1)).to(acc), expand_groups(v, q.size(1)).to(acc)
    scores = torch.matmul(q.to(acc), k.transpose(-1, -2)) * scale
    if causal:
        seen = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~seen, float("-inf"))
    if mask is not None:
        scores = scores + mask.to(acc)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.softmax(scores, dim=-1), v).to(q.dtype), lse


def attention_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of q [b, heads, s_q, d] over k, v [b, groups, s_k, d] with a sink logit per
    head (`sinks` [heads], differentiable) in the softmax's denominator.  `mask`: boolean
    [b or 1, 1, s_q, s_k] (True: attend) or None; `causal`: the top-left causal mask.  Every
    query must see at least one key.  A fused kernel where one takes these tensors, else
    float32 torch ops."""
    scale = q.size(-1) ** -0.5 if scale is None else scale
    kernel = fused_kernel(q, k, v, masked=mask is not None)
    if kernel is not None and mask is not None and not kernel.masks:
        kernel = None
    additive = None if mask is None else additive_mask(mask, q.dtype)
    if kernel is None:
        out, lse = _attention_and_lse(q, k, v, additive, causal, scale)
        return with_sinks(out, lse, sinks)[0]
    return _SinkAttention.apply(q, k, v, sinks, additive, causal, scale, kernel)
