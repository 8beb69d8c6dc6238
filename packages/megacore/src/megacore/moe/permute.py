"""Tokens to experts and back by one sort: no Python loop over tokens or experts.

`permute` orders the T x k (token, choice) pairs by expert (a stable sort, so each expert
sees its tokens in their order) and gathers the hidden states in that order; `unpermute`
puts each expert output back at its (token, choice) place and sums a token's k outputs
weighted by their probabilities, in fp32 (Megatron's permute / unpermute).  A choice whose
index is `DROPPED` (an expert's capacity refused it) is sorted last and cut off: it reaches
no expert and adds zero.

`LocalDispatcher` is the one-process token dispatcher; the expert-parallel dispatchers
(all-to-all, all-gather) keep its interface: `dispatch(hidden [T, h], probs [T, k],
indices [T, k]) -> (expert_input [N, h], tokens_per_local_expert [E_local])`, then
`combine(expert_output [N, h]) -> [T, h]`, one pair per forward (the dispatcher keeps what
`combine` needs in between).
"""

import torch

from megacore.moe.router import DROPPED, tokens_per_expert


def permute(
    hidden: torch.Tensor, indices: torch.Tensor, num_experts: int, dropless: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_hidden [N, h], tokens_per_expert [E] int64, sort_order [N]): the rows of
    `hidden` [T, h] each expert of `indices` [T, k] receives, grouped by expert in expert
    order; `sort_order` holds each row's flat (token x k + choice) index for `unpermute`.
    N is T x k less the dropped choices; `dropless` says there are none (N is then known
    without reading the counts on the host)."""
    k = indices.shape[1]
    flat = indices.reshape(-1)
    counts = tokens_per_expert(indices, num_experts)
    # Dropped choices (-1) get the key E: after every expert, cut off below.
    keys = flat if dropless else torch.where(flat == DROPPED, num_experts, flat)
    sort_order = torch.argsort(keys, stable=True)
    if not dropless:
        sort_order = sort_order[: int(counts.sum())]
    return hidden[sort_order // k], counts, sort_order


def unpermute(
    expert_output: torch.Tensor, sort_order: torch.Tensor, probs: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """[T, h] in `expert_output`'s dtype: sum over each token's choices of probability x its
    expert's output row, accumulated in fp32.  Each row is put at its own (token, choice)
    place and the k places summed: no atomic adds, the same bits on every run."""
    k, h = probs.shape[1], expert_output.shape[-1]
    weights = probs.reshape(-1)[sort_order].float()
    weighted = expert_output.float() * weights.unsqueeze(-1)
    placed = weighted.new_zeros(num_tokens * k, h).index_put((sort_order,), weighted)
    return placed.view(num_tokens, k, h).sum(1).to(expert_output.dtype)


class LocalDispatcher:
    """Every expert on this process: dispatch is `permute`, combine is `unpermute`."""

    def __init__(self, num_experts: int, dropless: bool = True):
        self.num_experts, self.dropless = num_experts, dropless
        self._state = None

    def dispatch(
        self, hidden: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        expert_input, counts, order = permute(hidden, indices, self.num_experts, self.dropless)
        self._state = (order, probs, hidden.shape[0])
        return expert_input, counts

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        if self._state is None:
            raise RuntimeError("LocalDispatcher.combine called without a dispatch before it")
        order, probs, num_tokens = self._state
        self._state = None
        return unpermute(expert_output, order, probs, num_tokens)
