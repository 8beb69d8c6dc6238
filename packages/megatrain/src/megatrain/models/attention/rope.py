"""Rotary position embeddings (HF's half-split convention), Llama 3.1's frequency scaling, and
the cos/sin tables a layer's positions pick from."""

import math
from functools import lru_cache

import torch


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
