"""The Hugging Face classes a Llama-kind checkpoint exports as (`Family`: Llama, Qwen2, Qwen3,
Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss, DeepSeek-V2/V3), each with its config fields and MLP
writer, and the choice among them from the resolved [model] switches (`decoder_family`,
`moe_family`, `deepseek_family`).  `llama.export_llama` writes the one chosen; the families'
importers are `hf.llama`, `hf.qwen`, `hf.moe`, `hf.gpt_oss` and `hf.deepseek`.
"""

from collections.abc import Callable
from dataclasses import dataclass

from megatrain.checkpoint.files import CheckpointError
from megatrain.hf.common import layer_is_moe

ANY = object()  # a switch value any setting of which the family holds (in its own field)


@dataclass(frozen=True)
class Family:
    """A Hugging Face class our Llama-like model exports as: its name in messages, its
    architecture and config class, the resolved [model] fields it needs beyond
    `llama.LLAMA_SWITCHES` (field -> value) and its own config fields (`fields(m)`).  Its
    tensors' names are `decoder.decoder_map`'s for the config class's model_type."""

    name: str
    architecture: str
    config_class: str
    switches: dict
    fields: Callable[[dict], dict] = lambda m: {}


LLAMA = Family("Llama", "LlamaForCausalLM", "LlamaConfig",
               {"qk_layernorm": False, "add_qkv_bias": False, "num_moe_experts": None})  # fmt: skip


def _qwen3_fields(m: dict) -> dict:
    return {"attention_bias": False, "use_sliding_window": False}


QWEN2 = Family(
    "Qwen2", "Qwen2ForCausalLM", "Qwen2Config",
    {"qk_layernorm": False, "add_qkv_bias": True, "num_moe_experts": None},
    lambda m: {"use_sliding_window": False},
)  # fmt: skip
QWEN3 = Family(
    "Qwen3", "Qwen3ForCausalLM", "Qwen3Config",
    {"qk_layernorm": True, "add_qkv_bias": False, "num_moe_experts": None},
    _qwen3_fields,
)  # fmt: skip


# Llama with a sliding window on every layer (`windows.window_fields` writes it).
MISTRAL = Family("Mistral", "MistralForCausalLM", "MistralConfig", LLAMA.switches)


def decoder_family(m: dict) -> Family:
    """The Hugging Face class a Llama-kind model of resolved [model] section `m` exports as:
    a mixture of experts' (`moe_family`), Qwen3 with q/k norms, Qwen2 with q, k, v
    biases, else Llama.  A switch the chosen class lacks is refused by the exporter."""
    if m.get("softmax_type") == "learnable":
        return GPT_OSS
    if m.get("multi_latent_attention"):
        return deepseek_family(m)
    if m.get("num_moe_experts"):
        return moe_family(m)
    if m["qk_layernorm"]:
        return QWEN3
    if m["add_qkv_bias"]:
        return QWEN2
    return MISTRAL if m.get("window_size") else LLAMA


def _renormalized(m: dict) -> bool:
    """Whether our router's k weights sum to one: a softmax over the k chosen logits, or the
    softmax over all renormalized (HF's norm_topk_prob; Mixtral's always)."""
    return not m["moe_router_pre_softmax"] or m["moe_router_norm_topk_prob"]


def _mixtral_fields(m: dict) -> dict:
    return {"num_local_experts": m["num_moe_experts"], "num_experts_per_tok": m["moe_router_topk"],
            "intermediate_size": m["moe_ffn_hidden_size"] or m["ffn_hidden_size"],
            "router_aux_loss_coef": m["moe_aux_loss_coeff"], "router_jitter_noise": 0.0,
            "sliding_window": None}  # fmt: skip


def _qwen_moe_fields(m: dict) -> dict:
    layers = layer_is_moe(m)
    fields = {
        "num_experts": m["num_moe_experts"], "num_experts_per_tok": m["moe_router_topk"],
        "moe_intermediate_size": m["moe_ffn_hidden_size"] or m["ffn_hidden_size"],
        "norm_topk_prob": _renormalized(m), "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, moe in enumerate(layers) if not moe],
        "router_aux_loss_coef": m["moe_aux_loss_coeff"], "use_sliding_window": False,
    }  # fmt: skip
    if m["moe_shared_expert_intermediate_size"]:  # Qwen2-MoE
        fields["shared_expert_intermediate_size"] = m["moe_shared_expert_intermediate_size"]
        fields["qkv_bias"] = m["add_qkv_bias"]
    else:
        fields["attention_bias"] = False
    return fields


# What every HF mixture here routes as: softmax scores, no expert bias, no capacity (dropless),
# no scaling, no groups.
ROUTER = {"moe_router_score_function": "softmax", "moe_router_enable_expert_bias": False,
          "moe_expert_capacity_factor": None, "moe_router_topk_scaling_factor": None,
          "moe_router_num_groups": None}  # fmt: skip
MIXTRAL = Family(
    "Mixtral", "MixtralForCausalLM", "MixtralConfig",
    ROUTER | {"qk_layernorm": False, "add_qkv_bias": False, "moe_layer_freq": 1,
              "moe_shared_expert_intermediate_size": None},
    _mixtral_fields,
)  # fmt: skip
QWEN2_MOE = Family(
    "Qwen2-MoE", "Qwen2MoeForCausalLM", "Qwen2MoeConfig",
    ROUTER | {"qk_layernorm": False, "moe_shared_expert_gate": True},
    _qwen_moe_fields,
)  # fmt: skip
QWEN3_MOE = Family(
    "Qwen3-MoE", "Qwen3MoeForCausalLM", "Qwen3MoeConfig",
    ROUTER | {"qk_layernorm": True, "add_qkv_bias": False,
              "moe_shared_expert_intermediate_size": None},
    _qwen_moe_fields,
)  # fmt: skip


def moe_family(m: dict) -> Family:
    """The HF class a mixture of experts exports as: Qwen3-MoE with q/k norms, Qwen2-MoE with a
    shared expert, else Mixtral (whose router always renormalizes its k weights: a router
    that does not is refused naming the field)."""
    if m["qk_layernorm"]:
        return QWEN3_MOE
    if m["moe_shared_expert_intermediate_size"]:
        return QWEN2_MOE
    if not _renormalized(m):
        raise CheckpointError(
            "model.moe_router_norm_topk_prob is false with model.moe_router_pre_softmax: "
            "Mixtral renormalizes the top-k weights, and a Qwen-MoE export needs q/k norms "
            "(Qwen3) or a shared expert (Qwen2)"
        )
    return MIXTRAL


def _gpt_oss_fields(m: dict) -> dict:
    from megatrain.hf.gpt_oss import gpt_oss_fields

    return gpt_oss_fields(m)


# gpt-oss: sinks, windows by layer, biases everywhere, clamped quick-GeGLU experts.
GPT_OSS = Family(
    "gpt-oss", "GptOssForCausalLM", "GptOssConfig",
    ROUTER | {"qk_layernorm": False, "add_qkv_bias": False, "add_bias_linear": True,
              "softmax_type": "learnable", "quick_geglu": True, "glu_linear_offset": 1.0,
              "activation_func_clamp_value": ANY, "moe_router_pre_softmax": False,
              "moe_layer_freq": 1, "moe_shared_expert_intermediate_size": None},
    _gpt_oss_fields,
)  # fmt: skip


def _deepseek_fields(m: dict) -> dict:
    from megatrain.hf.deepseek import deepseek_fields

    return deepseek_fields(m)


# What every DeepSeek layer is beside its latent attention: no q/k norms or qkv biases, and a
# router of no capacity and no shared-expert gate; the rest (sigmoid or softmax scores, the
# expert bias, groups, the MoE layers) `deepseek.deepseek_fields` checks and writes.
DEEPSEEK_SWITCHES = {"qk_layernorm": False, "add_qkv_bias": False, "moe_shared_expert_gate": False,
                     "moe_expert_capacity_factor": None}  # fmt: skip
DEEPSEEK_V3 = Family(
    "DeepSeek-V3", "DeepseekV3ForCausalLM", "DeepseekV3Config",
    DEEPSEEK_SWITCHES, _deepseek_fields,
)  # fmt: skip
DEEPSEEK_V2 = Family(
    "DeepSeek-V2", "DeepseekV2ForCausalLM", "DeepseekV2Config",
    DEEPSEEK_SWITCHES | {"moe_router_score_function": "softmax",
                         "moe_router_enable_expert_bias": False}, _deepseek_fields,
)  # fmt: skip


def deepseek_family(m: dict) -> Family:
    """A multi-latent attention model's class: DeepSeek-V2 for softmax routing, else V3."""
    from megatrain.hf.deepseek import export_version

    return DEEPSEEK_V2 if export_version(m) == "deepseek_v2" else DEEPSEEK_V3
