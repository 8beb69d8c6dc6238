"""`TransformerConfig`: the model as built, what every module of `models/` reads.

The [model] section of a run config becomes one (`models.model_config`); GPT, BERT and the
Llama family are settings of it (see `models/transformer.py`).  It sits below every model
module, so the attention kinds, the MLPs and the layer import it and not each other.
"""

from dataclasses import dataclass

from megatrain.config import BLOCK_ORDERS, RECOMPUTE_CHOICES, MoEConfig

GELUS = {"tanh": "tanh", "erf": "none"}  # our name -> F.gelu's `approximate`


@dataclass(frozen=True)
class YarnScaling:
    """YaRN's rotary scaling (HF rope_type "yarn", `attention.rope`): frequencies interpolated
    by `factor` below the wavelengths the correction range (`beta_fast`, `beta_slow`
    rotations within the original context) marks, kept above it, ramped between; the range
    rounded outwards unless `truncate` is False (gpt-oss).  cos and sin are multiplied by the
    attention factor: mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are
    set (DeepSeek), else mscale(factor); with `mscale_all_dim` multi-latent attention
    multiplies its softmax scale by mscale(factor, mscale_all_dim)^2, as HF's DeepSeek does.
    0 for mscale or mscale_all_dim: unset."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True


@dataclass
class TransformerConfig(MoEConfig):
    """The model as built; the mixture-of-experts fields (`MoEConfig`, keyword-only) are the
    [model] section's, `models.moe.MoELayer` on the layers `moe_layer_freq` names."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int  # padded: divisible by tp
    max_position_embeddings: int
    # The tokenizer's vocabulary; the logits of the padding rows above it are masked out,
    # so the padding (which depends on tp) changes nothing a layout computes.
    true_vocab_size: int | None = None
    ffn_hidden_size: int | None = None
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    # What `parallelize.parallelize_model` applies to the built layers (`apply_recompute`) and
    # what HFU counts; the layers themselves do not read it.
    recompute: str = "none"  # none | selective | full
    distribute_saved_activations: bool = False
    sequence_parallel: bool = False
    # Transformer layers of each virtual pipeline stage in model order (chunk c of rank r at
    # c * pp + r), from parallel.pipeline_model_parallel_layout; None: the even split.
    pipeline_layer_counts: tuple[int, ...] | None = None
    # What `parallelize.parallelize_model` applies to the built layers (`apply_tp_comm_overlap`):
    # sequence parallelism's collectives overlapped with the linears' GEMMs.
    tp_comm_overlap: bool = False
    block_order: str = "pre_ln"  # pre_ln | post_ln
    causal: bool = True
    gelu: str = "tanh"  # tanh | erf
    num_tokentypes: int = 0
    normalization: str = "layernorm"  # layernorm | rmsnorm
    position_embedding: str = "learned"  # learned | rope
    rotary_base: float = 10000.0
    # Llama 3.1's scaling: (factor, low_freq_factor, high_freq_factor, original context), or
    # YaRN's (`YarnScaling`); None: off
    rope_scaling: tuple[float, float, float, int] | YarnScaling | None = None
    swiglu: bool = False  # the gated MLP: [gate | up] of ffn_hidden_size each
    # The gated MLP's activation and its shift and clamp (`megacore.moe.glu`; Megatron-LM's
    # names): quick-GeGLU in place of SiLU, up + glu_linear_offset, the clamp (None: off).
    quick_geglu: bool = False
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: float | None = None
    num_query_groups: int | None = None  # None: one key/value head per head
    add_bias: bool = True
    # Each head's width; None: hidden_size / num_attention_heads (Megatron's kv_channels).
    kv_channels: int | None = None
    # Which attention kind every layer holds (`models.attention.ATTENTION_KINDS`).
    attention_type: str = "mha"
    # The model's normalization over each head of the queries and keys before RoPE (Qwen3).
    qk_layernorm: bool = False
    # Multi-latent attention's sizes (attention_type "mla", DeepSeek-V2/V3; Megatron-LM's
    # names): the queries' low-rank width (None: queries projected directly from the hidden
    # state), the joint key/value latent's, each head's no-rope query/key width, the rope
    # part's (one rope key a token, shared by every head) and each head's value width.
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    add_qkv_bias: bool = False  # biases on q, k, v even without add_bias (Qwen2)
    tie_output: bool = True
    # The output layer and the loss in one chunked op that never holds the [tokens, vocab]
    # logits (`tp.linear_vocab_parallel_cross_entropy`); GPT and Llama, when labels are given.
    fused_linear_cross_entropy: bool = False
    # Sliding windows: a causal query sees itself and the window_size - 1 keys before it, on
    # the layers `layer_types` names "sliding_attention" (None: all); `spec.attention_for`
    # hands the full layers' attention this config with window_size None.
    window_size: int | None = None
    layer_types: tuple[str, ...] | None = None
    # "learnable": attention sinks, a learned logit per head in the softmax's denominator.
    softmax_type: str = "vanilla"
    # Multi-token prediction's depths on the last stage (`models.mtp`; None: none) and the
    # weight of their mean loss.
    mtp_num_layers: int | None = None
    mtp_loss_scaling_factor: float = 0.1

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        for name, value, choices in (
            ("block_order", self.block_order, BLOCK_ORDERS),
            ("gelu", self.gelu, tuple(GELUS)),
            ("recompute", self.recompute, RECOMPUTE_CHOICES),
            ("normalization", self.normalization, ("layernorm", "rmsnorm")),
            ("position_embedding", self.position_embedding, ("learned", "rope")),
        ):
            if value not in choices:
                raise ValueError(f"model.{name} must be one of {choices}, not {value!r}")
