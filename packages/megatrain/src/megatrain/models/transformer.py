"""The transformer GPT and BERT share, from megacore's tensor-parallel pieces.

One layer (`TransformerLayer`) and one language-model base (`LanguageModel`): word
embeddings split over the (padded) vocabulary and tied to the output layer, learned
positions, optional token types, the layers of one pipeline chunk, and the logits with
the padding rows of the vocabulary masked out.  What differs between the models is a
setting of `TransformerConfig`:

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

Attention heads are split over TP ranks (QKV column-parallel, laid out per head as [q k v];
with grouped-query attention the queries and the key/value groups are two column-parallel
linears, `q` and `kv` (per group [k v]), and with fewer groups than TP ranks each rank holds
its heads' group whole: `kv` is then replicated, each rank projects its group only, and the
ranks sharing a group sum its gradient; projection row-parallel); the MLP of ffn_hidden_size (4h)
is column- then row-parallel (SwiGLU: gate and up two column-parallel linears, so each is a
contiguous split that checkpoints reshard).  Activations are [sequence, batch,
hidden].  Every piece is drawn from its own CPU `torch.Generator` (word embeddings
`seed`, positions `seed - 1`, token types `seed - 2`, layer i `seed + 1 + i`; the
models' heads below that) at full size and then sliced, so any (tp, pp, vpp) layout
holds the same numbers as one process.  The parameters are allocated on their device in
their dtype and the slices copied there: drawing on the CPU keeps a GPU-built model equal
to a CPU-built one, and private generators leave the global ones (which dropout uses)
untouched, so building a model changes no random state.
"""

import math
from dataclasses import dataclass, field
from functools import lru_cache, partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from megacore import tensor_parallel as tp
from megacore.context_parallel import context_parallel_attention
from megatrain.config import BLOCK_ORDERS, RECOMPUTE_CHOICES, MoEConfig
from megatrain.models.moe import MoELayer, is_moe_layer
from megatrain.parallelize import ParallelContext

GELUS = {"tanh": "tanh", "erf": "none"}  # our name -> F.gelu's `approximate`


@dataclass
class AttentionInputs:
    """What every layer's causal attention needs of a batch beyond its activations, made once
    per forward (`LanguageModel.attention_inputs`) and handed down in the place of BERT's
    padding mask: the position of each token (rotary angles; None: 0, 1, ... in order), the
    document of each token (packed documents attend within their own; None: one sequence),
    and `seq_len`, the length of the whole sequence (the rotary table's size)."""

    position_ids: torch.Tensor | None = None  # [b, s] int64
    segments: torch.Tensor | None = None  # [b, s] int64
    seq_len: int = 0
    # FlexAttention's block mask of `segments`, made by the first layer that needs it and
    # shared by the others (the same documents in every layer).
    block_mask: object = None


def document_mask(segments: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s] boolean: query i sees key j when j <= i in the same document."""
    s = segments.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segments.device).tril()
    return causal & (segments[:, None, :, None] == segments[:, None, None, :])


@lru_cache(maxsize=4)
def _flex_attention(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


def document_block_mask(segments: torch.Tensor):
    """FlexAttention's block mask for causal attention within the documents of `segments`."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (segments[b, q_idx] == segments[b, kv_idx])

    b, s = segments.shape
    return create_block_mask(same_document_causal, b, None, s, s, device=segments.device)


def flex_document_attention(q, k, v, segments: torch.Tensor, compiled: bool = True, block=None):
    """Causal attention within documents by FlexAttention's block mask (`block`, else made
    from `segments`): blocks of keys that no query of a block may see (another document, or
    after it) are skipped, never an s x s mask.  `compiled=False` runs FlexAttention's eager
    reference (any device, slow: for tests)."""
    block = document_block_mask(segments) if block is None else block
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    return _flex_attention(compiled)(q, k, v, block_mask=block, **gqa)


@dataclass
class TransformerConfig(MoEConfig):
    """The model as built; the mixture-of-experts fields (`MoEConfig`, keyword-only) are the
    [model] section's, `models.moe.MoELayer` on the layers `moe_layer_freq` names."""

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
    # What `parallelize.build_chunks` applies to the built layers (`apply_recompute`) and what
    # HFU counts; the layers themselves do not read it.
    recompute: str = "none"  # none | selective | full
    distribute_saved_activations: bool = False
    sequence_parallel: bool = False
    # What `parallelize.build_chunks` applies to the built layers (`apply_tp_comm_overlap`):
    # sequence parallelism's collectives overlapped with the linears' GEMMs.
    tp_comm_overlap: bool = False
    block_order: str = "pre_ln"  # pre_ln | post_ln
    causal: bool = True
    gelu: str = "tanh"  # tanh | erf
    num_tokentypes: int = 0
    normalization: str = "layernorm"  # layernorm | rmsnorm
    position_embedding: str = "learned"  # learned | rope
    rotary_base: float = 10000.0
    # Llama 3.1's scaling: (factor, low_freq_factor, high_freq_factor, original context); None: off
    rope_scaling: tuple[float, float, float, int] | None = None
    swiglu: bool = False
    num_query_groups: int | None = None  # None: one key/value head per head
    add_bias: bool = True
    # Each head's width; None: hidden_size / num_attention_heads (Megatron's kv_channels).
    kv_channels: int | None = None
    # The model's normalization over each head of the queries and keys before RoPE (Qwen3).
    qk_layernorm: bool = False
    add_qkv_bias: bool = False  # biases on q, k, v even without add_bias (Qwen2)
    tie_output: bool = True
    # The output layer and the loss in one chunked op that never holds the [tokens, vocab]
    # logits (`tp.linear_vocab_parallel_cross_entropy`); GPT and Llama, when labels are given.
    fused_linear_cross_entropy: bool = False

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        for name, value, choices in (
            ("block_order", self.block_order, BLOCK_ORDERS),
            ("gelu", self.gelu, tuple(GELUS)),
            ("recompute", self.recompute, RECOMPUTE_CHOICES),
            ("normalization", self.normalization, ("layernorm", "rmsnorm")),
            ("position_embedding", self.position_embedding, ("learned", "rope")),
        ):
            if value not in choices:
                raise ValueError(f"model.{name} must be one of {choices}, not {value!r}")


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


class RMSNorm(nn.Module):
    """x / rms(x) x weight, computed in fp32 and cast back, as HF's Llama does (so a bf16
    model normalizes as its reference does)."""

    def __init__(self, size: int, eps: float, device=None, dtype=torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _layer_norm(
    cfg: TransformerConfig, device=None, dtype=torch.float32, size: int | None = None
) -> nn.Module:
    """The model's normalization over `size` (None: hidden_size)."""
    size = size or cfg.hidden_size
    if cfg.normalization == "rmsnorm":
        ln = RMSNorm(size, cfg.layernorm_epsilon, device=device, dtype=dtype)
    else:
        ln = nn.LayerNorm(size, eps=cfg.layernorm_epsilon, device=device, dtype=dtype)
    for p in ln.parameters():  # replicated; under sequence parallelism their grads are partial
        p.sequence_parallel = cfg.sequence_parallel
    return ln


def rope_frequencies(
    head_dim: int, base: float, scaling: tuple[float, float, float, int] | None
) -> torch.Tensor:
    """The rotary inverse frequencies [head_dim / 2] in fp32, as HF computes them; with
    `scaling` (factor, low_freq_factor, high_freq_factor, original context), Llama 3.1's:
    wavelengths beyond the original context / low_freq_factor are stretched by `factor`, those
    below it / high_freq_factor kept, and those between interpolated."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    if scaling is None:
        return inv_freq
    factor, low, high, context = scaling
    low_wavelen, high_wavelen = context / low, context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


@lru_cache(maxsize=16)
def _rope_tables(head_dim, base, scaling, end, device, dtype):
    inv_freq = rope_frequencies(head_dim, base, scaling)
    positions = torch.arange(end, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, s, d] rotated by the angles of its positions (cos, sin [s, d]): HF's
    half-split convention (the first half of each head pairs with the second)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _cpu_generator(seed: int) -> torch.Generator:
    """A private generator for one piece of the model: it draws what torch.manual_seed(seed)
    would make the default CPU generator draw, without touching the global state."""
    return torch.Generator(device="cpu").manual_seed(seed)


def _dropout(x: torch.Tensor, p: float, training: bool, sequence_parallel: bool) -> torch.Tensor:
    """Dropout of a replicated activation: one mask on every TP rank, or, when each rank holds
    other tokens (sequence parallelism), a mask of its own from the model-parallel stream."""
    if not (training and p):
        return x
    if sequence_parallel:
        with tp.get_rng_tracker().fork():
            return F.dropout(x, p, True)
    return F.dropout(x, p, True)


def bias_gelu(
    x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "tanh"
) -> torch.Tensor:
    """GeLU of x + bias: GPT-2's tanh approximation, or the exact one (`approximate="none"`,
    BERT's).

    The column-parallel fc1 leaves its bias out (`skip_bias_add`) so the add and the GeLU
    are one elementwise expression: one kernel under `training.compile`; in eager the add
    is a pass of its own, as in Megatron without its fusion (a plain function, not
    TorchScript: deprecated, and it fuses nothing on a CPU).  The same numbers as adding
    the bias in the linear, up to rounding.
    """
    return F.gelu(x if bias is None else x + bias, approximate=approximate)


def bias_dropout_add(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    p: float,
    training: bool,
    sequence_parallel: bool = False,
) -> torch.Tensor:
    """residual + dropout(x + bias): the end of each half of a block, Megatron's fused op.

    The row-parallel layers leave their bias out (`skip_bias_add`) so the bias, the dropout
    and the residual add are one elementwise expression (one kernel under `training.compile`).
    The dropout draws the same mask as `_dropout` would: the same generator, the same shape.
    """
    if bias is not None:
        x = x + bias
    return residual + _dropout(x, p, training, sequence_parallel)


def _placement(generator, device, dtype, initialize: bool = True) -> dict:
    """The keyword arguments that put a tensor-parallel layer's parameters in place: on
    `device` in `dtype`, drawn from `generator`, or left undrawn (`initialize=False`) when
    a checkpoint will overwrite them."""
    return {
        "generator": generator,
        "device": device,
        "params_dtype": dtype,
        "perform_initialization": initialize,
    }


def _layer_norm_in(cfg: TransformerConfig, place: dict) -> nn.LayerNorm:
    return _layer_norm(cfg, place["device"], place["params_dtype"])


def _head_norm(cfg: TransformerConfig, head_dim: int, place: dict) -> nn.Module:
    """The model's normalization over one head's `head_dim` (qk_layernorm), replicated on
    every TP rank and its gradient summed over TP (see ParallelAttention)."""
    norm = _layer_norm(cfg, place["device"], place["params_dtype"], size=head_dim)
    for p in norm.parameters():
        p.sequence_parallel = True
    return norm


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


class ParallelAttention(nn.Module):
    def __init__(self, cfg: TransformerConfig, place: dict, parallel: ParallelContext):
        super().__init__()
        h, sp = cfg.hidden_size, cfg.sequence_parallel
        self.cfg, self.tp_size = cfg, parallel.tp_size
        # The attention core as called; `parallelize.apply_recompute` swaps in a checkpointed one.
        self.core_attention = self._core
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
            self.q_layernorm = _head_norm(cfg, d, place)
            self.k_layernorm = _head_norm(cfg, d, place)
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

    def _core(self, q, k, v, mask=None):
        # The flash-eligible call (bf16/fp16 on CUDA) when causal: no attn_mask (is_causal
        # instead of a materialized s x s mask), 4-D [b, heads, s, d] inputs with head_dim
        # <= 256, and the last dimension of stride 1.  Flash takes the batch, head and
        # sequence strides as they come, so the permuted views of the QKV output need no
        # contiguous() copy.  Bidirectional: the key-padding mask [b, 1, 1, s] broadcasts.
        p = self.cfg.attention_dropout if self.training else 0.0
        causal = self.cfg.causal
        if isinstance(mask, AttentionInputs):  # causal; packed documents: within each
            inputs, segments, mask = mask, mask.segments, None
            cp = self.context_parallel
            if cp is not None:  # the sequence is split over CP ranks: attend over all of it
                positions = cp.positions(q.shape[2], q.device)
                return context_parallel_attention(
                    q, k, v, q_positions=positions, kv_positions=positions, segments=segments,
                    comm_type=cp.comm_type, group=cp.group,
                )  # fmt: skip
            if segments is not None:
                if q.is_cuda and not p:  # FlexAttention skips the masked blocks
                    if inputs.block_mask is None:
                        inputs.block_mask = document_block_mask(segments)
                    return flex_document_attention(q, k, v, segments, block=inputs.block_mask)
                mask, causal = document_mask(segments), False  # SDPA with the s x s mask
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        # No random numbers needed (so none need seeding, e.g. for evaluation); or one TP rank,
        # whose heads the default stream serves: no generator swap, which torch.compile cannot
        # trace (it would cut the compiled layer in three around the attention).
        if not p or self.tp_size == 1:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, **gqa
            )
        # Local heads: another mask on each TP rank.  Under sequence parallelism the layer's
        # caller has forked around the whole layer and this fork is a no-op (no swap).
        with tp.get_rng_tracker().fork():
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, **gqa
            )

    def _cached_core(self, q, k, v, cache: KVCache, layer_id: int):
        offset = cache.offset
        k, v = cache.append(layer_id, k, v)  # the local key/value heads: groups, not heads
        s = q.shape[2]
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        if offset == 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
        # Query i sits at position offset + i and sees keys up to there.
        mask = torch.ones(s, offset + s, dtype=torch.bool, device=q.device).tril(offset)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)

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
            offset = cache.offset if cache is not None else 0
            positions = mask.position_ids if isinstance(mask, AttentionInputs) else None
            cfg = self.cfg
            # Tables for the next power of two of positions: one or two cache entries for a
            # run (not max_position_embeddings' worth: 128k positions for Llama 3.1).
            length = mask.seq_len if positions is not None else offset + s
            end = 1 << (length - 1).bit_length()
            cos, sin = _rope_tables(
                self.head_dim, cfg.rotary_base, cfg.rope_scaling, end, q.device, q.dtype
            )
            if positions is not None:  # per token: [b, 1, s, d] against [b, heads, s, d]
                cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
            else:
                cos, sin = cos[offset : offset + s], sin[offset : offset + s]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            out = self._cached_core(q, k, v, cache, layer_id)
        else:
            out = self.core_attention(q, k, v, mask)
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.heads_local * self.head_dim)
        return self.proj(out)


class ParallelMLP(nn.Module):
    def __init__(self, cfg: TransformerConfig, place: dict):
        super().__init__()
        h, sp, std = cfg.hidden_size, cfg.sequence_parallel, cfg.init_method_std
        self.gelu = cfg.gelu
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
            return self.fc2(F.silu(gate) * up)
        hidden, bias = self.fc1(x)
        return self.fc2(bias_gelu(hidden, bias, GELUS[self.gelu]))


class TransformerLayer(nn.Module):
    """One block, its parameters placed by `place` (`_placement`); its weights are drawn
    from the placement's generator in order (qkv, or q and kv; proj; gate; fc1; fc2; on a
    MoE layer the MLP is `MoELayer`, drawn as it says).
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
        self.ln1 = _layer_norm_in(cfg, place)
        parallel = parallel or ParallelContext.from_process_groups()
        self.attention = ParallelAttention(cfg, place, parallel)
        self.ln2 = _layer_norm_in(cfg, place)
        # The routed experts on the MoE layers (`layer_number`: the model's 0-based layer id).
        if is_moe_layer(cfg, layer_number):
            self.mlp = MoELayer(cfg, place, parallel)
        else:
            self.mlp = ParallelMLP(cfg, place)

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

    Built directly on `device` in `dtype`; a last stage's copy of the tied word
    embeddings is zero until `parallelize.build_chunks` syncs it.  `initialize=False` skips drawing
    the weights (their values are whatever the memory held), for a model a checkpoint
    is about to overwrite."""

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
                self.embedding_layernorm = _layer_norm(cfg, device, dtype)
                for p in self.embedding_layernorm.parameters():
                    p.sequence_parallel = False  # before the scatter: every rank sees all tokens
        self.layer_ids = list(range(cfg.num_layers) if layer_ids is None else layer_ids)
        self.layers = nn.ModuleDict(
            {
                str(i): TransformerLayer(
                    cfg,
                    _placement(_cpu_generator(seed + 1 + i), device, dtype, initialize),
                    self.parallel,
                    layer_number=i,
                )
                for i in self.layer_ids
            }
        )
        self.output_weight = None
        if post_process:
            if cfg.block_order == "pre_ln":
                self.final_layernorm = _layer_norm(cfg, device, dtype)
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
            elif not pre_process:  # a copy on the last stage, kept equal by pipeline_parallel
                rows = tp.divide_by_tp(cfg.vocab_size, "vocab_size")
                self.output_weight = nn.Parameter(
                    torch.zeros(rows, cfg.hidden_size, device=device, dtype=dtype)
                )
                tp.set_tensor_model_parallel_attributes(self.output_weight, True, 0)
                self.output_weight.shared_embedding = True
        if pre_process and not post_process and cfg.tie_output:
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
            tp.init_method_normal(self.config.init_method_std)(full, generator=_cpu_generator(seed))
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
        init(full[:rows], generator=_cpu_generator(seed))
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
        x = x.transpose(0, 1).contiguous()  # [s, b, h]
        if cfg.sequence_parallel:
            x = tp.scatter_to_sequence_parallel_region(x)
        return _dropout(x, cfg.hidden_dropout, self.training, cfg.sequence_parallel)

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
        for i, layer in self.layers.items():
            call = self.in_rank_stream(layer)
            if self.checkpointed_layer is not None and self.training:
                x = self.checkpointed_layer(call, x, mask)
            elif cache is None:
                # No layer id when there is no cache to key: under training.compile one
                # compiled graph then serves every layer (an id would recompile per layer).
                x = call(x, mask)
            else:
                x = layer(x, mask, cache, int(i))
        if self.post_process and self.config.block_order == "pre_ln":
            x = self.final_layernorm(x)
        return x

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
