"""The time model's primitives on one GPU of a profile (`Costs`): a GEMM, a flash kernel, the
element-wise and memory-bound passes and a collective; and the bandwidth a group of GPUs
gets (`group_bandwidth`).  `cost_model` and `attention_time` build a layer from them."""

from megatrain.plan.hardware import Gpu, Profile

# How much longer FlashAttention in Triton ("flash_triton") takes than FlashAttention-2 (the
# profile's attention_tflops): Dao 2023 (arXiv 2307.08691) section 4.1, on an A100, "around
# 1.3-1.5x faster than FlashAttention in Triton in the forward pass and around 2x faster in
# the backward pass"; the forward at the range's middle.  Measured on A100 only; on a
# Hopper profile this is assumed (FlashAttention-2 there used no Hopper instructions, nor did
# the pre-MLIR Triton the kernel was written for).
TRITON_FLASH_SLOWDOWN = {"forward": 1.4, "backward": 2.0}


# What torchao's tensorwise float8 casts move (training.precision = "fp8": each float8
# linear's input X, weight W and output gradient G cast with a dynamic per-tensor scale),
# bytes per element of each, in the forward and in the backward (for the input gradient's
# GEMM and the weight gradient's).  A bf16 element read is 2 bytes, a float8 one written 1.
FLOAT8_CAST_BYTES = {
    # training.compile: torchao's own roofline of the compiled casts (torchao/testing/
    # training/roofline_utils.py, get_tensor_memory_traffic_ovhd_s, "tensorwise", at
    # 36027d82d): X and G each an amax pass (read 2) and one cast writing both layouts the
    # GEMMs take (read 2, write 2 x 1); W an amax pass and a cast each for the forward and
    # the backward GEMM (2 + 3 + 3).
    "compiled": {
        "forward": {"input": 6, "weight": 5},
        "backward": {"grad_output": 6, "weight": 3},
    },
    # eager: the six casts of torchao's matmul_with_hp_or_float8_args (X and W for the
    # forward, G and W for the input gradient, G and X for the weight's), each as its torch
    # ops run (float8_utils.tensor_to_amax's abs 4 and max 2; _ToFloat8ConstrFunc's to
    # float32 6, x scale 8, clamp 8, to float8 5: 33), and the copies preprocess_addmm makes
    # for _scaled_mm's operand layouts (W in the input gradient's GEMM, G and X in the
    # weight's: read and write 1 each).
    "eager": {
        "forward": {"input": 33, "weight": 33},
        "backward": {"grad_output": 33 + 35, "weight": 35, "input": 35},
    },
}


class Costs:
    """Times of GEMMs, memory-bound ops and collectives on one GPU of a profile.

    `precision` "fp8": the layers' linears in float8 (`linear_fwd_bwd` with float8=True: the
    fp8 peak at the profile's `fp8_gemm_efficiency`, and `FLOAT8_CAST_BYTES` as compiled or
    not, `compiled`), everything else in bf16."""

    def __init__(self, gpu: Gpu, profile: Profile, precision: str, compiled: bool = False):
        self.gpu, self.profile = gpu, profile
        self.peak = gpu.base_peak_flops(precision)
        self.flops = self.peak * profile.gemm_efficiency  # a large GEMM's rate
        self.float8 = None  # FLOAT8_CAST_BYTES of the run, when its linears are float8
        if precision == "fp8":
            self.fp8_flops = gpu.peak_flops("fp8") * profile.fp8_fraction()
            self.float8 = FLOAT8_CAST_BYTES["compiled" if compiled else "eager"]
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

    def linear_fwd_bwd(self, m: float, n: float, k: float, float8: bool) -> tuple[float, float]:
        """A layer's linear, [m, k] x [k, n], forward and backward (`gemm_fwd_bwd`); `float8`:
        one megatrain runs in float8 under fp8 (`accounting.float8_gemm`), its three GEMMs
        at the fp8 rate and its casts' bytes (`FLOAT8_CAST_BYTES`) memory-bound."""
        if not (float8 and self.float8):
            return self.gemm_fwd_bwd(m, n, k)
        forward = self._fp8_gemm(m, n, k) + self._casts("forward", m, n, k)
        backward = self._fp8_gemm(m, k, n) + self._fp8_gemm(k, n, m)
        return forward, backward + self._casts("backward", m, n, k)

    def _fp8_gemm(self, m: float, n: float, k: float) -> float:
        """[m, k] x [k, n] in float8 (operands 1 byte, the bf16 output 2)."""
        traffic = (m * k + k * n + 2 * m * n) / self.hbm
        return max(2 * m * n * k / self.fp8_flops, traffic) + self.profile.gemm_overhead_s

    def _casts(self, part: str, m: float, n: float, k: float) -> float:
        sizes = {"input": m * k, "weight": k * n, "grad_output": m * n}
        return self.memory_bound(sum(b * sizes[r] for r, b in self.float8[part].items()))

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
