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
