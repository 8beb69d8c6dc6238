"""The attention kinds a `TransformerLayer` can hold, one module each, and the registry that picks
one by `TransformerConfig.attention_type`.

What they share lives in modules of its own: `rope` (rotary positions), `masks` (documents'
masks, FlexAttention block masks), `kv_cache` (generation), `inputs` (what a batch hands every
layer's attention) and `core` (the softmax(qk^T)v kernels: SDPA, FlexAttention, context
parallelism).

An attention kind is an `nn.Module` built as `Kind(cfg, place, parallel)` (the model config,
`common.placement`'s keyword arguments with the layer's generator, the rank's
`ParallelContext`) whose `forward(x [s, b, h], mask, cache, layer_id)` returns the output
without its bias and that bias (or None), for `bias_dropout_add`.  What `parallelize` sets
on it from outside: `context_parallel` (None, or the chunk's `ContextParallel`) and
`core_attention` (the call of its attention core, `core`, which selective recompute wraps
in a checkpoint); its `core(q, k, v, mask)` must therefore be the part worth recomputing.

The kinds: "mha" (`self_attention`: multi-head and grouped-query) and "mla" (`multi_latent`:
DeepSeek-V2/V3's multi-latent attention, `model.multi_latent_attention`, whose `core(q,
latent, k_rope, mask)` takes the key/value latent and up-projects it inside, so selective
recompute keeps the latent).

Adding a kind: its module here, a line in `ATTENTION_KINDS`, and the config field that
selects it (mapped to `attention_type` in `models.model_config`).  Attention with sinks and
sliding windows (gpt-oss) is not built yet.
"""

from megatrain.models.attention.multi_latent import MultiLatentAttention
from megatrain.models.attention.self_attention import SelfAttention

ATTENTION_KINDS = {
    "mha": SelfAttention,  # multi-head, and grouped-query with num_query_groups < heads
    "mla": MultiLatentAttention,  # DeepSeek-V2/V3's multi-latent attention
}


def build_attention(cfg, place: dict, parallel):
    """The attention of one layer, of the kind `cfg.attention_type` names."""
    kind = ATTENTION_KINDS.get(cfg.attention_type)
    if kind is None:
        raise ValueError(
            f"model attention_type must be one of {tuple(ATTENTION_KINDS)}, "
            f"not {cfg.attention_type!r}"
        )
    return kind(cfg, place, parallel)
