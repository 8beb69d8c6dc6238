"""The attention core's time, as the kernel that runs it (`accounting.attention_kernel`), and
context parallelism's communication around it: one layer, one microbatch, one TP rank
(`cost_model.layer_seconds` adds them to the layer's GEMMs and element-wise passes)."""

from dataclasses import replace

from megacore.context_parallel import steps_outside_window
from megatrain.config import Config
from megatrain.models.transformer_config import TransformerConfig
from megatrain.plan.accounting import (
    ATTENTION_IMPLEMENTATIONS,
    attention_core_flops,
    attention_kernel_for,
    attention_widths,
    context_parallel_numbers,
    layer_gemms,
)
from megatrain.plan.accounting.flops import window_flops_layers
from megatrain.plan.costs import Costs
from megatrain.plan.layout import Layout

# HBM bytes megacore's ring attention (context_parallel._block_attention, float32) moves a
# score and head besides its GEMMs, each torch op reading and writing the block's scores once
# (4 bytes an element; the mask's byte per score where an op reads it): forward, the scale
# (8), torch.where with the mask (9), logsumexp (24: amax, the difference, exp, the sum) and
# softmax (8); backward, softmax's (12), logsumexp's (24: the difference, exp, the product),
# the two gradients summed (12), torch.where's (9) and the scale's (8).
RING_FORWARD_BYTES = 8 + 9 + 24 + 8
RING_BACKWARD_BYTES = 12 + 24 + 12 + 9 + 8
# Bytes a (query, key) pair of the masks moves, whatever the heads: the all-gather path's
# boolean mask written (1), read for the rows that see no key (1), and converted by SDPA to
# the additive mask (1 read, 2 written); the ring's written and read for each block (2).
MASKED_MASK_BYTES = 5
RING_MASK_BYTES = 2
# HBM bytes a score moves (16 bits) around Megatron-LM's two batched products in its fused
# attention ("fused_softmax"; megatron/model/fused_softmax.py and transformer.py as of the
# sc21 scripts, de7dc40f88): forward, the fused scale-mask-softmax reads the scores and
# writes the probabilities (4), dropout reads them and writes its output and its 1-byte mask
# (5); backward, dropout's reads the gradient and the mask and writes a gradient (5), the
# softmax's reads that and the probabilities and writes the scores' gradient (6).  Without
# dropout, the softmax's alone.
FUSED_SOFTMAX_BYTES = {"forward": 4, "backward": 6}
FUSED_SOFTMAX_DROPOUT_BYTES = {"forward": 5, "backward": 5}


def layer_mean_core_flops(cfg: TransformerConfig, queries: int, keys: int, skip: bool) -> float:
    """One layer's attention core FLOPs averaged over the layers, each at its own window
    (`accounting.window_flops_layers`: a sliding layer computes its band, a full one the
    square): the per-layer time the fused kernels are timed by, so that layers x it is the
    model's attention time with gpt-oss's alternation."""
    windows = window_flops_layers(cfg)
    return sum(attention_core_flops(cfg, queries, keys, skip, w) for w in windows) / len(windows)


def attention_core_seconds(
    config: Config, cfg: TransformerConfig, layout: Layout, costs: Costs
) -> list[tuple[float, float]]:
    """(forward, backward) seconds of one layer's attention core for one microbatch on one
    TP rank: the rank's s / cp queries of each sequence against all s keys, as the kernel
    `accounting.attention_kernel` names runs (the GPU's `attention`, the precision, cp and
    its communication; q heads of d on the rank, g key/value groups, b sequences):

    - "flash" (16 bits, cp 1): one kernel at the profile's attention rate, the masked half
      of causal attention skipped, moving q, k, v and the output (O(s h) bytes:
      `Costs.flash_attention`).
    - "masked" (16 bits, cp > 1, "allgather"): SDPA with megacore's boolean mask runs
      cuDNN's fused kernel (Hopper, Blackwell) or the memory-efficient one (A100), timed as
      one fused kernel at the same rate (no published figure for the masked kernels in
      this table's sources: an optimistic bound for them) but with every score's FLOPs (an
      arbitrary mask: no block skipped) and, besides q, k, v and the output, the additive
      mask read once per sequence and head (b q (s / cp) s x 2 bytes; the backward reads
      it again, as `Costs.flash_attention` counts all its bytes twice).  Besides the
      kernels, building the mask and converting it to the bias, 5 bytes a (query, key)
      pair (`MASKED_MASK_BYTES`), in the forward.
    - "ring" (cp > 1, "p2p", no packed documents): megacore's fused ring
      (`_fused_ring_seconds`).
    - "ring_float32" (cp > 1, "p2p", packed documents): megacore's float32 ring, cp blocks each of
      two float32 batched GEMMs per head (QK^T and probabilities x V, s / cp queries
      against s / cp keys) at the fp32 peak (torch leaves TF32 off and megatrain does not
      turn it on), and the float32 torch ops over each block's scores, memory-bound:
      `RING_FORWARD_BYTES` and `RING_BACKWARD_BYTES` a score and head, and each block's
      mask (`RING_MASK_BYTES` a pair).  No block is skipped without a window (megacore's
      balanced chunks give every block a visible key); the merge's O(s h / t) passes are
      left out (d cp / s of the scores').
    - Sliding-window layers under "p2p" run the float32 ring whatever the documents (the
      fused kernels take no window), computing only the blocks some local query sees through
      the window (megacore's `steps_outside_window`, averaged over the CP ranks); the model's
      layers are weighted by kind (gpt-oss: half sliding on the float32 ring, half full on the
      fused one).
    - "unfused" (the 2019 path): two batched GEMMs per head, QK^T and scores x V, each
      max(FLOPs, bytes) at `gemm_efficiency`; the softmax and dropout over the s x s scores
      are the layer's element-wise passes (`layer_seconds`)."""
    m, t = config.model, config.training
    cp, s, b, tp = layout.cp, t.seq_length, layout.micro_batch, layout.tp
    local, a = s // cp, m.num_attention_heads
    head = cfg.kv_channels or cfg.hidden_size // a
    # multi-latent attention: products over heads of d_q (scores) and d_v (context)
    qk_head, v_head = head, head
    if m.multi_latent_attention:
        qk_head, v_head = m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim
    heads = b * a / tp
    # the queries', the keys' and values' and the output's elements a token on the rank
    queries, kv, out = attention_widths(replace(config, parallel=_at_tp(config, tp)))
    kernel = attention_kernel_for(
        costs.attention, t.precision, cp, layout.cp_comm, config.data.reset_attention_mask
    )
    masks = b if config.data.reset_attention_mask else 1  # one causal mask, or per sequence
    if kernel in ("flash", "masked"):
        causal_skip = kernel == "flash"
        flops = b * layer_mean_core_flops(cfg, local, s, causal_skip) / tp
        nbytes = costs.element * b * ((queries + out) * local + kv * s)
        if kernel == "masked":  # the additive mask, read for every sequence and head
            nbytes += costs.element * heads * local * s
        fused = [costs.flash_attention(flops, nbytes, s)]
        if kernel == "masked":
            fused.append((costs.memory_bound(MASKED_MASK_BYTES * local * s * masks), 0.0))
        return fused
    if kernel == "unfused":
        return [
            costs.gemm_fwd_bwd(local, s, qk_head, heads),
            costs.gemm_fwd_bwd(local, v_head, s, heads),
        ]
    dims = (qk_head, v_head)
    if kernel == "ring":  # the full layers' (a sliding layer's ring is the float32 one, below)
        widths, unwindowed = (queries, kv, out), replace(cfg, window_size=None)
        full = _fused_ring_seconds(unwindowed, layout, costs, local, s, widths, heads, t.precision)
    else:  # "ring_float32"
        full = _float32_ring_seconds(costs, local, s, cp, cp, dims, heads, masks)
    windows = [w for w in window_flops_layers(cfg) if w is not None]
    if not windows:
        return full
    # megacore runs a sliding layer's ring as its float32 ring (the fused kernels take no
    # window), passing on unread the blocks no local query sees: the layers weighted by their
    # kind, the sliding ones' blocks counted as the ring visits them.
    share = len(windows) / len(window_flops_layers(cfg))
    seen = _blocks_seen(s, cp, windows[0])
    sliding = _float32_ring_seconds(costs, local, s, cp, seen, dims, heads, masks)
    return [(f * (1 - share), b * (1 - share)) for f, b in full] + [
        (f * share, b * share) for f, b in sliding
    ]


def _blocks_seen(s: int, cp: int, window: int) -> float:
    """The K/V blocks a CP rank's float32 ring computes with a sliding window, averaged over
    the ranks: its own and every step's that megacore does not skip (`steps_outside_window`)."""
    chunk = s // (2 * cp)
    return sum(cp - len(steps_outside_window(chunk, r, cp, window)) for r in range(cp)) / cp


def _float32_ring_seconds(costs, local, s, cp, blocks, head_dims, heads, masks):
    """megacore's float32 ring ("ring_float32"): two float32 batched GEMMs per head for each
    of the `blocks` K/V blocks of s / cp keys it computes, and the float32 torch ops over each
    block's scores, memory-bound."""
    qk_head, v_head = head_dims
    fp32 = Costs(costs.gpu, costs.profile, "fp32") if "fp32" in costs.gpu.peak_tflops else costs
    block = s // cp  # each block's keys
    gemms = [
        fp32.gemm_fwd_bwd(local, block, qk_head, heads),
        fp32.gemm_fwd_bwd(local, v_head, block, heads),
    ]
    scores = heads * local * block * blocks  # every computed block's, every head's
    passes = (
        costs.memory_bound(RING_FORWARD_BYTES * scores + RING_MASK_BYTES * local * s * masks),
        costs.memory_bound(RING_BACKWARD_BYTES * scores),
    )
    return [(f * blocks, b * blocks) for f, b in gemms] + [passes]


def _at_tp(config: Config, tp: int):
    """The config's parallel section at tensor parallelism tp (a layout's)."""
    return replace(config.parallel, tensor_model_parallel_size=tp)


def _fused_ring_seconds(cfg, layout, costs, local, s, widths, heads, precision):
    """megacore's fused ring (`attention_kernel` "ring"): cp kernel calls a pass, each of the
    rank's s / cp queries against a block of s / cp keys (the balanced chunks paired so that
    causal attention computes half of all the scores, as flash at cp 1), each merging its
    partial output into a float32 accumulator (read and written); the backward re-runs the
    ring.  In 16 bits on a GPU whose attention is "flash": FlashAttention-2 at the profile's
    rate for a call's s / cp keys.  Otherwise (fp32, or an "unfused" GPU) the memory-efficient
    kernel, for which no rate is published: its two products per head timed as GEMMs of the
    visible keys (at the fp32 peak in fp32), the scores never in memory."""
    cp, b = layout.cp, layout.micro_batch
    queries, kv, out = widths  # elements a token on the rank (`attention_widths`)
    flops = b * layer_mean_core_flops(cfg, local, s, True) / layout.tp
    visible = flops / (b * layer_mean_core_flops(cfg, local, s, False) / layout.tp)
    block = s // cp  # a call's keys
    # each call reads q and a K/V block and writes its output; the merge reads and writes the
    # float32 accumulator and reads the call's output
    call_bytes = costs.element * b * ((queries + out) * local + kv * block)
    merge = costs.memory_bound(cp * (2 * 4 + costs.element) * b * out * local)
    head = queries * layout.tp / cfg.num_attention_heads  # a query head's (d_q for MLA)
    v_head = out * layout.tp / cfg.num_attention_heads
    if ATTENTION_IMPLEMENTATIONS[costs.attention] == "flash" and precision != "fp32":
        forward, backward = costs.flash_attention(flops, cp * call_bytes, block)
        overhead = (cp - 1) * costs.profile.gemm_overhead_s  # cp calls, one counted
        return [(forward + overhead + merge, backward + overhead + merge)]
    gemm = Costs(costs.gpu, costs.profile, "fp32") if precision == "fp32" else costs
    keys = visible * block  # the visible keys of a call, on average
    return cp * [
        gemm.gemm_fwd_bwd(local, keys, head, heads),
        gemm.gemm_fwd_bwd(local, v_head, keys, heads),
    ] + [(merge, merge)]


def context_parallel_seconds(
    config: Config,
    layout: Layout,
    costs: Costs,
    core_forward: float,
    bandwidth: float,
    core_backward: float = 0.0,
) -> float:
    """Exposed seconds of one layer's CP communication for one microbatch on one TP rank
    (forward, backward, and the forward's again when the attention is recomputed);
    `core_forward` and `core_backward`: the attention core's forward and backward times,
    behind which the ring's transfers run."""
    cp = layout.cp
    if cp == 1:
        return 0.0
    t = config.training
    # The whole sequence's K and V on one TP rank (or under "latent" its KV latents and rope
    # keys, the same on every TP rank); each CP rank receives (cp - 1)/cp of it.
    numbers = context_parallel_numbers(
        replace(config, parallel=_at_tp(config, layout.tp)), layout.cp_comm
    )
    kv = costs.element * layout.micro_batch * t.seq_length * numbers
    if layout.cp_comm in ("allgather", "latent"):
        forward = costs.collective("all_gather", kv, cp, bandwidth)
        backward = costs.collective("reduce_scatter", kv, cp, bandwidth)
    else:  # each of cp - 1 blocks passed on while the block in hand is attended to
        step = costs.collective("p2p", kv / cp, 2, bandwidth)
        forward = (cp - 1) * max(0.0, step - core_forward / cp)
        if config.data.reset_attention_mask:  # the float32 ring: each block's gradient sent
            backward = (cp - 1) * step  # back before the next block's backward
        else:  # the fused ring re-runs: each step passes a K/V block and a float32 K/V
            # gradient on behind the step's kernel; the last gradient, going home, is exposed
            grads = costs.collective("p2p", 4 / costs.element * kv / cp, 2, bandwidth)
            backward = (cp - 1) * max(0.0, step + grads - core_backward / cp) + grads
    again = forward if layout.recompute in ("selective", "full") else 0.0
    return forward + backward + again


def latent_up_projection_seconds(
    config: Config, cfg: TransformerConfig, layout: Layout, costs: Costs
) -> tuple[float, float]:
    """(forward, backward) seconds `cp_comm_type = "latent"` adds to one layer for one
    microbatch on one TP rank: each CP rank up-projects the gathered latents of the whole
    sequence into its heads' keys and values (kv_b, [r_kv] -> heads / t x (d_n + d_v)), not
    only its own s / cp tokens' (which the layer's GEMMs count): the time of that GEMM over
    s b tokens less its time over s b / cp, its backward the input's and weight's gradients.
    0 for any other communication and at cp 1."""
    if layout.cp == 1 or layout.cp_comm != "latent":
        return 0.0, 0.0
    k, n = next(g for g in layer_gemms(cfg) if g.name == "kv_b").per_rank(layout.tp)
    whole = config.training.seq_length * layout.micro_batch
    forward, backward = costs.gemm_fwd_bwd(whole, n, k)
    local_forward, local_backward = costs.gemm_fwd_bwd(whole / layout.cp, n, k)
    return forward - local_forward, backward - local_backward
