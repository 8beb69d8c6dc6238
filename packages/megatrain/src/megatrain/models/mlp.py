"""The dense MLP: what fills a layer's MLP slot on a dense layer, and a MoE layer's shared expert.

The MLP slot (`spec.build_mlp`): a module built as `Kind(cfg, place, parallel)` whose
`forward(x [s, b, h])` returns its output without the last bias and that bias (or None), for
`bias_dropout_add`.  `ParallelMLP` is it for dense layers, `moe.MoELayer` for MoE layers.

ffn_hidden_size (4h) is column- then row-parallel; SwiGLU's gate and up are two
column-parallel linears, so each is a contiguous split that checkpoints reshard.  The gated
activation is the experts' (`megacore.moe.glu`: SiLU or quick-GeGLU, with its offset and
clamp).
"""

import torch
from torch import nn

from megacore import tensor_parallel as tp
from megacore.moe import glu
from megatrain.models.common import bias_gelu
from megatrain.models.transformer_config import GELUS, TransformerConfig


class ParallelMLP(nn.Module):
    def __init__(self, cfg: TransformerConfig, place: dict, parallel=None):
        super().__init__()
        h, sp, std = cfg.hidden_size, cfg.sequence_parallel, cfg.init_method_std
        self.gelu = cfg.gelu
        self.glu = {
            "activation": "quick_geglu" if cfg.quick_geglu else "swiglu",
            "glu_linear_offset": cfg.glu_linear_offset,
            "clamp_value": cfg.activation_func_clamp_value,
        }
        tp.divide_by_tp(cfg.ffn_hidden_size, "ffn_hidden_size")

        def column(bias_in_kernel: bool):
            return tp.ColumnParallelLinear(
                h,
                cfg.ffn_hidden_size,
                bias=cfg.add_bias,
                sequence_parallel=sp,
                init_method=tp.init_method_normal(std),
                skip_bias_add=not bias_in_kernel,
                **place,
            )

        # SwiGLU: SiLU(gate(x)) x fc1(x); the gate is drawn first.
        self.gate = column(bias_in_kernel=True) if cfg.swiglu else None
        self.fc1 = column(bias_in_kernel=cfg.swiglu)  # GeLU: the bias added in bias_gelu
        self.fc2 = tp.RowParallelLinear(
            cfg.ffn_hidden_size,
            h,
            bias=cfg.add_bias,
            input_is_parallel=True,
            sequence_parallel=sp,
            skip_bias_add=True,  # added in bias_dropout_add
            init_method=tp.scaled_init_method_normal(std, cfg.num_layers),
            **place,
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The output without fc2's bias, and that bias (for bias_dropout_add)."""
        if self.gate is not None:
            gate, _ = self.gate(x)
            up, _ = self.fc1(x)
            return self.fc2(glu(gate, up, **self.glu))
        hidden, bias = self.fc1(x)
        return self.fc2(bias_gelu(hidden, bias, GELUS[self.gelu]))
