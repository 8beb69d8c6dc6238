"""Models built from megacore's parallel pieces: GPT and BERT on one transformer.

`model.kind` of a run config picks the model; the functions here dispatch on it, so the
training loop, checkpoints and loaders take the kind from the config instead of assuming
GPT.  The chunks come out as built at the rank's layout; `megatrain.parallelize` applies
the rest of the run's parallelism to them (`parallelize_model`).

The tree: `transformer_config` (the model as built), `layout` (where a rank sits, its chunks
built), `common` (placement, norms, fused elementwise ops), `attention/` (one module per
attention kind, and what they share), `mlp` (the dense MLP), `moe` (the routed experts),
`spec` (which attention and which MLP each layer holds), `transformer` (the layer and the
language-model base), `gpt` and `bert` (the models).
"""

from megacore import tensor_parallel as tp
from megatrain.config import MOE_FIELDS, Config, pipeline_layer_counts
from megatrain.models.bert import BertModel, bert_config, build_bert_chunks
from megatrain.models.gpt import GPTConfig, GPTModel, build_gpt_chunks
from megatrain.models.transformer_config import TransformerConfig, YarnScaling

# A Llama is GPTModel with the Llama switches of TransformerConfig set (`model_config`).
_BUILDERS = {"gpt": build_gpt_chunks, "bert": build_bert_chunks, "llama": build_gpt_chunks}


def build_model_chunks(kind: str, cfg: TransformerConfig, seed: int = 1234, **placement) -> list:
    """This rank's chunks of the `kind` model ("gpt", "bert" or "llama") as built (no
    recompute, context or expert parallelism applied: `parallelize.parallelize_model`);
    `placement`: device, dtype, initialize, as `build_gpt_chunks`."""
    return _BUILDERS[kind](cfg, seed, **placement)


def model_config(config: Config, vocab_size: int) -> TransformerConfig:
    """The model of a run config; `vocab_size` is the tokenizer's, padded here for TP."""
    m, p = config.model, config.parallel
    padded = tp.vocab_size_with_padding(
        vocab_size, p.tensor_model_parallel_size, m.make_vocab_size_divisible_by
    )
    make = bert_config if m.kind == "bert" else TransformerConfig
    return make(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        vocab_size=padded,
        max_position_embeddings=m.max_position_embeddings,
        true_vocab_size=vocab_size,
        ffn_hidden_size=config.ffn_hidden_size,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        layernorm_epsilon=m.layernorm_epsilon,
        recompute=m.recompute,
        distribute_saved_activations=p.distribute_saved_activations,
        sequence_parallel=p.sequence_parallel and p.tensor_model_parallel_size > 1,
        pipeline_layer_counts=pipeline_layer_counts(config),
        tp_comm_overlap=p.tp_comm_overlap,
        block_order=m.block_order,
        normalization=config.model_switch("normalization"),
        position_embedding=(
            "rope" if config.model_switch("position_embedding_type") == "rope" else "learned"
        ),
        rotary_base=m.rotary_base,
        rope_scaling=_rope_scaling(m),
        swiglu=config.model_switch("swiglu"),
        quick_geglu=m.quick_geglu,
        glu_linear_offset=m.glu_linear_offset,
        activation_func_clamp_value=m.activation_func_clamp_value,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
        qk_layernorm=m.qk_layernorm,
        attention_type="mla" if m.multi_latent_attention else "mha",
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_head_dim,
        qk_pos_emb_head_dim=m.qk_pos_emb_head_dim,
        v_head_dim=m.v_head_dim,
        add_qkv_bias=m.add_qkv_bias,
        add_bias=config.model_switch("add_bias_linear"),
        tie_output=not config.model_switch("untie_embeddings_and_output_weights"),
        fused_linear_cross_entropy=config.training.fused_linear_cross_entropy,
        window_size=m.window_size,
        layer_types=None if m.layer_types is None else tuple(m.layer_types),
        softmax_type=m.softmax_type,
        mtp_num_layers=m.mtp_num_layers,
        mtp_loss_scaling_factor=m.mtp_loss_scaling_factor,
        **{name: getattr(m, name) for name in MOE_FIELDS},
    )


def _rope_scaling(m) -> tuple | YarnScaling | None:
    """The [model] section's rotary scaling as TransformerConfig takes it: YaRN's fields
    (rope_type "yarn"), Llama 3.1's (rope_scaling_factor), or None."""
    if m.rope_type == "yarn":
        return YarnScaling(
            factor=m.rotary_scaling_factor,
            original_max_position_embeddings=m.original_max_position_embeddings,
            beta_fast=m.beta_fast,
            beta_slow=m.beta_slow,
            mscale=m.mscale,
            mscale_all_dim=m.mscale_all_dim,
            truncate=m.correction_range_round_to_int,
        )
    if m.rope_scaling_factor:
        return (
            m.rope_scaling_factor,
            m.rope_low_freq_factor,
            m.rope_high_freq_factor,
            m.rope_original_max_position_embeddings,
        )
    return None


__all__ = [
    "BertModel",
    "GPTConfig",
    "GPTModel",
    "TransformerConfig",
    "bert_config",
    "build_bert_chunks",
    "build_gpt_chunks",
    "build_model_chunks",
    "model_config",
]
