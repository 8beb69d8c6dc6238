"""Parameters of a model, from its config alone.

- **Parameters**: `layer_parameters`, `layer_parameters_per_rank` (their attention's:
  `attention_parameters`, `attention_parameters_per_rank`, multi-latent attention's
  included); the whole model by kind,
  tied embeddings counted once (`gpt_parameters`, `bert_parameters`, `parameter_count`);
  what one GPU of a pipeline stage holds (`parameters_per_gpu`, of which experts:
  `expert_parameters_per_gpu`).  A mixture of experts (`num_moe_experts`) holds, on each of
  its MoE layers (`moe_layer_count`), E experts of 2 or 3 (SwiGLU) matrices of h x f_e in
  place of the dense MLP, the router [E, h] and the shared expert (`moe_mlp_parameters`); a
  token uses k of the experts (`active_parameters`).  Multi-token prediction's depths
  (`mtp_parameters`) are counted in the model and on its last stage.
"""

import functools
from types import SimpleNamespace

from megacore.pipeline_parallel.layer_assignment import layers_for
from megatrain.models.moe import is_moe_layer
from megatrain.models.transformer_config import TransformerConfig


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
    matrices of h x f_e, with add_bias each expert's fc1 and fc2 biases), the router [E, h]
    (and its bias [E] with add_bias; the expert bias is a buffer) and the shared expert (its
    matrices, biases, and its gate [1, h])."""
    h, E = cfg.hidden_size, cfg.num_moe_experts
    mlp = 3 if cfg.swiglu else 2
    f_shared = cfg.moe_shared_expert_intermediate_size or 0
    shared = mlp * h * f_shared + (_mlp_biases(cfg, f_shared) if f_shared else 0)
    return {
        "experts": E * (mlp * h * expert_ffn_size(cfg) + _mlp_biases(cfg, expert_ffn_size(cfg))),
        "router": E * h + (E if cfg.add_bias else 0),
        "shared_expert": shared + (h if cfg.moe_shared_expert_gate else 0),
    }


def _mlp_biases(cfg: TransformerConfig, f: int) -> int:
    """An MLP of width f's biases with add_bias: fc1's (gate's and up's when gated), fc2's."""
    return ((2 if cfg.swiglu else 1) * f + cfg.hidden_size) if cfg.add_bias else 0


def _layer_shapes(cfg: TransformerConfig) -> tuple[int, int, int, int]:
    """(QKV's output width, MLP matrices of h x f, the MLP's column-parallel biases, one
    norm's parameters): heads x head_dim + 2 x groups x head_dim (3h without grouped-query
    attention or kv_channels); 3 matrices with SwiGLU (gate, up, down), else 2; the MLP's
    column biases with add_bias; LayerNorm has a bias, RMSNorm not."""
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    qkv = _attention_width(cfg) + 2 * (cfg.num_query_groups or cfg.num_attention_heads) * (
        _head_dim(cfg)
    )
    mlp = 3 if cfg.swiglu else 2
    norm = 2 * h if cfg.normalization == "layernorm" else h
    return qkv, mlp, (mlp - 1) * f if cfg.add_bias else 0, norm


def _norm(cfg: TransformerConfig, size: int) -> int:
    return (2 if cfg.normalization == "layernorm" else 1) * size


def _attention_split(cfg: TransformerConfig, tp: int) -> tuple[int, int]:
    """(parameters split over the TP ranks, whole, parameters every TP rank holds whole) of
    one layer's attention at tensor parallelism tp, the projection's bias among the whole.

    "mha": QKV (and its biases with add_bias or add_qkv_bias) and the projection split, the
    qk_layernorm norms whole, and the key/value projection whole when there are fewer
    key/value groups than TP ranks (`ReplicatedKV`).  "mla" (`multi_latent`): the query
    up-projection q_b [heads (d_n + d_r), r_q] or the direct q [heads (d_n + d_r), h], the
    key/value up-projection kv_b [heads (d_n + d_v), r_kv] and the projection [h, heads d_v]
    split; the down-projections q_a [r_q, h] and kv_a [r_kv + d_r, h] (with their biases
    under add_bias) and the latents' norms whole."""
    h, a = cfg.hidden_size, cfg.num_attention_heads
    proj_bias = h if cfg.add_bias else 0
    if cfg.attention_type == "mla":
        q_dim, r_q, r_kv = (
            cfg.qk_head_dim + cfg.qk_pos_emb_head_dim,
            cfg.q_lora_rank,
            cfg.kv_lora_rank,
        )
        down = cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim
        split = (r_q or h) * a * q_dim + r_kv * a * (cfg.qk_head_dim + cfg.v_head_dim)
        split += a * cfg.v_head_dim * h
        whole = (h + cfg.add_bias) * down + _norm(cfg, r_kv) + proj_bias
        if r_q:
            whole += (h + cfg.add_bias) * r_q + _norm(cfg, r_q)
        return split, whole
    qkv = _layer_shapes(cfg)[0]
    split = h * qkv + _attention_width(cfg) * h + (qkv if cfg.add_bias or cfg.add_qkv_bias else 0)
    whole = proj_bias + _qk_norms(cfg)
    if cfg.softmax_type == "learnable":  # the sinks, one a head, split with the heads
        split += a
    groups = cfg.num_query_groups or a
    if groups < tp:  # the key/value projection (and its bias) whole on every rank
        bias = 1 if cfg.add_bias or cfg.add_qkv_bias else 0
        kv = 2 * groups * _head_dim(cfg) * (h + bias)
        split, whole = split - kv, whole + kv
    return split, whole


def attention_parameters(cfg: TransformerConfig) -> int:
    """Parameters of one layer's attention, whole (all TP ranks together): weights, biases
    and its own norms (not the layer's input norm)."""
    return sum(_attention_split(cfg, 1))


def attention_parameters_per_rank(cfg: TransformerConfig, tp: int) -> int:
    """One layer's attention parameters on one TP rank (`_attention_split`)."""
    split, whole = _attention_split(cfg, tp)
    return split // tp + whole


def layer_parameters(cfg: TransformerConfig, moe: bool = False) -> int:
    """Parameters of one TransformerLayer (whole, all TP ranks together); `moe`: a MoE layer,
    its experts, router and shared expert in place of the dense MLP."""
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    _, mlp, mlp_biases, norm = _layer_shapes(cfg)
    fc2_bias = h if cfg.add_bias else 0
    if moe:  # the MoE's biases are its parts'
        mlp_params = sum(moe_mlp_parameters(cfg).values())
    else:
        mlp_params = mlp * h * f + mlp_biases + fc2_bias
    return attention_parameters(cfg) + mlp_params + 2 * norm


def layer_parameters_per_rank(
    cfg: TransformerConfig, tp: int, moe: bool = False, ep: int = 1, etp: int | None = None
) -> int:
    """One layer's parameters on one TP rank: the split matrices and column biases / tp, the
    row-parallel biases and the norms whole (as `layer_parameters` counts them, at tp 1), the
    attention's whole parts (`_attention_split`).  A MoE layer (`moe`) holds E / ep experts,
    each / etp (None: tp), the router and the shared expert's gate whole, the shared expert
    / tp."""
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    _, mlp, mlp_biases, norm = _layer_shapes(cfg)
    split, replicated = _attention_split(cfg, tp)
    replicated += 2 * norm
    fc2_bias = h if cfg.add_bias else 0
    experts = 0
    if moe:
        parts = moe_mlp_parameters(cfg)
        # The shared expert's gate and fc2 bias whole on each rank, the rest split.
        whole = h if cfg.moe_shared_expert_gate else 0
        whole += fc2_bias if cfg.moe_shared_expert_intermediate_size else 0
        split += parts["shared_expert"] - whole
        replicated += parts["router"] + whole
        # Each expert's matrices and biases split over etp (fc2's bias by h's columns).
        experts = parts["experts"] // (ep * (tp if etp is None else etp))
    else:
        split += mlp * h * f + mlp_biases
        replicated += fc2_bias
    return split // tp + replicated + experts


def _positions(cfg: TransformerConfig) -> int:
    return cfg.max_position_embeddings if cfg.position_embedding == "learned" else 0


def gpt_parameters(cfg: TransformerConfig) -> int:
    """Parameters of the whole GPT or Llama (tied embeddings counted once; an untied output
    layer counted beside them; multi-token prediction's depths, `mtp_parameters`), from the
    config alone."""
    h = cfg.hidden_size
    words = cfg.vocab_size * h * (1 if cfg.tie_output else 2)
    final_norm = _layer_shapes(cfg)[3]
    main = _layers_parameters(cfg) + words + _positions(cfg) * h + final_norm
    return main + mtp_parameters(cfg)


def mtp_layer_numbers(cfg: TransformerConfig) -> range:
    """The positions of multi-token prediction's layers (`models.mtp`): num_layers onwards."""
    return range(cfg.num_layers, cfg.num_layers + (cfg.mtp_num_layers or 0))


def mtp_parameters(cfg: TransformerConfig, tp: int = 1, ep: int = 1, etp: int | None = None) -> int:
    """Multi-token prediction's parameters on one TP rank of the last stage (tp 1: whole): per
    depth its three norms (enorm, hnorm, its final norm) whole, eh_proj [h, 2h] split over TP
    and one layer of its position's kind (`layer_parameters_per_rank`).  The word embeddings
    and the output layer it uses are the model's: DeepSeek's files hold a copy of each per
    depth beside them (`embed_tokens`, `shared_head.head`), which this does not count."""
    h, norm = cfg.hidden_size, _layer_shapes(cfg)[3]
    own = 3 * norm + 2 * h * h // tp
    return sum(
        own + layer_parameters_per_rank(cfg, tp, is_moe_layer(cfg, i), ep, etp)
        for i in mtp_layer_numbers(cfg)
    )


def _layers_parameters(cfg: TransformerConfig) -> int:
    moe = moe_layer_count(cfg)
    dense = (cfg.num_layers - moe) * layer_parameters(cfg)
    return dense + (moe * layer_parameters(cfg, True) if moe else 0)


def active_parameters(cfg: TransformerConfig) -> int:
    """Parameters one token of a GPT or Llama goes through: `gpt_parameters` with each MoE
    layer's k of its E experts (the router and shared expert whole; the model's count for a
    dense model), multi-token prediction's depths left out (a training objective's, not the
    model's way to the next token; DeepSeek-V3's 37B leaves them out).  Mixtral 8x7B: 12.9 B
    of 46.7 B."""
    unused = cfg.num_moe_experts - cfg.moe_router_topk if cfg.num_moe_experts else 0
    per_expert = moe_mlp_parameters(cfg)["experts"] // cfg.num_moe_experts if unused else 0
    main = gpt_parameters(cfg) - mtp_parameters(cfg)
    return main - moe_layer_count(cfg) * unused * per_expert


def bert_parameters(cfg: TransformerConfig) -> int:
    """Parameters of the whole BERT (tied embeddings counted once), from the config alone."""
    h, v = cfg.hidden_size, cfg.vocab_size
    embeddings = v * h + cfg.max_position_embeddings * h + cfg.num_tokentypes * h
    norms = 2 * h  # the final LayerNorm (pre_ln) or the embeddings' (post_ln)
    heads = (h * h + h) + 2 * h + v + (h * h + h) + (2 * h + 2)  # LM head, pooler, SOP
    return _layers_parameters(cfg) + embeddings + norms + heads


def stage_layer_ids(cfg: TransformerConfig, pp: int, stage: int) -> list[int]:
    """The transformer layers pipeline rank `stage` holds, over all its chunks: as
    `cfg.pipeline_layer_counts` gives them (parallel.pipeline_model_parallel_layout; the
    number of chunks a rank holds is their count / pp), or without a layout the even split,
    layers stage x n/pp onwards (interleaving moves which MoE layers a rank holds, not how
    many layers)."""
    counts = cfg.pipeline_layer_counts
    if counts is None:
        n = cfg.num_layers // pp
        return list(range(stage * n, (stage + 1) * n))
    return list(_stage_ids(cfg.num_layers, tuple(counts), pp, stage))


@functools.cache
def _stage_ids(num_layers: int, counts: tuple[int, ...], pp: int, stage: int) -> tuple:
    vpp = len(counts) // pp
    return tuple(
        layer
        for chunk in range(vpp)
        for layer in layers_for(num_layers, stage, pp, vpp, chunk, stage_layers=counts)
    )


def stage_layers(cfg: TransformerConfig, pp: int, stage: int) -> tuple[int, int]:
    """(dense layers, MoE layers) of pipeline rank `stage` (`stage_layer_ids`)."""
    ids = stage_layer_ids(cfg, pp, stage)
    if cfg.pipeline_layer_counts is None:  # contiguous: the remembered count
        moe = moe_layer_count(cfg, ids[0], ids[-1] + 1) if ids else 0
    else:
        freq = cfg.moe_layer_freq
        freq = freq if isinstance(freq, int) else tuple(freq)
        moe = _moe_among(freq, tuple(ids)) if cfg.num_moe_experts else 0
    return len(ids) - moe, moe


@functools.cache
def _moe_among(freq: int | tuple, ids: tuple[int, ...]) -> int:
    """How many of layers `ids` are MoE layers, remembered (`_moe_count`'s reason)."""
    pattern = SimpleNamespace(num_moe_experts=1, moe_layer_freq=freq)
    return sum(is_moe_layer(pattern, i) for i in ids)


def expert_parameters_per_gpu(
    cfg: TransformerConfig, pp: int = 1, stage: int = 0, ep: int = 1, etp: int = 1
) -> int:
    """The routed experts' parameters one GPU of stage `stage` holds (E / ep experts of each
    MoE layer, each / etp): what is reduced and sharded over the expert data-parallel group
    rather than the dense one.  0 for a dense model."""
    if not cfg.num_moe_experts:
        return 0
    moe = stage_layers(cfg, pp, stage)[1]
    if stage == pp - 1:  # multi-token prediction's MoE layers
        moe += sum(is_moe_layer(cfg, i) for i in mtp_layer_numbers(cfg))
    return moe * moe_mlp_parameters(cfg)["experts"] // (ep * etp)


def parameters_per_gpu(
    cfg: TransformerConfig,
    tp: int = 1,
    pp: int = 1,
    stage: int = 0,
    ep: int = 1,
    etp: int | None = None,
) -> int:
    """Parameters one GPU of pipeline stage `stage` holds (a last stage's copy of the tied
    embeddings included; with multi-token prediction its depths, and the copy of the word
    embeddings they embed with when the output layer is untied and pp > 1).  At tp = pp = 1
    (and ep 1) this is the model's `parameter_count`.
    A bidirectional config is BERT: token types, and its heads on the last stage.  MoE layers
    hold E / ep experts, each / etp (None: tp)."""
    h = cfg.hidden_size
    dense, moe = stage_layers(cfg, pp, stage)
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
        if cfg.mtp_num_layers:
            count += mtp_parameters(cfg, tp, ep, etp)
            if pp > 1 and not cfg.tie_output:
                count += words  # the copy of the word embeddings MTP embeds with
        if not cfg.causal:  # BERT's LM head (dense, LayerNorm, vocab-split bias), pooler, SOP
            count += (h * h + h) + 2 * h + cfg.vocab_size // tp + (h * h + h) + (2 * h + 2)
    return count
