"""Top-k routing of tokens to experts, as plain functions over the router's logits [T, E].

Megatron-core's router (`megatron/core/transformer/moe/router.py`, `moe_utils.py`) in the
[T, k] form: every function takes or returns the k chosen experts of each token
(`indices` [T, k]) and their weights (`probs` [T, k], fp32), never a [T, E] map on the
token path.  A choice dropped by an expert's capacity has index -1 (`DROPPED`): it is not
sent to any expert and adds nothing to its token.

The scores (`topk_routing`):
- softmax, `pre_softmax` False (Megatron's default, Mixtral's numbers, gpt-oss's order): the
  top k of the logits, a softmax over those k (weights that sum to one).
- softmax, `pre_softmax` True (HF Mixtral / Qwen-MoE / DeepSeek-V2 order): a softmax over all
  E, then the top k; `norm_topk_prob` (HF's name) divides the k by their sum (Qwen3-MoE),
  else they are used as they are (Qwen2-MoE, DeepSeek-V2).
- sigmoid (DeepSeek-V3): sigmoid of every logit, the top k, divided by their sum when k > 1
  (Megatron; `norm_topk_prob` True or False says so explicitly, HF's DeepSeek-V3 switch);
  `expert_bias` (auxiliary-loss-free balancing, HF's e_score_correction_bias) is added to
  the scores for the choice only, never to the weights.
The top k may be group-limited (`group_limited_topk`, DeepSeek's): the E experts in
`num_groups` equal groups of consecutive ids, each token choosing among the experts of its
`group_topk` best groups only, a group ranked by the sum of its `group_score_topk` highest
scores (None: topk // group_topk, Megatron's; HF's DeepSeek-V3 sums the top 2, DeepSeek-V2's
group_limited_greedy takes the max, the top 1).  The scores the groups are ranked by are
those the experts are chosen by (with the expert bias under sigmoid, as HF's).
Then `scaling_factor` multiplies the weights (Megatron's moe_router_topk_scaling_factor,
HF's routed_scaling_factor, after any normalization as both do).

Capacity (`drop_over_capacity`): ceil(T x k / E x factor) choices an expert takes at most
of a microbatch's T tokens, the rest dropped by the policy.  Where the tokens of the
microbatch are spread over ranks (sequence parallelism over TP, chunks over CP),
`drop_over_capacity_in_layout` decides over all of them as one process does (T the
microbatch's s x b, the same choices kept), from an all-gather of the choices alone, so
every layout drops what one process drops (megatron-core decides per rank instead, from
its s / (tp x cp) tokens).

The auxiliary losses return this rank's share of a loss over a `group` of ranks that each
hold part of the tokens (megatron-core passes the tensor x context parallel group): the
token counts per expert are summed over the group, so the shares add up over the group to
the loss of all its tokens, and every layout gives the same number.  One process: None.
Part of megacore.moe's gradient-scale rule: the shares add up to one loss, not one per CP
rank, so their gradient scale carries x cp against the data-parallel mean (see
`MoEAuxLossAutoScaler`).
"""

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist

from megacore import parallel_state as ps
from megacore.collectives import all_gather_flat
from megacore.context_parallel import cp_chunk_indices

SCORE_FUNCTIONS = ("softmax", "sigmoid")
DROP_POLICIES = ("probs", "position")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
DROPPED = -1  # the expert index of a choice its expert's capacity dropped


def group_limited_topk(
    scores: torch.Tensor,
    topk: int,
    num_groups: int,
    group_topk: int,
    group_score_topk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [T, k], indices [T, k]): the top k of `scores` [T, E] among the experts of each
    token's `group_topk` best groups of the `num_groups` (E / num_groups consecutive experts
    each), a group's rank the sum of its `group_score_topk` highest scores (None: topk //
    group_topk, Megatron's).  The experts outside the chosen groups are never chosen (they
    are -inf here, so the caller must leave k of them: group_topk x E / num_groups >= k)."""
    T, E = scores.shape
    per_group = E // num_groups
    summed = group_score_topk or topk // group_topk
    grouped = scores.view(T, num_groups, per_group)
    group_scores = grouped.topk(summed, dim=-1).values.sum(dim=-1)
    chosen = group_scores.topk(group_topk, dim=-1).indices
    allowed = torch.zeros(T, num_groups, dtype=torch.bool, device=scores.device)
    allowed = allowed.scatter(1, chosen, True).repeat_interleave(per_group, dim=1)
    return scores.masked_fill(~allowed, float("-inf")).topk(topk, dim=-1)


def topk_routing(
    logits: torch.Tensor,
    topk: int,
    *,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    norm_topk_prob: bool | None = None,
    scaling_factor: float | None = None,
    expert_bias: torch.Tensor | None = None,
    num_groups: int | None = None,
    group_topk: int | None = None,
    group_score_topk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs [T, k] fp32, indices [T, k] int64): each token's k experts and their weights.
    `norm_topk_prob` None: the score function's own (sigmoid's k weights normalized when
    k > 1, softmax's top k of all not); `num_groups` and `group_topk`: group-limited."""
    logits = logits.float()

    def choose(scores):
        if num_groups is None:
            return scores.topk(topk, dim=-1)
        return group_limited_topk(scores, topk, num_groups, group_topk, group_score_topk)

    if score_function == "softmax":
        if expert_bias is not None:
            raise ValueError("topk_routing: expert_bias is for the sigmoid score function")
        if pre_softmax:
            probs, indices = choose(torch.softmax(logits, dim=-1))
        else:  # the softmax over the k chosen sums to one: nothing to normalize
            top, indices = choose(logits)
            probs = torch.softmax(top, dim=-1)
        normalize = bool(norm_topk_prob) and pre_softmax
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        if expert_bias is None:
            probs, indices = choose(scores)
        else:  # the bias chooses; the weights are the unbiased scores of the chosen
            indices = choose(scores + expert_bias.float()).indices
            probs = scores.gather(1, indices)
        normalize = topk > 1 if norm_topk_prob is None else norm_topk_prob
    else:
        raise ValueError(f"score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}")
    if normalize:
        probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor:
        probs = probs * scaling_factor
    return probs, indices


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Choices an expert takes at most: ceil(T x k / E x factor) (Megatron's get_capacity)."""
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def drop_over_capacity(
    probs: torch.Tensor,
    indices: torch.Tensor,
    num_experts: int,
    capacity_factor: float,
    drop_policy: str = "probs",
) -> torch.Tensor:
    """`indices` with the choices beyond each expert's capacity set to `DROPPED`.

    "probs": each expert keeps the choices of highest weight; "position": those of the
    earliest tokens.  Sort-based, no loop: the choices sorted by expert (then by the
    policy's key), each one's rank within its expert compared with the capacity.  `probs`
    is read under "probs" only.  Over `indices`' T tokens alone: a rank holding part of a
    microbatch decides with `drop_over_capacity_in_layout`."""
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}")
    T, k = indices.shape
    capacity = expert_capacity(T, num_experts, k, capacity_factor)
    flat = indices.reshape(-1)
    if drop_policy == "probs":  # by weight, highest first (ties: the earlier token)
        order = torch.argsort(probs.detach().reshape(-1), descending=True, stable=True)
    else:  # by position: token t's choices come before token t + 1's
        order = torch.arange(T * k, device=flat.device)
    order = order[torch.argsort(flat[order], stable=True)]  # by expert, the key kept inside
    counts = torch.bincount(flat, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(T * k, device=flat.device) - starts[flat[order]]
    keep = torch.empty_like(flat, dtype=torch.bool)
    keep[order] = rank_in_expert < capacity
    return torch.where(keep, flat, DROPPED).view(T, k)


@dataclass(frozen=True)
class TokenLayout:
    """Where the ranks of `group` hold a microbatch's tokens: each CP rank c of `cp` its
    chunks c and 2cp-1-c of every sequence (`cp_chunk_indices`), split over `tp` TP ranks
    (sequence parallelism: TP rank t the t-th contiguous 1/tp of them; `tp` 1 without), every
    rank [s_local, b] of them.  `group` is parallel_state's TP x CP group (the CP group when
    tp is 1), whose ranks go TP innermost: group rank g = c x tp + t; `rank` is this one's."""

    group: object
    rank: int
    tp: int
    cp: int

    @property
    def size(self) -> int:
        return self.tp * self.cp

    def token_order(self, s_local: int, batch: int, device) -> torch.Tensor:
        """LongTensor [size x s_local x batch]: for each row of the group's tokens gathered
        in group-rank order (each rank's [s_local, b] flattened), its index among one
        process's s x b tokens of the microbatch (position x b + sequence)."""
        return _token_order(s_local, batch, self.tp, self.cp, torch.device(device))


def token_layout(sequence_parallel: bool) -> TokenLayout | None:
    """The layout of parallel_state's groups: the sequence split over TP under
    `sequence_parallel` (without it, as in forward passes at tp > 1, the TP ranks hold the
    same tokens), over CP always; None when this rank holds all its microbatch's tokens."""
    tp = ps.get_tensor_model_parallel_world_size() if sequence_parallel else 1
    cp = ps.get_context_parallel_world_size()
    if tp * cp == 1:
        return None
    if tp == 1:
        return TokenLayout(ps.get_context_parallel_group(), ps.get_context_parallel_rank(), 1, cp)
    group, rank = (
        ps.get_tensor_and_context_parallel_group(),
        ps.get_tensor_and_context_parallel_rank(),
    )
    return TokenLayout(group, rank, tp, cp)


@lru_cache(maxsize=16)
def _token_order(s_local: int, batch: int, tp: int, cp: int, device) -> torch.Tensor:
    ranks = []
    for c in range(cp):
        positions = cp_chunk_indices(s_local * tp * cp, c, cp).view(tp, s_local)
        ranks += [positions[t] for t in range(tp)]
    positions = torch.stack(ranks)  # [tp x cp, s_local], in group-rank order
    order = positions[:, :, None] * batch + torch.arange(batch)
    return order.reshape(-1).to(device)


@torch.no_grad()
def drop_over_capacity_in_layout(
    probs: torch.Tensor,
    indices: torch.Tensor,
    num_experts: int,
    capacity_factor: float,
    drop_policy: str,
    layout: TokenLayout,
    batch: int,
) -> torch.Tensor:
    """`drop_over_capacity` as one process decides it, on a rank that holds `layout.rank`'s
    part of a microbatch ([s_local x batch, k], its rows [s_local, b] flattened): the
    capacity from the whole microbatch's s x b tokens, and each expert keeping the choices
    one process keeps (under "position" the earliest in the global sequence order, under
    "probs" the highest weights, ties to the earlier token in that order).

    Megatron-core decides per rank, from its s / (tp x cp) tokens: its capacity and its
    choices then depend on the layout.  Here the decision needs every choice of the group:
    one all-gather over `layout.group` of int32 per choice, the expert id ("position": 4
    bytes a choice, 4k a token) or the expert id and the fp32 weight's bits ("probs": 8
    bytes a choice, 8k a token), against the experts' [s_local x b, h] rows of 2h bytes or
    more a token, sent k times.  Every rank then runs the one-process decision over the
    group's s x b x k choices and keeps its own rows' (no host sync; no gradient)."""
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}")
    T = indices.shape[0]
    if T % batch:
        raise ValueError(f"drop_over_capacity_in_layout: {T} tokens are not [s, {batch}]")
    mine = indices.to(torch.int32)[..., None]
    if drop_policy == "probs":  # the weight travels as its bits, in the same collective
        mine = torch.cat([mine, probs.detach().float().view(torch.int32)[..., None]], -1)
    gathered = mine.new_empty((layout.size * T, *mine.shape[1:]))
    all_gather_flat(gathered, mine.contiguous(), group=layout.group)
    order = layout.token_order(T // batch, batch, indices.device)
    whole = torch.empty_like(gathered)
    whole[order] = gathered  # one process's token order
    whole_probs = whole[..., 1].view(torch.float32) if drop_policy == "probs" else None
    kept = drop_over_capacity(whole_probs, whole[..., 0], num_experts, capacity_factor, drop_policy)
    kept = kept[order[layout.rank * T : (layout.rank + 1) * T]]
    return torch.where(kept == DROPPED, DROPPED, indices)


def tokens_per_expert(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """LongTensor [E]: the choices each expert received (`DROPPED` ones not counted)."""
    # Shifted by one so that DROPPED (-1) falls in a bin of its own, dropped here: no host sync.
    return torch.bincount(indices.reshape(-1) + 1, minlength=num_experts + 1)[1:]


def routing_scores_for_aux_loss(
    logits: torch.Tensor, topk: int, score_function: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [..., E] fp32, routing_map [..., E] bool) as Megatron's load-balancing losses
    read them: the softmax over all experts (sigmoid: normalized over all experts) and the
    top k of those scores (before any capacity drop, without an expert bias)."""
    logits = logits.float()
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    top = scores.topk(topk, dim=-1).indices
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, top, True)
    return scores, routing_map


def _summed(counts: torch.Tensor, group) -> tuple[torch.Tensor, int]:
    """Counts summed over `group` (None: as they are) and the group's size."""
    if group is None:
        return counts, 1
    counts = counts.clone()
    dist.all_reduce(counts, group=group)
    return counts, dist.get_world_size(group)


def switch_load_balancing_loss(
    scores: torch.Tensor,
    routing_map: torch.Tensor,
    topk: int,
    coeff: float,
    group=None,
    num_experts: int | None = None,
) -> torch.Tensor:
    """Switch Transformer's load-balancing loss (Megatron's aux_loss):
    coeff x E x sum_i f_i P_i, f_i = (choices of expert i) / (T k), P_i = mean over the T
    tokens of the score of expert i.  `scores`, `routing_map`: [T, E] of this rank's tokens;
    with `group`, T and the choices are the group's and the result is this rank's share.
    `num_experts`: E when the columns are not the experts (the sequence-wise loss)."""
    T, columns = scores.shape
    experts = num_experts or columns
    counts, ranks = _summed(routing_map.sum(0).float(), group)
    total = T * ranks
    return (scores.sum(0) * counts).sum() * (experts * coeff / (topk * total * total))


def sequence_load_balancing_loss(
    scores: torch.Tensor,
    routing_map: torch.Tensor,
    topk: int,
    coeff: float,
    group=None,
) -> torch.Tensor:
    """The load-balancing loss of each sequence, averaged over the sequences (Megatron's
    seq_aux_loss, DeepSeek-V2/V3's sequence-wise balance loss).  `scores`, `routing_map`:
    [s, b, E], this rank's positions of b sequences (with `group`, the group's ranks hold
    the other positions of the same sequences)."""
    s, b, E = scores.shape
    # Each sequence's experts as experts of their own: one switch loss over [s, b x E] is
    # the sum of the b sequences' losses.
    loss = switch_load_balancing_loss(
        scores.reshape(s, b * E), routing_map.reshape(s, b * E), topk, coeff, group, E
    )
    return loss / b


def z_loss(logits: torch.Tensor, coeff: float, group=None) -> torch.Tensor:
    """ST-MoE's router z-loss: coeff x mean over tokens of logsumexp(logits)^2.  With
    `group` (ranks holding equal parts of the tokens), this rank's share: its mean / size
    (megacore.moe's gradient-scale rule: the shares sum to the group's mean)."""
    ranks = 1 if group is None else dist.get_world_size(group)
    return torch.logsumexp(logits.float(), dim=-1).square().mean() * (coeff / ranks)


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Attaches an auxiliary loss to an activation: the forward returns the activation as it
    is, the backward hands the loss a gradient of `main_loss_backward_scale` (what the main
    loss's gradient is scaled by: 1 / microbatches, x the fp16 loss scale), so the loss
    trains the router without changing any forward signature or the reported LM loss
    (Megatron's MoEAuxLossAutoScaler).  Part of megacore.moe's gradient-scale rule: under
    context parallelism the train step sets that scale x cp (a share is not a whole loss)."""

    main_loss_backward_scale: torch.Tensor | float = 1.0

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        if isinstance(scale, torch.Tensor):
            scale = scale.to(aux_loss.device, aux_loss.dtype)
        return grad_output, torch.ones_like(aux_loss) * scale

    @staticmethod
    def set_loss_scale(scale: torch.Tensor | float) -> None:
        """The scale of the main loss's gradient for the coming backwards."""
        MoEAuxLossAutoScaler.main_loss_backward_scale = scale


@torch.no_grad()
def update_expert_bias(
    bias: torch.Tensor, tokens_per_expert: torch.Tensor, rate: float
) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free balancing, in place: each expert's bias rises by
    `rate` when it received fewer tokens than the mean, falls by `rate` when more
    (bias += rate x sign(mean - count)).  The counts must be the step's (all its
    microbatches, and over the data-parallel ranks)."""
    counts = tokens_per_expert.float()
    bias += rate * torch.sign(counts.mean() - counts).to(bias.dtype)
    return bias
