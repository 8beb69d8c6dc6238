"""FLOPs of a model, from its config alone.

- **FLOPs**: the forward pass of the layers (`transformer_forward_flops`; a MoE layer's MLP
  at its k active experts and its shared expert, as Megatron-LM's
  `num_floating_point_operations` counts them) plus each kind's
  heads (`gpt_forward_flops`, `bert_forward_flops`); an iteration's model FLOPs, the
  numerator of MFU (`*_model_flops_per_iteration`), and hardware FLOPs, the numerator of HFU,
  which add what recomputation runs again (`recomputed_flops`,
  `*_hardware_flops_per_iteration`); both by kind (`flops_per_iteration`).  Multi-token
  prediction's depths count as layers of their positions' kinds, and each its eh_proj and
  its logits with the heads (Megatron-LM's `num_floating_point_operations` counts them).
"""

from megatrain.config import RECOMPUTE_CHOICES
from megatrain.models.moe import is_moe_layer
from megatrain.models.transformer_config import TransformerConfig
from megatrain.plan.accounting.gemms import layer_gemms
from megatrain.plan.accounting.parameters import (
    _attention_width,
    expert_ffn_size,
    moe_layer_count,
    mtp_layer_numbers,
)
from megatrain.plan.accounting.recompute import OP_SELECTIVE_RERUN, RECOMPUTE_IMPLEMENTATIONS

# The fraction of tokens BERT predicts (its masking rate), for the FLOP count.
MASKED_LM_PROB = 0.15


def attention_core_flops(
    cfg: TransformerConfig, queries: int, keys: int, causal_skip: bool, window: int | None = None
) -> float:
    """FLOPs of one layer's attention core for `queries` against `keys` (one sequence):
    scores QK^T and scores x V, 2 x 2 queries keys (heads x head_dim); multi-latent
    attention's 2 queries keys heads (d_n + d_r) and 2 queries keys heads d_v (Megatron-LM's
    MLA terms, there halved for the causal mask).  `causal_skip`: a kernel that skips the
    masked blocks of causal attention (flash) does half.  `window` (a sliding layer's,
    `window_flops_layers`): each query sees at most `window` keys, so the band of
    queries x min(window, keys) counts in the place of the square, and a kernel that skips
    what no query sees computes it less its causal corner, 1 - min(window, keys) / (2 keys)
    of it (half when the window spans the sequence)."""
    if cfg.attention_type == "mla":
        a = cfg.num_attention_heads
        widths = a * (cfg.qk_head_dim + cfg.qk_pos_emb_head_dim) + a * cfg.v_head_dim
    else:
        widths = 2 * _attention_width(cfg)
    seen = keys if window is None else min(window, keys)
    full = 2 * queries * seen * widths
    return full * (1 - seen / (2 * keys)) if causal_skip and cfg.causal else full


def window_flops_layers(cfg: TransformerConfig) -> list:
    """Each layer's sliding window (None: full attention), as `models.spec` builds them, multi-
    token prediction's layers after the model's."""
    from megatrain.models.spec import is_sliding_layer

    layers = [*range(cfg.num_layers), *mtp_layer_numbers(cfg)]
    return [cfg.window_size if is_sliding_layer(cfg, i) else None for i in layers]


def transformer_forward_flops(cfg: TransformerConfig, batch: int, seq: int) -> tuple[float, float]:
    """FLOPs of one forward pass of the layers, in two parts the recompute modes redo
    differently: (the dense matmuls, the attention cores).

    Only matrix multiplies count, a multiply-add as 2 FLOPs (Narayanan et al. 2021, appendix).
    Per layer, for B s tokens: QKV 2Bsh(3h), projection 2Bsh^2, MLP 2Bsh(f) twice, so
    8Bsh^2 + 4Bshf (= 24Bsh^2 at f = 4h); with grouped-query attention QKV is 2Bsh(h + 2gd)
    (g key/value heads of d), and SwiGLU's MLP three matrices, 6Bshf (a MoE layer's at
    `active_ffn_width`, k f_e + the shared expert, for f); the attention core,
    scores QK^T 2Bs^2h and scores x V 2Bs^2h, 4Bs^2h (the full s x s matrix, as the paper
    counts it, though a causal kernel skips the masked half: `megatrain plan` times that
    half, MFU counts it all).  Embeddings, norms, GeLU, softmax and dropout are not
    matmuls and are left out.  The dense matmuls are `layer_gemms`' summed, the list the
    time model times (test_flops holds them to these closed forms).  Multi-token
    prediction's layers count among them, each of its position's kind.
    """
    mtp = mtp_layer_numbers(cfg)
    n = cfg.num_layers + len(mtp)
    moe = moe_layer_count(cfg) + sum(is_moe_layer(cfg, i) for i in mtp)
    per_token = (n - moe) * _gemm_flops(cfg, False) + (moe * _gemm_flops(cfg, True) if moe else 0)
    core = sum(attention_core_flops(cfg, seq, seq, False, w) for w in window_flops_layers(cfg))
    return batch * seq * per_token, batch * core


def _gemm_flops(cfg: TransformerConfig, moe: bool) -> int:
    """Model FLOPs per token of one layer's weight GEMMs (`layer_gemms`)."""
    return sum(g.flops_per_token for g in layer_gemms(cfg, moe) if g.model_flops)


def active_ffn_width(cfg: TransformerConfig) -> int:
    """The MLP width one token of a MoE layer goes through: k f_e + the shared expert's.
    Megatron-LM's FLOP formula counts these (topk x moe_ffn_hidden_size + the shared
    expert) and leaves out the router's 2 h E per token, as this count does."""
    return cfg.moe_router_topk * expert_ffn_size(cfg) + (
        cfg.moe_shared_expert_intermediate_size or 0
    )


def recomputed_flops(cfg: TransformerConfig, batch: int, seq: int, recompute: str | None) -> float:
    """FLOPs recomputation runs again in one iteration's backward (what HFU adds to MFU):
    nothing ("none"), the attention cores ("selective"), or every layer's forward ("full";
    the heads sit outside the checkpointed layers); "op_selective" the GEMMs it reruns
    (`OP_SELECTIVE_RERUN`).  `recompute` defaults to the config's."""
    recompute = cfg.recompute if recompute is None else recompute
    if recompute not in (*RECOMPUTE_CHOICES, *RECOMPUTE_IMPLEMENTATIONS):
        raise ValueError(f"recompute must be one of {RECOMPUTE_CHOICES}, not {recompute!r}")
    dense, core = transformer_forward_flops(cfg, batch, seq)
    if recompute == "op_selective":
        gemms = {g.name: g.flops_per_token for g in layer_gemms(cfg)}
        per_token = sum(share * gemms[name] for name, share in OP_SELECTIVE_RERUN.items())
        return per_token * batch * seq * (cfg.num_layers + len(mtp_layer_numbers(cfg)))
    return {"none": 0.0, "selective": core, "full": dense + core}[recompute]


def gpt_forward_flops(cfg: TransformerConfig, batch: int, seq: int) -> tuple[float, float, float]:
    """FLOPs of one forward pass of the whole GPT, in three parts the recompute modes redo
    differently: (the layers' dense matmuls, the layers' attention cores, the heads: the
    logits 2BshV, and with D multi-token prediction depths D (2BshV + 2Bs(2h)h), each depth's
    logits and its eh_proj, which sit outside the checkpointed layers)."""
    dense, core = transformer_forward_flops(cfg, batch, seq)
    h, depths = cfg.hidden_size, len(mtp_layer_numbers(cfg))
    logits = 2 * batch * seq * h * cfg.vocab_size
    return dense, core, logits + depths * (logits + 2 * batch * seq * 2 * h * h)


def gpt_model_flops_per_iteration(
    cfg: TransformerConfig, global_batch: int, seq_length: int
) -> float:
    """Model FLOPs of one GPT training iteration, the numerator of MFU: what the model needs,
    whatever is recomputed.  Forward once, backward twice the forward (the gradients of the
    inputs and of the weights), so with f = 4h and V the padded vocabulary:

        3 (24 B s l h^2 + 4 B s^2 h l + 2 B s h V) = 72 B s l h^2 (1 + s/6h + V/12lh)

    (Narayanan et al. 2021's count without its recompute pass).
    """
    dense, core, logits = gpt_forward_flops(cfg, global_batch, seq_length)
    return 3 * (dense + core + logits)


def gpt_hardware_flops_per_iteration(
    cfg: TransformerConfig, global_batch: int, seq_length: int, recompute: str | None = None
) -> float:
    """Hardware FLOPs of one GPT training iteration, the numerator of HFU: the model FLOPs
    plus what recomputation runs again in backward.  `recompute` defaults to `cfg.recompute`.

    - "none": nothing again; HFU = MFU.
    - "full": every layer's forward again (not the logits, which are outside the
      checkpointed layers): 4 (24 B s l h^2 + 4 B s^2 h l) + 3 (2 B s h V)
      = 96 B s l h^2 (1 + s/6h + V/16lh), the count Narayanan et al. 2021 report.
    - "selective": only the attention core again (QK^T and scores x V; Korthikanti et al.
      2022): 72 B s l h^2 (1 + s/6h + V/12lh) + 4 B s^2 h l
      = 72 B s l h^2 (1 + 2s/9h + V/12lh).
    """
    model = gpt_model_flops_per_iteration(cfg, global_batch, seq_length)
    return model + recomputed_flops(cfg, global_batch, seq_length, recompute)


def bert_forward_flops(cfg: TransformerConfig, batch: int, seq: int) -> tuple[float, float, float]:
    """(the layers' dense matmuls, the attention cores, the heads) of one BERT forward pass;
    the MLM head runs on the predicted 15% of the tokens: 2 B m h (h + V), m = 0.15 s; the
    pooler and SOP head on [CLS]: 2 B h (h + 2)."""
    dense, core = transformer_forward_flops(cfg, batch, seq)
    predicted = batch * seq * MASKED_LM_PROB
    h = cfg.hidden_size
    return dense, core, 2 * predicted * h * (h + cfg.vocab_size) + 2 * batch * h * (h + 2)


def bert_model_flops_per_iteration(
    cfg: TransformerConfig, global_batch: int, seq_length: int
) -> float:
    """Model FLOPs of one BERT training iteration (forward once, backward twice), whatever is
    recomputed: the numerator of MFU, as `gpt_model_flops_per_iteration`."""
    return 3 * sum(bert_forward_flops(cfg, global_batch, seq_length))


def bert_hardware_flops_per_iteration(
    cfg: TransformerConfig, global_batch: int, seq_length: int, recompute: str | None = None
) -> float:
    """Model FLOPs plus what recomputation runs again (the numerator of HFU; the heads are
    outside the checkpointed layers, as GPT's logits)."""
    model = bert_model_flops_per_iteration(cfg, global_batch, seq_length)
    return model + recomputed_flops(cfg, global_batch, seq_length, recompute)
