"""Fully sharded data parallelism (FSDP2) beside the distributed optimizer on the CPU: time
per training step of the same GPT at dp 2, each sharding, and the ratio.

    python benchmarks/bench_fsdp.py --out benchmarks/results/fsdp-cpu.json

Each sharding trains the same model on the same batches (one warm-up step, then
`--steps` timed ones, the slowest rank's time); "full" gathers every layer's parameters
before its forward (and again before its backward under ZeRO-3) and reduce-scatters the
gradients once a step; "optimizer" reduce-scatters the gradients and all-gathers the
updated parameters once a step; "none" all-reduces the gradients.  On gloo over two cores
this measures the extra collectives' host cost, not a GPU's overlap.  The NCCL-rules checker
is off (it waits for every peer's match, which is right for the tests and wrong for timing).
"""

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megacore import parallel_state as ps
from megacore.testing import run_distributed
from megatrain.config import load_config
from megatrain.run.distributed import init_distributed
from megatrain.run.setup import build_run
from megatrain.run.step import train_step
from megatrain.testing import write_counting_corpus

VOCAB = 512
SHARDINGS = {
    "none": [],
    "optimizer": ['parallel.data_parallel_sharding="optimizer"'],
    "full": ['parallel.data_parallel_sharding="full"'],
    "full-zero2": [
        'parallel.data_parallel_sharding="full"',
        "parallel.reshard_after_forward=false",
    ],
}


def _overrides(args, corpus: str, out: str) -> list[str]:
    return [
        f"data.corpus={corpus!r}",
        f"training.output_dir={out!r}",
        f"model.num_layers={args.layers}",
        f"model.hidden_size={args.hidden}",
        "model.num_attention_heads=8",
        f"model.max_position_embeddings={args.seq}",
        f"training.seq_length={args.seq}",
        f"training.micro_batch_size={args.micro_batch}",
        f"training.global_batch_size={args.micro_batch * 2 * args.microbatches}",
        f"training.precision={args.precision!r}",
        "training.train_iters=1000",
        "logging.tensorboard=false",
    ]


def _measure(overrides: list[str], steps: int) -> float:
    device, _ = init_distributed(600)
    run = build_run(load_config(None, overrides), device)
    try:
        train_step(run)  # warm-up: FSDP's lazy init, the allocator, the data
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            train_step(run)
        elapsed = torch.tensor([(time.perf_counter() - start) / steps])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed)
    finally:
        ps.destroy_model_parallel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=1, help="per rank and step")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        corpus = str(write_counting_corpus(Path(tmp), VOCAB))
        for name, extra in SHARDINGS.items():
            overrides = [*_overrides(args, corpus, f"{tmp}/{name}"), *extra]
            seconds = run_distributed(
                _measure, 2, (overrides, args.steps), timeout=1200, nccl_rules=False
            )[0]
            rows[name] = {"ms_per_step": round(seconds * 1000, 2)}
            print(f"{name:12s} {seconds * 1000:8.1f} ms/step", flush=True)
    base = rows["optimizer"]["ms_per_step"]
    for row in rows.values():
        row["vs_optimizer"] = round(row["ms_per_step"] / base, 3)
    result = {
        "benchmark": "fsdp-cpu",
        "dp": 2,
        "args": vars(args),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpus": len(os.sched_getaffinity(0)),
        "results": rows,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
