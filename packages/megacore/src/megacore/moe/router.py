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

The auxiliary losses return this rank's share of a loss over a `group` of ranks that each
hold part of the tokens (megatron-core passes the tensor x context parallel group): the
token counts per expert are summed over the group, so the shares add up over the group to
the loss of all its tokens, and every layout gives the same number.  One process: None.
Part of megacore.moe's gradient-scale rule: the shares add up to one loss, not one per CP
rank, so their gradient scale carries x cp against the data-parallel mean (see
`MoEAuxLossAutoScaler`).
"""

import math

import torch
import torch.distributed as dist

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
    policy's key), each one's rank within its expert compared with the capacity."""
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
