"""GPT-2 1.2B on one GPU: megatrain's training step beside HF's, megatron-core's, torchtitan's.

    make bench-gpu                                   # the paper's 1.2B, bf16, one GPU
    python benchmarks/bench_gpu.py --micro-batch 4 --recompute none --out bench-results/gpu.json
    python benchmarks/bench_gpu.py --small --out bench-results/gpu-small.json   # on a CPU
    python benchmarks/bench_gpu.py --config pipelines/models/llama3-8b.toml --layers 4
    python benchmarks/bench_gpu.py --config pipelines/models/mixtral-8x7b.toml --layers 2 \
        --experts 4 --peers none                    # a mixture of experts, on one GPU
    python benchmarks/bench_gpu.py --config pipelines/models/deepseek-v2-lite.toml --layers 4 \
        --peers none                                # DeepSeek's latent attention and experts
    python benchmarks/bench_gpu.py --config pipelines/models/gpt-oss-20b.toml --layers 4 \
        --peers none          # gpt-oss: sinks, sliding layers (FlexAttention's block mask)

The model is `pipelines/models/gpt2-1.2b.toml` (the paper's Table 1: 40 layers, hidden
1536, 16 heads, seq 1024; GPT-2's 50257 tokens padded to 50304 at tp 1) with its
recompute chosen by memory (`--recompute auto`: the least that fits the GPU by
`megatrain.plan.memory`; a 32 GB V100 needs "full", an 80 GB H100 less), one microbatch of
`--micro-batch` sequences per step (global batch = micro batch), bf16 on a GPU, on a
synthetic corpus of random tokens (bench_gpt_train.py's helpers).  `--small` (or
`--layers/--hidden/--heads/--seq/--vocab`) shrinks the shape so the same script runs
on a CPU, in fp32.

Ours is the step `megatrain run` takes: a `megatrain.run.setup.Run` from `build_run` (a
1-process NCCL group on a GPU, gloo on a CPU; bf16 parameters with fp32 masters in
`MegatronOptimizer`), one `train_step(run)` per iteration. HF's is
`transformers.GPT2LMHeadModel` (`LlamaForCausalLM` for a Llama `--config`, e.g.
pipelines/models/llama3-8b.toml with fewer layers) of the same shape, padded vocabulary and
dropout, SDPA attention, fp32 weights under `torch.autocast(bf16)` (HF's usual mixed
precision), gradient checkpointing when we recompute fully, `torch.optim.AdamW` with our lr,
betas, eps, decay and clipping, on the very same batches. Each model runs alone: built,
`--warmup` steps, `--iters` timed steps (`torch.cuda.synchronize()` before and after each),
then freed, so `torch.cuda.max_memory_allocated` is its own peak.

A mixture-of-experts config (mixtral-8x7b, qwen3-30b-a3b, mixtral-tiny, the DeepSeek
shapes: deepseek-v3, deepseek-v2-lite, moonlight-16b-a3b, deepseek-tiny) runs with every
expert on the one device (expert parallelism 1), `--experts` / `--expert-ffn` to shrink it
(`--layers` keeps a DeepSeek's dense first layers); HF's side is `MixtralForCausalLM` /
`Qwen3MoeForCausalLM` / `DeepseekV3ForCausalLM` / `DeepseekV2ForCausalLM` (bench_gpt_train's
HFTrainer, as `megatrain export-hf` writes the config), at its default experts
implementation; the model FLOPs count the k active experts.  A DeepSeek runs without its
MTP depths on both sides (transformers drops them).  The peers' runners build dense
models only: they are recorded as skipped for a mixture.

After them, each of `--peers` (default both; benchmarks/peers/) alone in the same way on the
same batches: megatron-core's own GPTModel (local layer spec, no Transformer Engine) with its
DistributedDataParallel and get_megatron_optimizer, and torchtitan's Llama 3 (the same model
for a Llama config, a FLOP-matched Llama for GPT-2) with its parallelize_llama and
build_optimizers; each module's doc says exactly what runs.  A peer whose package does not import
(scripts/fetch_gpu_wheels.py and scripts/install_gpu_wheels.sh install them) or that fails is
recorded as skipped with the reason, and the others' numbers stay.

Reported per model: tokens/s (median step; mean), ms/step, model TFLOP/s, MFU (model FLOPs,
72 B s l h^2 (1 + s/6h + V/12lh), whatever is recomputed) and HFU (with the recomputed
work: 96 B s l h^2 (1 + s/6h + V/16lh) under full recompute) against one device's dense
bf16 peak (`megatrain.run.metrics.device_peak_tflops`; on a CPU the best of two measured fp32
matmul rates), peak memory, losses; and ours / HF tokens/s (median and fastest step).
Each model's MFU counts its own model FLOPs (the same as ours but for the FLOP-matched Llama's
rounding).  Its losses are checked: the first near ln(vocab) (random tokens; within
`LOSS_TOLERANCE`) and the largest difference from ours over the steps.
"""

import argparse
import copy
import gc
import json
import math
import os
import platform
import tempfile
import time
import traceback
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
import peers
import torch
import torch.distributed as dist
from bench_gpt_train import (
    HFTrainer,
    Recorder,
    cpu_model,
    free_port,
    loader,
    profile_step,
    random_docs,
    summarize,
    write_corpus,
)

from megacore import parallel_state as ps
from megatrain.config import load_config, validate
from megatrain.plan.accounting import (
    gpt_hardware_flops_per_iteration,
    gpt_model_flops_per_iteration,
    gpt_parameters,
)
from megatrain.plan.memory import cheapest_recompute
from megatrain.run.metrics import device_peak_tflops, measured_matmul_tflops
from megatrain.run.setup import build_run
from megatrain.run.step import train_step

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "pipelines" / "models" / "gpt2-1.2b.toml"
# A shape a 2-core CPU trains in seconds a step: the same code path, smaller matrices.
SMALL = {"layers": 4, "hidden": 256, "heads": 4, "seq": 256, "vocab": 8192, "micro_batch": 4}
GIB = 2**30
# The speed levers of ours (docs/training.md), on unless --no-levers; gradient-accumulation
# fusion is left out under --compile, which it does not combine with.
LEVER_FIELDS = ("fused_linear_cross_entropy", "gradient_accumulation_fusion",
                "one_sync_per_iteration")  # fmt: skip
LEVERS = tuple(f"training.{name}=true" for name in LEVER_FIELDS)
# How far a first loss may lie from ln(vocab) on random tokens: GPT-2's init (std 0.02) starts
# within 0.01 nats of it, torchtitan's (logits of std ~1) about 0.5 above it.
LOSS_TOLERANCE = 1.0
# The peers' packages (and the kernels packages shipped with them), versions recorded.
PEER_PACKAGES = ("megatron-core", "torchtitan", "torchao", "liger-kernel")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/gpu.json"))
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda")
    parser.add_argument("--micro-batch", type=int, default=None, help="default: the config's")
    parser.add_argument(
        "--recompute",
        choices=("auto", "none", "selective", "full"),
        default="auto",
        help="auto (default): the least recompute that fits this GPU's memory by "
        "megatrain.plan.memory's estimate; the config's own on a CPU",
    )
    parser.add_argument("--precision", choices=("bf16", "fp32"), default=None,
                        help="default: bf16 on a GPU, fp32 on a CPU")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20, help="timed steps per model")
    parser.add_argument("--small", action="store_true", help=f"a CPU-sized shape: {SMALL}")
    for name in ("layers", "hidden", "heads", "seq", "vocab"):
        parser.add_argument(f"--{name}", type=int, default=None)
    parser.add_argument("--groups", type=int, default=None, help="a Llama's key/value heads")
    parser.add_argument("--ffn", type=int, default=None, help="the MLP's hidden width")
    parser.add_argument("--experts", type=int, default=None, help="a mixture's experts per layer")
    parser.add_argument(
        "--expert-ffn", type=int, default=None, help="a mixture's expert hidden width"
    )
    parser.add_argument("--no-hf", action="store_true", help="skip the Hugging Face model")
    parser.add_argument(
        "--no-levers",
        dest="levers",
        action="store_false",
        help="ours without the speed levers (fused linear + cross entropy, gradient-accumulation "
        "fusion, one host sync per iteration)",
    )
    parser.add_argument(
        "--fp8",
        action="store_true",
        help="ours once more with training.precision='fp8' (torchao's float8 training) as "
        "'megatrain-fp8'; recorded as skipped with the reason where float8 cannot run",
    )
    parser.add_argument(
        "--fp8-emulate", action="store_true", help="--fp8 through torchao's emulation (any device)"
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="ours once more with training.cuda_graphs (each layer a CUDA graph) as "
        "'megatrain-cuda-graphs'; recorded as skipped with the reason where it cannot run",
    )
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="ours once more with parallel.data_parallel_sharding='full' (torch's FSDP2 over "
        "the one rank: fp32 shards gathered as bf16, the cost beside the plain step) as "
        "'megatrain-fsdp'",
    )
    parser.add_argument(
        "--packed",
        action="store_true",
        help="ours once more with packed documents (data.reset_position_ids and "
        "reset_attention_mask: attention within each document, FlexAttention's block mask on "
        "CUDA) as 'megatrain-packed'",
    )
    parser.add_argument(
        "--peers",
        default=",".join(peers.PEERS),
        help=f"comma-separated, of {', '.join(peers.PEERS)}, or 'none' (default: all; one "
        "that does not import is recorded as skipped)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="profile one more step of ours: top ops by time"
    )
    parser.add_argument(
        "--compile", action="store_true", help="ours with training.compile (HF stays eager)"
    )
    parser.add_argument("--peak-tflops", type=float, default=None, help="override the peak")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    if args.small:
        for name, value in SMALL.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    if args.device is None:
        if not torch.cuda.is_available() and not args.small:
            parser.error("no CUDA device: pass --small (or --device cpu) to run on the CPU")
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.precision is None:
        args.precision = "bf16" if args.device == "cuda" else "fp32"
    args.peers = [] if args.peers == "none" else args.peers.split(",")
    if unknown := set(args.peers) - set(peers.PEERS):
        parser.error(
            f"--peers: unknown {', '.join(sorted(unknown))}; known: {', '.join(peers.PEERS)}"
        )
    return args


def overrides(args: argparse.Namespace, corpus: Path, out: Path) -> list[str]:
    """The config's fields this benchmark sets: one device, one microbatch a step."""
    o = [
        "parallel.tensor_model_parallel_size=1",
        "parallel.pipeline_model_parallel_size=1",
        "parallel.data_parallel_size=1",
        f'training.precision="{args.precision}"',
        f"training.train_iters={args.warmup + args.iters}",
        # The paper's 3000 warm-up iterations exceed this run; the lr does not change the speed.
        "optimizer.lr_warmup_iters=0",
        f"training.seed={args.seed}",
        f'training.output_dir="{out}"',
        f'data.corpus="{corpus}"',
        "logging.tensorboard=false",
    ]
    # One microbatch a step on both sides (HF's loader takes one): global batch = micro batch.
    micro = args.micro_batch or load_config(args.config).training.micro_batch_size
    o += [f"training.micro_batch_size={micro}", f"training.global_batch_size={micro}"]
    if args.compile:
        o.append("training.compile=true")
    if args.levers:
        o += [lever for lever in LEVERS if not (args.compile and "accumulation" in lever)]
    if args.recompute != "auto":
        o.append(f'model.recompute="{args.recompute}"')
    for name, field in (("layers", "num_layers"), ("hidden", "hidden_size"),
                        ("heads", "num_attention_heads"), ("vocab", "vocab_size"),
                        ("groups", "num_query_groups"), ("ffn", "ffn_hidden_size")):  # fmt: skip
        if getattr(args, name) is not None:
            o.append(f"model.{field}={getattr(args, name)}")
    if args.seq is not None:
        o += [f"training.seq_length={args.seq}", f"model.max_position_embeddings={args.seq}"]
    model = load_config(args.config).model
    if model.num_moe_experts:  # every expert on the one device
        o += ["parallel.expert_model_parallel_size=1", "parallel.expert_tensor_parallel_size=1"]
        freq = model.moe_layer_freq
        if args.layers is not None and isinstance(freq, list):
            # A DeepSeek's dense first layers (first_k_dense_replace) kept, the rest MoE (and
            # at least one MoE layer).
            dense = freq.index(1) if 1 in freq else len(freq)
            if freq != [0] * dense + [1] * (len(freq) - dense):
                raise SystemExit(f"--layers: {args.config}'s model.moe_layer_freq {freq} is not "
                                 "dense layers first, then MoE layers")  # fmt: skip
            dense = min(dense, args.layers - 1)
            o.append(f"model.moe_layer_freq={[0] * dense + [1] * (args.layers - dense)}")
        if args.experts is not None:
            o.append(f"model.num_moe_experts={args.experts}")
        if args.expert_ffn is not None:
            o.append(f"model.moe_ffn_hidden_size={args.expert_ffn}")
    elif args.experts is not None or args.expert_ffn is not None:
        raise SystemExit(f"--experts / --expert-ffn: {args.config} is not a mixture of experts")
    if args.layers is not None and model.layer_types:
        # gpt-oss's alternation of sliding and full layers, from the first, for the layers kept
        kept = [model.layer_types[i % len(model.layer_types)] for i in range(args.layers)]
        o.append(f"model.layer_types={kept}")
    if model.mtp_num_layers:
        # HF's DeepseekV3ForCausalLM drops the MTP layer (and the fused loss lever takes no
        # depths): the same model on both sides, without it.
        o.append("model.mtp_num_layers=none")
    return o


def init_process_group(device: torch.device) -> None:
    """A 1-process group, as `megatrain run` makes one: NCCL on a GPU, gloo on a CPU."""
    init = f"tcp://127.0.0.1:{free_port()}"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=0, world_size=1, init_method=init, device_id=device)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=init)


def run_steps(step, warmup: int, iters: int, device: torch.device, name: str):
    """(seconds of each timed step, losses of every step).  On a GPU the clock reads only after
    `synchronize()`, so a step's time is its kernels', not how fast Python queued them."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    seconds, losses = [], []
    for i in range(warmup + iters):
        sync()
        start = time.perf_counter()
        out = step()
        sync()
        elapsed = time.perf_counter() - start
        losses.append(out["loss"])
        if i >= warmup:
            seconds.append(elapsed)
        if i + 1 == warmup or i + 1 == warmup + iters:
            label = "warm-up" if i < warmup else "timed"
            print(f"{name:9s} {label} steps done; loss {out['loss']:.4f}", flush=True)
    return seconds, losses


def reset_memory(device: torch.device) -> float | None:
    """Free what the previous model left and start a new peak; GiB still allocated."""
    gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device) / GIB


def peak_memory(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


# SDPA's backends, by the aten op that runs each (the CPU's flash kernel included).
ATTENTION_BACKENDS = {
    "flash": "aten::_scaled_dot_product_flash_attention",
    "cudnn": "aten::_scaled_dot_product_cudnn_attention",
    "efficient": "aten::_scaled_dot_product_efficient_attention",
    "math": "aten::_scaled_dot_product_attention_math",
}
# Kernel (GPU) or op (CPU) names of matrix multiplies and of attention.
GEMM_NAMES = ("gemm", "nvjet", "xmma", "cutlass", "aten::mm", "aten::addmm", "aten::bmm",
              "_scaled_mm")  # fmt: skip
ATTENTION_NAMES = ("flash", "fmha", "attention", "sdpa")


def kernel_shares(step, cuda: bool) -> dict:
    """One more step under the profiler: which SDPA backend ran (by its aten op) and the share
    of the step's device time (a CPU's op time) in matmul and in attention kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    backends = sorted(
        name
        for name, op in ATTENTION_BACKENDS.items()
        if any(e.key == op or e.key.startswith(op + "_for_") for e in events)
    )
    if cuda:  # the kernels themselves, so no time counts twice through the ops above them
        timed = [
            (e.key, e.self_device_time_total) for e in events if e.device_type == DeviceType.CUDA
        ]
    else:
        timed = [(e.key, e.self_cpu_time_total) for e in events]
    total = sum(t for _, t in timed) or 1
    attention = sum(t for k, t in timed if any(n in k.lower() for n in ATTENTION_NAMES))
    gemm = sum(
        t
        for k, t in timed
        if any(n in k.lower() for n in GEMM_NAMES)
        and not any(n in k.lower() for n in ATTENTION_NAMES)
    )
    return {
        "sdpa_backends": backends,
        "matmul_share": round(gemm / total, 4),
        "attention_share": round(attention / total, 4),
        "matmul_and_attention_share": round((gemm + attention) / total, 4),
        "timed": "GPU kernels' time" if cuda else "CPU ops' self time",
    }


def measure_ours(config, device: torch.device, args: argparse.Namespace) -> dict:
    """megatrain's step, as `megatrain run` takes it; the run is freed on return."""
    before = reset_memory(device)
    run = build_run(config, device)
    run.train_data = Recorder(run.train_data)
    seconds, losses = run_steps(
        lambda: train_step(run), args.warmup, args.iters, device, "megatrain"
    )
    digests = list(run.train_data.digests)  # the timed steps' batches, not the profiled ones
    profile = None
    if args.profile:
        profile = profile_step(lambda: train_step(run), 30, cuda=device.type == "cuda")
        for row in profile:
            ms, share, calls = row["self_ms"], row["share"], row["calls"]
            print(f"  {ms:9.2f} ms {share:6.1%} {calls:6d}  {row['op'][:90]}")
        kernels = kernel_shares(lambda: train_step(run), cuda=device.type == "cuda")
        print(f"  kernels: {kernels}")
    return {
        "seconds": seconds,
        "losses": losses,
        "model_config": run.model_config,  # the vocabulary padded as training pads it
        "recompute": run.model_config.recompute,
        "peak_memory_gib": peak_memory(device),
        "memory_before_gib": before,
        "parameters": sum(
            p.numel() for p in dict.fromkeys(p for c in run.chunks for p in c.parameters())
        ),
        "precision": "fp32"
        if args.precision == "fp32"
        else f"{args.precision} parameters, fp32 masters (MegatronOptimizer)",
        "digests": digests,
        **({"profile_top_ops": profile, "profile_kernels": kernels} if profile else {}),
    }


def measure_variant(
    config, device: torch.device, args: argparse.Namespace, section: str = "training", **fields
) -> dict:
    """Ours again with the fields of config `section` changed, or why it cannot run."""
    variant = copy.deepcopy(config)
    for name, value in fields.items():
        setattr(getattr(variant, section), name, value)
    try:
        validate(variant, 1)
        return measure_ours(variant, device, args)
    except Exception as e:  # a variant that cannot run is a result, not the end of the run
        traceback.print_exc()
        return {"skipped": True, "reason": f"{type(e).__name__}: {e}"}
    finally:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()


def measure_fsdp(config, device: torch.device, args: argparse.Namespace) -> dict:
    """Ours again fully sharded by FSDP2 (`data_parallel_sharding = "full"`), or why it cannot
    run; without gradient-accumulation fusion (FSDP's gradients replace its buffer)."""
    variant = copy.deepcopy(config)
    variant.training.gradient_accumulation_fusion = False
    return measure_variant(variant, device, args, "parallel", data_parallel_sharding="full")


def measure_fp8(config, device: torch.device, args: argparse.Namespace) -> dict:
    """Ours again with the layers' GEMMs in float8 (bf16 otherwise), or why it cannot run."""
    result = measure_variant(
        config,
        device,
        args,
        precision="fp8",
        fp8_emulate=args.fp8_emulate,
        gradient_accumulation_fusion=False,  # torchao makes its weight gradients
    )
    if not result.get("skipped"):
        result["precision"] = "fp8 (torchao float8 training" + (
            ", emulated)" if args.fp8_emulate else ")"
        )
    return result


def measure_hf(config, corpus: Path, vocab_padded: int, device, args) -> dict:
    """GPT2LMHeadModel (or LlamaForCausalLM) of the same shape on the same batches; freed on
    return."""
    t, recompute = config.training, config.model.recompute
    before = reset_memory(device)
    low = torch.bfloat16 if args.precision == "bf16" else None
    batches = loader(corpus, config.model.vocab_size, t.seq_length, t.micro_batch_size, args.seed)
    hf = HFTrainer(
        config,
        Recorder(batches),
        args.seed,
        vocab_size=vocab_padded,
        device=device,
        autocast_dtype=low,
        recompute=recompute == "full",
    )
    seconds, losses = run_steps(hf.step, args.warmup, args.iters, device, "hf")
    # HF has no selective recompute; its SDPA keeps no s x s matrix to spare anyway.
    return {
        "seconds": seconds,
        "losses": losses,
        "recompute": "full" if recompute == "full" else "none",
        "peak_memory_gib": peak_memory(device),
        "memory_before_gib": before,
        "parameters": sum(p.numel() for p in hf.params),
        "attn_implementation": hf.attn_implementation,
        "class": type(hf.model).__name__,
        "precision": "fp32 weights, torch.autocast(bf16)" if low else "fp32",
        "digests": hf.batches.digests,
    }


def measure_peer(name: str, config, corpus: Path, model_config, device, args) -> dict:
    """Peer `name` (benchmarks/peers) on the same batches, timed as ours; freed on return."""
    t = config.training
    before = reset_memory(device)
    batches = Recorder(
        loader(corpus, config.model.vocab_size, t.seq_length, t.micro_batch_size, args.seed)
    )
    trainer = peers.build(name, config, model_config, batches, device, args.precision, args.seed)
    try:
        seconds, losses = run_steps(trainer.step, args.warmup, args.iters, device, name)
    finally:
        trainer.close()
    return {
        "seconds": seconds,
        "losses": losses,
        "model_config": trainer.model_config,  # its own model FLOPs
        "recompute": trainer.recompute,
        "peak_memory_gib": peak_memory(device),
        "memory_before_gib": before,
        "parameters": trainer.parameters,
        "precision": trainer.precision,
        "description": trainer.description,
        **trainer.details,
        "digests": batches.digests,
    }


def run_peers(config, corpus: Path, model_config, device, args, ours_digests) -> dict:
    """Each of `args.peers` alone; one that does not import or fails is recorded as skipped with
    the reason, so the others' numbers stay."""
    results = {}
    for name in args.peers:
        reason = peers.unavailable(name)
        if model_config.num_moe_experts:
            reason = "a mixture of experts: the peer runners here build dense models only"
        if reason is None:
            try:
                result = measure_peer(name, config, corpus, model_config, device, args)
                if result["digests"] != ours_digests:
                    raise RuntimeError(f"{name} was trained on other batches than ours")
                results[name] = result
            except Exception as e:
                traceback.print_exc()
                reason = f"failed: {type(e).__name__}: {e}"
            reset_memory(device)
        if reason is not None:
            print(f"{name} skipped: {reason}", flush=True)
            results[name] = {"skipped": True, "reason": reason}
    return results


def package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def loss_check(losses: list[float], ours: list[float], ln_vocab: float) -> dict:
    return {
        "first_loss_minus_ln_vocab": losses[0] - ln_vocab,
        "first_loss_near_ln_vocab": abs(losses[0] - ln_vocab) < LOSS_TOLERANCE,
        "tolerance": LOSS_TOLERANCE,
        "max_abs_diff_vs_megatrain": max(abs(a - b) for a, b in zip(losses, ours, strict=True)),
    }


def main() -> None:
    args = parse_args()
    # An indexed device, as megatrain's init_distributed makes: NCCL's device_id needs one.
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    torch.set_num_threads(args.threads)
    import transformers

    tmp = tempfile.TemporaryDirectory(prefix="bench_gpu_")
    work = Path(tmp.name)
    config = load_config(args.config, overrides(args, work / "corpus", work / "run"))
    if args.recompute == "auto" and device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
        config.model.recompute = cheapest_recompute(config, memory)
    m, t = config.model, config.training
    batch, seq = t.micro_batch_size, t.seq_length
    rng = np.random.default_rng(args.seed)
    need = int((args.warmup + args.iters) * batch * seq * 1.1) + 2 * seq  # one epoch suffices
    docs = {  # one shard per split
        "train": [random_docs(rng, need, m.vocab_size)],
        "valid": [random_docs(rng, 4 * seq, m.vocab_size)],
    }
    corpus = write_corpus(work / "corpus", docs, vocab_size=m.vocab_size, batch_rows=1024)

    init_process_group(device)
    results = {}
    try:
        # A GPU's dense bf16 peak from the table; a CPU's fp32 matmul rate, measured before and
        # after the steps with the best kept (as bench_gpt_train.py: noise only lowers a rate).
        if device.type == "cuda" or args.peak_tflops:
            peak, peak_source = device_peak_tflops(device, args.peak_tflops)
            peak_source = "--peak-tflops" if args.peak_tflops else peak_source
            peaks = [peak]
        else:
            peaks = [measured_matmul_tflops()]
        results["megatrain"] = measure_ours(config, device, args)
        ps.destroy_model_parallel()
        model_config = results["megatrain"].pop("model_config")
        if args.fp8 or args.fp8_emulate:
            results["megatrain-fp8"] = measure_fp8(config, device, args)
        if not args.no_hf:
            results["hf"] = measure_hf(config, corpus, model_config.vocab_size, device, args)
            if results["hf"]["digests"] != results["megatrain"]["digests"]:
                raise RuntimeError("the two models were trained on different batches")
            reset_memory(device)
        if args.fsdp:  # the same batches, the parameters FSDP2's shards
            results["megatrain-fsdp"] = measure_fsdp(config, device, args)
        if args.packed:  # the same batches, attention kept within each document
            results["megatrain-packed"] = measure_variant(
                config, device, args, "data", reset_position_ids=True, reset_attention_mask=True
            )
        ours_digests = results["megatrain"]["digests"]
        results |= run_peers(config, corpus, model_config, device, args, ours_digests)
        if args.cuda_graphs:  # last: a capture that fails cannot cost the others' numbers
            results["megatrain-cuda-graphs"] = measure_variant(
                config, device, args, cuda_graphs=True
            )
        if device.type == "cpu" and not args.peak_tflops:
            peaks.append(measured_matmul_tflops())
            peak = max(peaks)
            peak_source = f"CPU fp32 2048^3 matmul, best of two, {torch.get_num_threads()} threads"
    finally:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        dist.destroy_process_group()
        tmp.cleanup()

    flops = gpt_model_flops_per_iteration(model_config, batch, seq)  # ours (HF's: the same model)
    ln_vocab = math.log(m.vocab_size)
    tokens = batch * seq
    report = {}
    for name, r in results.items():
        if r.get("skipped"):
            report[name] = r
            continue
        run_config = r.pop("model_config", model_config)  # a FLOP-matched peer's own
        r["model_flops_per_step"] = gpt_model_flops_per_iteration(run_config, batch, seq)
        r["hardware_flops"] = gpt_hardware_flops_per_iteration(  # plus what it recomputes
            run_config, batch, seq, r["recompute"]
        )
        summary = summarize(
            r["seconds"], r["losses"], r["model_flops_per_step"], peak, tokens, r["hardware_flops"]
        )
        extra = {k: v for k, v in r.items() if k not in ("seconds", "losses", "digests")}
        checks = loss_check(r["losses"], results["megatrain"]["losses"], ln_vocab)
        report[name] = {
            **summary,
            **extra,
            "loss_check": checks,
            "batches_checked": len(r["digests"]),
        }
    record = {
        "benchmark": "gpu",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "transformers": transformers.__version__,
            "peer_packages": {name: package_version(name) for name in PEER_PACKAGES},
            "torch_threads": torch.get_num_threads(),
        },
        "shape": {
            "config": str(config_path(args.config)),
            "kind": m.kind,
            "num_query_groups": model_config.num_query_groups,
            "num_layers": m.num_layers,
            "hidden_size": m.hidden_size,
            "num_attention_heads": m.num_attention_heads,
            "ffn_hidden_size": config.ffn_hidden_size,
            "num_moe_experts": m.num_moe_experts,
            "moe_router_topk": m.moe_router_topk if m.num_moe_experts else None,
            "moe_ffn_hidden_size": model_config.moe_ffn_hidden_size,
            "multi_latent_attention": m.multi_latent_attention,
            "mtp_num_layers": m.mtp_num_layers,
            "window_size": m.window_size,
            "layer_types": m.layer_types,
            "softmax_type": m.softmax_type,
            "seq_length": seq,
            "vocab_size": m.vocab_size,
            "vocab_size_padded": model_config.vocab_size,
            "micro_batch_size": batch,
            "global_batch_size": batch,
            "tokens_per_step": tokens,
            "precision": args.precision,
            "recompute": m.recompute,
            "compile": t.compile,
            "levers": {name: getattr(t, name) for name in LEVER_FIELDS},
            "hidden_dropout": m.hidden_dropout,
            "attention_dropout": m.attention_dropout,
            "parameters_formula": gpt_parameters(model_config),
        },
        "method": {
            "device": str(device),
            "warmup_steps": args.warmup,
            "timed_steps": args.iters,
            "timing": "perf_counter around each step, torch.cuda.synchronize() before and after"
            if device.type == "cuda"
            else "perf_counter around each step",
            "order": "ours alone (build, warm-up, timed, freed), then HF alone, then each peer "
            f"alone ({', '.join(args.peers) or 'none'})",
            "batches": "a GPTBatches over a synthetic corpus of random tokens"
            if sum("skipped" not in r for r in report.values()) == 1
            else "identical: one GPTBatches per model over one synthetic corpus and seed; the "
            "digests of every batch were compared with ours",
            "model_flops_per_step": flops,
            "model_flops_formula": (
                "72 B s l h^2 (1 + s/6h + V/12lh) (gpt_model_flops_per_iteration; a Llama's "
                "grouped K/V and SwiGLU counted as they are)"
            ),
            "hardware_flops_formula": "gpt_hardware_flops_per_iteration: + 24 B s l h^2"
            " + 4 B s^2 h l (a forward of every layer) under full recompute,"
            " + 4 B s^2 h l under selective",
            "peak_tflops": peak,
            "peak_tflops_measurements": peaks,
            "peak_source": peak_source,
        },
        "ln_vocab": ln_vocab,
        **report,
    }
    if "hf" in report:
        ours, hf = report["megatrain"], report["hf"]
        record["ratio_tokens_per_s_ours_over_hf"] = (
            ours["tokens_per_s_median"] / hf["tokens_per_s_median"]
        )
        # The fastest steps: the least disturbed by other work on a shared machine.
        record["ratio_tokens_per_s_best_ours_over_hf"] = (
            ours["tokens_per_s_best"] / hf["tokens_per_s_best"]
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print_table(record)
    print(f"wrote {args.out}")


def config_path(path: Path) -> Path:
    """Relative to the repository when inside it, so the JSON does not name this machine."""
    path = path.resolve()
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def print_table(record: dict) -> None:
    s, method = record["shape"], record["method"]
    kind = "Llama" if s["kind"] == "llama" else "GPT-2"
    if s.get("num_moe_experts"):
        kind += f" with {s['num_moe_experts']} experts ({s['moe_router_topk']} a token)"
    print(
        f"\n{kind} {s['num_layers']}x{s['hidden_size']}, {s['num_attention_heads']} heads, seq "
        f"{s['seq_length']}, vocab {s['vocab_size_padded']}, micro batch {s['micro_batch_size']}, "
        f"{s['precision']}, recompute {s['recompute']} on {record['machine']['device']}; "
        f"peak {method['peak_tflops']:.3g} TFLOP/s ({method['peak_source']})"
    )
    print(f"  {'model':21s} {'tokens/s':>10s} {'ms/step':>9s} {'TFLOP/s':>8s} {'MFU':>6s} "
          f"{'HFU':>6s} {'peak GiB':>9s} {'first loss':>10s} {'vs ours':>8s}")  # fmt: skip
    for name in ("megatrain", "megatrain-fp8", "megatrain-packed", "megatrain-cuda-graphs", "hf",
                 *peers.PEERS):  # fmt: skip
        r = record.get(name)
        if r is None:
            continue
        if r.get("skipped"):
            print(f"  {name:21s} skipped: {r['reason'][:150]}")
            continue
        memory = "-" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.2f}"
        print(
            f"  {name:21s} {r['tokens_per_s_median']:10.0f} {r['ms_per_step_median']:9.1f} "
            f"{r['model_tflops']:8.3g} {r['mfu']:6.1%} {r['hfu']:6.1%} {memory:>9s} "
            f"{r['losses'][0]:10.4f} {r['loss_check']['max_abs_diff_vs_megatrain']:8.4f}"
        )
    print("  (vs ours: the largest difference of its loss from ours over the steps)")
    for name in peers.PEERS:
        if "description" in record.get(name, {}):
            print(f"  {name}: {record[name]['description']}")
    if "ratio_tokens_per_s_ours_over_hf" in record:
        print(
            f"  ours / HF tokens/s: {record['ratio_tokens_per_s_ours_over_hf']:.3f} (median step), "
            f"{record['ratio_tokens_per_s_best_ours_over_hf']:.3f} (fastest step)"
        )


if __name__ == "__main__":
    main()
