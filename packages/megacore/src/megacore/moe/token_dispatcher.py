"""Token dispatch over expert-parallel ranks: megatron-core's all-to-all and all-gather
dispatchers, with the interface of the one-process `LocalDispatcher`.

`dispatch(hidden [T, h], probs [T, k], indices [T, k])` hands back the tokens this rank's
experts must process, grouped by local expert (`expert_input [N, h]`), and how many each
local expert got (`tokens_per_local_expert`); `combine(expert_output [N, h])` brings the
experts' outputs back to the ranks the tokens came from, weighted by their routing
probabilities and summed over each token's k experts ([T, h]).  Every step is an autograd
operation whose backward is the reverse communication, so the gradients of `hidden`,
`probs` and the experts' weights are those of one process holding every expert.

Experts are laid out as megatron-core lays them: expert-parallel rank e of ep holds global
experts [e * E / ep, (e + 1) * E / ep); the ranks of one expert-tensor-parallel group hold
the same experts with fc1 split by columns and fc2 by rows, so each computes a partial sum
of every expert output that the combine step adds up (a reduce-scatter).

- `AllToAllDispatcher` (moe_token_dispatcher_type = "alltoall"): sort the (token, slot)
  pairs by expert, `all_to_all_single` with uneven splits over the EP group (the counts
  travel first, in an equal-split all-to-all), all-gather over the ETP group, sort by
  local expert; the combine is the reverse (reduce-scatter over ETP, all-to-all back).
- `AllGatherDispatcher` ("allgather"): all-gather tokens, probabilities and expert ids over
  ETP x EP, keep the pairs routed to the local experts; the combine adds each rank's
  outputs into the gathered token positions and reduce-scatters over ETP x EP.
- `PerRankAllToAllDispatcher` ("alltoall" sending each token once per rank, DeepSeek's
  node-limited dispatch): a token goes once to each EP rank holding any of its experts,
  with its k expert ids and weights; that rank sorts the choices its experts take (as the
  all-gather dispatcher does), and its combine sums the token's weighted expert outputs
  there and sends one row back, which the token's rank adds up over the ranks it went to.
  With group-limited routing whose groups lie whole on the ranks (megatrain's
  moe_group_limited_dispatch), a token crosses to at most group_topk ranks, whatever k.

Uneven gathers and reduce-scatters pad each rank's rows to the largest count (one small
size exchange first), so every collective has NCCL's equal-size form.  The split sizes are
read on the host (a sync per dispatch, as Megatron's all-to-all dispatcher has).
"""

import torch
import torch.distributed as dist

from megacore import parallel_state as ps
from megacore.collectives import all_gather_flat
from megacore.moe.permute import LocalDispatcher, permute, unpermute
from megacore.moe.router import DROPPED
from megacore.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

DISPATCHER_TYPES = ("alltoall", "allgather")


# --- communication as autograd operations ------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        return _all_to_all(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, ctx.input_splits, ctx.output_splits), None, None, None


def _all_to_all(x, group, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


def _sizes_over(group, count: int, device) -> list[int]:
    """Every rank's `count` over `group`, in group-rank order."""
    world = dist.get_world_size(group)
    mine = torch.tensor([count], dtype=torch.int64, device=device)
    out = torch.empty(world, dtype=torch.int64, device=device)
    all_gather_flat(out, mine, group=group)
    return out.tolist()


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.size(0) == rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.size(0), *x.shape[1:]))])


def gather_rows(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """Every rank's rows of `x` (rank i has sizes[i]) concatenated in group-rank order;
    backward: each rank's rows of the summed gradient (a reduce-scatter)."""
    if len(sizes) == 1:
        return x
    most = max(sizes)
    padded = gather_from_sequence_parallel_region(_pad_rows(x, most), True, group)
    if all(s == most for s in sizes):
        return padded
    keep = torch.cat([torch.arange(s) + i * most for i, s in enumerate(sizes)]).to(x.device)
    return padded.index_select(0, keep)


def reduce_scatter_rows(x: torch.Tensor, group, sizes: list[int], rank: int) -> torch.Tensor:
    """`x` summed over `group`, rank i keeping its sizes[i] rows (x holds every rank's rows in
    group-rank order, as `gather_rows` made them); backward all-gathers."""
    if len(sizes) == 1:
        return x
    most = max(sizes)
    if any(s != most for s in sizes):
        pieces = torch.split(x, sizes)
        x = torch.cat([_pad_rows(p, most) for p in pieces])
    out = reduce_scatter_to_sequence_parallel_region(x, group)
    return out[: sizes[rank]]


# --- the dispatchers ---------------------------------------------------------------------------


def _take_expert_groups(dispatcher, num_experts: int) -> None:
    """The all-to-all dispatchers' groups and sizes: the EP and ETP groups, ep, etp, this
    rank's ETP rank, the E experts and the E / ep each EP rank holds."""
    d = dispatcher
    d.ep_group = ps.get_expert_model_parallel_group()
    d.etp_group = ps.get_expert_tensor_parallel_group()
    d.ep, d.etp = dist.get_world_size(d.ep_group), dist.get_world_size(d.etp_group)
    d.etp_rank = dist.get_rank(d.etp_group)
    if num_experts % d.ep:
        raise ValueError(
            f"{type(d).__name__}: num_moe_experts ({num_experts}) is not divisible by "
            f"expert_model_parallel_size ({d.ep})"
        )
    d.num_experts, d.local = num_experts, num_experts // d.ep


class AllToAllDispatcher:
    """Tokens to the experts' ranks by all-to-all over EP, then all-gathered over ETP."""

    def __init__(self, num_experts: int, dropless: bool = True):
        self.dropless = dropless
        _take_expert_groups(self, num_experts)

    # The block order the regroup depends on.  L = E / ep local experts; a block is the rows one
    # source rank sends to one local expert, in the sender's token order.
    # - `sent` is sorted by global expert, so it is ep blocks, one per destination EP rank in
    #   EP-group rank order, each by local expert: EP-group rank k must hold global experts
    #   [k L, (k + 1) L) (parallel_state's groups list ranks by coordinate; the experts'
    #   `first` is ep_rank x L).  The all-to-all's output is then [ep source, local expert].
    # - The ETP peers hold the same experts (ETP varies only the etp coordinate), and both the
    #   count gather (`all_gather_flat`) and the row gather (`gather_rows`) concatenate in
    #   ETP-group rank order, so `matrix[q, s, i]` counts exactly the rows gather_rows puts in
    #   block (q, s, i): the rows arrive ordered (etp source q, ep source s, local expert i),
    #   block sizes matrix.reshape(-1), the same matrix on every peer.
    # - `sizes` packs three orders into one host read: [etp_sizes (etp: what each ETP peer
    #   received over EP, the row gather's per-rank sizes) | output_splits (ep: what this rank
    #   receives from each EP source, matrix[etp_rank].sum(1)) | input_splits (ep: what it
    #   sends to each EP destination)].
    # - The regroup stably sorts the blocks into (local expert, etp source, ep source) order;
    #   `combine` inverts it, then reduce-scatters over ETP and all-to-alls back.
    # Example, ep 2 x etp 2, E 4 (L 2) on 4 ranks: ETP [0,1] (experts 0,1), [2,3] (2,3); EP
    # [0,2], [1,3].  Rank 0 (etp 0, ep 0) gets from rank 0 2 rows for expert 0, 1 for 1; from
    # rank 2 0 and 3; its peer rank 1 gets from rank 1 1 and 0, from rank 3 2 and 2.  On ranks 0
    # and 1, matrix = [[[2, 1], [0, 3]], [[1, 0], [2, 2]]]: the 11 rows arrive as blocks
    # r0e0 (2) r0e1 (1) r2e0 (0) r2e1 (3) r1e0 (1) r1e1 (0) r3e0 (2) r3e1 (2); etp_sizes
    # [6, 5]; rank 0's output_splits [3, 3] (rank 1's [1, 4]); regrouped: expert 0 = r0 r0 r1
    # r3 r3, expert 1 = r0 r2 r2 r2 r3 r3, tokens_per_local_expert [5, 6].  If rank 0 sends 3
    # rows to EP rank 0 and 2 to EP rank 1, its sizes are [6, 5, 3, 3, 3, 2].
    def dispatch(self, hidden, probs, indices):
        # Sorted by global expert, the pairs for each EP rank are one block (its experts').
        sent, counts, self.order = permute(hidden, indices, self.num_experts, self.dropless)
        self.probs, self.num_tokens = probs, hidden.size(0)
        # [source ep rank, local expert]: how many pairs each rank sends to each local expert.
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.ep_group)
        received = received.view(self.ep, self.local)
        if self.etp > 1:  # every ETP rank's matrix: [etp source, ep source, local expert]
            gathered = received.new_empty((self.etp * self.ep, self.local))
            all_gather_flat(gathered, received, group=self.etp_group)
            received = gathered
        matrix = received.view(self.etp, self.ep, self.local)
        # The split sizes, which all_to_all_single takes as lists: the dispatch's host sync
        # ([etp_sizes | output_splits | input_splits], the block order above).
        sent_per_rank = counts.view(self.ep, self.local).sum(1)
        sizes = torch.cat([matrix.sum((1, 2)), matrix[self.etp_rank].sum(1), sent_per_rank])
        sizes = sizes.tolist()
        self.etp_sizes = sizes[: self.etp]
        self.output_splits = sizes[self.etp : self.etp + self.ep]
        self.input_splits = sizes[self.etp + self.ep :]
        x = _AllToAll.apply(sent, self.ep_group, self.output_splits, self.input_splits)
        x = gather_rows(x, self.etp_group, self.etp_sizes)
        # Rows arrive in blocks ordered (etp source, ep source, local expert): a stable sort of
        # each row's block by (local expert, etp source, ep source) groups them by expert.
        blocks = torch.arange(matrix.numel(), device=matrix.device)
        by_expert = blocks.view(self.etp, self.ep, self.local).permute(2, 0, 1).reshape(-1)
        place = torch.empty_like(blocks)
        place[by_expert] = blocks  # each arriving block's place in expert order
        rows = torch.repeat_interleave(place, matrix.reshape(-1), output_size=x.size(0))
        self.regroup = torch.argsort(rows, stable=True)
        tokens_per_local_expert = matrix.sum((0, 1))
        return x.index_select(0, self.regroup), tokens_per_local_expert

    def combine(self, expert_output):
        # Back to (etp source, ep source, local expert) order: the inverse of the regroup.
        back = torch.empty_like(self.regroup)
        back[self.regroup] = torch.arange(self.regroup.numel(), device=self.regroup.device)
        x = expert_output.index_select(0, back)
        x = reduce_scatter_rows(x, self.etp_group, self.etp_sizes, self.etp_rank)
        x = _AllToAll.apply(x, self.ep_group, self.input_splits, self.output_splits)
        return unpermute(x, self.order, self.probs, self.num_tokens)


class AllGatherDispatcher:
    """Every token to every rank of ETP x EP; each keeps the pairs its experts take."""

    def __init__(self, num_experts: int):
        self.group = ps.get_expert_tensor_and_model_parallel_group()
        self.rank = dist.get_rank(self.group)
        ep = ps.get_expert_model_parallel_world_size()
        ep_rank = ps.get_expert_model_parallel_rank()
        if num_experts % ep:
            raise ValueError(
                f"AllGatherDispatcher: num_moe_experts ({num_experts}) is not divisible by "
                f"expert_model_parallel_size ({ep})"
            )
        self.local = num_experts // ep
        self.first = ep_rank * self.local

    def dispatch(self, hidden, probs, indices):
        # `sizes`, the gathers and the combine's reduce-scatter all go in ETP x EP group-rank
        # order, so rank i's tokens are rows [sum(sizes[:i]), sum(sizes[:i + 1])) everywhere.
        self.sizes = _sizes_over(self.group, hidden.size(0), hidden.device)
        hidden = gather_rows(hidden, self.group, self.sizes)
        self.probs = gather_rows(probs, self.group, self.sizes)
        indices = gather_rows(indices, self.group, self.sizes)  # integers: no gradient
        # Other ranks' experts (and choices a capacity dropped) count as dropped here.
        local = indices - self.first
        local = torch.where((local >= 0) & (local < self.local), local, DROPPED)
        expert_input, counts, self.order = permute(hidden, local, self.local)
        return expert_input, counts

    def combine(self, expert_output):
        out = unpermute(expert_output, self.order, self.probs, sum(self.sizes))
        return reduce_scatter_rows(out, self.group, self.sizes, self.rank)


class PerRankAllToAllDispatcher:
    """Each token to each EP rank holding one of its experts, once; then all-gathered over
    ETP.  The rows cross in (destination rank, token) order, each with the token's k expert
    ids and weights (the weights with their gradient)."""

    def __init__(self, num_experts: int):
        _take_expert_groups(self, num_experts)
        self.first = dist.get_rank(self.ep_group) * self.local

    def dispatch(self, hidden, probs, indices):
        T, k = indices.shape
        # [T, ep]: whether the token goes to each rank (a dropped choice to none, bin ep).
        rank_of_choice = torch.where(indices == DROPPED, self.ep, indices // self.local)
        goes = torch.zeros(T, self.ep + 1, dtype=torch.bool, device=indices.device)
        goes = goes.scatter(1, rank_of_choice, True)[:, : self.ep]
        pairs = goes.t().nonzero()  # (rank, token), ranks in order, each rank's tokens in order
        self.dest, self.token = pairs[:, 0], pairs[:, 1]
        # Where each (token, rank) row lands among the token's ranks, for a sum with no atomics.
        self.slot = (torch.cumsum(goes, 1) - 1)[self.token, self.dest]
        self.width, self.num_tokens = min(k, self.ep), T
        sent_per_rank = goes.sum(0)
        received = torch.empty_like(sent_per_rank)
        dist.all_to_all_single(received, sent_per_rank, group=self.ep_group)
        sizes = torch.cat([received, sent_per_rank]).tolist()
        self.output_splits, self.input_splits = sizes[: self.ep], sizes[self.ep :]
        splits = (self.ep_group, self.output_splits, self.input_splits)
        x = _AllToAll.apply(hidden[self.token], *splits)
        weights = _AllToAll.apply(probs[self.token], *splits)
        chosen = _all_to_all(indices[self.token], *splits)  # integers: no gradient
        self.etp_sizes = [x.size(0)]
        if self.etp > 1:
            self.etp_sizes = _sizes_over(self.etp_group, x.size(0), x.device)
        x = gather_rows(x, self.etp_group, self.etp_sizes)
        weights = gather_rows(weights, self.etp_group, self.etp_sizes)
        chosen = gather_rows(chosen, self.etp_group, self.etp_sizes)
        # Choices of other ranks' experts (and dropped ones) are none of this rank's.
        local = chosen - self.first
        local = torch.where((local >= 0) & (local < self.local), local, DROPPED)
        expert_input, counts, self.order = permute(x, local, self.local)
        self.weights, self.rows = weights, x.size(0)
        return expert_input, counts

    def combine(self, expert_output):
        # Each received row: its token's weighted outputs of this rank's experts, summed.
        x = unpermute(expert_output, self.order, self.weights, self.rows)
        x = reduce_scatter_rows(x, self.etp_group, self.etp_sizes, self.etp_rank)
        x = _AllToAll.apply(x, self.ep_group, self.input_splits, self.output_splits)
        h = x.size(-1)
        placed = x.new_zeros(self.num_tokens * self.width, h, dtype=torch.float32)
        placed = placed.index_put((self.token * self.width + self.slot,), x.float())
        return placed.view(self.num_tokens, self.width, h).sum(1).to(x.dtype)


def build_token_dispatcher(
    num_experts: int,
    moe_token_dispatcher_type: str = "alltoall",
    dropless: bool = True,
    per_rank: bool = False,
):
    """The dispatcher for this rank's expert layout: the one-process `LocalDispatcher` when
    no experts are split (ep x etp = 1), else megatron-core's kind of that name; `per_rank`
    (with "alltoall"): `PerRankAllToAllDispatcher`, each token sent once per rank."""
    if moe_token_dispatcher_type not in DISPATCHER_TYPES:
        raise ValueError(
            f"moe_token_dispatcher_type must be one of {', '.join(DISPATCHER_TYPES)}, "
            f"got {moe_token_dispatcher_type!r}"
        )
    split = ps.model_parallel_is_initialized() and (
        ps.get_expert_model_parallel_world_size() * ps.get_expert_tensor_parallel_world_size() > 1
    )
    if not split:
        return LocalDispatcher(num_experts, dropless)
    if moe_token_dispatcher_type == "allgather":
        return AllGatherDispatcher(num_experts)
    if per_rank:
        return PerRankAllToAllDispatcher(num_experts)
    return AllToAllDispatcher(num_experts, dropless)
