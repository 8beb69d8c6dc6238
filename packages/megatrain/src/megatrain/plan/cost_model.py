"""Memory per GPU and step time of one layout of a training config on one kind of GPU.

Memory is megatrain.plan.memory's estimate of the fullest pipeline stage (weights, fp32
gradients and optimizer state by megacore's bytes-per-parameter table, with and without
the distributed optimizer; Korthikanti et al.'s activations with sequence parallelism and
selective/full recompute; the microbatches 1F1B and interleaved 1F1B keep in flight).

Time of one iteration, built from the data sheet (`Gpu`) and its profile (`Profile`: the
GPU's generation in gpus.toml, or `--profile FILE`), for one TP rank of each pipeline stage
and one microbatch of b sequences of s tokens:

- **GEMMs**: each takes max(FLOPs / (peak e), bytes / HBM) + tau: compute-bound at e of
  peak (`gemm_efficiency`, or `gemm_efficiency_by_size` at the GEMM's FLOPs), memory-bound
  when its operands are thin (the attention's per-head products at a small head size: why
  more heads scale worse, the paper's Table 7), plus a fixed time tau per GEMM
  (`gemm_overhead_us`), equivalently an efficiency e W / (W + W_half) that falls with the
  per-GPU size W of the GEMM, W_half = tau e peak: why splitting a small model over more
  GPUs gains less (Table 8).  Per layer: the
  model's own GEMMs (`accounting.layer_gemms`, the list the FLOP count sums: QKV, or Q and
  grouped K/V; the projection; the MLP's two, or SwiGLU's three; a MoE layer's router,
  experts and shared expert), each split over tp as the model splits it; the backward
  runs two GEMMs per forward one (the input's and the weight's gradients).  Under fp8
  (`training.precision = "fp8"`) the linears megatrain converts (`accounting.float8_gemm`)
  run at the fp8 peak x the profile's `fp8_gemm_efficiency`, float8 operands and a bf16
  output, plus torchao's tensorwise casts of their input, weight and output gradient,
  memory-bound (`costs.FLOAT8_CAST_BYTES`: as torch ops run them eager, or fused under
  `training.compile`); everything else runs in bf16, and MFU is of the bf16 peak.
- **The attention core** (`attention_core_seconds`), as the GPU's entry says it runs
  (`Gpu.attention`, `megatrain plan --attention`): "unfused", the 2019 kernels, two
  products per head (the s x s scores written and read, their softmax and dropout among
  the non-GEMM ops); "flash" (16 bits, cp 1), one fused kernel at the profile's
  `attention_tflops` for the sequence length (FlashAttention's figures), moving O(s h)
  bytes, doing half the score FLOPs of causal attention, its backward 2.5 x its forward.
  Two implementations published runs ran are timed as they ran, for checking the model
  against them (published_runs.toml's `attention`): "flash_triton" (FlashAttention in
  Triton, `TRITON_FLASH_SLOWDOWN` x FlashAttention-2's time) and "fused_softmax"
  (Megatron-LM's fused softmax: the unfused products, and the bytes its kernels move over
  each score, `FUSED_SOFTMAX_BYTES`, in place of the element-wise passes over them).
- **Non-GEMM ops** (LayerNorm, GeLU, softmax, dropout, residual adds) are memory-bound:
  `elementwise_passes` x the bytes of activations the layer stores
  (`accounting.activations_per_layer`, recompute "none") / HBM bandwidth (the data
  sheet's x `hbm_efficiency`, as for every memory-bound term), twice that in the
  backward.  Without sequence parallelism the LayerNorms and dropouts run whole on every
  TP rank, as the formula's replicated 10 s b h says.
- **Recompute**: full reruns each layer's forward (GEMMs, ops and its all-reduces) in the
  backward; selective reruns the attention core (its two GEMMs and its softmax/dropout).  A
  published run's "op_selective" (torchtitan's op-level policy,
  `accounting.RECOMPUTE_IMPLEMENTATIONS`) reruns the GEMMs `OP_SELECTIVE_RERUN` names and
  every non-GEMM op of the forward.
- **TP communication** (on the critical path): per layer 2 all-reduces of s b h in the
  forward and 2 in the backward (Fig. 4), or with sequence parallelism an all-gather and a
  reduce-scatter for each (the same bytes, twice the latency), plus the embedding's and the
  output layer's; with sequence parallelism and `parallel.tp_comm_overlap` each of the
  layer's collectives runs as ring steps behind the chunks of its GEMM, and only what it
  takes beyond them shows (`tp_overlap_seconds`).  A collective over n GPUs moving N bytes takes
  latency + f N / (bandwidth x `collective_efficiency`) with the ring's f = 2 (n-1)/n for
  an all-reduce, (n-1)/n for an all-gather or reduce-scatter; the bandwidth is NVLink's
  inside a node, the network's share of the GPUs of a group between nodes.
- **Context parallelism** (cp > 1; each CP rank computes its s / cp tokens of every
  sequence, so every per-token term above is at s / cp, and the attention core is its
  s / cp queries against all s keys): per layer, the K/V of the other ranks' tokens,
  (cp - 1)/cp x 2 b s (g / t) d bytes received per rank (g key/value groups of d, t tp),
  over the CP group's links (NVLink when tp x cp GPUs fit a node, else the network).
  "allgather": an all-gather in the forward and the K/V gradients' reduce-scatter in the
  backward, neither overlapped.  "p2p": cp - 1 ring steps, each passing a block of
  2 b (s / cp) (g / t) d bytes to the next rank while the attention of the block in hand
  runs, so only what a transfer takes beyond its block's attention is exposed; megacore's
  fused ring (no packed documents) runs the ring again in the backward, each step passing a
  block and its float32 K/V gradient on behind the step's kernel, the last gradient (going
  home) exposed; the float32 ring (packed documents) sends each block's gradient back
  before the next block's backward starts, exposed.  Multi-latent attention's K/V are
  2 a d_q numbers a token, V zero-padded to the QK width (`accounting.attention_widths`);
  its "latent" gathers and
  reduce-scatters as "allgather" does but only the compressed latent and rope key, r_kv +
  d_r numbers a token whatever tp, and each rank up-projects the whole sequence's K/V
  (`attention_time.latent_up_projection_seconds`, in the layer's compute).  Under selective
  or full recompute the attention (and so its communication) runs again in the backward.
  The attention core
  runs as megacore runs it (`accounting.attention_kernel`): "allgather" in 16 bits with
  flash on the GPU is "masked", SDPA with megacore's boolean mask, which runs cuDNN's or the
  memory-efficient fused kernel (no scores kept, but every score computed, and the mask read
  for each head); "p2p" is "ring", the fused ring (a flash kernel call a step, causal
  attention's half of the scores, as flash at cp 1), or with packed documents
  "ring_float32", float32 torch ops (GEMMs at the fp32 peak, the passes over each block's
  scores memory-bound).
- **Pipeline**: with T_r the time of stage r for one microbatch (layers, embedding on the
  first, the output layer and loss on the last, with multi-token prediction's depths
  (`mtp_time.mtp_seconds`) there too, the point-to-point sends of the
  activation and its gradient, per model chunk), an iteration of m microbatches takes
  m max T_r + (sum T_r - max T_r) / vpp: the slowest stage paces the steady state, the
  fill and drain cross every other stage once, vpp times faster when interleaved
  ((p - 1) / (m vpp) of the steady state when the stages are equal).  ZB-H1 fills the
  drain with deferred weight gradients: (sum T_r - max T_r) (F + max(0, B - W)) / T, F,
  B and W the forward, input-gradient and weight-gradient shares of a layer's time T (a
  third of 1F1B's bubble when the three are equal; the fill, F per stage, stays).
  `schedule_seconds` runs megacore's own schedule tables with these times: the tests hold
  the two equal when the stages are equal or the last one (output layer and loss) is the
  slowest (and for ZB-H1 at equal stages), and the formula at most 6% above the tables
  when the first one is 10% slower.
- **Data parallelism**: the fp32 gradients' all-reduce over dp x cp (CP ranks hold whole
  replicas too; reduce-scatter, and an all-gather of the 16-bit weights, under the
  distributed optimizer, which shards over dp x cp); with
  `overlap_grad_reduce` it runs behind the last microbatch's backward and only what is
  left over (at least the last bucket) is exposed.  With pp > 1 the tied embedding's
  gradients are all-reduced between the first and last stage.  Fully sharded (`fsdp`,
  `data_parallel_sharding = "full"`): the fp32 gradients reduce-scattered once a step (every
  microbatch with `reduce_every_microbatch`, each behind that microbatch's backward), and the
  16-bit weights all-gathered in every microbatch's forward (and again in its backward when
  resharded after the forward), each layer's gather behind the previous layer's compute; a
  backward's gathers and reduce-scatters share the link, so together they hide behind it
  (`_fsdp_exposed`).
- **Optimizer step**: memory-bound, the bytes Adam reads and writes per parameter / HBM.

MFU is the model FLOPs of an iteration (megatrain.plan.accounting.flops_per_iteration) over the time
and the peak of every GPU.
"""

from dataclasses import dataclass, field

from megacore.pipeline_parallel import order_1f1b, order_interleaved, order_zb_h1, timeline
from megatrain.config import Config
from megatrain.models import model_config
from megatrain.models.transformer_config import TransformerConfig
from megatrain.plan.accounting import (
    MASKED_LM_PROB,
    OP_SELECTIVE_RERUN,
    activations_per_layer,
    attention_kernel_for,
    float8_gemm,
    flops_per_iteration,
    layer_gemms,
    stage_layers,
)
from megatrain.plan.attention_time import (
    FUSED_SOFTMAX_BYTES,
    FUSED_SOFTMAX_DROPOUT_BYTES,
    attention_core_seconds,
    context_parallel_seconds,
    latent_up_projection_seconds,
)
from megatrain.plan.costs import Costs, group_bandwidth
from megatrain.plan.hardware import Gpu, Profile
from megatrain.plan.layout import Layout, apply_layout
from megatrain.plan.memory import HEADROOM, memory_breakdown, weighed_stages
from megatrain.plan.mtp_time import mtp_seconds

# Bytes Adam moves per parameter in one step (megacore's optimizer): it reads the fp32
# gradient, master weight and two moments and writes the last three (28); the gradient
# norm reads the gradient (4); the 16-bit model copies its weights from the masters (6);
# zeroing the gradient buffer writes it (4).  Sharded by the distributed optimizer but the
# last: the whole buffer is zeroed.
ADAM_BYTES = {"sharded": 28 + 4, "copy_16bit": 6, "zero_grads": 4}
TIME_PARTS = (
    "compute", "tp_comm", "cp_comm", "ep_comm", "pp_bubble", "pp_p2p", "dp_comm", "optimizer",
)  # fmt: skip
MEMORY_PARTS = ("weights", "gradients", "optimizer_state", "activations")


@dataclass
class Estimate:
    layout: Layout
    memory: dict  # bytes per GPU of the fullest stage: MEMORY_PARTS, total, stage
    time: dict  # seconds per iteration: TIME_PARTS, total
    mfu: float
    tflops_per_gpu: float  # hardware FLOPs (recompute included) per second per GPU
    fits: bool
    notes: dict = field(default_factory=dict)


def layer_seconds(
    config: Config,
    layout: Layout,
    costs: Costs,
    bandwidth: float,
    cp_bandwidth: float = 0.0,
    moe: bool = False,
    ep_bandwidth: float = 0.0,
    cfg: TransformerConfig | None = None,
) -> dict:
    """Seconds one layer takes for one microbatch on one TP rank, by part (`bandwidth`: the
    TP group's, `cp_bandwidth`: the CP group's); `moe`: a MoE layer (`moe_seconds`, its
    all-to-alls over `ep_bandwidth`).  The GEMMs are the model's (`accounting.layer_gemms`
    of `cfg`, the config's model when None)."""
    m, t = config.model, config.training
    cp, s, b, tp = layout.cp, t.seq_length, layout.micro_batch, layout.tp
    local = s // cp  # the rank's tokens of each sequence
    cfg = cfg or model_config(config, m.vocab_size or 1)  # the layers do not see the vocabulary
    tokens, h = local * b, m.hidden_size
    gemms = _dense_gemms(cfg, tp, moe)
    dense = [costs.linear_fwd_bwd(tokens, n, k, float8) for k, n, float8 in gemms]
    experts = moe_seconds(config, layout, costs, tokens, ep_bandwidth, cfg) if moe else {}
    core = attention_core_seconds(config, cfg, layout, costs)
    scale = 2 if t.precision == "fp32" else 1  # the activation formula counts 16-bit bytes
    attention = costs.attention
    selective = activations_per_layer(config, "selective", moe, attention)
    # What the attention core's softmax and masks move among the layer's element-wise passes:
    # for the unfused kernels the s x s scores as the 2019 model counts them (Korthikanti's
    # 5 a s / h, at the rank's s / cp queries against s keys); the fused kernels keep none,
    # and the float32 ring's passes over its scores are attention_core_seconds' own.
    a = m.num_attention_heads
    kernel = attention_kernel_for(
        attention, t.precision, cp, layout.cp_comm, config.data.reset_attention_mask
    )
    core_bytes = 5 * a * local * s * b / tp if kernel == "unfused" else 0.0
    ops = costs.elementwise(scale * (selective + core_bytes))
    core_ops = costs.elementwise(scale * core_bytes)
    backward_ops = 2 * ops
    if costs.attention == "fused_softmax" and kernel == "unfused":
        # Megatron-LM's fused softmax: the bytes its kernels move, not passes over what it keeps
        moved = dict(FUSED_SOFTMAX_BYTES)
        if m.attention_dropout:
            moved = {k: v + FUSED_SOFTMAX_DROPOUT_BYTES[k] for k, v in moved.items()}
        scores = scale * a * local * s * b / tp
        core_ops = costs.memory_bound(moved["forward"] * scores)
        ops = costs.elementwise(scale * selective) + core_ops
        backward_ops = 2 * costs.elementwise(scale * selective)
        backward_ops += costs.memory_bound(moved["backward"] * scores)
    activation = costs.element * tokens * h
    if layout.sequence_parallel:  # an all-gather and a reduce-scatter for each all-reduce
        one_way = 4 * costs.collective("all_gather", activation, tp, bandwidth)
    else:
        one_way = 2 * costs.collective("all_reduce", activation, tp, bandwidth)
    # cp_comm_type "latent": the whole sequence's K/V up-projected on each CP rank
    latent = latent_up_projection_seconds(config, cfg, layout, costs)
    forward = sum(g[0] for g in dense) + sum(g[0] for g in core) + ops + latent[0]
    backward = sum(g[1] for g in dense) + sum(g[1] for g in core) + backward_ops + latent[1]
    # The dense weights' gradients: what ZB-H1 defers to its W steps (bf16 GEMMs: megatrain
    # refuses ZB-H1 with fp8).
    weight = sum(costs.gemm(k, n, tokens) for k, n, _ in gemms)
    if moe:
        forward += experts["forward"]
        backward += experts["backward"]
        weight += experts["weight_grads"]
    if layout.recompute == "op_selective":  # a published run's: its rerun GEMMs, every other op
        names = [g.name for g in layer_gemms(cfg, moe) if g.name not in _ROUTED]
        forwards = dict(zip(names, (g[0] for g in dense), strict=True))
        recompute = sum(share * forwards[n] for n, share in OP_SELECTIVE_RERUN.items()) + ops
    else:
        recompute = {
            "none": 0.0,
            # the core (and under "latent" the up-projection inside it) again
            "selective": sum(g[0] for g in core) + core_ops + latent[0],
            "full": forward,
        }[layout.recompute]
    comm = one_way * (3 if layout.recompute == "full" else 2)
    if layout.sequence_parallel and config.parallel.tp_comm_overlap:
        passes = 3 if layout.recompute == "full" else 2  # the forward runs again under full
        comm = tp_overlap_seconds(cfg, tp, moe, dense, one_way / 4, passes)
    # "backward": what runs in the backward pass (for overlapping the gradients' reduction)
    return {
        "compute": forward + backward + recompute,
        "tp_comm": comm,
        # dispatch and combine in the forward, their gradients in the backward, the forward's
        # again under full recompute
        "ep_comm": experts.get("all_to_all", 0.0) * (3 if layout.recompute == "full" else 2),
        "cp_comm": context_parallel_seconds(
            config,
            layout,
            costs,
            sum(g[0] for g in core),
            cp_bandwidth,
            sum(g[1] for g in core),
        ),
        "backward": backward + recompute,
        "weight_grads": weight,
    }


def tp_overlap_seconds(
    cfg: TransformerConfig,
    tp: int,
    moe: bool,
    dense: list[tuple[float, float]],
    collective: float,
    passes: int,
) -> float:
    """Exposed seconds of one layer's sequence-parallel TP communication for one microbatch
    under `parallel.tp_comm_overlap`: each all-gather feeding a column-parallel GEMM and each
    reduce-scatter of a row-parallel GEMM's output runs as tp - 1 ring steps behind tp - 1
    of the tp chunks of its GEMM, so a collective of `collective` seconds shows
    max(0, collective - (tp - 1)/tp x GEMM): in the forward the attention's input gather
    behind its column GEMMs (qkv, or q and kv) and the projection's reduce-scatter behind the
    projection, the MLP's likewise (gate and fc1; fc2); in the backward the column GEMMs'
    input-gradient reduce-scatters and the row GEMMs' output-gradient gathers behind their
    input-gradient GEMMs (half a GEMM's backward).  A MoE layer's MLP collectives stay
    exposed (its dispatcher moves the tokens).  `dense`: the (forward, backward) seconds of
    `accounting.layer_gemms` less the routed ones, in their order; `passes` forwards (2:
    forward and backward, 3 under full recompute)."""
    names = [g.name for g in layer_gemms(cfg, moe) if g.name not in _ROUTED]
    times = dict(zip(names, dense, strict=True))
    columns = [("qkv", "q", "kv"), ("proj",)]
    if not moe:
        columns += [("gate", "fc1"), ("fc2",)]
    share = (tp - 1) / tp

    def exposed(direction: int) -> float:
        hidden = [sum(times[n][direction] for n in group if n in times) for group in columns]
        # the backward's input-gradient GEMM is about half of a GEMM's backward
        scale = 1.0 if direction == 0 else 0.5
        return sum(max(0.0, collective - share * scale * g) for g in hidden) + collective * (
            4 - len(columns)
        )

    forward, backward = exposed(0), exposed(1)
    return forward * (passes - 1) + backward


def moe_seconds(
    config: Config,
    layout: Layout,
    costs: Costs,
    tokens: float,
    bandwidth: float,
    cfg: TransformerConfig | None = None,
) -> dict:
    """One MoE layer's experts for one microbatch on one rank, the dense MLP's replacement:

    - the router, [T, h] x [h, E] (T = the rank's tokens, / tp: MoE at tp > 1 runs with
      sequence parallelism);
    - the experts' GEMMs at their active size: T k copies of tokens spread evenly over the
      E / ep local experts (a balanced router), x etp (an etp group takes its ranks' tokens)
      at f_e / etp, as one grouped GEMM per matrix (a batch of E / ep);
    - permute and unpermute: each copy read and written, forward and backward
      (memory-bound);
    - "all_to_all": the dispatch and the combine of one pass, each the rank's T k copies of
      h over the ep group (expert-parallel ranks etp apart; NVLink when the group fits a
      node: `bandwidth`).  The step runs it forward and backward: 4 all-to-alls a layer.
    """
    m = config.model
    cfg = cfg or model_config(config, m.vocab_size or 1)
    h, E, k = m.hidden_size, m.num_moe_experts, m.moe_router_topk
    tp, ep, etp = layout.tp, layout.ep, layout.expert_tp
    local = tokens / tp  # sequence parallel: each TP rank routes its own tokens
    copies = local * k * etp  # what this rank's experts take (its etp group's tokens)
    per_expert = copies / (E // ep)
    gemms = {g.name: g.per_rank(tp, etp) for g in layer_gemms(cfg, moe=True)}
    shapes = [  # (m, n, k, batch): [m, k] x [k, n]
        (local, *gemms["router"][::-1], 1),
        (per_expert, *gemms["experts.weight1"][::-1], E // ep),  # gate and up in one
        (per_expert, *gemms["experts.weight2"][::-1], E // ep),
    ]
    gemms = [costs.gemm_fwd_bwd(*shape) for shape in shapes]
    # permute and unpermute, forward and backward: each copy of h read and written
    moved = 2 * 2 * costs.element * local * k * h
    a2a = costs.element * local * k * h
    return {
        "forward": sum(g[0] for g in gemms) + costs.memory_bound(moved),
        "backward": sum(g[1] for g in gemms) + costs.memory_bound(moved),
        "weight_grads": sum(costs.gemm(kk, n, mm, bb) for mm, n, kk, bb in shapes),
        "all_to_all": 2 * costs.collective("all_to_all", a2a, ep, bandwidth),
    }


# A MoE layer's GEMMs `moe_seconds` times (as grouped GEMMs, over the expert layout).
_ROUTED = ("router", "experts.weight1", "experts.weight2")


def _dense_gemms(cfg: TransformerConfig, tp: int, moe: bool) -> list[tuple[float, float, bool]]:
    """(input size, output size, in float8 under fp8) of a layer's dense GEMMs on one TP rank,
    as the model runs them (`accounting.layer_gemms`: qkv or q and kv, the projection, the
    MLP or the shared expert; `accounting.float8_gemm`)."""
    gemms = [g for g in layer_gemms(cfg, moe) if g.name not in _ROUTED]
    return [(*g.per_rank(tp), float8_gemm(g, tp)) for g in gemms]


def _ends(config: Config, layout: Layout, costs: Costs, vocab: int, bandwidth: float):
    """(first stage's embedding, last stage's output layer and loss): seconds per microbatch."""
    t, h, tp = config.training, config.model.hidden_size, layout.tp
    s, b = t.seq_length // layout.cp, layout.micro_batch  # the rank's tokens
    activation = costs.element * s * b * h
    kind = "all_gather" if layout.sequence_parallel else "all_reduce"
    embed = {
        "compute": 3 * costs.elementwise(costs.element * s * b * h),
        "tp_comm": costs.collective(kind, activation, tp, bandwidth),
    }
    predicted = s * b * (MASKED_LM_PROB if config.model.kind == "bert" else 1.0)
    gemms = [costs.gemm_fwd_bwd(predicted, vocab / tp, h)]
    if config.model.kind == "bert":  # the LM head's dense layer before the logits
        gemms.append(costs.gemm_fwd_bwd(predicted, h, h))
    logits = 4 * predicted * vocab / tp  # fp32, as memory.py counts them
    head = {
        "compute": sum(f + bw for f, bw in gemms) + 3 * costs.elementwise(logits),
        # the output layer's input (all-gather or the backward's all-reduce) and the
        # vocab-parallel cross entropy's three small all-reduces (max, sum, target logit)
        "tp_comm": costs.collective(kind, activation, tp, bandwidth)
        + 3 * costs.collective("all_reduce", 4 * predicted, tp, bandwidth),
    }
    return embed, head


def pipeline_seconds(
    stage_seconds: list[float], microbatches: int, vpp: int = 1, fill: float | None = None
) -> float:
    """One iteration of 1F1B (vpp 1), interleaved 1F1B or ZB-H1, stage r taking
    stage_seconds[r] per microbatch (all its chunks, forward and backward):
    m max + (sum - max) x fill, where fill is 1 / vpp, or for ZB-H1 (F + max(0, B - W)) /
    (F + B + W) of a microbatch's time (forward, input gradient, weight gradient)."""
    slowest = max(stage_seconds)
    fill = 1 / vpp if fill is None else fill
    return microbatches * slowest + (sum(stage_seconds) - slowest) * fill


def schedule_seconds(
    microbatches: int,
    forward: list[float],
    backward: list[float],
    vpp: int = 1,
    weight: list[float] | None = None,
) -> float:
    """One iteration run by megacore's schedule tables (1F1B, interleaved at vpp > 1, or
    ZB-H1 when `weight` gives the weight-gradient share of each backward): rank r spends
    forward[r] / vpp on the forward of one chunk of a microbatch and backward[r] / vpp on
    its backward (of which weight[r] in W), and starts a step once its input has been
    produced (communication free).  For checking `pipeline_seconds`."""
    pp = len(forward)
    if weight is not None:
        orders = [order_zb_h1(microbatches, pp, r) for r in range(pp)]
    elif vpp > 1:
        orders = [order_interleaved(microbatches, pp, r, vpp) for r in range(pp)]
    else:
        orders = [order_1f1b(microbatches, pp, r) for r in range(pp)]
    w = weight or [0.0] * pp

    def cost(rank: int, step) -> float:
        return {
            "F": forward[rank] / vpp,
            "B": (backward[rank] - w[rank]) / vpp,
            "W": w[rank],
        }[step.kind]

    times = timeline(orders, vpp, cost)
    return max(end for _, end in times.values())


def memory_per_gpu(
    config: Config, vocab: int, dp: int, attention: str = "unfused", recompute: str | None = None
) -> dict:
    """Bytes per GPU of the fullest pipeline stage (megatrain.plan.memory), by part;
    `recompute`: the config's (None), or a published run's policy (a layout's)."""
    model = model_config(config, vocab)
    stages = {
        stage: memory_breakdown(
            config,
            recompute,
            vocab_size=vocab,
            data_parallel_size=dp,
            stage=stage,
            attention=attention,
            model=model,
        )
        for stage in weighed_stages(config)
    }
    stage = max(stages, key=lambda s: stages[s]["total"])
    fullest = stages[stage]
    return {
        **{part: fullest[part] for part in MEMORY_PARTS},
        "total": fullest["total"],
        "parameters": max(b["parameters"] for b in stages.values()),
        "expert_parameters": max(b["expert_parameters"] for b in stages.values()),
        "host_checkpoint_copy": max(b["host_checkpoint_copy"] for b in stages.values()),
        "stage": stage,
    }


def _fsdp_exposed(
    gather: float,
    reduce: float,
    forward: float,
    backward: float,
    layers: int,
    microbatches: int,
    reductions: int,
    reshard: bool,
) -> tuple[float, float]:
    """(exposed gathers, exposed reduce-scatters) of FSDP in a step, from one gather of the
    stage's parameters (`gather` seconds), one reduce-scatter of its gradients (`reduce`) and
    one microbatch's `forward` and `backward` seconds over its `layers` layers.  Each
    microbatch's forward gathers every layer, each prefetched behind the previous layer's
    forward but the first; its backward gathers them again when resharded after the forward,
    and on the `reductions` microbatches that reduce (the last, or every one) reduce-scatters
    each layer's gradients as its backward ends, the last layer's after all compute.  A
    backward's gathers and reduce-scatters share the link: together they hide behind the
    backward, not each behind all of it."""
    first = gather / layers  # the first layer's gather, before any compute
    forward_exposed = max(first, gather - forward)
    regather = gather if reshard else 0.0
    plain = max(first if reshard else 0.0, regather - backward)
    reducing = max(
        (first if reshard else 0.0) + reduce / layers, regather + reduce - backward
    )  # fmt: skip
    # the reduce-scatters' share of a reducing backward's exposed time, the rest the gathers'
    share = reduce / (regather + reduce) if regather + reduce else 0.0
    gathers = microbatches * forward_exposed + (microbatches - reductions) * plain
    gathers += reductions * (1 - share) * reducing
    return gathers, reductions * share * reducing


def estimate(
    config: Config,
    layout: Layout,
    gpu: Gpu,
    profile: Profile,
    vocab_size: int,
    global_batch: int | None = None,
    memory: dict | None = None,
) -> Estimate:
    """Memory and step time of `config` at `layout` on GPUs `gpu` (`vocab_size`: the
    tokenizer's, padded here for tp); `memory`: `memory_per_gpu` of the config at the layout
    where the caller has it (the search, which estimates only the layouts that fit)."""
    config = apply_layout(config, layout, global_batch)
    t, p = config.training, config.parallel
    tp, cp, pp, dp, vpp = layout.tp, layout.cp, layout.pp, layout.dp, layout.vpp
    microbatches = t.global_batch_size // (layout.micro_batch * dp)
    cfg = model_config(config, vocab_size)
    costs = Costs(gpu, profile, t.precision, compiled=t.compile)
    memory = memory or memory_per_gpu(config, vocab_size, dp, gpu.attention, layout.recompute)

    tp_bandwidth = group_bandwidth(gpu, tp, 1)
    # tp-cp-dp-pp: a CP group's members are tp ranks apart, its data-parallel peers tp x cp.
    cp_bandwidth = group_bandwidth(gpu, cp, tp)
    layer = layer_seconds(config, layout, costs, tp_bandwidth, cp_bandwidth, cfg=cfg)
    moe_layer = layer
    if cfg.num_moe_experts:  # expert-parallel ranks are etp apart (tp-ep-dp-pp for experts)
        ep_bandwidth = group_bandwidth(gpu, layout.ep, layout.expert_tp)
        moe_layer = layer_seconds(
            config, layout, costs, tp_bandwidth, cp_bandwidth, True, ep_bandwidth, cfg
        )
    embed, head = _ends(config, layout, costs, cfg.vocab_size, tp_bandwidth)
    # Point-to-point: each chunk of each microbatch sends its output on and its input's
    # gradient back (split over TP under sequence parallelism); over the network as soon
    # as one stage boundary crosses nodes (the slowest boundary paces the pipeline).
    p2p = 0.0
    if pp > 1:
        sent = costs.element * t.seq_length // cp * layout.micro_batch * cfg.hidden_size
        sent /= tp if layout.sequence_parallel else 1
        within = layout.gpus <= gpu.gpus_per_node
        link = gpu.intra_node_gbps if within else gpu.inter_node_gbps
        p2p = 2 * vpp * costs.collective("p2p", sent, 2, link * 1e9)
    # multi-token prediction's depths, on the last stage (the slower by them unless a
    # pipeline layout gives it fewer layers; the slowest stage paces the pipeline)
    mtp = mtp_seconds(
        config, layout, costs, {False: layer, True: moe_layer}, embed, head, tp_bandwidth, cfg
    )
    stages = []
    held = [stage_layers(cfg, pp, stage) for stage in range(pp)]  # (dense, MoE) a stage
    # the layers whose backward hides the data-parallel reductions: the fullest stage's
    layers = max(sum(h) for h in held)
    for stage, (dense, moe) in enumerate(held):
        parts = {
            k: dense * layer[k] + moe * moe_layer[k]
            for k in ("compute", "tp_comm", "cp_comm", "ep_comm")
        }
        for end, here in ((embed, stage == 0), (head, stage == pp - 1), (mtp, stage == pp - 1)):
            if here:
                parts = {k: parts[k] + end.get(k, 0.0) for k in parts}
        stages.append({**parts, "pp_p2p": p2p})
    totals = [sum(s.values()) for s in stages]
    slowest = stages[totals.index(max(totals))]
    time = {
        k: microbatches * slowest[k] for k in ("compute", "tp_comm", "cp_comm", "ep_comm", "pp_p2p")
    }
    fill = None
    if layout.schedule == "zb-h1":  # the deferred weight gradients fill the drain
        layer = moe_layer  # (the MoE layers' shares where there are any)
        forward = layer["compute"] - layer["backward"]
        input_grads = layer["backward"] - layer["weight_grads"]
        fill = (forward + max(0.0, input_grads - layer["weight_grads"])) / layer["compute"]
    time["pp_bubble"] = pipeline_seconds(totals, microbatches, vpp, fill) - microbatches * max(
        totals
    )

    # Data parallelism and the optimizer, for the stage holding the most parameters: the
    # gradients are reduced over dp x cp ranks (CP ranks hold whole replicas too), a group
    # of ranks tp apart.
    params = memory["parameters"]
    replicas = dp * cp
    dp_bandwidth = group_bandwidth(gpu, replicas, tp)
    grads = 4 * params  # megacore reduces the fp32 gradient buffer
    bucket = costs.collective("all_reduce", 4 * min(p.bucket_size, params), replicas, dp_bandwidth)
    gather = 0.0
    reductions = 1  # the gradients are reduced once a step, after the last microbatch's backward
    if layout.fsdp:  # FSDP2: fp32 gradients reduce-scattered, 16-bit parameters gathered
        if p.reduce_every_microbatch:  # ... after every microbatch's backward
            reductions = microbatches
        reshard = pp == 1 if p.reshard_after_forward is None else p.reshard_after_forward

        def fsdp_exposed(count: float, ranks: int, bandwidth: float) -> tuple[float, float]:
            return _fsdp_exposed(
                costs.collective("all_gather", costs.element * count, ranks, bandwidth),
                costs.collective("reduce_scatter", 4 * count, ranks, bandwidth),
                layers * (layer["compute"] - layer["backward"]),
                layers * layer["backward"],
                max(layers, 1),
                microbatches,
                reductions,
                reshard,
            )

        # the dense parameters over dp x cp; the experts over their own group, below
        gather, reduce = fsdp_exposed(params - memory["expert_parameters"], replicas, dp_bandwidth)
    elif layout.distributed_optimizer:
        reduce = costs.collective("reduce_scatter", grads, replicas, dp_bandwidth)
        gather = costs.collective("all_gather", costs.element * params, replicas, dp_bandwidth)
        if p.overlap_param_gather:  # behind the next forward but for its first bucket
            gather = costs.collective(
                "all_gather", costs.element * p.bucket_size, replicas, dp_bandwidth
            )
    else:
        reduce = costs.collective("all_reduce", grads, replicas, dp_bandwidth)
    if p.overlap_grad_reduce and replicas > 1 and not layout.fsdp:
        # buckets go out as a reducing microbatch's backward produces their gradients
        reduce = max(min(bucket, reduce), reduce - reductions * layers * layer["backward"])
    embedding = 0.0
    if pp > 1:  # the tied word embeddings' gradients, first and last stage
        crosses = layout.gpus > gpu.gpus_per_node
        link = (gpu.inter_node_gbps if crosses else gpu.intra_node_gbps) * 1e9
        embedding = costs.collective(
            "all_reduce", 4 * cfg.vocab_size * cfg.hidden_size / tp, 2, link
        )
    time["dp_comm"] = reduce + gather + embedding
    experts = memory["expert_parameters"]
    if experts:  # the experts' gradients over their own data-parallel group (ranks etp x ep
        # apart), as the dense ones; `reduce` and `gather` above took them with the dense ones
        edp = max(1, replicas * tp // (layout.ep * layout.expert_tp))
        edp_bandwidth = group_bandwidth(gpu, edp, layout.ep * layout.expert_tp)
        share = experts / params
        if layout.fsdp:  # FSDP2 over their group, layer by layer as the dense parameters
            share = 0.0  # `reduce` and `gather` above are the dense parameters' alone
            expert_comm = sum(fsdp_exposed(experts, edp, edp_bandwidth))
        elif layout.distributed_optimizer:
            expert_comm = costs.collective(
                "reduce_scatter", 4 * experts, edp, edp_bandwidth
            ) + costs.collective("all_gather", costs.element * experts, edp, edp_bandwidth)
        else:
            expert_comm = costs.collective("all_reduce", 4 * experts, edp, edp_bandwidth)
        if p.overlap_grad_reduce and edp > 1 and not layout.fsdp:
            expert_comm = max(0.0, expert_comm - layers * layer["backward"])
        time["dp_comm"] = (1 - share) * (reduce + gather) + expert_comm + embedding
    sharded = layout.distributed_optimizer or layout.fsdp
    shard = params / replicas if sharded else params
    if experts and sharded:  # the experts' shard is over their data-parallel group
        shard = (params - experts) / replicas + experts / edp
    # FSDP's gradients are sharded too, and its masters are the parameters (no 16-bit copy).
    moved = (
        shard * ADAM_BYTES["sharded"]
        + (shard if layout.fsdp else params) * ADAM_BYTES["zero_grads"]
    )
    if t.precision != "fp32" and not layout.fsdp:
        moved += params * ADAM_BYTES["copy_16bit"]
    time["optimizer"] = costs.memory_bound(moved)
    time["total"] = sum(time[k] for k in TIME_PARTS)

    model_flops, hardware_flops = flops_per_iteration(
        config.model.kind, cfg, t.global_batch_size, t.seq_length, layout.recompute
    )
    gpus = layout.gpus
    return Estimate(
        layout=layout,
        memory=memory,
        time=time,
        mfu=model_flops / (time["total"] * gpus * gpu.base_peak_flops(t.precision)),
        tflops_per_gpu=hardware_flops / (time["total"] * gpus) / 1e12,
        fits=memory["total"] <= (1 - HEADROOM) * gpu.memory_bytes,
        # each pipeline stage's seconds for one microbatch (the last with MTP's depths)
        notes={"microbatches": microbatches, "stage_seconds": totals},
    )
