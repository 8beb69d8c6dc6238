"""Measure the time model's constants on the machine at hand: `megatrain plan --calibrate`.

- **GEMMs**: square and tall-skinny matrix multiplies from 256 to 8192 (128 to 2048 on a
  CPU) in the training precision (bf16 on a GPU, fp32 on a CPU), best of a few runs each; a
  least-squares fit of time = FLOPs / rate + tau (weighted by 1/time, so small GEMMs count
  as much as large) gives `gemm_efficiency` = rate / peak, the peak being the data sheet's
  (megatrain.run.metrics) on a GPU, and the fitted rate itself on a CPU (no vendor number
  applies to an arbitrary CPU); each GEMM's own FLOPs / ((time - tau) peak) gives
  `gemm_efficiency_by_size`, by its GFLOP; tau alone is recorded (the layers below give the
  one used).
- **float8 GEMMs** (a GPU with float8 tensor cores, compute capability 8.9+): square
  `torch._scaled_mm` GEMMs of the largest sizes above, e4m3 operands and a bf16 output as
  torchao's float8 linears run them; the best rate over the GPU table's fp8 peak gives
  `fp8_gemm_efficiency` (as the published figure, the best shape's).  Elsewhere the profile
  keeps its generation's published figure, or none, and its measurements say so.
- **Attention**: torch's SDPA, causal, forward and backward, head dimension 128, at sequence
  lengths 512 to 16384 in bf16 on a GPU (16 heads, 16k tokens a call, as FlashAttention's
  benchmarks; whichever kernel SDPA picks there) and 128 to 512 in fp32 on a CPU: FLOPs
  counted as the cost model counts a flash kernel's (the causal half, the backward 2.5 x
  the forward) over the time give `attention_tflops`.
- **Memory bandwidth**: a large tensor copied (bytes read + written / time); over the data
  sheet's bandwidth on a GPU, `hbm_efficiency` (1 on a CPU, whose bandwidth is this one).
- **Collectives**: all-reduces of 16 KiB to 64 MiB over the GPUs of this node (NCCL), or
  over `ranks` local processes on a CPU (gloo); time = latency + 2 (n-1)/n bytes /
  bandwidth fitted gives `collective_latency_us` and the bus bandwidth, over the link's
  nominal one `collective_efficiency`.  With one GPU there is nothing to measure: the
  built-in values stay, and the profile says so.
- **Layers**: megatrain's own TransformerLayer, forward and backward, at a few sizes (one
  process, tp 1).  With the GEMM rate and memory bandwidth just measured, the cost model's
  layer time is linear in the two constants left, the fixed time per GEMM (which in a
  layer also carries the host work of the eager ops around each GEMM, as in the built-in
  fit) and the non-GEMM ops' memory traffic; least squares on the measured layers gives
  `gemm_overhead_us` and `elementwise_passes`.

On a GPU the profile's device is the GPU table's entry of the same model (memory and
link bandwidths from the data sheet), and what is not measured (collectives on one GPU) is
that entry's built-in profile's; on a CPU it is the measured machine, so `megatrain plan
--profile cpu.json` without --gpu plans for it.  The profile is `measured`, its source the
machine, the device and the date.
"""

import os
import platform
import time
from dataclasses import replace

import numpy as np
import torch

from megatrain.plan.hardware import DEFAULT_PROFILE, GIB, Gpu, Profile, builtin_profile, load_gpus

# (hidden, heads, seq, batch) of the layers timed
LAYERS_GPU = ((1024, 16, 1024, 1), (1024, 16, 1024, 4), (2048, 16, 1024, 2), (4096, 32, 1024, 2))
LAYERS_CPU = ((128, 4, 128, 1), (256, 4, 128, 2), (256, 8, 128, 4), (512, 8, 128, 2))
GEMM_SIZES_GPU = (256, 512, 1024, 2048, 4096, 8192)
GEMM_SIZES_CPU = (128, 256, 512, 1024, 2048)
ALL_REDUCE_BYTES = tuple(2**p for p in range(14, 27, 2))  # 16 KiB .. 64 MiB
ATTENTION_SEQ_GPU = (512, 1024, 2048, 4096, 8192, 16384)
ATTENTION_SEQ_CPU = (128, 256, 512)
ATTENTION_HEAD_DIM = 128
# (heads, tokens a call: batch = tokens / seq) of the attention timed
ATTENTION_SHAPE = {"cuda": (16, 16384), "cpu": (2, 512)}
COPY_BYTES = {"cuda": 1 << 30, "cpu": 256 << 20}  # well above the caches


def _best_seconds(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up: allocation, kernel selection, the thread pool
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_gemms(device: torch.device, dtype: torch.dtype, sizes, repeats: int = 5) -> list:
    """[(m, n, k, seconds)] for square GEMMs and ones with a short inner dimension."""
    shapes = [(n, n, n) for n in sizes] + [(sizes[-1], n, n // 4) for n in sizes[1:]]
    out = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        out.append((m, n, k, _best_seconds(lambda a=a, b=b: a @ b, device, repeats)))
    return out


def measure_fp8_gemms(device: torch.device, sizes, repeats: int = 5) -> list:
    """[(n, seconds)] of square float8 GEMMs (e4m3 operands, the second column-major as
    `torch._scaled_mm` takes it, per-tensor scales, a bf16 output)."""
    out = []
    one = torch.ones((), device=device, dtype=torch.float32)
    for n in sizes:
        a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()

        def gemm(a=a, b=b):
            return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

        out.append((n, _best_seconds(gemm, device, repeats)))
    return out


def fp8_gemm_efficiency(measured: list, peak: float) -> float:
    """The best rate of `measure_fp8_gemms`' GEMMs over the fp8 peak."""
    return max(2.0 * n**3 / seconds for n, seconds in measured) / peak


def fit_gemms(measured: list) -> tuple[float, float]:
    """(FLOP/s of a large GEMM, fixed seconds per GEMM) by weighted least squares."""
    work = np.array([2.0 * m * n * k for m, n, k, _ in measured])
    seconds = np.array([s for *_, s in measured])
    design = np.stack([work, np.ones_like(work)], axis=1) / seconds[:, None]
    (inverse_rate, overhead), *_ = np.linalg.lstsq(design, np.ones_like(seconds), rcond=None)
    if overhead < 0 or inverse_rate <= 0:  # no measurable fixed cost (or noise): the rate alone
        inverse_rate, overhead = float(np.sum(work / seconds) / np.sum((work / seconds) ** 2)), 0.0
    return 1.0 / float(inverse_rate), float(overhead)


def gemm_efficiency_by_size(measured: list, overhead: float, peak: float) -> tuple:
    """((GFLOP, fraction of peak), ...) ascending: each GEMM's FLOPs / ((time - overhead)
    peak), the time beyond the fixed overhead (at least half the time: a GEMM timed below
    the fitted overhead is noise); GEMMs of the same FLOPs averaged."""
    by_size: dict[float, list] = {}
    for m, n, k, seconds in measured:
        flops = 2.0 * m * n * k
        busy = max(seconds - overhead, seconds / 2)
        by_size.setdefault(flops / 1e9, []).append(flops / (busy * peak))
    return tuple((size, float(np.mean(f))) for size, f in sorted(by_size.items()))


def measure_attention(device: torch.device, dtype: torch.dtype, seqs, repeats: int = 5) -> list:
    """[(seq, TFLOP/s)] of SDPA's causal attention, forward and backward, at head dimension
    ATTENTION_HEAD_DIM; FLOPs as the cost model counts a flash kernel's."""
    heads, tokens = ATTENTION_SHAPE[device.type]
    d = ATTENTION_HEAD_DIM
    out = []
    for seq in seqs:
        batch = max(1, tokens // seq)
        q, k, v = (
            torch.randn(batch, heads, seq, d, device=device, dtype=dtype, requires_grad=True)
            for _ in range(3)
        )
        grad = torch.randn(batch, heads, seq, d, device=device, dtype=dtype)

        def step(q=q, k=k, v=v, grad=grad):
            q.grad = k.grad = v.grad = None
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

        forward = 4 * batch * heads * seq * seq * d / 2  # the causal half of QK^T and PV
        out.append((seq, 3.5 * forward / _best_seconds(step, device, repeats) / 1e12))
    return out


def measure_copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a copy, counting what is read and what is written."""
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_seconds(lambda: dst.copy_(src), device, 5)


def _all_reduce_worker(sizes: tuple, repeats: int) -> list | None:
    """One rank: [(bytes, seconds)] of all-reduces (rank 0 reports)."""
    import torch.distributed as dist

    from megatrain.run.distributed import init_distributed

    device, _ = init_distributed()
    out = []
    for nbytes in sizes:
        tensor = torch.ones(nbytes // 4, device=device)
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            dist.all_reduce(tensor)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        out.append((nbytes, min(times[1:])))
    return out if dist.get_rank() == 0 else None


def fit_collectives(measured: list, ranks: int) -> tuple[float, float]:
    """(bus bandwidth in bytes/s, latency in seconds) of t = latency + 2 (n-1)/n N / bw."""
    moved = np.array([2 * (ranks - 1) / ranks * n for n, _ in measured])
    seconds = np.array([s for _, s in measured])
    design = np.stack([moved, np.ones_like(moved)], axis=1) / seconds[:, None]
    (inverse_bandwidth, latency), *_ = np.linalg.lstsq(design, np.ones_like(seconds), rcond=None)
    return 1.0 / float(inverse_bandwidth), max(0.0, float(latency))


def _layer_worker(shapes: tuple, precision: str, repeats: int) -> list:
    """[seconds] of forward + backward of one TransformerLayer (dropout on) per shape."""
    from megacore import parallel_state as ps
    from megacore import tensor_parallel
    from megatrain.models.common import placement
    from megatrain.models.transformer import TransformerLayer
    from megatrain.models.transformer_config import TransformerConfig
    from megatrain.run.distributed import init_distributed
    from megatrain.run.setup import PRECISION_DTYPES

    device, _ = init_distributed()
    ps.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_manual_seed(0)  # the attention dropout's generator
    dtype = PRECISION_DTYPES[precision]
    out = []
    for hidden, heads, seq, batch in shapes:
        cfg = TransformerConfig(
            num_layers=1,
            hidden_size=hidden,
            num_attention_heads=heads,
            vocab_size=128,
            max_position_embeddings=seq,
        )
        layer = TransformerLayer(cfg, placement(torch.Generator().manual_seed(0), device, dtype))
        x = torch.randn(seq, batch, hidden, device=device, dtype=dtype, requires_grad=True)
        grad = torch.ones(seq, batch, hidden, device=device, dtype=dtype)
        step = lambda layer=layer, x=x, grad=grad: layer(x).backward(grad)  # noqa: E731
        out.append(_best_seconds(step, device, repeats))
    return out


def fit_layers(measured: list, gpu: Gpu, profile: Profile, precision: str) -> tuple[float, float]:
    """(gemm_overhead_us, elementwise_passes) by weighted least squares of the cost model's
    layer time (forward and backward, tp 1), linear in both, to [(shape, seconds)]."""
    from megatrain.config import Config, ModelConfig, TrainingConfig
    from megatrain.plan.cost_model import layer_seconds
    from megatrain.plan.costs import Costs
    from megatrain.plan.layout import Layout

    rows, seconds = [], []
    for (hidden, heads, seq, batch), took in measured:
        config = Config(
            model=ModelConfig(num_layers=1, hidden_size=hidden, num_attention_heads=heads),
            training=TrainingConfig(seq_length=seq, micro_batch_size=batch, precision=precision),
        )
        layout = Layout(tp=1, pp=1, dp=1, micro_batch=batch)
        times = [
            layer_seconds(
                config,
                layout,
                Costs(gpu, replace(profile, gemm_overhead_us=us, elementwise_passes=k), precision),
                1.0,
            )["compute"]
            for us, k in ((0.0, 0.0), (1.0, 0.0), (0.0, 1.0))
        ]
        fixed = times[0]
        rows.append([times[1] - fixed, times[2] - fixed])
        seconds.append(took - fixed)
    weights = 1 / np.array([took for _, took in measured])
    design = np.array(rows) * weights[:, None]
    (overhead, passes), *_ = np.linalg.lstsq(design, np.array(seconds) * weights, rcond=None)
    return max(0.0, float(overhead)), max(0.0, float(passes))


def _table_gpu(name: str, memory_bytes: float) -> Gpu | None:
    """The GPU table's entry for a device name (the model in the name, nearest memory)."""
    matches = [g for g in load_gpus().values() if g.key.split("-")[0] in name.lower()]
    return min(matches, key=lambda g: abs(g.memory_bytes - memory_bytes), default=None)


def calibrate(ranks: int = 2, log=print) -> Profile:
    """Measure this machine; on a CPU the collectives run over `ranks` local processes."""
    from megatrain.run import launch
    from megatrain.run.metrics import device_peak_tflops

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    sizes = GEMM_SIZES_GPU if cuda else GEMM_SIZES_CPU
    log(f"calibrate: GEMMs of {sizes[0]}..{sizes[-1]} in {dtype} on {device}")
    gemms = measure_gemms(device, dtype, sizes)
    rate, overhead = fit_gemms(gemms)
    copy = measure_copy_bandwidth(device, COPY_BYTES[device.type])
    log(
        f"calibrate: GEMM {rate / 1e12:.2f} TFLOP/s + {overhead * 1e6:.1f} us; "
        f"copy {copy / 1e9:.1f} GB/s"
    )
    seqs = ATTENTION_SEQ_GPU if cuda else ATTENTION_SEQ_CPU
    log(f"calibrate: causal attention (SDPA) at s {seqs[0]}..{seqs[-1]}, forward and backward")
    attention = measure_attention(device, dtype, seqs)
    log("calibrate: attention " + ", ".join(f"{t:.1f} TFLOP/s at {s}" for s, t in attention))
    precision = "bf16" if cuda else "fp32"
    if cuda:
        props = torch.cuda.get_device_properties(device)
        # The data sheet's memory and links; None for a GPU the table lacks (plan it with
        # --gpu-file, whose link bandwidths this profile's efficiency then applies to).
        gpu = _table_gpu(props.name, props.total_memory)
        peak = device_peak_tflops(device)[0] * 1e12
        ranks = torch.cuda.device_count()
    else:
        peak = rate
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        gpu = Gpu(
            key="cpu",
            name=f"{platform.machine()} CPU, {torch.get_num_threads()} threads",
            memory_gib=memory / GIB,
            peak_tflops={precision: rate / 1e12},
            hbm_gbps=copy / 1e9,
            intra_node_gbps=copy / 1e9,  # replaced below by the measured all-reduce
            inter_node_gbps=copy / 1e9,
            gpus_per_node=ranks,
        )
    # What is not measured here (collectives on one GPU) is the device's generation's.
    base = builtin_profile(gpu.profile if gpu is not None else DEFAULT_PROFILE)
    device_name = torch.cuda.get_device_name(device) if cuda else gpu.name
    # The device the layer fit is made against: the table's, else the one measured here.
    measured_gpu = gpu or Gpu(
        key="measured",
        name=device_name,
        memory_gib=1.0,
        peak_tflops={precision: peak / 1e12},
        hbm_gbps=copy / 1e9,
        intra_node_gbps=1.0,
        inter_node_gbps=1.0,
        gpus_per_node=1,
    )
    by_size = gemm_efficiency_by_size(gemms, overhead, peak)
    hbm = copy / (measured_gpu.hbm_gbps * 1e9)
    log(
        f"calibrate: GEMMs at {by_size[0][1]:.0%}..{by_size[-1][1]:.0%} of peak from "
        f"{by_size[0][0]:.2g} to {by_size[-1][0]:.3g} GFLOP; copy at {hbm:.0%} of the data sheet"
    )
    shapes = LAYERS_GPU if cuda else LAYERS_CPU
    log(f"calibrate: {len(shapes)} transformer layers, forward and backward")
    layers = launch.run_workers(_layer_worker, (shapes, precision, 5), 1)[0]
    overhead_us, passes = fit_layers(
        list(zip(shapes, layers, strict=True)),
        measured_gpu,
        replace(
            base, gemm_efficiency=rate / peak, gemm_efficiency_by_size=by_size, hbm_efficiency=hbm
        ),
        precision,
    )
    log(f"calibrate: layers give {overhead_us:.1f} us per GEMM, {passes:.2f} passes")
    fp8, fp8_note = base.fp8_gemm_efficiency, f"profile {base.name}'s, not measured"
    float8 = cuda and gpu is not None and "fp8" in gpu.peak_tflops
    if float8 and torch.cuda.get_device_capability(device) >= (8, 9):
        fp8_gemms = measure_fp8_gemms(device, sizes[-2:])
        fp8 = fp8_gemm_efficiency(fp8_gemms, gpu.peak_flops("fp8"))
        fp8_note = [{"n": n, "seconds": t} for n, t in fp8_gemms]
        log(f"calibrate: float8 GEMMs at {fp8:.0%} of the fp8 peak")
    measured = {
        "device": device_name,
        "dtype": str(dtype),
        "gemms": [{"m": m, "n": n, "k": k, "seconds": s} for m, n, k, s in gemms],
        "gemm_rate_tflops": rate / 1e12,
        "gemm_alone_overhead_us": overhead * 1e6,
        "layers": [
            {"hidden": h, "heads": a, "seq": sq, "batch": b, "seconds": t}
            for (h, a, sq, b), t in zip(shapes, layers, strict=True)
        ],
        "copy_gbps": copy / 1e9,
        "fp8_gemms": fp8_note,
        "attention": {
            "kernel": "torch.nn.functional.scaled_dot_product_attention, is_causal=True",
            "head_dim": ATTENTION_HEAD_DIM,
            "heads_tokens": ATTENTION_SHAPE[device.type],
            "torch": torch.__version__,
        },
    }
    profile = replace(
        base,
        gemm_efficiency=rate / peak,
        gemm_efficiency_by_size=by_size,
        gemm_overhead_us=overhead_us,
        hbm_efficiency=hbm,
        elementwise_passes=passes,
        fp8_gemm_efficiency=fp8,
        attention_tflops=tuple((float(s), t) for s, t in attention),
        name="calibrated",
        source=f"calibrated on {platform.node()} ({device_name}) {time.strftime('%Y-%m-%d')}",
        measured=True,
        measurements=measured,
    )
    if ranks > 1:
        log(f"calibrate: all-reduces over {ranks} {'GPUs' if cuda else 'processes'}")
        reduces = launch.run_workers(_all_reduce_worker, (ALL_REDUCE_BYTES, 5), ranks)[0]
        bandwidth, latency = fit_collectives(reduces, ranks)
        measured["all_reduce"] = [{"bytes": n, "seconds": s} for n, s in reduces]
        measured["all_reduce_bus_gbps"] = bandwidth / 1e9
        log(f"calibrate: all-reduce bus {bandwidth / 1e9:.2f} GB/s + {latency * 1e6:.1f} us")
        if not cuda:  # one machine: its processes' all-reduce is both "links"
            gpu = replace(gpu, intra_node_gbps=bandwidth / 1e9, inter_node_gbps=bandwidth / 1e9)
        profile = replace(profile, collective_latency_us=latency * 1e6)
        if gpu is not None:
            efficiency = bandwidth / (gpu.intra_node_gbps * 1e9)
            profile = replace(profile, collective_efficiency=efficiency)
    else:
        measured["all_reduce"] = f"not measured (one GPU): profile {base.name}'s"
    return replace(profile, device=gpu)
