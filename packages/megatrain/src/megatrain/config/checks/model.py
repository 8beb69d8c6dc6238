"""[model]: the kinds and choices, RoPE scaling, the mixture of experts, dropout."""

import math

from megatrain.config.errors import _need
from megatrain.config.sections import (
    BLOCK_ORDERS,
    CAUSAL_KINDS,
    CHOICES,
    MODEL_KINDS,
    NORMALIZATIONS,
    POSITION_EMBEDDING_TYPES,
    Config,
)


def _check_model(config: Config) -> None:
    """The model's kinds and choices: kind, block order, normalization, position embedding,
    RoPE scaling, mixture of experts."""
    m = config.model
    _need(m.kind in MODEL_KINDS, f"model.kind must be one of {MODEL_KINDS}, got {m.kind!r}")
    _need(
        m.block_order in BLOCK_ORDERS,
        f"model.block_order must be one of {BLOCK_ORDERS}, got {m.block_order!r}",
    )
    _need(
        m.kind == "bert" or m.block_order == "pre_ln",
        f"model.block_order {m.block_order!r} is BERT's original order (Fig. 7 a); GPT-2 is pre_ln",
    )
    for name, choices in (("normalization", NORMALIZATIONS),
                          ("position_embedding_type", POSITION_EMBEDDING_TYPES)):  # fmt: skip
        value = getattr(m, name)
        _need(
            value is None or value in choices,
            f"model.{name} must be one of {choices}, got {value!r}",
        )
    _need(
        m.rope_scaling_factor == 0 or m.rope_scaling_factor >= 1,
        f"model.rope_scaling_factor must be 0 (off) or >= 1, got {m.rope_scaling_factor}",
    )
    _need(
        m.rope_scaling_factor == 0 or m.rope_high_freq_factor > m.rope_low_freq_factor,
        f"model.rope_high_freq_factor ({m.rope_high_freq_factor}) must be above "
        f"model.rope_low_freq_factor ({m.rope_low_freq_factor})",
    )
    _check_moe(config)


def _check_moe(config: Config) -> None:
    """The mixture-of-experts switches against each other and the model (the expert-parallel
    sizes are checked with the layout)."""
    m = config.model
    E = m.num_moe_experts
    if E is None:
        return
    why = f"model.num_moe_experts = {E}"
    _need(
        m.kind in CAUSAL_KINDS,
        f"model.num_moe_experts: MoE is built for the causal kinds {' and '.join(CAUSAL_KINDS)}, "
        f"not model.kind = {m.kind!r}",
    )
    _need(
        m.moe_router_topk <= E,
        f"model.moe_router_topk ({m.moe_router_topk}) is above model.num_moe_experts ({E})",
    )
    for section_key, choices in CHOICES.items():
        if section_key[0] == "model" and section_key[1].startswith("moe_"):
            value = getattr(m, section_key[1])
            _need(
                value in choices, f"model.{section_key[1]} must be one of {choices}, got {value!r}"
            )
    factor = m.moe_expert_capacity_factor
    _need(
        factor is None or factor > 0,
        f"model.moe_expert_capacity_factor must be > 0 (or unset: dropless), got {factor}",
    )
    freq = m.moe_layer_freq
    if isinstance(freq, list):
        _need(
            len(freq) == m.num_layers and all(v in (0, 1) for v in freq),
            f"model.moe_layer_freq: a list needs a 0 or 1 for each of the model.num_layers "
            f"({m.num_layers}) layers, got {freq!r}",
        )
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate"):
        value = getattr(m, name)
        _need(value is None or value >= 0, f"model.{name} must be >= 0, got {value}")
    scaling = m.moe_router_topk_scaling_factor
    _need(
        scaling is None or scaling > 0,
        f"model.moe_router_topk_scaling_factor must be > 0 (or unset), got {scaling}",
    )
    _need(
        not m.moe_router_enable_expert_bias or m.moe_router_score_function == "sigmoid",
        "model.moe_router_enable_expert_bias = true needs model.moe_router_score_function = "
        f"'sigmoid' (DeepSeek-V3's, as Megatron), got {m.moe_router_score_function!r}",
    )
    _need(
        not m.moe_shared_expert_gate or m.moe_shared_expert_intermediate_size,
        "model.moe_shared_expert_gate = true gates a shared expert: set "
        "model.moe_shared_expert_intermediate_size",
    )
    _need(
        not config.model_switch("add_bias_linear"),
        f"{why} with model.add_bias_linear = true: the experts have no biases (as Megatron's "
        "grouped GEMM); set model.add_bias_linear = false",
    )
    _need(
        not config.training.cuda_graphs,
        f"{why} with training.cuda_graphs = true: the tokens each expert gets change with "
        "every batch, which a captured graph cannot follow; turn one off",
    )
    _need(
        not config.training.compile,
        f"{why} with training.compile = true: compiled MoE layers are not built (torch's "
        "compiled grouped GEMM takes bf16 only, and the experts' token counts change with "
        "every batch); turn one off",
    )


def _check_dropout(config: Config) -> None:
    m = config.model
    _need(
        not (m.hidden_dropout < 0 or m.hidden_dropout >= 1 or math.isnan(m.hidden_dropout)),
        f"model.hidden_dropout must be in [0, 1), got {m.hidden_dropout}",
    )
    _need(
        0 <= m.attention_dropout < 1,
        f"model.attention_dropout must be in [0, 1), got {m.attention_dropout}",
    )
