"""GPT-2 (paper section 2.2), and the Llama family, on the shared transformer
(`models/transformer.py`).

Pre-LayerNorm blocks, causal attention, GPT-2's tanh GeLU, learned positions, word
embeddings tied to the output layer, a final LayerNorm: `TransformerConfig`'s defaults.  A
Llama is the same model with its switches set (RMSNorm, rotary positions, SwiGLU,
grouped-query attention, no biases, an output layer of its own).

Generation passes a `KVCache`: each attention layer appends its keys and values and
attends over all cached positions, so a new token costs one position's work.

`GPTModel` is the whole model or one pipeline chunk of it (`layer_ids`, `pre_process`,
`post_process`); `build_gpt_chunks` builds this rank's chunks.
"""

import torch

from megacore import tensor_parallel as tp
from megatrain.models.attention.kv_cache import KVCache
from megatrain.models.layout import build_chunks
from megatrain.models.transformer import LanguageModel
from megatrain.models.transformer_config import TransformerConfig

# GPT's settings are TransformerConfig's defaults (pre_ln, causal, tanh GeLU, no token types).
GPTConfig = TransformerConfig

__all__ = ["GPTConfig", "GPTModel", "build_gpt_chunks"]


class GPTModel(LanguageModel):
    """The whole GPT-2, or one pipeline chunk: `forward(tokens, labels)` gives the loss per token
    [b, s] on the last stage (with `fused_linear_cross_entropy`: their mean, 0-d, its
    gradients made in the forward), the activations [s, b, h] before it, and logits (this rank's
    vocabulary slice, [s, b, v/tp]) when `labels` is None.  See `LanguageModel` for how it
    is built."""

    def __init__(self, cfg: GPTConfig, *args, **kwargs):
        if not cfg.causal or cfg.num_tokentypes:
            raise ValueError("GPTModel: needs causal attention and no token types")
        super().__init__(cfg, *args, **kwargs)
        if self.post_process and cfg.tie_output:  # untied: LanguageModel built it, weight and all
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
        position_ids: torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`cache` (generation, one pipeline stage): continue after its cached positions.
        Packed documents (`data.reset_*`): `position_ids` [b, s] per token and `segments`
        [b, s], each token's document, attention staying within it."""
        offset = cache.offset if cache is not None else 0
        inputs = self.attention_inputs(tokens, position_ids, segments)
        x = self.embed(tokens, offset, inputs=inputs) if self.pre_process else self.input_tensor
        x = self.run_layers(x, inputs, cache=cache)
        if cache is not None:
            cache.offset += tokens.shape[1]
        if not self.post_process:
            return x
        weight = self.tied_output_weight()
        if labels is not None and self.config.fused_linear_cross_entropy:
            return tp.linear_vocab_parallel_cross_entropy(  # the mean, 0-d
                self.output_layer.parallel_input(x),
                self.output_layer.weight if weight is None else weight,
                labels.t(),
                true_vocab_size=self.config.true_vocab_size,
            )
        logits, _ = self.output_layer(x, weight=weight)
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
    """This rank's GPT chunks (see `layout.build_chunks`), as built: `parallelize_model`
    applies the run's parallelism to them."""
    return build_chunks(GPTModel, cfg, seed, device=device, dtype=dtype, initialize=initialize)
