"""Hugging Face gpt-oss both ways (`GptOssForCausalLM`, model_type gpt_oss), as our Llama kind
with the switches that make it: attention sinks (`model.softmax_type = "learnable"`), sliding
windows on the layers `layer_types` names (`hf.windows`), biases on q, k, v and the output
projection (`add_bias_linear`), YaRN rotary scaling, and every MLP a mixture of experts whose
router has a bias and whose experts are biased, clamped (up + 1) gate sigmoid(1.702 gate)
GLUs (Megatron-LM's `quick_geglu`, `glu_linear_offset` 1, `activation_func_clamp_value` =
`swiglu_limit`), routed by the top k of the router's logits with a softmax over those k
(`moe_router_pre_softmax` false).

The storage (`decoder.decoder_map` with gpt-oss's fields): `self_attn.{q,k,v,o}_proj` with
biases and `self_attn.sinks` [heads] (ours `attention.q`, `attention.kv` per group [k v],
`attention.proj`, `attention.sinks`); `mlp.router.weight` / `bias` (ours by the same names);
`mlp.experts.gate_up_proj` [E, h, 2f] and its bias with gate and up interleaved by column
(`tensor_map.interleaved_experts_map`: ours [gate | up], two strided boxes of each), and
`down_proj` [E, f, h] with its bias [E, h] (ours `experts.weight2`, `bias2`).  OpenAI's
published files keep the experts in MXFP4 (`*_blocks`, `*_scales`), which `hf.quantized`
dequantises as they are read; the bf16 and fp32 files transformers writes are read as they
are.  Import refuses, by field and before any weight is read, a gpt-oss we do not compute
(another swiglu_alpha, no attention_bias, a rope type other than YaRN or none).
"""

from pathlib import Path

from megatrain.hf.decoder import (
    ROPE_TYPES,
    decoder_fields,
    import_decoder,
    load_hf_config,
    refuser,
)

MODEL_TYPES = ("gpt_oss",)
SWIGLU_ALPHA = 1.702  # quick-GeGLU's gain, fixed in megacore.moe.glu


def read_gpt_oss_config(hf_dir: Path) -> dict:
    """config.json of a gpt-oss as `decoder_fields` reads it, with its experts' fields."""
    config_file, c = load_hf_config(hf_dir)
    refuse = refuser(config_file, c)
    if c.get("model_type") not in MODEL_TYPES:
        refuse("model_type", f"expected one of {MODEL_TYPES}")
    if float(c.get("swiglu_alpha", SWIGLU_ALPHA)) != SWIGLU_ALPHA:
        refuse("swiglu_alpha", f"expected {SWIGLU_ALPHA} (quick-GeGLU's gain)")
    if not c.get("attention_bias", True):
        refuse("attention_bias", "gpt-oss's attention has biases; expected true")
    limit = c.get("swiglu_limit", 7.0)
    if limit is not None and (not isinstance(limit, int | float) or limit <= 0):
        refuse("swiglu_limit", "expected a positive clamp (or null: none)")
    experts = c.get("num_local_experts", c.get("num_experts", 128))
    topk = c.get("num_experts_per_tok", 4)
    if not isinstance(experts, int) or experts < 1:
        refuse("num_local_experts", "expected a positive number of experts")
    if not isinstance(topk, int) or not 1 <= topk <= experts:
        refuse("num_experts_per_tok", f"expected 1 to the {experts} experts")
    c = {"hidden_act": "silu", **c}  # gpt-oss's config names silu; its experts are the GLU above
    fields = decoder_fields(
        config_file, c, required=("intermediate_size",), head_dim=64, qkv_bias=True,
        rope_types=(*ROPE_TYPES, "yarn"),
    )  # fmt: skip
    return fields | {
        "experts": experts, "topk": topk, "expert_ffn": int(c["intermediate_size"]),
        "shared_ffn": None, "moe_layers": [True] * fields["layers"], "o_bias": True,
        "sinks": True, "limit": None if limit is None else float(limit),
        "aux": float(c.get("router_aux_loss_coef", 0.0)),
    }  # fmt: skip


def configure_gpt_oss(m, c: dict) -> None:
    """Our [model] fields of gpt-oss beyond the Llama's (`read_gpt_oss_config`'s)."""
    m.num_moe_experts, m.moe_router_topk = c["experts"], c["topk"]
    m.ffn_hidden_size = c["expert_ffn"]  # no dense layers
    m.moe_router_pre_softmax, m.moe_router_score_function = False, "softmax"
    m.add_bias_linear, m.add_qkv_bias, m.softmax_type = True, False, "learnable"
    m.quick_geglu, m.glu_linear_offset = True, 1.0
    m.activation_func_clamp_value = c["limit"]
    m.moe_router_load_balancing_type = "aux_loss"
    m.moe_aux_loss_coeff = c["aux"]


def import_gpt_oss(hf_dir: Path, out_ckpt, tokenizer_file, **kw) -> Path:
    """Write the gpt-oss of `hf_dir` as a megatrain checkpoint of kind llama (iteration 0,
    weights only); returns the iteration directory (`kw`: `import_decoder`'s)."""
    return import_decoder(
        hf_dir, out_ckpt, tokenizer_file, read_gpt_oss_config(hf_dir), configure_gpt_oss, **kw
    )


def gpt_oss_fields(m: dict) -> dict:
    """transformers.GptOssConfig's own fields for our resolved [model] section `m` (beside
    `llama.llama_config_fields`' and `windows.window_fields`')."""
    return {
        "num_local_experts": m["num_moe_experts"],
        "num_experts_per_tok": m["moe_router_topk"],
        "intermediate_size": m["moe_ffn_hidden_size"] or m["ffn_hidden_size"],
        "swiglu_alpha": SWIGLU_ALPHA,
        "swiglu_limit": m["activation_func_clamp_value"],
        "router_aux_loss_coef": m["moe_aux_loss_coeff"],
        "attention_bias": True,
    }
