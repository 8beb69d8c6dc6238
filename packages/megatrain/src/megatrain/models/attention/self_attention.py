"""Multi-head and grouped-query self-attention (GPT-2, BERT, Llama, Qwen2/3, Mixtral): the
"mha" attention kind."""

import torch
from torch import nn

from megacore import tensor_parallel as tp
from megatrain.models.attention.core import attend, attend_cached
from megatrain.models.attention.inputs import AttentionInputs
from megatrain.models.attention.kv_cache import KVCache
from megatrain.models.attention.rope import apply_rope, rope_cos_sin
from megatrain.models.common import layer_norm
from megatrain.models.layout import ParallelContext
from megatrain.models.transformer_config import TransformerConfig


def head_norm(cfg: TransformerConfig, head_dim: int, place: dict) -> nn.Module:
    """The model's normalization over one head's `head_dim` (qk_layernorm), replicated on
    every TP rank and its gradient summed over TP (see SelfAttention)."""
    norm = layer_norm(cfg, place["device"], place["params_dtype"], size=head_dim)
    for p in norm.parameters():
        p.sequence_parallel = True
    return norm


def attention_sinks(cfg: TransformerConfig, place: dict, parallel: ParallelContext) -> nn.Parameter:
    """This rank's heads' sink logits [heads / tp] (gpt-oss's `sinks`), split over TP with the
    heads; drawn whole (normal, init_method_std) after the layer's other weights, so every
    layout holds one process's numbers and every other weight is drawn as without them."""
    heads, rank = cfg.num_attention_heads, parallel.tp_rank
    local = heads // parallel.tp_size
    sinks = torch.empty(local, device=place["device"], dtype=place["params_dtype"])
    if place["perform_initialization"]:
        master = torch.empty(heads, dtype=torch.float32)
        tp.init_method_normal(cfg.init_method_std)(master, generator=place["generator"])
        sinks.copy_(master[rank * local : (rank + 1) * local])
    sinks = nn.Parameter(sinks)
    tp.set_tensor_model_parallel_attributes(sinks, True, 0, 1)
    return sinks


class ReplicatedKV(nn.Module):
    """Grouped-query attention's key/value projection when there are fewer groups than TP
    ranks (tp a multiple of the groups): the whole [2 groups d, h] weight (per group [k v],
    as the column-parallel `kv`, so checkpoints reshard between the two) on every rank,
    which projects only the group of its query heads.  The ranks sharing a group each
    compute part of its gradient: the weight is marked `sequence_parallel`, so
    `sync_sequence_parallel_grads` sums it over TP like the other replicated parameters
    whose gradients are partial, and its input's gradient is summed as a column-parallel
    linear's is (all-reduce, or reduce-scatter under sequence parallelism)."""

    def __init__(self, cfg: "TransformerConfig", size: int, place: dict, parallel: ParallelContext):
        super().__init__()
        world, rank, groups = parallel.tp_size, parallel.tp_rank, cfg.num_query_groups
        if world % groups:
            raise ValueError(
                f"num_query_groups ({groups}) and tensor_model_parallel_size ({world}): one must "
                "divide the other (each TP rank holds whole key/value groups)"
            )
        rows = size // groups
        group = rank // (world // groups)
        self.rows = slice(group * rows, (group + 1) * rows)
        self.sequence_parallel = cfg.sequence_parallel and world > 1
        weight = torch.empty(
            size, cfg.hidden_size, device=place["device"], dtype=place["params_dtype"]
        )
        if place["perform_initialization"]:  # the full weight, drawn as `kv` draws it
            master = torch.empty(size, cfg.hidden_size, dtype=torch.float32)
            tp.init_method_normal(cfg.init_method_std)(master, generator=place["generator"])
            weight.copy_(master)
        self.weight = nn.Parameter(weight)
        self.weight.sequence_parallel = True  # partial on each rank: summed over TP
        self.bias = None
        if cfg.add_bias or cfg.add_qkv_bias:
            self.bias = nn.Parameter(
                torch.zeros(size, device=place["device"], dtype=place["params_dtype"])
            )
            self.bias.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            x = tp.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True)
        else:
            x = tp.copy_to_tensor_model_parallel_region(x)
        bias = None if self.bias is None else self.bias[self.rows]
        return tp.linear(x, self.weight[self.rows], bias), None


class SelfAttention(nn.Module):
    """Multi-head attention, and grouped-query attention when `num_query_groups` is fewer than
    the heads (the "mha" kind): heads split over TP ranks, QKV column-parallel laid out per
    head as [q k v]; with grouped-query attention the queries and the key/value groups are
    two column-parallel linears, `q` and `kv` (per group [k v]), and with fewer groups than
    TP ranks each rank holds its heads' group whole (`ReplicatedKV`); the projection
    row-parallel.  Optional per-head q/k normalization (Qwen3) and rotary positions."""

    def __init__(self, cfg: TransformerConfig, place: dict, parallel: ParallelContext):
        super().__init__()
        h, sp = cfg.hidden_size, cfg.sequence_parallel
        self.cfg, self.tp_size = cfg, parallel.tp_size
        # The attention core as called; `parallelize.apply_recompute` swaps in a checkpointed one.
        self.core_attention = self.core
        self.context_parallel = None  # parallelize.apply_context_parallel sets it
        self.heads_local = tp.divide_by_tp(cfg.num_attention_heads, "num_attention_heads")
        self.head_dim = cfg.kv_channels or tp.divide(
            h, cfg.num_attention_heads, "hidden_size", "num_attention_heads"
        )
        std = cfg.init_method_std
        groups, d = cfg.num_query_groups, self.head_dim
        width = cfg.num_attention_heads * d  # the queries' (and the projection's input) width

        def column(size: int) -> tp.ColumnParallelLinear:
            init = tp.init_method_normal(std)
            bias = cfg.add_bias or cfg.add_qkv_bias  # split with the columns, whole heads
            return tp.ColumnParallelLinear(
                h, size, bias=bias, sequence_parallel=sp, init_method=init, **place
            )

        if groups == cfg.num_attention_heads:
            self.groups_local = self.heads_local
            self.qkv = column(3 * width)
        else:  # grouped-query attention: the queries, then each group's key and value
            self.q = column(width)
            if groups % parallel.tp_size == 0:
                self.groups_local = groups // parallel.tp_size
                self.kv = column(2 * groups * d)
            else:  # fewer groups than TP ranks
                self.groups_local = 1
                self.kv = ReplicatedKV(cfg, 2 * groups * d, place, parallel)
        # Qwen3's q_norm and k_norm over each head (ones: no draw, so every other weight is
        # drawn as without them).  Every TP rank holds them whole but normalizes only its own
        # heads, so each rank's gradient is a part: marked `sequence_parallel`, which
        # `sync_sequence_parallel_grads` sums over TP (whether or not sequence parallelism is on).
        self.q_layernorm = self.k_layernorm = None
        if cfg.qk_layernorm:
            self.q_layernorm = head_norm(cfg, d, place)
            self.k_layernorm = head_norm(cfg, d, place)
        self.proj = tp.RowParallelLinear(
            width,
            h,
            bias=cfg.add_bias,
            input_is_parallel=True,
            sequence_parallel=sp,
            skip_bias_add=True,  # added in bias_dropout_add
            init_method=tp.scaled_init_method_normal(std, cfg.num_layers),
            **place,
        )
        self.window = cfg.window_size  # None on full layers (`spec.attention_for`)
        self.sinks = None  # gpt-oss's attention sinks: a logit per head
        if cfg.softmax_type == "learnable":
            self.sinks = attention_sinks(cfg, place, parallel)

    def core(self, q, k, v, mask=None):
        """The attention core (`attention.core.attend`) with this layer's settings; what
        `core_attention` calls unless selective recompute wraps it."""
        return attend(
            q, k, v, mask,
            causal=self.cfg.causal,
            dropout_p=self.cfg.attention_dropout if self.training else 0.0,
            tp_size=self.tp_size,
            context_parallel=self.context_parallel,
            window=self.window,
            sinks=self.sinks,
        )  # fmt: skip

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        layer_id: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The projected output without its bias, and that bias (for bias_dropout_add).
        `mask`: keys to attend [b, 1, 1, s] (True = attend), for bidirectional attention; or,
        causal, the batch's `AttentionInputs` (positions, documents)."""
        d = self.head_dim
        if hasattr(self, "qkv"):
            qkv, _ = self.qkv(x)
            s, b = qkv.shape[:2]
            # [s, b, heads, 3, d] -> three of [b, heads, s, d]
            q, k, v = qkv.view(s, b, self.heads_local, 3, d).permute(3, 1, 2, 0, 4)
        else:  # q [b, heads, s, d]; k, v [b, groups, s, d] from per group [k, v]
            q, _ = self.q(x)
            kv, _ = self.kv(x)
            s, b = q.shape[:2]
            q = q.view(s, b, self.heads_local, d).permute(1, 2, 0, 3)
            k, v = kv.view(s, b, self.groups_local, 2, d).permute(3, 1, 2, 0, 4)
        if self.q_layernorm is not None:  # over each head's d, before the rotary embedding
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if self.cfg.position_embedding == "rope":
            inputs = mask if isinstance(mask, AttentionInputs) else None
            offset = cache.offset if cache is not None else 0
            cos, sin = rope_cos_sin(self.cfg, d, s, offset, inputs, q.device, q.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            out = attend_cached(q, k, v, cache, layer_id, self.window, self.sinks)
        else:
            out = self.core_attention(q, k, v, mask)
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.heads_local * self.head_dim)
        return self.proj(out)
