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
  runs two GEMMs per forward one (the input's and the weight's gradients).
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
  backward; selective reruns the attention core (its two GEMMs and its softmax/dropout).
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
  before the next block's backward starts, exposed.  Under selective or full recompute the
  attention (and so its communication) runs again in the backward.  The attention core
  runs as megacore runs it (`accounting.attention_kernel`): "allgather" in 16 bits with
  flash on the GPU is "masked", SDPA with megacore's boolean mask, which runs cuDNN's or the
  memory-efficient fused kernel (no scores kept, but every score computed, and the mask read
  for each head); "p2p" is "ring", the fused ring (a flash kernel call a step, causal
  attention's half of the scores, as flash at cp 1), or with packed documents
  "ring_float32", float32 torch ops (GEMMs at the fp32 peak, the passes over each block's
  scores memory-bound).
- **Pipeline**: with T_r the time of stage r for one microbatch (layers, embedding on the
  first, the output layer and loss on the last, the point-to-point sends of the
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
  resharded after the forward), each layer's gather behind the previous layer's compute.
- **Optimizer step**: memory-bound, the bytes Adam reads and writes per parameter / HBM.

MFU is the model FLOPs of an iteration (megatrain.plan.accounting.flops_per_iteration) over the time
and the peak of every GPU.
"""

from dataclasses import dataclass, field, replace

from megacore.pipeline_parallel import order_1f1b, order_interleaved, order_zb_h1, timeline
from megatrain.config import Config
from megatrain.models import model_config
from megatrain.models.transformer import TransformerConfig
from megatrain.plan.accounting import (
    ATTENTION_IMPLEMENTATIONS,
    MASKED_LM_PROB,
    activations_per_layer,
    attention_core_flops,
    attention_kernel_for,
    flops_per_iteration,
    layer_gemms,
    moe_layer_count,
)
from megatrain.plan.hardware import Gpu, Profile
from megatrain.plan.memory import HEADROOM, memory_breakdown

# Bytes Adam moves per parameter in one step (megacore's optimizer): it reads the fp32
# gradient, master weight and two moments and writes the last three (28); the gradient
# norm reads the gradient (4); the 16-bit model copies its weights from the masters (6);
# zeroing the gradient buffer writes it (4).  Sharded by the distributed optimizer but the
# last: the whole buffer is zeroed.
ADAM_BYTES = {"sharded": 28 + 4, "copy_16bit": 6, "zero_grads": 4}
# HBM bytes megacore's ring attention (context_parallel._block_attention, float32) moves a
# score and head besides its GEMMs, each torch op reading and writing the block's scores once
# (4 bytes an element; the mask's byte per score where an op reads it): forward, the scale
# (8), torch.where with the mask (9), logsumexp (24: amax, the difference, exp, the sum) and
# softmax (8); backward, softmax's (12), logsumexp's (24: the difference, exp, the product),
# the two gradients summed (12), torch.where's (9) and the scale's (8).
RING_FORWARD_BYTES = 8 + 9 + 24 + 8
RING_BACKWARD_BYTES = 12 + 24 + 12 + 9 + 8
# Bytes a (query, key) pair of the masks moves, whatever the heads: the all-gather path's
# boolean mask written (1), read for the rows that see no key (1), and converted by SDPA to
# the additive mask (1 read, 2 written); the ring's written and read for each block (2).
MASKED_MASK_BYTES = 5
RING_MASK_BYTES = 2
# HBM bytes a score moves (16 bits) around Megatron-LM's two batched products in its fused
# attention ("fused_softmax"; megatron/model/fused_softmax.py and transformer.py as of the
# sc21 scripts, de7dc40f88): forward, the fused scale-mask-softmax reads the scores and
# writes the probabilities (4), dropout reads them and writes its output and its 1-byte mask
# (5); backward, dropout's reads the gradient and the mask and writes a gradient (5), the
# softmax's reads that and the probabilities and writes the scores' gradient (6).  Without
# dropout, the softmax's alone.
FUSED_SOFTMAX_BYTES = {"forward": 4, "backward": 6}
FUSED_SOFTMAX_DROPOUT_BYTES = {"forward": 5, "backward": 5}
# How much longer FlashAttention in Triton ("flash_triton") takes than FlashAttention-2 (the
# profile's attention_tflops): Dao 2023 (arXiv 2307.08691) section 4.1, on an A100, "around
# 1.3-1.5x faster than FlashAttention in Triton in the forward pass and around 2x faster in
# the backward pass"; the forward at the range's middle.  Measured on A100 only; on a
# Hopper profile this is assumed (FlashAttention-2 there used no Hopper instructions, nor did
# the pre-MLIR Triton the kernel was written for).
TRITON_FLASH_SLOWDOWN = {"forward": 1.4, "backward": 2.0}
TIME_PARTS = (
    "compute", "tp_comm", "cp_comm", "ep_comm", "pp_bubble", "pp_p2p", "dp_comm", "optimizer",
)  # fmt: skip
MEMORY_PARTS = ("weights", "gradients", "optimizer_state", "activations")


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    vpp: int = 1
    micro_batch: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    schedule: str = "1f1b"  # the pipeline schedule: 1f1b, interleaved (vpp > 1) or zb-h1
    cp: int = 1  # context parallelism: each sequence split over cp ranks
    cp_comm: str = "p2p"  # its attention's communication: "p2p" (a ring) or "allgather"
    fsdp: bool = False  # parallel.data_parallel_sharding = "full" (torch's FSDP2)
    ep: int = 1  # a mixture of experts: parallel.expert_model_parallel_size
    etp: int | None = None  # parallel.expert_tensor_parallel_size (None: tp)
    # FSDP reduce-scatters every microbatch's gradients (parallel.reduce_every_microbatch):
    # True or False as the plan tries both, None for the config's own choice
    reduce_every_microbatch: bool | None = None

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def sharding(self) -> str:
        """parallel.data_parallel_sharding at this layout."""
        return "full" if self.fsdp else "optimizer" if self.distributed_optimizer else "none"

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def describe(self) -> str:
        parts = [f"tp {self.tp}"]
        if self.cp > 1:
            parts.append(f"cp {self.cp} {self.cp_comm}")
        parts.append(f"pp {self.pp}")
        if self.vpp > 1:
            parts.append(f"vpp {self.vpp}")
        if self.schedule == "zb-h1" and self.pp > 1:
            parts.append("zb-h1")
        parts += [f"dp {self.dp}", f"mb {self.micro_batch}", f"recompute {self.recompute}"]
        if self.sequence_parallel:
            parts.append("sp")
        if self.distributed_optimizer:
            parts.append("distopt")
        if self.fsdp:
            parts.append("fsdp")
        if self.fsdp and self.reduce_every_microbatch:
            parts.append("reduce-every-mb")
        if self.ep > 1 or self.etp is not None:
            parts.append(f"ep {self.ep} etp {self.expert_tp}")
        return " ".join(parts)

    def overrides(self) -> list[str]:
        """The `section.field=value` overrides that give a config this layout."""
        return [
            f"parallel.tensor_model_parallel_size={self.tp}",
            f"parallel.context_parallel_size={self.cp}",
            *([f'parallel.cp_comm_type="{self.cp_comm}"'] if self.cp > 1 else []),
            f"parallel.pipeline_model_parallel_size={self.pp}",
            f"parallel.virtual_pipeline_model_parallel_size={self.vpp if self.vpp > 1 else 'none'}",
            "parallel.pipeline_schedule=" + (f'"{self.schedule}"' if self.pp > 1 else "none"),
            f"parallel.sequence_parallel={str(self.sequence_parallel).lower()}",
            # a config's parallel.tp_comm_overlap needs sequence parallelism (apply_layout)
            *([] if self.sequence_parallel else ["parallel.tp_comm_overlap=false"]),
            f"parallel.use_distributed_optimizer={str(self.distributed_optimizer).lower()}",
            *(['parallel.data_parallel_sharding="full"'] if self.fsdp else []),
            *(
                [f"parallel.reduce_every_microbatch={str(self.reduce_every_microbatch).lower()}"]
                if self.fsdp and self.reduce_every_microbatch is not None
                else []
            ),
            *(
                [
                    f"parallel.expert_model_parallel_size={self.ep}",
                    f"parallel.expert_tensor_parallel_size={self.expert_tp}",
                ]
                if self.ep > 1 or self.etp is not None
                else []
            ),
            f"training.micro_batch_size={self.micro_batch}",
            f"model.recompute={self.recompute}",
        ]


def layout_of(config: Config, dp: int) -> Layout:
    """The layout a config runs at on tp x cp x pp x dp GPUs."""
    p = config.parallel
    vpp = p.virtual_pipeline_model_parallel_size or 1
    return Layout(
        tp=p.tensor_model_parallel_size,
        pp=p.pipeline_model_parallel_size,
        dp=dp,
        vpp=vpp,
        schedule=p.pipeline_schedule or ("interleaved" if vpp > 1 else "1f1b"),
        micro_batch=config.training.micro_batch_size,
        recompute=config.model.recompute,
        sequence_parallel=p.sequence_parallel and p.tensor_model_parallel_size > 1,
        distributed_optimizer=p.use_distributed_optimizer
        or p.data_parallel_sharding == "optimizer",
        cp=p.context_parallel_size,
        cp_comm=p.cp_comm_type if p.context_parallel_size > 1 else "p2p",
        fsdp=p.data_parallel_sharding == "full",
        ep=p.expert_model_parallel_size,
        etp=p.expert_tensor_parallel_size,
        reduce_every_microbatch=(
            True if p.data_parallel_sharding == "full" and p.reduce_every_microbatch else None
        ),
    )


def apply_layout(config: Config, layout: Layout, global_batch: int | None = None) -> Config:
    """A copy of `config` at `layout` (and `global_batch`); the rest of the config kept."""
    p, t = config.parallel, config.training
    return replace(
        config,
        model=replace(config.model, recompute=layout.recompute),
        parallel=replace(
            p,
            tensor_model_parallel_size=layout.tp,
            context_parallel_size=layout.cp,
            cp_comm_type=layout.cp_comm if layout.cp > 1 else p.cp_comm_type,
            pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
            pipeline_schedule=layout.schedule if layout.pp > 1 else None,
            data_parallel_size=layout.dp,
            sequence_parallel=layout.sequence_parallel,
            # the config's choice where the layout has sequence parallelism to overlap
            tp_comm_overlap=p.tp_comm_overlap and layout.sequence_parallel,
            use_distributed_optimizer=layout.distributed_optimizer,
            data_parallel_sharding=layout.sharding,
            reshard_after_forward=p.reshard_after_forward if layout.fsdp else None,
            reduce_every_microbatch=layout.fsdp
            and (
                p.reduce_every_microbatch
                if layout.reduce_every_microbatch is None
                else layout.reduce_every_microbatch
            ),
            overlap_param_gather=p.overlap_param_gather and layout.distributed_optimizer,
            distribute_saved_activations=p.distribute_saved_activations
            and not layout.sequence_parallel,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp,
        ),
        training=replace(
            t,
            micro_batch_size=layout.micro_batch,
            global_batch_size=global_batch or t.global_batch_size,
        ),
    )


@dataclass
class Estimate:
    layout: Layout
    memory: dict  # bytes per GPU of the fullest stage: MEMORY_PARTS, total, stage
    time: dict  # seconds per iteration: TIME_PARTS, total
    mfu: float
    tflops_per_gpu: float  # hardware FLOPs (recompute included) per second per GPU
    fits: bool
    notes: dict = field(default_factory=dict)


class Costs:
    """Times of GEMMs, memory-bound ops and collectives on one GPU of a profile."""

    def __init__(self, gpu: Gpu, profile: Profile, precision: str):
        self.gpu, self.profile = gpu, profile
        self.peak = gpu.peak_flops(precision)
        self.flops = self.peak * profile.gemm_efficiency  # a large GEMM's rate
        # what memory-bound kernels reach of the data sheet's bandwidth
        self.hbm = gpu.hbm_gbps * 1e9 * profile.hbm_efficiency
        self.element = 4 if precision == "fp32" else 2
        self.attention = gpu.attention  # gpus.toml's `attention` (or --attention)

    def gemm(self, m: float, n: float, k: float, batch: float = 1) -> float:
        """[m, k] x [k, n], `batch` times (a batched GEMM is one kernel), at the profile's
        fraction of peak for a GEMM of its size."""
        flops = 2 * m * n * k * batch
        rate = self.flops
        if self.profile.gemm_efficiency_by_size:
            rate = self.peak * self.profile.gemm_fraction(flops)
        traffic = self.element * batch * (m * k + k * n + m * n) / self.hbm
        return max(flops / rate, traffic) + self.profile.gemm_overhead_s

    def gemm_fwd_bwd(self, m: float, n: float, k: float, batch: float = 1) -> tuple[float, float]:
        """A GEMM's forward and its backward: the input's gradient [m, n] x [n, k] and the
        weight's (or other operand's) [k, m] x [m, n]."""
        return self.gemm(m, n, k, batch), self.gemm(m, k, n, batch) + self.gemm(k, n, m, batch)

    def flash_attention(self, flops: float, nbytes: float, seq: int) -> tuple[float, float]:
        """A flash kernel's forward and backward at sequence length `seq`, doing `flops` in
        the forward (the backward 2.5 x: it recomputes the scores, 5 products to the
        forward's 2) and reading and writing `nbytes` (q, k, v and the output; twice in the
        backward, with the gradients): one kernel each, at the profile's `attention_tflops`
        for `seq` (a forward-and-backward rate, so both at it)."""
        rate = self.profile.attention_flops(seq)
        slow = TRITON_FLASH_SLOWDOWN if self.attention == "flash_triton" else {}
        overhead = self.profile.gemm_overhead_s
        forward = max(flops / rate * slow.get("forward", 1), nbytes / self.hbm)
        backward = max(2.5 * flops / rate * slow.get("backward", 1), 2 * nbytes / self.hbm)
        return forward + overhead, backward + overhead

    def elementwise(self, stored_bytes: float) -> float:
        return self.profile.elementwise_passes * stored_bytes / self.hbm

    def memory_bound(self, nbytes: float) -> float:
        return nbytes / self.hbm

    def collective(self, kind: str, nbytes: float, ranks: int, bandwidth: float) -> float:
        if ranks <= 1:
            return 0.0
        factor = {"all_reduce": 2 * (ranks - 1) / ranks, "p2p": 1.0}.get(kind, (ranks - 1) / ranks)
        rate = bandwidth * self.profile.collective_efficiency
        return self.profile.collective_latency_s + factor * nbytes / rate


def group_bandwidth(gpu: Gpu, members: int, stride: int) -> float:
    """Bytes/s of a group of `members` GPUs `stride` ranks apart (TP: stride 1; DP: tp): the
    NVLink bandwidth when the group fits in a node, else the network's, of which each node
    gives the group its adapters' share for the group's GPUs on it."""
    per_node = max(1, min(members, gpu.gpus_per_node // stride))
    if per_node >= members:
        return gpu.intra_node_gbps * 1e9
    return gpu.inter_node_gbps * 1e9 * per_node


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
    shapes = _dense_shapes(cfg, tp, moe)
    dense = [costs.gemm_fwd_bwd(tokens, n, k) for k, n in shapes]
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
    forward = sum(g[0] for g in dense) + sum(g[0] for g in core) + ops
    backward = sum(g[1] for g in dense) + sum(g[1] for g in core) + backward_ops
    # The dense weights' gradients: what ZB-H1 defers to its W steps.
    weight = sum(costs.gemm(k, n, tokens) for k, n in shapes)
    if moe:
        forward += experts["forward"]
        backward += experts["backward"]
        weight += experts["weight_grads"]
    recompute = {
        "none": 0.0,
        "selective": sum(g[0] for g in core) + core_ops,
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


def attention_core_seconds(
    config: Config, cfg: TransformerConfig, layout: Layout, costs: Costs
) -> list[tuple[float, float]]:
    """(forward, backward) seconds of one layer's attention core for one microbatch on one
    TP rank: the rank's s / cp queries of each sequence against all s keys, as the kernel
    `accounting.attention_kernel` names runs (the GPU's `attention`, the precision, cp and
    its communication; q heads of d on the rank, g key/value groups, b sequences):

    - "flash" (16 bits, cp 1): one kernel at the profile's attention rate, the masked half
      of causal attention skipped, moving q, k, v and the output (O(s h) bytes:
      `Costs.flash_attention`).
    - "masked" (16 bits, cp > 1, "allgather"): SDPA with megacore's boolean mask runs
      cuDNN's fused kernel (Hopper, Blackwell) or the memory-efficient one (A100), timed as
      one fused kernel at the same rate (no published figure for the masked kernels in
      this table's sources: an optimistic bound for them) but with every score's FLOPs (an
      arbitrary mask: no block skipped) and, besides q, k, v and the output, the additive
      mask read once per sequence and head (b q (s / cp) s x 2 bytes; the backward reads
      it again, as `Costs.flash_attention` counts all its bytes twice).  Besides the
      kernels, building the mask and converting it to the bias, 5 bytes a (query, key)
      pair (`MASKED_MASK_BYTES`), in the forward.
    - "ring" (cp > 1, "p2p", no packed documents): megacore's fused ring
      (`_fused_ring_seconds`).
    - "ring_float32" (cp > 1, "p2p", packed documents): megacore's float32 ring, cp blocks each of
      two float32 batched GEMMs per head (QK^T and probabilities x V, s / cp queries
      against s / cp keys) at the fp32 peak (torch leaves TF32 off and megatrain does not
      turn it on), and the float32 torch ops over each block's scores, memory-bound:
      `RING_FORWARD_BYTES` and `RING_BACKWARD_BYTES` a score and head, and each block's
      mask (`RING_MASK_BYTES` a pair).  No block is skipped (megacore's balanced chunks
      give every block a visible key); the merge's O(s h / t) passes are left out (d cp / s
      of the scores').
    - "unfused" (the 2019 path): two batched GEMMs per head, QK^T and scores x V, each
      max(FLOPs, bytes) at `gemm_efficiency`; the softmax and dropout over the s x s scores
      are the layer's element-wise passes (`layer_seconds`)."""
    m, t = config.model, config.training
    cp, s, b, tp = layout.cp, t.seq_length, layout.micro_batch, layout.tp
    local, a = s // cp, m.num_attention_heads
    head = cfg.kv_channels or cfg.hidden_size // a
    heads = b * a / tp
    kernel = attention_kernel_for(
        costs.attention, t.precision, cp, layout.cp_comm, config.data.reset_attention_mask
    )
    masks = b if config.data.reset_attention_mask else 1  # one causal mask, or per sequence
    if kernel in ("flash", "masked"):
        causal_skip = kernel == "flash"
        flops = b * attention_core_flops(cfg, local, s, causal_skip=causal_skip) / tp
        groups = b * max(cfg.num_query_groups or a, tp) / tp  # key/value heads on the rank
        nbytes = costs.element * head * (2 * heads * local + 2 * groups * s)
        if kernel == "masked":  # the additive mask, read for every sequence and head
            nbytes += costs.element * heads * local * s
        fused = [costs.flash_attention(flops, nbytes, s)]
        if kernel == "masked":
            fused.append((costs.memory_bound(MASKED_MASK_BYTES * local * s * masks), 0.0))
        return fused
    if kernel == "unfused":
        return [
            costs.gemm_fwd_bwd(local, s, head, heads),
            costs.gemm_fwd_bwd(local, head, s, heads),
        ]
    if kernel == "ring":
        return _fused_ring_seconds(cfg, layout, costs, local, s, head, heads, t.precision)
    fp32 = Costs(costs.gpu, costs.profile, "fp32") if "fp32" in costs.gpu.peak_tflops else costs
    block = s // cp  # each block's keys
    gemms = [
        fp32.gemm_fwd_bwd(local, block, head, heads),
        fp32.gemm_fwd_bwd(local, head, block, heads),
    ]
    scores = heads * local * s  # every block's, every head's
    passes = (
        costs.memory_bound(RING_FORWARD_BYTES * scores + RING_MASK_BYTES * local * s * masks),
        costs.memory_bound(RING_BACKWARD_BYTES * scores),
    )
    return cp * gemms + [passes]


def _fused_ring_seconds(cfg, layout, costs, local, s, head, heads, precision):
    """megacore's fused ring (`attention_kernel` "ring"): cp kernel calls a pass, each of the
    rank's s / cp queries against a block of s / cp keys (the balanced chunks paired so that
    causal attention computes half of all the scores, as flash at cp 1), each merging its
    partial output into a float32 accumulator (read and written); the backward re-runs the
    ring.  In 16 bits on a GPU whose attention is "flash": FlashAttention-2 at the profile's
    rate for a call's s / cp keys.  Otherwise (fp32, or an "unfused" GPU) the memory-efficient
    kernel, for which no rate is published: its two products per head timed as GEMMs of the
    visible keys (at the fp32 peak in fp32), the scores never in memory."""
    cp = layout.cp
    flops = layout.micro_batch * attention_core_flops(cfg, local, s, causal_skip=True) / layout.tp
    visible = flops / (layout.micro_batch * attention_core_flops(cfg, local, s, False) / layout.tp)
    groups = layout.micro_batch * max(cfg.num_query_groups or cfg.num_attention_heads, layout.tp)
    groups /= layout.tp  # key/value heads on the rank
    block = s // cp  # a call's keys
    # each call reads q and a K/V block and writes its output; the merge reads and writes the
    # float32 accumulator and reads the call's output
    call_bytes = costs.element * head * (2 * heads * local + 2 * groups * block)
    merge = costs.memory_bound(cp * (2 * 4 + costs.element) * heads * local * head)
    if ATTENTION_IMPLEMENTATIONS[costs.attention] == "flash" and precision != "fp32":
        forward, backward = costs.flash_attention(flops, cp * call_bytes, block)
        overhead = (cp - 1) * costs.profile.gemm_overhead_s  # cp calls, one counted
        return [(forward + overhead + merge, backward + overhead + merge)]
    gemm = Costs(costs.gpu, costs.profile, "fp32") if precision == "fp32" else costs
    keys = visible * block  # the visible keys of a call, on average
    return cp * [
        gemm.gemm_fwd_bwd(local, keys, head, heads),
        gemm.gemm_fwd_bwd(local, head, keys, heads),
    ] + [(merge, merge)]


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


def context_parallel_seconds(
    config: Config,
    layout: Layout,
    costs: Costs,
    core_forward: float,
    bandwidth: float,
    core_backward: float = 0.0,
) -> float:
    """Exposed seconds of one layer's CP communication for one microbatch on one TP rank
    (forward, backward, and the forward's again when the attention is recomputed);
    `core_forward` and `core_backward`: the attention core's forward and backward times,
    behind which the ring's transfers run."""
    cp = layout.cp
    if cp == 1:
        return 0.0
    m, t = config.model, config.training
    a = m.num_attention_heads
    groups = max(m.num_query_groups or a, layout.tp) / layout.tp  # key/value groups per rank
    # The whole sequence's K and V on one TP rank; each CP rank receives (cp - 1)/cp of it.
    kv = costs.element * 2 * layout.micro_batch * t.seq_length * groups * (m.hidden_size // a)
    if layout.cp_comm == "allgather":
        forward = costs.collective("all_gather", kv, cp, bandwidth)
        backward = costs.collective("reduce_scatter", kv, cp, bandwidth)
    else:  # each of cp - 1 blocks passed on while the block in hand is attended to
        step = costs.collective("p2p", kv / cp, 2, bandwidth)
        forward = (cp - 1) * max(0.0, step - core_forward / cp)
        if config.data.reset_attention_mask:  # the float32 ring: each block's gradient sent
            backward = (cp - 1) * step  # back before the next block's backward
        else:  # the fused ring re-runs: each step passes a K/V block and a float32 K/V
            # gradient on behind the step's kernel; the last gradient, going home, is exposed
            grads = costs.collective("p2p", 4 / costs.element * kv / cp, 2, bandwidth)
            backward = (cp - 1) * max(0.0, step + grads - core_backward / cp) + grads
    again = forward if layout.recompute in ("selective", "full") else 0.0
    return forward + backward + again


# A MoE layer's GEMMs `moe_seconds` times (as grouped GEMMs, over the expert layout).
_ROUTED = ("router", "experts.weight1", "experts.weight2")


def _dense_shapes(cfg: TransformerConfig, tp: int, moe: bool) -> list[tuple[float, float]]:
    """(input, output) sizes of a layer's dense GEMMs on one TP rank, as the model runs them
    (`accounting.layer_gemms`: qkv or q and kv, the projection, the MLP or the shared
    expert)."""
    return [g.per_rank(tp) for g in layer_gemms(cfg, moe) if g.name not in _ROUTED]


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


def memory_per_gpu(config: Config, vocab: int, dp: int, attention: str = "unfused") -> dict:
    """Bytes per GPU of the fullest pipeline stage (megatrain.plan.memory), by part."""
    pp = config.parallel.pipeline_model_parallel_size
    stages = {
        stage: memory_breakdown(
            config, vocab_size=vocab, data_parallel_size=dp, stage=stage, attention=attention
        )
        for stage in sorted({0, pp - 1})
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


def estimate(
    config: Config,
    layout: Layout,
    gpu: Gpu,
    profile: Profile,
    vocab_size: int,
    global_batch: int | None = None,
) -> Estimate:
    """Memory and step time of `config` at `layout` on GPUs `gpu` (`vocab_size`: the
    tokenizer's, padded here for tp)."""
    config = apply_layout(config, layout, global_batch)
    t, p = config.training, config.parallel
    tp, cp, pp, dp, vpp = layout.tp, layout.cp, layout.pp, layout.dp, layout.vpp
    microbatches = t.global_batch_size // (layout.micro_batch * dp)
    cfg = model_config(config, vocab_size)
    costs = Costs(gpu, profile, t.precision)
    memory = memory_per_gpu(config, vocab_size, dp, gpu.attention)

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
    layers = cfg.num_layers // pp
    stages = []
    for stage in range(pp):
        moe = moe_layer_count(cfg, stage * layers, (stage + 1) * layers)
        parts = {
            k: (layers - moe) * layer[k] + moe * moe_layer[k]
            for k in ("compute", "tp_comm", "cp_comm", "ep_comm")
        }
        for end, here in ((embed, stage == 0), (head, stage == pp - 1)):
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
        reduce = reductions * costs.collective("reduce_scatter", grads, replicas, dp_bandwidth)
        reshard = pp == 1 if p.reshard_after_forward is None else p.reshard_after_forward
        # every microbatch's forward gathers each layer (resharded after its backward), and
        # its backward again when resharded after the forward
        gathers = microbatches * (2 if reshard else 1)
        gather = gathers * costs.collective(
            "all_gather", costs.element * params, replicas, dp_bandwidth
        )
        # each layer's gather prefetched behind the previous layer's compute, but the first
        gather = max(gather / max(layers, 1), gather - microbatches * layers * layer["compute"])
    elif layout.distributed_optimizer:
        reduce = costs.collective("reduce_scatter", grads, replicas, dp_bandwidth)
        gather = costs.collective("all_gather", costs.element * params, replicas, dp_bandwidth)
        if p.overlap_param_gather:  # behind the next forward but for its first bucket
            gather = costs.collective(
                "all_gather", costs.element * p.bucket_size, replicas, dp_bandwidth
            )
    else:
        reduce = costs.collective("all_reduce", grads, replicas, dp_bandwidth)
    if p.overlap_grad_reduce and replicas > 1:
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
        if layout.distributed_optimizer:
            expert_comm = costs.collective(
                "reduce_scatter", 4 * experts, edp, edp_bandwidth
            ) + costs.collective("all_gather", costs.element * experts, edp, edp_bandwidth)
        else:
            expert_comm = costs.collective("all_reduce", 4 * experts, edp, edp_bandwidth)
        if p.overlap_grad_reduce and edp > 1:
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
        config.model.kind, cfg, t.global_batch_size, t.seq_length
    )
    gpus = layout.gpus
    return Estimate(
        layout=layout,
        memory=memory,
        time=time,
        mfu=model_flops / (time["total"] * gpus * gpu.peak_flops(t.precision)),
        tflops_per_gpu=hardware_flops / (time["total"] * gpus) / 1e12,
        fits=memory["total"] <= (1 - HEADROOM) * gpu.memory_bytes,
        notes={"microbatches": microbatches},
    )
