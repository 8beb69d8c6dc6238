"""What every block of the transformer shares: where a layer's parameters go (`placement`) and
the generator they are drawn from (`cpu_generator`), the normalizations (LayerNorm, RMSNorm),
dropout of replicated activations, and Megatron's fused elementwise ends of a block
(`bias_gelu`, `bias_dropout_add`).

Every piece of the model is drawn from its own CPU `torch.Generator` at full size and then
sliced, so any (tp, pp, vpp) layout holds the same numbers as one process; private
generators leave the global ones (which dropout uses) untouched.
"""

import torch
import torch.nn.functional as F
from torch import nn

from megacore import tensor_parallel as tp
from megatrain.models.transformer_config import TransformerConfig


class RMSNorm(nn.Module):
    """x / rms(x) x weight, computed in fp32 and cast back, as HF's Llama does (so a bf16
    model normalizes as its reference does)."""

    def __init__(self, size: int, eps: float, device=None, dtype=torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def layer_norm(
    cfg: TransformerConfig, device=None, dtype=torch.float32, size: int | None = None
) -> nn.Module:
    """The model's normalization over `size` (None: hidden_size)."""
    size = size or cfg.hidden_size
    if cfg.normalization == "rmsnorm":
        ln = RMSNorm(size, cfg.layernorm_epsilon, device=device, dtype=dtype)
    else:
        ln = nn.LayerNorm(size, eps=cfg.layernorm_epsilon, device=device, dtype=dtype)
    for p in ln.parameters():  # replicated; under sequence parallelism their grads are partial
        p.sequence_parallel = cfg.sequence_parallel
    return ln


def cpu_generator(seed: int) -> torch.Generator:
    """A private generator for one piece of the model: it draws what torch.manual_seed(seed)
    would make the default CPU generator draw, without touching the global state."""
    return torch.Generator(device="cpu").manual_seed(seed)


def dropout(x: torch.Tensor, p: float, training: bool, sequence_parallel: bool) -> torch.Tensor:
    """Dropout of a replicated activation: one mask on every TP rank, or, when each rank holds
    other tokens (sequence parallelism), a mask of its own from the model-parallel stream."""
    if not (training and p):
        return x
    if sequence_parallel:
        with tp.get_rng_tracker().fork():
            return F.dropout(x, p, True)
    return F.dropout(x, p, True)


def bias_gelu(
    x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "tanh"
) -> torch.Tensor:
    """GeLU of x + bias: GPT-2's tanh approximation, or the exact one (`approximate="none"`,
    BERT's).

    The column-parallel fc1 leaves its bias out (`skip_bias_add`) so the add and the GeLU
    are one elementwise expression: one kernel under `training.compile`; in eager the add
    is a pass of its own, as in Megatron without its fusion (a plain function, not
    TorchScript: deprecated, and it fuses nothing on a CPU).  The same numbers as adding
    the bias in the linear, up to rounding.
    """
    return F.gelu(x if bias is None else x + bias, approximate=approximate)


def bias_dropout_add(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    p: float,
    training: bool,
    sequence_parallel: bool = False,
) -> torch.Tensor:
    """residual + dropout(x + bias): the end of each half of a block, Megatron's fused op.

    The row-parallel layers leave their bias out (`skip_bias_add`) so the bias, the dropout
    and the residual add are one elementwise expression (one kernel under `training.compile`).
    The dropout draws the same mask as `dropout` would: the same generator, the same shape.
    """
    if bias is not None:
        x = x + bias
    return residual + dropout(x, p, training, sequence_parallel)


def placement(generator, device, dtype, initialize: bool = True) -> dict:
    """The keyword arguments that put a tensor-parallel layer's parameters in place: on
    `device` in `dtype`, drawn from `generator`, or left undrawn (`initialize=False`) when
    a checkpoint will overwrite them."""
    return {
        "generator": generator,
        "device": device,
        "params_dtype": dtype,
        "perform_initialization": initialize,
    }


def layer_norm_in(cfg: TransformerConfig, place: dict) -> nn.LayerNorm:
    return layer_norm(cfg, place["device"], place["params_dtype"])
