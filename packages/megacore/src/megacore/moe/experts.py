"""The experts' MLPs over tokens grouped by expert, from 3-D weights.

`grouped_mlp(x, tokens_per_expert, w_fc1 [E, h, f or 2f], w_fc2 [E, f, h])`: x [N, h] holds
expert 0's tokens, then expert 1's, ... (`permute`'s order).  Each matmul is one call of
torch's grouped GEMM (`torch._grouped_mm`, with a row offset per expert) where the torch in
use has it for the device, dtype and shapes; otherwise a loop over the experts (one matmul
each, the fallback and the reference).  The two agree to fp32 rounding, gradients too.

SwiGLU: w_fc1's last dimension is [gate | up] (f each); SiLU(gate) x up.  Under expert
tensor parallelism each rank holds f / etp of both halves ([gate_r | up_r], see
`fc1_shard`) and its fc2 output is a partial sum over the etp ranks.
"""

from functools import lru_cache

import torch
import torch.nn.functional as F

ACTIVATIONS = ("swiglu", "gelu_tanh", "gelu")


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


def _activate(hidden: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "swiglu":
        gate, up = hidden.chunk(2, dim=-1)
        return F.silu(gate) * up
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
) -> torch.Tensor:
    """fc2(act(fc1(x))) per expert over its rows of x [N, h]; [N, h_out].
    `grouped`: True forces torch's grouped GEMM (an error where it cannot run), False the
    loop, None the grouped GEMM where `grouped_gemm_available`."""
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
        hidden = _matmul_grouped(x, w_fc1, offsets)
        return _matmul_grouped(_activate(hidden, activation), w_fc2, offsets)
    counts = tokens_per_expert.tolist()
    hidden = _matmul_loop(x, w_fc1, counts)
    return _matmul_loop(_activate(hidden, activation), w_fc2, counts)


def fc1_shard(full: torch.Tensor, rank: int, size: int, swiglu: bool) -> torch.Tensor:
    """Expert tensor-parallel rank `rank`'s columns of fc1 weights [..., h, f or 2f]: f / size
    contiguous columns, of the gate and of the up halves apart under SwiGLU."""
    if not swiglu:
        return full.chunk(size, dim=-1)[rank]
    gate, up = full.chunk(2, dim=-1)
    return torch.cat((gate.chunk(size, dim=-1)[rank], up.chunk(size, dim=-1)[rank]), dim=-1)
