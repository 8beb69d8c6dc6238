"""Pipeline bubble of 1F1B, interleaved 1F1B and ZB-H1, measured beside the theory.

    python benchmarks/bench_pipeline_bubble.py --out bench-results/pipeline_bubble.json

Every layer does the same work (a fixed forward and backward time, slept so
that ranks sharing CPU cores do not slow each other), so the time a rank spends
beyond its own compute is the schedule's bubble.  Bubble fraction =
(measured time - compute time) / compute time, where a rank's compute time is
measured too: the same forwards and backwards of its layers run back to back,
without a pipeline (so the sleeps' overshoot and autograd's own time are compute;
communication and the executor's time count as bubble).
Theory, with a backward twice the forward: (p - 1) / m for 1F1B, (p - 1) / (v m)
interleaved, and (p - 1) / (3 m) for ZB-H1, whose backward is split into B and W
of a forward each.  The steps really run the schedules and p2p of megacore.

A layer's forward takes 40 ms by default (--forward-ms): the executor's own host work
(posting each transfer to gloo, Python) costs about half a millisecond a step on a
loaded 2-core machine and counts as bubble; at 40 ms that is about a GPU's share
(where the host work overlaps the kernels).  At 10 or 20 ms the measured bubbles sit
further above theory by that fixed cost.

The NCCL-rules checker is off here: it makes every post wait until the peer
posts its match (stricter than NCCL, whose host calls return at once and whose
transfers only keep their order on a stream), which is right for proving the
schedules cannot hang (the tests do) and wrong for timing them.
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
from megacore import tensor_parallel as tp
from megacore.pipeline_parallel import get_forward_backward_func
from megacore.testing import run_distributed


class _FixedWork(torch.autograd.Function):
    """The forward's time, and the input gradient's half of the backward."""

    @staticmethod
    def forward(ctx, x, forward_s, input_grad_s):
        ctx.input_grad_s = input_grad_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.input_grad_s)
        return grad, None, None


class _Chunk(nn.Module):
    """Layers of fixed work.  Each ends in a linear through megacore (`tp.linear`) whose
    weight gradient takes the other half of the backward (a hook sleeps when it lands): in
    the backward under 1F1B, in the W step under ZB-H1."""

    def __init__(self, layers: int, forward_s: float, backward_s: float):
        super().__init__()
        self.forward_s, self.half_backward_s = forward_s, backward_s / 2
        self.weights = nn.ParameterList(nn.Parameter(torch.eye(8)) for _ in range(layers))
        for w in self.weights:
            w.register_post_accumulate_grad_hook(lambda _: time.sleep(self.half_backward_s))
        self.input_tensor = None

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def forward(self, data):
        x = data if ps.is_pipeline_first_stage() else self.input_tensor
        for w in self.weights:
            x = tp.linear(_FixedWork.apply(x, self.forward_s, self.half_backward_s), w)
        return x


def _forward_step(data_iterator, model):
    out = model(next(data_iterator))
    return out, lambda o: (o.sum(), {})


def _measure(schedule, pp, vpp, microbatches, layers, forward_s, backward_s, repeats):
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
        get_forward_backward_func(schedule)(
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
    seconds, compute = best, _compute_seconds(model, microbatches, shape, repeats)
    ps.destroy_model_parallel()
    nominal = microbatches * (layers // pp) * (forward_s + backward_s)
    return {
        "seconds": seconds,
        "compute_seconds": compute,
        "nominal_compute_seconds": nominal,
        "bubble": (seconds - compute) / compute,
    }


def _compute_seconds(model: list, microbatches: int, shape: tuple, repeats: int) -> float:
    """This rank's forwards and backwards of every microbatch, back to back (best of repeats)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for chunk in model:
            for _ in range(microbatches):
                x = torch.randn(shape, requires_grad=True)
                chunk.set_input_tensor(x)
                chunk(x).sum().backward()
        best = min(best, time.perf_counter() - start)
    return best


# With a backward twice the forward, split into B and W of a forward each.
THEORY = {
    "1f1b": lambda p, v, m: (p - 1) / m,
    "interleaved": lambda p, v, m: (p - 1) / (v * m),
    "zb-h1": lambda p, v, m: (p - 1) / (3 * m),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/pipeline_bubble.json"))
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--vpp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--forward-ms", type=float, default=40.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    f, b = args.forward_ms / 1e3, 2 * args.forward_ms / 1e3  # backward costs twice the forward
    rows = []
    for m in args.microbatches:
        for name, vpp in (("1f1b", None), ("interleaved", args.vpp), ("zb-h1", None)):
            job = (name, args.pp, vpp, m, args.layers, f, b, args.repeats)
            res = run_distributed(_measure, args.pp, job, timeout=600, nccl_rules=False)
            v = vpp or 1
            rows.append(
                {
                    "schedule": name,
                    "p": args.pp,
                    "v": v,
                    "m": m,
                    "measured_bubble": max(r["bubble"] for r in res),
                    "theory_bubble": THEORY[name](args.pp, v, m),
                    "seconds": max(r["seconds"] for r in res),
                    "compute_seconds": min(r["compute_seconds"] for r in res),
                    "nominal_compute_seconds": res[0]["nominal_compute_seconds"],
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
