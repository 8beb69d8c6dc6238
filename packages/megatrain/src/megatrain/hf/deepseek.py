"""Hugging Face DeepSeek-V3 and DeepSeek-V2 both ways (`DeepseekV3ForCausalLM`, model_type
deepseek_v3, which Moonlight ships as and Kimi K2's architecture is; `DeepseekV2ForCausalLM`,
deepseek_v2, with or without `q_lora_rank`), as our Llama kind with multi-latent attention
(`models.attention.multi_latent`) and DeepSeek's routed experts (`models.moe`).

What config.json says, as our [model] fields (Megatron-LM's names):

- q_lora_rank, kv_lora_rank, v_head_dim: the same names; qk_nope_head_dim, qk_rope_head_dim:
  qk_head_dim, qk_pos_emb_head_dim;
- rope_scaling / rope_parameters of type yarn (factor, original_max_position_embeddings,
  beta_fast, beta_slow, mscale, mscale_all_dim): rope_type "yarn", rotary_scaling_factor and
  the others by name;
- n_routed_experts, num_experts_per_tok, moe_intermediate_size: num_moe_experts,
  moe_router_topk, moe_ffn_hidden_size; n_shared_experts x moe_intermediate_size:
  moe_shared_expert_intermediate_size; first_k_dense_replace: a 0/1 moe_layer_freq (the dense
  layers of intermediate_size);
- n_group, topk_group: moe_router_num_groups, moe_router_group_topk (one group: none);
  routed_scaling_factor, norm_topk_prob: moe_router_topk_scaling_factor,
  moe_router_norm_topk_prob;
- V3's sigmoid scores and `e_score_correction_bias`: moe_router_score_function "sigmoid",
  moe_router_enable_expert_bias (the bias our `router.expert_bias` buffer), a group ranked by
  its top-2 sum (moe_router_group_score_topk 2); V2's softmax over every expert
  (moe_router_pre_softmax), unnormalized, its topk_method greedy or group_limited_greedy (a
  group ranked by its max: moe_router_group_score_topk 1);
- aux_loss_alpha, seq_aux (DeepSeek's own files): moe_aux_loss_coeff with "seq_aux_loss" or
  "aux_loss".

The storage: `self_attn.q_a_proj` / `q_a_layernorm` / `q_b_proj` (or `q_proj`),
`kv_a_proj_with_mqa` / `kv_a_layernorm` / `kv_b_proj`, `o_proj` are our `attention.q_a`,
`q_a_norm`, `q_b` (`q`), `kv_a`, `kv_a_norm`, `kv_b`, `proj` as they are (the same row
orders: per head [no-rope, rope] and [no-rope key, value]; the rope rows kept in DeepSeek's
interleaved layout, which our MLA rotates as it is stored); the experts Qwen's per-expert
names (`decoder.mlp_map`), the shared experts `mlp.shared_experts.*` our `shared_expert.*`,
the correction bias `mlp.gate.e_score_correction_bias` our `router.expert_bias` (fp32).
DeepSeek's published FP8 files are read as they are (`hf.quantized`).

The multi-token prediction layers DeepSeek-V3's files hold as
`model.layers.{num_hidden_layers + k}.*` (`num_nextn_predict_layers` of them; transformers
drops them on load and writes none) are our MTP depths (`models.mtp`, model.mtp_num_layers):
`enorm`, `hnorm`, `eh_proj` ([embedding | hidden] columns, as ours), `shared_head.norm` (our
depth's `final_layernorm`) and the decoder layer (ours `mtp.layers.k.layer.*`); their
`embed_tokens` and `shared_head.head`, copies of the model's own (the depths share them), are
not read, and an export writes them from the model's.  Files without them (transformers')
import without MTP, with a line saying so.

Refused before any weight is read, naming the field: what we do not compute (`rope_interleave`
false, `attention_bias`, `mlp_bias`, a `num_key_value_heads` other than the heads, another
`scoring_func` or `topk_method`, `moe_layer_freq` other than 1, V2's `norm_topk_prob` true,
which transformers' DeepseekV2 does not apply) and sizes that do not fit (`topk_group` above
`n_group`, experts not divisible by `n_group`).  An export refuses, naming the `model.` field,
a router or MoE layout neither class has.
"""

from pathlib import Path

from megatrain.checkpoint.files import CheckpointError
from megatrain.hf.common import HFFormatError, layer_is_moe
from megatrain.hf.decoder import (
    MTP_COPIES,
    ROPE_TYPES,
    decoder_fields,
    import_decoder,
    load_hf_config,
    read_headers,
    refuser,
)

V3_TYPES = ("deepseek_v3", "kimi_k2")  # Kimi K2's config.json: DeepseekV3ForCausalLM
MODEL_TYPES = (*V3_TYPES, "deepseek_v2")
V2_TOPK_METHODS = ("greedy", "group_limited_greedy")
# What ranks a group: HF DeepSeek-V3 sums its top 2 scores, V2's group_limited_greedy its max.
GROUP_SCORE_TOPK = {"deepseek_v3": 2, "deepseek_v2": 1}


def _version(model_type: str) -> str:
    return "deepseek_v3" if model_type in V3_TYPES else "deepseek_v2"


def _positive(refuse, c: dict, name: str, default=None) -> int:
    value = c.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        refuse(name, "expected a positive integer")
    return value


def read_deepseek_config(hf_dir: Path) -> dict:
    """config.json of a DeepSeek-V3 or V2 as `decoder.decoder_map` reads it: `decoder_fields`'
    dict with the latent attention's sizes (`mla`), the experts' and the router's fields, and
    the multi-token prediction depths it declares (`mtp_layers`; `read_deepseek_files` says
    which the files hold); refuses, by field, what we do not compute."""
    config_file, c = load_hf_config(hf_dir)
    refuse = refuser(config_file, c)
    model_type = c.get("model_type")
    if model_type not in MODEL_TYPES:
        refuse("model_type", f"expected one of {MODEL_TYPES}")
    version = _version(model_type)
    if model_type == "kimi_k2" and "DeepseekV3ForCausalLM" not in (c.get("architectures") or []):
        refuse("architectures", "a kimi_k2 is read as DeepseekV3ForCausalLM")
    for name in ("attention_bias", "mlp_bias"):
        if c.get(name):
            refuse(name, "biases in DeepSeek's linears are not supported")
    if c.get("rope_interleave", True) is not True:
        refuse("rope_interleave", "our multi-latent attention rotates DeepSeek's interleaved "
               "rope rows as stored; expected true")  # fmt: skip
    heads = _positive(refuse, c, "num_attention_heads")
    if c.get("num_key_value_heads", heads) not in (None, heads):
        refuse("num_key_value_heads", f"multi-latent attention has a key and value per head: "
               f"expected num_attention_heads ({heads})")  # fmt: skip
    if c.get("moe_layer_freq", 1) != 1:
        refuse("moe_layer_freq", "transformers' DeepSeek makes every layer from "
               "first_k_dense_replace on a MoE layer; expected 1")  # fmt: skip
    q_lora_rank = c.get("q_lora_rank")
    if q_lora_rank is not None:
        q_lora_rank = _positive(refuse, c, "q_lora_rank")
    mla = {
        "q_lora_rank": q_lora_rank,
        "kv_lora_rank": _positive(refuse, c, "kv_lora_rank", 512),
        "nope": _positive(refuse, c, "qk_nope_head_dim", 128),
        "rope": _positive(refuse, c, "qk_rope_head_dim", 64),
        "v": _positive(refuse, c, "v_head_dim", 128),
    }
    if mla["rope"] % 2:
        refuse("qk_rope_head_dim", "expected an even width (rotated in pairs)")
    # HF writes head_dim = qk_rope_head_dim and the heads' own key/value count; our MLA sizes
    # its heads by the fields above, so the shared reader sees none of its own.
    shared = {k: v for k, v in c.items() if k not in ("head_dim", "num_key_value_heads")}
    fields = decoder_fields(
        config_file, shared, head_dim=mla["rope"], rope_types=(*ROPE_TYPES, "yarn")
    )
    if fields["scaling"] is not None:
        refuse("rope_scaling", "DeepSeek's rotary scaling is YaRN's; llama3 is not read here")
    depth = c.get("num_nextn_predict_layers", c.get("num_mtp_layers", 0)) or 0
    if not isinstance(depth, int) or depth < 0:
        refuse("num_nextn_predict_layers", "expected a count of layers")
    if depth and version == "deepseek_v2":
        refuse("num_nextn_predict_layers", "DeepSeek-V2 has no multi-token prediction")
    moe = _moe_fields(refuse, c, version, fields["layers"])
    return fields | moe | {"mla": mla, "mtp_declared": depth, "mtp_layers": depth}


def _moe_fields(refuse, c: dict, version: str, layers: int) -> dict:
    """The experts' and the router's fields of a DeepSeek config.json (`read_deepseek_config`)."""
    experts = _positive(refuse, c, "n_routed_experts", 256 if version == "deepseek_v3" else 64)
    topk = c.get("num_experts_per_tok")
    if not isinstance(topk, int) or not 1 <= topk <= experts:
        refuse("num_experts_per_tok", f"expected 1 to the {experts} experts")
    expert_ffn = _positive(refuse, c, "moe_intermediate_size")
    shared = _positive(refuse, c, "n_shared_experts", 1 if version == "deepseek_v3" else 2)
    dense = c.get("first_k_dense_replace", 3 if version == "deepseek_v3" else 0)
    if not isinstance(dense, int) or not 0 <= dense <= layers:
        refuse("first_k_dense_replace", f"expected 0 to the {layers} layers")
    if dense and not isinstance(c.get("intermediate_size"), int):
        refuse("intermediate_size", "the dense first_k_dense_replace layers need their size")
    if version == "deepseek_v3":
        if c.get("scoring_func", "sigmoid") != "sigmoid":
            refuse("scoring_func", "DeepSeek-V3's router scores by sigmoid; expected 'sigmoid'")
        if c.get("topk_method", "noaux_tc") != "noaux_tc":
            refuse("topk_method", "DeepSeek-V3 chooses by noaux_tc; expected 'noaux_tc'")
        grouped, norm = True, bool(c.get("norm_topk_prob", True))
    else:
        if c.get("scoring_func", "softmax") != "softmax":
            refuse("scoring_func", "DeepSeek-V2's router scores by softmax; expected 'softmax'")
        method = c.get("topk_method", "greedy")
        if method not in V2_TOPK_METHODS:
            refuse("topk_method", f"expected one of {V2_TOPK_METHODS}")
        if c.get("norm_topk_prob"):
            refuse("norm_topk_prob", "transformers' DeepseekV2 does not normalize the top-k "
                   "weights (DeepSeek's own code does): expected false")  # fmt: skip
        grouped, norm = method == "group_limited_greedy", False
    groups = group_topk = None
    if grouped:
        groups = _positive(refuse, c, "n_group", 8 if version == "deepseek_v3" else None)
        group_topk = _positive(refuse, c, "topk_group", 4 if version == "deepseek_v3" else None)
        if experts % groups:
            refuse("n_group", f"n_routed_experts ({experts}) is not divisible by it")
        if group_topk > groups:
            refuse("topk_group", f"above n_group ({groups})")
        if topk > group_topk * (experts // groups):
            refuse("num_experts_per_tok", f"above the experts of topk_group ({group_topk}) "
                   f"groups of {experts // groups}")  # fmt: skip
        if experts // groups < GROUP_SCORE_TOPK[version]:
            refuse("n_group", f"a group ranked by its top {GROUP_SCORE_TOPK[version]} scores "
                   "needs that many experts")  # fmt: skip
        if groups == 1:  # one group, always chosen: no group limit
            groups = group_topk = None
    scaling = c.get("routed_scaling_factor", 2.5 if version == "deepseek_v3" else 1.0)
    if not isinstance(scaling, int | float) or scaling <= 0:
        refuse("routed_scaling_factor", "expected a positive number")
    alpha = c.get("aux_loss_alpha", 0.0) or 0.0
    if not isinstance(alpha, int | float) or alpha < 0:
        refuse("aux_loss_alpha", "expected a coefficient >= 0")
    return {
        "experts": experts, "topk": topk, "expert_ffn": expert_ffn,
        "shared_ffn": shared * expert_ffn, "shared_name": "shared_experts", "shared_gate": False,
        "moe_layers": [i >= dense for i in range(layers)], "version": version,
        "expert_bias": version == "deepseek_v3", "norm_topk": norm, "groups": groups,
        "group_topk": group_topk, "scaling_factor": float(scaling), "aux": float(alpha),
        "seq_aux": bool(c.get("seq_aux", False)),
    }  # fmt: skip


def configure_deepseek(m, c: dict) -> None:
    """Our [model] fields of a DeepSeek beyond the Llama's (`read_deepseek_config`'s)."""
    mla = c["mla"]
    m.multi_latent_attention = True
    m.q_lora_rank, m.kv_lora_rank = mla["q_lora_rank"], mla["kv_lora_rank"]
    m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim = mla["nope"], mla["rope"], mla["v"]
    m.num_query_groups = m.kv_channels = None  # MLA's heads are sized by the fields above
    m.num_moe_experts, m.moe_router_topk = c["experts"], c["topk"]
    m.moe_ffn_hidden_size = c["expert_ffn"]
    m.moe_shared_expert_intermediate_size = c["shared_ffn"]
    layers = c["moe_layers"]
    m.moe_layer_freq = 1 if all(layers) else [int(x) for x in layers]
    if c["version"] == "deepseek_v3":
        m.moe_router_score_function, m.moe_router_enable_expert_bias = "sigmoid", True
    else:  # HF's order: the softmax over every expert, then the top k
        m.moe_router_score_function, m.moe_router_pre_softmax = "softmax", True
    m.moe_router_norm_topk_prob = c["norm_topk"]
    m.moe_router_topk_scaling_factor = c["scaling_factor"]
    if c["groups"] is not None:
        m.moe_router_num_groups, m.moe_router_group_topk = c["groups"], c["group_topk"]
        m.moe_router_group_score_topk = GROUP_SCORE_TOPK[c["version"]]
    m.mtp_num_layers = c["mtp_layers"] or None
    m.moe_aux_loss_coeff = c["aux"]
    m.moe_router_load_balancing_type = (
        "none" if not c["aux"] else "seq_aux_loss" if c["seq_aux"] else "aux_loss"
    )


def read_deepseek_files(hf_dir: Path, log: bool = True) -> dict:
    """`read_deepseek_config`, with what the files hold: transformers' fused 3-D experts or
    the per-expert ones (`c["fused"]`), and the multi-token prediction layers
    model.layers.{num_hidden_layers + k}.* num_nextn_predict_layers declares, imported as our
    MTP depths (`c["mtp_layers"]`; none when the files hold none, as transformers writes a
    DeepSeek-V3: it drops them), their copies of the word embedding and output layer not read
    (`c["skipped_prefixes"]`); a line says which (`log`, rank 0)."""
    import torch.distributed as dist

    c = read_deepseek_config(hf_dir)
    names = read_headers(hf_dir, c).shapes
    c["fused"] = any(name.endswith(".mlp.experts.gate_up_proj") for name in names)
    first, depth = c["layers"], c["mtp_declared"]
    prefixes = [f"model.layers.{first + k}." for k in range(depth)]
    held = [p for p in prefixes if any(n.startswith(p) for n in names)]
    if held and held != prefixes:
        raise HFFormatError(
            f"{hf_dir}: config.json's num_nextn_predict_layers is {depth}, but the files hold "
            f"only {', '.join(p + '*' for p in held)} of {', '.join(p + '*' for p in prefixes)}"
        )
    c["mtp_layers"] = len(held)
    c["skipped_prefixes"] = tuple(p + n for p in held for n in MTP_COPIES)
    if depth and log and (not dist.is_initialized() or dist.get_rank() == 0):
        said = (
            f"reading the {depth} multi-token prediction layer{'s' if depth > 1 else ''} "
            f"{', '.join(p + '*' for p in held)} as model.mtp_num_layers {depth} (their "
            "embed_tokens and shared_head.head, copies of the model's word embedding and "
            "output layer, not read)"
            if held
            else f"config.json's num_nextn_predict_layers is {depth}, but the files hold no "
            f"{prefixes[0]}* (transformers drops them): no multi-token prediction imported"
        )
        print(f"megatrain: {hf_dir}: {said}", flush=True)
    return c


def import_deepseek(hf_dir: Path, out_ckpt, tokenizer_file, **kw) -> Path:
    """Write the DeepSeek-V3 or V2 of `hf_dir` as a megatrain checkpoint of kind llama with
    multi-latent attention and DeepSeek's experts (iteration 0, weights only); returns the
    iteration directory (`kw`: `import_decoder`'s)."""
    c = read_deepseek_files(hf_dir)
    return import_decoder(hf_dir, out_ckpt, tokenizer_file, c, configure_deepseek, **kw)


# --- export ---------------------------------------------------------------------------------


def _refuse(field: str, value, why: str):
    raise CheckpointError(f"model.{field} is {value!r}: {why}")


def export_version(m: dict) -> str:
    """Which class a multi-latent attention model of resolved [model] section `m` exports as:
    DeepSeek-V2 for softmax routing, else DeepSeek-V3 (sigmoid routing, or no experts)."""
    if m["num_moe_experts"] and m["moe_router_score_function"] == "softmax":
        return "deepseek_v2"
    return "deepseek_v3"


def _dense_prefix(m: dict) -> int:
    """first_k_dense_replace of our moe_layer_freq, refused unless the dense layers come first
    and every later layer is a MoE layer (the only pattern transformers' DeepSeek builds)."""
    layers = layer_is_moe(m)
    dense = layers.index(True) if any(layers) else len(layers)
    if not all(layers[dense:]):
        why = "DeepSeek's MoE layers are those from first_k_dense_replace on: dense layers first"
        _refuse("moe_layer_freq", m["moe_layer_freq"], why)
    return dense


def _router_fields(m: dict, version: str) -> dict:
    """The experts' and the router's config.json fields, refusing by field a router the
    class has no switch for."""
    E, k = m["num_moe_experts"], m["moe_router_topk"]
    f = m["moe_ffn_hidden_size"] or m["ffn_hidden_size"]
    shared = m["moe_shared_expert_intermediate_size"]
    if not shared or shared % f:
        why = f"DeepSeek's shared experts are n_shared_experts x moe_ffn_hidden_size ({f})"
        _refuse("moe_shared_expert_intermediate_size", shared, why)
    norm = m["moe_router_norm_topk_prob"]
    if version == "deepseek_v3":
        if not m["moe_router_enable_expert_bias"]:
            _refuse(
                "moe_router_enable_expert_bias",
                False,
                "DeepSeek-V3's router always holds its correction bias; expected true",
            )
        norm = k > 1 if norm is None else norm  # sigmoid's own: normalized when k > 1
    else:
        if not m["moe_router_pre_softmax"]:
            _refuse("moe_router_pre_softmax", False, "DeepSeek-V2 takes the top k of the "
                    "softmax over every expert; expected true")  # fmt: skip
        if norm:
            _refuse("moe_router_norm_topk_prob", norm, "transformers' DeepseekV2 does not "
                    "normalize the top-k weights; expected false or unset")  # fmt: skip
    fields = {
        "n_routed_experts": E, "num_experts_per_tok": k, "moe_intermediate_size": f,
        "n_shared_experts": shared // f, "first_k_dense_replace": _dense_prefix(m),
        "routed_scaling_factor": m["moe_router_topk_scaling_factor"] or 1.0,
        "norm_topk_prob": bool(norm),
    }  # fmt: skip
    groups = m["moe_router_num_groups"]
    if groups is not None:
        summed = m["moe_router_group_score_topk"] or k // m["moe_router_group_topk"]
        if summed != GROUP_SCORE_TOPK[version]:
            _refuse("moe_router_group_score_topk", m["moe_router_group_score_topk"],
                    f"{'DeepSeek-V3' if version == 'deepseek_v3' else 'DeepSeek-V2'} ranks a "
                    f"group by its top {GROUP_SCORE_TOPK[version]}")  # fmt: skip
        fields |= {"n_group": groups, "topk_group": m["moe_router_group_topk"]}
        if version == "deepseek_v2":
            fields["topk_method"] = "group_limited_greedy"
    else:
        fields |= {"n_group": 1, "topk_group": 1}
        if version == "deepseek_v2":
            fields["topk_method"] = "greedy"
    if m["moe_aux_loss_coeff"] and m["moe_router_load_balancing_type"] != "none":
        fields |= {"aux_loss_alpha": m["moe_aux_loss_coeff"],
                   "seq_aux": m["moe_router_load_balancing_type"] == "seq_aux_loss"}  # fmt: skip
    return fields


def deepseek_fields(m: dict) -> dict:
    """transformers.DeepseekV3Config's or DeepseekV2Config's own fields for our resolved
    [model] section `m` (beside `llama.llama_config_fields`')."""
    version = export_version(m)
    heads = m["num_attention_heads"]
    fields = {
        "q_lora_rank": m["q_lora_rank"], "kv_lora_rank": m["kv_lora_rank"],
        "qk_nope_head_dim": m["qk_head_dim"], "qk_rope_head_dim": m["qk_pos_emb_head_dim"],
        "v_head_dim": m["v_head_dim"], "num_key_value_heads": heads, "attention_bias": False,
        # transformers' DeepSeek sizes its rotary tables by head_dim: the rope key's width.
        "head_dim": m["qk_pos_emb_head_dim"],
    }  # fmt: skip
    if version == "deepseek_v3":
        fields |= {
            "rope_interleave": True,
            "num_nextn_predict_layers": m.get("mtp_num_layers") or 0,
        }
    else:
        if m.get("mtp_num_layers"):
            _refuse("mtp_num_layers", m.get("mtp_num_layers"), "DeepSeek-V2 has no multi-token "
                    "prediction (a DeepSeek-V3 export needs sigmoid routing)")  # fmt: skip
        fields["mlp_bias"] = False
    if m["num_moe_experts"]:
        return fields | _router_fields(m, version)
    # No experts: every layer dense (first_k_dense_replace = num_layers), no router built.
    return fields | {"first_k_dense_replace": m["num_layers"], "n_routed_experts": 1,
                     "num_experts_per_tok": 1, "n_group": 1, "topk_group": 1}  # fmt: skip


def map_fields(m: dict) -> dict:
    """The fields `decoder.decoder_map` reads of a multi-latent attention model (`llama.
    map_fields` adds them): the latent sizes, DeepSeek's shared experts and expert bias."""
    return {
        "mla": {"q_lora_rank": m["q_lora_rank"], "kv_lora_rank": m["kv_lora_rank"],
                "nope": m["qk_head_dim"], "rope": m["qk_pos_emb_head_dim"],
                "v": m["v_head_dim"]},
        "shared_name": "shared_experts", "shared_gate": False,
        "expert_bias": bool(m["moe_router_enable_expert_bias"]),
        "mtp_layers": m.get("mtp_num_layers") or 0, "mtp_copies": True,
    }  # fmt: skip
