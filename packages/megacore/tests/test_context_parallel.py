"""Context parallelism: the balanced chunk layout, and attention over CP ranks (both comm
types; the ring fused and in float32) equal to full-sequence SDPA in outputs and in q/k/v
gradients; what the fused ring saves and which kernel calls it makes."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from megacore import attention_kernels
from megacore import context_parallel as cpa
from megacore import parallel_state as ps
from megacore.context_parallel import (
    context_parallel_attention,
    cp_chunk_indices,
    split_for_context_parallel,
)
from megacore.testing import run_distributed

TOL = 1e-5


# --- the layout --------------------------------------------------------------------------------


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_chunk_indices_balance_the_sequence(cp):
    seq = 8 * cp
    chunk = seq // (2 * cp)
    parts = [cp_chunk_indices(seq, r, cp) for r in range(cp)]
    assert all(p.dtype == torch.int64 and p.shape == (seq // cp,) for p in parts)
    assert sorted(torch.cat(parts).tolist()) == list(range(seq))  # a permutation
    for r, p in enumerate(parts):
        first, second = r, 2 * cp - 1 - r
        expected = [*range(first * chunk, (first + 1) * chunk)]
        expected += [*range(second * chunk, (second + 1) * chunk)]
        assert p.tolist() == expected
    # split_for_context_parallel takes those positions along any dim.
    x = torch.arange(3 * seq * 2).reshape(3, seq, 2)
    for r, p in enumerate(parts):
        assert torch.equal(split_for_context_parallel(x, 1, r, cp), x[:, p])
    assert cp_chunk_indices(16, 1, 4).tolist() == [2, 3, 12, 13]  # chunks 1 and 6 of 8


def test_chunk_indices_refuse_uneven_lengths():
    with pytest.raises(ValueError, match=r"sequence length 20 .* = 8"):
        cp_chunk_indices(20, 0, 4)
    with pytest.raises(ValueError, match=r"sequence length 6 .* = 4"):
        split_for_context_parallel(torch.zeros(2, 6), 1, 1, 2)
    with pytest.raises(ValueError, match="cp_rank 2"):
        cp_chunk_indices(16, 2, 2)
    assert cp_chunk_indices(7, 0, 1).tolist() == list(range(7))  # cp 1: anything goes


def test_attention_refuses_bad_arguments():
    q, kv, pos = torch.zeros(1, 4, 8, 2), torch.zeros(1, 3, 8, 2), torch.arange(8)
    with pytest.raises(ValueError, match="comm_type"):
        context_parallel_attention(
            q, q, q, q_positions=pos, kv_positions=pos, comm_type="a2a", group=object()
        )
    with pytest.raises(ValueError, match="multiple of the key/value groups"):
        context_parallel_attention(q, kv, kv, q_positions=pos, kv_positions=pos, group=object())
    with pytest.raises(ValueError, match="segments"):
        context_parallel_attention(
            q, q, q, q_positions=pos, kv_positions=pos, segments=pos, group=object()
        )


# --- the reference -----------------------------------------------------------------------------


def _mask(seq, segments, causal):
    """[b or 1, 1, s, s] boolean: what full-sequence attention sees (None: everything)."""
    pos = torch.arange(seq)
    mask = (pos[None, :] <= pos[:, None])[None, None] if causal else None
    if segments is not None:
        same = (segments[:, :, None] == segments[:, None, :])[:, None]
        mask = same if mask is None else mask & same
    return mask


def _documents(batch, seq, generator):
    """Document ids of packed sequences: a few documents of uneven lengths per row."""
    rows = []
    for _ in range(batch):
        cuts = torch.randperm(seq - 1, generator=generator)[:3] + 1
        ids = torch.zeros(seq, dtype=torch.int64)
        for c in cuts.tolist():
            ids[c:] += 1
        rows.append(ids)
    return torch.stack(rows)


def _reference(q, k, v, mask):
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=k.size(1) != q.size(1)
    )


def test_merge_by_log_sum_exp_and_a_dropped_term():
    """The ring's merge of per-block partials equals softmax over all keys; leaving one
    block out (or masking with the wrong mask) does not: the comparison can fail."""
    g = torch.Generator().manual_seed(0)
    b, heads, groups, s, d = 2, 4, 2, 12, 8
    q = torch.randn(b, heads, s, d, generator=g)
    k, v = (torch.randn(b, groups, s, d, generator=g) for _ in range(2))
    segments = _documents(b, s, g)
    mask = _mask(s, segments, causal=True)
    ref = _reference(q, k, v, mask)
    qg = q.reshape(b, groups, heads // groups, s, d)
    blocks = [slice(0, 4), slice(4, 9), slice(9, 12)]
    parts = [
        cpa._block_attention(qg, k[:, :, i], v[:, :, i], mask[..., i], d**-0.5) for i in blocks
    ]
    merged = cpa._merge(*map(list, zip(*parts, strict=True)))[0].reshape(b, heads, s, d)
    assert (merged - ref).abs().max() < TOL
    # Rows with no visible key in a block (row 0 in blocks 2 and 3) gave -inf, not NaN.
    assert not torch.isnan(merged).any()
    dropped = cpa._merge([parts[0][0], parts[2][0]], [parts[0][1], parts[2][1]])[0]
    assert (dropped.reshape(b, heads, s, d) - ref).abs().max() > 1e-2
    assert (_reference(q, k, v, _mask(s, None, causal=True)) - ref).abs().max() > 1e-2


# --- over CP ranks -----------------------------------------------------------------------------

CASES = [
    # (comm_type, heads, groups, causal, segments)
    (comm, heads, groups, causal, segmented)
    for comm, (heads, groups), (causal, segmented) in itertools.product(
        ("allgather", "p2p"),
        ((4, 4), (4, 2)),
        ((True, False), (True, True), (False, True), (False, False)),
    )
]


def _errors(case, cp_rank, cp, seed, wrong_positions=False):
    """Max |difference| from full-sequence SDPA of this rank's output and q/k/v gradients."""
    comm, heads, groups, causal, segmented = case
    g = torch.Generator().manual_seed(seed)
    b, s, d = 2, 16, 8
    q = torch.randn(b, heads, s, d, generator=g).requires_grad_()
    k = torch.randn(b, groups, s, d, generator=g).requires_grad_()
    v = torch.randn(b, groups, s, d, generator=g).requires_grad_()
    upstream = torch.randn(b, heads, s, d, generator=g)
    segments = _documents(b, s, g) if segmented else None

    ref = _reference(q, k, v, _mask(s, segments, causal))
    ref.backward(upstream)

    mine = cp_chunk_indices(s, cp_rank, cp)
    local = [
        split_for_context_parallel(t.detach(), 2, cp_rank, cp).requires_grad_() for t in (q, k, v)
    ]
    positions = mine
    if wrong_positions:  # a contiguous split's positions for a balanced split's tokens
        positions = torch.arange(cp_rank * (s // cp), (cp_rank + 1) * (s // cp))
    out = context_parallel_attention(
        *local,
        q_positions=positions,
        kv_positions=positions,
        segments=None if segments is None else segments[:, mine],
        causal=causal,
        comm_type=comm,
    )
    out.backward(upstream[:, :, mine])
    # Each rank's K/V gradient is the sum over every rank's queries: the full gradient at
    # its own positions, as the all-gather's reduce-scatter or the ring's return trip gives.
    return [
        (out - ref[:, :, mine]).abs().max().item(),
        *[
            (t.grad - full.grad[:, :, mine]).abs().max().item()
            for t, full in zip(local, (q, k, v), strict=True)
        ],
    ]


def _bf16_errors(cp_rank, cp, heads, groups):
    """The fused ring in bfloat16 and one-process bfloat16 SDPA, each against float32 attention
    of the same (bfloat16-rounded) inputs: max |difference| of out, dq, dk, dv at this rank's
    positions, [ring..., one process...]."""
    g = torch.Generator().manual_seed(5)  # the same sequence on every rank
    b, s, d = 2, 64, 16
    q, k, v = (
        torch.randn(b, n, s, d, generator=g).bfloat16().float().requires_grad_()
        for n in (heads, groups, groups)
    )
    upstream = torch.randn(b, heads, s, d, generator=g).bfloat16()
    mine = cp_chunk_indices(s, cp_rank, cp)
    ref = _reference(q, k, v, _mask(s, None, causal=True))
    ref.backward(upstream.float())
    half = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    one = F.scaled_dot_product_attention(*half, is_causal=True, enable_gqa=groups != heads)
    one.backward(upstream)
    local = [split_for_context_parallel(t.detach(), 2, cp_rank, cp).requires_grad_() for t in half]
    out = context_parallel_attention(*local, q_positions=mine, kv_positions=mine)
    out.backward(upstream[:, :, mine])
    assert out.dtype == torch.bfloat16 and all(t.grad.dtype == torch.bfloat16 for t in local)

    full = [ref[:, :, mine], *(t.grad[:, :, mine] for t in (q, k, v))]

    def errors(*results):
        return [(x.float() - y).abs().max().item() for x, y in zip(results, full, strict=True)]

    return errors(out, *(t.grad for t in local)) + errors(
        one[:, :, mine], *(t.grad[:, :, mine] for t in half)
    )


EVIDENCE_SHAPE = (2, 4, 2, 256, 8)  # b, heads, groups, s, d


def _fused_ring_evidence(cp_rank, cp):
    """What the fused ring saves for backward and which kernel calls it makes, against the
    float32 ring on the same attention (one document in `segments` sends it there): bytes
    saved by each, bytes of q, k, v, out and the lse, and (rows, keys, causal) of each call."""
    g = torch.Generator().manual_seed(9)
    b, heads, groups, s, d = EVIDENCE_SHAPE
    q = torch.randn(b, heads, s, d, generator=g)
    k, v = (torch.randn(b, groups, s, d, generator=g) for _ in range(2))
    mine = cp_chunk_indices(s, cp_rank, cp)
    calls = []
    real = attention_kernels.fused_kernel

    def recording(*tensors):
        kernel = real(*tensors)

        def forward(q, k, v, causal, scale):
            calls.append(("forward", q.size(2), k.size(2), causal))
            return kernel.forward(q, k, v, causal, scale)

        def backward(grad, q, k, v, out, lse, causal, scale):
            calls.append(("backward", q.size(2), k.size(2), causal))
            return kernel.backward(grad, q, k, v, out, lse, causal, scale)

        return attention_kernels.FusedKernel(kernel.name, forward, backward)

    saved = {}
    for path, segments in (
        ("fused", None),
        ("float32", torch.zeros(b, s // cp, dtype=torch.int64)),
    ):
        local = [split_for_context_parallel(t, 2, cp_rank, cp).requires_grad_() for t in (q, k, v)]
        sizes = []

        def pack(t, sizes=sizes):
            sizes.append(t.numel() * t.element_size())
            return t

        attention_kernels.fused_kernel = recording
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = context_parallel_attention(
                    *local, q_positions=mine, kv_positions=mine, segments=segments
                )
            out.sum().backward()
        finally:
            attention_kernels.fused_kernel = real
        saved[path] = sum(sizes)
        if path == "fused":
            lse_bytes = out[..., 0].numel() * 4
            saved["q k v out lse"] = sum(t.numel() * 4 for t in (*local, out)) + lse_bytes
            saved["local"] = out.size(2)
    return saved, calls


WINDOW_CASES = [
    # (comm_type, heads, groups, window, sinks, segments): s = 16, so a chunk is 2 tokens at
    # cp 4 and 4 at cp 2: windows of 1 (itself), 3 (under a cp 2 chunk) and 7 (over chunks)
    (comm, 4, groups, window, sinks, segmented)
    for comm, groups, (window, sinks, segmented) in itertools.product(
        ("allgather", "p2p"),
        (4, 2),
        (
            (1, False, False),
            (3, True, False),
            (7, False, True),
            (7, True, True),
            (None, True, False),
        ),
    )
]


def _windowed_reference(q, k, v, mask, sinks):
    """Attention with an optional sink logit per head in the denominator, as HF's gpt-oss eager
    path computes it: the sink joins the scores as one more column, dropped after softmax."""
    b, heads, s, d = q.shape
    k, v = (t.repeat_interleave(heads // t.size(1), dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) * d**-0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, -1) @ v
    column = sinks.reshape(1, heads, 1, 1).expand(b, heads, s, 1)
    probs = torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1]
    return probs @ v


def _window_errors(case, cp_rank, cp, seed):
    """Max |difference| from one process of this rank's output and q, k, v (and sink)
    gradients, in float64, for a sliding window and/or sinks; and the ring steps skipped."""
    comm, heads, groups, window, with_sinks, segmented = case
    g = torch.Generator().manual_seed(seed)
    b, s, d = 2, 16, 8
    q = torch.randn(b, heads, s, d, generator=g, dtype=torch.float64).requires_grad_()
    k, v = (
        torch.randn(b, groups, s, d, generator=g, dtype=torch.float64).requires_grad_()
        for _ in range(2)
    )
    sinks = torch.randn(heads, generator=g, dtype=torch.float64) if with_sinks else None
    upstream = torch.randn(b, heads, s, d, generator=g, dtype=torch.float64)
    segments = _documents(b, s, g) if segmented else None
    mask = _mask(s, segments, causal=True)
    if window is not None:
        pos = torch.arange(s)
        mask = mask & (pos[:, None] - pos[None, :] < window)[None, None]
    full_sinks = None if sinks is None else sinks.clone().requires_grad_()
    ref = _windowed_reference(q, k, v, mask, full_sinks)
    ref.backward(upstream)
    mine = cp_chunk_indices(s, cp_rank, cp)
    local = [
        split_for_context_parallel(t.detach(), 2, cp_rank, cp).requires_grad_() for t in (q, k, v)
    ]
    local_sinks = None if sinks is None else sinks.clone().requires_grad_()
    out = context_parallel_attention(
        *local, q_positions=mine, kv_positions=mine,
        segments=None if segments is None else segments[:, mine],
        comm_type=comm, window=window, sinks=local_sinks,
    )  # fmt: skip
    out.backward(upstream[:, :, mine])
    errors = [(out - ref[:, :, mine]).abs().max().item()]
    errors += [
        (t.grad - f.grad[:, :, mine]).abs().max().item()
        for t, f in zip(local, (q, k, v), strict=True)
    ]
    if sinks is not None:  # each rank's share; the sum over CP ranks is the full gradient
        errors.append(local_sinks.grad)
        errors.append(full_sinks.grad)
    skipped = sorted(cpa._window_skips(mine, cp_rank, cp, window)) if comm == "p2p" else []
    return errors, skipped


def _check_attention_on_4_ranks():
    results = {}
    for cp in (4, 2, 1):  # cp 2: two CP groups of two (dp 2); cp 1: local attention
        ps.initialize_model_parallel(context_parallel_size=cp)
        cp_rank, dp_rank = ps.get_context_parallel_rank(), ps.get_data_parallel_rank()
        cases = CASES if cp > 1 else [c for c in CASES if c[1:] == (4, 2, True, True)]
        for case in cases:
            results[(cp, *case)] = _errors(case, cp_rank, cp, seed=100 * cp + dp_rank)
        if cp > 1:  # negative control: the right tokens at the wrong positions
            for comm in ("allgather", "p2p"):
                case = (comm, 4, 2, True, False)
                results[("wrong", cp, comm)] = _errors(
                    case, cp_rank, cp, seed=7, wrong_positions=True
                )
            for heads, groups in ((4, 4), (4, 2)):
                results[("bf16", cp, heads, groups)] = _bf16_errors(cp_rank, cp, heads, groups)
            results[("evidence", cp)] = _fused_ring_evidence(cp_rank, cp)
            for case in WINDOW_CASES:
                results[("window", cp, *case)] = _window_errors(case, cp_rank, cp, seed=11)
        ps.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def cp_ranks():
    """Every rank's results of `_check_attention_on_4_ranks` (one spawn for the tests below)."""
    return run_distributed(_check_attention_on_4_ranks, world_size=4, timeout=300)


def test_attention_over_cp_ranks_equals_full_attention(cp_ranks):
    ranks = cp_ranks
    assert len(ranks[0]) == 2 * len(CASES) + 2 + 4 + 2 * 3 + 2 * len(WINDOW_CASES)
    for key in ranks[0]:
        if key[0] in ("bf16", "evidence", "window"):
            continue
        worst = [max(r[key][i] for r in ranks) for i in range(4)]  # out, dq, dk, dv
        if key[0] == "wrong":
            assert worst[0] > 1e-2, key  # the test can fail
        else:
            assert max(worst) < TOL, (key, worst)


def test_sliding_windows_and_sinks_over_cp_ranks_equal_one_process(cp_ranks):
    """Sliding windows (shorter than a chunk and longer, with packed documents) and attention
    sinks, by both comm types at cp 2 and 4 (float64 inputs; the float32 ring within TOL): each
    rank's output and q, k, v gradients equal one process's at its positions, and the sinks'
    gradient summed over the CP ranks (as the data x context gradient all-reduce sums it)
    equals one process's.  The p2p
    ring skips the steps whose block lies wholly outside every local query's window — a window
    of 1 or 3 at cp 4 skips some on every rank — and still equals one process, so a skip of a
    block some query needed would fail here."""
    keys = [k for k in cp_ranks[0] if k[0] == "window"]
    assert len(keys) == 2 * len(WINDOW_CASES)
    skipped_any = set()
    for key in keys:
        cp, case = key[1], key[2:]
        per_rank = [r[key][0] for r in cp_ranks]
        worst = [max(e[i] for e in per_rank) for i in range(4)]
        assert max(worst) < TOL, (key, worst)
        if case[4]:  # sinks: the CP group's shares sum to the full gradient
            groups_of = [list(range(i, i + cp)) for i in range(0, 4, cp)]
            for ranks in groups_of:
                total = sum(cp_ranks[r][key][0][4] for r in ranks)
                torch.testing.assert_close(total, cp_ranks[ranks[0]][key][0][5], rtol=0, atol=TOL)
        if any(r[key][1] for r in cp_ranks):
            skipped_any.add((cp, case[3]))
        if case[0] == "p2p" and cp == 4 and case[3] in (1, 3):
            assert all(r[key][1] for r in cp_ranks), key  # every rank skips some steps
        if case[3] is None or case[3] > 2 * 16 // cp:
            assert not any(r[key][1] for r in cp_ranks), key
    assert (4, 1) in skipped_any and (4, 3) in skipped_any


BF16_SLACK = 2.0


def test_fused_ring_in_bfloat16_is_as_close_as_one_process_bfloat16(cp_ranks):
    """The fused ring in bfloat16 (cp 2 and 4, MHA and GQA) against float32 attention is within
    BF16_SLACK x one process's bfloat16 SDPA error on the same inputs.  Why 2: the one process
    rounds its output and gradients to bfloat16 once; the ring rounds each block kernel's
    partial output and gradients to bfloat16 too, merges and sums them in float32, and rounds
    the result again: two roundings where the one process has one.  A block left out or
    mis-masked is off by O(0.1-1), far beyond it (2 x the one-process error stays below 0.1)."""
    keys = [k for k in cp_ranks[0] if k[0] == "bf16"]
    assert len(keys) == 4
    for key in keys:
        ring = [max(r[key][i] for r in cp_ranks) for i in range(4)]  # out, dq, dk, dv
        one = [max(r[key][4 + i] for r in cp_ranks) for i in range(4)]
        assert all(0 < e < 0.05 for e in one), (key, one)  # bfloat16 did round
        for what, mine, theirs in zip(("out", "dq", "dk", "dv"), ring, one, strict=True):
            assert mine <= BF16_SLACK * theirs, (key, what, mine, theirs)


def test_fused_ring_saves_o_s_d_and_skips_masked_pairs(cp_ranks):
    """The fused path is what runs for causal attention without documents: it saves exactly q,
    k, v, the output and the float32 lse (O(s_local·d)), where the float32 ring saves at least
    every block's scores [b, heads, s_local, s_local]; its kernel calls cover causal attention's
    share of the scores (half of s_local x s, a causal call counting half its square), once
    in the forward and once in the backward's re-run ring."""
    b, heads, _, s, _ = EVIDENCE_SHAPE
    for cp in (2, 4):
        for rank in cp_ranks:
            saved, calls = rank[("evidence", cp)]
            local = saved["local"]
            assert saved["fused"] == saved["q k v out lse"]
            assert saved["float32"] >= cp * b * heads * local * local * 4
            forward = [c[1:] for c in calls if c[0] == "forward"]
            assert forward == [c[1:] for c in calls if c[0] == "backward"]
            assert len(forward) == cp
            area = sum(rows * keys / (2 if causal else 1) for rows, keys, causal in forward)
            assert area == local * s / 2


def test_balanced_positions_are_checked_and_remembered():
    positions = cp_chunk_indices(16, 1, 4)
    assert cpa._holds_balanced_chunks(positions, 1, 4)
    assert cpa._holds_balanced_chunks(positions, 1, 4)  # remembered
    assert not cpa._holds_balanced_chunks(positions, 2, 4)
    assert not cpa._holds_balanced_chunks(torch.arange(4, 8), 1, 4)  # a contiguous split
    assert not cpa._holds_balanced_chunks(torch.arange(3), 0, 2)  # odd: no two chunks
    positions[0] = 0  # changed in place: checked again
    assert not cpa._holds_balanced_chunks(positions, 1, 4)


# --- the fused ring's kernels, one call each (scripts/gpu_check.sh runs the CUDA ones) ---------


def _attention_and_lse(q, k, v, causal, scale):
    """Reference attention in float64 with its log-sum-exp; k, v may have fewer heads."""
    rep = q.size(1) // k.size(1)
    k, v = (t.double().repeat_interleave(rep, dim=1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) * scale
    if causal:
        keep = torch.ones(q.size(2), k.size(2), dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


@pytest.mark.parametrize(
    ("kernel", "dtype", "tol"),
    [
        ("cpu flash", torch.float32, 1e-4),
        ("cuda flash", torch.bfloat16, 2e-2),
        ("cuda efficient", torch.float32, 1e-4),
    ],
)
def test_fused_ring_kernels_equal_attention(kernel, dtype, tol):
    """Each kernel the fused ring calls (the CPU's flash kernel; on a GPU FlashAttention-2 in
    16 bits and the memory-efficient kernel in fp32), called as the ring calls it: its output
    and log-sum-exp equal attention's, causal and full, grouped K/V too, and its backward
    given that output and log-sum-exp equals attention's q, k and v gradients (on a GPU: the
    op signatures, GQA's expansion and the efficient kernel's padded log-sum-exp, which no CPU
    run reaches; scripts/gpu_check.sh runs them)."""
    fused = {
        "cpu flash": attention_kernels._CPU_FLASH,
        "cuda flash": attention_kernels._CUDA_FLASH,
        "cuda efficient": attention_kernels._CUDA_EFFICIENT,
    }[kernel]
    device = kernel.split()[0]
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("the CUDA kernels need a GPU")
    if kernel == "cuda flash" and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("FlashAttention-2 needs sm80 or newer")
    gen = torch.Generator(device=device).manual_seed(0)
    for causal, groups in itertools.product((True, False), (4, 2)):
        b, heads, s, d = 2, 4, 96, 64  # s not a multiple of 32: the efficient kernel pads lse
        q = torch.randn(b, heads, s, d, device=device, generator=gen).to(dtype)
        k, v = (
            torch.randn(b, groups, s, d, device=device, generator=gen).to(dtype) for _ in range(2)
        )
        scale = d**-0.5
        out, lse = fused.forward(q, k, v, causal, scale)
        ref_q, ref_k, ref_v = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref, ref_lse = _attention_and_lse(ref_q, ref_k, ref_v, causal, scale)
        assert out.dtype == dtype and lse.shape == (b, heads, s)
        torch.testing.assert_close(out.double(), ref.detach(), atol=tol, rtol=tol)
        torch.testing.assert_close(lse.double(), ref_lse.detach(), atol=tol, rtol=tol)
        grad = torch.randn(b, heads, s, d, device=device, generator=gen).to(dtype)
        dq, dk, dv = fused.backward(grad, q, k, v, out, lse, causal, scale)
        ref.backward(grad.double())
        for got, want in ((dq, ref_q.grad), (dk, ref_k.grad), (dv, ref_v.grad)):
            assert got.shape == want.shape
            torch.testing.assert_close(got.double(), want, atol=5 * tol, rtol=5 * tol)
