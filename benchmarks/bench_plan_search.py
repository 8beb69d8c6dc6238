"""How long `megatrain plan` searches, in one process and over worker processes.

    python benchmarks/bench_plan_search.py                      # DeepSeek-V3, 256 H100s, tp 1
    python benchmarks/bench_plan_search.py --fix none           # the whole search (minutes)
    python benchmarks/bench_plan_search.py --workers 1 4 16 --out bench-results/plan_search.json

Times `megatrain.plan.search.plan` on a shipped config (default deepseek-v3.toml, the largest
search the shipped configs make) at each `--workers` count (default 1 and every CPU this process
may use), the splits limited by `--fix` as `megatrain plan --fix` does (default tp=1: about a
sixth of the layouts, a minute in one process on 2 cores).  Reported per count: seconds, layouts
weighed per second, the speedup over the first count, and whether the result (the ranking with
its times and memory, the refusals with their examples, the layouts counted) equals the first
count's; the load average beside it (other work on the machine slows every count).
"""

import argparse
import json
import os
import platform
import time
from pathlib import Path

from megatrain.config import load_config
from megatrain.plan import hardware, search

ROOT = Path(__file__).resolve().parents[1]


def _outcome(result: search.Plan) -> tuple:
    return (
        [(e.layout, e.time, e.memory) for e in result.ranked],
        result.rejected,
        result.enumerated,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "pipelines/models/deepseek-v3.toml"))
    parser.add_argument("--gpus", type=int, default=256)
    parser.add_argument("--gpu", default="h100-80gb")
    parser.add_argument(
        "--fix", nargs="*", default=["tp=1"], help="NAME=VALUE splits ('none': the whole search)"
    )
    parser.add_argument("--workers", type=int, nargs="*", default=None)
    parser.add_argument("--out", default="benchmarks/results/plan-search.json")
    args = parser.parse_args()
    fixed = search.parse_fixed([] if args.fix == ["none"] else args.fix)
    workers = args.workers or sorted({1, search.search_workers()})
    config = load_config(args.config, [])
    gpu = hardware.job_gpu(args.gpus, args.gpu, None, None, None)
    profile = hardware.gpu_profile(gpu)
    rows, first = [], None
    for count in workers:
        load = os.getloadavg()
        started = time.perf_counter()
        result = search.plan(
            config, args.gpus, gpu, profile, config.model.vocab_size, fixed=fixed, workers=count
        )
        seconds = time.perf_counter() - started
        outcome = _outcome(result)
        first = first or (seconds, outcome)
        rows.append({
            "workers": count,
            "seconds": seconds,
            "layouts": result.enumerated,
            "fit": len(result.ranked),
            "layouts_per_s": result.enumerated / seconds,
            "speedup": first[0] / seconds,
            "same_result_as_first": outcome == first[1],
            "load_average_before": load,
            "first": result.ranked[0].layout.describe() if result.ranked else None,
        })  # fmt: skip
        row = rows[-1]
        print(
            f"workers {count:>3}: {seconds:7.1f} s, {row['layouts']:,} layouts "
            f"({row['layouts_per_s']:,.0f}/s), x{row['speedup']:.2f}, same result: "
            f"{row['same_result_as_first']}, load {load[0]:.2f}"
        )
    record = {
        "benchmark": "plan-search",
        "config": os.path.relpath(args.config, ROOT),
        "gpus": args.gpus,
        "gpu": args.gpu,
        "fixed": fixed,
        "cpus": search.search_workers(),
        "machine": platform.processor() or platform.machine(),
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    if not all(row["same_result_as_first"] for row in rows):
        raise SystemExit("bench_plan_search: a worker count ranked differently from the first")


if __name__ == "__main__":
    main()
