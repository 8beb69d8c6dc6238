"""BERT (paper section 3, Table 4, Fig. 7) on the shared transformer (`models/transformer.py`).

Bidirectional attention with a key-padding mask, BERT's exact GeLU, two token types, and
either block order: "pre_ln" is the paper's architecture (b), LayerNorm on the input of
attention and MLP plus a final LayerNorm, which trains stably as BERT grows; "post_ln" is
the original BERT's (a), LayerNorm after each residual add and on the embeddings.

The heads, on the last pipeline stage, as Megatron's BERT:

- masked LM: dense h -> h, GeLU, LayerNorm, then the word embeddings (tied, split over the
  vocabulary) with a vocabulary-parallel bias; the cross entropy is taken through
  `vocab_parallel_cross_entropy` on the masked positions only (picked before the head, so
  the logits of the other 85% are never computed), averaged over them.
- sentence-order prediction: the pooler (dense + tanh on [CLS]'s final hidden state) and
  a 2-way linear head; label 1 = the segments were swapped.

The heads are replicated over TP ranks and run on the whole sequence: under sequence
parallelism the final hidden states are gathered first, with a backward that only splits
(every TP rank then computes the same heads on the same tokens, so their gradients need no
reduction).  Their weights are drawn from private generators below the transformer's
(`seed - 3`: LM head, `seed - 4`: pooler, `seed - 5`: SOP head), so every layout holds the
same numbers.
"""

import torch
import torch.nn.functional as F
from torch import nn

from megacore import tensor_parallel as tp
from megatrain.models.common import cpu_generator, layer_norm
from megatrain.models.layout import build_chunks
from megatrain.models.transformer import LanguageModel
from megatrain.models.transformer_config import GELUS, TransformerConfig


def bert_config(**fields) -> TransformerConfig:
    """A TransformerConfig with BERT's settings (bidirectional, erf GeLU, two token types,
    pre_ln unless `block_order="post_ln"`, LayerNorm epsilon 1e-12 as BERT's)."""
    settings = {"causal": False, "gelu": "erf", "num_tokentypes": 2, "layernorm_epsilon": 1e-12}
    return TransformerConfig(**{**settings, **fields})


def replicated_linear(cfg, rows: int, cols: int, seed: int, device, dtype, initialize):
    """nn.Linear(cols -> rows), weight N(0, std) from its own generator, bias zero."""
    layer = nn.Linear(cols, rows, device="cpu" if device is None else device, dtype=dtype)
    if initialize:
        full = torch.empty(rows, cols)
        tp.init_method_normal(cfg.init_method_std)(full, generator=cpu_generator(seed))
        with torch.no_grad():
            layer.weight.copy_(full)
            layer.bias.zero_()
    return layer


class BertModel(LanguageModel):
    """The whole BERT, or one pipeline chunk.

    `forward(tokens, token_types, padding_mask, ...)` with [b, s] inputs (`padding_mask`
    True on real tokens).  A stage before the last returns its activations [s, b, h].  The
    last stage returns, given `mlm_labels` [b, s], `loss_mask` [b, s] (1 where a token is to
    be predicted) and `sop_labels` [b], a dict of scalar tensors: "mlm_loss" (mean over the
    predicted tokens), "sop_loss", "sop_accuracy" and "loss" (their sum); without labels,
    (masked-LM logits [s, b, v/tp] of every position, SOP logits [b, 2]).  Pass `loss_mask`
    on the CPU to spare a host sync: the positions it selects are found there.

    `encode` gives the encoder's output alone (a fine-tuning head's input); a subclass with
    `PRETRAINING_HEADS = False` builds the pooler but not the MLM and SOP heads, whose
    weights a pretraining checkpoint then simply does not load.
    """

    PRETRAINING_HEADS = True

    def __init__(
        self,
        cfg: TransformerConfig,
        layer_ids=None,
        pre_process: bool = True,
        post_process: bool = True,
        seed: int = 1234,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        initialize: bool = True,
        parallel=None,
    ):
        if cfg.causal or cfg.num_tokentypes < 1:
            raise ValueError("BertModel: needs bidirectional attention and token types")
        super().__init__(
            cfg,
            layer_ids,
            pre_process,
            post_process,
            seed,
            device=device,
            dtype=dtype,
            initialize=initialize,
            parallel=parallel,
        )
        if not post_process:
            return
        h = cfg.hidden_size
        self.pooler = replicated_linear(cfg, h, h, seed - 4, device, dtype, initialize)
        if not self.PRETRAINING_HEADS:
            return
        self.lm_dense = replicated_linear(cfg, h, h, seed - 3, device, dtype, initialize)
        self.lm_layernorm = layer_norm(cfg, device, dtype)
        for p in self.lm_layernorm.parameters():
            p.sequence_parallel = False  # after the gather: every rank sees every token
        self.lm_output = tp.ColumnParallelLinear(
            h,
            cfg.vocab_size,
            bias=False,
            skip_weight_param_allocation=True,
            params_dtype=dtype,
            device=device,
        )
        rows = tp.divide_by_tp(cfg.vocab_size, "vocab_size")
        self.lm_bias = nn.Parameter(torch.zeros(rows, device=device, dtype=dtype))
        tp.set_tensor_model_parallel_attributes(self.lm_bias, True, 0)
        self.sop_head = replicated_linear(cfg, 2, h, seed - 5, device, dtype, initialize)

    def _mlm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., h] -> this rank's vocabulary slice of the logits [..., v/tp]."""
        x = F.gelu(self.lm_dense(hidden), approximate=GELUS[self.config.gelu])
        logits, _ = self.lm_output(self.lm_layernorm(x), weight=self.tied_output_weight())
        return self.mask_padding(logits + self.lm_bias)

    def encode(self, tokens: torch.Tensor, token_types: torch.Tensor, padding_mask: torch.Tensor):
        """The encoder: a stage before the last returns its activations [s, b, h]; the last
        returns (the final hidden states [s, b, h] of the whole sequence, the pooled [CLS]
        [b, h]), the same on every TP rank."""
        device = tokens.device if self.pre_process else self.input_tensor.device
        # Keys to attend, broadcast over heads and queries: [b, 1, 1, s].
        mask = padding_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
        x = self.embed(tokens, token_types=token_types) if self.pre_process else self.input_tensor
        x = self.run_layers(x, mask)
        if not self.post_process:
            return x
        if self.config.sequence_parallel:
            x = tp.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
        return x, torch.tanh(self.pooler(x[0]))  # [CLS] is position 0

    def forward(
        self,
        tokens: torch.Tensor,
        token_types: torch.Tensor,
        padding_mask: torch.Tensor,
        mlm_labels: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        sop_labels: torch.Tensor | None = None,
    ):
        out = self.encode(tokens, token_types, padding_mask)
        if not self.post_process:
            return out
        x, pooled = out
        sop_logits = self.sop_head(pooled)
        if mlm_labels is None:
            return self._mlm_logits(x), sop_logits
        s, b, h = x.shape
        # The positions to predict, in the [s, b] order of x, found where loss_mask lives.
        picked = loss_mask.t().reshape(-1).nonzero().squeeze(1).to(x.device, non_blocking=True)
        targets = mlm_labels.to(x.device).t().reshape(-1).index_select(0, picked)
        logits = self._mlm_logits(x.reshape(s * b, h).index_select(0, picked))
        mlm_losses = tp.vocab_parallel_cross_entropy(logits.float(), targets)
        mlm_loss = mlm_losses.sum() / max(1, picked.numel())
        sop_labels = sop_labels.to(x.device)
        sop_loss = F.cross_entropy(sop_logits.float(), sop_labels)
        accuracy = (sop_logits.argmax(-1) == sop_labels).float().mean()
        return {
            "loss": mlm_loss + sop_loss,
            "mlm_loss": mlm_loss,
            "sop_loss": sop_loss,
            "sop_accuracy": accuracy,
        }


def build_bert_chunks(
    cfg: TransformerConfig,
    seed: int = 1234,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    initialize: bool = True,
) -> list[BertModel]:
    """This rank's BERT chunks (see `layout.build_chunks`), as built: `parallelize_model`
    applies the run's parallelism to them."""
    return build_chunks(BertModel, cfg, seed, device=device, dtype=dtype, initialize=initialize)


__all__ = [
    "BertModel",
    "bert_config",
    "build_bert_chunks",
]
