"""The weight GEMMs of a layer (`layer_gemms`, a `Gemm` each), the one description of a
layer the FLOP count sums and `megatrain plan`'s time model times, and which of them run in
float8 under training.precision = "fp8" (`float8_gemm`).
"""

from dataclasses import dataclass

from megatrain.models.transformer_config import TransformerConfig
from megatrain.plan.accounting.parameters import _attention_width, _head_dim, expert_ffn_size


@dataclass(frozen=True)
class Gemm:
    """One weight GEMM of a layer, as the model runs it: each token's [k] x [k, n] (whole,
    all TP ranks together), `copies` times (a MoE token goes through its k routed experts),
    split over tensor parallelism as `split` says (`per_rank`):

    - "column": the outputs / tp (column-parallel: qkv, q, gate, fc1);
    - "row": the inputs / tp (row-parallel: proj, fc2);
    - "kv": grouped-query attention's key/value projection, its g groups / tp, or one
      whole group per rank when g < tp (`ReplicatedKV`);
    - "expert_column", "expert_row": a routed expert's, over etp;
    - "replicated": whole on every rank (the router, the shared expert's gate).

    `model_flops`: counted in the FLOPs of MFU (the router's and the shared expert gate's
    2 h E and 2 h per token are not, as Megatron-LM's `num_floating_point_operations`)."""

    name: str
    k: int
    n: int
    split: str
    copies: int = 1
    groups: int = 0  # "kv": the key/value groups
    model_flops: bool = True

    @property
    def flops_per_token(self) -> int:
        return 2 * self.copies * self.k * self.n

    @property
    def weights(self) -> int:
        """The weight's parameters (one expert's for a routed expert: x E for all)."""
        return self.k * self.n

    def per_rank(self, tp: int, etp: int | None = None) -> tuple[float, float]:
        """(k, n) of this GEMM on one rank at tensor parallelism tp (experts: etp, None: tp)."""
        etp = tp if etp is None else etp
        if self.split == "kv":
            return self.k, self.n / self.groups * max(self.groups, tp) / tp
        divide = {"column": (1, tp), "row": (tp, 1), "expert_column": (1, etp),
                  "expert_row": (etp, 1), "replicated": (1, 1)}[self.split]  # fmt: skip
        return self.k / divide[0], self.n / divide[1]


# Float8Recipe.applies_to (megacore/tensor_parallel/float8.py): a linear whose weight has a
# dimension that is not a multiple of 16 keeps bf16 (float8 GEMMs need them).
FLOAT8_ALIGN = 16


def float8_gemm(g: Gemm, tp: int) -> bool:
    """Whether megatrain runs `g` in float8 under training.precision = "fp8" at tensor
    parallelism tp: `parallelize.apply_float8` converts the column- and row-parallel linears
    of the layers (qkv or q and kv, the projection, the MLP's, the shared expert's), each
    rank's weight shard when both its dimensions are multiples of FLOAT8_ALIGN; a routed
    expert's grouped GEMMs, the router, the shared expert's gate and `ReplicatedKV` (fewer
    key/value groups than tp) stay bf16."""
    if g.split not in ("column", "row") and not (g.split == "kv" and g.groups >= tp):
        return False
    return all(d % FLOAT8_ALIGN == 0 for d in g.per_rank(tp))


def _mlp_gemms(h: int, f: int, swiglu: bool, prefix: str = "") -> list[Gemm]:
    """A dense MLP's GEMMs: SwiGLU's gate and fc1 (SiLU(gate) x fc1), or GeLU's fc1; fc2."""
    up = [Gemm(prefix + "gate", h, f, "column")] if swiglu else []
    return [*up, Gemm(prefix + "fc1", h, f, "column"), Gemm(prefix + "fc2", f, h, "row")]


def _mla_gemms(cfg: TransformerConfig) -> list[Gemm]:
    """Multi-latent attention's GEMMs (`models.attention.multi_latent`), Megatron-LM's MLA
    FLOP terms: the queries' down-projection q_a [h, r_q] and up-projection q_b [r_q, heads
    (d_n + d_r)] (or the direct q [h, heads (d_n + d_r)]), the key/value down-projection
    with the rope key kv_a [h, r_kv + d_r], the up-projection kv_b [r_kv, heads (d_n +
    d_v)], the projection [heads d_v, h].  The down-projections are whole on every TP rank
    ("replicated": each rank runs them over its own tokens, which under sequence
    parallelism are 1/tp of them; the time model counts all)."""
    h, a = cfg.hidden_size, cfg.num_attention_heads
    q_dim, r_q = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim, cfg.q_lora_rank
    if r_q:
        queries = [Gemm("q_a", h, r_q, "replicated"), Gemm("q_b", r_q, a * q_dim, "column")]
    else:
        queries = [Gemm("q", h, a * q_dim, "column")]
    r_kv, v = cfg.kv_lora_rank, cfg.v_head_dim
    return [
        *queries,
        Gemm("kv_a", h, r_kv + cfg.qk_pos_emb_head_dim, "replicated"),
        Gemm("kv_b", r_kv, a * (cfg.qk_head_dim + v), "column"),
        Gemm("proj", a * v, h, "row"),
    ]


def layer_gemms(cfg: TransformerConfig, moe: bool = False) -> list[Gemm]:
    """The weight GEMMs of one TransformerLayer, as models/transformer.py and models/moe.py
    run them (one description of a layer for the FLOP count and `megatrain plan`'s time
    model): the attention's qkv (3 x heads x head_dim), or with grouped-query attention q
    and kv (2 g d); the projection; the MLP (`_mlp_gemms`); a MoE layer (`moe`) has in
    place of the MLP the router [h, E], the routed experts' weight1 (h x f_e, 2 f_e with
    SwiGLU, gate and up in one) and weight2 (f_e x h), `moe_router_topk` copies of each
    token, and the shared expert (an MLP of `moe_shared_expert_intermediate_size`) with its
    gate [h, 1].  Multi-latent attention's in place of qkv: `_mla_gemms`.  The attention
    core (scores and context) is not a weight GEMM:
    `attention_core_flops`."""
    h, d, a = cfg.hidden_size, _head_dim(cfg), cfg.num_attention_heads
    width, groups = _attention_width(cfg), cfg.num_query_groups or a
    if cfg.attention_type == "mla":
        attention = _mla_gemms(cfg)
    elif groups == a:
        attention = [Gemm("qkv", h, 3 * width, "column")]
    else:
        attention = [Gemm("q", h, width, "column"), Gemm("kv", h, 2 * groups * d, "kv", 1, groups)]
    if cfg.attention_type != "mla":
        attention.append(Gemm("proj", width, h, "row"))
    if not moe:
        return attention + _mlp_gemms(h, cfg.ffn_hidden_size, cfg.swiglu)
    f_e, k = expert_ffn_size(cfg), cfg.moe_router_topk
    up = 2 * f_e if cfg.swiglu else f_e
    experts = [
        Gemm("router", h, cfg.num_moe_experts, "replicated", model_flops=False),
        Gemm("experts.weight1", h, up, "expert_column", copies=k),
        Gemm("experts.weight2", f_e, h, "expert_row", copies=k),
    ]
    shared = cfg.moe_shared_expert_intermediate_size
    if shared:
        experts += _mlp_gemms(h, shared, cfg.swiglu, "shared_expert.")
        if cfg.moe_shared_expert_gate:
            experts.append(Gemm("shared_expert_gate", h, 1, "replicated", model_flops=False))
    return attention + experts
