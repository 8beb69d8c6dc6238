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
from megatrain.models.mtp import MultiTokenPrediction
from megatrain.models.transformer import LanguageModel
from megatrain.models.transformer_config import TransformerConfig

# GPT's settings are TransformerConfig's defaults (pre_ln, causal, tanh GeLU, no token types).
GPTConfig = TransformerConfig

__all__ = ["GPTConfig", "GPTModel", "build_gpt_chunks"]


class GPTModel(LanguageModel):
    """The whole GPT-2, or one pipeline chunk: `forward(tokens, labels)` gives the loss per token
    [b, s] on the last stage (with `fused_linear_cross_entropy`: their mean, 0-d, its
    gradients made in the forward), the activations [s, b, h] before it, and logits (this rank's
    vocabulary slice, [s, b, v/tp]) when `labels` is None.  With multi-token prediction
    (`mtp_num_layers`; `models.mtp`) a last stage given the depths' tokens and labels gives
    {"lm": the loss per token, "mtp": each depth's, [b, s, D]}.  See `LanguageModel` for how
    it is built."""

    def __init__(self, cfg: GPTConfig, *args, **kwargs):
        if not cfg.causal or cfg.num_tokentypes:
            raise ValueError("GPTModel: needs causal attention and no token types")
        super().__init__(cfg, *args, **kwargs)
        seed, device, dtype, initialize = self.built_with
        if self.post_process and cfg.tie_output:  # untied: LanguageModel built it, weight and all
            self.output_layer = tp.ColumnParallelLinear(
                cfg.hidden_size,
                cfg.vocab_size,
                bias=False,
                sequence_parallel=cfg.sequence_parallel,
                skip_weight_param_allocation=True,
                params_dtype=dtype,
                device=device,
            )
        if cfg.mtp_num_layers and cfg.fused_linear_cross_entropy:
            raise ValueError(
                "GPTModel: multi-token prediction needs the loss per token, which "
                "fused_linear_cross_entropy does not give"
            )
        self.mtp = None
        if self.post_process and cfg.mtp_num_layers:
            self.mtp = MultiTokenPrediction(
                cfg, seed, self.parallel, device=device, dtype=dtype, initialize=initialize
            )

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        cache: KVCache | None = None,
        position_ids: torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
        mtp_tokens: torch.Tensor | None = None,
        mtp_labels: torch.Tensor | None = None,
    ) -> torch.Tensor | dict:
        """`cache` (generation, one pipeline stage): continue after its cached positions.
        Packed documents (`data.reset_*`): `position_ids` [b, s] per token and `segments`
        [b, s], each token's document, attention staying within it.  `mtp_tokens`,
        `mtp_labels` [b, s, D]: multi-token prediction's inputs and targets
        (`mtp.mtp_targets`)."""
        offset = cache.offset if cache is not None else 0
        inputs = self.attention_inputs(tokens, position_ids, segments)
        x = self.embed(tokens, offset, inputs=inputs) if self.pre_process else self.input_tensor
        x = self.run_layers(x, inputs, cache=cache)
        if cache is not None:
            cache.offset += tokens.shape[1]
        if not self.post_process:
            return x
        if labels is None:
            return self.logits(x)
        weight = self.tied_output_weight()
        if self.config.fused_linear_cross_entropy:
            return tp.linear_vocab_parallel_cross_entropy(  # the mean, 0-d
                self.output_layer.parallel_input(x),
                self.output_layer.weight if weight is None else weight,
                labels.t(),
                true_vocab_size=self.config.true_vocab_size,
            )
        losses = self.token_losses(x, labels)
        if self.mtp is None or mtp_tokens is None:
            return losses
        return {"lm": losses, "mtp": self.mtp(self, x, mtp_tokens, mtp_labels, inputs)}

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """[s, b, h] final hidden states -> logits, this rank's vocabulary slice [s, b, v/tp],
        the padding rows -inf."""
        logits, _ = self.output_layer(x, weight=self.tied_output_weight())
        return self.mask_padding(logits)

    def token_losses(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """[s, b, h] final hidden states and [b, s] labels -> the loss per token [b, s]."""
        logits = self.logits(x)
        losses = tp.vocab_parallel_cross_entropy(logits.float(), labels.t().contiguous())
        return losses.t()


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
