"""GPT-2 (paper section 2.2) from megacore's tensor-parallel pieces.

Pre-LayerNorm blocks; attention heads split over TP ranks (QKV column-parallel,
laid out per head as [q k v] so a contiguous slice is whole heads; projection
row-parallel); GeLU MLP of ffn_hidden_size (4h) column- then row-parallel;
learned positions; word embeddings split over the (padded) vocabulary and tied
to the output layer; final LayerNorm; causal attention by
`scaled_dot_product_attention`.  Activations are [sequence, batch, hidden].

Generation passes a `KVCache`: each attention layer appends its keys and values
and attends over all cached positions, so a new token costs one position's work.

`GPTModel` is the whole model or one pipeline chunk of it (`layer_ids`,
`pre_process`, `post_process`).  Every piece is drawn from its own seed (the
embeddings from `seed`, layer i from `seed + 1 + i`) on the CPU at full size
and then sliced, so any (tp, pp, vpp) layout holds the same numbers as one process.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from megacore import parallel_state, pipeline_parallel
from megacore import tensor_parallel as tp


@dataclass
class GPTConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int  # padded: divisible by tp
    max_position_embeddings: int
    # The tokenizer's vocabulary; the logits of the padding rows above it are masked out,
    # so the padding (which depends on tp) changes nothing a layout computes.
    true_vocab_size: int | None = None
    ffn_hidden_size: int | None = None
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    recompute: str = "none"  # none | selective | full
    distribute_saved_activations: bool = False
    sequence_parallel: bool = False

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size


@dataclass
class KVCache:
    """Keys and values of the positions seen so far, per layer (local heads of this TP rank).

    `offset` is the number of cached positions; `GPTModel.forward` advances it.
    """

    max_length: int
    offset: int = 0
    layers: dict = field(default_factory=dict)  # layer id -> (keys, values) [b, heads, max, d]

    def append(self, layer_id: int, k: torch.Tensor, v: torch.Tensor):
        """Store k, v [b, heads, s, d] at the next positions; all cached keys and values."""
        b, heads, s, d = k.shape
        end = self.offset + s
        if end > self.max_length:
            raise ValueError(f"KVCache: {end} positions exceed max_length={self.max_length}")
        if layer_id not in self.layers:
            shape = (b, heads, self.max_length, d)
            self.layers[layer_id] = (k.new_empty(shape), v.new_empty(shape))
        keys, values = self.layers[layer_id]
        keys[:, :, self.offset : end] = k
        values[:, :, self.offset : end] = v
        return keys[:, :, :end], values[:, :, :end]


def _layer_norm(cfg: GPTConfig) -> nn.LayerNorm:
    ln = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
    for p in ln.parameters():  # replicated; under sequence parallelism their grads are partial
        p.sequence_parallel = cfg.sequence_parallel
    return ln


def _dropout(x: torch.Tensor, p: float, training: bool, sequence_parallel: bool) -> torch.Tensor:
    """Dropout of a replicated activation: one mask on every TP rank, or, when each rank holds
    other tokens (sequence parallelism), a mask of its own from the model-parallel stream."""
    if not (training and p):
        return x
    if sequence_parallel:
        with tp.get_rng_tracker().fork():
            return F.dropout(x, p, True)
    return F.dropout(x, p, True)


class ParallelAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        h, sp = cfg.hidden_size, cfg.sequence_parallel
        self.cfg = cfg
        self.heads_local = tp.divide_by_tp(cfg.num_attention_heads, "num_attention_heads")
        self.head_dim = tp.divide(h, cfg.num_attention_heads, "hidden_size", "num_attention_heads")
        std = cfg.init_method_std
        self.qkv = tp.ColumnParallelLinear(
            h, 3 * h, sequence_parallel=sp, init_method=tp.init_method_normal(std)
        )
        self.proj = tp.RowParallelLinear(
            h,
            h,
            input_is_parallel=True,
            sequence_parallel=sp,
            init_method=tp.scaled_init_method_normal(std, cfg.num_layers),
        )

    def _core(self, q, k, v):
        p = self.cfg.attention_dropout if self.training else 0.0
        if not p:  # no random numbers needed (so none need seeding, e.g. for evaluation)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with tp.get_rng_tracker().fork():  # local heads: another mask on each TP rank
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)

    def _cached_core(self, q, k, v, cache: KVCache, layer_id: int):
        offset = cache.offset
        k, v = cache.append(layer_id, k, v)
        s = q.shape[2]
        if offset == 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        # Query i sits at position offset + i and sees keys up to there.
        mask = torch.ones(s, offset + s, dtype=torch.bool, device=q.device).tril(offset)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, layer_id: int = 0
    ) -> torch.Tensor:
        qkv, _ = self.qkv(x)
        s, b = qkv.shape[:2]
        # [s, b, heads, 3, d] -> three of [b, heads, s, d]
        q, k, v = qkv.view(s, b, self.heads_local, 3, self.head_dim).permute(3, 1, 2, 0, 4)
        if cache is not None:
            out = self._cached_core(q, k, v, cache, layer_id)
        elif self.cfg.recompute == "selective":  # the s x s part is cheap to redo, costly to keep
            out = tp.checkpoint(self._core, False, q, k, v)
        else:
            out = self._core(q, k, v)
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.heads_local * self.head_dim)
        out, _ = self.proj(out)
        return out


class ParallelMLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        h, sp, std = cfg.hidden_size, cfg.sequence_parallel, cfg.init_method_std
        tp.divide_by_tp(cfg.ffn_hidden_size, "ffn_hidden_size")
        self.fc1 = tp.ColumnParallelLinear(
            h, cfg.ffn_hidden_size, sequence_parallel=sp, init_method=tp.init_method_normal(std)
        )
        self.fc2 = tp.RowParallelLinear(
            cfg.ffn_hidden_size,
            h,
            input_is_parallel=True,
            sequence_parallel=sp,
            init_method=tp.scaled_init_method_normal(std, cfg.num_layers),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.fc1(x)
        out, _ = self.fc2(F.gelu(hidden, approximate="tanh"))  # GPT-2's GeLU
        return out


class TransformerLayer(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.ln1, self.attention = _layer_norm(cfg), ParallelAttention(cfg)
        self.ln2, self.mlp = _layer_norm(cfg), ParallelMLP(cfg)

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, layer_id: int = 0
    ) -> torch.Tensor:
        p, sp = self.cfg.hidden_dropout, self.cfg.sequence_parallel
        x = x + _dropout(self.attention(self.ln1(x), cache, layer_id), p, self.training, sp)
        return x + _dropout(self.mlp(self.ln2(x)), p, self.training, sp)


class GPTModel(nn.Module):
    """The whole GPT-2, or one pipeline chunk: `forward(tokens, labels)` gives the loss per token
    [b, s] on the last stage, the activations [s, b, h] before it, and logits (this rank's
    vocabulary slice, [s, b, v/tp]) when `labels` is None."""

    def __init__(
        self,
        cfg: GPTConfig,
        layer_ids=None,
        pre_process: bool = True,
        post_process: bool = True,
        seed: int = 1234,
    ):
        super().__init__()
        self.config = cfg
        self.pre_process, self.post_process = pre_process, post_process
        self.input_tensor = None
        init = tp.init_method_normal(cfg.init_method_std)
        if pre_process:
            self.embedding = tp.VocabParallelEmbedding(
                cfg.vocab_size, cfg.hidden_size, perform_initialization=False
            )
            self._init_word_embeddings(seed)
            self.position_embedding = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
            torch.manual_seed(seed - 1)
            init(self.position_embedding.weight)
        self.layer_ids = list(range(cfg.num_layers) if layer_ids is None else layer_ids)
        layers = {}
        for i in self.layer_ids:
            torch.manual_seed(seed + 1 + i)
            layers[str(i)] = TransformerLayer(cfg)
        self.layers = nn.ModuleDict(layers)
        if post_process:
            self.final_layernorm = _layer_norm(cfg)
            self.output_layer = tp.ColumnParallelLinear(
                cfg.hidden_size,
                cfg.vocab_size,
                bias=False,
                sequence_parallel=cfg.sequence_parallel,
                skip_weight_param_allocation=True,
            )
            if pre_process:
                self.output_weight = None  # the word embeddings themselves
            else:  # a copy on the last stage, kept equal by megacore.pipeline_parallel
                rows = tp.divide_by_tp(cfg.vocab_size, "vocab_size")
                self.output_weight = nn.Parameter(torch.zeros(rows, cfg.hidden_size))
                tp.set_tensor_model_parallel_attributes(self.output_weight, True, 0)
                self.output_weight.shared_embedding = True
        if pre_process and not post_process:
            self.embedding.weight.shared_embedding = True

    @torch.no_grad()
    def _init_word_embeddings(self, seed: int) -> None:
        """Rows of the real vocabulary drawn as one matrix, padding rows zero: the same numbers
        whatever the padding (which depends on tp)."""
        cfg = self.config
        rows = cfg.true_vocab_size or cfg.vocab_size
        torch.manual_seed(seed)
        full = torch.zeros(cfg.vocab_size, cfg.hidden_size)
        tp.init_method_normal(cfg.init_method_std)(full[:rows])
        world = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        self.embedding.weight.copy_(tp.shard_of(full, 0, rank, world))

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """The pipeline schedule hands a non-first stage its input here."""
        self.input_tensor = tensor

    def embed(self, tokens: torch.Tensor, offset: int = 0) -> torch.Tensor:
        end = offset + tokens.shape[1]
        if end > self.config.max_position_embeddings:
            raise ValueError(
                f"GPTModel: sequence of {end} tokens is longer than the position table "
                f"(max_position_embeddings={self.config.max_position_embeddings})"
            )
        positions = torch.arange(offset, end, device=tokens.device)
        x = self.embedding(tokens) + self.position_embedding(positions)
        x = x.transpose(0, 1).contiguous()  # [s, b, h]
        if self.config.sequence_parallel:
            x = tp.scatter_to_sequence_parallel_region(x)
        return _dropout(x, self.config.hidden_dropout, self.training, self.config.sequence_parallel)

    def run_layers(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        for i, layer in self.layers.items():
            if self.config.recompute == "full" and self.training:
                x = tp.checkpoint(layer, self.config.distribute_saved_activations, x)
            else:
                x = layer(x, cache, int(i))
        return x

    def _mask_padding(self, logits: torch.Tensor) -> torch.Tensor:
        true_vocab = self.config.true_vocab_size
        local = logits.shape[-1]
        start = parallel_state.get_tensor_model_parallel_rank() * local
        if true_vocab is None or start + local <= true_vocab:
            return logits
        keep = max(0, true_vocab - start)
        padding = torch.arange(local, device=logits.device) >= keep
        return logits.masked_fill(padding, float("-inf"))

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """`cache` (generation, one pipeline stage): continue after its cached positions."""
        offset = cache.offset if cache is not None else 0
        x = self.embed(tokens, offset) if self.pre_process else self.input_tensor
        x = self.run_layers(x, cache)
        if cache is not None:
            cache.offset += tokens.shape[1]
        if not self.post_process:
            return x
        weight = self.embedding.weight if self.output_weight is None else self.output_weight
        logits, _ = self.output_layer(self.final_layernorm(x), weight=weight)
        logits = self._mask_padding(logits)
        if labels is None:
            return logits
        losses = tp.vocab_parallel_cross_entropy(logits.float(), labels.t().contiguous())
        return losses.t()  # [b, s]


def build_gpt_chunks(cfg: GPTConfig, seed: int = 1234) -> list[GPTModel]:
    """This rank's chunks of the model (one, or vpp under interleaving), tied embeddings synced.

    Needs `megacore.parallel_state.initialize_model_parallel` first.
    """
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    rank = parallel_state.get_pipeline_model_parallel_rank()
    chunks = []
    for v in range(vpp or 1):
        if vpp:
            parallel_state.set_virtual_pipeline_model_parallel_rank(v)
        layer_ids = pipeline_parallel.layers_for(cfg.num_layers, rank, pp, vpp, virtual_rank=v)
        chunks.append(
            GPTModel(
                cfg,
                layer_ids,
                pre_process=parallel_state.is_pipeline_first_stage(),
                post_process=parallel_state.is_pipeline_last_stage(),
                seed=seed,
            )
        )
    if vpp:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    pipeline_parallel.sync_shared_embeddings(chunks)
    return chunks


def num_parameters(cfg: GPTConfig) -> int:
    """Parameters of the whole model (tied embeddings counted once), from the config alone."""
    h, f, n = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_layers
    layer = 3 * h * h + 3 * h + h * h + h + h * f + f + f * h + h + 4 * h
    return n * layer + cfg.vocab_size * h + cfg.max_position_embeddings * h + 2 * h


def model_flops_per_iteration(
    cfg: GPTConfig, global_batch: int, seq_length: int, full_recompute: bool
) -> float:
    """The paper's count (DESIGN.md, MFU row): 72 B s l h^2 (1 + s/6h + V/12lh), or with full
    recomputation of each layer 96 B s l h^2 (1 + s/6h + V/16lh)."""
    b, s, n, h, v = global_batch, seq_length, cfg.num_layers, cfg.hidden_size, cfg.vocab_size
    if full_recompute:
        return 96 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))
    return 72 * b * s * n * h * h * (1 + s / (6 * h) + v / (12 * n * h))
