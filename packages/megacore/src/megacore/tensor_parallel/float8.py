"""Float8 matmuls for the linear layers, through torchao's float8 training (Hopper and newer).

`Float8Recipe` is what a column- or row-parallel linear carries in `.float8` when a model
trains in fp8 (`megatrain`'s `training.precision = "fp8"`, applied by its `parallelize`):
its forward GEMM and both backward GEMMs then cast their operands to float8 with dynamic
per-tensor scales and multiply in float8 (`torch._scaled_mm`), through torchao's own
autograd function, the one its `Float8Linear` calls.  The parameters, the activations
between layers and the gradients stay bf16; the optimizer keeps fp32 masters as for bf16.
Each tensor-parallel rank scales its own shard: the local GEMM is all that changes.

`emulate=True` is torchao's emulation (the casts and scales done, the matmul in high
precision), which runs on any device: the numbers of float8 training without its speed,
for checking a run where there is no such GPU.
"""

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

# The float8 GEMM needs both dimensions of each operand divisible by 16.
_ALIGN = 16


@dataclass(frozen=True)
class Float8Recipe:
    emulate: bool = False

    @cached_property
    def _torchao(self):
        """(torchao's matmul function, its linear config, its GEMM config), built once."""
        from torchao.float8.config import Float8LinearConfig
        from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args

        config = Float8LinearConfig(emulate=self.emulate)
        # torchao's Float8Linear builds its GEMM config from the linear config; a meta-device
        # one lends us that without allocating (or copying torchao's internals).
        probe = Float8Linear.from_float(nn.Linear(_ALIGN, _ALIGN, device="meta"), config=config)
        return matmul_with_hp_or_float8_args, config, probe.linear_mm_config

    def applies_to(self, weight: torch.Tensor) -> bool:
        return weight.dim() == 2 and all(d % _ALIGN == 0 for d in weight.shape)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        """x A^T + b with the GEMMs in float8 (output in x's dtype)."""
        matmul, config, mm_config = self._torchao
        out = matmul.apply(x, weight.t(), mm_config, config)
        return out if bias is None else out + bias.to(out.dtype)


def check_float8_available(device: torch.device, emulate: bool) -> None:
    """Raise an error naming what is missing: torchao, or a GPU with float8 GEMMs."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        raise RuntimeError(
            "fp8 training needs torchao's float8 training (pip install 'megatrain[gpu]', "
            f"or torchao >= 0.12 beside your torch): {e}"
        ) from e
    if emulate:
        return
    if device.type != "cuda":
        raise RuntimeError(
            f"fp8 training needs an NVIDIA GPU with float8 GEMMs (compute capability 8.9+: "
            f"H100, H200, L4, L40, RTX 40xx); this run is on '{device}'. Use bf16, or torchao's "
            "emulation to check the numbers without the speed"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise RuntimeError(
            f"fp8 training needs float8 GEMMs (compute capability 8.9+: H100, H200, L4, L40, "
            f"RTX 40xx), but {torch.cuda.get_device_name(device)} is {major}.{minor}; use bf16"
        )
