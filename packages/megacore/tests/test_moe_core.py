"""megacore.moe on one process, fp32: routing against the published formulas written out
here (HF Mixtral's, Qwen2/3-MoE's, DeepSeek-V3's), capacity drops against a per-expert
loop, permutation against a per-token loop, the grouped GEMM against the per-expert loop
(gradients too), the auxiliary losses against the papers' formulas and their gradient
through the autoscaler, the expert-bias update."""

import math

import pytest
import torch

from megacore import moe

T, E, K = 24, 6, 2


def _logits(seed=0, t=T, e=E):
    return torch.randn(t, e, generator=torch.Generator().manual_seed(seed)) * 2


def _same_choices(probs, indices, ref_probs, ref_indices):
    """Equal as sets per token: the order of the k choices is not part of the contract."""
    order, ref_order = indices.argsort(-1), ref_indices.argsort(-1)
    assert torch.equal(indices.gather(1, order), ref_indices.gather(1, ref_order))
    torch.testing.assert_close(probs.gather(1, order), ref_probs.gather(1, ref_order))


def test_softmax_routing_is_mixtral_and_qwen():
    logits = _logits()
    # HF MixtralSparseMoeBlock / Qwen3-MoE (norm_topk_prob): softmax over all, top k, renormalized.
    full = torch.softmax(logits, dim=1, dtype=torch.float)
    weights, chosen = torch.topk(full, K, dim=-1)
    mixtral = weights / weights.sum(dim=-1, keepdim=True)
    for pre_softmax, norm in ((False, False), (True, True)):
        probs, indices = moe.topk_routing(logits, K, pre_softmax=pre_softmax, norm_topk_prob=norm)
        _same_choices(probs, indices, mixtral, chosen)
    # Qwen2-MoE (norm_topk_prob false): the top k of the softmax as they are.
    probs, indices = moe.topk_routing(logits, K, pre_softmax=True)
    _same_choices(probs, indices, weights, chosen)
    assert not torch.allclose(probs.sum(-1), torch.ones(T))
    probs2, _ = moe.topk_routing(logits, K, pre_softmax=True, scaling_factor=2.5)
    torch.testing.assert_close(probs2, probs * 2.5)


def test_sigmoid_routing_with_bias_chooses_but_does_not_weigh():
    logits = _logits(1)
    bias = torch.zeros(E)
    bias[4] = 10.0  # expert 4 chosen by every token
    probs, indices = moe.topk_routing(
        logits, K, score_function="sigmoid", expert_bias=bias, scaling_factor=2.0
    )
    assert (indices == 4).any(-1).all()
    # DeepSeek-V3: s = sigmoid(u); choose by s + b; weights s / sum(chosen s), times the factor.
    s = torch.sigmoid(logits)
    chosen = torch.topk(s + bias, K, dim=-1).indices
    picked = s.gather(1, chosen)
    _same_choices(probs, indices, picked / picked.sum(-1, keepdim=True) * 2.0, chosen)
    unbiased_probs, unbiased = moe.topk_routing(logits, K, score_function="sigmoid")
    assert not torch.equal(unbiased.sort(-1).values, indices.sort(-1).values)
    top = s.topk(K, dim=-1)
    _same_choices(unbiased_probs, unbiased, top.values / top.values.sum(-1, keepdim=True),
                  top.indices)  # fmt: skip
    with pytest.raises(ValueError, match="sigmoid"):
        moe.topk_routing(logits, K, expert_bias=bias)


def _drops_reference(probs, indices, capacity, policy):
    """Per expert: keep its `capacity` choices of highest weight (or earliest token)."""
    keep = torch.zeros_like(indices, dtype=torch.bool)
    for e in range(E):
        where = [(t, j) for t in range(indices.shape[0]) for j in range(K) if indices[t, j] == e]
        if policy == "probs":
            where.sort(key=lambda tj: -probs[tj].item())
        for t, j in where[:capacity]:
            keep[t, j] = True
    return keep


@pytest.mark.parametrize("policy", moe.DROP_POLICIES)
def test_capacity_drops_the_right_choices(policy):
    logits = _logits(2)
    logits[:, 0] += 3.0  # expert 0 overloaded
    probs, indices = moe.topk_routing(logits, K)
    factor = 0.5
    capacity = moe.expert_capacity(T, E, K, factor)
    assert capacity == math.ceil(T * K / E * factor) == 4
    kept = moe.drop_over_capacity(probs, indices, E, factor, policy)
    reference = _drops_reference(probs, indices, capacity, policy)
    assert torch.equal(kept != moe.DROPPED, reference)
    assert torch.equal(kept[reference], indices[reference])
    assert (moe.tokens_per_expert(kept, E) <= capacity).all()
    assert moe.tokens_per_expert(kept, E).sum() == reference.sum() < T * K


def test_permute_unpermute_equal_a_per_token_loop():
    h = 5
    hidden = torch.randn(T, h)
    probs, indices = moe.topk_routing(_logits(3), K)
    indices = moe.drop_over_capacity(probs, indices, E, 0.75)
    scale = torch.arange(1, E + 1, dtype=torch.float)  # "expert" e multiplies by e + 1
    sorted_hidden, counts, order = moe.permute(hidden, indices, E)
    assert torch.equal(counts, moe.tokens_per_expert(indices, E))
    owner = torch.repeat_interleave(torch.arange(E), counts)
    # Grouped by expert, each expert's tokens in their order; the dropped choices nowhere.
    rows = [t for e in range(E) for t in range(T) for j in range(K) if indices[t, j] == e]
    torch.testing.assert_close(sorted_hidden, hidden[rows])
    out = moe.unpermute(sorted_hidden * scale[owner, None], order, probs, T)
    expected = torch.zeros(T, h)
    for t in range(T):
        for j in range(K):
            if indices[t, j] != moe.DROPPED:
                expected[t] += probs[t, j] * hidden[t] * scale[indices[t, j]]
    torch.testing.assert_close(out, expected)
    # The dispatcher is the same pair; dropless knows N without reading the counts.
    _, full = moe.topk_routing(_logits(3), K)
    dispatcher = moe.LocalDispatcher(E, dropless=True)
    x, counts = dispatcher.dispatch(hidden, probs, full)
    assert x.shape[0] == T * K and counts.sum() == T * K
    torch.testing.assert_close(dispatcher.combine(x), (probs.sum(-1, keepdim=True) * hidden))


def _mlp_inputs(h=8, f=12, counts=(3, 0, 7, 5), swiglu=True, seed=4):
    g = torch.Generator().manual_seed(seed)
    n, e = sum(counts), len(counts)
    x = torch.randn(n, h, generator=g)
    w1 = torch.randn(e, h, 2 * f if swiglu else f, generator=g) / 3
    w2 = torch.randn(e, f, h, generator=g) / 3
    return x, torch.tensor(counts), w1, w2


@pytest.mark.parametrize("activation", ["swiglu", "gelu_tanh"])
def test_grouped_gemm_equals_the_per_expert_loop(activation):
    x, counts, w1, w2 = _mlp_inputs(swiglu=activation == "swiglu")
    assert moe.grouped_gemm_available(x, w1, w2), "torch here has a CPU grouped GEMM"
    results = []
    for grouped in (True, False):
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2)]
        out = moe.grouped_mlp(leaves[0], counts, leaves[1], leaves[2], activation, grouped)
        out.sum().backward()  # an expanded gradient: the grouped backward needs it contiguous
        results.append([out.detach()] + [t.grad for t in leaves])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # By hand, expert by expert.
    start, expected = 0, []
    for e, c in enumerate(counts.tolist()):
        hidden = x[start : start + c] @ w1[e]
        if activation == "swiglu":
            gate, up = hidden.chunk(2, -1)
            hidden = torch.nn.functional.silu(gate) * up
        else:
            hidden = torch.nn.functional.gelu(hidden, approximate="tanh")
        expected.append(hidden @ w2[e])
        start += c
    torch.testing.assert_close(results[0][0], torch.cat(expected), rtol=1e-5, atol=1e-6)
    # Rows not on 16 bytes: the loop serves, and forcing the grouped GEMM says why not.
    x, counts, w1, w2 = _mlp_inputs(h=6, f=5)
    assert not moe.grouped_gemm_available(x, w1, w2)
    with pytest.raises(RuntimeError, match="grouped GEMM"):
        moe.grouped_mlp(x, counts, w1, w2, "swiglu", grouped=True)
    # Rows on 16 bytes but a weight 4 bytes past a 16-byte boundary, as a view into a flat
    # buffer after an odd-sized parameter starts (CUDA's kernel refuses its data_ptr).
    x, counts, w1, w2 = _mlp_inputs()
    flat = torch.empty(w1.numel() + 1)
    shifted = flat[1:].view_as(w1).copy_(w1)
    assert shifted.data_ptr() % 16 == 4 and shifted.is_contiguous()
    assert not moe.grouped_gemm_available(x, shifted, w2)


def test_fc1_shard_splits_gate_and_up_apart():
    full = torch.arange(2 * 8).float().view(1, 16)  # gate 0..7, up 8..15
    assert moe.fc1_shard(full, 1, 2, swiglu=True).tolist() == [[4, 5, 6, 7, 12, 13, 14, 15]]
    assert moe.fc1_shard(full, 1, 4, swiglu=False).tolist() == [[4, 5, 6, 7]]


def _group_limited_by_hand(scores, topk, groups, group_topk, summed):
    """Token by token: each group's score the sum of its `summed` best, the `group_topk`
    best groups, the top k of their experts."""
    T, E = scores.shape
    per = E // groups
    out = []
    for t in range(T):
        rank = [scores[t, g * per : (g + 1) * per].topk(summed).values.sum() for g in range(groups)]
        best = torch.stack(rank).topk(group_topk).indices.tolist()
        allowed = [e for g in best for e in range(g * per, (g + 1) * per)]
        pick = scores[t, allowed].topk(topk).indices
        out.append(torch.tensor(allowed)[pick])
    return torch.stack(out)


def test_group_limited_routing_chooses_within_each_tokens_best_groups():
    logits = _logits(11, t=T, e=16)
    bias = torch.randn(16, generator=torch.Generator().manual_seed(3)) * 0.3
    # DeepSeek-V3 (HF): sigmoid + correction bias ranks the groups by their top-2 sum.
    probs, indices = moe.topk_routing(
        logits, 4, score_function="sigmoid", expert_bias=bias, num_groups=4, group_topk=2,
        group_score_topk=2, scaling_factor=2.5,
    )  # fmt: skip
    s = torch.sigmoid(logits)
    chosen = _group_limited_by_hand(s + bias, 4, 4, 2, 2)
    picked = s.gather(1, chosen)
    _same_choices(probs, indices, picked / picked.sum(-1, keepdim=True) * 2.5, chosen)
    # Every token's experts lie in at most group_topk groups.
    assert ((indices // 4).sort(-1).values.diff(dim=-1) != 0).sum(-1).max() <= 1
    # The limit changes the choice: without it some token picks from a third group.
    _, free = moe.topk_routing(logits, 4, score_function="sigmoid", expert_bias=bias)
    assert ((free // 4).sort(-1).values.diff(dim=-1) != 0).sum(-1).max() > 1
    # DeepSeek-V2's group_limited_greedy: the softmax over all, groups ranked by their max
    # (the top 1), the k weights as they are.
    probs, indices = moe.topk_routing(
        logits, 3, pre_softmax=True, num_groups=4, group_topk=2, group_score_topk=1
    )
    p = torch.softmax(logits, -1)
    chosen = _group_limited_by_hand(p, 3, 4, 2, 1)
    _same_choices(probs, indices, p.gather(1, chosen), chosen)
    # Megatron's default rank: the sum of the top k / group_topk (here 4 / 2 = 2).
    probs, indices = moe.topk_routing(logits, 4, pre_softmax=True, num_groups=4, group_topk=2)
    chosen = _group_limited_by_hand(p, 4, 4, 2, 2)
    _same_choices(probs, indices, p.gather(1, chosen), chosen)
    # A gradient reaches the chosen logits only.
    leaf = logits.clone().requires_grad_()
    probs, indices = moe.topk_routing(
        leaf, 4, score_function="sigmoid", num_groups=4, group_topk=2, group_score_topk=2
    )
    probs.sum().backward()
    assert torch.isfinite(leaf.grad).all()


def test_sigmoid_weights_normalized_as_told():
    logits = _logits(12)
    s = torch.sigmoid(logits)
    top = s.topk(K, dim=-1)
    # HF DeepSeek-V3 with norm_topk_prob false: the chosen scores as they are, scaled.
    probs, indices = moe.topk_routing(
        logits, K, score_function="sigmoid", norm_topk_prob=False, scaling_factor=2.5
    )
    _same_choices(probs, indices, top.values * 2.5, top.indices)
    # Unset (Megatron's): normalized when k > 1; told, even at k = 1 (HF's).
    probs, _ = moe.topk_routing(logits, K, score_function="sigmoid")
    torch.testing.assert_close(probs.sum(-1), torch.ones(T))
    one, _ = moe.topk_routing(logits, 1, score_function="sigmoid")
    torch.testing.assert_close(one[:, 0], s.max(-1).values)
    one, _ = moe.topk_routing(logits, 1, score_function="sigmoid", norm_topk_prob=True)
    torch.testing.assert_close(one, torch.ones(T, 1))


def test_glu_is_swiglu_and_gpt_oss_clamped_quick_geglu():
    g = torch.Generator().manual_seed(8)
    gate, up = torch.randn(50, 6, generator=g) * 6, torch.randn(50, 6, generator=g) * 6
    torch.testing.assert_close(moe.glu(gate, up), torch.nn.functional.silu(gate) * up)
    # gpt-oss (HF GptOssExperts._apply_gate): gate clamped above at the limit, up to
    # [-limit, limit], (up + 1) x gate sigmoid(alpha gate), alpha 1.702.
    limit = 7.0
    cg, cu = gate.clamp(max=limit), up.clamp(-limit, limit)
    expected = (cu + 1) * (cg * torch.sigmoid(cg * 1.702))
    assert (gate > limit).any() and (up.abs() > limit).any()  # the clamps act here
    torch.testing.assert_close(moe.glu(gate, up, "quick_geglu", 1.0, limit), expected)
    with pytest.raises(ValueError, match="quick_geglu"):
        moe.glu(gate, up, "gelu")


def test_grouped_gemm_with_biases_and_the_clamped_activation():
    x, counts, w1, w2 = _mlp_inputs()
    g = torch.Generator().manual_seed(9)
    b1, b2 = torch.randn(4, w1.shape[-1], generator=g), torch.randn(4, 8, generator=g)
    kw = {"glu_linear_offset": 1.0, "clamp_value": 0.5}  # a small limit: the clamps act
    results = []
    for grouped in (True, False):
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2, b1, b2)]
        xs, a, b, c, d = leaves
        out = moe.grouped_mlp(xs, counts, a, b, "quick_geglu", grouped, b_fc1=c, b_fc2=d, **kw)
        (out * torch.arange(out.numel()).view_as(out).sin()).sum().backward()
        results.append([out.detach()] + [t.grad for t in leaves])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    start, expected = 0, []
    for e, c in enumerate(counts.tolist()):
        gate, up = (x[start : start + c] @ w1[e] + b1[e]).chunk(2, -1)
        expected.append(moe.glu(gate, up, "quick_geglu", **kw) @ w2[e] + b2[e])
        start += c
    torch.testing.assert_close(results[0][0], torch.cat(expected), rtol=1e-5, atol=1e-6)
    # An expert without tokens gets no bias gradient.
    assert results[0][4][1].abs().max() == 0 and results[0][5][1].abs().max() == 0


def test_fc2_bias_share_adds_the_bias_once_over_etp():
    bias = torch.arange(8.0).view(1, 8)
    shares = [moe.fc2_bias_share(bias.chunk(4, -1)[r], r, 4) for r in range(4)]
    assert torch.equal(sum(shares), bias) and shares[1].tolist() == [[0, 0, 2, 3, 0, 0, 0, 0]]


def test_aux_and_z_losses_match_the_papers_and_reach_the_router():
    logits = _logits(5)
    coeff = 0.01
    scores, routing_map = moe.routing_scores_for_aux_loss(logits, K, "softmax")
    # Switch Transformer (eq. 4, top-k as Megatron): E * sum_i f_i P_i, f_i the fraction
    # of the T k choices, P_i the mean router probability.
    p = torch.softmax(logits, -1)
    chosen = p.topk(K, -1).indices
    f = torch.stack([(chosen == i).sum() / (T * K) for i in range(E)])
    expected = coeff * E * (f * p.mean(0)).sum()
    torch.testing.assert_close(
        moe.switch_load_balancing_loss(scores, routing_map, K, coeff), expected
    )
    # Sequence-wise (DeepSeek-V3 eq. 17-20): the same per sequence, averaged over sequences.
    s, b = 6, 4
    per_seq = []
    for j in range(b):
        rows = torch.arange(T).view(s, b)[:, j]
        pj, cj = p[rows], chosen[rows]
        fj = torch.stack([(cj == i).sum() / (s * K) for i in range(E)])
        per_seq.append(coeff * E * (fj * pj.mean(0)).sum())
    torch.testing.assert_close(
        moe.sequence_load_balancing_loss(scores.view(s, b, E), routing_map.view(s, b, E), K, coeff),
        torch.stack(per_seq).mean(),
    )
    # ST-MoE's router z-loss: the mean of log(sum_j exp x_j) squared.
    z = torch.stack([torch.log(torch.exp(row).sum()) ** 2 for row in logits]).mean()
    torch.testing.assert_close(moe.z_loss(logits, 1e-3), 1e-3 * z)

    # Attached by the autoscaler: the router's gradient is the main loss's plus scale x the
    # aux loss's, the forward unchanged.
    x = torch.randn(T, 8)
    weight = torch.randn(E, 8, requires_grad=True)
    target = torch.randn(T, K)

    def losses(w):
        lg = x @ w.t()
        probs, _ = moe.topk_routing(lg, K)
        sc, rm = moe.routing_scores_for_aux_loss(lg, K, "softmax")
        return lg, probs, moe.switch_load_balancing_loss(sc, rm, K, coeff), moe.z_loss(lg, 1e-3)

    scale = 0.25  # 1 / 4 microbatches
    moe.MoEAuxLossAutoScaler.set_loss_scale(scale)
    try:
        lg, probs, aux, zl = losses(weight)
        lg2 = moe.MoEAuxLossAutoScaler.apply(lg, zl)
        assert torch.equal(lg2, lg)
        probs2, _ = moe.topk_routing(lg2, K)
        attached = moe.MoEAuxLossAutoScaler.apply(probs2, aux)
        ((attached * target).sum() * scale).backward()
        w = weight.detach().clone().requires_grad_()
        _, probs, aux, zl = losses(w)
        (((probs * target).sum() + aux + zl) * scale).backward()
        torch.testing.assert_close(weight.grad, w.grad)
        assert aux.item() > 0
    finally:
        moe.MoEAuxLossAutoScaler.set_loss_scale(1.0)


def test_expert_bias_moves_towards_equal_loads():
    bias = torch.tensor([0.0, 0.5, -0.5, 0.0])
    moe.update_expert_bias(bias, torch.tensor([10, 2, 4, 0]), 1e-3)  # mean 4
    torch.testing.assert_close(bias, torch.tensor([-1e-3, 0.5 + 1e-3, -0.5, 1e-3]))
