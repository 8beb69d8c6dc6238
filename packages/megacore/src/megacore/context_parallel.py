"""Context parallelism: attention over a sequence split across the context-parallel ranks.

What each rank holds.  A sequence of s tokens is cut into 2·cp equal chunks and CP
rank r holds chunks r and 2cp-1-r, in that order (`cp_chunk_indices`,
`split_for_context_parallel`): under a causal mask early chunks see few keys and
late ones many, so pairing the r-th earliest with the r-th latest gives every rank
the same work.  Everything outside attention (embeddings, MLPs, the loss) is per
token and runs on the local 2·(s / 2cp) tokens as it is; only attention needs the
other ranks' keys and values.  Positions (rotary embeddings, the causal mask) are
the tokens' global ones, which is why the attention takes them as arguments.  Each
CP rank holds the whole model, so gradients are reduced over data x context
parallel ranks (`parallel_state.get_data_parallel_group(with_context_parallel=True)`).

`context_parallel_attention` equals full attention over the whole sequence,
restricted to the local queries, in one of two ways (`comm_type`):

- "allgather" (Llama 3, §3.3.2): all-gather K and V (with their positions and
  document ids) over the CP group, then SDPA of the local queries against every key
  with a boolean mask.  One collective of 2·b·groups·s·d elements per layer, not
  overlapped, and the whole sequence's K/V in memory; simple, and with grouped-query
  attention K/V are small, so Llama 3 chose it, and it handles any mask (packed
  documents) at once.  Backward: the K/V gradients are reduce-scattered (summed over
  the ranks whose queries used them, each rank keeping its own tokens' part), by
  `tensor_parallel.gather_from_sequence_parallel_region` with the CP group.
- "p2p" (a ring, as Transformer Engine does for megatron-core): cp steps; at step i
  rank r holds the K/V block that started on rank (r - i) mod cp, computes its
  queries' partial attention against it with the block's log-sum-exp, and passes the
  block on to rank r+1 while receiving the next from r-1.  The transfer is started
  before the block's attention and waited on after, so it overlaps the compute; only
  two K/V blocks are in flight at a time.  The partials are merged by log-sum-exp
  (a row with no visible key in a block has lse -inf and weight zero).  Backward:
  autograd through the block attention (plain torch ops: float32 scores masked with
  -inf, logsumexp, softmax, matmul), and each ring shift's backward sends the
  gradient of the received block back round the ring (to r-1, receiving from r+1),
  so the K/V gradients are exact.  Memory: autograd keeps every received block and
  every block's probabilities [b, heads, s_local, s_local] for backward, so this path
  holds as much K/V as "allgather" does; a fused kernel (Transformer Engine's) saves
  only the outputs and log-sum-exps and re-runs the ring in backward instead.  No
  block is skipped: under the balanced layout every block holds an early chunk
  (j < cp) that every rank's late chunk (>= cp) sees, so none is entirely masked.

Dropout is not supported (the caller refuses it); with cp=1 both paths are local
attention and communicate nothing.
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megacore import parallel_state
from megacore.tensor_parallel.mappings import gather_from_sequence_parallel_region

__all__ = ["context_parallel_attention", "cp_chunk_indices", "split_for_context_parallel"]

COMM_TYPES = ("allgather", "p2p")


def cp_chunk_indices(seq_len: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """The global positions (int64, [seq_len // cp_size]) CP rank `cp_rank` holds.

    The sequence is cut into 2·cp_size equal chunks; the rank holds chunks cp_rank and
    2·cp_size - 1 - cp_rank, in that order.  ValueError if seq_len is not a multiple
    of 2·cp_size (cp_size 1: range(seq_len), for any length).
    """
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_chunk_indices: cp_rank {cp_rank} is not in [0, cp_size={cp_size})")
    if cp_size == 1:  # nothing to balance: the whole sequence, of any length
        return torch.arange(seq_len, dtype=torch.int64)
    chunks = 2 * cp_size
    if seq_len % chunks:
        raise ValueError(
            f"context parallelism: sequence length {seq_len} is not divisible by "
            f"2 x context_parallel_size = {chunks} (each rank holds two of {chunks} chunks)"
        )
    chunk = seq_len // chunks
    first, second = cp_rank * chunk, (chunks - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def split_for_context_parallel(
    x: torch.Tensor, dim: int, cp_rank: int, cp_size: int
) -> torch.Tensor:
    """This CP rank's part of x along `dim`: its two chunks (`cp_chunk_indices`), concatenated.

    Differentiable (the gradient lands at the rank's positions, zero elsewhere).
    """
    if cp_size == 1:
        return x
    index = cp_chunk_indices(x.size(dim), cp_rank, cp_size).to(x.device)
    return x.index_select(dim, index)


def _visible(
    q_positions: torch.Tensor,
    kv_positions: torch.Tensor,
    q_segments: torch.Tensor | None,
    kv_segments: torch.Tensor | None,
    causal: bool,
) -> torch.Tensor | None:
    """Boolean mask [b or 1, 1, s_q, s_k] of the keys each query sees (None: all)."""
    mask = None
    if causal:
        mask = (kv_positions[None, :] <= q_positions[:, None])[None, None]
    if q_segments is not None:
        same = (q_segments[:, :, None] == kv_segments[:, None, :])[:, None]
        mask = same if mask is None else mask & same
    return mask


def _token_meta(positions: torch.Tensor, segments: torch.Tensor | None) -> torch.Tensor:
    """[s, 1 + b] int64: each key's position, then its document in each sequence; sent
    along with K/V so one message carries all of a block's metadata."""
    if segments is None:
        return positions[:, None].to(torch.int64).contiguous()
    return torch.cat([positions[:, None], segments.t()], 1).to(torch.int64).contiguous()


def _check(q, k, v, q_positions, kv_positions, segments, comm_type):
    if comm_type not in COMM_TYPES:
        raise ValueError(
            f"context_parallel_attention: comm_type must be one of {COMM_TYPES}, got {comm_type!r}"
        )
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(
            "context_parallel_attention: q must be [b, heads, s, d] and k, v [b, groups, s, d] "
            f"of one shape; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    b, heads, s_q, d = q.shape
    if k.size(0) != b or k.size(3) != d or heads % k.size(1):
        raise ValueError(
            f"context_parallel_attention: k, v {tuple(k.shape)} do not fit q {tuple(q.shape)} "
            "(same batch and head size; heads a multiple of the key/value groups)"
        )
    if q_positions.shape != (s_q,) or kv_positions.shape != (k.size(2),):
        raise ValueError(
            f"context_parallel_attention: q_positions {tuple(q_positions.shape)} and "
            f"kv_positions {tuple(kv_positions.shape)} must be [s_local] ({s_q}, {k.size(2)})"
        )
    if segments is not None and (s_q != k.size(2) or segments.shape != (b, s_q)):
        raise ValueError(
            f"context_parallel_attention: segments {tuple(segments.shape)} must be "
            f"[b, s_local] = ({b}, {s_q}), with q and k/v the same tokens"
        )


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_positions: torch.Tensor,
    kv_positions: torch.Tensor,
    segments: torch.Tensor | None = None,
    causal: bool = True,
    comm_type: str = "p2p",
    group: dist.ProcessGroup | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of this CP rank's queries against the whole sequence's keys (module doc).

    q: [b, heads, s_local, d]; k, v: [b, groups, s_local, d] (grouped-query attention:
    query head h uses key/value group h // (heads // groups), as SDPA's enable_gqa).
    q_positions, kv_positions: [s_local] int64 global positions of the local tokens
    (`cp_chunk_indices`; moved to q's device).  segments: optional [b, s_local] int64
    document ids of the local tokens; a query sees only keys of its own document.
    causal: a query sees keys at positions <= its own.  comm_type: "allgather" or "p2p"
    (megatron-core's default, "p2p", overlaps the transfers).  group: the CP
    group (default `parallel_state.get_context_parallel_group()`), the same on every
    rank that holds a part of these sequences.  scale: default 1/sqrt(d).

    Returns [b, heads, s_local, d] in q's dtype: full attention over every rank's tokens
    with that mask, at this rank's queries.  A query that sees no key at all gets zeros.
    Every rank of the group must call it with the same shapes and comm_type.
    """
    _check(q, k, v, q_positions, kv_positions, segments, comm_type)
    # The mask is built, and the positions and documents sent, on the tensors' device.
    q_positions, kv_positions = q_positions.to(q.device), kv_positions.to(q.device)
    segments = None if segments is None else segments.to(q.device)
    if group is None:
        group = parallel_state.get_context_parallel_group()
    if scale is None:
        scale = 1.0 / math.sqrt(q.size(-1))
    if comm_type == "allgather":
        return _allgather_attention(
            q, k, v, q_positions, kv_positions, segments, causal, group, scale
        )
    return _ring_attention(q, k, v, q_positions, kv_positions, segments, causal, group, scale)


# --- all-gather -----------------------------------------------------------------------------


def _allgather_attention(q, k, v, q_positions, kv_positions, segments, causal, group, scale):
    groups = k.size(1)
    # One collective for K and V along a leading sequence dim: [s, 2, b, g, d] per rank.
    kv = torch.stack([k, v]).permute(3, 0, 1, 2, 4).contiguous()
    kv = gather_from_sequence_parallel_region(kv, True, group)  # backward: reduce-scatter
    kv = kv.permute(1, 2, 3, 0, 4)  # [2, b, g, cp·s, d], keys in group-rank order
    # Their positions and documents, in the same order (no gradient).
    meta = gather_from_sequence_parallel_region(_token_meta(kv_positions, segments), True, group)
    all_positions = meta[:, 0]
    all_segments = None if segments is None else meta[:, 1:].t()
    mask = _visible(q_positions, all_positions, segments, all_segments, causal)
    out = F.scaled_dot_product_attention(
        q, kv[0], kv[1], attn_mask=mask, scale=scale, enable_gqa=groups != q.size(1)
    )
    if mask is not None:  # SDPA's rows with no visible key: zeros, as the ring gives
        out = out.masked_fill(~mask.any(-1, keepdim=True), 0.0)
    return out


# --- ring -----------------------------------------------------------------------------------


def _ring_peers(group: dist.ProcessGroup) -> tuple[int, int]:
    """Global ranks of the next and previous CP ranks."""
    ranks = dist.get_process_group_ranks(group)
    me = ranks.index(dist.get_rank())
    return ranks[(me + 1) % len(ranks)], ranks[(me - 1) % len(ranks)]


def _start_shift(tensors: list[torch.Tensor], group, to_next: bool = True):
    """Send each tensor to the next rank and receive its like from the previous (or the
    reverse); returns the receive buffers and the requests to wait on."""
    nxt, prev = _ring_peers(group)
    send_to, recv_from = (nxt, prev) if to_next else (prev, nxt)
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, send_to, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, recv_from, group) for t in received]
    return received, dist.batch_isend_irecv(ops)


class _RingShifted(torch.autograd.Function):
    """Forward: the block received from the previous rank (the transfer is done already).
    Backward: its gradient goes back to the previous rank, and the gradient of the block
    this rank sent comes from the next one."""

    @staticmethod
    def forward(ctx, sent, received, group):
        ctx.group = group
        return received

    @staticmethod
    def backward(ctx, grad):
        (grad_sent,), requests = _start_shift([grad.contiguous()], ctx.group, to_next=False)
        for request in requests:
            request.wait()
        return grad_sent, None, None


def _block_attention(q, k, v, mask, scale):
    """Partial attention of q against one K/V block, in float32, with its log-sum-exp.

    q: [b, g, rep, s_q, d]; k, v: [b, g, s_k, d]; mask: [b or 1, 1, s_q, s_k] or None.
    Returns out [b, g, rep, s_q, d] and lse [b, g, rep, s_q] (-inf where a row sees no key).
    """
    scores = torch.matmul(q, k.float().unsqueeze(2).transpose(-1, -2)) * scale
    if mask is None:
        lse = torch.logsumexp(scores, dim=-1)
        return torch.matmul(torch.softmax(scores, dim=-1), v.float().unsqueeze(2)), lse
    mask = mask.unsqueeze(2)  # [b or 1, 1, 1, s_q, s_k]
    seen = mask.any(-1)  # rows with a visible key
    # A row with none is filled with zeros rather than -inf, so that logsumexp and softmax
    # stay finite (and their gradients free of NaN); its lse is then set to -inf, which
    # gives it zero weight in the merge and so zero gradient.
    fill = torch.zeros_like(seen, dtype=scores.dtype).masked_fill(seen, float("-inf"))
    fill = fill.unsqueeze(-1)
    scores = torch.where(mask, scores, fill)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1), v.float().unsqueeze(2))
    return out, torch.where(seen, lse, float("-inf"))


def _merge(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Combine partial attentions by their log-sum-exps: softmax over all blocks' keys."""
    lse = torch.stack(lses)  # [blocks, b, g, rep, s_q]
    seen = torch.isfinite(lse).any(0)
    # Rows that see no key in any block: a finite stand-in, their weights are exp(-inf) = 0.
    total = torch.logsumexp(torch.where(seen, lse, 0.0), dim=0)
    weights = torch.exp(lse - total).unsqueeze(-1)
    return (weights * torch.stack(outs)).sum(0)


def _ring_attention(q, k, v, q_positions, kv_positions, segments, causal, group, scale):
    b, heads, s_q, d = q.shape
    groups = k.size(1)
    cp = dist.get_world_size(group)
    qg = q.float().reshape(b, groups, heads // groups, s_q, d)
    kv = torch.stack([k, v]).contiguous()  # one transfer per step for K and V
    meta = _token_meta(kv_positions, segments)
    outs, lses = [], []
    for step in range(cp):
        if step < cp - 1:  # start passing this block on before computing with it
            received, requests = _start_shift([kv.detach(), meta], group)
        block_segments = None if segments is None else meta[:, 1:].t()
        mask = _visible(q_positions, meta[:, 0], segments, block_segments, causal)
        out, lse = _block_attention(qg, kv[0], kv[1], mask, scale)
        outs.append(out)
        lses.append(lse)
        if step < cp - 1:
            for request in requests:
                request.wait()
            kv = _RingShifted.apply(kv, received[0], group)
            meta = received[1]
    out = _merge(outs, lses)
    return out.reshape(b, heads, s_q, d).to(q.dtype)
