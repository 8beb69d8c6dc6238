"""The attention core every kind shares: softmax(q k^T / sqrt(d)) v over [b, heads, s, d], through
the kernel that fits the call — `scaled_dot_product_attention` (flash-eligible when causal on
CUDA: `is_causal`, never an s x s mask), FlexAttention's block mask for packed documents and
sliding windows on CUDA, the dense mask on the CPU, megacore's context-parallel attention when
the sequence is split over CP ranks — and its cached form for generation.  Attention sinks
(a logit per head in the denominator) go through `megacore.attention_kernels`, on any kernel
that returns the log-sum-exp (FlexAttention's on CUDA with windows or documents).

An attention kind computes its queries, keys and values and hands them here; what it
projects (and how it splits heads over TP) is its own.
"""

import torch
import torch.nn.functional as F

from megacore import tensor_parallel as tp
from megacore.attention_kernels import attention_with_sinks, with_sinks
from megacore.context_parallel import context_parallel_attention
from megatrain.models.attention.inputs import AttentionInputs
from megatrain.models.attention.kv_cache import KVCache
from megatrain.models.attention.masks import (
    attention_block_mask,
    causal_mask,
    document_mask,
    flex_attention,
)


def attend(
    q, k, v, mask=None, *, causal: bool, dropout_p: float, tp_size: int, context_parallel,
    window: int | None = None, sinks: torch.Tensor | None = None,
):  # fmt: skip
    """Attention over q [b, heads, s, d] and k, v [b, groups, s, d] (grouped-query when fewer).

    `mask`: keys to attend [b, 1, 1, s] (bidirectional), or, causal, the batch's
    `AttentionInputs` (positions, documents).  `context_parallel`: the layer's
    `parallelize.ContextParallel` (None: this rank holds the whole sequence).  `tp_size`: with
    dropout at tp > 1 each rank draws its heads' masks from the model-parallel stream.
    `window`: a causal sliding window (`masks`); `sinks`: this rank's heads' sink logits
    [heads] (`megacore.attention_kernels`; no dropout with them)."""
    # The flash-eligible call (bf16/fp16 on CUDA) when causal: no attn_mask (is_causal
    # instead of a materialized s x s mask), 4-D [b, heads, s, d] inputs with head_dim
    # <= 256, and the last dimension of stride 1.  Flash takes the batch, head and
    # sequence strides as they come, so the permuted views of the QKV output need no
    # contiguous() copy.  Bidirectional: the key-padding mask [b, 1, 1, s] broadcasts.
    p = dropout_p
    if isinstance(mask, AttentionInputs):  # causal; packed documents: within each
        inputs, segments, mask = mask, mask.segments, None
        cp = context_parallel
        if cp is not None:  # the sequence is split over CP ranks: attend over all of it
            positions = cp.positions(q.shape[2], q.device)
            return context_parallel_attention(
                q, k, v, q_positions=positions, kv_positions=positions, segments=segments,
                comm_type=cp.comm_type, group=cp.group, window=window, sinks=sinks,
            )  # fmt: skip
        if segments is not None or window is not None:
            if q.is_cuda and not p:  # FlexAttention skips the masked blocks
                block = inputs.block_masks.get(window)
                if block is None:
                    b, s = q.shape[0], q.shape[2]
                    block = attention_block_mask(segments, window, b, s, q.device)
                    inputs.block_masks[window] = block
                if sinks is None:
                    return flex_attention(q, k, v, block)
                return with_sinks(*flex_attention(q, k, v, block, return_lse=True), sinks)[0]
            if window is not None and not p and q.shape[2] > 2 * _window_block(window):
                return windowed_attention(q, k, v, window, segments, sinks)
            mask, causal = _dense_mask(segments, window, q), False  # SDPA with the s x s mask
    elif causal and window is not None:
        if not p and q.shape[2] > 2 * _window_block(window):
            return windowed_attention(q, k, v, window, None, sinks)
        mask, causal = causal_mask(q.shape[2], window, q.device), False
    if sinks is not None:
        return attention_with_sinks(q, k, v, sinks, mask=mask, causal=causal)
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    # No random numbers needed (so none need seeding, e.g. for evaluation); or one TP rank,
    # whose heads the default stream serves: no generator swap, which torch.compile cannot
    # trace (it would cut the compiled layer in three around the attention).
    if not p or tp_size == 1:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, **gqa
        )
    # Local heads: another mask on each TP rank.  Under sequence parallelism the layer's
    # caller has forked around the whole layer and this fork is a no-op (no swap).
    with tp.get_rng_tracker().fork():
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, **gqa
        )


def _window_block(window: int) -> int:
    # Queries a call: a block of B queries sees at most B + window - 1 keys, so the work is
    # s (B + w) scores; B = w keeps it within twice the band, and at least 64 keeps the calls
    # few enough for the kernels to run at speed.
    return max(window, 64)


def windowed_attention(q, k, v, window: int, segments=None, sinks=None):
    """Causal sliding-window attention (with documents, with sinks) in blocks of queries, all
    in one kernel call, each block against only the keys its window reaches: work and memory
    grow with s x window, not s^2 (the CPU's path; CUDA's is FlexAttention's block mask).
    Exact: each query sees all its keys in its block, so no merge is needed."""
    b, s, block = q.shape[0], q.shape[2], _window_block(window)
    n = -(-s // block)
    tail, span = n * block - s, block + window - 1  # queries padded to n blocks; keys a block
    # The blocks as views of zero-padded copies (queries split, keys and values unfolded into
    # overlapping windows), so that autograd's backward is one pass over each: a slice a block
    # would write a full-size gradient a block (s^2 / block).  [b n, heads or groups, ., d]
    qb = F.pad(q, (0, 0, 0, tail)).unflatten(2, (n, block)).transpose(1, 2).flatten(0, 1)

    def windows(x):
        x = F.pad(x, (0, 0, window - 1, tail)).unfold(2, span, block)  # [b, g, n, d, span]
        return x.permute(0, 2, 1, 4, 3).flatten(0, 1)

    kb, vb = windows(k), windows(v)
    queries = torch.arange(n * block, device=q.device).view(n, block, 1)
    starts = torch.arange(n, device=q.device)[:, None, None] * block - (window - 1)
    keys = starts + torch.arange(span, device=q.device)  # [n, 1, span]: padding at < 0
    mask = (keys <= queries) & (queries - keys < window) & (keys >= 0)  # [n, block, span]
    mask = mask[None, :, None]  # [1, n, 1, block, span]
    if segments is not None:  # padded queries and keys in a document of their own (-1)
        seen = F.pad(segments, (window - 1, tail), value=-1).unfold(1, span, block)
        mine = F.pad(segments, (0, tail), value=-1).view(b, n, block)
        mask = mask & (mine[..., :, None] == seen[..., None, :])[:, :, None]
    mask = mask.expand(b, n, 1, block, span).flatten(0, 1)
    if sinks is not None:
        out = attention_with_sinks(qb, kb, vb, sinks, mask=mask)
    else:
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, **gqa)
    return out.unflatten(0, (b, n)).transpose(1, 2).flatten(2, 3)[:, :, :s]


def _dense_mask(segments, window, q):
    if segments is not None:
        return document_mask(segments, window)
    return causal_mask(q.shape[2], window, q.device)


def attend_cached(q, k, v, cache: KVCache, layer_id: int, window=None, sinks=None):
    """Causal attention of new queries over the cached keys and values and their own (appended
    to `cache`, layer `layer_id`'s: the local key/value heads, groups, not heads).  A sliding
    layer (`window`) caches only the window_size - 1 positions its next query can see."""
    offset, s = cache.offset, q.shape[2]
    if window is None:
        k, v = cache.append(layer_id, k, v)
        first = 0
    else:
        k, v, first = cache.append_windowed(layer_id, k, v, window)
    if offset == 0 and window is None:
        mask, causal = None, True
    else:  # query i sits at position offset + i and sees the keys up to there (in the window)
        mask, causal = causal_mask(s, window, q.device, offset, offset + s)[..., first:], False
    if sinks is not None:
        return attention_with_sinks(q, k, v, sinks, mask=mask, causal=causal)
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, **gqa)
