"""Tensor-model parallelism (paper section 3): layers, region operators, cross entropy, RNG.

Megatron-LM's public names, so code and habits carry over.  Activations are
[sequence, batch, hidden]; sequence parallelism shards the first dimension.
"""

from megacore.tensor_parallel.comm_overlap import all_gather_matmul, matmul_reduce_scatter
from megacore.tensor_parallel.cross_entropy import (
    default_chunk_tokens,
    linear_vocab_parallel_cross_entropy,
    vocab_parallel_cross_entropy,
)
from megacore.tensor_parallel.float8 import Float8Recipe, check_float8_available
from megacore.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    init_method_normal,
    scaled_init_method_normal,
    sync_sequence_parallel_grads,
    vocab_parallel_embedding,
)
from megacore.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megacore.tensor_parallel.random import (
    RNGStatesTracker,
    checkpoint,
    get_cuda_rng_tracker,
    get_rng_tracker,
    model_parallel_cuda_manual_seed,
    model_parallel_manual_seed,
)
from megacore.tensor_parallel.utils import (
    divide,
    divide_by_tp,
    param_is_not_tensor_parallel_duplicate,
    set_tensor_model_parallel_attributes,
    shard_of,
    split_tensor_along_last_dim,
    unshard,
    vocab_range,
    vocab_size_with_padding,
)
from megacore.tensor_parallel.weight_grad import (
    apply_weight_grads,
    deferring_weight_grads,
    linear,
    split_backward,
)

__all__ = [
    "ColumnParallelLinear",
    "Float8Recipe",
    "RNGStatesTracker",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "all_gather_matmul",
    "apply_weight_grads",
    "check_float8_available",
    "checkpoint",
    "copy_to_tensor_model_parallel_region",
    "default_chunk_tokens",
    "deferring_weight_grads",
    "divide",
    "divide_by_tp",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "get_cuda_rng_tracker",
    "get_rng_tracker",
    "init_method_normal",
    "linear",
    "linear_vocab_parallel_cross_entropy",
    "matmul_reduce_scatter",
    "model_parallel_cuda_manual_seed",
    "model_parallel_manual_seed",
    "param_is_not_tensor_parallel_duplicate",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scaled_init_method_normal",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "set_tensor_model_parallel_attributes",
    "shard_of",
    "split_backward",
    "split_tensor_along_last_dim",
    "sync_sequence_parallel_grads",
    "unshard",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embedding",
    "vocab_range",
    "vocab_size_with_padding",
]
