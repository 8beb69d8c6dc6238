"""Memory of a layer's activations, from its config alone.

- **Memory**: the bytes one layer keeps per microbatch under each
  recompute mode (`activations_per_layer`; under context parallelism each rank's s / cp
  tokens, and what the attention over the whole sequence keeps besides:
  `context_parallel_attention_per_layer`, and holds while it runs:
  `context_parallel_attention_working`); `megatrain.plan.memory` adds them up per stage.
  Which kernel the attention core runs as (`attention_kernel`) decides the s x s terms.
"""

from megatrain.config import Config
from megatrain.plan.accounting.attention import (
    _context_parallel,
    context_parallel_attention_per_layer,
    flash_attention,
)
from megatrain.plan.accounting.recompute import op_selective_activations_per_token


def expert_layout(config: Config) -> tuple[int, int]:
    """(ep, etp) of a config: parallel.expert_model_parallel_size and
    expert_tensor_parallel_size (None: the tensor-parallel size)."""
    p = config.parallel
    etp = p.expert_tensor_parallel_size
    return p.expert_model_parallel_size, p.tensor_model_parallel_size if etp is None else etp


def moe_mlp_activations(config: Config) -> float:
    """A MoE layer's MLP activations per token, in the units of `activations_per_layer`'s
    TP-split term (bytes / (s b h) at 16 bits; what replaces the dense MLP's 4 or 8 f / h):
    the router's fp32 logits and scores (8 E / h); the permuted tokens the experts take and
    the outputs they give back, kept for the weights' gradients (2 x 2 k, each of the k
    copies of a token; x etp, whose ranks all take the tokens of their group); each copy's
    f_e-wide tensors (4 or 8 f_e / h, at f_e / etp on etp x the tokens: the same bytes); the
    shared expert's (4 or 8 f_s / h).  Tokens spread evenly over the experts (a balanced
    router): an expert-parallel rank takes as many copies as its tokens make."""
    m = config.model
    h, E, k = m.hidden_size, m.num_moe_experts, m.moe_router_topk
    f_tensors = 8 if config.model_switch("swiglu") else 4
    f_e = m.moe_ffn_hidden_size or config.ffn_hidden_size
    shared = m.moe_shared_expert_intermediate_size or 0
    etp = expert_layout(config)[1]
    return 8 * E / h + 4 * k * etp + f_tensors * (k * f_e + shared) / h


def moe_dispatch_bytes(config: Config) -> float:
    """Bytes the token dispatch of one MoE layer holds while it runs (once per stage, not
    kept): the all-to-all's send and receive buffers of the rank's s b / tp tokens x k
    copies x h (16 bits; x etp: gathered over the expert-tensor-parallel group); 0 when the
    experts are not split over ranks (ep = etp = 1)."""
    ep, etp = expert_layout(config)
    if ep * etp == 1:
        return 0.0
    m, t = config.model, config.training
    tokens = t.seq_length // config.parallel.context_parallel_size * t.micro_batch_size
    tokens /= config.parallel.tensor_model_parallel_size
    return 2 * 2 * tokens * etp * m.moe_router_topk * m.hidden_size


def mla_activations(config: Config, recompute: str) -> tuple[float, float]:
    """Multi-latent attention's tensors kept for the backward (`models.attention.
    multi_latent`), in `activations_per_layer`'s units (bytes / (s b h) at 16 bits), in place
    of multi-head attention's 4 + 4 g/a: (those split over TP with the heads, those whole on
    each rank), a heads of d_q = qk_head_dim + qk_pos_emb_head_dim, values of d_v.

    Split: the queries (a d_q, the core's input) and the projection's input (a d_v); without
    recompute the keys (a d_q) and the values, as the CUDA kernels take them: padded to d_q
    (the CPU's math kernel keeps kv_b's whole output, a (d_n + d_v), of which they are a
    view).  Selective recompute keeps neither (the core up-projects them again).  Whole: each
    latent (r_q, r_kv) as its down-projection gives it (kv_a's with the rope key, r_kv + d_r)
    and its norm's output (the up-projection's input), and RMSNorm's normalized input (for
    its weight's gradient; LayerNorm keeps statistics only); under selective recompute the
    rotated rope key d_r too (the core's input).  Norm statistics are left out, as for the
    layers' norms."""
    m = config.model
    h, a = m.hidden_size, m.num_attention_heads
    d_q, d_v, d_r = m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim, m.qk_pos_emb_head_dim
    kept = 3 if config.model_switch("normalization") == "rmsnorm" else 2  # per latent
    latents = kept * (m.q_lora_rank or 0) + kept * m.kv_lora_rank + d_r
    if recompute == "selective":
        return 2 * a * (d_q + d_v) / h, 2 * (latents + d_r) / h
    return 2 * a * (3 * d_q + d_v) / h, 2 * latents / h


def activations_per_layer(
    config: Config, recompute: str, moe: bool = False, attention: str = "unfused"
) -> float:
    """Bytes one layer keeps for one microbatch (Korthikanti et al. 2022, section 4; 16-bit
    activations, 1-byte dropout masks), s sequence, b micro batch, h hidden, a heads, t tp:

        none       s b h (34 + 5 a s / h)                     tp 1
                   s b h (10 + 24/t + 5 a s / (h t))          tp t
                   s b h (34/t + 5 a s / (h t))               tp t, sequence parallel
        selective  the same without the 5 a s / h term (the attention core's s x s tensors)
        full       2 s b h, the layer's input (/ t with sequence parallelism or
                   distribute_saved_activations)

    The 5 a s / h term is what attention that materializes its s x s scores keeps
    (`attention` "unfused", the default: the paper's kernels, and an upper bound for a real
    run whatever SDPA picks).  `attention` "flash" (what SDPA runs in 16 bits on Ampere and
    newer; `flash_attention`) keeps no scores: in place of the term, "none" keeps the
    kernel's fp32 row statistic (log-sum-exp), 4 a s b / t bytes, and its output is the
    projection's input counted above.  Under context parallelism the choice does not apply
    (see below: as megacore runs it).

    The 24 is what TP splits: q, k, v and the projection's input (8), the MLP's two
    f-wide tensors (16 at f = 4h); the 10 what it does not (the norms' and the linears'
    inputs, 8, and the two hidden dropout masks, 1 byte an element each).  Without hidden
    dropout (`model.hidden_dropout` 0: Llama's, MPT's) there are no masks and it is 8:
    megatrain's `_dropout` returns its input untouched at p = 0, so nothing is saved for it.
    In general 4 + 4 g/a + 4 f/h for g key/value groups, and
    4 + 4 g/a + 8 f/h with SwiGLU, which keeps four f-wide tensors (gate, up, SiLU(gate),
    their product).  A MoE layer (`moe`) has `moe_mlp_activations` in place of the MLP's
    4 or 8 f/h (TP-split: MoE at tp > 1 runs with sequence parallelism).  Multi-latent
    attention has `mla_activations` in place of 4 + 4 g/a, and its latents among the 10.

    Context parallelism (cp > 1): every per-token tensor above is the rank's s / cp tokens,
    so the per-token bytes are exactly 1/cp of cp 1's; in place of the 5 a s / h term,
    "none" keeps what the attention over the whole sequence keeps
    (`context_parallel_attention_per_layer`: the other ranks' K/V and the masks or scores),
    which "selective" and "full" recompute instead (the layer being recomputed holds it
    once: `megatrain.plan.memory`).
    """
    m, p, t = config.model, config.parallel, config.training
    cp, whole, s = _context_parallel(config)
    b, h, a = t.micro_batch_size, m.hidden_size, m.num_attention_heads
    tp = p.tensor_model_parallel_size
    sp = p.sequence_parallel and tp > 1
    if recompute == "full":
        split_input = sp or (p.distribute_saved_activations and tp > 1)
        return 2 * s * b * h / (tp if split_input else 1)
    if recompute == "op_selective":  # a published run's (RECOMPUTE_IMPLEMENTATIONS)
        return s * b * op_selective_activations_per_token(config)
    # k and v: g groups split over tp, or one whole group per rank when g < tp
    groups = max(m.num_query_groups or a, tp)
    f_tensors = 8 if config.model_switch("swiglu") else 4
    mlp = moe_mlp_activations(config) if moe else f_tensors * config.ffn_hidden_size / h
    attention_split, attention_unsplit = 4 + 4 * groups / a, 0.0
    if m.multi_latent_attention:
        attention_split, attention_unsplit = mla_activations(config, recompute)
    split = attention_split + mlp
    # the norms' and the linears' inputs, and the two hidden dropout masks where there is dropout
    unsplit = 8 + (2 if m.hidden_dropout else 0) + attention_unsplit
    dense = (unsplit + split) / tp if sp else unsplit + split / tp
    per_token = s * b * h * dense
    if recompute == "selective":
        return per_token
    if cp > 1:
        return per_token + context_parallel_attention_per_layer(config)
    if flash_attention(config, attention):
        return per_token + 4 * a * s * b / tp
    return per_token + s * b * h * 5 * a * whole / (h * tp)


def weight_grad_inputs_per_layer(config: Config) -> float:
    """Bytes one layer holds for one microbatch between ZB-H1's B and W steps: each dense
    GEMM's input and output gradient, from which W computes the weight gradient (16-bit).

    Per s b h, with t tp, g key/value groups, a heads, f the FFN size: the full-width
    tensors (the QKV and MLP inputs, all-gathered under sequence parallelism, and the
    projection's and the MLP's output gradients before they are reduced) 4, plus the
    TP-split ones: QKV's output gradient (1 + 2 g/a), the projection's input 1, the MLP's
    up gradients (f/h, twice with SwiGLU) and its down input f/h, each / t.  Under context
    parallelism s is the rank's s / cp tokens.
    """
    m, p, t = config.model, config.parallel, config.training
    s = _context_parallel(config)[2]
    b, h, a = t.micro_batch_size, m.hidden_size, m.num_attention_heads
    groups = max(m.num_query_groups or a, p.tensor_model_parallel_size)  # one per rank when fewer
    f = config.ffn_hidden_size / h
    up = 2 if config.model_switch("swiglu") else 1
    split = (1 + 2 * groups / a) + 1 + up * f + f
    return 2 * s * b * h * (4 + split / p.tensor_model_parallel_size)
