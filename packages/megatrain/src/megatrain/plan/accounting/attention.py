"""The attention core's memory, from its config alone.

Which kernel the attention core runs as (`attention_kernel`) decides the s x s terms of
`activations_per_layer`.  Under context parallelism, what the attention over the whole
sequence keeps besides each rank's s / cp tokens (`context_parallel_attention_per_layer`),
and holds while it runs (`context_parallel_attention_working`).
"""

from megatrain.config import Config


def _context_parallel(config: Config) -> tuple[int, int, int]:
    """(cp, the whole sequence s, the tokens of it one CP rank holds: s / cp)."""
    cp = config.parallel.context_parallel_size
    s = config.training.seq_length
    return cp, s, s // cp


def attention_widths(config: Config) -> tuple[float, float, float]:
    """(the queries', the keys' and values' together, the output's) elements a token on one
    TP rank: a heads of d, K and V of g key/value groups (one whole group a rank when g < t);
    multi-latent attention's a heads of d_q = qk_head_dim + qk_pos_emb_head_dim queries and
    keys and d_v values, the values zero-padded to d_q as megatrain hands them to megacore's
    attention (its kernels take K and V of one shape; `models.attention.multi_latent`): K and
    V 2 a d_q a token (49,152 for DeepSeek-V3, whose unpadded K and V are 40,960)."""
    m, tp = config.model, config.parallel.tensor_model_parallel_size
    a = m.num_attention_heads
    if m.multi_latent_attention:
        d_q = m.qk_head_dim + m.qk_pos_emb_head_dim
        return a / tp * d_q, a / tp * 2 * d_q, a / tp * m.v_head_dim
    d = m.kv_channels or m.hidden_size // a
    return a / tp * d, 2 * max(m.num_query_groups or a, tp) / tp * d, a / tp * d


def context_parallel_numbers(config: Config, cp_comm: str | None = None) -> float:
    """Elements a token of another CP rank that one TP rank's attention receives, by
    `cp_comm` (the config's parallel.cp_comm_type when None): "p2p" and "allgather" its keys
    and values (`attention_widths`), "latent" multi-latent attention's compressed KV latent
    and shared rope key, kv_lora_rank + qk_pos_emb_head_dim, the same on every TP rank (576
    for DeepSeek-V3), from which each rank up-projects the whole sequence's K and V itself."""
    m = config.model
    if (cp_comm or config.parallel.cp_comm_type) == "latent":
        return m.kv_lora_rank + m.qk_pos_emb_head_dim
    return attention_widths(config)[1]


# How a layer's attention core runs (`attention_kernel`).
ATTENTION_KERNELS = ("flash", "masked", "ring", "ring_float32", "unfused")
# Implementations of a kernel that published runs ran and megatrain does not, so that the
# plan is checked against what each run did (published_runs.toml's `attention`): each keeps
# what its kernel keeps and runs where it runs, and only its time differs (cost_model's
# `Costs.flash_attention` and `layer_seconds`):
# - "flash_triton": FlashAttention in Triton (flash-attention's flash_attn_triton.py, what
#   llm-foundry's MPT ran with attn_impl "triton"), a flash kernel;
# - "fused_softmax": Megatron-LM's fused scale-mask-softmax CUDA kernel and torch's dropout
#   around the two batched products (Megatron-LM 2020-2022's path; its 2019 code ran
#   separate torch ops, "unfused"), an unfused kernel.
ATTENTION_IMPLEMENTATIONS = {
    "flash": "flash", "unfused": "unfused", "flash_triton": "flash", "fused_softmax": "unfused",
}  # fmt: skip


def attention_kernel(config: Config, attention: str) -> str:
    """How a layer's attention core runs at this config on a GPU whose attention is
    `attention` ("flash": SDPA's fused kernels, Ampere and newer; "unfused": the 2019
    kernels, V100 or asked for):

    - "flash": cp 1 in 16 bits with "flash": SDPA with is_causal and no mask runs a flash
      kernel (FlashAttention-2, or cuDNN's, which torch puts first on Hopper and Blackwell
      with cuDNN newer than 9.15): no s x s scores kept, the masked blocks of causal
      attention skipped.
    - "masked": cp > 1 with `cp_comm_type = "allgather"` (or "latent", whose K/V of the
      whole sequence are up-projected from the gathered latent) in 16 bits with "flash":
      megacore calls SDPA with a boolean mask over the gathered K/V (the keys each local
      query sees).
      Flash refuses a mask, so SDPA runs cuDNN's fused kernel where torch puts it first
      (sm90/sm100, cuDNN > 9.15: the H100s measured here ran it) or the memory-efficient
      kernel (A100), both fused, both taking the mask as an additive bias in the
      activations' dtype that SDPA converts it to: no scores kept, but every score computed,
      as neither can know which blocks the bias masks whole.
    - "ring": cp > 1 with "p2p" without packed documents, any GPU and precision: megacore's
      fused ring (`context_parallel._FusedRing`), one fused kernel call a ring step that
      returns its log-sum-exp (FlashAttention-2 in 16 bits on Ampere and newer, the
      memory-efficient kernel otherwise; a CPU's flash kernel), the balanced chunks paired so
      that causal attention computes half the scores, as flash at cp 1 does; it keeps q, k, v,
      the output and the log-sum-exp, and re-runs the ring in the backward.
    - "ring_float32": cp > 1 with "p2p" and packed documents (`data.reset_attention_mask`,
      whose masks cut blocks anywhere): megacore's ring of float32 torch ops (matmul, where,
      logsumexp, softmax, matmul), the scores and probabilities materialized and kept, no
      block skipped.
    - "unfused": otherwise (the 2019 kernels: "unfused" asked for, a V100, or fp32 outside
      the ring, where the fused kernels' figures do not apply).
    """
    p = config.parallel
    return attention_kernel_for(
        attention,
        config.training.precision,
        p.context_parallel_size,
        p.cp_comm_type,
        config.data.reset_attention_mask,
    )


def attention_kernel_for(
    attention: str, precision: str, cp: int, cp_comm: str, documents: bool = False
) -> str:
    """`attention_kernel` of a precision, context-parallel size and communication, with or
    without packed documents' masks (`documents`)."""
    if attention not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"attention must be one of {tuple(ATTENTION_IMPLEMENTATIONS)}, not {attention!r}"
        )
    attention = ATTENTION_IMPLEMENTATIONS[attention]
    if cp > 1 and cp_comm == "p2p":
        return "ring_float32" if documents else "ring"
    if attention == "unfused" or precision == "fp32":
        return "unfused"
    return "flash" if cp == 1 else "masked"


def flash_attention(config: Config, attention: str) -> bool:
    """Whether a layer's attention core runs as a flash kernel (no s x s scores in memory,
    causal blocks skipped): `attention_kernel` "flash" (asked for, 16 bits, cp 1)."""
    return attention_kernel(config, attention) == "flash"


def context_parallel_masks(config: Config) -> int:
    """How many copies of the allgather path's and the ring's mask a microbatch makes: one
    [1, 1, s/cp, s] mask for causal attention, shared by its sequences and heads, or one per
    sequence when each attends within its documents (`data.reset_attention_mask`)."""
    return config.training.micro_batch_size if config.data.reset_attention_mask else 1


def context_parallel_attention_per_layer(config: Config) -> float:
    """Bytes the attention of one layer keeps for one microbatch under context parallelism
    (cp > 1) beyond the rank's own per-token tensors (`activations_per_layer`), as
    megacore.context_parallel runs it; 0 at cp 1.  s the whole sequence, s/cp the rank's
    tokens, b micro batch, a heads of d, t tp, g key/value groups (one per TP rank when
    g < t), n the masks (`context_parallel_masks`: 1, or b with documents), in the 16-bit
    convention of `activations_per_layer` (fp32 runs double it):

    - "allgather" (`attention_kernel` "masked" on a GPU; on a CPU SDPA's fused CPU kernel
      keeps as little): the other ranks' keys and values, 4 (g/t) d (s - s/cp) b (SDPA
      keeps the gathered K/V of the whole sequence; the rank's own are the per-token k and
      v); the additive mask SDPA makes of the boolean one and its kernel keeps for the
      backward, 2 (s/cp) s n; the kernel's fp32 log-sum-exp, 4 (a/t) (s/cp) b, and its
      output, 2 (a/t) d (s/cp) b, which megacore's masked_fill (rows that see no key) copies
      into the projection's input.  No per-head scores.  The boolean mask is held only
      while the layer's attention runs (`context_parallel_attention_working`).
    - "latent" (multi-latent attention; `attention_kernel` "masked" as "allgather"): what
      "allgather" keeps, and besides the other ranks' gathered latents and rope keys, the
      up-projection's input, 2 (r_kv + d_r) (s - s/cp) b (the keys and values SDPA keeps are
      the up-projection's output for the whole sequence, of which the rank's own are the
      per-token k and v, as above).
    - "p2p" without packed documents (`attention_kernel` "ring", the fused ring): only what
      flash keeps at cp 1 for the rank's tokens, its fp32 log-sum-exp, 4 (a/t) (s/cp) b (q,
      k, v and the output are the per-token tensors counted by `activations_per_layer`).
    - "p2p" with packed documents ("ring_float32"): the ring's block attention is plain
      torch ops in float32 (no fused kernel):
      autograd keeps every block's K/V in float32, the whole sequence's (8 (g/t) d s b),
      the queries' float32 copy in a 16-bit run (4 (a/t) d (s/cp) b), every block's float32
      scores (logsumexp's input) and probabilities (softmax's output), 8 (a/t) (s/cp) s b,
      with its boolean mask (torch.where's condition), (s/cp) s n, the merge's stack of the
      cp blocks' float32 outputs, 4 (a/t) d s b, and their log-sum-exps, merged
      log-sum-exps and weights, 12 (a/t) s b.

    Under recompute "none" every layer keeps this; under "selective" and "full" the layer
    whose attention is being recomputed holds it, once.
    """
    m, p, t = config.model, config.parallel, config.training
    cp, whole, s = _context_parallel(config)
    if cp == 1:
        return 0.0
    b, a = t.micro_batch_size, m.num_attention_heads
    tp = p.tensor_model_parallel_size
    # the queries', K and V's and the output's elements a token on this rank
    width, kv_per_token, out = attention_widths(config)
    masks = context_parallel_masks(config)
    # Bytes of an fp32 element and of a boolean in the 16-bit convention (fp32 runs double).
    fp32, boolean = (2, 0.5) if t.precision == "fp32" else (4, 1)
    if p.cp_comm_type in ("allgather", "latent"):
        gathered = 2 * kv_per_token * (whole - s) * b
        if p.cp_comm_type == "latent":  # the gathered latents, the up-projection's input
            gathered += 2 * context_parallel_numbers(config) * (whole - s) * b
        kernel = fp32 * a / tp * s * b + 2 * out * s * b  # log-sum-exp and output
        return gathered + 2 * s * whole * masks + kernel
    if not config.data.reset_attention_mask:  # the fused ring: its log-sum-exp
        return fp32 * a / tp * s * b
    queries = 0 if t.precision == "fp32" else fp32 * width * s * b
    scores = 2 * fp32 * a / tp * s * whole * b + boolean * s * whole * masks
    merge = fp32 * (width + 3 * a / tp) * whole * b
    return fp32 * kv_per_token * whole * b + queries + scores + merge


def context_parallel_attention_working(config: Config) -> float:
    """Bytes one layer's attention holds under context parallelism only while it runs (one
    layer's at a time), in `context_parallel_attention_per_layer`'s convention; 0 at cp 1:

    - "allgather" and "latent": the boolean mask, (s/cp) s n bytes, from which SDPA makes
      its additive one (kept) and megacore the rows that see no key.
    - "p2p" without packed documents (the fused ring), in its backward (its forward holds
      less): two K/V blocks in flight, 2 x 2 (g/t) d (s/cp) b x 2 bytes; the two float32
      K/V-gradient accumulators travelling with them, 2 x 2 (g/t) d (s/cp) b x 4; the
      float32 query gradient, 4 (a/t) d (s/cp) b; the late query chunk's copies of the
      output's gradient, q and the output, 3 x 2 (a/t) d (s/cp) b / 2; and one kernel call's
      q, k and v gradients, 2 ((a/t) + 2 (g/t)) d (s/cp) b.
    - "p2p" with packed documents (the float32 ring): during a block's backward, three
      float32 tensors of its scores, 12 (a/t) (s/cp) (s/cp) b: the softmax's input gradient
      and logsumexp's exp(scores - lse) and its product with the gradient, before the two
      gradients are summed.
    """
    m, p, t = config.model, config.parallel, config.training
    cp, whole, s = _context_parallel(config)
    if cp == 1:
        return 0.0
    masks = context_parallel_masks(config)
    if p.cp_comm_type in ("allgather", "latent"):
        boolean = 0.5 if t.precision == "fp32" else 1
        return boolean * s * whole * masks
    fp32 = 2 if t.precision == "fp32" else 4
    heads = m.num_attention_heads / p.tensor_model_parallel_size
    b = t.micro_batch_size
    if not config.data.reset_attention_mask:  # the fused ring's backward
        queries, kv_per_token, _ = attention_widths(config)
        kv = kv_per_token * s * b  # a block's K and V
        width = queries * s * b  # the rank's queries
        # 16-bit tensors at 2 bytes and float32 ones at `fp32`, as above
        return 2 * 2 * kv + 2 * fp32 * kv + fp32 * width + 3 * 2 * width / 2 + 2 * (width + kv)
    return 3 * fp32 * heads * s * (whole // cp) * b
