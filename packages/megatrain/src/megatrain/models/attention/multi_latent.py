"""Multi-latent attention (DeepSeek-V2/V3, Megatron-LM's MLA): the "mla" attention kind.

Per token: the queries from a low-rank latent (`q_lora_rank`: down-projection, its norm,
up-projection) or straight from the hidden state; one joint down-projection to the key/value
latent (`kv_lora_rank`) and a rope key (`qk_pos_emb_head_dim`, one a token, shared by every
head); the latent normalized and up-projected into each head's no-rope key (`qk_head_dim`)
and value (`v_head_dim`, which may differ).  The rope parts of the queries and the rope key
are rotated in DeepSeek's interleaved layout (`rope.apply_rope_interleaved`); the softmax
scale is 1 / sqrt(qk_head_dim + qk_pos_emb_head_dim) times YaRN's mscale^2 when the rotary
scaling sets mscale_all_dim (HF's DeepseekV3Attention).

Tensor parallelism, Megatron's way: the down-projections and their norms run whole on every
TP rank over the rank's own tokens (all of them; its part of the sequence under sequence
parallelism), so only the latents cross ranks (576 numbers a token for DeepSeek-V3 against
its 7,168-wide hidden state), entering the heads' region as a column-parallel linear's input
does (all-gathered under sequence parallelism, the gradient reduce-scattered; else its
gradient all-reduced).  Their weights are therefore marked `sequence_parallel` exactly when
sequence parallelism is on (each rank's gradient covers its tokens: summed over TP), as the
layers' norms are; without it every rank computes the same full gradient.  The up-projections
are column-parallel over heads, the output row-parallel.

`core(q, latent, k_rope, mask)` takes the gathered latent, not the keys and values: the
key/value up-projection runs inside it, so selective recompute keeps the latent [s, b,
kv_lora_rank] and recomputes the up-projected K and V (2 x heads x 192 numbers a token for
DeepSeek-V3).  Generation caches the latent and the rope key, as HF does.

Context parallelism: with `cp_comm_type` "p2p" or "allgather" the up-projected keys and values
go through megacore's context-parallel attention as the multi-head kind's do, the values
zero-padded to the QK head width there (megacore's kernels take K and V of one shape; the
padded columns give zero outputs, sliced off, and leave the scores and the log-sum-exp
merge untouched).  With "latent" (`latent_gather`) the latent and the rope key are gathered
instead, outside `core` as under TP, so selective recompute keeps the gathered latent and
gathers nothing again; the rope parts are rotated at each token's global position (the
batch's position_ids, made global before the CP split).
"""

import torch
import torch.nn.functional as F
from torch import nn

from megacore import tensor_parallel as tp
from megatrain.models.attention.core import attend
from megatrain.models.attention.inputs import AttentionInputs
from megatrain.models.attention.kv_cache import KVCache
from megatrain.models.attention.latent_gather import gather_latent
from megatrain.models.attention.rope import apply_rope_interleaved, rope_cos_sin, softmax_mscale
from megatrain.models.common import layer_norm
from megatrain.models.layout import ParallelContext
from megatrain.models.transformer_config import TransformerConfig


class ReplicatedLinear(nn.Module):
    """A linear whole on every TP rank, applied to the rank's own tokens before the heads
    split (MLA's down-projections).  Drawn whole from the layer's generator, as a
    column-parallel linear at tp 1 draws it; the weight (and bias) marked `sequence_parallel`
    when sequence parallelism splits the tokens over the ranks, so their gradients are summed
    over TP like the norms'."""

    def __init__(self, cfg: TransformerConfig, in_size: int, out_size: int, bias: bool, place):
        super().__init__()
        device, dtype = place["device"], place["params_dtype"]
        weight = torch.empty(out_size, in_size, device=device, dtype=dtype)
        if place["perform_initialization"]:  # fp32 on the CPU, as every weight is drawn
            master = torch.empty(out_size, in_size, dtype=torch.float32)
            tp.init_method_normal(cfg.init_method_std)(master, generator=place["generator"])
            weight.copy_(master)
        self.weight = nn.Parameter(weight)
        self.bias = (
            nn.Parameter(torch.zeros(out_size, device=device, dtype=dtype)) if bias else None
        )
        for p in self.parameters():
            p.sequence_parallel = cfg.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tp.linear(x, self.weight, self.bias, accumulate=True)


class MultiLatentAttention(nn.Module):
    """DeepSeek's multi-latent attention (the "mla" kind; the module docstring).  Parameters,
    in the order their weights are drawn: `q_a` (hidden -> q_lora_rank, replicated),
    `q_a_norm`, `q_b` (column-parallel, per head [no-rope, rope]), or `q` (hidden -> heads x
    (qk_head_dim + qk_pos_emb_head_dim), column-parallel) without q_lora_rank; `kv_a`
    (hidden -> [latent, rope key], replicated), `kv_a_norm`, `kv_b` (latent -> per head
    [no-rope key, value], column-parallel); `proj` (heads x v_head_dim -> hidden,
    row-parallel).  Biases (add_bias) where DeepSeek's attention_bias puts them: the
    down-projections and the output."""

    def __init__(self, cfg: TransformerConfig, place: dict, parallel: ParallelContext):
        super().__init__()
        h, sp = cfg.hidden_size, cfg.sequence_parallel
        self.cfg, self.tp_size = cfg, parallel.tp_size
        # The attention core as called; `parallelize.apply_recompute` swaps in a checkpointed one.
        self.core_attention = self.core
        self.context_parallel = None  # parallelize.apply_context_parallel sets it
        if cfg.qk_pos_emb_head_dim % 2:
            raise ValueError(
                f"model.qk_pos_emb_head_dim must be even (rotated in pairs), got "
                f"{cfg.qk_pos_emb_head_dim}"
            )
        heads = cfg.num_attention_heads
        self.heads_local = tp.divide_by_tp(heads, "num_attention_heads")
        self.nope, self.rope = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim
        self.v_dim, self.kv_rank = cfg.v_head_dim, cfg.kv_lora_rank
        self.q_dim = self.nope + self.rope
        # attend() scales by 1 / sqrt(q_dim), SDPA's default; YaRN's mscale^2 goes on the queries.
        self.q_scale = softmax_mscale(cfg.rope_scaling)
        std = cfg.init_method_std

        def column(in_size: int, out_size: int) -> tp.ColumnParallelLinear:
            return tp.ColumnParallelLinear(
                in_size, out_size, bias=False, sequence_parallel=sp,
                init_method=tp.init_method_normal(std), **place,
            )  # fmt: skip

        self.q_a = self.q_a_norm = self.q_b = self.q = None
        if cfg.q_lora_rank:
            self.q_a = ReplicatedLinear(cfg, h, cfg.q_lora_rank, cfg.add_bias, place)
            self.q_a_norm = self._latent_norm(cfg.q_lora_rank, place)
            self.q_b = column(cfg.q_lora_rank, heads * self.q_dim)
        else:
            self.q = column(h, heads * self.q_dim)
        self.kv_a = ReplicatedLinear(cfg, h, self.kv_rank + self.rope, cfg.add_bias, place)
        self.kv_a_norm = self._latent_norm(self.kv_rank, place)
        self.kv_b = column(self.kv_rank, heads * (self.nope + self.v_dim))
        self.proj = tp.RowParallelLinear(
            heads * self.v_dim,
            h,
            bias=cfg.add_bias,
            input_is_parallel=True,
            sequence_parallel=sp,
            skip_bias_add=True,  # added in bias_dropout_add
            init_method=tp.scaled_init_method_normal(std, cfg.num_layers),
            **place,
        )

    def _latent_norm(self, size: int, place: dict) -> nn.Module:
        # The model's normalization (RMSNorm for DeepSeek), before the heads split: its
        # gradient is partial exactly under sequence parallelism, as `layer_norm` marks it.
        return layer_norm(self.cfg, place["device"], place["params_dtype"], size=size)

    def up_project(self, latent: torch.Tensor, k_rope: torch.Tensor):
        """This rank's heads' keys [b, heads, s, qk_head_dim + rope] and values [b, heads, s,
        v_head_dim] from the normalized latent [s, b, kv_lora_rank] (already in the heads'
        region) and the rotated rope key [b, 1, s, rope], broadcast to every head."""
        s, b = latent.shape[:2]
        kv = tp.linear(latent, self.kv_b.weight, accumulate=True, float8=self.kv_b.float8)
        kv = kv.view(s, b, self.heads_local, self.nope + self.v_dim).permute(1, 2, 0, 3)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, self.heads_local, -1, -1)), dim=-1)
        return k, v

    def core(self, q, latent, k_rope, mask=None):
        """The key/value up-projection and the attention core (`attention.core.attend`): what
        `core_attention` calls, and what selective recompute runs again, keeping only its
        inputs (the latent, not the keys and values).  q [b, heads, s, qk_head_dim + rope].
        Under the "latent" comm type, latent and k_rope are the whole sequence's and `mask`
        the boolean mask of the keys each local query sees (`gather_latent`)."""
        k, v = self.up_project(latent, k_rope)
        cp = self.context_parallel
        gathered = cp is not None and cp.comm_type == "latent"
        # SDPA takes values narrower than the queries and keys on the CPU (the math kernel);
        # CUDA's flash and FlexAttention paths are sure to take them only at the QK width,
        # and megacore's context-parallel attention only at it: zero columns added there, and
        # sliced off the output (exact; a third more V bytes for DeepSeek-V3's 128 against 192).
        widen = q.is_cuda or (cp is not None and not gathered)
        pad = q.shape[-1] - self.v_dim if widen else 0
        if pad > 0:
            v = F.pad(v, (0, pad))
        if gathered:  # no dropout under CP (the config checks)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            out = attend(
                q, k, v, mask,
                causal=self.cfg.causal,
                dropout_p=self.cfg.attention_dropout if self.training else 0.0,
                tp_size=self.tp_size,
                context_parallel=cp,
            )  # fmt: skip
        return out[..., : self.v_dim] if pad > 0 else out

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | AttentionInputs | None = None,
        cache: KVCache | None = None,
        layer_id: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The projected output without its bias, and that bias (for bias_dropout_add).
        `mask`: the batch's `AttentionInputs` (positions, documents), or None."""
        if self.q is not None:
            q, _ = self.q(x)
        else:  # the column-parallel q_b gathers the query latent itself
            q, _ = self.q_b(self.q_a_norm(self.q_a(x)))
        s, b = q.shape[:2]
        q = q.view(s, b, self.heads_local, self.q_dim).permute(1, 2, 0, 3)
        latent, k_rope = self.kv_a(x).split([self.kv_rank, self.rope], dim=-1)
        # Into the heads' region as kv_b's input enters it (gathered under sequence
        # parallelism, the gradient reduced over TP): outside `core`, so recompute keeps
        # the gathered latent and gathers nothing again.
        latent = self.kv_b.parallel_input(self.kv_a_norm(latent))
        k_rope = self.kv_b.parallel_input(k_rope)
        k_rope = k_rope.view(s, b, 1, self.rope).permute(1, 2, 0, 3)
        inputs = mask if isinstance(mask, AttentionInputs) else None
        offset = cache.offset if cache is not None else 0
        cos, sin = rope_cos_sin(self.cfg, self.rope, s, offset, inputs, q.device, q.dtype)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        q = torch.cat((q_nope, apply_rope_interleaved(q_rope, cos, sin)), dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        k_rope = apply_rope_interleaved(k_rope, cos, sin)
        cp = self.context_parallel
        if cache is not None:
            out = self._attend_cached(q, latent, k_rope, cache, layer_id)
        elif cp is not None and cp.comm_type == "latent":
            latent, k_rope, visible = gather_latent(latent, k_rope, inputs, cp)
            out = self.core_attention(q, latent, k_rope, visible)
        else:
            out = self.core_attention(q, latent, k_rope, mask)
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.heads_local * self.v_dim)
        return self.proj(out)

    def _attend_cached(self, q, latent, k_rope, cache: KVCache, layer_id: int):
        """Generation: the latent [b, 1, s, kv_lora_rank] and the rotated rope key cached (not
        the up-projected keys and values), then every cached position up-projected and
        attended causally from the new queries at offset .. offset + s."""
        offset, s = cache.offset, q.shape[2]
        latent, k_rope = cache.append(layer_id, latent.permute(1, 0, 2).unsqueeze(1), k_rope)
        k, v = self.up_project(latent.squeeze(1).permute(1, 0, 2), k_rope)
        mask = torch.ones(s, offset + s, dtype=torch.bool, device=q.device).tril(offset)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
