"""Hugging Face mixtures of experts both ways: Mixtral (`MixtralForCausalLM`), Qwen2-MoE
(`Qwen2MoeForCausalLM`) and Qwen3-MoE (`Qwen3MoeForCausalLM`), as our Llama kind with
`model.num_moe_experts` (`models.moe.MoELayer`), through the decoders' reader (`hf.decoder`)
and `llama.export_llama`; the classes an export writes, with their MLP writer and the
routers they refuse, are `hf.families`' (`moe_family`).

The storage differs only in the MLPs:

- HF keeps each expert's three matrices apart, as nn.Linear weights (transformers 5 fuses
  them in memory as `mlp.experts.gate_up_proj` [E, 2f, h] / `down_proj` [E, h, f] but
  writes, and reads, the per-expert names; a file holding the fused ones is read too):
  Mixtral's `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up), `w2` (down), Qwen's
  `mlp.experts.{e}.gate_proj` / `up_proj` / `down_proj`.  Ours are one 3-D tensor each for
  the grouped GEMM: `mlp.experts.weight1` [E, h, 2f] (x @ weight1 = [gate | up]) and
  `mlp.experts.weight2` [E, f, h] (the down projection, transposed);
- the router is HF's `gate.weight` [E, h], ours `mlp.router.weight`;
- Qwen2-MoE's shared expert (`mlp.shared_expert.gate_proj/up_proj/down_proj`) and its
  sigmoid gate (`mlp.shared_expert_gate.weight` [1, h]) are our `mlp.shared_expert.gate /
  fc1 / fc2` and `mlp.shared_expert_gate.weight`;
- gpt-oss (no importer yet; the layer computes it: tests/test_moe_hf_parity.py) keeps
  `mlp.experts.gate_up_proj` [E, h, 2f] with gate and up interleaved by column, and its
  bias [E, 2f] so too: `gate_up_from_interleaved` / `gate_up_to_interleaved` turn them
  into our `experts.weight1` / `bias1` [gate | up] and back; `down_proj` [E, f, h] and
  `down_proj_bias` [E, h] are our `weight2` and `bias2`, `router.weight` / `router.bias`
  ours of the same names.

Routing: HF takes the softmax over all experts, then the top k, renormalized by Mixtral
always and by Qwen when `norm_topk_prob`; ours is `moe_router_pre_softmax` with
`moe_router_norm_topk_prob` (a softmax over the k chosen logits, Megatron's default, is the
renormalized case).  Which layers are MoE: Qwen's `mlp_only_layers` and
`decoder_sparse_step` (layer i when (i + 1) % step == 0 and i is not MLP-only) become a 0/1
`moe_layer_freq` list, the dense layers of `intermediate_size` and the experts of
`moe_intermediate_size`.  Import refuses, by field and before any weight is read, what our
MoE cannot compute (router jitter, a sliding window, DeepSeek's latent attention, ...);
export refuses a router HF has no switch for (sigmoid scores, an expert bias, a capacity,
a scaling factor).
"""

from pathlib import Path

import torch

from megatrain.hf.decoder import (
    decoder_fields,
    import_decoder,
    load_hf_config,
    read_headers,
    read_qwen_config,
    refuser,
)
from megatrain.hf.families import moe_family  # noqa: F401 (benchmarks import it from here)

MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
# Fields that change what a model computes and that we have no switch for, refused when set
# (DeepSeek's latent attention and its grouped, scaled routing, should a config carry them).
UNREPRESENTED = ("kv_lora_rank", "q_lora_rank", "n_routed_experts", "n_shared_experts",
                 "topk_method", "routed_scaling_factor")  # fmt: skip


def gate_up_columns(f: int) -> torch.Tensor:
    """The columns of HF gpt-oss's `experts.gate_up_proj` [E, h, 2f] (and of its
    `gate_up_proj_bias` [E, 2f]) in our `experts.weight1` order: HF interleaves them (gate at
    the even columns, up at the odd), ours are [gate | up] halves; ours = hf[..., columns]."""
    return torch.cat((torch.arange(0, 2 * f, 2), torch.arange(1, 2 * f, 2)))


def gate_up_from_interleaved(hf: torch.Tensor) -> torch.Tensor:
    """HF gpt-oss's interleaved gate/up columns [..., 2f] as our [gate | up] halves."""
    return hf[..., gate_up_columns(hf.shape[-1] // 2)]


def gate_up_to_interleaved(ours: torch.Tensor) -> torch.Tensor:
    """Our [gate | up] halves [..., 2f] as HF gpt-oss's interleaved columns (the inverse)."""
    gate, up = ours.chunk(2, dim=-1)
    return torch.stack((gate, up), dim=-1).flatten(-2)


def moe_layers(c: dict) -> list[bool]:
    """Which layers are MoE, as HF decides: every layer in Mixtral; in Qwen's MoE layer i when
    (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers."""
    step, dense = c.get("sparse_step", 1), set(c.get("mlp_only", ()))
    return [(i + 1) % step == 0 and i not in dense for i in range(c["layers"])]


def _experts(c: dict, default: int | None):
    """The number of experts, under either name transformers writes (its configs map
    num_experts to num_local_experts: Qwen3-MoE's hub files say num_experts, transformers 5
    saves num_local_experts)."""
    return c.get("num_local_experts", c.get("num_experts", default))


def read_moe_config(hf_dir: Path) -> dict:
    """config.json of a Mixtral, Qwen2-MoE or Qwen3-MoE as `decoder_fields` reads it, with
    the experts' fields {experts, topk, expert_ffn, shared_ffn, norm_topk, sparse_step,
    mlp_only, aux}; refuses, by field, what our MoE cannot compute."""
    config_file, c = load_hf_config(hf_dir)
    refuse = refuser(config_file, c)
    model_type = c.get("model_type")
    if model_type not in MODEL_TYPES:
        refuse("model_type", f"expected one of {MODEL_TYPES}")
    for field in UNREPRESENTED:
        if c.get(field) is not None:
            refuse(field, "not supported by our mixture of experts")
    if c.get("router_jitter_noise"):
        refuse("router_jitter_noise", "router jitter is not supported; expected 0")
    if model_type == "mixtral":
        fields = decoder_fields(config_file, c, required=("intermediate_size",))
        experts, expert_ffn, shared_ffn = _experts(c, 8), fields["ffn"], None
        norm_topk, sparse_step, mlp_only = True, 1, []
    else:
        fields = read_qwen_config(hf_dir, required=("moe_intermediate_size",))
        experts, expert_ffn = _experts(c, None), c["moe_intermediate_size"]
        shared_ffn = c.get("shared_expert_intermediate_size") if model_type == "qwen2_moe" else None
        norm_topk, sparse_step = (
            bool(c.get("norm_topk_prob", False)),
            c.get("decoder_sparse_step", 1),
        )
        mlp_only = c.get("mlp_only_layers") or []
        if not isinstance(sparse_step, int) or sparse_step < 1:
            refuse("decoder_sparse_step", "expected a positive integer")
        if not all(isinstance(i, int) for i in mlp_only):
            refuse("mlp_only_layers", "expected a list of layer numbers")
    topk = c.get("num_experts_per_tok", 2)
    if not isinstance(experts, int) or experts < 1:
        field = "num_local_experts" if "num_local_experts" in c else "num_experts"
        refuse(field, "expected a positive number of experts")
    if not isinstance(topk, int) or not 1 <= topk <= experts:
        refuse("num_experts_per_tok", f"expected 1 to the {experts} experts")
    if model_type == "qwen2_moe" and not shared_ffn:
        refuse("shared_expert_intermediate_size", "Qwen2-MoE's shared expert needs its size")
    fields |= {
        "experts": experts, "topk": topk, "expert_ffn": int(expert_ffn), "shared_ffn": shared_ffn,
        "norm_topk": norm_topk, "sparse_step": sparse_step, "mlp_only": mlp_only,
        "aux": float(c.get("router_aux_loss_coef", 0.0)),
    }  # fmt: skip
    fields["moe_layers"] = moe_layers(fields)
    return fields


def configure_moe(m, c: dict) -> None:
    """Our [model] MoE fields from `read_moe_config`'s."""
    m.num_moe_experts, m.moe_router_topk = c["experts"], c["topk"]
    if c["model_type"] == "mixtral":
        m.ffn_hidden_size = c["expert_ffn"]  # no dense layers
    else:
        m.moe_ffn_hidden_size = c["expert_ffn"]
    # HF's order: the softmax over every expert, the top k, renormalized or not.
    m.moe_router_pre_softmax, m.moe_router_norm_topk_prob = True, c["norm_topk"]
    m.moe_router_score_function = "softmax"
    layers = moe_layers(c)
    m.moe_layer_freq = 1 if all(layers) else [int(x) for x in layers]
    if c["shared_ffn"]:
        m.moe_shared_expert_intermediate_size, m.moe_shared_expert_gate = c["shared_ffn"], True
    m.moe_router_load_balancing_type = "aux_loss"
    m.moe_aux_loss_coeff = c["aux"]


def read_moe_files(hf_dir: Path) -> dict:
    """`read_moe_config`, with whether the files hold the per-expert matrices as transformers
    writes them or its in-memory 3-D `gate_up_proj` / `down_proj` (a state dict saved as it is
    held; `c["fused"]`): the headers say which."""
    c = read_moe_config(hf_dir)
    names = read_headers(hf_dir, c).shapes
    c["fused"] = any(name.endswith(".mlp.experts.gate_up_proj") for name in names)
    return c


def import_moe(hf_dir: Path, out_ckpt, tokenizer_file, **kw) -> Path:
    """Write the Mixtral, Qwen2-MoE or Qwen3-MoE of `hf_dir` as a megatrain checkpoint of kind
    llama with num_moe_experts (iteration 0, weights only); returns the iteration directory."""
    return import_decoder(
        hf_dir, out_ckpt, tokenizer_file, read_moe_files(hf_dir), configure_moe, **kw
    )
