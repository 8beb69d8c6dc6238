"""The transformer GPT and BERT share, from megacore's tensor-parallel pieces.

One layer (`TransformerLayer`: an attention and an MLP, each of the kind `models.spec`
chooses, with normalization and residuals around them) and one language-model base
(`LanguageModel`): word embeddings split over the (padded) vocabulary and tied to the
output layer, learned positions, optional token types, the layers of one pipeline chunk,
and the logits with the padding rows of the vocabulary masked out.  What differs between
the models is a setting of `TransformerConfig`:

- `block_order`: "pre_ln" (GPT-2, and BERT as the paper reorders it, Fig. 7 (b)):
  LayerNorm on the input of attention and of the MLP, a final LayerNorm; "post_ln"
  (the original BERT, Fig. 7 (a)): LayerNorm after each residual add, and one on the
  embeddings instead of a final one.
- `causal`: causal attention (GPT) or bidirectional with a key-padding mask (BERT),
  both through `scaled_dot_product_attention` (a [b, 1, 1, s] boolean mask, never an
  s x s one).
- `gelu`: GPT-2's tanh approximation or BERT's exact (erf) GeLU.
- `num_tokentypes`: BERT's segment embeddings (0: none).
- The Llama family's switches: `normalization` "rmsnorm" (RMSNorm, computed in fp32 as HF
  does), `position_embedding` "rope" (rotary embeddings on queries and keys, base
  `rotary_base`, Llama 3.1's frequency scaling when `rope_scaling_factor`), `swiglu` (an MLP
  of gate and up projections, SiLU(gate) x up), `num_query_groups` (grouped-query attention:
  heads share key/value heads), `add_bias` False (no biases in the linears) and
  `tie_output` False (an output layer of its own).  Their defaults are GPT-2's.

Attention heads are split over TP ranks (`models.attention`); the MLP of ffn_hidden_size
(4h) is column- then row-parallel (`models.mlp`; the routed experts: `models.moe`).
Activations are [sequence, batch, hidden]. Every piece is drawn from its own CPU
`torch.Generator` (word embeddings `seed`, positions `seed - 1`, token types `seed - 2`,
layer i `seed + 1 + i`; the models' heads below that) at full size and then sliced, so any
(tp, pp, vpp) layout holds the same numbers as one process. The parameters are allocated on
their device in their dtype and the slices copied there: drawing on the CPU keeps a
GPU-built model equal to a CPU-built one, and private generators leave the global ones
(which dropout uses) untouched, so building a model changes no random state.
"""

from functools import partial

import torch
from torch import nn
from torch.nn.utils import skip_init

from megacore import tensor_parallel as tp
from megatrain.models.attention.inputs import AttentionInputs
from megatrain.models.attention.kv_cache import KVCache
from megatrain.models.common import (
    bias_dropout_add,
    cpu_generator,
    dropout,
    layer_norm,
    layer_norm_in,
    placement,
)
from megatrain.models.layout import ParallelContext
from megatrain.models.spec import attention_for, mlp_for
from megatrain.models.transformer_config import TransformerConfig


class TransformerLayer(nn.Module):
    """One block, its parameters placed by `place` (`common.placement`); its weights are drawn
    from the placement's generator in order: the attention's (`models.spec.attention_for`),
    then the MLP's (`models.spec.mlp_for`), each as its kind says.
    `parallel`: the rank's place in the layout (None: megacore's process groups).
    `block_order` "pre_ln": x + f(LN(x)); "post_ln": LN(x + f(x)) (the original BERT)."""

    def __init__(
        self,
        cfg: TransformerConfig,
        place: dict,
        parallel: ParallelContext | None = None,
        layer_number: int = 0,
    ):
        super().__init__()
        self.cfg = cfg
        self.ln1 = layer_norm_in(cfg, place)
        parallel = parallel or ParallelContext.from_process_groups()
        self.attention = attention_for(cfg, place, parallel, layer_number)
        self.ln2 = layer_norm_in(cfg, place)
        self.mlp = mlp_for(cfg, place, parallel, layer_number)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        layer_id: int = 0,
    ) -> torch.Tensor:
        p, sp = self.cfg.hidden_dropout, self.cfg.sequence_parallel
        if self.cfg.block_order == "post_ln":
            out, bias = self.attention(x, mask, cache, layer_id)
            x = self.ln1(bias_dropout_add(out, bias, x, p, self.training, sp))
            out, bias = self.mlp(x)
            return self.ln2(bias_dropout_add(out, bias, x, p, self.training, sp))
        out, bias = self.attention(self.ln1(x), mask, cache, layer_id)
        x = bias_dropout_add(out, bias, x, p, self.training, sp)
        out, bias = self.mlp(self.ln2(x))
        return bias_dropout_add(out, bias, x, p, self.training, sp)


def _forked(layer, *args):
    with tp.get_rng_tracker().fork():
        return layer(*args)


class LanguageModel(nn.Module):
    """What GPT and BERT share: the embeddings (words split over the padded vocabulary,
    positions, token types when `num_tokentypes`), the layers of one pipeline chunk
    (`layer_ids`, `pre_process`, `post_process`), the final LayerNorm (pre_ln) and the
    word embeddings for the tied output layer (`tied_output_weight()`), with logits' padding
    rows masked (`mask_padding`).  The models add their heads and their `forward`.

    Built directly on `device` in `dtype`; a last stage's copy of the word embeddings (for
    a tied output layer, or multi-token prediction) is zero until `layout.build_chunks`
    syncs it.  `initialize=False` skips drawing the weights (their values are whatever the
    memory held), for a model a checkpoint is about to overwrite."""

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
        parallel: ParallelContext | None = None,
    ):
        super().__init__()
        self.config = cfg
        # Where this chunk sits in the layout; None: megacore's process groups, read once here.
        self.parallel = parallel or ParallelContext.from_process_groups()
        # A layer as the chunk runs it while training; `parallelize.apply_recompute` puts
        # full recompute here (None: the layer itself).
        self.checkpointed_layer = None
        self.context_parallel = None  # parallelize.apply_context_parallel sets it
        self.pre_process, self.post_process = pre_process, post_process
        # How the chunk is built, for the parts a model adds to it (GPT's MTP depths).
        self.built_with = (seed, device, dtype, initialize)
        self.input_tensor = None
        if pre_process:
            self.embedding = tp.VocabParallelEmbedding(
                cfg.vocab_size,
                cfg.hidden_size,
                perform_initialization=False,  # _init_word_embeddings: padding rows zero
                params_dtype=dtype,
                device=device,
            )
            if initialize:
                self._init_vocab_rows(self.embedding.weight, seed)
            if cfg.position_embedding == "learned":
                self.position_embedding = self._replicated_embedding(
                    cfg.max_position_embeddings, seed - 1, device, dtype, initialize
                )
            if cfg.num_tokentypes:
                self.tokentype_embedding = self._replicated_embedding(
                    cfg.num_tokentypes, seed - 2, device, dtype, initialize
                )
            if cfg.block_order == "post_ln":  # the original BERT normalizes its embeddings
                self.embedding_layernorm = layer_norm(cfg, device, dtype)
                for p in self.embedding_layernorm.parameters():
                    p.sequence_parallel = False  # before the scatter: every rank sees all tokens
        self.layer_ids = list(range(cfg.num_layers) if layer_ids is None else layer_ids)
        self.layers = nn.ModuleDict(
            {
                str(i): TransformerLayer(
                    cfg,
                    placement(cpu_generator(seed + 1 + i), device, dtype, initialize),
                    self.parallel,
                    layer_number=i,
                )
                for i in self.layer_ids
            }
        )
        self.output_weight = None
        if post_process:
            if cfg.block_order == "pre_ln":
                self.final_layernorm = layer_norm(cfg, device, dtype)
            if not cfg.tie_output:  # an output layer of its own (seed - 3), padding rows zero
                self.output_layer = tp.ColumnParallelLinear(
                    cfg.hidden_size,
                    cfg.vocab_size,
                    bias=False,
                    sequence_parallel=cfg.sequence_parallel,
                    perform_initialization=False,
                    params_dtype=dtype,
                    device=device,
                )
                if initialize:
                    self._init_vocab_rows(self.output_layer.weight, seed - 3)
            # A copy of the word embeddings on the last stage, kept equal by pipeline_parallel:
            # the tied output layer's weight, and what multi-token prediction embeds with.
            if not pre_process and (cfg.tie_output or cfg.mtp_num_layers):
                rows = tp.divide_by_tp(cfg.vocab_size, "vocab_size")
                self.output_weight = nn.Parameter(
                    torch.zeros(rows, cfg.hidden_size, device=device, dtype=dtype)
                )
                tp.set_tensor_model_parallel_attributes(self.output_weight, True, 0)
                self.output_weight.shared_embedding = True
        if pre_process and not post_process and (cfg.tie_output or cfg.mtp_num_layers):
            self.embedding.weight.shared_embedding = True

    def _replicated_embedding(self, rows: int, seed: int, device, dtype, initialize: bool):
        # skip_init: nn.Embedding's own init would draw from the global generator.  It
        # builds on "meta" and stays there when told device=None: name the CPU.
        table = skip_init(
            nn.Embedding,
            rows,
            self.config.hidden_size,
            device="cpu" if device is None else device,
            dtype=dtype,
        )
        if initialize:  # drawn on the CPU in float32, like every other weight, then copied
            full = torch.empty(table.weight.shape)
            tp.init_method_normal(self.config.init_method_std)(full, generator=cpu_generator(seed))
            with torch.no_grad():
                table.weight.copy_(full)
        return table

    @torch.no_grad()
    def _init_vocab_rows(self, weight: torch.Tensor, seed: int) -> None:
        """This rank's rows of a [vocabulary, hidden] matrix (the word embeddings, an untied
        output layer): the real vocabulary's rows drawn as one matrix, padding rows zero, so
        the same numbers whatever the padding (which depends on tp)."""
        cfg = self.config
        rows = cfg.true_vocab_size or cfg.vocab_size
        full = torch.zeros(cfg.vocab_size, cfg.hidden_size)
        init = tp.init_method_normal(cfg.init_method_std)
        init(full[:rows], generator=cpu_generator(seed))
        p = self.parallel
        weight.copy_(tp.shard_of(full, 0, p.tp_rank, p.tp_size))

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """The pipeline schedule hands a non-first stage its input here."""
        self.input_tensor = tensor

    def embed(
        self,
        tokens: torch.Tensor,
        offset: int = 0,
        token_types: torch.Tensor | None = None,
        inputs: AttentionInputs | None = None,
    ) -> torch.Tensor:
        """[b, s] token ids (and token types) -> [s, b, h] (this rank's part of s under
        sequence parallelism), positions from `offset`, or `inputs.position_ids`."""
        cfg = self.config
        positions = inputs.position_ids if inputs is not None else None
        end = offset + tokens.shape[1] if positions is None else inputs.seq_len
        if end > cfg.max_position_embeddings:
            raise ValueError(
                f"{type(self).__name__}: sequence of {end} tokens is longer than the position "
                f"table (max_position_embeddings={cfg.max_position_embeddings})"
            )
        x = self.embedding(tokens)
        if cfg.position_embedding == "learned":  # rotary positions are applied in attention
            if positions is None:
                positions = torch.arange(offset, end, device=tokens.device)
            x = x + self.position_embedding(positions)
        if cfg.num_tokentypes:
            if token_types is None:
                raise ValueError(f"{type(self).__name__}: token_types are needed")
            x = x + self.tokentype_embedding(token_types)
        if cfg.block_order == "post_ln":
            x = self.embedding_layernorm(x)
        return self._as_hidden(x)

    def embed_words(self, tokens: torch.Tensor) -> torch.Tensor:
        """[b, s] token ids -> their word embeddings alone as [s, b, h] hidden states (this
        rank's part of s under sequence parallelism), on any stage that holds the word
        embeddings or their copy (multi-token prediction's)."""
        weight = self.word_embeddings_weight()
        start = self.parallel.tp_rank * weight.size(0)
        return self._as_hidden(tp.vocab_parallel_embedding(tokens, weight, start))

    def _as_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """[b, s, h] embeddings -> [s, b, h], scattered under sequence parallelism, dropped out."""
        cfg = self.config
        x = x.transpose(0, 1).contiguous()  # [s, b, h]
        if cfg.sequence_parallel:
            x = tp.scatter_to_sequence_parallel_region(x)
        return dropout(x, cfg.hidden_dropout, self.training, cfg.sequence_parallel)

    def attention_inputs(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
    ) -> AttentionInputs | None:
        """The batch's `AttentionInputs` (None when it has neither positions nor documents).
        Under context parallelism `tokens` are this rank's part of a sequence cp times
        longer, and `position_ids` their global positions."""
        if position_ids is None and segments is None:
            return None
        cp = self.context_parallel.size if self.context_parallel is not None else 1
        return AttentionInputs(position_ids, segments, tokens.shape[1] * cp)

    def run_layers(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """The chunk's layers, then the final LayerNorm on a last pre_ln stage."""
        if not self.layers and not self.pre_process and not self.post_process:
            # A middle stage of no layer (parallel.pipeline_model_parallel_layout) passes its
            # input on, as a view: the schedule frees a sent output's storage, which would
            # otherwise be the received input's, still needed for the gradient it sends back.
            return x.view_as(x)
        for i, layer in self.layers.items():
            x = self.run_layer(layer, x, mask, cache, int(i))
        if self.post_process and self.config.block_order == "pre_ln":
            x = self.final_layernorm(x)
        return x

    def run_layer(
        self,
        layer: TransformerLayer,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        layer_id: int = 0,
    ) -> torch.Tensor:
        """One layer of the chunk (its own, or multi-token prediction's) as the chunk runs its
        layers: under full recompute, in the TP ranks' own random stream."""
        call = self.in_rank_stream(layer)
        if self.checkpointed_layer is not None and self.training:
            return self.checkpointed_layer(call, x, mask)
        if cache is None:
            # No layer id when there is no cache to key: under training.compile one compiled
            # graph then serves every layer (an id would recompile per layer).
            return call(x, mask)
        return layer(x, mask, cache, layer_id)

    def transformer_layers(self) -> list[TransformerLayer]:
        """Every transformer layer of the chunk, its own then multi-token prediction's: what
        recompute, context parallelism, compile, float8 and FSDP apply to."""
        mtp = getattr(self, "mtp", None)
        return [*self.layers.values(), *(mtp.transformer_layers() if mtp is not None else [])]

    def in_rank_stream(self, layer):
        """`layer`, or `layer` called inside the TP ranks' own random stream when every draw
        in a training layer is per rank: under sequence parallelism at tp > 1 the attention
        dropout falls on the rank's heads and the hidden dropout on its tokens.  One fork
        around the layer then replaces one per draw inside it (those become no-ops, the same
        masks in the same order), so a compiled or graphed layer holds no generator swap."""
        cfg = self.config
        per_rank = cfg.sequence_parallel and self.parallel.tp_size > 1
        if not (self.training and per_rank and (cfg.hidden_dropout or cfg.attention_dropout)):
            return layer
        return partial(_forked, layer)

    def tied_output_weight(self) -> torch.Tensor | None:
        """The word embeddings (this rank's vocabulary rows), for the tied output layer; None
        when the output layer has its own weight (`tie_output` False)."""
        if not self.config.tie_output:
            return None
        return self.word_embeddings_weight()

    def word_embeddings_weight(self) -> torch.Tensor:
        """This rank's vocabulary rows of the word embeddings: the first stage's own, or the
        last stage's copy (`output_weight`)."""
        return self.embedding.weight if self.output_weight is None else self.output_weight

    def mask_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """-inf on the padding rows of the vocabulary (this rank's slice of the last dim)."""
        true_vocab = self.config.true_vocab_size
        local = logits.shape[-1]
        start = self.parallel.tp_rank * local
        if true_vocab is None or start + local <= true_vocab:
            return logits
        keep = max(0, true_vocab - start)
        padding = torch.arange(local, device=logits.device) >= keep
        return logits.masked_fill(padding, float("-inf"))
