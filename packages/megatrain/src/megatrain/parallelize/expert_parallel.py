"""Expert parallelism on built chunks: each MoE layer set for megacore's expert groups, and the two
per-step reductions over the layout that the MoE layers' statistics need (the load-balancing
loss as one process reports it, the experts' loads summed over a stage).

Part of megacore.moe's gradient-scale rule: the router's auxiliary losses are computed over the
tokens of whole sequences (`aux_loss_group`, TP x CP under sequence/context parallelism).
"""

import torch
import torch.distributed as dist

from megacore import moe, parallel_state
from megacore.moe.token_dispatcher import build_token_dispatcher
from megatrain.checkpoint.dcp import expert_layout
from megatrain.models.moe import moe_layers


def apply_expert_parallel(chunk) -> None:
    """A chunk's MoE layers set for megacore's process groups: where its experts lie in the
    whole expert weights (`expert_layout`, which checkpoints read), the token dispatcher of the
    expert layout (`megacore.moe.token_dispatcher`, by model.moe_token_dispatcher_type) and,
    where the tokens of one sequence are spread over TP (sequence parallelism) or CP ranks,
    that group for the router's load-balancing and z losses, whose token counts and
    averages must cover the whole sequence to be one process's numbers (Megatron-LM #1652,
    #3672), and where those tokens lie (`token_layout`), over which capacity drops are
    decided as one process decides them.  Nothing changes without process groups (one
    process)."""
    if not parallel_state.model_parallel_is_initialized():
        return
    spread = parallel_state.get_tensor_and_context_parallel_world_size() > 1
    layout = moe.token_layout(chunk.config.sequence_parallel)
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    for layer in moe_layers([chunk]):
        cfg = layer.cfg
        # Where this rank's experts lie in the whole [E, ...] weights (the checkpoint's).
        # fc1's columns (weight1's last dimension, bias1's) in [gate | up] halves when gated;
        # weight2's rows; bias2's h columns, shared out over ETP.
        experts, E, halves = layer.experts, cfg.num_moe_experts, 2 if cfg.swiglu else 1
        split = [(experts.weight1, 2, halves), (experts.weight2, 1, 1)]
        if experts.bias1 is not None:
            split += [(experts.bias1, 1, halves), (experts.bias2, 1, 1)]
        for w, dim, parts in split:
            w.expert_layout = expert_layout(w.shape, E, experts.first, etp_rank, etp, dim, parts)
        dropless = cfg.moe_expert_capacity_factor is None
        layer.dispatcher = build_token_dispatcher(
            cfg.num_moe_experts, cfg.moe_token_dispatcher_type, dropless,
            per_rank=cfg.moe_group_limited_dispatch,
        )  # fmt: skip
        if spread:
            # Part of megacore.moe's gradient-scale rule: the router's losses become TP x CP
            # shares (the train step's x cp undoes the DDP's 1/cp on their gradients).
            layer.router.aux_loss_group = parallel_state.get_tensor_and_context_parallel_group()
        if cfg.moe_expert_capacity_factor is not None:
            layer.router.token_layout = layout


def aux_loss_over_layout(chunks, cfg, device) -> torch.Tensor | None:
    """The step's load-balancing loss (without its coefficient) as one process reports it: each
    MoE layer's mean over the step's microbatches, its ranks' shares summed over TP x CP (each
    rank's loss is its share of its sequences', `megacore.moe.switch_load_balancing_loss`),
    averaged over DP, then the mean over every MoE layer of the model (the stages' layers
    summed over PP).  None when the model computes no such loss (the config says so on every
    rank alike); else every rank must call it."""
    if not (cfg.num_moe_experts and cfg.moe_aux_loss_coeff):
        return None
    if cfg.moe_router_load_balancing_type == "none":
        return None
    means = [torch.stack(m.aux_losses).mean() for m in moe_layers(chunks) if m.aux_losses]
    value = torch.stack(means).sum().reshape(1) if means else torch.zeros(1, device=device)
    value = value.to(device, torch.float32)
    if parallel_state.model_parallel_is_initialized():
        # Part of megacore.moe's gradient-scale rule: the TP x CP shares add up to one loss
        # (no / cp, unlike the gradients' DP x CP mean); only DP is averaged.
        dist.all_reduce(value, group=parallel_state.get_tensor_and_data_parallel_group(True))
        value /= parallel_state.get_data_parallel_world_size()
    layers = torch.tensor([float(len(means))], device=device)
    stats = torch.cat([value, layers])
    if parallel_state.model_parallel_is_initialized():
        dist.all_reduce(stats, group=parallel_state.get_pipeline_model_parallel_group())
    return stats[0] / stats[1].clamp(min=1)


def sum_expert_loads(chunks) -> None:
    """Each MoE layer's step load (tokens per expert, dropped choices) summed over the ranks
    of its pipeline stage (TP x DP x CP, which together saw the step's tokens), so the
    expert-bias update and the logged load are one process's.  Call after the step's
    microbatches, before `update_expert_biases`; every rank of the stage must call it."""
    if not parallel_state.model_parallel_is_initialized():
        return
    group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    if dist.get_world_size(group) == 1:
        return
    layers = moe_layers(chunks)
    if not layers:
        return
    # One all-reduce for every layer of the rank (a step of a 64-layer MoE would otherwise
    # issue 128 latency-bound collectives over a group of up to tp x dp x cp ranks).
    loads = [t for layer in layers for t in (layer.tokens_per_expert, layer.dropped)]
    flat = torch.cat([t.reshape(-1) for t in loads])
    dist.all_reduce(flat, group=group)
    for t, summed in zip(loads, flat.split([t.numel() for t in loads]), strict=True):
        t.copy_(summed.view_as(t))
    for layer in layers:
        # Every rank of a stage routes as many tokens (the same microbatch shape).
        layer.choices *= dist.get_world_size(group)
