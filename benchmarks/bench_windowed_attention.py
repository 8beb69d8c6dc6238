"""Sliding-window attention's cost against the sequence length at a fixed window, on the CPU.

    python benchmarks/bench_windowed_attention.py --out bench-results/windowed_attention.json

The attention core of one sliding layer (`models.attention.core.attend` with a window, as a
gpt-oss sliding layer calls it: grouped-query heads, with sinks), forward and backward, at
sequence 1k to 8k with the window fixed (128, gpt-oss's): the blocked path
(`core.windowed_attention`: blocks of queries in one kernel call, each against only the keys
its window reaches) should grow about linearly, where the s x s mask that SDPA would otherwise
take (timed beside it up to `--dense-max`) grows with s^2.  Reported per length: the median
of `--repeats` timings, and each path's time over the first length's (linear: the length's
ratio).  On CUDA the sliding layers use FlexAttention's block mask instead (`bench_gpu.py`).
"""

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from megacore.attention_kernels import attention_with_sinks
from megatrain.models.attention.core import attend, windowed_attention
from megatrain.models.attention.inputs import AttentionInputs
from megatrain.models.attention.masks import causal_mask


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dense-max", type=int, default=4096, help="longest s x s mask timed")
    parser.add_argument("--out", type=Path, default=Path("bench-results/windowed_attention.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    sinks = torch.randn(args.heads, requires_grad=True)
    rows = []
    for s in args.seqs:
        q = torch.randn(1, args.heads, s, args.head_dim, requires_grad=True)
        k, v = (torch.randn(1, args.groups, s, args.head_dim, requires_grad=True) for _ in "kv")
        inputs = AttentionInputs(seq_len=s)

        def blocked(q=q, k=k, v=v, inputs=inputs):
            out = attend(q, k, v, inputs, causal=True, dropout_p=0.0, tp_size=1,
                         context_parallel=None, window=args.window, sinks=sinks)  # fmt: skip
            out.sum().backward()

        def dense(q=q, k=k, v=v, s=s):
            mask = causal_mask(s, args.window, q.device)
            attention_with_sinks(q, k, v, sinks, mask=mask).sum().backward()

        assert torch.allclose(
            windowed_attention(q, k, v, args.window, None, sinks),
            attention_with_sinks(q, k, v, sinks, mask=causal_mask(s, args.window, q.device)),
            atol=1e-5,
        )
        blocked()  # warm-up
        row = {"seq": s, "blocked_s": timed(blocked, args.repeats)}
        if s <= args.dense_max:
            dense()
            row["dense_mask_s"] = timed(dense, args.repeats)
        rows.append(row)
        print(json.dumps(row), flush=True)
    first = rows[0]
    for row in rows:
        row["length_ratio"] = row["seq"] / first["seq"]
        row["blocked_ratio"] = row["blocked_s"] / first["blocked_s"]
        if "dense_mask_s" in row:
            row["dense_ratio"] = row["dense_mask_s"] / first["dense_mask_s"]
    result = {
        "what": "one sliding layer's attention core (GQA, sinks), forward + backward, fp32 CPU",
        "window": args.window, "heads": args.heads, "groups": args.groups,
        "head_dim": args.head_dim, "threads": torch.get_num_threads(),
        "load_average": os.getloadavg(), "rows": rows,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
