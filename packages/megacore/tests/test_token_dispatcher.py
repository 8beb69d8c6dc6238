"""Expert-parallel token dispatch against one process, in real gloo groups under the NCCL
checker: one 4-rank spawn runs every layout and the three dispatchers (all-to-all, all-gather,
all-to-all once per rank) on experts with biases on both GEMMs (fc1's split with its columns
over ETP, fc2's shared out over h), and checks the expert getters, the rows the per-rank
dispatch sends, and the checker's all-to-all rule on the way."""

import torch
import torch.distributed as dist

from megacore import parallel_state as ps
from megacore.moe import DROPPED, LocalDispatcher, fc1_shard, fc2_bias_share, grouped_mlp
from megacore.moe.token_dispatcher import (
    AllGatherDispatcher,
    AllToAllDispatcher,
    PerRankAllToAllDispatcher,
    build_token_dispatcher,
)
from megacore.testing import NCCLSemanticsError, run_distributed

E, K, H, F = 8, 2, 8, 6  # experts, top-k, hidden, expert ffn
WORLD = 4
LAYOUTS = [(1, 4, None), (2, 2, 1), (2, 2, None), (1, 2, 2)]  # (tp, ep, etp)
KINDS = ("alltoall", "allgather", "per_rank")


def _data(drop: bool):
    """Every rank's tokens (uneven counts), routing, weights and upstream gradient."""
    g = torch.Generator().manual_seed(7)
    ranks = []
    for r in range(WORLD):
        t = 3 + 2 * r
        scores = torch.randn(t, E, generator=g).softmax(-1)
        probs, indices = scores.topk(K, dim=-1)
        if drop:  # a capacity's drops: some choices go to no expert
            indices = torch.where(torch.rand(t, K, generator=g) < 0.3, DROPPED, indices)
        ranks.append(
            (torch.randn(t, H, generator=g), probs, indices, torch.randn(t, H, generator=g))
        )
    w1 = torch.randn(E, H, 2 * F, generator=g) * 0.3
    w2 = torch.randn(E, F, H, generator=g) * 0.3
    b1, b2 = torch.randn(E, 2 * F, generator=g), torch.randn(E, H, generator=g)
    return ranks, (w1, w2, b1, b2)


def _leaf(t):
    return t.clone().requires_grad_(True)


def _one_process(drop: bool):
    ranks, weights = _data(drop)
    w1, w2, b1, b2 = (_leaf(w) for w in weights)
    outs, grads = [], []
    for hidden, probs, indices, upstream in ranks:
        hidden, probs = _leaf(hidden), _leaf(probs)
        d = LocalDispatcher(E, dropless=not drop)
        x, counts = d.dispatch(hidden, probs, indices)
        out = d.combine(grouped_mlp(x, counts, w1, w2, grouped=False, b_fc1=b1, b_fc2=b2))
        (out * upstream).sum().backward()
        outs.append(out.detach())
        grads.append((hidden.grad, probs.grad))
    return outs, grads, (w1.grad, w2.grad, b1.grad, b2.grad)


def _layout_result(kind: str, drop: bool, reference):
    outs, grads, (w1_grad, w2_grad, b1_grad, b2_grad) = reference
    rank = dist.get_rank()
    ranks, (w1, w2, b1, b2) = _data(drop)
    hidden, probs, indices, upstream = ranks[rank]
    hidden, probs = _leaf(hidden), _leaf(probs)
    ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    etp, etp_rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    mine = slice(ep_rank * E // ep, (ep_rank + 1) * E // ep)
    w1_local = _leaf(fc1_shard(w1[mine], etp_rank, etp, swiglu=True))
    w2_local = _leaf(w2[mine].chunk(etp, dim=1)[etp_rank])
    b1_local = _leaf(fc1_shard(b1[mine], etp_rank, etp, swiglu=True))
    b2_local = _leaf(b2[mine].chunk(etp, dim=1)[etp_rank])  # h's columns shared out over ETP
    if kind == "alltoall":
        d = AllToAllDispatcher(E, dropless=not drop)
    elif kind == "allgather":
        d = AllGatherDispatcher(E)
    else:
        d = PerRankAllToAllDispatcher(E)
    x, counts = d.dispatch(hidden, probs, indices)
    b2_share = fc2_bias_share(b2_local, etp_rank, etp)
    y = grouped_mlp(x, counts, w1_local, w2_local, grouped=False, b_fc1=b1_local, b_fc2=b2_share)
    out = d.combine(y)
    (out * upstream).sum().backward()
    # Expert weights are replicated over expert-data-parallel ranks: their gradients sum there.
    local = (w1_local, w2_local, b1_local, b2_local)
    for w in local:
        dist.all_reduce(w.grad, group=ps.get_expert_data_parallel_group())
    want = (
        fc1_shard(w1_grad[mine], etp_rank, etp, swiglu=True),
        w2_grad[mine].chunk(etp, dim=1)[etp_rank],
        fc1_shard(b1_grad[mine], etp_rank, etp, swiglu=True),
        b2_grad[mine].chunk(etp, dim=1)[etp_rank],
    )
    names = ("w1_grad", "w2_grad", "b1_grad", "b2_grad")
    grad_error = {
        name: (w.grad - ref).abs().max().item()
        for name, w, ref in zip(names, local, want, strict=True)
    }
    # Rows this rank sends over EP: one per (token, choice) off the per-rank dispatcher, one per
    # (token, destination rank) on it.
    sent = sum(d.input_splits) if kind != "allgather" else None
    return {
        "out": (out.detach() - outs[rank]).abs().max().item(),
        "hidden_grad": (hidden.grad - grads[rank][0]).abs().max().item(),
        "probs_grad": (probs.grad - grads[rank][1]).abs().max().item(),
        **grad_error,
        "tokens": int(counts.sum()),
        "sent": sent,
        "pairs": _rank_pairs(indices, ep),
    }


def _rank_pairs(indices, ep):
    """(token, EP rank) pairs the routing `indices` makes: the rows the per-rank dispatch sends."""
    ranks = {(t, e // (E // ep)) for t, row in enumerate(indices.tolist()) for e in row if e >= 0}
    return len(ranks)


def _ranks(group):
    return dist.get_process_group_ranks(group)


def _dispatch_everywhere():
    references = {drop: _one_process(drop) for drop in (False, True)}
    out = {"layouts": {}, "groups": {}}
    for tp, ep, etp in LAYOUTS:
        ps.initialize_model_parallel(
            tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
        )
        out["groups"][tp, ep, etp] = {
            "ep": (_ranks(ps.get_expert_model_parallel_group()),
                   ps.get_expert_model_parallel_rank()),
            "etp": (_ranks(ps.get_expert_tensor_parallel_group()),
                    ps.get_expert_tensor_parallel_world_size()),
            "edp": (_ranks(ps.get_expert_data_parallel_group()),
                    ps.get_expert_data_parallel_rank()),
            "etp_ep": _ranks(ps.get_expert_tensor_and_model_parallel_group()),
            "factory": type(build_token_dispatcher(E, "allgather")).__name__,
        }  # fmt: skip
        for kind in KINDS:
            for drop in (False, True):
                result = _layout_result(kind, drop, references[drop])
                out["layouts"][tp, ep, etp, kind, drop] = result
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(1)
    out["factory_one"] = type(build_token_dispatcher(E)).__name__
    ps.destroy_model_parallel()
    # The checker: rank 0 sends rank 1 two rows where rank 1 expects one.
    rank = dist.get_rank()
    send = [2 if (rank, q) == (0, 1) else 1 for q in range(WORLD)]
    try:
        dist.all_to_all_single(torch.zeros(WORLD), torch.zeros(sum(send)), None, send)
        out["mismatch"] = None
    except NCCLSemanticsError as e:
        out["mismatch"] = str(e)
    return out


def test_dispatchers_equal_one_process():
    results = run_distributed(_dispatch_everywhere, world_size=WORLD, timeout=240)
    for rank, out in enumerate(results):
        for layout, r in out["layouts"].items():
            for name in ("out", "hidden_grad", "probs_grad", "w1_grad", "w2_grad", "b1_grad",
                         "b2_grad"):  # fmt: skip
                assert r[name] < 1e-5, (rank, layout, name, r[name])
        groups = out["groups"]
        assert groups[1, 4, None]["ep"] == ([0, 1, 2, 3], rank)
        assert groups[2, 2, 1]["ep"][0] == [rank - rank % 2, rank - rank % 2 + 1]
        assert groups[2, 2, 1]["edp"] == ([rank % 2, rank % 2 + 2], rank // 2)
        assert groups[2, 2, None]["etp"] == ([rank - rank % 2, rank - rank % 2 + 1], 2)
        assert groups[2, 2, None]["ep"][0] == [rank % 2, rank % 2 + 2]
        assert groups[2, 2, None]["etp_ep"] == [0, 1, 2, 3]
        assert {g["factory"] for g in groups.values()} == {"AllGatherDispatcher"}
        assert out["factory_one"] == "LocalDispatcher"
        assert "rank 0 sends rank 1 2 rows" in out["mismatch"], out["mismatch"]
        assert "rank 1 expects 1" in out["mismatch"]
    # Dropped choices reach no expert: fewer tokens than without drops, summed over ranks.
    for layout in LAYOUTS:
        kept = sum(out["layouts"][(*layout, "alltoall", True)]["tokens"] for out in results)
        full = sum(out["layouts"][(*layout, "alltoall", False)]["tokens"] for out in results)
        etp = layout[0] if layout[2] is None else layout[2]
        assert full == etp * K * sum(3 + 2 * r for r in range(WORLD))
        assert kept < full
    # The per-rank dispatch sends each token once to each rank of its experts, no more.
    for out in results:
        for layout in LAYOUTS:
            for drop in (False, True):
                per_rank = out["layouts"][(*layout, "per_rank", drop)]
                assert per_rank["sent"] == per_rank["pairs"], (layout, drop)
                assert per_rank["sent"] <= out["layouts"][(*layout, "alltoall", drop)]["sent"]
    assert sum(o["layouts"][(1, 4, None, "per_rank", False)]["sent"] for o in results) < sum(
        o["layouts"][(1, 4, None, "alltoall", False)]["sent"] for o in results
    )
