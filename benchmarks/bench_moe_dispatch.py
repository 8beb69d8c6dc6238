"""Tokens the MoE all-to-all sends to other expert-parallel ranks, with and without
model.moe_group_limited_dispatch, at DeepSeek-V3's routing shape.

    python benchmarks/bench_moe_dispatch.py --out bench-results/moe_dispatch.json

A pure count, no training: 256 experts in 8 groups, top 8, group-limited to 4 groups
(sigmoid scores with a correction bias, groups ranked by their top-2 sum, as HF's
DeepSeek-V3), over ep 8 ranks (so each rank holds one group, 32 experts), on router
scores random but skewed: every expert has a popularity of its own (a log-normal-ish
offset on its logit) and every token leans towards a few groups (an offset per token and
group), as trained routers do.  Tokens are spread evenly over the ranks; a token's own
rank is where it sits.

For each way of routing (top 8 of all 256 experts; group-limited top 8) and of sending
(megacore's `AllToAllDispatcher`: a row for every (token, chosen expert) on another rank;
`PerRankAllToAllDispatcher`: a row for every (token, other rank holding one of its
experts)), the rows a rank sends on the dispatch (the combine sends as many back), the
ranks a token reaches (mean, max), and the bytes in bf16 at DeepSeek-V3's hidden 7168 (a
per-rank row also carries its k expert ids, int64, and k weights, fp32).
moe_group_limited_dispatch is the last: group-limited routing, sent per rank.  The routing
is megacore's own `topk_routing`, the rows counted as the dispatchers count them.
"""

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from megacore.moe import topk_routing

E, GROUPS, GROUP_TOPK, K, EP = 256, 8, 4, 8, 8
HIDDEN, BF16 = 7168, 2
ROW_EXTRA = K * (8 + 4)  # a per-rank row's expert ids (int64) and weights (fp32)


def skewed_logits(tokens: int, seed: int, expert_skew: float, group_lean: float):
    """[tokens, E] router logits: noise, plus each expert's popularity, plus each token's
    lean towards some groups (per token and group, shared by the group's experts)."""
    g = torch.Generator().manual_seed(seed)
    popularity = torch.randn(E, generator=g) * expert_skew
    lean = torch.randn(tokens, GROUPS, generator=g) * group_lean
    noise = torch.randn(tokens, E, generator=g)
    return noise + popularity + lean.repeat_interleave(E // GROUPS, dim=1)


def counts(indices: torch.Tensor, source: torch.Tensor) -> dict:
    """What the two dispatchers send for tokens routed to `indices` [T, k] from ranks
    `source` [T]: rows per (token, remote expert) and per (token, remote rank)."""
    T = indices.shape[0]
    rank_of = indices // (E // EP)
    remote_choices = (rank_of != source[:, None]).sum().item()
    goes = torch.zeros(T, EP, dtype=torch.bool).scatter(1, rank_of, True)
    reached = goes.sum(1)
    goes[torch.arange(T), source] = False  # a token's own rank costs no transfer
    remote_ranks = goes.sum().item()
    return {
        "per_choice_rows": remote_choices,
        "per_rank_rows": remote_ranks,
        "ranks_reached_mean": reached.float().mean().item(),
        "ranks_reached_max": reached.max().item(),
    }


def measure(tokens_per_rank: int, seed: int, expert_skew: float, group_lean: float) -> dict:
    T = tokens_per_rank * EP
    logits = skewed_logits(T, seed, expert_skew, group_lean)
    bias = torch.randn(E, generator=torch.Generator().manual_seed(seed + 1)) * 0.05
    source = torch.arange(T) // tokens_per_rank
    route = {"score_function": "sigmoid", "expert_bias": bias}
    grouped = {"num_groups": GROUPS, "group_topk": GROUP_TOPK, "group_score_topk": 2}
    _, free = topk_routing(logits, K, **route)
    _, limited = topk_routing(logits, K, **route, **grouped)
    c_free, c_limited = counts(free, source), counts(limited, source)
    dense_row = HIDDEN * BF16
    per_rank_row = dense_row + ROW_EXTRA
    rows_of = {
        "top8_per_choice": c_free["per_choice_rows"],
        "top8_per_rank": c_free["per_rank_rows"],
        "group_limited_per_choice": c_limited["per_choice_rows"],
        "group_limited_per_rank": c_limited["per_rank_rows"],
    }
    ways = {
        name: rows * (per_rank_row if name.endswith("per_rank") else dense_row)
        for name, rows in rows_of.items()
    }
    baseline = ways["top8_per_choice"]
    return {
        "tokens_per_rank": tokens_per_rank,
        "seed": seed,
        "expert_skew": expert_skew,
        "group_lean": group_lean,
        "top8": c_free,
        "group_limited": c_limited,
        "dispatch_per_rank": {
            name: {
                "rows": rows_of[name] / EP,
                "mb": nbytes / EP / 2**20,
                "fraction_of_top8_per_choice": nbytes / baseline,
            }
            for name, nbytes in ways.items()
        },
        "saving_of_moe_group_limited_dispatch": 1 - ways["group_limited_per_rank"] / baseline,
        "saving_against_group_limited_per_choice": (
            1 - ways["group_limited_per_rank"] / ways["group_limited_per_choice"]
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-results/moe_dispatch.json")
    parser.add_argument("--tokens-per-rank", type=int, default=4096)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    started = time.perf_counter()
    rows = [
        measure(args.tokens_per_rank, seed, skew, lean)
        for skew, lean in ((0.0, 0.0), (0.5, 1.0), (1.0, 2.0))
        for seed in range(args.seeds)
    ]
    record = {
        "benchmark": "moe_dispatch",
        "host": platform.node(),
        "shape": {
            "experts": E,
            "groups": GROUPS,
            "group_topk": GROUP_TOPK,
            "topk": K,
            "ep": EP,
            "hidden": HIDDEN,
            "dtype": "bf16",
        },
        "method": __doc__.split("\n\n", 2)[2],
        "rows": rows,
        "seconds": time.perf_counter() - started,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    for r in rows:
        print(
            f"skew {r['expert_skew']} lean {r['group_lean']} seed {r['seed']}: "
            + ", ".join(
                f"{name} {v['mb']:.1f} MB ({v['fraction_of_top8_per_choice']:.2f})"
                for name, v in r["dispatch_per_rank"].items()
            )
            + f"; ranks a token reaches: top8 {r['top8']['ranks_reached_mean']:.2f}"
            f" (max {r['top8']['ranks_reached_max']}), group-limited"
            f" {r['group_limited']['ranks_reached_mean']:.2f}"
            f" (max {r['group_limited']['ranks_reached_max']})"
        )
    print(f"wrote {out} in {record['seconds']:.1f} s")


if __name__ == "__main__":
    main()
