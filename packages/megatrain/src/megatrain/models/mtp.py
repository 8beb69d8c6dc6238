"""DeepSeek-V3's multi-token prediction (MTP): depths on the last pipeline stage, each predicting
one token further ahead than the one before it.

Depth k (1..D) at position i joins what the depth before it made of the position, h^{k-1}_i
(depth 0: the model's output after its final norm), with the embedding of the token k places
ahead, t_{i+k}, and predicts t_{i+k+1}:

    h^k_i = norm_k(Layer_k(eh_proj([enorm(emb(t_{i+k})); hnorm(h^{k-1}_i)])))

- the embedding first in the concatenation, as DeepSeek's files and vLLM order it;
- `emb` the model's word embeddings (HF's MTP `embed_tokens` is a copy of them), which a last
  stage without them holds as a copy kept equal through the embedding group, as a tied
  output layer's (`LanguageModel.output_weight`, `megacore.pipeline_parallel`'s shared
  embeddings);
- `Layer_k` one transformer layer, dense or MoE as `spec` builds the layer at position
  num_layers + k - 1 (where HF stores it, `model.layers.{num_hidden_layers + k - 1}`), its
  weights drawn from that position's generator (seed + 1 + position);
- `norm_k` the depth's own final norm (HF's `shared_head.norm`); its output feeds depth k + 1
  and the model's output layer (HF's `shared_head.head` is that layer), as megatron-core's
  MTP block does;
- `eh_proj` column-parallel as megatron-core's: the concatenation in, this rank's columns of
  h gathered over TP, scattered back over the sequence under sequence parallelism.

The parameters are `mtp.layers.<k-1>.{enorm, hnorm, eh_proj, layer, final_layernorm}`.  The
model returns the loss per token and depth (`MultiTokenPrediction.forward`); which positions
count and how the depths' losses are normalised is the train step's (`run.step`), from the
targets `mtp_targets` makes of the whole sequence before any context-parallel split.
"""

import torch
from torch import nn

from megacore import tensor_parallel as tp
from megatrain.models.attention.inputs import AttentionInputs
from megatrain.models.common import cpu_generator, layer_norm_in, placement
from megatrain.models.layout import ParallelContext
from megatrain.models.transformer import TransformerLayer
from megatrain.models.transformer_config import TransformerConfig

# The batch's arrays for the depths, [b, s, D] each (`mtp_targets`).
MTP_BATCH_KEYS = ("mtp_tokens", "mtp_labels", "mtp_mask")


class MTPLayer(nn.Module):
    """One depth: enorm, hnorm, eh_proj, a transformer layer, its final norm (module docstring)."""

    def __init__(
        self, cfg: TransformerConfig, place: dict, parallel: ParallelContext, layer_number: int
    ):
        super().__init__()
        self.cfg = cfg
        self.enorm = layer_norm_in(cfg, place)
        self.hnorm = layer_norm_in(cfg, place)
        self.eh_proj = tp.ColumnParallelLinear(
            2 * cfg.hidden_size,
            cfg.hidden_size,
            bias=False,
            sequence_parallel=cfg.sequence_parallel,
            init_method=tp.init_method_normal(cfg.init_method_std),
            **place,
        )
        self.layer = TransformerLayer(cfg, place, parallel, layer_number)
        self.final_layernorm = layer_norm_in(cfg, place)

    def forward(
        self,
        model,
        embedded: torch.Tensor,
        hidden: torch.Tensor,
        inputs: AttentionInputs | None,
    ) -> torch.Tensor:
        """[s, b, h] (s / tp under sequence parallelism) embeddings of the tokens k ahead and
        the depth before's states -> this depth's, normed; `model` runs the layer as it runs
        its own (recompute, the TP ranks' random stream)."""
        x, _ = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        # This rank's columns of h for every token -> all of h for its tokens.
        x = tp.gather_from_tensor_model_parallel_region(x)
        if self.cfg.sequence_parallel:
            x = tp.scatter_to_sequence_parallel_region(x)
        return self.final_layernorm(model.run_layer(self.layer, x, inputs))


class MultiTokenPrediction(nn.Module):
    """The D depths of a last stage (`cfg.mtp_num_layers`); `forward` gives their loss per
    token, [b, s, D]."""

    def __init__(
        self,
        cfg: TransformerConfig,
        seed: int,
        parallel: ParallelContext,
        *,
        device=None,
        dtype: torch.dtype = torch.float32,
        initialize: bool = True,
    ):
        super().__init__()
        first = cfg.num_layers  # HF's model.layers.{num_hidden_layers}
        self.layers = nn.ModuleDict(
            {
                str(k): MTPLayer(
                    cfg,
                    placement(cpu_generator(seed + 1 + first + k), device, dtype, initialize),
                    parallel,
                    layer_number=first + k,
                )
                for k in range(cfg.mtp_num_layers)
            }
        )

    def transformer_layers(self) -> list[TransformerLayer]:
        return [depth.layer for depth in self.layers.values()]

    def forward(
        self,
        model,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        inputs: AttentionInputs | None,
    ) -> torch.Tensor:
        """The loss per token of each depth, [b, s, D], from the model's output `hidden`
        [s, b, h] and `mtp_targets`' tokens and labels [b, s, D] (this rank's positions under
        context parallelism); `model` (the `GPTModel` chunk) embeds and computes the losses."""
        losses = []
        for k, depth in enumerate(self.layers.values()):
            hidden = depth(model, model.embed_words(tokens[..., k]), hidden, inputs)
            losses.append(model.token_losses(hidden, labels[..., k]))
        return torch.stack(losses, dim=-1)


def mtp_targets(batch: dict, depth: int) -> dict:
    """`batch` (a GPT microbatch, [b, s] arrays, the whole sequence) with each depth's arrays,
    [b, s, depth]: the input tokens t_{i+k} ("mtp_tokens"), the targets t_{i+k+1}
    ("mtp_labels", labels[i+k]) and which count ("mtp_mask", float): those of the main loss
    shifted k (`loss_mask[i+k]`, data.eod_mask_loss), never past the sequence's end (i + k < s)
    and, with packed documents (`segments`, data.reset_attention_mask), never with the token k
    ahead in another document than position i's.  Made before a context-parallel split, so a
    shift across a CP chunk's edge reads the token the other rank holds."""
    tokens, labels = batch["tokens"], batch["labels"]
    b, s = tokens.shape
    shape = (b, s, depth)
    shifted_tokens = torch.zeros(shape, dtype=tokens.dtype, device=tokens.device)
    shifted_labels = torch.zeros(shape, dtype=labels.dtype, device=labels.device)
    mask = torch.zeros(shape, dtype=torch.float32, device=tokens.device)
    loss_mask, segments = batch.get("loss_mask"), batch.get("segments")
    for k in range(1, depth + 1):
        shifted_tokens[:, : s - k, k - 1] = tokens[:, k:]
        shifted_labels[:, : s - k, k - 1] = labels[:, k:]
        keep = torch.ones(b, s - k, dtype=torch.float32, device=tokens.device)
        if loss_mask is not None:
            keep = keep * loss_mask[:, k:].to(keep.device, torch.float32)
        if segments is not None:
            keep = keep * (segments[:, k:] == segments[:, : s - k]).to(keep.device, keep.dtype)
        mask[:, : s - k, k - 1] = keep
    return {**batch, "mtp_tokens": shifted_tokens, "mtp_labels": shifted_labels, "mtp_mask": mask}
