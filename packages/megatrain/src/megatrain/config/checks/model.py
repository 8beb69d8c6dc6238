"""[model]: the kinds and choices, RoPE scaling, multi-latent attention, the mixture of experts,
dropout."""

import math

from megatrain.config.errors import ConfigError
from megatrain.config.sections import (
    BLOCK_ORDERS,
    CAUSAL_KINDS,
    CHOICES,
    MODEL_KINDS,
    NORMALIZATIONS,
    POSITION_EMBEDDING_TYPES,
    ROPE_TYPES,
    Config,
)


def _check_model(config: Config) -> None:
    """The model's kinds and choices: kind, block order, normalization, position embedding,
    RoPE scaling, mixture of experts."""
    m = config.model
    if m.kind not in MODEL_KINDS:
        raise ConfigError(f"model.kind must be one of {MODEL_KINDS}, got {m.kind!r}")
    if m.block_order not in BLOCK_ORDERS:
        raise ConfigError(f"model.block_order must be one of {BLOCK_ORDERS}, got {m.block_order!r}")
    if m.kind != "bert" and m.block_order != "pre_ln":
        raise ConfigError(
            f"model.block_order {m.block_order!r} is BERT's original order (Fig. 7 a); "
            "GPT-2 is pre_ln"
        )
    for name, choices in (("normalization", NORMALIZATIONS),
                          ("position_embedding_type", POSITION_EMBEDDING_TYPES)):  # fmt: skip
        value = getattr(m, name)
        if value is not None and value not in choices:
            raise ConfigError(f"model.{name} must be one of {choices}, got {value!r}")
    if not (m.rope_scaling_factor == 0 or m.rope_scaling_factor >= 1):
        raise ConfigError(
            f"model.rope_scaling_factor must be 0 (off) or >= 1, got {m.rope_scaling_factor}"
        )
    if not (m.rope_scaling_factor == 0 or m.rope_high_freq_factor > m.rope_low_freq_factor):
        raise ConfigError(
            f"model.rope_high_freq_factor ({m.rope_high_freq_factor}) must be above "
            f"model.rope_low_freq_factor ({m.rope_low_freq_factor})"
        )
    _check_yarn(config)
    _check_multi_latent_attention(config)
    _check_moe(config)
    _check_gated_activation(config)


def _check_yarn(config: Config) -> None:
    m = config.model
    if m.rope_type not in ROPE_TYPES:
        raise ConfigError(f"model.rope_type must be one of {ROPE_TYPES}, got {m.rope_type!r}")
    if m.rope_type != "yarn":
        return
    if m.rope_scaling_factor:
        raise ConfigError(
            f"model.rope_type = 'yarn' with model.rope_scaling_factor = {m.rope_scaling_factor} "
            "(Llama 3.1's scaling): YaRN's factor is model.rotary_scaling_factor; set "
            "model.rope_scaling_factor = 0"
        )
    if not m.rotary_scaling_factor >= 1:
        raise ConfigError(
            f"model.rotary_scaling_factor must be >= 1 with model.rope_type = 'yarn', got "
            f"{m.rotary_scaling_factor}"
        )
    if not m.original_max_position_embeddings > 0:
        raise ConfigError(
            "model.original_max_position_embeddings (YaRN's pretraining context) must be > 0, got "
            f"{m.original_max_position_embeddings}"
        )
    if not m.beta_fast > m.beta_slow > 0:
        raise ConfigError(
            f"model.beta_fast ({m.beta_fast}) must be above model.beta_slow ({m.beta_slow}), "
            "both > 0 (YaRN's correction range, in rotations)"
        )
    for name in ("mscale", "mscale_all_dim"):
        if not getattr(m, name) >= 0:
            raise ConfigError(f"model.{name} must be >= 0 (0: unset), got {getattr(m, name)}")


def _check_multi_latent_attention(config: Config) -> None:
    m = config.model
    if not m.multi_latent_attention:
        return
    why = "model.multi_latent_attention = true"
    if m.kind not in CAUSAL_KINDS:
        raise ConfigError(
            f"{why}: multi-latent attention is built for the causal kinds "
            f"{' and '.join(CAUSAL_KINDS)}, not model.kind = {m.kind!r}"
        )
    if config.model_switch("position_embedding_type") != "rope":
        raise ConfigError(
            f"{why} needs rotary positions (its decoupled rope key): set "
            "model.position_embedding_type = 'rope'"
        )
    if not (m.qk_pos_emb_head_dim > 0 and m.qk_pos_emb_head_dim % 2 == 0):
        raise ConfigError(
            f"model.qk_pos_emb_head_dim must be even and > 0 (rotated in pairs), got "
            f"{m.qk_pos_emb_head_dim}"
        )
    for name in ("kv_lora_rank", "qk_head_dim", "v_head_dim"):
        if not getattr(m, name) > 0:
            raise ConfigError(f"model.{name} must be > 0, got {getattr(m, name)}")
    if not (m.q_lora_rank is None or m.q_lora_rank > 0):
        raise ConfigError(
            "model.q_lora_rank must be > 0, or unset (queries projected directly), got "
            f"{m.q_lora_rank}"
        )
    for name, unset in (("num_query_groups", None), ("kv_channels", None),
                        ("qk_layernorm", False), ("add_qkv_bias", False)):  # fmt: skip
        if getattr(m, name) != unset:
            raise ConfigError(
                f"{why} with model.{name} = {getattr(m, name)!r}: multi-latent attention's heads "
                "are sized by model.qk_head_dim, qk_pos_emb_head_dim and v_head_dim, its latents "
                f"normalized always; unset model.{name}"
            )


def _check_moe(config: Config) -> None:
    """The mixture-of-experts switches against each other and the model (the expert-parallel
    sizes are checked with the layout)."""
    m = config.model
    E = m.num_moe_experts
    if E is None:
        return
    why = f"model.num_moe_experts = {E}"
    if m.kind not in CAUSAL_KINDS:
        raise ConfigError(
            "model.num_moe_experts: MoE is built for the causal kinds "
            f"{' and '.join(CAUSAL_KINDS)}, not model.kind = {m.kind!r}"
        )
    if not m.moe_router_topk <= E:
        raise ConfigError(
            f"model.moe_router_topk ({m.moe_router_topk}) is above model.num_moe_experts ({E})"
        )
    for section_key, choices in CHOICES.items():
        if section_key[0] == "model" and section_key[1].startswith("moe_"):
            value = getattr(m, section_key[1])
            if value not in choices:
                raise ConfigError(f"model.{section_key[1]} must be one of {choices}, got {value!r}")
    factor = m.moe_expert_capacity_factor
    if not (factor is None or factor > 0):
        raise ConfigError(
            f"model.moe_expert_capacity_factor must be > 0 (or unset: dropless), got {factor}"
        )
    freq = m.moe_layer_freq
    if isinstance(freq, list) and not (
        len(freq) == m.num_layers and all(v in (0, 1) for v in freq)
    ):
        raise ConfigError(
            f"model.moe_layer_freq: a list needs a 0 or 1 for each of the model.num_layers "
            f"({m.num_layers}) layers, got {freq!r}"
        )
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate"):
        value = getattr(m, name)
        if not (value is None or value >= 0):
            raise ConfigError(f"model.{name} must be >= 0, got {value}")
    scaling = m.moe_router_topk_scaling_factor
    if not (scaling is None or scaling > 0):
        raise ConfigError(
            f"model.moe_router_topk_scaling_factor must be > 0 (or unset), got {scaling}"
        )
    if m.moe_router_enable_expert_bias and m.moe_router_score_function != "sigmoid":
        raise ConfigError(
            "model.moe_router_enable_expert_bias = true needs model.moe_router_score_function = "
            f"'sigmoid' (DeepSeek-V3's, as Megatron), got {m.moe_router_score_function!r}"
        )
    if m.moe_shared_expert_gate and not m.moe_shared_expert_intermediate_size:
        raise ConfigError(
            "model.moe_shared_expert_gate = true gates a shared expert: set "
            "model.moe_shared_expert_intermediate_size"
        )
    _check_router_groups(config)
    if config.training.cuda_graphs:
        raise ConfigError(
            f"{why} with training.cuda_graphs = true: the tokens each expert gets change with "
            "every batch, which a captured graph cannot follow; turn one off"
        )
    if config.training.compile:
        raise ConfigError(
            f"{why} with training.compile = true: compiled MoE layers are not built (torch's "
            "compiled grouped GEMM takes bf16 only, and the experts' token counts change with "
            "every batch); turn one off"
        )


def _check_router_groups(config: Config) -> None:
    """Group-limited routing: its sizes against the experts and the top k, and the dispatch
    that relies on it (its expert-parallel side is the layout's check)."""
    m = config.model
    E, groups, group_topk = m.num_moe_experts, m.moe_router_num_groups, m.moe_router_group_topk
    if m.moe_group_limited_dispatch and groups is None:
        raise ConfigError(
            "model.moe_group_limited_dispatch = true relies on group-limited routing: set "
            "model.moe_router_num_groups and model.moe_router_group_topk"
        )
    if groups is None and group_topk is None:
        if m.moe_router_group_score_topk is not None:
            raise ConfigError(
                "model.moe_router_group_score_topk ranks the groups of group-limited routing: set "
                "model.moe_router_num_groups and model.moe_router_group_topk, or leave it unset"
            )
        return
    if groups is None or group_topk is None:
        raise ConfigError(
            "model.moe_router_num_groups and model.moe_router_group_topk go together (HF's n_group "
            f"and topk_group), got {groups} and {group_topk}"
        )
    if not groups >= 1:
        raise ConfigError(f"model.moe_router_num_groups must be >= 1, got {groups}")
    if E % groups != 0:
        raise ConfigError(
            f"model.num_moe_experts ({E}) is not divisible by model.moe_router_num_groups "
            f"({groups}): each group holds as many experts"
        )
    if not 1 <= group_topk <= groups:
        raise ConfigError(
            f"model.moe_router_group_topk ({group_topk}) must be 1 to model.moe_router_num_groups "
            f"({groups})"
        )
    per_group = E // groups
    if not m.moe_router_topk <= group_topk * per_group:
        raise ConfigError(
            f"model.moe_router_topk ({m.moe_router_topk}) is above the experts of "
            f"model.moe_router_group_topk ({group_topk}) groups of {per_group}"
        )
    summed = m.moe_router_group_score_topk
    if summed is None:
        if not m.moe_router_topk // group_topk >= 1:
            raise ConfigError(
                f"model.moe_router_topk ({m.moe_router_topk}) // model.moe_router_group_topk "
                f"({group_topk}) is 0, the scores that rank a group: set "
                "model.moe_router_group_score_topk"
            )
    else:
        if not 1 <= summed <= per_group:
            raise ConfigError(
                f"model.moe_router_group_score_topk ({summed}) must be 1 to a group's "
                f"{per_group} experts"
            )
    if m.moe_group_limited_dispatch and m.moe_token_dispatcher_type != "alltoall":
        raise ConfigError(
            "model.moe_group_limited_dispatch = true is the all-to-all's: set "
            f"model.moe_token_dispatcher_type = 'alltoall', got {m.moe_token_dispatcher_type!r}"
        )


def _check_gated_activation(config: Config) -> None:
    """quick_geglu, glu_linear_offset and activation_func_clamp_value shape a gated MLP."""
    m = config.model
    for name, unset in (("quick_geglu", False), ("glu_linear_offset", 0.0),
                        ("activation_func_clamp_value", None)):  # fmt: skip
        value = getattr(m, name)
        if value != unset and not config.model_switch("swiglu"):
            raise ConfigError(
                f"model.{name} = {value} shapes the gated MLP: set model.swiglu = true"
            )
    clamp = m.activation_func_clamp_value
    if not (clamp is None or (clamp > 0 and math.isfinite(clamp))):
        raise ConfigError(
            f"model.activation_func_clamp_value must be a finite number > 0 (or unset), got {clamp}"
        )


def _check_dropout(config: Config) -> None:
    m = config.model
    if m.hidden_dropout < 0 or m.hidden_dropout >= 1 or math.isnan(m.hidden_dropout):
        raise ConfigError(f"model.hidden_dropout must be in [0, 1), got {m.hidden_dropout}")
    if not 0 <= m.attention_dropout < 1:
        raise ConfigError(f"model.attention_dropout must be in [0, 1), got {m.attention_dropout}")
