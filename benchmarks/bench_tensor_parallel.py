"""Tensor-parallel throughput: a transformer MLP block and the vocabulary-parallel loss.

    python benchmarks/bench_tensor_parallel.py --out bench-results/tensor_parallel.json

Runs the paper's MLP (column- then row-parallel, Fig. 3a) forward+backward at
each TP size that fits the machine, on gloo (CPU) or NCCL (GPU, --backend nccl),
and `vocab_parallel_cross_entropy` against `torch.nn.functional.cross_entropy`
at TP=1, then the output layer with it: `F.linear` and the loss against the fused
`linear_vocab_parallel_cross_entropy`.  Writes one JSON record with the timings and
the machine they came from.
"""

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megacore import parallel_state, tensor_parallel
from megacore.testing import run_distributed


def _timed(step, device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def _mlp_rank(tp_size, hidden, seq, batch, warmup, iters):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    device = torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")
    tensor_parallel.model_parallel_manual_seed(0)
    fc1 = tensor_parallel.ColumnParallelLinear(hidden, 4 * hidden, device=device)
    fc2 = tensor_parallel.RowParallelLinear(
        4 * hidden, hidden, input_is_parallel=True, device=device
    )
    x = torch.randn(seq, batch, hidden, device=device, requires_grad=True)

    def step():
        h, _ = fc1(x)
        y, _ = fc2(F.gelu(h))
        y.sum().backward()

    seconds = _timed(step, device, warmup, iters)
    parallel_state.destroy_model_parallel()
    flops = 3 * 2 * 2 * seq * batch * hidden * 4 * hidden  # fwd + 2x bwd, two matmuls
    return {
        "tp": tp_size,
        "ms_per_step": seconds * 1e3,
        "tflops_per_rank": flops / tp_size / seconds / 1e12,
    }


def _cross_entropy_rank(tokens, vocab, hidden, warmup, iters):
    parallel_state.initialize_model_parallel()
    device = torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")
    logits = torch.randn(tokens, vocab, device=device, requires_grad=True)
    target = torch.randint(0, vocab, (tokens,), device=device)
    ours = _timed(
        lambda: tensor_parallel.vocab_parallel_cross_entropy(logits, target).mean().backward(),
        device,
        warmup,
        iters,
    )
    torch_ce = _timed(lambda: F.cross_entropy(logits, target).backward(), device, warmup, iters)
    # The output layer and the loss, forward and backward: F.linear then the loss above, and
    # the fused op (training.fused_linear_cross_entropy), which never holds the logits.
    x = torch.randn(tokens, hidden, device=device, requires_grad=True)
    weight = (torch.randn(vocab, hidden, device=device) * 0.02).requires_grad_(True)

    def unfused():
        loss = tensor_parallel.vocab_parallel_cross_entropy(F.linear(x, weight), target)
        loss.mean().backward()

    def fused():
        tensor_parallel.linear_vocab_parallel_cross_entropy(x, weight, target).backward()

    linear_unfused = _timed(unfused, device, warmup, iters)
    linear_fused = _timed(fused, device, warmup, iters)
    parallel_state.destroy_model_parallel()
    return {
        "tokens": tokens,
        "vocab": vocab,
        "ours_ms": ours * 1e3,
        "torch_ms": torch_ce * 1e3,
        "with_output_layer": {
            "hidden": hidden,
            "unfused_ms": linear_unfused * 1e3,
            "fused_ms": linear_fused * 1e3,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/tensor_parallel.json"))
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()

    devices = torch.cuda.device_count() if args.backend == "nccl" else len(os.sched_getaffinity(0))
    sizes = [s for s in (1, 2, 4, 8) if s <= max(devices, 1)]
    shape = (args.hidden, args.seq, args.batch, 1, args.iters)
    mlp = [
        run_distributed(_mlp_rank, s, (s, *shape), backend=args.backend, timeout=600)[0]
        for s in sizes
    ]
    ce = run_distributed(
        _cross_entropy_rank,
        1,
        (args.seq * args.batch, args.vocab, args.hidden, 1, args.iters),
        backend=args.backend,
        timeout=600,
    )[0]
    record = {
        "benchmark": "tensor_parallel",
        "machine": {
            "platform": platform.platform(),
            "cpus": len(os.sched_getaffinity(0)),
            "gpu": torch.cuda.get_device_name() if args.backend == "nccl" else None,
            "torch": torch.__version__,
            "backend": args.backend,
        },
        "mlp": {"hidden": args.hidden, "seq": args.seq, "batch": args.batch, "by_tp": mlp},
        "cross_entropy_tp1": ce,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
