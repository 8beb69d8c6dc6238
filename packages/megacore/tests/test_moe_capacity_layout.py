"""Capacity drops decided over a layout (`megacore.moe.drop_over_capacity_in_layout`) keep
exactly the choices one process keeps, in real gloo groups under the NCCL checker: one
4-rank spawn holds a microbatch split as megatrain splits it (CP's balanced chunks by
`split_for_context_parallel`, then sequence parallelism's contiguous TP slices) at tp 2,
cp 2, tp 2 x cp 2, tp 4 and cp 4, under both drop policies, with weights rounded so that
many tie (the tie goes to the earlier token in one process's order).  The per-rank
decision (`drop_over_capacity` on a rank's own tokens) is checked to differ, so the case
is one where the layout matters."""

import torch

from megacore import moe
from megacore import parallel_state as ps
from megacore.context_parallel import split_for_context_parallel
from megacore.testing import run_distributed

E, K, S, B = 4, 2, 16, 3  # experts, top-k, sequence, batch
FACTOR = 1.0
LAYOUTS = [(2, 1), (1, 2), (2, 2), (4, 1), (1, 4)]  # (tp, cp) on 4 ranks
POLICIES = ("probs", "position")


def _microbatch():
    """[s, b, k] weights and expert ids, the same on every rank: the router's top-k of a
    skewed softmax (so experts overflow), weights rounded to 1/16 (ties)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(S, B, E, generator=g) + torch.tensor([1.5, 0.5, 0.0, -1.0])
    probs, indices = logits.softmax(-1).topk(K, dim=-1)
    return (probs * 16).round() / 16, indices


def _mine(t: torch.Tensor, tp: int, cp: int) -> torch.Tensor:
    """This rank's [s_local x b, k] rows of a [s, b, k] tensor, as the model holds them."""
    t = split_for_context_parallel(t, 0, ps.get_context_parallel_rank(), cp)
    t = t.chunk(tp, dim=0)[ps.get_tensor_model_parallel_rank()]
    return t.reshape(-1, K)


def _check_layouts():
    probs, indices = _microbatch()
    results = {}
    for tp, cp in LAYOUTS:
        ps.initialize_model_parallel(tp, context_parallel_size=cp)
        try:
            layout = moe.token_layout(sequence_parallel=True)
            assert (layout.tp, layout.cp) == (tp, cp)
            local_probs, local_indices = _mine(probs, tp, cp), _mine(indices, tp, cp)
            for policy in POLICIES:
                whole = moe.drop_over_capacity(
                    probs.reshape(-1, K), indices.reshape(-1, K), E, FACTOR, policy
                ).view(S, B, K)
                kept = moe.drop_over_capacity_in_layout(
                    local_probs, local_indices, E, FACTOR, policy, layout, B
                )
                per_rank = moe.drop_over_capacity(local_probs, local_indices, E, FACTOR, policy)
                results[tp, cp, policy] = {
                    "same": torch.equal(kept, _mine(whole, tp, cp)),
                    "dtype": kept.dtype == local_indices.dtype,
                    "dropped": int((whole == moe.DROPPED).sum()),
                    "per_rank_differs": not torch.equal(per_rank, _mine(whole, tp, cp)),
                }
            # Without sequence parallelism the TP ranks hold the same tokens: CP alone.
            alone = moe.token_layout(sequence_parallel=False)
            results[tp, cp, "no-sp"] = None if alone is None else (alone.tp, alone.cp)
        finally:
            ps.destroy_model_parallel()
    return results


def test_drops_over_a_layout_are_one_processes():
    per_rank = run_distributed(_check_layouts, 4, timeout=120)
    for tp, cp in LAYOUTS:
        for policy in POLICIES:
            seen = [r[tp, cp, policy] for r in per_rank]
            assert all(s["same"] and s["dtype"] for s in seen), (tp, cp, policy, seen)
            assert seen[0]["dropped"] > 0, (tp, cp, policy)  # the case is there
            # Deciding per rank drops other choices on some rank: the layout matters.
            assert any(s["per_rank_differs"] for s in seen), (tp, cp, policy)
        assert all(r[tp, cp, "no-sp"] == (None if cp == 1 else (1, cp)) for r in per_rank)


def test_the_token_order_is_the_balanced_split():
    # Rank (c, t) of tp 2 x cp 2, s_local 2, b 2: CP rank c holds chunks c and 3 - c of
    # 8 positions (two each), TP rank t the t-th of those chunks.
    layout = moe.TokenLayout(None, 0, 2, 2)
    order = layout.token_order(2, 2, "cpu").view(4, 2, 2)
    positions = order // 2
    assert positions[:, :, 0].tolist() == [[0, 1], [6, 7], [2, 3], [4, 5]]
    assert torch.equal(order % 2, torch.tensor([0, 1]).expand(4, 2, 2))
    assert sorted(order.reshape(-1).tolist()) == list(range(16))
