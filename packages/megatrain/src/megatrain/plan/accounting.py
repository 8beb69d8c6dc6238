"""Parameters, FLOPs and memory of a model, from its config alone: every formula in one place.

The training loop's MFU/HFU logging (`run/loop.py`), the memory estimate (`megatrain.plan.memory`),
`megatrain plan`'s cost model, the benchmarks and megaeval all count with these functions;
nothing here builds a model or imports the training loop.

- **Parameters**: `layer_parameters`, `layer_parameters_per_rank`; the whole model by kind,
  tied embeddings counted once (`gpt_parameters`, `bert_parameters`, `parameter_count`);
  what one GPU of a pipeline stage holds (`parameters_per_gpu`, of which experts:
  `expert_parameters_per_gpu`).  A mixture of experts (`num_moe_experts`) holds, on each of
  its MoE layers (`moe_layer_count`), E experts of 2 or 3 (SwiGLU) matrices of h x f_e in
  place of the dense MLP, the router [E, h] and the shared expert (`moe_mlp_parameters`); a
  token uses k of the experts (`active_parameters`).
- **FLOPs**: the forward pass of the layers (`transformer_forward_flops`; a MoE layer's MLP
  at its k active experts and its shared expert, as Megatron-LM's
  `num_floating_point_operations` counts them) plus each kind's
  heads (`gpt_forward_flops`, `bert_forward_flops`); an iteration's model FLOPs, the
  numerator of MFU (`*_model_flops_per_iteration`), and hardware FLOPs, the numerator of HFU,
  which add what recomputation runs again (`recomputed_flops`,
  `*_hardware_flops_per_iteration`); both by kind (`flops_per_iteration`).
- **Memory**: the bytes per parameter of weights, gradients and optimizer state
  (`state_bytes_per_parameter`) and the bytes one layer keeps per microbatch under each
  recompute mode (`activations_per_layer`; under context parallelism each rank's s / cp
  tokens, and what the attention over the whole sequence keeps besides:
  `context_parallel_attention_per_layer`, and holds while it runs:
  `context_parallel_attention_working`); `megatrain.plan.memory` adds them up per stage.
  Which kernel the attention core runs as (`attention_kernel`) decides the s x s terms.
  Host memory: the copy of a rank's state a background checkpoint save keeps
  (`checkpoint_copy_bytes_per_parameter`).

`kind` is a run config's `model.kind`: "gpt", "bert" or "llama" (`KINDS`).
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

from megatrain.config import RECOMPUTE_CHOICES, Config
from megatrain.models.moe import is_moe_layer
from megatrain.models.transformer import TransformerConfig

# The fraction of tokens BERT predicts (its masking rate), for the FLOP count.
MASKED_LM_PROB = 0.15


# ---------------------------------------------------------------------------- parameters


def _head_dim(cfg: TransformerConfig) -> int:
    return cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads


def _attention_width(cfg: TransformerConfig) -> int:
    """The queries' width, the projection's input: heads x head_dim (h unless kv_channels)."""
    return cfg.num_attention_heads * _head_dim(cfg)


def _qk_norms(cfg: TransformerConfig) -> int:
    """qk_layernorm's two norms over a head's width (replicated on every TP rank)."""
    return (2 if cfg.normalization == "layernorm" else 1) * 2 * _head_dim(cfg) * cfg.qk_layernorm


def expert_ffn_size(cfg: TransformerConfig) -> int:
    """Each routed expert's hidden size f_e (`moe_ffn_hidden_size`, else `ffn_hidden_size`)."""
    return cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size


def moe_layer_count(cfg: TransformerConfig, first: int = 0, end: int | None = None) -> int:
    """How many of layers first..end-1 (all by default) are MoE layers (`is_moe_layer`)."""
    end = cfg.num_layers if end is None else end
    if not cfg.num_moe_experts:
        return 0
    freq = cfg.moe_layer_freq
    return _moe_count(freq if isinstance(freq, int) else tuple(freq), first, end)


@functools.cache
def _moe_count(freq: int | tuple, first: int, end: int) -> int:
    """`moe_layer_count`, remembered: `megatrain plan` asks it for every layout it weighs."""
    pattern = SimpleNamespace(num_moe_experts=1, moe_layer_freq=freq)
    return sum(is_moe_layer(pattern, i) for i in range(first, end))


def moe_mlp_parameters(cfg: TransformerConfig) -> dict[str, int]:
    """One MoE layer's MLP (in place of the dense one), whole: the routed experts (E x 2 or 3
    matrices of h x f_e; no biases, refused with MoE), the router [E, h] (no bias; the expert
    bias is a buffer) and the shared expert (its matrices, and its gate [1, h])."""
    h, E = cfg.hidden_size, cfg.num_moe_experts
    mlp = 3 if cfg.swiglu else 2
    shared = mlp * h * (cfg.moe_shared_expert_intermediate_size or 0)
    return {
        "experts": E * mlp * h * expert_ffn_size(cfg),
        "router": E * h,
        "shared_expert": shared + (h if cfg.moe_shared_expert_gate else 0),
    }


def _layer_shapes(cfg: TransformerConfig) -> tuple[int, int, int, int]:
    """(QKV's output width, MLP matrices of h x f, column-parallel biases, one norm's
    parameters): heads x head_dim + 2 x groups x head_dim (3h without grouped-query attention
    or kv_channels); 3 matrices with SwiGLU (gate, up, down), else 2; the QKV biases with
    add_bias or add_qkv_bias; LayerNorm has a bias, RMSNorm not."""
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    qkv = _attention_width(cfg) + 2 * (cfg.num_query_groups or cfg.num_attention_heads) * (
        _head_dim(cfg)
    )
    mlp = 3 if cfg.swiglu else 2
    column_biases = (qkv if cfg.add_bias or cfg.add_qkv_bias else 0) + (
        (mlp - 1) * f if cfg.add_bias else 0
    )
    norm = 2 * h if cfg.normalization == "layernorm" else h
    return qkv, mlp, column_biases, norm


def layer_parameters(cfg: TransformerConfig, moe: bool = False) -> int:
    """Parameters of one TransformerLayer (whole, all TP ranks together); `moe`: a MoE layer,
    its experts, router and shared expert in place of the dense MLP."""
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    qkv, mlp, column_biases, norm = _layer_shapes(cfg)
    row_biases = 2 * h if cfg.add_bias else 0  # proj, fc2
    attention = h * qkv + _attention_width(cfg) * h + _qk_norms(cfg)
    mlp_params = sum(moe_mlp_parameters(cfg).values()) if moe else mlp * h * f
    return attention + mlp_params + column_biases + row_biases + 2 * norm


def layer_parameters_per_rank(
    cfg: TransformerConfig, tp: int, moe: bool = False, ep: int = 1, etp: int | None = None
) -> int:
    """One layer's parameters on one TP rank: the split matrices and column biases / tp, the
    row-parallel biases and the norms whole (as `layer_parameters` counts them, at tp 1), and
    the key/value projection whole when there are fewer key/value groups than TP ranks.  A MoE
    layer (`moe`) holds E / ep experts, each / etp (None: tp), the router and the shared
    expert's gate whole, the shared expert / tp."""
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    qkv, mlp, column_biases, norm = _layer_shapes(cfg)
    split = h * qkv + _attention_width(cfg) * h + column_biases
    # proj and fc2 biases, two norms, the queries' and keys' norms
    replicated = (2 * h if cfg.add_bias else 0) + 2 * norm + _qk_norms(cfg)
    experts = 0
    if moe:
        parts = moe_mlp_parameters(cfg)
        gate = h if cfg.moe_shared_expert_gate else 0
        split += parts["shared_expert"] - gate
        replicated += parts["router"] + gate
        experts = parts["experts"] // (ep * (tp if etp is None else etp))
    else:
        split += mlp * h * f
    groups = cfg.num_query_groups or cfg.num_attention_heads
    if groups < tp:  # the key/value projection (and its bias) whole on every rank
        bias = 1 if cfg.add_bias or cfg.add_qkv_bias else 0
        kv = 2 * groups * _head_dim(cfg) * (h + bias)
        split, replicated = split - kv, replicated + kv
    return split // tp + replicated + experts


def _positions(cfg: TransformerConfig) -> int:
    return cfg.max_position_embeddings if cfg.position_embedding == "learned" else 0


def gpt_parameters(cfg: TransformerConfig) -> int:
    """Parameters of the whole GPT or Llama (tied embeddings counted once; an untied output
    layer counted beside them), from the config alone."""
    h = cfg.hidden_size
    words = cfg.vocab_size * h * (1 if cfg.tie_output else 2)
    final_norm = _layer_shapes(cfg)[3]
    return _layers_parameters(cfg) + words + _positions(cfg) * h + final_norm


def _layers_parameters(cfg: TransformerConfig) -> int:
    moe = moe_layer_count(cfg)
    dense = (cfg.num_layers - moe) * layer_parameters(cfg)
    return dense + (moe * layer_parameters(cfg, True) if moe else 0)


def active_parameters(cfg: TransformerConfig) -> int:
    """Parameters one token of a GPT or Llama goes through: `gpt_parameters` with each MoE
    layer's k of its E experts (the router and shared expert whole; the model's count for a
    dense model).  Mixtral 8x7B: 12.9 B of 46.7 B."""
    unused = cfg.num_moe_experts - cfg.moe_router_topk if cfg.num_moe_experts else 0
    per_expert = (3 if cfg.swiglu else 2) * cfg.hidden_size * expert_ffn_size(cfg)
    return gpt_parameters(cfg) - moe_layer_count(cfg) * unused * per_expert


def bert_parameters(cfg: TransformerConfig) -> int:
    """Parameters of the whole BERT (tied embeddings counted once), from the config alone."""
    h, v = cfg.hidden_size, cfg.vocab_size
    embeddings = v * h + cfg.max_position_embeddings * h + cfg.num_tokentypes * h
    norms = 2 * h  # the final LayerNorm (pre_ln) or the embeddings' (post_ln)
    heads = (h * h + h) + 2 * h + v + (h * h + h) + (2 * h + 2)  # LM head, pooler, SOP
    return _layers_parameters(cfg) + embeddings + norms + heads


def _stage_layers(cfg: TransformerConfig, pp: int, stage: int) -> tuple[int, int]:
    """(dense layers, MoE layers) of pipeline stage `stage`: layers stage x n/pp onwards."""
    n = cfg.num_layers // pp
    moe = moe_layer_count(cfg, stage * n, (stage + 1) * n)
    return n - moe, moe


def expert_parameters_per_gpu(
    cfg: TransformerConfig, pp: int = 1, stage: int = 0, ep: int = 1, etp: int = 1
) -> int:
    """The routed experts' parameters one GPU of stage `stage` holds (E / ep experts of each
    MoE layer, each / etp): what is reduced and sharded over the expert data-parallel group
    rather than the dense one.  0 for a dense model."""
    if not cfg.num_moe_experts:
        return 0
    return _stage_layers(cfg, pp, stage)[1] * moe_mlp_parameters(cfg)["experts"] // (ep * etp)


def parameters_per_gpu(
    cfg: TransformerConfig,
    tp: int = 1,
    pp: int = 1,
    stage: int = 0,
    ep: int = 1,
    etp: int | None = None,
) -> int:
    """Parameters one GPU of pipeline stage `stage` holds (a last stage's copy of the tied
    embeddings included).  At tp = pp = 1 (and ep 1) this is the model's `parameter_count`.
    A bidirectional config is BERT: token types, and its heads on the last stage.  MoE layers
    hold E / ep experts, each / etp (None: tp)."""
    h = cfg.hidden_size
    dense, moe = _stage_layers(cfg, pp, stage)
    count = dense * layer_parameters_per_rank(cfg, tp)
    if moe:
        count += moe * layer_parameters_per_rank(cfg, tp, True, ep, etp)
    words = cfg.vocab_size * h // tp
    if stage == 0:
        count += words + (_positions(cfg) + cfg.num_tokentypes) * h
        if cfg.block_order == "post_ln":
            count += 2 * h  # the embeddings' LayerNorm
    if stage == pp - 1:
        if cfg.block_order == "pre_ln":
            count += _layer_shapes(cfg)[3]  # final norm
        if pp > 1 or not cfg.tie_output:
            count += words  # the output layer: a copy of the word embeddings, or its own
        if not cfg.causal:  # BERT's LM head (dense, LayerNorm, vocab-split bias), pooler, SOP
            count += (h * h + h) + 2 * h + cfg.vocab_size // tp + (h * h + h) + (2 * h + 2)
    return count


# ---------------------------------------------------------------------------- FLOPs


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


def layer_gemms(cfg: TransformerConfig, moe: bool = False) -> list[Gemm]:
    """The weight GEMMs of one TransformerLayer, as models/transformer.py and models/moe.py
    run them (one description of a layer for the FLOP count and `megatrain plan`'s time
    model): the attention's qkv (3 x heads x head_dim), or with grouped-query attention q
    and kv (2 g d); the projection; the MLP (`_mlp_gemms`); a MoE layer (`moe`) has in
    place of the MLP the router [h, E], the routed experts' weight1 (h x f_e, 2 f_e with
    SwiGLU, gate and up in one) and weight2 (f_e x h), `moe_router_topk` copies of each
    token, and the shared expert (an MLP of `moe_shared_expert_intermediate_size`) with its
    gate [h, 1].  The attention core (scores and context) is not a weight GEMM:
    `attention_core_flops`."""
    h, d, a = cfg.hidden_size, _head_dim(cfg), cfg.num_attention_heads
    width, groups = _attention_width(cfg), cfg.num_query_groups or a
    if groups == a:
        attention = [Gemm("qkv", h, 3 * width, "column")]
    else:
        attention = [Gemm("q", h, width, "column"), Gemm("kv", h, 2 * groups * d, "kv", 1, groups)]
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


def attention_core_flops(
    cfg: TransformerConfig, queries: int, keys: int, causal_skip: bool
) -> float:
    """FLOPs of one layer's attention core for `queries` against `keys` (one sequence):
    scores QK^T and scores x V, 2 x 2 queries keys (heads x head_dim).  `causal_skip`: a
    kernel that skips the masked blocks of causal attention (flash) does half."""
    full = 4 * queries * keys * _attention_width(cfg)
    return full / 2 if causal_skip and cfg.causal else full


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
    time model times (test_flops holds them to these closed forms).
    """
    n, moe = cfg.num_layers, moe_layer_count(cfg)
    per_token = (n - moe) * _gemm_flops(cfg, False) + (moe * _gemm_flops(cfg, True) if moe else 0)
    return batch * seq * per_token, n * batch * attention_core_flops(cfg, seq, seq, False)


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


# Recompute policies published runs ran and megatrain does not offer, each counted and timed as
# it ran so that the plan is checked against what the run did (published_runs.toml's
# layout.recompute), with the megatrain mode a config of the run takes:
# - "op_selective": torchtitan's op-level selective activation checkpointing (torchtitan/
#   parallelisms/parallelize_llama.py's _save_list and _custom_policy at 9dec370, Llama):
#   each layer's forward keeps the outputs of every other matmul (the first, third, ...) and
#   of the attention kernel, and its backward reruns everything else of the forward.
RECOMPUTE_IMPLEMENTATIONS = {"op_selective": "selective"}
# The share of each of a layer's GEMMs (`layer_gemms`' names) whose forward "op_selective"
# reruns: torchtitan's Llama block calls wq, wk, wv, wo, w1, w3, w2 (SwiGLU: w2(silu(w1(x)) *
# w3(x))), so the second, fourth and sixth rerun: wk (the first half of megatrain's kv), wo
# (proj) and w3 (the up projection, megatrain's fc1; its gate is w1).
OP_SELECTIVE_RERUN = {"kv": 0.5, "proj": 1.0, "fc1": 1.0}


def op_selective_activations_per_token(config: Config) -> float:
    """Bytes one layer keeps a token under "op_selective" (tp 1, a SwiGLU model with grouped
    key/value heads: what torchtitan's Llama is): the checkpointed layer's input (h), the
    kept matmuls' outputs (wq: a d, wv: g d, w1: f, w2: h) and the attention's output (a d),
    16-bit, and its fp32 log-sum-exp (a)."""
    m = config.model
    a, h, f = m.num_attention_heads, m.hidden_size, config.ffn_hidden_size
    d = m.kv_channels or h // a
    g = m.num_query_groups or a
    return 2 * (h + a * d + g * d + a * d + f + h) + 4 * a


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
        return per_token * batch * seq * cfg.num_layers
    return {"none": 0.0, "selective": core, "full": dense + core}[recompute]


def gpt_forward_flops(cfg: TransformerConfig, batch: int, seq: int) -> tuple[float, float, float]:
    """FLOPs of one forward pass of the whole GPT, in three parts the recompute modes redo
    differently: (the layers' dense matmuls, the layers' attention cores, the logits 2BshV)."""
    dense, core = transformer_forward_flops(cfg, batch, seq)
    return dense, core, 2 * batch * seq * cfg.hidden_size * cfg.vocab_size


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


@dataclass(frozen=True)
class ModelKind:
    """One model kind's counts (cfg, global batch, sequence length -> number)."""

    num_parameters: Callable[[TransformerConfig], int]
    forward_flops: Callable[..., tuple[float, float, float]]
    model_flops_per_iteration: Callable[..., float]
    hardware_flops_per_iteration: Callable[..., float]


GPT = ModelKind(
    gpt_parameters,
    gpt_forward_flops,
    gpt_model_flops_per_iteration,
    gpt_hardware_flops_per_iteration,
)
BERT = ModelKind(
    bert_parameters,
    bert_forward_flops,
    bert_model_flops_per_iteration,
    bert_hardware_flops_per_iteration,
)
KINDS = {"gpt": GPT, "bert": BERT, "llama": GPT}  # a Llama is GPTModel with its switches


def parameter_count(kind: str, cfg: TransformerConfig) -> int:
    """Parameters of the whole `kind` model, tied embeddings counted once."""
    return KINDS[kind].num_parameters(cfg)


def flops_per_iteration(
    kind: str,
    cfg: TransformerConfig,
    global_batch: int,
    seq_length: int,
    recompute: str | None = None,
) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one training iteration of the `kind` model: the
    numerators of MFU and HFU (recompute as `cfg.recompute`, or a published run's policy)."""
    formulas = KINDS[kind]
    recompute = recompute or cfg.recompute
    return (
        formulas.model_flops_per_iteration(cfg, global_batch, seq_length),
        formulas.hardware_flops_per_iteration(cfg, global_batch, seq_length, recompute),
    )


# ---------------------------------------------------------------------------- memory


def state_bytes_per_parameter(
    precision: str, distributed_optimizer: bool, dp: int, sharding: str | None = None
) -> dict[str, float]:
    """megacore's optimizer table split by what holds the bytes: the model's weights (2 in
    16 bits, 4 in fp32), the fp32 gradient buffer (4), and the optimizer's state (fp32 master
    weights when the model is 16-bit, Adam's two moments: 12 or 8), sharded over dp by the
    distributed optimizer.

    In all: fp32 16 bytes per parameter (weights and grads 4 each, Adam's two moments 8);
    fp16/bf16 18 (16-bit weights 2, fp32 grads 4, fp32 master and moments 12); under
    `use_distributed_optimizer` 8 + 8/d and 6 + 12/d.

    `sharding` (parallel.data_parallel_sharding; None: "optimizer" or "none" as
    `distributed_optimizer` says): "full" (FSDP2) keeps every parameter once in fp32, sharded,
    the masters themselves (weights 4/d), its fp32 gradient sharded (4/d) and Adam's moments
    (8/d): 16/d in any precision.  What FSDP gathers for compute comes on top
    (`fsdp_gathered_bytes`).
    """
    if sharding == "full":
        return {"weights": 4 / dp, "gradients": 4 / dp, "optimizer_state": 8 / dp}
    optimizer = 8 if precision == "fp32" else 12
    return {
        "weights": 4 if precision == "fp32" else 2,
        "gradients": 4,
        "optimizer_state": optimizer / dp if distributed_optimizer else optimizer,
    }


def fsdp_gathered_bytes(
    params: int,
    layer_params: int,
    layers: int,
    precision: str,
    reshard_after_forward: bool,
    microbatches: int,
    reduce_every_microbatch: bool = False,
) -> float:
    """Bytes FSDP2 holds unsharded on top of its shards (`data_parallel_sharding = "full"`),
    for a stage of `params` parameters per rank, `layers` layers of `layer_params` each:

    - gathered parameters in the compute dtype (2 bytes in 16 bits, 4 in fp32): the chunk's
      own (embeddings, output layer: kept from forward to backward) and, with
      `reshard_after_forward`, two layers' (the one computing, the one prefetched), else
      every layer's;
    - gradients: with one microbatch, or with `reduce_every_microbatch`
      (`parallel.reduce_every_microbatch`: each microbatch reduce-scattered into the
      shards), one layer's unsharded gradient and its fp32 reduce-scatter copy; with
      gradient accumulation otherwise every parameter's unsharded fp32 gradient, held from
      the first microbatch's backward to the last one's reduce-scatter.
    """
    compute = 4 if precision == "fp32" else 2
    own = params - layers * layer_params
    gathered = own + (min(2, layers) if reshard_after_forward else layers) * layer_params
    accumulated = microbatches > 1 and not reduce_every_microbatch
    gradients = 4 * params if accumulated else (compute + 4) * layer_params
    return compute * gathered + gradients


def checkpoint_copy_bytes_per_parameter(
    precision: str, distributed_optimizer: bool, dp: int, sharding: str | None = None
) -> float:
    """Host bytes per parameter of a rank's copy of its state for a background save
    (`checkpoint.async_save`, megatrain.checkpoint.background): what the rank saves, its
    weights in the run's dtype (2 or 4 bytes; under "full" its rows only, / dp) and its
    optimizer state, the fp32 master and Adam's two moments (12 bytes, / dp when sharded)."""
    full = sharding == "full"
    weights = (4 if precision == "fp32" else 2) / (dp if full else 1)
    return weights + 12 / (dp if full or distributed_optimizer else 1)


def _context_parallel(config: Config) -> tuple[int, int, int]:
    """(cp, the whole sequence s, the tokens of it one CP rank holds: s / cp)."""
    cp = config.parallel.context_parallel_size
    s = config.training.seq_length
    return cp, s, s // cp


def expert_layout(config: Config) -> tuple[int, int]:
    """(ep, etp) of a config: parallel.expert_model_parallel_size and
    expert_tensor_parallel_size (None: the tensor-parallel size)."""
    p = config.parallel
    etp = p.expert_tensor_parallel_size
    return p.expert_model_parallel_size, p.tensor_model_parallel_size if etp is None else etp


def moe_mlp_activations(config: Config) -> float:
    """A MoE layer's MLP activations per token, in the units of `activations_per_layer`'s
    TP-split term (bytes / (s b h) at 16 bits; what replaces the dense MLP's 4 or 8 f / h):
    the router's fp32 logits and scores (8 E / h); the permuted tokens the experts take and
    the outputs they give back, kept for the weights' gradients (2 x 2 k, each of the k
    copies of a token; x etp, whose ranks all take the tokens of their group); each copy's
    f_e-wide tensors (4 or 8 f_e / h, at f_e / etp on etp x the tokens: the same bytes); the
    shared expert's (4 or 8 f_s / h).  Tokens spread evenly over the experts (a balanced
    router): an expert-parallel rank takes as many copies as its tokens make."""
    m = config.model
    h, E, k = m.hidden_size, m.num_moe_experts, m.moe_router_topk
    f_tensors = 8 if config.model_switch("swiglu") else 4
    f_e = m.moe_ffn_hidden_size or config.ffn_hidden_size
    shared = m.moe_shared_expert_intermediate_size or 0
    etp = expert_layout(config)[1]
    return 8 * E / h + 4 * k * etp + f_tensors * (k * f_e + shared) / h


def moe_dispatch_bytes(config: Config) -> float:
    """Bytes the token dispatch of one MoE layer holds while it runs (once per stage, not
    kept): the all-to-all's send and receive buffers of the rank's s b / tp tokens x k
    copies x h (16 bits; x etp: gathered over the expert-tensor-parallel group); 0 when the
    experts are not split over ranks (ep = etp = 1)."""
    ep, etp = expert_layout(config)
    if ep * etp == 1:
        return 0.0
    m, t = config.model, config.training
    tokens = t.seq_length // config.parallel.context_parallel_size * t.micro_batch_size
    tokens /= config.parallel.tensor_model_parallel_size
    return 2 * 2 * tokens * etp * m.moe_router_topk * m.hidden_size


def activations_per_layer(
    config: Config, recompute: str, moe: bool = False, attention: str = "unfused"
) -> float:
    """Bytes one layer keeps for one microbatch (Korthikanti et al. 2022, section 4; 16-bit
    activations, 1-byte dropout masks), s sequence, b micro batch, h hidden, a heads, t tp:

        none       s b h (34 + 5 a s / h)                     tp 1
                   s b h (10 + 24/t + 5 a s / (h t))          tp t
                   s b h (34/t + 5 a s / (h t))               tp t, sequence parallel
        selective  the same without the 5 a s / h term (the attention core's s x s tensors)
        full       2 s b h, the layer's input (/ t with sequence parallelism or
                   distribute_saved_activations)

    The 5 a s / h term is what attention that materializes its s x s scores keeps
    (`attention` "unfused", the default: the paper's kernels, and an upper bound for a real
    run whatever SDPA picks).  `attention` "flash" (what SDPA runs in 16 bits on Ampere and
    newer; `flash_attention`) keeps no scores: in place of the term, "none" keeps the
    kernel's fp32 row statistic (log-sum-exp), 4 a s b / t bytes, and its output is the
    projection's input counted above.  Under context parallelism the choice does not apply
    (see below: as megacore runs it).

    The 24 is what TP splits: q, k, v and the projection's input (8), the MLP's two
    f-wide tensors (16 at f = 4h); the 10 what it does not (the norms' and the linears'
    inputs, 8, and the two hidden dropout masks, 1 byte an element each).  Without hidden
    dropout (`model.hidden_dropout` 0: Llama's, MPT's) there are no masks and it is 8:
    megatrain's `_dropout` returns its input untouched at p = 0, so nothing is saved for it.
    In general 4 + 4 g/a + 4 f/h for g key/value groups, and
    4 + 4 g/a + 8 f/h with SwiGLU, which keeps four f-wide tensors (gate, up, SiLU(gate),
    their product).  A MoE layer (`moe`) has `moe_mlp_activations` in place of the MLP's
    4 or 8 f/h (TP-split: MoE at tp > 1 runs with sequence parallelism).

    Context parallelism (cp > 1): every per-token tensor above is the rank's s / cp tokens,
    so the per-token bytes are exactly 1/cp of cp 1's; in place of the 5 a s / h term,
    "none" keeps what the attention over the whole sequence keeps
    (`context_parallel_attention_per_layer`: the other ranks' K/V and the masks or scores),
    which "selective" and "full" recompute instead (the layer being recomputed holds it
    once: `megatrain.plan.memory`).
    """
    m, p, t = config.model, config.parallel, config.training
    cp, whole, s = _context_parallel(config)
    b, h, a = t.micro_batch_size, m.hidden_size, m.num_attention_heads
    tp = p.tensor_model_parallel_size
    sp = p.sequence_parallel and tp > 1
    if recompute == "full":
        split_input = sp or (p.distribute_saved_activations and tp > 1)
        return 2 * s * b * h / (tp if split_input else 1)
    if recompute == "op_selective":  # a published run's (RECOMPUTE_IMPLEMENTATIONS)
        return s * b * op_selective_activations_per_token(config)
    # k and v: g groups split over tp, or one whole group per rank when g < tp
    groups = max(m.num_query_groups or a, tp)
    f_tensors = 8 if config.model_switch("swiglu") else 4
    mlp = moe_mlp_activations(config) if moe else f_tensors * config.ffn_hidden_size / h
    split = 4 + 4 * groups / a + mlp
    # the norms' and the linears' inputs, and the two hidden dropout masks where there is dropout
    unsplit = 8 + (2 if m.hidden_dropout else 0)
    dense = (unsplit + split) / tp if sp else unsplit + split / tp
    per_token = s * b * h * dense
    if recompute == "selective":
        return per_token
    if cp > 1:
        return per_token + context_parallel_attention_per_layer(config)
    if flash_attention(config, attention):
        return per_token + 4 * a * s * b / tp
    return per_token + s * b * h * 5 * a * whole / (h * tp)


# How a layer's attention core runs (`attention_kernel`).
ATTENTION_KERNELS = ("flash", "masked", "ring", "ring_float32", "unfused")
# Implementations of a kernel that published runs ran and megatrain does not, so that the
# plan is checked against what each run did (published_runs.toml's `attention`): each keeps
# what its kernel keeps and runs where it runs, and only its time differs (cost_model's
# `Costs.flash_attention` and `layer_seconds`):
# - "flash_triton": FlashAttention in Triton (flash-attention's flash_attn_triton.py, what
#   llm-foundry's MPT ran with attn_impl "triton"), a flash kernel;
# - "fused_softmax": Megatron-LM's fused scale-mask-softmax CUDA kernel and torch's dropout
#   around the two batched products (Megatron-LM 2020-2022's path; its 2019 code ran
#   separate torch ops, "unfused"), an unfused kernel.
ATTENTION_IMPLEMENTATIONS = {
    "flash": "flash", "unfused": "unfused", "flash_triton": "flash", "fused_softmax": "unfused",
}  # fmt: skip


def attention_kernel(config: Config, attention: str) -> str:
    """How a layer's attention core runs at this config on a GPU whose attention is
    `attention` ("flash": SDPA's fused kernels, Ampere and newer; "unfused": the 2019
    kernels, V100 or asked for):

    - "flash": cp 1 in 16 bits with "flash": SDPA with is_causal and no mask runs a flash
      kernel (FlashAttention-2, or cuDNN's, which torch puts first on Hopper and Blackwell
      with cuDNN newer than 9.15): no s x s scores kept, the masked blocks of causal
      attention skipped.
    - "masked": cp > 1 with `cp_comm_type = "allgather"` in 16 bits with "flash": megacore
      calls SDPA with a boolean mask over the gathered K/V (the keys each local query sees).
      Flash refuses a mask, so SDPA runs cuDNN's fused kernel where torch puts it first
      (sm90/sm100, cuDNN > 9.15: the H100s measured here ran it) or the memory-efficient
      kernel (A100), both fused, both taking the mask as an additive bias in the
      activations' dtype that SDPA converts it to: no scores kept, but every score computed,
      as neither can know which blocks the bias masks whole.
    - "ring": cp > 1 with "p2p" without packed documents, any GPU and precision: megacore's
      fused ring (`context_parallel._FusedRing`), one fused kernel call a ring step that
      returns its log-sum-exp (FlashAttention-2 in 16 bits on Ampere and newer, the
      memory-efficient kernel otherwise; a CPU's flash kernel), the balanced chunks paired so
      that causal attention computes half the scores, as flash at cp 1 does; it keeps q, k, v,
      the output and the log-sum-exp, and re-runs the ring in the backward.
    - "ring_float32": cp > 1 with "p2p" and packed documents (`data.reset_attention_mask`,
      whose masks cut blocks anywhere): megacore's ring of float32 torch ops (matmul, where,
      logsumexp, softmax, matmul), the scores and probabilities materialized and kept, no
      block skipped.
    - "unfused": otherwise (the 2019 kernels: "unfused" asked for, a V100, or fp32 outside
      the ring, where the fused kernels' figures do not apply).
    """
    p = config.parallel
    return attention_kernel_for(
        attention,
        config.training.precision,
        p.context_parallel_size,
        p.cp_comm_type,
        config.data.reset_attention_mask,
    )


def attention_kernel_for(
    attention: str, precision: str, cp: int, cp_comm: str, documents: bool = False
) -> str:
    """`attention_kernel` of a precision, context-parallel size and communication, with or
    without packed documents' masks (`documents`)."""
    if attention not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"attention must be one of {tuple(ATTENTION_IMPLEMENTATIONS)}, not {attention!r}"
        )
    attention = ATTENTION_IMPLEMENTATIONS[attention]
    if cp > 1 and cp_comm == "p2p":
        return "ring_float32" if documents else "ring"
    if attention == "unfused" or precision == "fp32":
        return "unfused"
    return "flash" if cp == 1 else "masked"


def flash_attention(config: Config, attention: str) -> bool:
    """Whether a layer's attention core runs as a flash kernel (no s x s scores in memory,
    causal blocks skipped): `attention_kernel` "flash" (asked for, 16 bits, cp 1)."""
    return attention_kernel(config, attention) == "flash"


def context_parallel_masks(config: Config) -> int:
    """How many copies of the allgather path's and the ring's mask a microbatch makes: one
    [1, 1, s/cp, s] mask for causal attention, shared by its sequences and heads, or one per
    sequence when each attends within its documents (`data.reset_attention_mask`)."""
    return config.training.micro_batch_size if config.data.reset_attention_mask else 1


def context_parallel_attention_per_layer(config: Config) -> float:
    """Bytes the attention of one layer keeps for one microbatch under context parallelism
    (cp > 1) beyond the rank's own per-token tensors (`activations_per_layer`), as
    megacore.context_parallel runs it; 0 at cp 1.  s the whole sequence, s/cp the rank's
    tokens, b micro batch, a heads of d, t tp, g key/value groups (one per TP rank when
    g < t), n the masks (`context_parallel_masks`: 1, or b with documents), in the 16-bit
    convention of `activations_per_layer` (fp32 runs double it):

    - "allgather" (`attention_kernel` "masked" on a GPU; on a CPU SDPA's fused CPU kernel
      keeps as little): the other ranks' keys and values, 4 (g/t) d (s - s/cp) b (SDPA
      keeps the gathered K/V of the whole sequence; the rank's own are the per-token k and
      v); the additive mask SDPA makes of the boolean one and its kernel keeps for the
      backward, 2 (s/cp) s n; the kernel's fp32 log-sum-exp, 4 (a/t) (s/cp) b, and its
      output, 2 (a/t) d (s/cp) b, which megacore's masked_fill (rows that see no key) copies
      into the projection's input.  No per-head scores.  The boolean mask is held only
      while the layer's attention runs (`context_parallel_attention_working`).
    - "p2p" without packed documents (`attention_kernel` "ring", the fused ring): only what
      flash keeps at cp 1 for the rank's tokens, its fp32 log-sum-exp, 4 (a/t) (s/cp) b (q,
      k, v and the output are the per-token tensors counted by `activations_per_layer`).
    - "p2p" with packed documents ("ring_float32"): the ring's block attention is plain
      torch ops in float32 (no fused kernel):
      autograd keeps every block's K/V in float32, the whole sequence's (8 (g/t) d s b),
      the queries' float32 copy in a 16-bit run (4 (a/t) d (s/cp) b), every block's float32
      scores (logsumexp's input) and probabilities (softmax's output), 8 (a/t) (s/cp) s b,
      with its boolean mask (torch.where's condition), (s/cp) s n, the merge's stack of the
      cp blocks' float32 outputs, 4 (a/t) d s b, and their log-sum-exps, merged
      log-sum-exps and weights, 12 (a/t) s b.

    Under recompute "none" every layer keeps this; under "selective" and "full" the layer
    whose attention is being recomputed holds it, once.
    """
    m, p, t = config.model, config.parallel, config.training
    cp, whole, s = _context_parallel(config)
    if cp == 1:
        return 0.0
    b, h, a = t.micro_batch_size, m.hidden_size, m.num_attention_heads
    tp = p.tensor_model_parallel_size
    d = m.kv_channels or h // a
    kv_per_token = 2 * max(m.num_query_groups or a, tp) / tp * d  # K and V elements
    width = a / tp * d  # the queries' (and the output's) elements a token on this rank
    masks = context_parallel_masks(config)
    # Bytes of an fp32 element and of a boolean in the 16-bit convention (fp32 runs double).
    fp32, boolean = (2, 0.5) if t.precision == "fp32" else (4, 1)
    if p.cp_comm_type == "allgather":
        gathered = 2 * kv_per_token * (whole - s) * b
        kernel = fp32 * a / tp * s * b + 2 * width * s * b  # log-sum-exp and output
        return gathered + 2 * s * whole * masks + kernel
    if not config.data.reset_attention_mask:  # the fused ring: its log-sum-exp
        return fp32 * a / tp * s * b
    queries = 0 if t.precision == "fp32" else fp32 * width * s * b
    scores = 2 * fp32 * a / tp * s * whole * b + boolean * s * whole * masks
    merge = fp32 * (width + 3 * a / tp) * whole * b
    return fp32 * kv_per_token * whole * b + queries + scores + merge


def context_parallel_attention_working(config: Config) -> float:
    """Bytes one layer's attention holds under context parallelism only while it runs (one
    layer's at a time), in `context_parallel_attention_per_layer`'s convention; 0 at cp 1:

    - "allgather": the boolean mask, (s/cp) s n bytes, from which SDPA makes its additive
      one (kept) and megacore the rows that see no key.
    - "p2p" without packed documents (the fused ring), in its backward (its forward holds
      less): two K/V blocks in flight, 2 x 2 (g/t) d (s/cp) b x 2 bytes; the two float32
      K/V-gradient accumulators travelling with them, 2 x 2 (g/t) d (s/cp) b x 4; the
      float32 query gradient, 4 (a/t) d (s/cp) b; the late query chunk's copies of the
      output's gradient, q and the output, 3 x 2 (a/t) d (s/cp) b / 2; and one kernel call's
      q, k and v gradients, 2 ((a/t) + 2 (g/t)) d (s/cp) b.
    - "p2p" with packed documents (the float32 ring): during a block's backward, three
      float32 tensors of its scores, 12 (a/t) (s/cp) (s/cp) b: the softmax's input gradient
      and logsumexp's exp(scores - lse) and its product with the gradient, before the two
      gradients are summed.
    """
    m, p, t = config.model, config.parallel, config.training
    cp, whole, s = _context_parallel(config)
    if cp == 1:
        return 0.0
    masks = context_parallel_masks(config)
    if p.cp_comm_type == "allgather":
        boolean = 0.5 if t.precision == "fp32" else 1
        return boolean * s * whole * masks
    fp32 = 2 if t.precision == "fp32" else 4
    heads = m.num_attention_heads / p.tensor_model_parallel_size
    b = t.micro_batch_size
    if not config.data.reset_attention_mask:  # the fused ring's backward
        tp, a = p.tensor_model_parallel_size, m.num_attention_heads
        d = m.kv_channels or m.hidden_size // a
        kv = 2 * max(m.num_query_groups or a, tp) / tp * d * s * b  # a block's K and V
        width = heads * d * s * b  # the rank's queries
        # 16-bit tensors at 2 bytes and float32 ones at `fp32`, as above
        return 2 * 2 * kv + 2 * fp32 * kv + fp32 * width + 3 * 2 * width / 2 + 2 * (width + kv)
    return 3 * fp32 * heads * s * (whole // cp) * b


def weight_grad_inputs_per_layer(config: Config) -> float:
    """Bytes one layer holds for one microbatch between ZB-H1's B and W steps: each dense
    GEMM's input and output gradient, from which W computes the weight gradient (16-bit).

    Per s b h, with t tp, g key/value groups, a heads, f the FFN size: the full-width
    tensors (the QKV and MLP inputs, all-gathered under sequence parallelism, and the
    projection's and the MLP's output gradients before they are reduced) 4, plus the
    TP-split ones: QKV's output gradient (1 + 2 g/a), the projection's input 1, the MLP's
    up gradients (f/h, twice with SwiGLU) and its down input f/h, each / t.  Under context
    parallelism s is the rank's s / cp tokens.
    """
    m, p, t = config.model, config.parallel, config.training
    s = _context_parallel(config)[2]
    b, h, a = t.micro_batch_size, m.hidden_size, m.num_attention_heads
    groups = max(m.num_query_groups or a, p.tensor_model_parallel_size)  # one per rank when fewer
    f = config.ffn_hidden_size / h
    up = 2 if config.model_switch("swiglu") else 1
    split = (1 + 2 * groups / a) + 1 + up * f + f
    return 2 * s * b * h * (4 + split / p.tensor_model_parallel_size)


__all__ = [
    "ATTENTION_IMPLEMENTATIONS",
    "ATTENTION_KERNELS",
    "BERT",
    "GPT",
    "KINDS",
    "MASKED_LM_PROB",
    "Gemm",
    "ModelKind",
    "activations_per_layer",
    "active_ffn_width",
    "active_parameters",
    "attention_core_flops",
    "attention_kernel",
    "attention_kernel_for",
    "bert_forward_flops",
    "bert_hardware_flops_per_iteration",
    "bert_model_flops_per_iteration",
    "bert_parameters",
    "context_parallel_attention_per_layer",
    "context_parallel_attention_working",
    "context_parallel_masks",
    "expert_ffn_size",
    "expert_layout",
    "expert_parameters_per_gpu",
    "flash_attention",
    "flops_per_iteration",
    "fsdp_gathered_bytes",
    "gpt_forward_flops",
    "gpt_hardware_flops_per_iteration",
    "gpt_model_flops_per_iteration",
    "gpt_parameters",
    "layer_gemms",
    "layer_parameters",
    "layer_parameters_per_rank",
    "moe_dispatch_bytes",
    "moe_layer_count",
    "moe_mlp_activations",
    "moe_mlp_parameters",
    "parameter_count",
    "parameters_per_gpu",
    "recomputed_flops",
    "state_bytes_per_parameter",
    "transformer_forward_flops",
    "weight_grad_inputs_per_layer",
]
