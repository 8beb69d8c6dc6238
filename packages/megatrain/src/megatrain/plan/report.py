"""A plan as a table for people (`format_plan`) or as JSON for tools (`plan_dict`)."""

from dataclasses import asdict

from megatrain.plan.cost_model import MEMORY_PARTS, TIME_PARTS, Estimate
from megatrain.plan.hardware import CONSTANTS, GIB, OPTIONAL_CONSTANTS, Profile
from megatrain.plan.memory import HEADROOM
from megatrain.plan.search import Plan, compiled_float8


def _number(value: float) -> str:
    return f"{value:.3g}" if value < 1000 else f"{value:.0f}"


def _curve(points: tuple, x: str, y: str) -> str:
    """A profile's curve in brief: its values at its two ends."""
    (x0, y0), (x1, y1) = points[0], points[-1]
    return f"{y} {_number(y0)}-{_number(y1)} at {x} {_number(x0)}-{_number(x1)}"


def describe_profile(profile: Profile) -> str:
    kind = "measured" if profile.measured else "not measured"
    gemms = f"{profile.gemm_efficiency:.0%} of peak"
    if profile.gemm_efficiency_by_size:
        gemms = _curve(profile.gemm_efficiency_by_size, "GFLOP", "fraction of peak")
    return (
        f"profile {profile.name} ({kind}: {profile.source}): GEMMs at {gemms} + "
        f"{profile.gemm_overhead_us:g} us each; memory-bound kernels at "
        f"{profile.hbm_efficiency:.0%} of HBM bandwidth, non-GEMM ops moving "
        f"{profile.elementwise_passes:g} x the activation bytes; collectives at "
        f"{profile.collective_efficiency:.0%} of link bandwidth + "
        f"{profile.collective_latency_us:g} us"
    )


def describe_check(check: dict) -> str:
    """The published check rows of the plan's GPU generation (published.check_rows_summary)."""
    if not check["rows"]:
        untimed = f" it can time ({check['left_out']} need flash)" if check["left_out"] else ""
        return (
            f"published runs: no check rows on {check['generation']} GPUs{untimed}, so no "
            "measure of how far this profile is off"
        )
    off = ", ".join(f"{row['run']} {row['ratio']:.2f}" for row in check["off"])
    return (
        f"published runs: {check['within']} of {check['rows']} check rows on "
        f"{check['generation']} GPUs ({', '.join(check['gpus'])}) within "
        f"{check['tolerance']:.0%} with this profile, median absolute error "
        f"{check['median_abs_error']:.0%} (python benchmarks/bench_plan.py --published)"
        + (f"; off (predicted / published): {off}" if off else "")
    )


def describe_attention(gpu, profile: Profile, seq: int | None = None) -> str:
    if gpu.attention == "flash":
        rate = ""
        if seq is not None:
            tflops = profile.attention_flops(seq) / 1e12
            rate = f", {tflops:.3g} at s {seq}"
        curve = _curve(profile.attention_tflops, "s", "TFLOP/s")
        return (
            f"flash (one fused kernel at the profile's {curve}{rate}, causal half skipped, no "
            "s x s scores kept; in 16 bits without context parallelism; --attention unfused "
            f"for the 2019 kernels){_CONTEXT_PARALLEL}"
        )
    return (
        "unfused (the s x s scores written, read and kept; --attention flash for a fused "
        f"kernel){_CONTEXT_PARALLEL}"
    )


def describe_float8(gpu, profile: Profile, compiled: bool) -> str:
    """What training.precision = "fp8" is timed as (costs.Costs, FLOAT8_CAST_BYTES)."""
    peak = gpu.peak_flops("fp8") / 1e12
    casts = (
        "compiled (training.compile): an amax pass and one cast per tensor, torchao's roofline"
        if compiled
        else "eager, as torchao's ops run (33 bytes an element a cast; training.compile=true "
        "fuses them)"
    )
    return (
        f"the layers' linears in float8 at {profile.fp8_fraction():.0%} of the fp8 peak "
        f"({peak:.0f} TFLOP/s), their tensorwise casts {casts}; the attention, the output "
        "layer and the rest in bf16, MFU of the bf16 peak"
    )


# What cp > 1 runs whatever the GPU's attention (accounting.attention_kernel).
_CONTEXT_PARALLEL = (
    "; with context parallelism megacore's own: the p2p ring fused (a kernel call a ring step, "
    "causal half skipped; float32 torch ops with packed documents), the all-gather SDPA with a "
    "mask (every score computed), and for multi-latent attention the latent's gather (its KV "
    "latent gathered, the whole sequence's K/V up-projected on every rank, SDPA with a mask)"
)


def _estimate_dict(rank: int, e: Estimate) -> dict:
    return {
        "rank": rank,
        "layout": asdict(e.layout),
        "overrides": e.layout.overrides(),
        "microbatches": e.notes["microbatches"],
        "memory_gib": {k: e.memory[k] / GIB for k in (*MEMORY_PARTS, "total")},
        "memory_stage": e.memory["stage"],
        "host_checkpoint_copy_gib": e.memory["host_checkpoint_copy"] / GIB,
        "time_s": {k: e.time[k] for k in (*TIME_PARTS, "total")},
        "mfu": e.mfu,
        "tflops_per_gpu": e.tflops_per_gpu,
    }


def plan_dict(plan: Plan, top: int, check: dict | None = None) -> dict:
    """The plan for tools; `check`: published.check_rows_summary of its GPU and profile."""
    m, t = plan.config.model, plan.config.training
    compiled = compiled_float8(plan)
    return {
        "config": plan.config.name,
        "model": {
            "kind": m.kind,
            "num_layers": m.num_layers,
            "hidden_size": m.hidden_size,
            "num_attention_heads": m.num_attention_heads,
            "seq_length": t.seq_length,
            "precision": t.precision,
        },
        "global_batch": plan.global_batch,
        "gpus": plan.gpus,
        "gpu": asdict(plan.gpu),
        "usable_memory_gib": (1 - HEADROOM) * plan.gpu.memory_gib,
        "profile": {
            "name": plan.profile.name,
            "source": plan.profile.source,
            "measured": plan.profile.measured,
            **{k: getattr(plan.profile, k) for k in (*CONSTANTS, *OPTIONAL_CONSTANTS)},
            "gemm_efficiency_by_size": [list(p) for p in plan.profile.gemm_efficiency_by_size],
            "attention_tflops": [list(p) for p in plan.profile.attention_tflops],
            "published_check": check,
        },
        "enumerated": plan.enumerated,
        "fixed": plan.fixed,
        "fit": len(plan.ranked),
        "layouts": [_estimate_dict(i + 1, e) for i, e in enumerate(plan.ranked[:top])],
        # fp8 without training.compile: #1 timed with it (None where that does not apply)
        "first_compiled": None if compiled is None else _estimate_dict(1, compiled),
        "rejected": [
            {"reason": reason, **entry}
            for reason, entry in sorted(plan.rejected.items(), key=lambda kv: -kv[1]["count"])
        ],
    }


_LAYOUT = (
    f"{'#':>3} {'tp':>3} {'cp':<6} {'pp':>3} {'sched':<5} {'dp':>4} {'mb':>3} {'m':>4} "
    f"{'recompute':<9} {'sp':<3} {'dopt':<6} {'ep/etp':<6}"
)
_MEMORY = f"{'weight':>6} {'grad':>5} {'optim':>5} {'activ':>5} {'total':>5}"
_TIME = (
    f"{'compute':>7} {'tp':>6} {'cp':>6} {'ep':>6} {'bubble':>6} {'p2p':>6} {'dp':>6} "
    f"{'optim':>6} {'step':>7}"
)
_HEADER = f"{_LAYOUT} | {_MEMORY} | {_TIME} | {'MFU':>5}"
_GROUPS = (
    f"{'layout':<{len(_LAYOUT)}} | {'memory per GPU, GiB':<{len(_MEMORY)}} | "
    f"{'step time, s':<{len(_TIME)}} |"
)


def _schedule(layout) -> str:
    """The pipeline schedule in the table: 1f1b, zb-h1, or vpp<n> for interleaved."""
    if layout.pp == 1:
        return "-"
    return f"vpp{layout.vpp}" if layout.vpp > 1 else layout.schedule


def _context(layout) -> str:
    """cp in the table: 1, or the size and its communication (p2p ring, ag: all-gather, lat:
    multi-latent attention's latent gather)."""
    if layout.cp == 1:
        return "1"
    return f"{layout.cp} {_CP_COMM_SHORT.get(layout.cp_comm, layout.cp_comm)}"


_CP_COMM_SHORT = {"allgather": "ag", "latent": "lat"}


def _sharding(layout) -> str:
    """dopt in the table: no, yes (the distributed optimizer), full (FSDP), full/m (FSDP
    reduce-scattering every microbatch's gradients)."""
    if layout.fsdp:
        return "full/m" if layout.reduce_every_microbatch else "full"
    return "yes" if layout.distributed_optimizer else "no"


def _experts(layout) -> str:
    """ep/etp in the table: the experts' parallel and tensor-parallel sizes (- when dense)."""
    if layout.ep == 1 and layout.etp is None:
        return "-"
    return f"{layout.ep}/{layout.expert_tp}"


def _row(rank: int, e: Estimate) -> str:
    layout, mem, time = e.layout, e.memory, e.time
    flag = {True: "yes", False: "no"}
    return (
        f"{rank:>3} {layout.tp:>3} {_context(layout):<6} {layout.pp:>3} {_schedule(layout):<5} "
        f"{layout.dp:>4} {layout.micro_batch:>3} {e.notes['microbatches']:>4} "
        f"{layout.recompute:<9} {flag[layout.sequence_parallel]:<3} "
        f"{_sharding(layout):<6} "
        f"{_experts(layout):<6} | "
        + " ".join(
            f"{mem[k] / GIB:>{w}.1f}"
            for k, w in zip((*MEMORY_PARTS, "total"), (6, 5, 5, 5, 5), strict=True)
        )
        + " | "
        + " ".join(
            f"{time[k]:>{w}.3f}"
            for k, w in zip((*TIME_PARTS, "total"), (7, 6, 6, 6, 6, 6, 6, 6, 7), strict=True)
        )
        + f" | {e.mfu:>5.1%}"
    )


def format_plan(plan: Plan, top: int, check: dict | None = None) -> str:
    """The plan for people; `check`: published.check_rows_summary of its GPU and profile."""
    m, t = plan.config.model, plan.config.training
    gpu = plan.gpu
    lines = [
        f"megatrain plan: {plan.config.name} ({m.kind}, {m.num_layers} layers, hidden "
        f"{m.hidden_size}, {m.num_attention_heads} heads, seq {t.seq_length}, {t.precision}), "
        f"global batch {plan.global_batch}, on {plan.gpus} x {gpu.key} in nodes of "
        f"{gpu.gpus_per_node}",
        f"time model: {describe_profile(plan.profile)}",
        *([describe_check(check)] if check else []),
        f"attention: {describe_attention(gpu, plan.profile, t.seq_length)}",
        *(
            [f"fp8: {describe_float8(gpu, plan.profile, t.compile)}"]
            if t.precision == "fp8"
            else []
        ),
        *(
            [
                "searched only: "
                + ", ".join(f"{name} {value}" for name, value in plan.fixed.items())
                + " (--fix)"
            ]
            if plan.fixed
            else []
        ),
        f"{plan.enumerated} layouts: {len(plan.ranked)} fit in "
        f"{(1 - HEADROOM) * gpu.memory_gib:.1f} GiB ({1 - HEADROOM:.0%} of {gpu.memory_gib:g}), "
        f"{plan.enumerated - len(plan.ranked)} refused",
        "",
    ]
    if plan.ranked:
        lines += [
            _GROUPS,
            _HEADER,
            *(_row(i + 1, e) for i, e in enumerate(plan.ranked[:top])),
            "",
            "m: microbatches per iteration; memory: the fullest pipeline stage; cp: context "
            "parallel size and its attention's communication (p2p ring, ag all-gather, lat the "
            "latent's gather); "
            "dopt: the distributed optimizer (yes) or FSDP (full; full/m reduce-scatters every "
            "microbatch's gradients); ep/etp: the experts' parallel and tensor-parallel sizes",
            "to run #1: megatrain run --config <config> "
            + " ".join(plan.ranked[0].layout.overrides()),
        ]
        compiled = compiled_float8(plan)
        if compiled is not None:
            lines.append(
                f"fp8 without training.compile: #1's float8 casts run as torch ops; with "
                f"training.compile=true it would take {compiled.time['total']:.3f} s a step "
                f"({compiled.mfu:.1%} MFU) in place of {plan.ranked[0].time['total']:.3f} s"
            )
        if plan.config.checkpoint.async_save:
            copy = plan.ranked[0].memory["host_checkpoint_copy"] / GIB
            lines.append(
                f"checkpoint.async_save: #1 keeps {copy:.1f} GiB of host memory per GPU (a copy "
                "of the rank's weights and optimizer state for the background write)"
            )
    else:
        lines.append("no layout fits.")
    if plan.rejected:
        lines += ["", "refused:"]
        for reason, entry in sorted(plan.rejected.items(), key=lambda kv: -kv[1]["count"]):
            lines.append(f"  {entry['count']:>5}  {reason}")
            if entry["example"]:
                lines.append(f"         e.g. {entry['example']}")
    return "\n".join(lines)
