"""Recompute policies published runs ran and megatrain does not offer
(`RECOMPUTE_IMPLEMENTATIONS`): the GEMMs torchtitan's "op_selective" reruns
(`OP_SELECTIVE_RERUN`, for `recomputed_flops`) and the bytes it keeps a token
(`op_selective_activations_per_token`, for `activations_per_layer`).
"""

from megatrain.config import Config

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
