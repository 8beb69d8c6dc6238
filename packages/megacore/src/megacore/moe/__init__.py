"""Mixture of experts: routing (`router`), token permutation and the one-process dispatcher
(`permute`), the experts' grouped MLP (`experts`).  Plain functions over tensors; the layer
that holds the weights is megatrain's `models.moe.MoELayer`.

The gradient-scale rule
-----------------------
Every parameter ends the backward with one process's gradient: that of the global batch's
mean LM loss plus each MoE layer's aux losses (load balancing, z) averaged over the
microbatches.  A stage's tokens are split over TP x CP x DP, all of them different (MoE at
tp > 1 needs sequence parallelism); megatrain's DDP reduces over DP x CP, N = dp x cp ranks.
Each (dp, cp) place backpropagates (1/M) (L + cp x its aux shares), M microbatches:

- L, its LM loss, one for its TP ranks: a CP rank's is scaled so that the CP ranks' mean
  is the microbatch's (megatrain's run.step `gpt_loss`).
- an aux share: each TP x CP rank's router losses over `aux_loss_group` = TP x CP, the
  ranks holding the microbatch's other tokens (token counts summed over it, the z loss
  divided by its size), so the shares add up over TP x CP to the microbatch's loss once,
  not to cp copies as the L's do.  The DDP's 1/N takes a 1/cp the shares never had: the
  train step gives `MoEAuxLossAutoScaler` the main loss's scale x cp.  TP needs no factor:
  the TP ranks' router gradients (`sequence_parallel`) are summed, never averaged.

| parameter                    | a rank's gradient holds             | summed over  | / by    |
|------------------------------|-------------------------------------|--------------|---------|
| dense, TP-split              | its shard's, its TP group's tokens  | DP x CP      | N       |
| replicated (router, norms)   | its own tokens' share (SP)          | DP x CP, TP  | N       |
| expert (`allreduce = False`) | its slice's, the tokens its ETP x   | expert DP    | N, not  |
|                              | EP group routed to its experts      | (EDP)        | EDP's   |

Experts divide by N: the ranks holding one slice of one expert (its EDP group) each take
the tokens of their own ETP x EP group, and those groups partition the stage, so the EDP
sum, like the dense one, covers every token of the stage once (`distributed.data_parallel`
divides every bucket by its dense size).  Each sum is then d/dw of S = the sum over the N
places of (1/M)(L + cp x shares), and S / N is one process's loss (the L's mean, the aux
losses' mean over the dp x M microbatches).

The norm counts each element once (`optimizer.clip_grads.counts_once`): after the
reduction a group's ranks hold the same sum (sharded: one shard each).  Dense terms are
summed over TP x PP (+ the DDP group when sharded), a TP duplicate on TP rank 0 only, the
tied embedding on the first stage; an expert element lives on one rank of ETP x EP x PP,
so every expert term counts, summed over that group (+ EDP when sharded) apart from the
dense ones (`expert_norm_groups`; with them when the expert layout is the dense one).
The logged aux loss mirrors the rule: megatrain's `aux_loss_over_layout` sums the shares
over TP x CP x DP and divides by dp.
"""

from megacore.moe.experts import (
    ACTIVATIONS,
    GATED,
    fc1_shard,
    fc2_bias_share,
    glu,
    grouped_gemm_available,
    grouped_mlp,
)
from megacore.moe.permute import LocalDispatcher, permute, unpermute
from megacore.moe.router import (
    DROP_POLICIES,
    DROPPED,
    LOAD_BALANCING_TYPES,
    SCORE_FUNCTIONS,
    MoEAuxLossAutoScaler,
    TokenLayout,
    drop_over_capacity,
    drop_over_capacity_in_layout,
    expert_capacity,
    group_limited_topk,
    routing_scores_for_aux_loss,
    sequence_load_balancing_loss,
    switch_load_balancing_loss,
    token_layout,
    tokens_per_expert,
    topk_routing,
    update_expert_bias,
    z_loss,
)

__all__ = [
    "ACTIVATIONS",
    "DROPPED",
    "DROP_POLICIES",
    "GATED",
    "LOAD_BALANCING_TYPES",
    "SCORE_FUNCTIONS",
    "LocalDispatcher",
    "MoEAuxLossAutoScaler",
    "TokenLayout",
    "drop_over_capacity",
    "drop_over_capacity_in_layout",
    "expert_capacity",
    "fc1_shard",
    "fc2_bias_share",
    "glu",
    "group_limited_topk",
    "grouped_gemm_available",
    "grouped_mlp",
    "permute",
    "routing_scores_for_aux_loss",
    "sequence_load_balancing_loss",
    "switch_load_balancing_loss",
    "token_layout",
    "tokens_per_expert",
    "topk_routing",
    "unpermute",
    "update_expert_bias",
    "z_loss",
]
