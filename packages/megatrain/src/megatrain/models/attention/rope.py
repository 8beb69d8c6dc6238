"""Rotary position embeddings (HF's half-split convention, and DeepSeek's interleaved pairs),
the frequency scalings (Llama 3.1's, YaRN's), and the cos/sin tables a layer's positions pick
from."""

import math
from functools import lru_cache

import torch

from megatrain.models.transformer_config import YarnScaling


def rope_frequencies(
    head_dim: int, base: float, scaling: tuple[float, float, float, int] | YarnScaling | None
) -> torch.Tensor:
    """The rotary inverse frequencies [head_dim / 2] in fp32, as HF computes them; with
    `scaling` a `YarnScaling`, YaRN's (`yarn_frequencies`); a tuple (factor, low_freq_factor,
    high_freq_factor, original context), Llama 3.1's: wavelengths beyond the original context
    / low_freq_factor are stretched by `factor`, those below it / high_freq_factor kept, and
    those between interpolated."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if isinstance(scaling, YarnScaling):
        return yarn_frequencies(base**exponents, head_dim, base, scaling)
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


def yarn_frequencies(
    pos_freqs: torch.Tensor, dim: int, base: float, yarn: YarnScaling
) -> torch.Tensor:
    """YaRN's inverse frequencies from base^(2i/dim) (`pos_freqs`), as HF's
    `_compute_yarn_parameters` computes them, op for op (so equal to its bit for bit): the
    dimensions whose wavelength turns fewer than `beta_slow` times in the original context
    interpolated (frequency / factor), those turning more than `beta_fast` times kept, a
    linear ramp between the two correction dimensions."""
    context = yarn.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    interpolated, kept = 1.0 / (yarn.factor * pos_freqs), 1.0 / pos_freqs
    return interpolated * (1 - extrapolation) + kept * extrapolation


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 mscale ln(scale) + 1 (1 when scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(scaling) -> float:
    """What cos and sin are multiplied by (HF's `attention_scaling`): YaRN's attention factor,
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) with both set (DeepSeek's: 1 when
    equal), else mscale(factor) (gpt-oss: 1.347 at factor 32); 1 for the other scalings."""
    if not isinstance(scaling, YarnScaling):
        return 1.0
    if scaling.mscale and scaling.mscale_all_dim:
        scaled = yarn_mscale(scaling.factor, scaling.mscale)
        return float(scaled / yarn_mscale(scaling.factor, scaling.mscale_all_dim))
    return yarn_mscale(scaling.factor)


def softmax_mscale(scaling) -> float:
    """DeepSeek's factor on the softmax scale, mscale(factor, mscale_all_dim)^2 when YaRN sets
    mscale_all_dim (HF's `yarn_apply_mscale`, which its DeepSeek-family attention applies), 1
    otherwise."""
    if isinstance(scaling, YarnScaling) and scaling.mscale_all_dim:
        mscale = yarn_mscale(scaling.factor, scaling.mscale_all_dim)
        return mscale * mscale
    return 1.0


@lru_cache(maxsize=16)
def _rope_tables(head_dim, base, scaling, end, device, dtype):
    inv_freq = rope_frequencies(head_dim, base, scaling)
    positions = torch.arange(end, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    factor = rope_attention_factor(scaling)
    if factor != 1.0:  # HF scales the fp32 tables before the cast
        cos, sin = cos * factor, sin * factor
    return cos.to(device, dtype), sin.to(device, dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, s, d] rotated by the angles of its positions (cos, sin [s, d]): HF's
    half-split convention (the first half of each head pairs with the second)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., d] in DeepSeek's layout, dimensions (0, 1), (2, 3), ... each a pair rotated by
    one frequency, rotated and returned in the half-split layout (the evens, then the odds):
    what HF's `apply_rotary_pos_emb_interleave` returns and Megatron's MLA computes.  Queries
    and keys leave in the same layout, so their products are those of the pairs rotated in
    place (DeepSeek-V2's complex form)."""
    return apply_rope(torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1), cos, sin)


def rope_cos_sin(cfg, head_dim: int, s: int, offset: int, inputs, device, dtype):
    """The angles of a layer's `s` query/key positions for heads of `head_dim`: per token from
    `inputs.position_ids` [b, s] (packed documents, context parallelism; then [b, 1, s, d]
    against [b, heads, s, d]), else positions offset .. offset + s (generation continues
    after its cached `offset`); cos, sin.

    The tables cover the next power of two of positions: one or two cache entries for a run
    (not max_position_embeddings' worth: 128k positions for Llama 3.1)."""
    positions = inputs.position_ids if inputs is not None else None
    length = inputs.seq_len if positions is not None else offset + s
    end = 1 << (length - 1).bit_length()
    cos, sin = _rope_tables(head_dim, cfg.rotary_base, cfg.rope_scaling, end, device, dtype)
    if positions is not None:
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    return cos[offset : offset + s], sin[offset : offset + s]
