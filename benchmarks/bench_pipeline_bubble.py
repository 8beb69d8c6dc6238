"""Pipeline bubble of 1F1B and interleaved 1F1B, measured beside the theory.

    python benchmarks/bench_pipeline_bubble.py --out bench-results/pipeline_bubble.json

Every layer does the same work (a fixed forward and backward time, slept so
that ranks sharing CPU cores do not slow each other), so the time a rank spends
beyond its own compute is the schedule's bubble.  Bubble fraction =
(measured time - ideal time) / ideal time, where ideal = m x layers per rank x
(forward + backward time).  Theory: (p - 1) / m for 1F1B and (p - 1) / (v m)
interleaved.  The steps really run the schedules and p2p of megacore.
"""

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from megacore import parallel_state as ps
from megacore.pipeline_parallel import get_forward_backward_func
from megacore.testing import run_distributed


class _FixedWork(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class _Chunk(nn.Module):
    def __init__(self, layers: int, forward_s: float, backward_s: float):
        super().__init__()
        self.layers, self.forward_s, self.backward_s = layers, forward_s, backward_s
        self.input_tensor = None

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def forward(self, data):
        x = data if ps.is_pipeline_first_stage() else self.input_tensor
        for _ in range(self.layers):
            x = _FixedWork.apply(x, self.forward_s, self.backward_s)
        return x


def _forward_step(data_iterator, model):
    out = model(next(data_iterator))
    return out, lambda o: (o.sum(), {})


def _measure(pp, vpp, microbatches, layers, forward_s, backward_s, repeats):
    ps.initialize_model_parallel(1, pp, vpp)
    chunks = vpp or 1
    per_chunk = layers // (pp * chunks)
    model = [_Chunk(per_chunk, forward_s, backward_s) for _ in range(chunks)]
    shape = (4, 1, 8)
    best = float("inf")
    for _ in range(repeats):
        data = [torch.randn(shape, requires_grad=True) for _ in range(microbatches)]
        dist.barrier()
        start = time.perf_counter()
        get_forward_backward_func()(
            forward_step_func=_forward_step,
            data_iterator=[iter(data) for _ in model] if vpp else iter(data),
            model=model if vpp else model[0],
            num_microbatches=microbatches,
            seq_length=shape[0],
            micro_batch_size=shape[1],
            hidden_size=shape[2],
        )
        dist.barrier()
        best = min(best, time.perf_counter() - start)
    ps.destroy_model_parallel()
    ideal = microbatches * (layers // pp) * (forward_s + backward_s)
    return {"seconds": best, "ideal_seconds": ideal, "bubble": (best - ideal) / ideal}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/pipeline_bubble.json"))
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--vpp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--forward-ms", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    f, b = args.forward_ms / 1e3, 2 * args.forward_ms / 1e3  # backward costs twice the forward
    rows = []
    for m in args.microbatches:
        for name, vpp in (("1f1b", None), ("interleaved", args.vpp)):
            res = run_distributed(
                _measure, args.pp, (args.pp, vpp, m, args.layers, f, b, args.repeats), timeout=600
            )
            v = vpp or 1
            rows.append(
                {
                    "schedule": name,
                    "p": args.pp,
                    "v": v,
                    "m": m,
                    "measured_bubble": max(r["bubble"] for r in res),
                    "theory_bubble": (args.pp - 1) / (v * m),
                    "seconds": max(r["seconds"] for r in res),
                    "ideal_seconds": res[0]["ideal_seconds"],
                }
            )
            print(json.dumps(rows[-1]))
    record = {
        "benchmark": "pipeline_bubble",
        "machine": {"platform": platform.platform(), "torch": torch.__version__},
        "layers": args.layers,
        "forward_ms_per_layer": args.forward_ms,
        "backward_ms_per_layer": 2 * args.forward_ms,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
