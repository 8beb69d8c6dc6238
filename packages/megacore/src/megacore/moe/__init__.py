"""Mixture of experts: routing (`router`), token permutation and the one-process dispatcher
(`permute`), the experts' grouped MLP (`experts`).  Plain functions over tensors; the layer
that holds the weights is megatrain's `models.moe.MoELayer`."""

from megacore.moe.experts import ACTIVATIONS, fc1_shard, grouped_gemm_available, grouped_mlp
from megacore.moe.permute import LocalDispatcher, permute, unpermute
from megacore.moe.router import (
    DROP_POLICIES,
    DROPPED,
    LOAD_BALANCING_TYPES,
    SCORE_FUNCTIONS,
    MoEAuxLossAutoScaler,
    drop_over_capacity,
    expert_capacity,
    routing_scores_for_aux_loss,
    sequence_load_balancing_loss,
    switch_load_balancing_loss,
    tokens_per_expert,
    topk_routing,
    update_expert_bias,
    z_loss,
)

__all__ = [
    "ACTIVATIONS",
    "DROPPED",
    "DROP_POLICIES",
    "LOAD_BALANCING_TYPES",
    "SCORE_FUNCTIONS",
    "LocalDispatcher",
    "MoEAuxLossAutoScaler",
    "drop_over_capacity",
    "expert_capacity",
    "fc1_shard",
    "grouped_gemm_available",
    "grouped_mlp",
    "permute",
    "routing_scores_for_aux_loss",
    "sequence_load_balancing_loss",
    "switch_load_balancing_loss",
    "tokens_per_expert",
    "topk_routing",
    "unpermute",
    "update_expert_bias",
    "z_loss",
]
