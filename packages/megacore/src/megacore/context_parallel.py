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
  rank r holds the K/V block that started on rank j = (r - i) mod cp, computes its
  queries' partial attention against it with the block's log-sum-exp, and passes the
  block on to rank r+1 while receiving the next from r-1.  The transfer is started
  before the block's attention and waited on after, so it overlaps the compute; only
  two K/V blocks are in flight at a time.  The partials are merged by log-sum-exp.
  Two implementations, chosen per call:

  The fused ring (`_FusedRing`), for causal or full attention without packed documents
  (segments None) on the balanced layout (under a causal mask the positions must be
  `cp_chunk_indices`; they are checked, once per positions tensor).  Each step pairs the
  local query chunks (r, 2cp-1-r) with the block's key chunks (j, 2cp-1-j): a key chunk
  after the query chunk is skipped, the same chunk is causal, one before is seen whole.
  So step 0 is one causal call over the local tokens (whose positions increase); from a
  block of j < r both query chunks see the early key chunk whole and not the late one
  (one call, 2c queries x c keys, c = s / 2cp); a block of j > r only the late query
  chunk sees, all of it (c x 2c).  Causal attention thus computes
  half of the s_local x s scores (causal attention's share; without a mask all of them),
  where the float32 ring computes all.  Each step is one fused kernel call that returns
  its log-sum-exp: on CPU `aten._scaled_dot_product_flash_attention_for_cpu`; on CUDA
  FlashAttention-2 (`aten._scaled_dot_product_flash_attention`) for 16 bits on sm80 and
  newer, the memory-efficient kernel (`aten._scaled_dot_product_efficient_attention`) for
  float32 or older GPUs, with grouped K/V heads expanded for the call and their gradients
  summed back (the CPU kernel takes them as they are).  The CUDA calls are not checked on
  a GPU by the tests here.  The partials are merged online in float32.  Saved for
  backward: q, the local k and v, the output and its float32 log-sum-exp [b, heads,
  s_local] (nothing of size s_local x s_local, no received block).  Backward runs the
  ring again: K/V blocks go round as in the forward, each with a float32 dK/dV
  accumulator that follows it (each rank adds its queries' share and passes it on; one
  more shift brings each block's gradient home), and each step's gradients come from the
  kernel's backward given the final output and log-sum-exp, which makes each block's
  share exact.  Communication: forward cp-1 K/V shifts; backward cp-1 K/V shifts and cp
  shifts of the float32 dK/dV (twice K/V's bytes in 16 bits), each overlapping the next
  step's compute.

  The float32 ring (`_masked_ring_attention`), for packed documents (any mask: a block's
  documents cut it anywhere, and the fused kernels take no mask here), positions other
  than the balanced layout's, and devices, dtypes or head sizes no fused kernel takes.
  It sends each block's positions and documents along with it and masks its float32
  scores with -inf (a row with no visible key in a block has lse -inf and weight zero).
  Backward: autograd through the block attention (plain torch ops: float32 scores,
  logsumexp, softmax, matmul), and each ring shift's backward sends the gradient of the
  received block back round the ring (to r-1, receiving from r+1), so the K/V gradients
  are exact.  Memory: autograd keeps every received block and every block's
  probabilities [b, heads, s_local, s_local], so this path holds as much K/V as
  "allgather" does.  No block is skipped: every score is computed and masked.

Dropout is not supported (the caller refuses it); with cp=1 both paths are local
attention and communicate nothing.
"""

import math
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megacore import attention_kernels, parallel_state
from megacore.attention_kernels import attention_with_sinks, sink_gradient, with_sinks
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
    window: int | None = None,
) -> torch.Tensor | None:
    """Boolean mask [b or 1, 1, s_q, s_k] of the keys each query sees (None: all); `window`:
    a causal query at i sees only keys at i - window < j (itself and window - 1 before)."""
    mask = None
    if causal:
        mask = (kv_positions[None, :] <= q_positions[:, None])[None, None]
    if window is not None:
        near = (q_positions[:, None] - kv_positions[None, :] < window)[None, None]
        mask = near if mask is None else mask & near
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


def _check(q, k, v, q_positions, kv_positions, segments, comm_type, window, sinks, causal):
    if window is not None and (not causal or window < 1):
        raise ValueError(
            f"context_parallel_attention: window must be a positive key count of causal "
            f"attention, got window={window!r} with causal={causal}"
        )
    if sinks is not None and sinks.shape != (q.size(1),):
        raise ValueError(
            f"context_parallel_attention: sinks must be [heads] = ({q.size(1)},), got "
            f"{tuple(sinks.shape)}"
        )
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
    window: int | None = None,
    sinks: torch.Tensor | None = None,
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

    window: a sliding window (causal only): a query at position i sees the keys at positions
    i - window < j <= i; the ring skips the blocks no local query sees.  sinks: [heads], a
    learned logit per head in every query's softmax denominator (gpt-oss), differentiable,
    applied once to the merged result (`megacore.attention_kernels`).
    """
    _check(q, k, v, q_positions, kv_positions, segments, comm_type, window, sinks, causal)
    # The mask is built, and the positions and documents sent, on the tensors' device.
    q_positions, kv_positions = q_positions.to(q.device), kv_positions.to(q.device)
    segments = None if segments is None else segments.to(q.device)
    if group is None:
        group = parallel_state.get_context_parallel_group()
    if scale is None:
        scale = 1.0 / math.sqrt(q.size(-1))
    args = (q, k, v, q_positions, kv_positions, segments, causal, group, scale, window, sinks)
    if comm_type == "allgather":
        return _allgather_attention(*args)
    return _ring_attention(*args)


# --- all-gather -----------------------------------------------------------------------------


def _allgather_attention(
    q, k, v, q_positions, kv_positions, segments, causal, group, scale, window, sinks
):
    groups = k.size(1)
    # One collective for K and V along a leading sequence dim: [s, 2, b, g, d] per rank.
    kv = torch.stack([k, v]).permute(3, 0, 1, 2, 4).contiguous()
    kv = gather_from_sequence_parallel_region(kv, True, group)  # backward: reduce-scatter
    kv = kv.permute(1, 2, 3, 0, 4)  # [2, b, g, cp·s, d], keys in group-rank order
    # Their positions and documents, in the same order (no gradient).
    meta = gather_from_sequence_parallel_region(_token_meta(kv_positions, segments), True, group)
    all_positions = meta[:, 0]
    all_segments = None if segments is None else meta[:, 1:].t()
    mask = _visible(q_positions, all_positions, segments, all_segments, causal, window)
    if sinks is not None:  # every local query sees itself among the gathered keys
        return attention_with_sinks(q, kv[0], kv[1], sinks, mask=mask, scale=scale)
    out = F.scaled_dot_product_attention(
        q, kv[0], kv[1], attn_mask=mask, scale=scale, enable_gqa=groups != q.size(1)
    )
    if mask is not None:  # SDPA's rows with no visible key: zeros, as the ring gives
        out = out.masked_fill(~mask.any(-1, keepdim=True), 0.0)
    return out


# --- ring ---------------------------------------------------------------------------------------
#
# Two implementations.  The fused ring (`_FusedRing`), for causal or full attention without
# packed documents on the balanced layout: per step at most one fused kernel call over the
# (query chunk, key chunk) pairs the causal mask needs, merged by log-sum-exp, and the ring
# re-run in backward.  The float32 ring (`_masked_ring_attention`), for everything else.


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


def _wait(requests) -> None:
    for request in requests:
        request.wait()


def _ring_attention(
    q, k, v, q_positions, kv_positions, segments, causal, group, scale, window, sinks
):
    kernel = attention_kernels.fused_kernel(q, k, v)
    # The fused ring knows which keys a query sees from the ring step alone, so it runs only
    # where the mask is that of the balanced layout: no packed documents (their masks cut
    # blocks anywhere; the fused kernels take no mask here), and, under a causal mask,
    # positions that are `cp_chunk_indices` (others, e.g. a contiguous split, need the
    # positions themselves).  A device, dtype or head size no fused kernel takes also goes
    # to the float32 ring; so do sliding windows, whose blocks it skips where no query sees them.
    fused = kernel is not None and segments is None and window is None
    if fused and causal:
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        fused = _holds_balanced_chunks(q_positions, rank, cp) and _holds_balanced_chunks(
            kv_positions, rank, cp
        )
    if fused:
        return _FusedRing.apply(q, k, v, causal, group, scale, kernel, sinks)
    return _masked_ring_attention(
        q, k, v, q_positions, kv_positions, segments, causal, group, scale, window, sinks
    )


# Positions tensors found to be the balanced layout: (id, rank, cp) -> (weak reference, version).
# Comparing them costs a device sync, and megatrain passes every layer the same tensor
# (`parallelize._cp_positions`), so each is compared once while it lives unchanged.
_BALANCED_POSITIONS: dict[tuple[int, int, int], tuple[weakref.ref, int]] = {}


def _holds_balanced_chunks(positions: torch.Tensor, rank: int, cp: int) -> bool:
    """Whether `positions` are `cp_chunk_indices(len · cp, rank, cp)`."""
    key = (id(positions), rank, cp)
    seen = _BALANCED_POSITIONS.get(key)
    if seen is not None and seen[0]() is positions and seen[1] == positions._version:
        return True
    if cp > 1 and positions.numel() % 2:
        return False
    expected = cp_chunk_indices(positions.numel() * cp, rank, cp)
    if not torch.equal(positions.cpu().to(torch.int64), expected):
        return False
    if len(_BALANCED_POSITIONS) >= 64:  # stale entries of freed tensors: start again
        _BALANCED_POSITIONS.clear()
    _BALANCED_POSITIONS[key] = (weakref.ref(positions), positions._version)
    return True


def _ring_step(step: int, rank: int, cp: int, causal: bool, half: int) -> tuple[slice, slice, bool]:
    """What ring step `step` computes on CP rank `rank`: the local query rows, the held block's
    key rows, and whether the pair is causal (module doc).

    The block held at step i started on rank j = (rank - i) mod cp: chunks j and 2cp-1-j,
    against the local chunks rank and 2cp-1-rank.  A key chunk after a query chunk is skipped,
    the same chunk is causal, one before it is seen whole.  Step 0 (j = rank): both chunks
    causal, the late queries see the early keys whole, and the early queries do not see the late
    keys: one causal call over all local tokens, whose positions increase.  j < rank: both query
    chunks see the block's early chunk whole, neither its late one (after both).  j > rank: the
    late query chunk sees both key chunks whole, the early one neither.
    """
    everything = slice(None)
    if not causal:
        return everything, everything, False
    if step == 0:
        return everything, everything, True
    if (rank - step) % cp < rank:
        return everything, slice(0, half), False
    return slice(half, None), everything, False


def _rows(t: torch.Tensor, rows: slice) -> torch.Tensor:
    """t's rows (dim 2) as a contiguous tensor, as the kernels prefer."""
    return t if rows == slice(None) else t[:, :, rows].contiguous()


def _merge_into(out, lse, part, part_lse) -> None:
    """Merge one call's partial attention into the running one, in place, by log-sum-exp:
    softmax over both calls' keys (every row seen here has a key in both, so all finite)."""
    total = torch.logaddexp(lse, part_lse)
    out.mul_(torch.exp(lse - total).unsqueeze(-1))
    out.add_(part.float() * torch.exp(part_lse - total).unsqueeze(-1))
    lse.copy_(total)


class _FusedRing(torch.autograd.Function):
    """The ring with a fused kernel a step (module doc): saves q, k, v, the output and its
    float32 log-sum-exp [b, heads, s_local], and runs the ring again in backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal, group, scale, kernel, sinks):
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        half = q.size(2) // 2
        q_late = _rows(q, slice(half, None)) if causal and cp > 1 else None
        kv = torch.stack([k, v])  # one transfer per step for K and V
        out = lse = None
        for step in range(cp):
            if step < cp - 1:  # start passing this block on before computing with it
                (received,), requests = _start_shift([kv], group)
            rows, keys, step_causal = _ring_step(step, rank, cp, causal, half)
            part, part_lse = kernel.forward(
                q if rows == slice(None) else q_late,
                _rows(kv[0], keys), _rows(kv[1], keys), step_causal, scale,
            )  # fmt: skip
            if out is None:  # step 0 covers every query row; merged in float32 (or float64)
                acc = torch.promote_types(q.dtype, torch.float32)
                out, lse = part.to(acc), part_lse.to(acc)
            else:
                _merge_into(out[:, :, rows], lse[:, :, rows], part, part_lse)
            if step < cp - 1:
                _wait(requests)
                kv = received
        if sinks is not None:  # once, on the merged result; backward sees the sink softmax
            out, lse = with_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.causal, ctx.group, ctx.scale, ctx.kernel = causal, group, scale, kernel
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        causal, group, scale, kernel = ctx.causal, ctx.group, ctx.scale, ctx.kernel
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        half = q.size(2) // 2
        grad = grad.contiguous()
        # The late query chunk's rows, for the steps that see it alone.
        late = slice(half, None)
        late_args = [_rows(t, late) for t in (grad, q, out, lse)] if causal and cp > 1 else None
        acc = torch.promote_types(q.dtype, torch.float32)
        dq = torch.zeros_like(q, dtype=acc)
        kv = torch.stack([k, v])
        # Each block's K/V gradient travels with it round the ring, summed in float32 over
        # the ranks that used it; one shift after the last step brings it home.
        dkv_received, dkv_requests = None, ()
        for step in range(cp):
            if step < cp - 1:
                (received,), requests = _start_shift([kv], group)
            rows, keys, step_causal = _ring_step(step, rank, cp, causal, half)
            g, q_rows, out_rows, lse_rows = (
                (grad, q, out, lse) if rows == slice(None) else late_args
            )
            dq_part, dk_part, dv_part = kernel.backward(
                g, q_rows, _rows(kv[0], keys), _rows(kv[1], keys), out_rows, lse_rows,
                step_causal, scale,
            )  # fmt: skip
            dq[:, :, rows] += dq_part
            if step == 0:
                dkv = torch.zeros_like(kv, dtype=acc)
            else:  # the block's gradient so far, from the rank that held it last step
                _wait(dkv_requests)
                dkv = dkv_received
            dkv[0, :, :, keys] += dk_part
            dkv[1, :, :, keys] += dv_part
            if cp > 1:
                (dkv_received,), dkv_requests = _start_shift([dkv], group)
            if step < cp - 1:
                _wait(requests)
                kv = received
        if cp > 1:
            _wait(dkv_requests)
            dkv = dkv_received
        dsinks = None if sinks is None else sink_gradient(grad, out, lse, sinks)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), *(None,) * 4, dsinks


# --- the float32 ring: packed documents, any positions, any device ----------------------------


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


class _ThroughRing(torch.autograd.Function):
    """The output, made to depend on the ring's last block: a rank that skipped the blocks at
    the end of its ring (a sliding window) would otherwise not run their shifts' backward,
    whose sends its neighbours, which used those blocks, wait for.  Its gradient: zeros."""

    @staticmethod
    def forward(ctx, out, last_block):
        ctx.block = (last_block.shape, last_block.dtype)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype = ctx.block
        return grad, torch.zeros((), dtype=dtype, device=grad.device).expand(shape)


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


def _merge(outs: list[torch.Tensor], lses: list[torch.Tensor]):
    """Combine partial attentions by their log-sum-exps: softmax over all blocks' keys; the
    merged output and its lse (-inf where a row sees no key)."""
    lse = torch.stack(lses)  # [blocks, b, g, rep, s_q]
    seen = torch.isfinite(lse).any(0)
    # Rows that see no key in any block: a finite stand-in, their weights are exp(-inf) = 0.
    total = torch.logsumexp(torch.where(seen, lse, 0.0), dim=0)
    weights = torch.exp(lse - total).unsqueeze(-1)
    return (weights * torch.stack(outs)).sum(0), torch.where(seen, total, float("-inf"))


def _masked_ring_attention(
    q, k, v, q_positions, kv_positions, segments, causal, group, scale, window, sinks
):
    """The ring in float32 torch ops with each block's mask built from the positions and
    documents sent along with it: any mask, any device; autograd keeps every block's scores.
    With a window, a block that no local query sees (`_window_skips`) is passed on unread."""
    b, heads, s_q, d = q.shape
    groups = k.size(1)
    cp = dist.get_world_size(group)
    qg = q.float().reshape(b, groups, heads // groups, s_q, d)
    kv = torch.stack([k, v]).contiguous()  # one transfer per step for K and V
    meta = _token_meta(kv_positions, segments)
    skips = _window_skips(q_positions, dist.get_rank(group), cp, window)
    outs, lses = [], []
    for step in range(cp):
        if step < cp - 1:  # start passing this block on before computing with it
            received, requests = _start_shift([kv.detach(), meta], group)
        if step not in skips:
            block_segments = None if segments is None else meta[:, 1:].t()
            mask = _visible(q_positions, meta[:, 0], segments, block_segments, causal, window)
            out, lse = _block_attention(qg, kv[0], kv[1], mask, scale)
            outs.append(out)
            lses.append(lse)
        if step < cp - 1:
            for request in requests:
                request.wait()
            kv = _RingShifted.apply(kv, received[0], group)
            meta = received[1]
    out, lse = _merge(outs, lses)
    if skips:  # every rank's backward runs every shift's return trip, used here or not
        out = _ThroughRing.apply(out, kv)
    out, lse = out.reshape(b, heads, s_q, d), lse.reshape(b, heads, s_q)
    if sinks is not None:
        out, _ = with_sinks(out, lse, sinks)
    return out.to(q.dtype)


def _window_skips(q_positions, rank: int, cp: int, window: int | None) -> set[int]:
    """The ring steps whose block no local query sees through the window (`steps_outside_window`)
    on the balanced layout (`cp_chunk_indices`); other layouts: none skipped (the masks decide)."""
    if window is None or cp == 1 or not _holds_balanced_chunks(q_positions, rank, cp):
        return set()
    return steps_outside_window(q_positions.numel() // 2, rank, cp, window)


def steps_outside_window(chunk: int, rank: int, cp: int, window: int) -> set[int]:
    """The p2p ring's steps at CP rank `rank` whose K/V block no local query sees through a
    sliding window of `window` keys, on the balanced layout of chunks of `chunk` tokens: the
    block of step i holds chunks j and 2cp-1-j (j = rank - i mod cp), and query chunk a sees
    key chunk c < a only if their nearest tokens, (a - c - 1) chunks + 1 apart, are within the
    window.  The ring passes those blocks on unread (and `megatrain plan` times the rest)."""
    mine = (rank, 2 * cp - 1 - rank)

    def seen(a, c):
        return c == a or (c < a and (a - c - 1) * chunk + 1 < window)

    skips = set()
    for step in range(1, cp):
        j = (rank - step) % cp
        if not any(seen(a, c) for a in mine for c in (j, 2 * cp - 1 - j)):
            skips.add(step)
    return skips
