"""The experts' MLPs over tokens grouped by expert, from 3-D weights.

`grouped_mlp(x, tokens_per_expert, w_fc1 [E, h, f or 2f], w_fc2 [E, f, h])`: x [N, h] holds
expert 0's tokens, then expert 1's, ... (`permute`'s order).  Each matmul is one call of
torch's grouped GEMM (`torch._grouped_mm`, with a row offset per expert) where the torch in
use has it for the device, dtype and shapes; otherwise a loop over the experts (one matmul
each, the fallback and the reference).  The two agree to fp32 rounding, gradients too.

The gated activations (`GATED`, `glu`): w_fc1's last dimension is [gate | up] (f each);
SwiGLU is SiLU(gate) x up, quick-GeGLU gate sigmoid(1.702 gate) x up (Megatron-LM's
quick_gelu, gpt-oss's with alpha 1.702), either with `glu_linear_offset` added to up and
`clamp_value` clamping gate to at most it and up to [-it, it] first (Megatron-LM's
glu_linear_offset and activation_func_clamp_value; gpt-oss: 1 and 7).  Under expert
tensor parallelism each rank holds f / etp of both halves ([gate_r | up_r], see
`fc1_shard`) and its fc2 output is a partial sum over the etp ranks.

Biases (`b_fc1` [E, f or 2f], `b_fc2` [E, h_out]): each row of x gets its expert's, taken
by `repeat_interleave` over the counts (no loop over the experts, no host sync), added
after each GEMM.  Under expert tensor parallelism b_fc1 is split with fc1's columns and
the caller hands each rank a b_fc2 that is zero outside its share, so the partial sums
add it once.
"""

from functools import lru_cache

import torch
import torch.nn.functional as F

ACTIVATIONS = ("swiglu", "quick_geglu", "gelu_tanh", "gelu")
GATED = ("swiglu", "quick_geglu")  # w_fc1 is [gate | up]
QUICK_GELU_ALPHA = 1.702  # Megatron-LM's quick_gelu, gpt-oss's swiglu_alpha


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: the grouped GEMM's
    backward refuses an expanded one (stride 0, e.g. from a sum)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


@lru_cache(maxsize=16)
def _grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch's grouped GEMM runs here (it exists from torch 2.8; CUDA needs sm80+
    and bf16, the CPU takes fp32, bf16 and fp16 from torch 2.9), tried once on tiny shapes."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.ones(4, 8, device=device_type, dtype=dtype)
        w = torch.ones(2, 8, 8, device=device_type, dtype=dtype)
        offs = torch.tensor([2, 4], device=device_type, dtype=torch.int32)
        torch._grouped_mm(x, w, offs=offs)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def grouped_gemm_available(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `grouped_mlp` can take the grouped GEMM for these tensors: the kernel runs on
    their device in their dtype, and x, the weights and every row of them start on a 16-byte
    boundary (the kernel's alignment: a weight viewed into a flat buffer at an odd offset is
    refused on CUDA, "expected data_ptr to be aligned to 16 bytes")."""
    # Under torch.compile the eager probe cannot run, and the compiled op takes bf16 only.
    if torch.compiler.is_compiling() or not _grouped_mm_runs(x.device.type, x.dtype):
        return False
    size = x.element_size()
    # The rows of x, of each weight and of the activations between (fc2's input rows).
    widths = [x.shape[-1]] + [w.shape[-1] for w in weights] + [w.shape[-2] for w in weights]
    return (
        all(w.dtype == x.dtype for w in weights)
        and all(n * size % 16 == 0 for n in widths)
        and all(t.data_ptr() % 16 == 0 for t in (x, *weights))
    )


def _matmul_grouped(x, w, offsets):
    return _ContiguousGrad.apply(torch._grouped_mm(x, w, offs=offsets))


def _matmul_loop(x, w, counts):
    parts = x.split(counts, dim=0)
    return torch.cat([part @ w[e] for e, part in enumerate(parts)], dim=0)


def glu(
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str = "swiglu",
    glu_linear_offset: float = 0.0,
    clamp_value: float | None = None,
) -> torch.Tensor:
    """act(gate) x (up + glu_linear_offset), act SiLU ("swiglu") or x sigmoid(1.702 x)
    ("quick_geglu"); `clamp_value`: gate clamped to at most it, up to [-it, it], first."""
    if clamp_value is not None:
        gate = gate.clamp(max=clamp_value)
        up = up.clamp(min=-clamp_value, max=clamp_value)
    if activation == "swiglu":
        act = F.silu(gate)
    elif activation == "quick_geglu":
        act = gate * torch.sigmoid(gate * QUICK_GELU_ALPHA)
    else:
        raise ValueError(f"glu: activation must be one of {GATED}, got {activation!r}")
    return act * (up + glu_linear_offset) if glu_linear_offset else act * up


def _activate(
    hidden: torch.Tensor, activation: str, glu_linear_offset: float, clamp_value: float | None
) -> torch.Tensor:
    if activation in GATED:
        gate, up = hidden.chunk(2, dim=-1)
        return glu(gate, up, activation, glu_linear_offset, clamp_value)
    if activation == "gelu_tanh":
        return F.gelu(hidden, approximate="tanh")
    if activation == "gelu":
        return F.gelu(hidden)
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def grouped_mlp(
    x: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    w_fc1: torch.Tensor,
    w_fc2: torch.Tensor,
    activation: str = "swiglu",
    grouped: bool | None = None,
    *,
    b_fc1: torch.Tensor | None = None,
    b_fc2: torch.Tensor | None = None,
    glu_linear_offset: float = 0.0,
    clamp_value: float | None = None,
) -> torch.Tensor:
    """fc2(act(fc1(x) + b_fc1)) + b_fc2 per expert over its rows of x [N, h]; [N, h_out].
    `grouped`: True forces torch's grouped GEMM (an error where it cannot run), False the
    loop, None the grouped GEMM where `grouped_gemm_available`.  `glu_linear_offset`,
    `clamp_value`: the gated activation's (`glu`)."""
    if grouped is None:
        grouped = grouped_gemm_available(x, w_fc1, w_fc2)
    elif grouped and not grouped_gemm_available(x, w_fc1, w_fc2):
        raise RuntimeError(
            f"grouped_mlp: torch {torch.__version__} has no grouped GEMM for {x.dtype} on "
            f"{x.device.type} with these shapes and addresses (rows and starts on 16 bytes); "
            "use grouped=None or False"
        )
    if grouped:
        offsets = torch.cumsum(tokens_per_expert, 0).to(torch.int32)

        def matmul(a, w):
            return _matmul_grouped(a, w, offsets)
    else:
        counts = tokens_per_expert.tolist()

        def matmul(a, w):
            return _matmul_loop(a, w, counts)

    hidden = _biased(matmul(x, w_fc1), b_fc1, tokens_per_expert)
    hidden = _activate(hidden, activation, glu_linear_offset, clamp_value)
    return _biased(matmul(hidden, w_fc2), b_fc2, tokens_per_expert)


def _biased(
    y: torch.Tensor, bias: torch.Tensor | None, tokens_per_expert: torch.Tensor
) -> torch.Tensor:
    """y [N, n] plus each row's expert's bias (bias [E, n]); y itself without a bias."""
    if bias is None:
        return y
    # output_size: the rows are known, so no host sync reads the counts.
    rows = bias.repeat_interleave(tokens_per_expert, dim=0, output_size=y.shape[0])
    return y + rows.to(y.dtype)


def fc2_bias_share(bias: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Expert tensor-parallel rank `rank`'s fc2 bias [..., h / size] (its share of h's columns)
    as the [..., h] it adds to its partial sum: zero outside its columns, so the partial sums
    over the `size` ranks hold the whole bias once (and each bias element lives on one rank)."""
    if size == 1:
        return bias
    width = bias.shape[-1]
    return F.pad(bias, (rank * width, (size - 1 - rank) * width))


def fc1_shard(full: torch.Tensor, rank: int, size: int, swiglu: bool) -> torch.Tensor:
    """Expert tensor-parallel rank `rank`'s columns of fc1 weights [..., h, f or 2f]: f / size
    contiguous columns, of the gate and of the up halves apart under SwiGLU."""
    if not swiglu:
        return full.chunk(size, dim=-1)[rank]
    gate, up = full.chunk(2, dim=-1)
    return torch.cat((gate.chunk(size, dim=-1)[rank], up.chunk(size, dim=-1)[rank]), dim=-1)
