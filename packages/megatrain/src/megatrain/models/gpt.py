"""GPT-2 (paper section 2.2) on the shared transformer (`models/transformer.py`).

Pre-LayerNorm blocks, causal attention, GPT-2's tanh GeLU, learned positions, word
embeddings tied to the output layer, a final LayerNorm: `TransformerConfig`'s defaults.

Generation passes a `KVCache`: each attention layer appends its keys and values and
attends over all cached positions, so a new token costs one position's work.

`GPTModel` is the whole model or one pipeline chunk of it (`layer_ids`, `pre_process`,
`post_process`); `build_gpt_chunks` builds this rank's chunks.
"""

import torch

from megacore import tensor_parallel as tp
from megatrain.models.transformer import (
    KVCache,
    LanguageModel,
    TransformerConfig,
    bias_dropout_add,
    bias_gelu,
    layer_parameters,
    recomputed_flops,
    transformer_forward_flops,
)
from megatrain.parallelize import build_chunks

# GPT's settings are TransformerConfig's defaults (pre_ln, causal, tanh GeLU, no token types).
GPTConfig = TransformerConfig

__all__ = [
    "GPTConfig",
    "GPTModel",
    "KVCache",
    "bias_dropout_add",
    "bias_gelu",
    "build_gpt_chunks",
    "hardware_flops_per_iteration",
    "model_flops_per_iteration",
    "num_parameters",
]


class GPTModel(LanguageModel):
    """The whole GPT-2, or one pipeline chunk: `forward(tokens, labels)` gives the loss per token
    [b, s] on the last stage, the activations [s, b, h] before it, and logits (this rank's
    vocabulary slice, [s, b, v/tp]) when `labels` is None.  See `LanguageModel` for how it
    is built."""

    def __init__(self, cfg: GPTConfig, *args, **kwargs):
        if not cfg.causal or cfg.num_tokentypes:
            raise ValueError("GPTModel: needs causal attention and no token types")
        super().__init__(cfg, *args, **kwargs)
        if self.post_process:
            self.output_layer = tp.ColumnParallelLinear(
                cfg.hidden_size,
                cfg.vocab_size,
                bias=False,
                sequence_parallel=cfg.sequence_parallel,
                skip_weight_param_allocation=True,
                params_dtype=kwargs.get("dtype", torch.float32),
                device=kwargs.get("device"),
            )

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """`cache` (generation, one pipeline stage): continue after its cached positions."""
        offset = cache.offset if cache is not None else 0
        x = self.embed(tokens, offset) if self.pre_process else self.input_tensor
        x = self.run_layers(x, cache=cache)
        if cache is not None:
            cache.offset += tokens.shape[1]
        if not self.post_process:
            return x
        logits, _ = self.output_layer(x, weight=self.tied_output_weight())
        logits = self.mask_padding(logits)
        if labels is None:
            return logits
        losses = tp.vocab_parallel_cross_entropy(logits.float(), labels.t().contiguous())
        return losses.t()  # [b, s]


def build_gpt_chunks(
    cfg: GPTConfig,
    seed: int = 1234,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    initialize: bool = True,
) -> list[GPTModel]:
    """This rank's GPT chunks (see `parallelize.build_chunks`)."""
    return build_chunks(GPTModel, cfg, seed, device=device, dtype=dtype, initialize=initialize)


def num_parameters(cfg: GPTConfig) -> int:
    """Parameters of the whole model (tied embeddings counted once), from the config alone."""
    h = cfg.hidden_size
    return (
        cfg.num_layers * layer_parameters(cfg)
        + cfg.vocab_size * h
        + cfg.max_position_embeddings * h
        + 2 * h
    )


def _forward_flops(cfg: GPTConfig, batch: int, seq: int) -> tuple[float, float, float]:
    """FLOPs of one forward pass of the whole model, in three parts the recompute modes redo
    differently: (the layers' dense matmuls, the layers' attention cores, the logits 2BshV)."""
    dense, core = transformer_forward_flops(cfg, batch, seq)
    return dense, core, 2 * batch * seq * cfg.hidden_size * cfg.vocab_size


def model_flops_per_iteration(cfg: GPTConfig, global_batch: int, seq_length: int) -> float:
    """Model FLOPs of one training iteration, the numerator of MFU: what the model needs,
    whatever is recomputed.  Forward once, backward twice the forward (the gradients of the
    inputs and of the weights), so with f = 4h and V the padded vocabulary:

        3 (24 B s l h^2 + 4 B s^2 h l + 2 B s h V) = 72 B s l h^2 (1 + s/6h + V/12lh)

    (Narayanan et al. 2021's count without its recompute pass).
    """
    dense, core, logits = _forward_flops(cfg, global_batch, seq_length)
    return 3 * (dense + core + logits)


def hardware_flops_per_iteration(
    cfg: GPTConfig, global_batch: int, seq_length: int, recompute: str | None = None
) -> float:
    """Hardware FLOPs of one training iteration, the numerator of HFU: the model FLOPs plus
    what recomputation runs again in backward.  `recompute` defaults to `cfg.recompute`.

    - "none": nothing again; HFU = MFU.
    - "full": every layer's forward again (not the logits, which are outside the
      checkpointed layers): 4 (24 B s l h^2 + 4 B s^2 h l) + 3 (2 B s h V)
      = 96 B s l h^2 (1 + s/6h + V/16lh), the count Narayanan et al. 2021 report.
    - "selective": only the attention core again (QK^T and scores x V; Korthikanti et al.
      2022): 72 B s l h^2 (1 + s/6h + V/12lh) + 4 B s^2 h l
      = 72 B s l h^2 (1 + 2s/9h + V/12lh).
    """
    model = model_flops_per_iteration(cfg, global_batch, seq_length)
    return model + recomputed_flops(cfg, global_batch, seq_length, recompute)
